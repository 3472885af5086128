"""Library behind ``fedsec mia``: membership inference audits of personalised federated models.

Question: can someone holding a model tell whether a record was in a client's training data?

Records and membership. Every record of every client is audited: the client's training split
(members of the target) and its held-out split (non-members). The partition holds out a share of
*each class the client holds* (``split_train_test``), so a client's non-members follow its own
label mix: a member is never compared with another client's images (under label skew that would
measure distribution shift, not membership). The held-out records double as the population data
of ``population`` and ``rmia``: a client's records are compared with its own client's held-out
records only (a held-out record also with itself, like any population record, so that every score
of a client has the same denominator).

Target run: the federation the user asked for (``config``), on the usual partition and seed.
Reference runs (``--reference-runs R``, even): shadow federations trained the way the target was —
the whole federated method, every client — in complementary pairs. In pair p every client's
records (training and held-out, per class, seeded) are split in two halves: run 2p trains on one,
run 2p+1 on the other (the other half is that run's test split). So every audited record is IN
exactly R/2 reference runs and OUT of R/2, and each run gives every client's personal model, the
global model and the uploads, usable as references for the same client and kind of model. A
reference run's federation seed is derived from (seed, run), so its initial model and batch order
differ from the target's; the partition is the target's.

Targets (``fedsec.mia_runs``): ``personal`` (each client's personalised model on its own records),
``global`` (the server's model on the same records) and ``upload`` (the model each client uploaded
in the last round: the server's view). Attacks: ``loss``, ``entropy``, ``population`` (no
reference models), ``rmia`` (offline, OUT references only, ``a`` tuned on reference pair 0 —
pseudo-target run 0 attacked with the runs outside that pair, leave-one-run-out — when R ≥ 4),
``lira`` (online: R/2 IN and R/2 OUT references per record, global variance) and, for the
``upload`` target only, ``update`` (the loss decrease of each record under its owner's upload
against the same round's other uploads, FedMIA-style, no reference runs).

Scoring and statistics (``attacks.membership.scoring``, ``attacks.statistics``), per target and attack, pooled over clients: AUC, advantage,
TPR at 1 % and 0.1 % FPR (refused with a sentence below 10/α non-members), each with a 95 %
bootstrap interval that resamples clients; TPR at the fixed 1 %-FPR threshold with a
Clopper–Pearson interval; the per-client AUC distribution; the empirical ε lower bound at δ.
Per target, the chance level of the split: the LOSS AUC the same members and non-members get from
models that trained on neither (``chance_level``).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from attacks import MEMBERSHIP
from attacks import statistics as st
from attacks.membership.rmia import DEFAULT_GAMMA, DEFAULT_TEMPERATURE
from attacks.membership.scoring import (AuditRecords, KindScores, attack_metrics, chance_level, per_client_aucs,
                                        score_kind, score_update)
from defenses.dp import DPConfig, DPMethod, check_dp_model
from fedecouple.backends import make_backend
from fedecouple.data.partition import Partition
from fedecouple.engine import derive_seed
from fedecouple.errors import UserError

from .. import io
from ..mia_runs import KINDS, RunSpec, done_record, load_signals, run_one
from ..runner import Prepared, RunConfig, prepare, run_record
from ..versions import provenance

# the attacks on a model's outputs are registered (attacks.MEMBERSHIP); "update" is the server's test on
# the uploads (attacks.membership.mia_update), scored from another signal
MODEL_ATTACKS = tuple(MEMBERSHIP)
ATTACKS = MODEL_ATTACKS + ("update",)
MIA_THREADS = 1


@dataclass(frozen=True)
class MiaSettings:
    attacks: tuple[str, ...] = ATTACKS
    reference_runs: int = 4
    gamma: float = DEFAULT_GAMMA
    temperature: float = DEFAULT_TEMPERATURE
    offline_a: float | None = None  # None: tune on reference pair 0 (needs R >= 4), else 0.3
    dp_noise: float | None = None  # DP-SGD noise multiplier for every run (None: no DP)
    max_grad_norm: float = 1.0
    stat_noise_multiplier: float | None = None  # DP statistics mechanism (None: dp_noise)
    stat_clip: float | None = None  # (None: max_grad_norm)
    counts: str = "noised"
    delta: float = 1e-5
    bootstrap: int = 1000
    exposed: int = 16

    def validate(self) -> None:
        unknown = [a for a in self.attacks if a not in ATTACKS]
        if unknown or not self.attacks:
            raise UserError(f"unknown attack(s) {', '.join(unknown) or '(none given)'} in --attacks; choose from: "
                            f"{', '.join(ATTACKS)}")
        if self.reference_runs < 2 or self.reference_runs % 2:
            raise UserError(f"--reference-runs must be an even number >= 2 (complementary pairs), got "
                            f"{self.reference_runs}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise UserError(f"--gamma must be a positive number, got {self.gamma}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise UserError(f"--temperature must be a positive number, got {self.temperature}")
        if self.offline_a is not None and not 0 <= self.offline_a <= 1:
            raise UserError(f"--offline-a must be in [0, 1] or 'tune', got {self.offline_a}")
        if self.bootstrap < 10:
            raise UserError(f"--bootstrap must be at least 10 resamples, got {self.bootstrap}")
        if self.exposed < 0:
            raise UserError(f"--exposed must be >= 0, got {self.exposed}")
        if self.dp_noise is not None:
            self.dp_config().validate()
        else:
            given = [flag for flag, value in (("--stat-noise-multiplier", self.stat_noise_multiplier),
                                              ("--stat-clip", self.stat_clip)) if value is not None]
            if given or self.counts != "noised":
                raise UserError(f"{(given or ['--counts'])[0]} needs --dp (it sets the DP statistics mechanism); "
                                f"add --dp SIGMA or drop the flag")

    def dp_config(self) -> DPConfig | None:
        if self.dp_noise is None:
            return None
        return DPConfig(noise_multiplier=self.dp_noise, max_grad_norm=self.max_grad_norm, delta=self.delta,
                        statistics_noise_multiplier=self.stat_noise_multiplier, statistics_clip=self.stat_clip,
                        counts=self.counts)


def parse_attacks(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    MiaSettings(attacks=names).validate()
    return names


def parse_offline_a(text: str | None) -> float | None:
    """``tune`` (or nothing) → None; otherwise a number in [0, 1]."""
    if text is None or str(text).strip().lower() == "tune":
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--offline-a expects a number in [0, 1] or 'tune', got {text!r}") from None
    if not 0 <= value <= 1:
        raise UserError(f"--offline-a must be in [0, 1] or 'tune', got {text}")
    return value


# ---------------------------------------------------------------------------------------------
# records and the reference halves


def audit_records(partition: Partition, labels: np.ndarray) -> AuditRecords:
    """Every client's training split (members) and held-out split (non-members, its own label mix)."""
    index, owner, member = [], [], []
    for cid in range(partition.num_clients):
        train, test = np.asarray(partition.train[cid]), np.asarray(partition.test[cid])
        both = np.concatenate([train, test]).astype(np.int64)
        order = np.argsort(both, kind="stable")
        index.append(both[order])
        owner.append(np.full(len(both), cid, dtype=np.int64))
        member.append(np.concatenate([np.ones(len(train), bool), np.zeros(len(test), bool)])[order])
    index_all = np.concatenate(index) if index else np.zeros(0, np.int64)
    return AuditRecords(index_all, np.concatenate(owner), np.asarray(labels)[index_all].astype(np.int64),
                        np.concatenate(member))


def reference_membership(records: AuditRecords, runs: int, seed: int) -> np.ndarray:
    """(records, runs) bool: IN of reference run r. Pair p splits each client's records of each
    class in two seeded halves, one for run 2p and the other for run 2p+1 (an odd class count
    gives its extra record to a side chosen by the parity of pair, client and class)."""
    inside = np.zeros((len(records.index), runs), dtype=bool)
    for pair in range(runs // 2):
        for cid in np.unique(records.owner):
            for k in np.unique(records.labels[records.owner == cid]):
                rows = np.flatnonzero((records.owner == cid) & (records.labels == k))
                rows = np.random.default_rng(derive_seed(seed, 0x4D1A, pair, int(cid), int(k))).permutation(rows)
                half = (len(rows) + (pair + int(cid) + int(k)) % 2) // 2
                inside[rows[:half], 2 * pair] = True
                inside[rows[half:], 2 * pair + 1] = True
    return inside


def split_partition(records: AuditRecords, trained: np.ndarray, like: Partition) -> Partition:
    """A partition with the same clients whose train split is ``trained`` and test split the rest."""
    train = [np.sort(records.index[(records.owner == c) & trained]) for c in range(like.num_clients)]
    test = [np.sort(records.index[(records.owner == c) & ~trained]) for c in range(like.num_clients)]
    return Partition(like.scheme, like.num_classes, train, test)


def reference_seed(seed: int, run: int) -> int:
    return derive_seed(seed, 0x4D1A5EED, run)


def plan_runs(prep: Prepared, records: AuditRecords, ref_in: np.ndarray, settings: MiaSettings,
              out: Path) -> list[RunSpec]:
    """The target run and the reference runs, with their folders under ``out/runs``."""
    dp = settings.dp_config()
    config = prep.config
    specs = [RunSpec("target", config, prep.partition, config.federation.seed, records.index, records.owner, records.member,
                     str(out / "runs" / "target"), dp, server_view=True)]
    for r in range(settings.reference_runs):
        specs.append(RunSpec(f"ref-{r}", config, split_partition(records, ref_in[:, r], prep.partition),
                             reference_seed(config.federation.seed, r), records.index, records.owner, ref_in[:, r].copy(),
                             str(out / "runs" / f"ref-{r}"), dp))
    return specs


def check_reusable(specs: list[RunSpec]) -> int:
    """How many runs are already done; a run folder finished under another configuration is an error."""
    done = 0
    for spec in specs:
        if spec.stage().holds_other():
            raise UserError(f"{spec.folder} holds a run of a different configuration; use another --out "
                            f"(or delete that folder)")
        done += done_record(spec) is not None
    return done


def score_all(target: dict, refs: list[dict], records: AuditRecords, ref_in: np.ndarray,
              settings: MiaSettings) -> dict[str, KindScores | str]:
    """Scores per target kind, or a sentence saying why the kind does not exist for this method."""
    notes = target.get("_notes", {})
    out: dict[str, KindScores | str] = {}
    for kind in KINDS:
        if kind not in target:
            out[kind] = notes.get(kind, "not available")
            continue
        stacked = np.stack([r[kind].numpy().astype(np.float64) for r in refs])
        result = score_kind(target[kind].numpy().astype(np.float64), stacked, records, ref_in, settings)
        result.note = notes.get(kind)
        result.chance = chance_level(stacked, records, ref_in)
        if kind == "upload" and "update" in settings.attacks:
            if "loss_down" in target and len(target["update_clients"]) >= 3:
                result.scores["update"] = score_update(target, records)
            else:
                result.not_applicable["update"] = notes.get("update", "the update test needs at least 3 clients "
                                                                      "uploading full models in the last round")
        out[kind] = result
    return out


# ---------------------------------------------------------------------------------------------
# running the audit


def estimate_seconds(prep: Prepared, specs: list[RunSpec], dp: DPConfig | None) -> float:
    """Rough wall time of training every run in one process: one timed round of the target
    federation (every client's update and the evaluation), scaled by rounds and by the records each
    run trains on. Signal collection after training (forward passes; a linear probe per client for
    methods whose server or uploads hold no classifier) comes on top."""
    from fedecouple.engine import Federation

    from ..runner import build_method

    method = build_method(prep.config)
    if dp is not None:
        method = DPMethod(method, dp)
    fed = Federation(method, prep.dataset, prep.partition, prep.config.federation)
    start = time.perf_counter()
    fed.run_round()
    per_record = (time.perf_counter() - start) / max(sum(len(t) for t in prep.partition.train), 1)
    return per_record * sum(int(s.trained.sum()) for s in specs) * prep.config.federation.rounds


def train_runs(specs: list[RunSpec], prep: Prepared, threads: int, progress: bool) -> list[dict]:
    """Run every spec not yet done, fanned out over the configured backend (one task per run)."""
    from tqdm import tqdm

    import sys

    todo = [s for s in specs if done_record(s) is None]
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc="mia runs", unit="run", file=sys.stderr,
               disable=not progress)
    backend = make_backend(prep.config.execution.backend, prep.config.execution.ray_address, threads,
                           prep.config.federation.device)
    try:
        backend.map(run_one, [(s, prep.dataset) for s in todo], threads=threads, on_result=lambda i: bar.update(1))
    finally:
        backend.close()
        bar.close()
    return [done_record(s) for s in specs]


def run_mia(config: RunConfig, settings: MiaSettings, out: str | Path, progress: bool = True,
            echo: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Plan, train (or reuse) the target and reference runs, score every attack, write the outputs.

    Bad input raises ``UserError`` before anything is written. Returns the summary."""
    settings.validate()
    if config.execution.threads is None:
        config = config.updated(threads=MIA_THREADS)
    if config.federation.rounds < 1:
        raise UserError(f"--rounds must be at least 1 for an audit (a model must be trained), got "
                        f"{config.federation.rounds}")
    prep = prepare(config)
    dp = settings.dp_config()
    if dp is not None:
        DPMethod(prep.method, dp)  # refuses what a method declares DP cannot cover, before anything is written
        check_dp_model(prep)
    out = Path(out)
    records = audit_records(prep.partition, prep.dataset.labels.numpy())
    ref_in = reference_membership(records, settings.reference_runs, config.federation.seed)
    specs = plan_runs(prep, records, ref_in, settings, out)
    done = check_reusable(specs)
    torch.set_num_threads(config.execution.threads)
    start = time.perf_counter()
    if done < len(specs):
        estimate = estimate_seconds(prep, [s for s in specs if done_record(s) is None], dp)
        echo(f"{len(specs) - done} of {len(specs)} federation(s) to train ({config.method}, {config.federation.rounds} rounds, "
             f"{config.data.clients} clients); estimated {estimate / 60:.1f} min of training in one process, "
             f"plus signal collection"
             + (" (spread over the Ray cluster)" if config.execution.backend == "ray" else ""))
    runs = train_runs(specs, prep, config.execution.threads, progress)
    signals = [load_signals(s) for s in specs]
    scored = score_all(signals[0], signals[1:], records, ref_in, settings)
    summary = build_summary(config, prep.method, settings, records, runs, scored, command)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    write_outputs(out, prep, records, scored, summary, settings)
    return summary


# ---------------------------------------------------------------------------------------------
# outputs


def build_summary(config: RunConfig, method, settings: MiaSettings, records: AuditRecords, runs: list[dict],
                  scored: dict, command: str | None) -> dict:
    """Everything summary.json holds: config, seed, versions, runs, and per target and attack the metrics."""
    seed = derive_seed(config.federation.seed, 0xB007)
    targets: dict = {}
    for kind, result in scored.items():
        if isinstance(result, str):
            targets[kind] = {"available": False, "note": result}
            continue
        attacks: dict = {}
        for name in settings.attacks:
            if name in result.scores:
                attacks[name] = attack_metrics(result.scores[name], records.member, records.owner,
                                               settings.bootstrap, seed, settings.delta)
            elif name in result.not_applicable:
                attacks[name] = {"not_applicable": result.not_applicable[name]}
            else:
                attacks[name] = {"not_applicable": "the update test scores the uploads (target 'upload') only"}
        targets[kind] = {"available": True, "note": result.note, "offline_a": result.offline_a or None,
                         "chance_level": result.chance, "attacks": attacks}
    record = run_record(config, method)
    summary = {"method": config.method, "dataset": config.data.dataset, "seed": config.federation.seed, "command": command,
               "config": record["config"], "method_hyperparameters": record["method_hyperparameters"],
               "torch_threads": record["torch_threads"], **provenance(),
               "settings": {**asdict(settings), "attacks": list(settings.attacks)},
               "records": {"members": int(records.member.sum()), "nonmembers": int((~records.member).sum()),
                           "clients": int(len(np.unique(records.owner)))},
               "target_accuracy": runs[0]["mean_accuracy"],
               "runs": [{k: r.get(k) for k in ("name", "federation_seed", "rounds", "mean_accuracy", "seconds",
                                               "training_records", "notes")} for r in runs],
               "targets": targets}
    if settings.dp_noise is not None:
        dp = runs[0].get("dp", {})
        summary["dp"] = {**asdict(settings.dp_config()), "epsilon_accounted_max": dp.get("epsilon_max"),
                         "epsilon_accounted_per_client": dp.get("epsilon_per_client")}
    return summary


def scores_frame(records: AuditRecords, scored: dict, attacks: tuple[str, ...]) -> pd.DataFrame:
    """mia.csv: one row per (target kind, record): record, client, label, target, member, score per attack."""
    frames = []
    for kind, result in scored.items():
        if isinstance(result, str):
            continue
        frame = pd.DataFrame({"record": records.index, "client": records.owner, "label": records.labels,
                              "target": kind, "member": records.member.astype(int)})
        for name in attacks:
            frame[name] = result.scores.get(name, np.full(len(records.index), np.nan))
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def most_exposed(frame: pd.DataFrame, summary: dict, k: int) -> tuple[pd.DataFrame, str | None, str | None]:
    """The k members with the highest score under the attack with the highest TPR at 1 % FPR
    (else AUC) on the personal models; each with the share of its client's non-members it outscores."""
    attacks = summary["targets"].get("personal", {}).get("attacks", {})

    def strength(item):
        m = item[1]
        tpr = m.get("tpr_at_1pct_fpr")
        return (tpr if isinstance(tpr, float) else -1.0, m.get("auc", -1.0))

    usable = [(n, m) for n, m in attacks.items() if "auc" in m]
    if k == 0 or not usable:
        return pd.DataFrame(), None, None
    attack = max(usable, key=strength)[0]
    rows = frame[frame["target"] == "personal"]
    members = rows[(rows["member"] == 1) & rows[attack].notna()].nlargest(k, attack)
    outscored = []
    for _, row in members.iterrows():
        own = rows[(rows["client"] == row["client"]) & (rows["member"] == 0)][attack]
        outscored.append(float((own < row[attack]).mean()) if len(own) else float("nan"))
    table = members[["record", "client", "label", attack]].rename(columns={attack: "score"}).reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    table["attack"] = attack
    table["outscores_nonmembers_of_client"] = outscored
    return table, "personal", attack


def write_outputs(out: Path, prep: Prepared, records: AuditRecords, scored: dict, summary: dict,
                  settings: MiaSettings) -> None:
    """mia.csv, per_client_auc.csv, summary.json, mia.md, roc.png, histograms.png, exposed.csv/png."""
    from reports import mia as render

    frame = scores_frame(records, scored, settings.attacks)
    io.write_csv(out / "mia.csv", frame)
    per_client, curves, histograms = [], {}, {}
    for kind, result in scored.items():
        if isinstance(result, str):
            continue
        for name, values in result.scores.items():
            ok = np.isfinite(values)
            table = per_client_aucs(values[ok], records.member[ok], records.owner[ok])
            per_client.append(table.assign(target=kind, attack=name))
            curves.setdefault(kind, {})[name] = tuple(st.roc(values[ok], records.member[ok])[:2])
            histograms.setdefault(kind, {})[name] = (values[ok & records.member], values[ok & ~records.member])
    if per_client:
        io.write_csv(out / "per_client_auc.csv", pd.concat(per_client, ignore_index=True)[
            ["target", "attack", "client", "auc", "n_members", "n_nonmembers"]])
    exposed, kind, attack = most_exposed(frame, summary, settings.exposed)
    if len(exposed):
        io.write_csv(out / "exposed.csv", exposed)
        images = prep.dataset.images[torch.from_numpy(exposed["record"].to_numpy().copy())].numpy()
        captions = [f"#{r.record} c{r.client} y={r.label}" for r in exposed.itertuples()]
        title = f"{kind} model, {attack}: most exposed members"
        io.write_bytes(out / "exposed.png", render.exposed_png(images, captions, title))
    if curves:
        io.write_bytes(out / "roc.png", render.roc_png(curves, title=f"{summary['method']}: membership inference ROC"))
        io.write_bytes(out / "histograms.png", render.histograms_png(histograms))
    rows = render.summary_rows(summary)
    io.write_text(out / "mia.md", render.markdown_table(rows) + "\n")
    io.write_json(out / "summary.json", io.finite(summary))
