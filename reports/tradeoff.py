"""The privacy–utility trade-off of ``fedsec defend``: pure rendering (the trade-off frame and a few
facts about the sweep in ``meta``; Markdown, a PNG and one line per value out).

``meta``: ``defense, method, dataset, image_attacks, label_attacks, delta, max_grad_norm,
accountant, targets, victim_batch, victim_steps, rounds, clients, partition, local_epochs, lr,
batch_size, seed, dp_per_sample, leak_gap_db`` (the "at chance" margin the audit uses) and, for
DP, ``dp_statistics, stat_noise_multiplier, stat_clip, counts`` (the statistics mechanism).
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from .figures import png_bytes
from .formatting import is_true

BASELINE = "none"


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


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def value_line(row: Mapping) -> str:
    """One sweep value for the terminal: accuracy, ε, PSNR per image attack, class presence."""
    parts = [f"{row['defense']} {row['value']}: accuracy {100 * row['accuracy']:.2f}%"]
    if _finite(row.get("epsilon")):
        parts.append(f"epsilon {row['epsilon']:.3g}")
    for k in [k for k in row if k.startswith("mean_psnr_") and _finite(row[k])]:
        a = k[len("mean_psnr_"):]
        prior = row.get(f"prior_psnr_{a}")
        parts.append(f"{a.upper()} {row[k]:.2f} dB" + (f" (prior {prior:.2f} dB)" if _finite(prior) else ""))
    parts += [f"{k[len('class_presence_'):]} class presence {row[k]:.2f}" for k in row
              if k.startswith("class_presence_") and _finite(row[k])]
    return ", ".join(parts)


def claim_check(frame: pd.DataFrame, meta: Mapping) -> str | None:
    """For noise and prune with DLG: where the DLG paper's claim (noise variance ≥ 1e-2 or pruning
    more than 20 % defeats DLG) lands in this sweep."""
    defense, margin = meta["defense"], float(meta["leak_gap_db"])
    if defense not in ("noise", "prune") or "dlg" not in meta["image_attacks"]:
        return None
    sub = frame[frame["defense"] == defense].copy()
    if sub.empty:
        return None
    sub["gap"] = sub["mean_psnr_dlg"] - sub["prior_psnr_dlg"]
    sub = sub.sort_values("value")
    defeated = sub[sub["gap"] < margin]
    base = frame[frame["defense"] == BASELINE]
    base_gap = float(base["mean_psnr_dlg"].iloc[0] - base["prior_psnr_dlg"].iloc[0]) if not base.empty else float("nan")
    threshold, unit = (1e-2, "variance") if defense == "noise" else (20.0, "% pruned")
    claim = ("the DLG paper: Gaussian noise of variance ≥ 1e-2 defeats DLG" if defense == "noise"
             else "the DLG paper: pruning more than 20 % of the gradient defeats DLG")
    lines = [f"**DLG claim check** ({claim}; 'defeated' here = mean DLG PSNR within {margin:g} dB of the "
             f"prior baseline). Without defense DLG is {_fmt(base_gap)} dB above the prior."]
    if defeated.empty:
        lines.append(f"No value tried defeats DLG here (largest tried: {sub['value'].max():g} {unit}).")
        return " ".join(lines)
    lines.append(f"The smallest value tried that defeats it is {float(defeated['value'].iloc[0]):g} {unit}.")
    beyond = sub[sub["value"] >= threshold] if defense == "noise" else sub[sub["value"] > threshold]
    if beyond.empty:
        lines.append(f"No value at or beyond the claim's threshold ({threshold:g} {unit}) was tried.")
    elif bool((beyond["gap"] < margin).all()):
        lines.append(f"Every value tried at or beyond the claim's threshold ({threshold:g} {unit}) defeats DLG: "
                     f"the claim holds here.")
    else:
        missed = beyond[beyond["gap"] >= margin]["value"]
        lines.append(f"At {', '.join(f'{v:g}' for v in missed)} {unit} (at or beyond the claim's threshold "
                     f"{threshold:g}) DLG is still more than {margin:g} dB above the prior: the claim does "
                     f"not hold here.")
    gaps = sub["gap"].tolist()
    if any(gaps[i + 1] > gaps[i] + 1.0 for i in range(len(gaps) - 1)):
        lines.append("The PSNR does not fall monotonically with the value (rises by more than 1 dB somewhere).")
    return " ".join(lines)


# one marker per image attack, in the order the sweep lists them (the legend names them)
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def _leakage_axes(ax, frame: pd.DataFrame, meta: Mapping) -> None:
    for i, a in enumerate(meta["image_attacks"]):
        col = f"mean_psnr_{a}"
        ok = frame[col].notna()
        ax.plot(frame.loc[ok, col], frame.loc[ok, "accuracy"] * 100, marker=MARKERS[i % len(MARKERS)],
                linestyle="-", label=a.upper())
        for _, r in frame[ok].iterrows():
            ax.annotate(str(r["value"]), (r[col], r["accuracy"] * 100), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    priors: dict[float, list[str]] = {}  # one dashed line per distinct prior, named by its attacks
    for a in meta["image_attacks"]:
        values = frame[f"prior_psnr_{a}"].dropna()
        if len(values):
            priors.setdefault(round(float(values.mean()), 1), []).append(a.upper())
    for i, (prior, names) in enumerate(sorted(priors.items())):
        ax.axvline(prior, color="grey", linestyle=("--", ":", "-.")[i % 3], label=f"prior ({', '.join(names)})")
    ax.set_xlabel("mean PSNR of reconstructions (dB)  ← more private")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title(f"{meta['defense']} on {meta['method']}: accuracy vs leakage", fontsize=9)
    if meta["image_attacks"]:
        ax.legend(fontsize=7)


def _epsilon_axes(ax, frame: pd.DataFrame, meta: Mapping) -> None:
    eps = frame["epsilon"].astype(float)
    sub = frame[(frame["defense"] == "dp") & np.isfinite(eps) & (eps > 0)]
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
    ax.set_xlabel(f"ε (max over clients, δ={meta['delta']:g})  ← more private")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title("accuracy vs formal privacy", fontsize=9)


def tradeoff_plot(frame: pd.DataFrame, meta: Mapping) -> bytes:
    """Accuracy against mean PSNR per image attack; for DP also accuracy against ε. PNG bytes."""
    from matplotlib.figure import Figure

    show_eps = meta["defense"] == "dp"
    fig = Figure(figsize=(10 if show_eps else 5.5, 4))
    axes = fig.subplots(1, 2 if show_eps else 1, squeeze=False)
    _leakage_axes(axes[0][0], frame, meta)
    if show_eps:
        _epsilon_axes(axes[0][1], frame, meta)
    fig.tight_layout()
    return png_bytes(fig, 110)


def _table(frame: pd.DataFrame, meta: Mapping) -> list[str]:
    image, labels = meta["image_attacks"], meta["label_attacks"]
    head = ["value", "accuracy (%)"]
    if meta["defense"] == "dp":
        head += [f"ε train (δ={meta['delta']:g})", "ε attacked client"]
    check = meta["defense"] == "download-check"
    if check:
        head += ["false alarms (honest downloads refused, %)"] + [f"{a} downloads detected (%)" for a in image]
    head += [f"{a.upper()} PSNR (dB) (prior)" for a in image]
    head += [f"{a} class presence" for a in labels]
    if meta.get("membership"):
        head += ["MIA AUC (LiRA, personal)", "MIA TPR@1%FPR", "empirical ε ≥"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in frame.iterrows():
        cells = [str(r["value"]), f"{_fmt(r['accuracy'], pct=True)} ± {_fmt(r['accuracy_std'], pct=True)}"]
        if meta["defense"] == "dp":
            cells += [_fmt_eps(r["epsilon"]), _fmt_eps(r["epsilon_attacked"])]
        if check:
            cells += [_fmt(r.get("false_alarm_rate"), pct=True)] + [_fmt(r.get(f"detection_rate_{a}"), pct=True)
                                                                    for a in image]
        cells += [f"{_fmt(r[f'mean_psnr_{a}'])} ({_fmt(r.get(f'prior_psnr_{a}'))})"
                  + (" MIS-SPECIFIED" if is_true(r.get(f"mis_specified_{a}")) else "") for a in image]
        cells += [_fmt(r.get(f"class_presence_{a}")) for a in labels]
        if meta.get("membership"):
            cells += [_fmt(r.get("mia_auc"), 3), _fmt(r.get("mia_tpr_1pct_fpr"), 3), _fmt(r.get("mia_epsilon_lower_bound"), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _statistics_sentence(m: Mapping) -> str:
    """What the DP statistics mechanism did in this sweep (or that the method has no statistics)."""
    if not m.get("dp_statistics"):
        return f"{m['method']} computes no whole-data statistic: DP-SGD covers all it uploads."
    sigma = "σ of the row" if m.get("stat_noise_multiplier") is None else f"{m['stat_noise_multiplier']:g}"
    clip = m["max_grad_norm"] if m.get("stat_clip") is None else m["stat_clip"]
    return (f"Whole-data statistics go through their own Gaussian mechanism: each sample's feature clipped to "
            f"norm {clip:g}, noise σ_stat·{clip:g} on every class sum, σ_stat·{clip:g}² on the class sums of squared "
            f"norms where a method uses them (FedPAC's V) and σ_stat on the class counts (σ_stat = "
            f"{sigma}; a class is held when its noisy count ≥ max(1, 3σ_stat)); class counts "
            f"{m.get('counts', 'noised')} in the upload; every release is composed in the same accountant. "
            f"Statistics of {m['method']}: {m['dp_statistics']}")


def _attacked_round(meta: Mapping) -> str:
    """The attacked round: "round 0", or "round 0 (<attack>: round 1)" where an attack needs a later one
    (``meta["attack_rounds"]``: {attack: its first attacked round})."""
    rounds = meta.get("attack_rounds") or {}
    later = {a: r for a, r in rounds.items() if r}
    if later and len(later) == len(rounds):
        return "round " + ", ".join(f"{r} ({a})" for a, r in later.items())
    return "round 0" + ("" if not later else " (" + ", ".join(f"{a}: round {r}" for a, r in later.items()) + ")")


def tradeoff_markdown(frame: pd.DataFrame, meta: Mapping, command: str | None, *, value_meaning: str) -> str:
    """``tradeoff.md``: the table, the plot, what the value means (``value_meaning``: the defense's own
    words for its swept value), the DLG claim check, notes."""
    m = meta
    lines = [f"## Defense: {m['defense']} on {m['method']} ({m['dataset']})", "",
             f"Value = {value_meaning}. Each value: train {m['rounds']} rounds × {m['clients']} clients "
             f"({m['partition']}, {m['local_epochs']} local epoch(s), lr {m['lr']:g}, batch {m['batch_size']}, seed "
             f"{m['seed']}) with the defense, then attack {_attacked_round(m)} of a fresh run with the same defense ({m['targets']} "
             f"targets; DLG/IG: each target trains {m['victim_steps']} step(s) on {m['victim_batch']} image(s)).", ""]
    lines += _table(frame, m)
    if any(is_true(v) for a in m["image_attacks"] for v in frame.get(f"mis_specified_{a}", [])):
        lines += ["", "MIS-SPECIFIED: for some target the true images, replayed through the attack's model of the "
                      "client, matched the upload worse than the reconstruction did: that PSNR says nothing about "
                      "the defense's privacy (the attack replays the client's undefended training: it models neither "
                      "the defense's clipping nor its noise)."]
    lines += ["", "![privacy–utility trade-off](tradeoff.png)", ""]
    if m["defense"] == "dp":
        lines.append(f"DP-SGD (Opacus): per-sample clipping to C = {m['max_grad_norm']:g}, Poisson batches "
                     f"(q = batch size / client samples), one {m['accountant'].upper()} accountant per client kept "
                     f"across rounds; ε = the maximum over clients of the cumulative ε of the training run. "
                     f"'ε attacked client' is the victim run's (q = 1, {m['victim_steps']} step(s)). "
                     f"Per-sample terms of {m['method']}: {m['dp_per_sample']}")
        lines += ["", _statistics_sentence(m)]
    elif m["defense"] == "download-check":
        lines.append("Client-side download check: before training, each client tests the first linear layer it received "
                     "(rows pointing one way, units its own images never fire, a jump from its previous download) and "
                     "the classifier where it receives one (a jump from its previous download), and refuses the "
                     "download, sitting the round out. False alarms: honest downloads refused in the row's "
                     "training (an honest server); detected: the attack's crafted downloads refused (a refused client "
                     "uploads nothing, so the attack has no image to score). No formal guarantee, so no ε.")
    else:
        lines.append("Channel filter on the client's update Δ (upload − download; for a kept personal classifier, "
                     "upload − the client's previous upload); no formal guarantee, so no ε.")
    check = claim_check(frame, m)
    if check:
        lines += ["", check]
    if "notes" in frame.columns:
        lines += [f"- value {r['value']}: {r['notes']}" for _, r in frame.iterrows()
                  if isinstance(r.get("notes"), str) and r["notes"]]
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"
