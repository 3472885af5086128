"""Library function behind ``fedsec defend``: the privacy–utility trade-off of one defense.

For each value of the defense (plus, by default, a no-defense baseline) it

1. trains the federation with the defense in place (``train/``: metrics.csv, summary.json, and
   ``defense.json``: the DP report — ε per client and the maximum — or the filters' log summary);
2. runs each requested attack on a fresh federation with the same defense (``attack-<name>/``, the
   ``fedsec attack`` harness: round 0; DLG/IG in the textbook victim setting — each attacked
   client trains ``victim_steps`` step(s) on ``victim_batch`` image(s) — and the label attack on
   the method's real local training);
3. writes ``done.json`` last (the value's row); a rerun skips values that have one, and inside an
   unfinished value skips the parts whose ``summary.json`` exists.

After every value ``tradeoff.csv`` (one row per finished value), ``tradeoff.png`` (accuracy
against mean PSNR per attack, and against ε for DP) and ``tradeoff.md`` (a Markdown section a
report can include) are rewritten atomically. ``defend.json`` at the top holds the settings; a
rerun with different settings (other than the list of values and the thread count) is an error.

Defense values:

* ``dp``: noise multiplier σ of DP-SGD (``--max-grad-norm`` C, ``--delta``); ε is the maximum
  over clients of the cumulative ε of the training run (``fedsec.defenses.dp``);
* ``noise``: the *variance* v of Gaussian noise on the gradient the server reads from an update,
  g = −Δ/lr (the DLG paper's unit): the filter adds N(0, (lr·√v)²) to every entry of Δ;
* ``clip``: bound C on the L2 norm of Δ (all model weights jointly);
* ``prune``: percentage p of the entries of Δ zeroed (smallest |Δ| first);
* ``quantize``: bits k (2^k levels per tensor);
* ``exclude``: a field kind (``prototype``, ``class_counts``, ``statistic``, ``classifier``, ...)
  or an fnmatch pattern of field names (``prototype.*``) dropped from every upload.

Filters act on model weights (kinds extractor/classifier); Δ as defined in
``fedsec.defenses.filters``. A filter gives no formal guarantee: its ε column is empty.
"""
from __future__ import annotations

import fnmatch
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from attacks import GRADIENT_ATTACKS
from attacks.base import Budget
from fedecouple.channel import ServerChannel
from fedecouple.errors import UserError
from fedecouple.methods import METHODS
from fedecouple.methods.base import KINDS
from fedecouple.models import build_model, default_architecture

from . import io, runner
from .attack import DEFAULT_ITERATIONS, gradient_free_message, run_attack
from .defenses.dp import PER_SAMPLE, DPConfig, DPMethod, privacy_report
from .defenses.filters import Exclude, FilterChain, GaussianNoise, NormClip, Prune, Quantize
from .runner import RunConfig

DEFENSES = ("dp", "noise", "clip", "prune", "quantize", "exclude")
DEFEND_ATTACKS = ("dlg", "idlg", "ig", "labels", "proto")
IMAGE_ATTACKS = ("dlg", "idlg", "ig", "proto")
BASELINE = "none"
DEFEATED_MARGIN_DB = 3.0  # "defeated": mean PSNR within this many dB of the prior baseline
COLUMNS = ["defense", "value", "accuracy", "accuracy_std", "epsilon", "epsilon_attacked"]
VALUE_MEANING = {
    "dp": "noise multiplier σ of DP-SGD",
    "noise": "variance v of the noise on the gradient −Δ/lr (σ on Δ = lr·√v)",
    "clip": "bound on the L2 norm of Δ",
    "prune": "percent of the entries of Δ zeroed (smallest |Δ| first)",
    "quantize": "bits per entry of Δ (2^k levels per tensor)",
    "exclude": "field kind or name pattern dropped from every upload",
}
# settings that never change a result: a rerun may differ in them
_IRRELEVANT = ("threads", "data_dir", "download")


@dataclass
class DefendSettings:
    defense: str
    values: list
    attacks: list[str] = field(default_factory=lambda: ["dlg", "ig", "labels"])
    baseline: bool = True
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    targets: int = 2
    iterations: int | None = None
    victim_batch: int = 1
    victim_steps: int = 1
    attack_seed: int | None = None

    def key(self, config: RunConfig) -> dict:
        """What must match between a rerun and the stored sweep (everything but values and threads)."""
        cfg = {k: v for k, v in json.loads(json.dumps(config.to_dict())).items() if k not in _IRRELEVANT}
        mine = json.loads(json.dumps({k: v for k, v in asdict(self).items() if k != "values"}))
        return {"config": cfg, "settings": mine}


# ---------------------------------------------------------------------------------------------
# parsing and validation


def parse_attacks(text: str | list[str]) -> list[str]:
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not items:
        raise UserError("--attacks needs at least one attack (comma-separated)")
    unknown = [a for a in items if a not in DEFEND_ATTACKS]
    if unknown:
        raise UserError(f"unknown attack {', '.join(unknown)}; choose from: {', '.join(DEFEND_ATTACKS)}")
    return list(dict.fromkeys(items))


def parse_values(defense: str, text: str | list) -> list:
    if defense not in DEFENSES:
        raise UserError(f"unknown defense {defense!r}; choose one of: {', '.join(DEFENSES)}")
    items = [str(t).strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    if not items:
        raise UserError("--values needs at least one value (comma-separated)")
    if defense == "exclude":
        return list(dict.fromkeys(items))
    out = []
    for item in items:
        try:
            value = int(item) if defense == "quantize" else float(item)
        except ValueError:
            kind = "an integer" if defense == "quantize" else "a number"
            raise UserError(f"--values for {defense} must be comma-separated numbers; {item!r} is not {kind}") from None
        if not math.isfinite(value):
            raise UserError(f"--values for {defense} must be finite, got {item!r}")
        if defense in ("dp", "noise") and value < 0:
            raise UserError(f"--values for {defense} ({VALUE_MEANING[defense]}) must be >= 0, got {item}")
        if defense == "clip" and value <= 0:
            raise UserError(f"--values for clip (a norm bound) must be positive, got {item}")
        if defense == "prune" and not 0 <= value <= 100:
            raise UserError(f"--values for prune are percentages in [0, 100], got {item}")
        if defense == "quantize" and not 1 <= value <= 32:
            raise UserError(f"--values for quantize are bits in 1..32, got {item}")
        out.append(value)
    return list(dict.fromkeys(out))


def value_slug(value) -> str:
    text = str(value)
    safe = "".join(ch if ch.isalnum() or ch in ".-_" else "_" for ch in text)
    return f"value-{safe}"


def make_filter(defense: str, value, config: RunConfig):
    if defense == "noise":
        return GaussianNoise(sigma=config.lr * math.sqrt(float(value)))
    if defense == "clip":
        return NormClip(float(value))
    if defense == "prune":
        return Prune(float(value))
    if defense == "quantize":
        return Quantize(int(value))
    if defense == "exclude":
        return Exclude(kinds=[value]) if value in KINDS else Exclude(fields=[value])
    raise ValueError(defense)


def make_chain(defense: str, value, config: RunConfig) -> FilterChain:
    persistent = getattr(METHODS[config.method], "persistent_groups", ())
    return FilterChain([make_filter(defense, value, config)], persistent, manifest=None, seed=config.seed)


def dp_config(settings: DefendSettings, value) -> DPConfig:
    return DPConfig(noise_multiplier=float(value), max_grad_norm=settings.max_grad_norm, delta=settings.delta,
                    accountant=settings.accountant)


def validate(config: RunConfig, settings: DefendSettings) -> None:
    """Every check that can fail before anything runs (bad values, refused DP, missing fields)."""
    prep = runner.prepare(config)
    config.federation_config().validate(config.clients)
    ds = prep.dataset
    model = build_model(config.arch or default_architecture(ds.channels, ds.image_size), ds.channels,
                        ds.image_size, ds.num_classes, ds.mean, ds.std)
    if not getattr(prep.method, "communicates", True):
        raise UserError(f"{config.method} never communicates: there is no upload to defend or attack")
    if settings.targets < 1:
        raise UserError(f"--targets must be at least 1, got {settings.targets}")
    if settings.iterations is not None and settings.iterations < 1:
        raise UserError(f"--iterations must be at least 1, got {settings.iterations}")
    if settings.victim_batch < 1 or settings.victim_steps < 1:
        raise UserError("--victim-batch and --victim-steps must be at least 1")
    for attack in settings.attacks:
        if attack in GRADIENT_ATTACKS:
            message = gradient_free_message(prep.method, attack, model)
            if message is not None:
                raise UserError(message)
    if settings.defense == "dp":
        for v in settings.values:
            DPMethod(prep.method, dp_config(settings, v))  # refuses what DP-SGD cannot cover
        return
    manifest = prep.method.manifest(model)
    for v in settings.values:
        make_chain(settings.defense, v, config)
        if settings.defense == "exclude":
            names = [spec.name.format(k=0) if spec.per_class else spec.name for spec in manifest]
            if v in KINDS:
                if not any(spec.kind == v for spec in manifest):
                    raise UserError(f"{config.method} uploads no field of kind {v!r}; its kinds: "
                                    f"{', '.join(sorted({s.kind for s in manifest}))}")
            elif not any(fnmatch.fnmatchcase(n, v) for n in names):
                raise UserError(f"--values {v!r} matches no field {config.method} uploads (fields: "
                                f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}; or a kind: "
                                f"{', '.join(KINDS)})")
        elif not any(spec.kind in ("extractor", "classifier") for spec in manifest):
            raise UserError(f"{config.method} uploads no model weights: the {settings.defense} filter (on the update "
                            f"Δ of the weights) has nothing to act on; use --defense exclude")


# ---------------------------------------------------------------------------------------------
# one value


def _train(config: RunConfig, settings: DefendSettings, value, out: Path) -> dict:
    """Train with the defense; metrics.csv, summary.json, defense.json in ``out``."""
    if (out / "summary.json").exists() and (out / "defense.json").exists():
        summary = io.read_json(out / "summary.json")
        if int(summary.get("rounds", -1)) >= config.rounds:
            return {**summary, "defense": io.read_json(out / "defense.json")}
    prep = runner.prepare(config)
    chain, dp = None, None
    if settings.defense == "dp" and value != BASELINE:
        dp = dp_config(settings, value)
        prep = replace(prep, method=DPMethod(prep.method, dp))
    elif value != BASELINE:
        chain = make_chain(settings.defense, value, config)
    fed = runner.build_federation(prep, channel=ServerChannel([chain] if chain else []))
    start = time.perf_counter()
    try:
        fed.run(config.rounds)
    except KeyError as exc:
        if settings.defense == "exclude":
            raise UserError(f"{config.method}'s server cannot aggregate without field {exc.args[0]!r}: "
                            f"excluding {value!r} breaks the method's protocol") from None
        raise
    finally:
        fed.close()  # e.g. shut down the Ray this run started
    summary = runner.write_metrics(out, fed, config, time.perf_counter() - start)
    if dp is not None:
        defense = {"kind": "dp", **privacy_report(fed.clients, dp)}
    elif chain is not None:
        defense = {"kind": "filter", "filters": chain.summary()}
    else:
        defense = {"kind": "none"}
    defense = io.finite(defense)
    io.write_json(out / "defense.json", defense)
    return {**summary, "defense": defense}


def _attack(config: RunConfig, settings: DefendSettings, value, attack: str, out: Path) -> dict:
    if (out / "summary.json").exists():
        return io.read_json(out / "summary.json")
    chain, dp = [], None
    if settings.defense == "dp" and value != BASELINE:
        dp = dp_config(settings, value)
    elif value != BASELINE:
        chain = [make_chain(settings.defense, value, config)]
    iterations = settings.iterations if settings.iterations is not None else DEFAULT_ITERATIONS[attack]
    victim = settings.victim_batch if attack in ("dlg", "idlg", "ig") else 0
    return run_attack(config, attack, (0,), targets=settings.targets, budget=Budget(iterations=iterations),
                      victim_batch=victim, victim_steps=settings.victim_steps, seed=settings.attack_seed, out=out,
                      progress=False, interceptors=chain, dp=dp)



def _num(x) -> float:
    return float("nan") if x is None else float(x)


def run_value(config: RunConfig, settings: DefendSettings, value, out: Path,
              on_part: Callable[[str], None] | None = None) -> dict:
    """Train, attack and score one value; returns its row (also written to ``done.json``)."""
    start = time.perf_counter()
    if on_part:
        on_part("train")
    trained = _train(config, settings, value, out / "train")
    row = {"defense": BASELINE if value == BASELINE else settings.defense, "value": value,
           "accuracy": _num(trained.get("mean_accuracy")), "accuracy_std": _num(trained.get("std_accuracy"))}
    defense = trained["defense"]
    row["epsilon"] = (math.inf if defense.get("epsilon_max") is None else float(defense["epsilon_max"])) \
        if defense.get("kind") == "dp" else float("nan")
    row["epsilon_attacked"] = float("nan")
    priors, notes = [], []
    for attack in settings.attacks:
        if on_part:
            on_part(attack)
        summary = _attack(config, settings, value, attack, out / f"attack-{attack}")
        if attack in IMAGE_ATTACKS:
            row[f"mean_psnr_{attack}"] = _num(summary.get("mean_psnr"))
            row[f"max_psnr_{attack}"] = _num(summary.get("max_psnr"))
            if summary.get("mean_prior_psnr") is not None:
                priors.append(float(summary["mean_prior_psnr"]))
        if attack == "labels":
            row["label_accuracy"] = _num(summary.get("label_accuracy"))
        dp = summary.get("dp")
        if dp is not None:  # ε of the attacked clients (not of the others in that run)
            targets = [str(c) for cs in (summary.get("targets") or {}).values() for c in cs]
            per_client = dp.get("epsilon_per_client") or {}
            for c in targets or list(per_client):
                eps = math.inf if per_client.get(c) is None else float(per_client[c])
                row["epsilon_attacked"] = eps if math.isnan(row["epsilon_attacked"]) else max(row["epsilon_attacked"], eps)
        if not summary.get("images_scored") and attack in IMAGE_ATTACKS:
            notes.extend(summary.get("notes", [])[:2])
    row["prior_psnr"] = float(np.mean(priors)) if priors else float("nan")
    if "labels" in settings.attacks and "label_accuracy" not in row:
        row["label_accuracy"] = float("nan")
    row["seconds"] = round(time.perf_counter() - start, 1)
    if notes:
        row["notes"] = "; ".join(dict.fromkeys(notes))
    return row


# ---------------------------------------------------------------------------------------------
# outputs


def tradeoff_frame(rows: list[dict], settings: DefendSettings) -> pd.DataFrame:
    columns = list(COLUMNS)
    for a in settings.attacks:
        if a in IMAGE_ATTACKS:
            columns.append(f"mean_psnr_{a}")
    columns.append("prior_psnr")
    if "labels" in settings.attacks:
        columns.append("label_accuracy")
    for a in settings.attacks:
        if a in IMAGE_ATTACKS:
            columns.append(f"max_psnr_{a}")
    columns.append("seconds")
    return pd.DataFrame(rows, columns=columns)


def _fmt(x, digits=2, pct=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    return f"{100 * x:.1f}" if pct else f"{x:.{digits}f}"


def _fmt_eps(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(float(x)):
        return "∞"
    return f"{float(x):.3g}"


def claim_check(frame: pd.DataFrame, settings: DefendSettings) -> str | None:
    """For noise and prune with DLG: where the DLG paper's claim (REFERENCE §4) lands here."""
    if settings.defense not in ("noise", "prune") or "dlg" not in settings.attacks:
        return None
    sub = frame[frame["defense"] == settings.defense].copy()
    if sub.empty:
        return None
    sub["gap"] = sub["mean_psnr_dlg"] - sub["prior_psnr"]
    sub = sub.sort_values("value")
    defeated = sub[sub["gap"] < DEFEATED_MARGIN_DB]
    base = frame[frame["defense"] == BASELINE]
    base_gap = float(base["mean_psnr_dlg"].iloc[0] - base["prior_psnr"].iloc[0]) if not base.empty else float("nan")
    threshold, unit = (1e-2, "variance") if settings.defense == "noise" else (20.0, "% pruned")
    claim = ("the DLG paper: Gaussian noise of variance ≥ 1e-2 defeats DLG" if settings.defense == "noise"
             else "the DLG paper: pruning more than 20 % of the gradient defeats DLG")
    lines = [f"**DLG claim check** ({claim}; 'defeated' here = mean DLG PSNR within {DEFEATED_MARGIN_DB:g} dB of the "
             f"prior baseline). Without defense DLG is {_fmt(base_gap)} dB above the prior."]
    if defeated.empty:
        lines.append(f"No value tried defeats DLG here (largest tried: {sub['value'].max():g} {unit}).")
        return " ".join(lines)
    first = float(defeated["value"].iloc[0])
    beyond = sub[sub["value"] >= threshold] if settings.defense == "noise" else sub[sub["value"] > threshold]
    lines.append(f"The smallest value tried that defeats it is {first:g} {unit}.")
    if beyond.empty:
        lines.append(f"No value at or beyond the claim's threshold ({threshold:g} {unit}) was tried.")
    elif bool((beyond["gap"] < DEFEATED_MARGIN_DB).all()):
        lines.append(f"Every value tried at or beyond the claim's threshold ({threshold:g} {unit}) defeats DLG: "
                     f"the claim holds here.")
    else:
        missed = beyond[beyond["gap"] >= DEFEATED_MARGIN_DB]["value"]
        lines.append(f"At {', '.join(f'{v:g}' for v in missed)} {unit} (at or beyond the claim's threshold "
                     f"{threshold:g}) DLG is still more than {DEFEATED_MARGIN_DB:g} dB above the prior: the claim does "
                     f"not hold here.")
    gaps = sub["gap"].tolist()
    if any(gaps[i + 1] > gaps[i] + 1.0 for i in range(len(gaps) - 1)):
        lines.append("The PSNR does not fall monotonically with the value (rises by more than 1 dB somewhere).")
    return " ".join(lines)


def write_plot(path: Path, frame: pd.DataFrame, settings: DefendSettings, config: RunConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image = [a for a in settings.attacks if a in IMAGE_ATTACKS]
    show_eps = settings.defense == "dp"
    fig, axes = plt.subplots(1, 2 if show_eps else 1, figsize=(10 if show_eps else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    markers = {"dlg": "o", "idlg": "v", "ig": "s", "proto": "^"}
    for a in image:
        col = f"mean_psnr_{a}"
        ok = frame[col].notna()
        ax.plot(frame.loc[ok, col], frame.loc[ok, "accuracy"] * 100, marker=markers.get(a, "o"), linestyle="-",
                label=a.upper())
        for _, r in frame[ok].iterrows():
            ax.annotate(str(r["value"]), (r[col], r["accuracy"] * 100), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    prior = frame["prior_psnr"].dropna()
    if len(prior):
        ax.axvline(float(prior.mean()), color="grey", linestyle="--", label="prior baseline")
    ax.set_xlabel("mean PSNR of reconstructions (dB)  ← more private")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title(f"{settings.defense} on {config.method}: accuracy vs leakage", fontsize=9)
    if image or len(prior):
        ax.legend(fontsize=7)
    if show_eps:
        ax = axes[0][1]
        sub = frame[(frame["defense"] == "dp") & np.isfinite(frame["epsilon"].astype(float))
                    & (frame["epsilon"].astype(float) > 0)]
        ax.plot(sub["epsilon"], sub["accuracy"] * 100, marker="o")
        for _, r in sub.iterrows():
            ax.annotate(f"σ={r['value']}", (r["epsilon"], r["accuracy"] * 100), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        base = frame[frame["defense"] == BASELINE]
        if not base.empty:
            ax.axhline(float(base["accuracy"].iloc[0]) * 100, color="grey", linestyle="--", label="no defense")
            ax.legend(fontsize=7)
        if len(sub):
            ax.set_xscale("log")
        ax.set_xlabel(f"ε (max over clients, δ={settings.delta:g})  ← more private")
        ax.set_ylabel("mean client test accuracy (%)")
        ax.set_title("accuracy vs formal privacy", fontsize=9)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def markdown(frame: pd.DataFrame, settings: DefendSettings, config: RunConfig, command: str | None) -> str:
    image = [a for a in settings.attacks if a in IMAGE_ATTACKS]
    head = ["value", "accuracy (%)"]
    if settings.defense == "dp":
        head += [f"ε train (δ={settings.delta:g})", "ε attacked client"]
    head += [f"{a.upper()} PSNR (dB)" for a in image] + (["prior PSNR (dB)"] if image else [])
    if "labels" in settings.attacks:
        head.append("label acc.")
    lines = [f"## Defense: {settings.defense} on {config.method} ({config.dataset})", ""]
    lines.append(f"Value = {VALUE_MEANING[settings.defense]}. Each value: train {config.rounds} rounds × "
                 f"{config.clients} clients ({config.partition}, {config.local_epochs} local epoch(s), lr {config.lr:g}, "
                 f"batch {config.batch_size}, seed {config.seed}) with the defense, then attack round 0 of a fresh run "
                 f"with the same defense ({settings.targets} targets; DLG/IG: each target trains "
                 f"{settings.victim_steps} step(s) on {settings.victim_batch} image(s)).")
    lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for _, r in frame.iterrows():
        cells = [str(r["value"]), f"{_fmt(r['accuracy'], pct=True)} ± {_fmt(r['accuracy_std'], pct=True)}"]
        if settings.defense == "dp":
            cells += [_fmt_eps(r["epsilon"]), _fmt_eps(r["epsilon_attacked"])]
        cells += [_fmt(r[f"mean_psnr_{a}"]) for a in image] + ([_fmt(r["prior_psnr"])] if image else [])
        if "labels" in settings.attacks:
            cells.append(_fmt(r.get("label_accuracy")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![privacy–utility trade-off](tradeoff.png)", ""]
    if settings.defense == "dp":
        lines.append(f"DP-SGD (Opacus): per-sample clipping to C = {settings.max_grad_norm:g}, Poisson batches "
                     f"(q = batch size / client samples), one {settings.accountant.upper()} accountant per client kept "
                     f"across rounds; ε = the maximum over clients of the cumulative ε of the training run. "
                     f"'ε attacked client' is the victim run's (q = 1, {settings.victim_steps} step(s)). "
                     f"Per-sample terms of {config.method}: {PER_SAMPLE.get(config.method, 'n/a')}")
    else:
        lines.append("Channel filter on the client's update Δ (upload − download; for a kept personal classifier, "
                     "upload − the client's previous upload); no formal guarantee, so no ε.")
    check = claim_check(frame, settings)
    if check:
        lines += ["", check]
    if "notes" in frame.columns:
        for _, r in frame.iterrows():
            if isinstance(r.get("notes"), str) and r["notes"]:
                lines.append(f"- value {r['value']}: {r['notes']}")
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the sweep


def defend(config: RunConfig, settings: DefendSettings, out: str | Path, progress: bool = True,
           on_value: Callable[[dict], None] | None = None, command: str | None = None) -> pd.DataFrame:
    """Run the sweep into ``out`` (resumable); returns the trade-off frame."""
    from tqdm import tqdm

    settings.values = parse_values(settings.defense, settings.values)
    settings.attacks = parse_attacks(settings.attacks)
    validate(config, settings)
    out = Path(out)
    key = settings.key(config)
    stored = out / "defend.json"
    if stored.exists():
        try:
            previous = io.read_json(stored)
        except (ValueError, OSError):
            previous = None
        if previous is None or previous.get("key") != key:
            raise UserError(f"{out} holds a defend sweep with different settings; use another --out or remove it")
    io.write_json(stored, {"key": key, "values": [str(v) for v in settings.values]})

    plan = ([BASELINE] if settings.baseline else []) + list(settings.values)
    rows: list[dict] = []
    bar = tqdm(plan, desc=f"defend {settings.defense} on {config.method}", unit="value", disable=not progress)
    try:
        for value in bar:
            path = out / ("baseline" if value == BASELINE else value_slug(value))
            done = path / "done.json"
            if done.exists():
                record = io.read_json(done)
                if record.get("key") != key:
                    raise UserError(f"{path} was computed with different settings; use another --out or remove it")
                row = {k: (float("nan") if v is None else v) for k, v in record["row"].items()}
                if row.get("epsilon") == "inf":
                    row["epsilon"] = math.inf
            else:
                row = run_value(config, settings, value, path,
                                on_part=lambda part, v=value: bar.set_postfix_str(f"{v}: {part}"))
                stored_row = {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in row.items()}
                io.write_json(done, {"key": key, "row": io.finite(stored_row)})
            for k in ("epsilon", "epsilon_attacked"):
                if row.get(k) == "inf":
                    row[k] = math.inf
            rows.append(row)
            frame = tradeoff_frame(rows, settings)
            if any("notes" in r for r in rows):
                frame["notes"] = [r.get("notes", "") for r in rows]
            io.write_csv(out / "tradeoff.csv", frame)
            write_plot(out / "tradeoff.png", frame, settings, config)
            io.write_text(out / "tradeoff.md", markdown(frame, settings, config, command))
            if on_value is not None:
                on_value(row)
    finally:
        bar.close()
    return tradeoff_frame(rows, settings)
