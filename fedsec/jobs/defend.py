"""Library function behind ``fedsec defend``: the privacy–utility trade-off of one defense.

For each value of the defense (plus, by default, a no-defense baseline) it

1. trains the federation with the defense in place (``train/``: metrics.csv, summary.json, and
   ``defense.json``: the DP report — ε per client and the maximum — or the filters' log summary);
2. runs each requested attack on a fresh federation with the same defense (``attack-<name>/``, the
   ``fedsec attack`` harness: round 0 (classifier fishing: round 1, it reads an earlier upload);
   DLG/IG in the textbook victim setting — each attacked client trains ``victim_steps`` step(s)
   on ``victim_batch`` image(s) — and the label attack on the method's real local training);
3. writes ``done.json`` last (the value's row, ``fedsec.resumable``); a rerun skips values that have
   one, and inside an unfinished value skips the parts whose ``summary.json`` exists.

After every value ``tradeoff.csv`` (one row per finished value), ``tradeoff.png`` (accuracy
against mean PSNR per attack, and against ε for DP) and ``tradeoff.md`` (a Markdown section a
report can include) are rewritten atomically. ``defend.json`` at the top holds the settings; a
rerun with different settings (other than the list of values and the thread count) is an error.

Defense values:

* ``dp``: noise multiplier σ of DP-SGD (``--max-grad-norm`` C, ``--delta``) and, unless
  ``--stat-noise-multiplier`` fixes it, of the mechanism for the method's whole-data statistics
  (clip ``--stat-clip``, default C; class counts ``--counts noised|withheld``); ε is the maximum
  over clients of the cumulative ε of the training run, both mechanisms composed
  (``defenses.dp``, ``defenses.dp_statistics``);
* ``noise``: the *variance* v of Gaussian noise on the gradient the server reads from an update,
  g = −Δ/lr (the DLG paper's unit): the filter adds N(0, (lr·√v)²) to every entry of Δ;
* ``clip``: bound C on the L2 norm of Δ (all model weights jointly);
* ``prune``: percentage p of the entries of Δ zeroed (smallest |Δ| first);
* ``quantize``: bits k (2^k levels per tensor);
* ``exclude``: a field kind (``prototype``, ``class_counts``, ``statistic``, ``classifier``, ...)
  or an fnmatch pattern of field names (``prototype.*``) dropped from every upload;
* ``download-check``: the value ``on``. Every client tests each download before training and
  refuses one that looks crafted (``defenses.download_check``); the row's training (an
  honest server) gives the false alarms (honest downloads refused), each malicious-server attack
  (``trap``, ``binning``) the detection rate on the downloads it crafted;
* ``consistency-check``: the value ``on``, under ``--secure-aggregation`` only. Every client compares
  a digest of its download with its masking-graph neighbours' and withholds its masked upload on a
  mismatch (``defenses.consistency_check``); the row's training gives the false alarms (rounds an
  honest server's round was flagged). Its detection of model inconsistency is measured by
  ``bench/secure_malicious.py``: the sweep's interceptors sit before a crafting server's.

Filters act on model weights (kinds extractor/classifier); Δ as defined in
``defenses.filters``. A filter gives no formal guarantee: its ε column is empty.

Each defense is a ``defenses.registry.DefenseSpec`` (``defenses.DEFENSES``): its value's meaning, how a value
is read, where it acts and how it is built for the run; the sweep reads the spec, not the name.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import pandas as pd

import attacks
import defenses
from attacks.verdicts import LEAK_GAP_DB, model_unknown_targets
from defenses.dp import DPConfig, DPMethod, check_dp_model
from defenses.registry import DefendedRun, DefenseSpec
from fedecouple.channel import Interceptor, ServerChannel
from fedecouple.errors import UserError
from fedecouple.methods.facets import dp_coverage
from reports.tradeoff import BASELINE, tradeoff_markdown, tradeoff_plot

from .. import io, runner
from ..catalog import DEFEND_ATTACKS
from ..resumable import ResumableStage
from ..runner import Prepared, RunConfig
from .attack import AttackSettings, check_applicable, model_for, parse_attacks, run_attack

LOCAL_TRAINING = "local training"  # where DP-SGD acts (``DefenseSpec.acts``): it wraps the method, no interceptor
CONSISTENCY_CHECK = "consistency-check"  # installed as the sweep's interceptor: before a crafting server's
# the DP statistics mechanism's settings and their defaults (they apply to --defense dp only)
STAT_DEFAULTS = {"stat_noise_multiplier": None, "stat_clip": None, "counts": "noised"}
# settings left out of a sweep's key at these values, so sweeps stored before they existed still resume
KEY_DEFAULTS = {**STAT_DEFAULTS, "attack_rounds": None}
COLUMNS = ["defense", "value", "accuracy", "accuracy_std", "epsilon", "epsilon_attacked"]


@dataclass(frozen=True)
class DefendSettings:
    defense: str
    values: list | str
    attacks: list[str] | str = field(default_factory=lambda: list(DEFEND_ATTACKS))
    baseline: bool = True
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    targets: int = 2
    iterations: int | str | None = None  # N, or ATTACK=N,... per attack
    victim_batch: int = 1
    victim_steps: int = 1
    attack_seed: int | None = None
    stat_noise_multiplier: float | None = None  # dp statistics: None = each value's σ
    stat_clip: float | None = None  # dp statistics: None = max_grad_norm
    counts: str = "noised"
    attack_rounds: str | None = None  # comma-separated rounds attacked; None: each attack's first round

    def key(self, config: RunConfig) -> dict:
        """What must match between a rerun and the stored sweep (everything but the values and the
        settings that never change a result; the statistics settings only when not at their
        defaults, so sweeps stored before they existed still resume)."""
        mine = {k: v for k, v in asdict(self).items() if k != "values" and not (k in KEY_DEFAULTS and
                                                                              v == KEY_DEFAULTS[k])}
        return {"config": config.result_key(), "settings": json.loads(json.dumps(mine))}

    def for_attack(self, attack: str) -> AttackSettings:
        """``attack_rounds`` (default: round 0, or the attack's first round: 1 for classifier fishing); the
        gradient attacks in the victim setting, the others on real local training; ``iterations`` N or
        ``ATTACK=N,...``."""
        from ..options import iterations_for
        from .attack import parse_rounds

        spec = attacks.get(attack)
        rounds = (spec.first_round,) if self.attack_rounds is None else tuple(parse_rounds(self.attack_rounds))
        return AttackSettings(attack=attack, rounds=rounds, targets=self.targets,
                              iterations=iterations_for(self.iterations, attack),
                              victim_batch=self.victim_batch if spec.default_victim_batch > 0 else 0,
                              victim_steps=self.victim_steps, seed=self.attack_seed)


# ---------------------------------------------------------------------------------------------
# parsing and validation


def defense_spec(defense: str) -> DefenseSpec:
    """The registered defense ``defense`` (``UserError`` naming the choices when there is none)."""
    try:
        return defenses.get(defense)
    except KeyError as exc:
        raise UserError(exc.args[0]) from None


def parse_values(defense: str, text: str | list) -> list:
    """The distinct values of ``text`` (comma-separated or a list), each read by the defense's spec."""
    spec = defense_spec(defense)
    items = [str(t).strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    if not items:
        raise UserError("--values needs at least one value (comma-separated)")
    return list(dict.fromkeys(spec.read(item) for item in items))


def value_slug(value) -> str:
    text = str(value)
    safe = "".join(ch if ch.isalnum() or ch in ".-_" else "_" for ch in text)
    return f"value-{safe}"


def _dp_settings(settings: DefendSettings) -> dict:
    """``DPConfig``'s fields other than the noise multiplier, from the sweep's settings."""
    return {"max_grad_norm": settings.max_grad_norm, "delta": settings.delta, "accountant": settings.accountant,
            "statistics_noise_multiplier": settings.stat_noise_multiplier, "statistics_clip": settings.stat_clip,
            "counts": settings.counts}


def dp_config(settings: DefendSettings, value) -> DPConfig:
    return DPConfig(noise_multiplier=float(value), **_dp_settings(settings))


def defended_run(prep: Prepared, settings: DefendSettings) -> DefendedRun:
    """What a defense is built from: the configured method and model, the clients' data, the DP settings."""
    import torch

    return DefendedRun(method=prep.method, model=lambda: model_for(prep), lr=prep.config.federation.train.lr,
                       seed=prep.config.federation.seed,
                       images_of=lambda c: prep.dataset.images[torch.from_numpy(prep.partition.train[c])],
                       dp=_dp_settings(settings), secure=prep.config.secure.protocol(prep.config.federation.seed))


def validate(config: RunConfig, settings: DefendSettings) -> Prepared:
    """Every check that can fail before anything runs (bad values, refused DP, missing fields)."""
    prep = runner.prepare(config)
    if not prep.method.communicates:
        raise UserError(f"{config.method} never communicates: there is no upload to defend or attack")
    if settings.targets < 1:
        raise UserError(f"--targets must be at least 1, got {settings.targets}")
    if isinstance(settings.iterations, int) and settings.iterations < 1:
        raise UserError(f"--iterations must be at least 1, got {settings.iterations}")
    if settings.victim_batch < 1 or settings.victim_steps < 1:
        raise UserError("--victim-batch and --victim-steps must be at least 1")
    spec = defense_spec(settings.defense)
    if MIA in settings.attacks and spec.acts != LOCAL_TRAINING:
        local = [s.name for s in defenses.DEFENSES.values() if s.acts == LOCAL_TRAINING]
        raise UserError(f"--attacks {MIA} runs under {' or '.join(f'--defense {n}' for n in local)} only: its "
                        f"shadow federations take DP-SGD but no channel filters")
    for attack in settings.attacks:
        if attack != MIA:
            check_applicable(attacks.get(attack), prep)
            if settings.defense == CONSISTENCY_CHECK and attacks.get(attack).malicious:
                raise UserError(f"--defense {CONSISTENCY_CHECK} must digest the downloads the crafting server of "
                                f"{attack} sends, but the attack harness installs the sweep's checks before that "
                                f"server; measure it with bench/secure_malicious.py, or sweep an honest server's attack")
    changed = [f"--{k.replace('_', '-')}" for k, v in STAT_DEFAULTS.items() if getattr(settings, k) != v]
    if changed and spec.acts != LOCAL_TRAINING:
        raise UserError(f"{', '.join(changed)} set the DP statistics mechanism: they apply to --defense dp only")
    run = defended_run(prep, settings)
    for v in settings.values:
        spec.build(v, run)  # refuses a value, method or upload the defense cannot cover
    if spec.acts == LOCAL_TRAINING:
        check_dp_model(prep)
    return prep


# ---------------------------------------------------------------------------------------------
# one value


def _defenses(settings: DefendSettings, value, prep: Prepared) -> tuple[list[Interceptor], DPConfig | None]:
    """(channel interceptors, DP-SGD config) of one sweep value."""
    if value == BASELINE:
        return [], None
    spec = defense_spec(settings.defense)
    built = spec.build(value, defended_run(prep, settings))
    return ([], built) if spec.acts == LOCAL_TRAINING else ([built], None)


def train_defended(prep: Prepared, settings: DefendSettings, value, out: Path) -> dict:
    """Train with the defense; metrics.csv, summary.json, defense.json in ``out`` (reused when there)."""
    config = prep.config
    if (out / "summary.json").exists() and (out / "defense.json").exists():
        summary = io.read_json(out / "summary.json")
        if int(summary.get("rounds", -1)) >= config.federation.rounds:
            return {**summary, "defense": io.read_json(out / "defense.json")}
    chains, dp = _defenses(settings, value, prep)
    if dp is not None:
        prep = replace(prep, method=DPMethod(prep.method, dp))
    fed = runner.build_federation(prep, channel=ServerChannel(chains))
    start = time.perf_counter()
    try:
        fed.run(config.federation.rounds)
    except KeyError as exc:
        if chains and defense_spec(settings.defense).acts == "upload":  # a filter dropped a field the server needs
            raise UserError(f"{config.method}'s server cannot aggregate without field {exc.args[0]!r}: "
                            f"{settings.defense} {value!r} breaks the method's protocol") from None
        raise
    finally:
        fed.close()  # e.g. shut down the Ray this run started
    summary = runner.write_metrics(out, fed, config, time.perf_counter() - start)
    built = dp if dp is not None else chains[0] if chains else None
    defense = {"kind": "none"} if built is None else defense_spec(settings.defense).report(built, fed.clients)
    defense = io.finite(defense)
    io.write_json(out / "defense.json", defense)
    return {**summary, "defense": defense}


def attack_defended(prep: Prepared, settings: DefendSettings, value, attack: str, out: Path) -> dict:
    """One attack on a fresh federation with the defense (the summary.json in ``out`` when there)."""
    if (out / "summary.json").exists():
        return io.read_json(out / "summary.json")
    chains, dp = _defenses(settings, value, prep)
    attack_settings = settings.for_attack(attack)
    if settings.defense == "download-check":  # the attack's own check sits after a malicious server
        attack_settings, chains = replace(attack_settings, download_check=bool(chains)), []
    return run_attack(prep.config, attack_settings, out=out, progress=False, interceptors=chains, dp=dp)


MIA = "mia"  # membership inference (``fedsec mia``): not a reconstruction attack, run by its own harness
MIA_REFERENCE_RUNS = 2


def parse_defend_attacks(text: str | list[str]) -> list[str]:
    """The registered attacks of ``text`` (``attack.parse_attacks``), plus ``mia``."""
    listed = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    others = [a for a in listed if a != MIA]
    if not others and MIA in listed:
        return [MIA]
    return parse_attacks(others) + ([MIA] if MIA in listed else [])


def membership_defended(prep: Prepared, settings: DefendSettings, value, out: Path) -> dict:
    """LiRA on the personal models (``fedsec.jobs.mia``, two shadow federations, with the value's DP-SGD):
    AUC, TPR at 1 % FPR and the empirical ε lower bound implied by it."""
    from .mia import MiaSettings, run_mia

    path = out / "summary.json"
    if path.exists():
        summary = io.read_json(path)
    else:
        # the value's whole DP configuration, statistics mechanism included, as in the row's training
        statistics = {} if value == BASELINE else {k: getattr(settings, k) for k in STAT_DEFAULTS}
        mia = MiaSettings(reference_runs=MIA_REFERENCE_RUNS, max_grad_norm=settings.max_grad_norm,
                          delta=settings.delta, dp_noise=None if value == BASELINE else float(value), **statistics)
        summary = run_mia(prep.config, mia, out, progress=False, echo=lambda text: None)
    lira = ((summary.get("targets") or {}).get("personal") or {}).get("attacks", {}).get("lira", {})
    eps = (lira.get("empirical_epsilon") or {}).get("epsilon_lower_bound")
    # TPR at 1 % FPR is refused (a sentence, not a number) below 1,000 non-members: then NaN here
    tpr = lira.get("tpr_at_1pct_fpr")
    return {"mia_auc": _num(lira.get("auc")), "mia_tpr_1pct_fpr": _num(tpr) if isinstance(tpr, (int, float)) else
            float("nan"), "mia_epsilon_lower_bound": _num(eps)}


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def _attacked_epsilon(summary: dict) -> float | None:
    """The largest ε among the attacked clients of an attack run with DP (None without DP)."""
    dp = summary.get("dp")
    if dp is None:
        return None
    targets = [str(c) for cs in (summary.get("targets") or {}).values() for c in cs]
    per_client = dp.get("epsilon_per_client") or {}
    eps = [math.inf if per_client.get(c) is None else float(per_client[c]) for c in targets or list(per_client)]
    return max(eps) if eps else None


def run_value(prep: Prepared, settings: DefendSettings, value, out: Path,
              on_part: Callable[[str], None] | None = None) -> dict:
    """Train, attack and score one value; returns its row (also written to ``done.json``)."""
    start = time.perf_counter()
    if on_part:
        on_part("train")
    trained = train_defended(prep, settings, value, out / "train")
    defense, spec = trained["defense"], defense_spec(settings.defense)
    row = {"defense": BASELINE if value == BASELINE else settings.defense, "value": value,
           "accuracy": _num(trained.get("mean_accuracy")), "accuracy_std": _num(trained.get("std_accuracy")),
           "epsilon": (math.inf if defense.get("epsilon_max") is None else float(defense["epsilon_max"]))
           if spec.formal and value != BASELINE else float("nan"), "epsilon_attacked": float("nan")}
    if spec.acts == "download":
        row["false_alarm_rate"] = _num(defense.get("false_alarm_rate"))
    notes = []
    for attack in settings.attacks:
        if on_part:
            on_part(attack)
        if attack == MIA:
            row.update(membership_defended(prep, settings, value, out / "attack-mia"))
            continue
        summary = attack_defended(prep, settings, value, attack, out / f"attack-{attack}")
        if attacks.get(attack).rebuilds_images:
            row[f"mean_psnr_{attack}"] = _num(summary.get("mean_psnr"))
            row[f"max_psnr_{attack}"] = _num(summary.get("max_psnr"))
            # each attack's own prior: the prototype attack scores against another one than DLG/IG
            row[f"prior_psnr_{attack}"] = _num(summary.get("mean_prior_psnr"))
            row[f"mis_specified_{attack}"] = bool(summary.get("mis_specified"))
            # NO MODEL: the server holds no model of the client (FedProto), so the PSNR is an estimate
            row[f"model_unknown_{attack}"] = bool(model_unknown_targets(summary))
            if spec.acts == "download":
                row[f"detection_rate_{attack}"] = _num((summary.get("download_check") or {}).get("detection_rate"))
            if not summary.get("images_scored"):
                notes.extend(summary.get("notes", [])[:2])
        else:
            row[f"class_presence_{attack}"] = _num(summary.get("class_presence_accuracy"))
        eps = _attacked_epsilon(summary)
        if eps is not None:
            row["epsilon_attacked"] = eps if math.isnan(row["epsilon_attacked"]) else max(row["epsilon_attacked"], eps)
    row["seconds"] = round(time.perf_counter() - start, 1)
    if notes:
        row["notes"] = "; ".join(dict.fromkeys(notes))
    return row


# ---------------------------------------------------------------------------------------------
# the sweep


def tradeoff_frame(rows: list[dict], settings: DefendSettings) -> pd.DataFrame:
    image = [a for a in settings.attacks if a != MIA and attacks.get(a).rebuilds_images]
    labels = [a for a in settings.attacks if a != MIA and not attacks.get(a).rebuilds_images]
    membership = ["mia_auc", "mia_tpr_1pct_fpr", "mia_epsilon_lower_bound"] if MIA in settings.attacks else []
    check = (["false_alarm_rate"] + [f"detection_rate_{a}" for a in image]) \
        if defense_spec(settings.defense).acts == "download" else []
    columns = (COLUMNS + check + [f"mean_psnr_{a}" for a in image] + [f"prior_psnr_{a}" for a in image]
               + [f"mis_specified_{a}" for a in image] + [f"model_unknown_{a}" for a in image]
               + [f"class_presence_{a}" for a in labels]
               + membership + [f"max_psnr_{a}" for a in image] + ["seconds"])
    frame = pd.DataFrame(rows, columns=columns)
    if any("notes" in r for r in rows):
        frame["notes"] = [r.get("notes", "") for r in rows]
    return frame


def _open_sweep(out: Path, key: dict, settings: DefendSettings) -> None:
    """Check ``out`` holds no sweep with other settings, then record this one's."""
    stored = out / "defend.json"
    if stored.exists():
        try:
            previous = io.read_json(stored)
        except (ValueError, OSError):
            previous = None
        if previous is None or previous.get("key") != key:
            raise UserError(f"{out} holds a defend sweep with different settings; use another --out or remove it")
    io.write_json(stored, {"key": key, "values": [str(v) for v in settings.values]})


def value_stage(path: Path, key: dict) -> ResumableStage:
    """One value of the sweep: its ``done.json`` holds the sweep's ``key`` and the value's row."""
    return ResumableStage(path, key, identity_field="key")


def _stored_row(stage: ResumableStage) -> dict | None:
    if stage.holds_other():
        raise UserError(f"{stage.path} was computed with different settings; use another --out or remove it")
    if not stage.complete():
        return None
    row = stage.record()["row"]
    return {k: (math.inf if v == "inf" else float("nan") if v is None else v) for k, v in row.items()}


def defend(config: RunConfig, settings: DefendSettings, out: str | Path, progress: bool = True,
           on_value: Callable[[dict], None] | None = None, command: str | None = None) -> pd.DataFrame:
    """Run the sweep into ``out`` (resumable); returns the trade-off frame."""
    from tqdm import tqdm

    settings = replace(settings, values=parse_values(settings.defense, settings.values),
                       attacks=parse_defend_attacks(settings.attacks))
    prep = validate(config, settings)
    out = Path(out)
    key = settings.key(config)
    _open_sweep(out, key, settings)
    plan = ([BASELINE] if settings.baseline else []) + list(settings.values)
    meta = _render_meta(settings, prep)
    rows: list[dict] = []
    bar = tqdm(plan, desc=f"defend {settings.defense} on {config.method}", unit="value", disable=not progress)
    try:
        for value in bar:
            path = out / ("baseline" if value == BASELINE else value_slug(value))
            stage = value_stage(path, key)
            row = _stored_row(stage)
            if row is None:
                row = run_value(prep, settings, value, path,
                                on_part=lambda part, v=value: bar.set_postfix_str(f"{v}: {part}"))
                stage.finish({"row": io.finite({k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
                                                for k, v in row.items()})})
            rows.append(row)
            frame = tradeoff_frame(rows, settings)
            io.write_csv(out / "tradeoff.csv", frame)
            io.write_bytes(out / "tradeoff.png", tradeoff_plot(frame, meta))
            io.write_text(out / "tradeoff.md", tradeoff_markdown(frame, meta, command,
                                                                 value_meaning=defense_spec(settings.defense).meaning))
            if on_value is not None:
                on_value(row)
    finally:
        bar.close()
    return tradeoff_frame(rows, settings)


def _render_meta(settings: DefendSettings, prep: Prepared) -> dict:
    """What ``reports.tradeoff`` needs to know about the sweep."""
    config, method = prep.config, prep.method
    return {"defense": settings.defense, "method": config.method, "dataset": config.data.dataset,
            "image_attacks": [a for a in settings.attacks if a != MIA and attacks.get(a).rebuilds_images],
            "label_attacks": [a for a in settings.attacks if a != MIA and not attacks.get(a).rebuilds_images],
            "membership": MIA in settings.attacks,
            "delta": settings.delta, "max_grad_norm": settings.max_grad_norm, "accountant": settings.accountant,
            "targets": settings.targets, "victim_batch": settings.victim_batch, "victim_steps": settings.victim_steps,
            "rounds": config.federation.rounds, "clients": config.data.clients, "partition": config.data.partition,
            "local_epochs": config.federation.train.local_epochs, "lr": config.federation.train.lr,
            "batch_size": config.federation.train.batch_size, "seed": config.federation.seed,
            "dp_per_sample": dp_coverage(method).dp_per_sample, "dp_statistics": dp_coverage(method).dp_statistics,
            "stat_noise_multiplier": settings.stat_noise_multiplier, "stat_clip": settings.stat_clip,
            "counts": settings.counts, "leak_gap_db": LEAK_GAP_DB,
            "attack_rounds": {a: settings.for_attack(a).rounds[0] for a in settings.attacks if a != MIA}}
