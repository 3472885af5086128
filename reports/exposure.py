"""The exposure matrix: what leaks, for which method, under which threat, in one verdict word per cell.

One function builds it (``exposure_matrix``) from a flat list of evidence: one figure each, with its
interval, the level an uninformed guess reaches on the same metric (the prior or chance level), and the
attack's own checks. The results page (``bench/results.py``) and ``fedsec report`` (``reports.comparison``)
both call it, so both show the same words by the same rule. Standard library only: importing this module
pulls in neither torch nor pandas.

The rule (``judge``), in order:

* **REFUSED**: the attack does not apply or the method refuses the setting (a method whose server reads
  each client's upload refuses secure aggregation; a malicious download FedProto never trains from).
* **EXPOSED**: the interval's lower end is above the prior (chance level). An attack whose optimiser
  stopped short is still EXPOSED, "at least": the true leakage can only be higher.
* **NO MODEL**: not above the prior, and the method uploads no model the attack can use (FedProto against
  weight attacks): a surrogate-model estimate, or no figure at all.
* **LOWER BOUND**: not above the prior while the optimiser stopped short on some target (its objective at
  the reconstruction above its objective at the truth): the true leakage may be higher.
* **NOT SHOWN**: at the prior with the optimiser reaching the truth's objective level on every target.
* **n/a** with the reason: no figure, no interval, no prior, a MIS-SPECIFIED attack (its forward model
  was wrong: the figure says nothing about the method) or a record that does not say whether the
  optimiser stopped short. Never a guess.

Chance levels for the metrics without a per-cell prior: LiRA AUC 0.5; the share of images recovered, of
inputs rebuilt exactly and of label counts read exactly 0 (an uninformed guess rebuilds nothing exactly);
class-presence accuracy against the label prior recorded with it (none recorded: n/a).

The column "exact batch recovery" holds the share of a batch's layer inputs that an exact attack (SPEAR)
recovered within its rule, against 0: that attack has no optimiser, so it never stops short.

Paired comparisons follow the same rule (``paired_verdict``): "A leaks more than B" holds where the
interval of A − B lies above 0, unless the side the interval puts lower, the side said to leak less,
stopped short: then it is "undetermined (lower bound)", never "holds".
"""
from __future__ import annotations

import html
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

from .formatting import finite_or_none

EXPOSED, LOWER_BOUND, NOT_SHOWN, NO_MODEL, REFUSED, NA = (
    "EXPOSED", "LOWER BOUND", "NOT SHOWN", "NO MODEL", "REFUSED", "n/a")
VERDICTS = (EXPOSED, LOWER_BOUND, NOT_SHOWN, NO_MODEL, REFUSED, NA)
# the worst exposure first: a leak shown, then one that may be there, then evidence against one, then a
# figure that cannot be judged; an attack that does not apply says nothing where another one measured
RANK = {EXPOSED: 5, LOWER_BOUND: 4, NOT_SHOWN: 3, NO_MODEL: 2, NA: 1, REFUSED: 0}

# the threats, in the matrix's column order: (key, column header, short name for the worst-exposure column)
THREATS = (("round0", "curious server, round 0", "round 0"),
           ("trained", "curious server, trained", "trained"),
           ("real-small", "real local training, small clients", "small clients"),
           ("real-default", "real local training, default-size clients", "default-size clients"),
           ("exact-batch", "exact batch recovery (SPEAR)", "exact batch"),
           ("malicious", "malicious server", "malicious"),
           ("secure", "under secure aggregation", "secure aggregation"),
           ("mia", "membership inference", "membership"))
THREAT_KEYS = tuple(t[0] for t in THREATS)
SMALL_CLIENT_IMAGES = 10  # at most this many training images: "small clients" (published attacks' setting)

# metric: (label, the chance level when the cell records no prior of its own, whether it rebuilds images)
METRICS = {
    "psnr": ("mean PSNR", None, True),
    "recovered": ("recovered", 0.0, True),
    "inputs exact": ("inputs exact", 0.0, True),
    "label counts exact": ("label counts exact", 0.0, False),
    "class presence": ("class-presence accuracy", None, False),
    "auc": ("LiRA AUC", 0.5, False),
}
PERCENT = {"recovered", "inputs exact", "label counts exact"}
DEFAULT_METHODS = ("fedavg", "fedper", "fedpac", "fedproto", "fedecouple")

HOLDS, FAILS, UNDETERMINED = "holds", "does not hold", "undetermined"
UNDETERMINED_LOWER_BOUND = "undetermined (lower bound)"

RULE = ("EXPOSED: the figure's 95 % interval lies above the prior (chance level): leakage shown; \"at least\" "
        "where the optimiser stopped short, since the true leakage can only be higher. LOWER BOUND: not above the "
        "prior while the optimiser stopped short on some target (its objective at the reconstruction above its "
        "objective at the truth): the true leakage may be higher. NOT SHOWN: at the prior with the optimiser "
        "reaching the truth's objective level on every target. NO MODEL: the method uploads no model the attack "
        "can use (FedProto against weight attacks): at most a surrogate-model estimate. REFUSED: the attack does "
        "not apply or the method refuses the setting. n/a: the cell lacks what a verdict needs (the reason is "
        "given). Chance levels: the prior image for PSNR, 0.5 for LiRA AUC, 0 % for shares recovered or exact.")


@dataclass(frozen=True)
class Evidence:
    """One figure for one method under one threat. ``value``, ``low``, ``high``: the figure and its 95 %
    interval (shares as fractions); ``chance``: the prior or chance level (None: the metric's fixed one);
    ``stopped_short``: targets whose optimiser stopped short (None: not recorded; 0 for an attack without an
    optimiser); ``no_model``: targets whose server holds no model of the client; ``refused``: why the attack
    does not apply (then nothing else counts); ``missing``: why there is no figure; ``source``: where the
    figure comes from (a record, a report cell); ``what``: the attack or setting, in a few words."""

    method: str
    threat: str
    source: str
    metric: str = "psnr"
    value: float | None = None
    low: float | None = None
    high: float | None = None
    chance: float | None = None
    stopped_short: int | None = None
    n_targets: int | None = None
    no_model: int = 0
    mis_specified: int = 0
    refused: str | None = None
    missing: str | None = None
    what: str = ""

    def __post_init__(self):
        if self.threat not in THREAT_KEYS:
            raise ValueError(f"unknown threat {self.threat!r}; known: {', '.join(THREAT_KEYS)}")
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; known: {', '.join(METRICS)}")


@dataclass(frozen=True)
class Verdict:
    word: str
    why: str
    evidence: Evidence


def evidence_of(item: Evidence | Mapping) -> Evidence:
    """An ``Evidence`` from itself or from a mapping of its fields (as a JSON round trip leaves it)."""
    if isinstance(item, Evidence):
        return item
    names = {f.name for f in fields(Evidence)}
    unknown = set(item) - names
    if unknown:
        raise ValueError(f"evidence has unknown field {sorted(unknown)[0]!r}")
    return Evidence(**item)


def as_dicts(evidence: Iterable[Evidence]) -> list[dict]:
    return [asdict(e) for e in evidence]


def chance_of(e: Evidence) -> float | None:
    return finite_or_none(e.chance) if e.chance is not None else METRICS[e.metric][1]


def judge(e: Evidence) -> Verdict:
    """The one rule (this module's docstring) applied to one figure."""
    if e.refused:
        return Verdict(REFUSED, e.refused, e)
    value, low, high, chance = finite_or_none(e.value), finite_or_none(e.low), finite_or_none(e.high), chance_of(e)
    if value is None:
        if e.no_model:
            return Verdict(NO_MODEL, e.missing or "the method uploads no model this attack can use", e)
        return Verdict(NA, e.missing or "not measured", e)
    if low is None or high is None:
        return Verdict(NA, "no interval recorded", e)
    if chance is None:
        return Verdict(NA, "no prior (chance level) recorded", e)
    if low > chance:
        notes = ["at least: the optimiser stopped short"] if e.stopped_short else []
        notes += [f"a surrogate-model estimate (NO MODEL on {e.no_model} targets)"] if e.no_model else []
        notes += [f"MIS-SPECIFIED on {e.mis_specified} targets"] if e.mis_specified else []
        return Verdict(EXPOSED, "; ".join(notes), e)
    if e.no_model:
        return Verdict(NO_MODEL, f"the server holds no model of {e.no_model} of {e.n_targets or '?'} targets: a "
                                 f"surrogate-model estimate", e)
    if e.mis_specified:
        return Verdict(NA, f"MIS-SPECIFIED on {e.mis_specified} of {e.n_targets or '?'} targets: the figure says "
                           f"nothing about the method", e)
    if e.stopped_short is None:
        return Verdict(NA, "not above the prior, and the record does not say whether the optimiser stopped short", e)
    if e.stopped_short:
        return Verdict(LOWER_BOUND, f"the optimiser stopped short on {e.stopped_short} of {e.n_targets or '?'} "
                                    f"targets: the true leakage may be higher", e)
    return Verdict(NOT_SHOWN, "", e)


def _number(v: float, metric: str) -> str:
    if metric in PERCENT:
        return f"{100 * v:.0f}"
    return f"{v:.3f}" if metric == "auc" else f"{v:.2f}"


def figure_text(e: Evidence) -> str:
    """The figure in a few words: "17.92 dB [15.80, 20.29], prior 11.08", "recovered 57 % [41, 73]",
    "LiRA AUC 0.551 [0.530, 0.571]"; "" without a figure."""
    value = finite_or_none(e.value)
    if value is None:
        return ""
    low, high = finite_or_none(e.low), finite_or_none(e.high)
    interval = f" [{_number(low, e.metric)}, {_number(high, e.metric)}]" if low is not None and high is not None else ""
    if e.metric == "psnr":
        text = f"{_number(value, e.metric)} dB{interval}"
    else:
        unit = " %" if e.metric in PERCENT else ""
        text = f"{METRICS[e.metric][0]} {_number(value, e.metric)}{unit}{interval}"
    prior = finite_or_none(e.chance)
    if prior is not None:
        text += f", {'label prior' if e.metric == 'class presence' else 'prior'} {_number(prior, e.metric)}"
    return text


def _key(v: Verdict) -> tuple:
    """Which of a cell's verdicts stands for it: the worst word, then images before labels, PSNR before
    shares, then the largest margin above the chance level."""
    chance = chance_of(v.evidence)
    low = finite_or_none(v.evidence.low)
    value = finite_or_none(v.evidence.value)
    margin = (low - chance) if low is not None and chance is not None else (value or 0.0) - (chance or 0.0)
    return (RANK[v.word], METRICS[v.evidence.metric][2], v.evidence.metric == "psnr", margin)


@dataclass(frozen=True)
class Cell:
    """One (method, threat) cell: the verdict that stands for it, and its other verdicts' words."""
    verdict: Verdict | None
    others: tuple[str, ...] = ()

    @property
    def word(self) -> str:
        return self.verdict.word if self.verdict else NA


@dataclass(frozen=True)
class Matrix:
    methods: tuple[str, ...]
    threats: tuple[str, ...]
    cells: dict
    worst: dict


def exposure_matrix(evidence: Iterable[Evidence | Mapping], methods: Sequence[str] = ()) -> Matrix:
    """The exposure matrix of ``evidence``: one row per method (``methods`` first, then FedAvg, FedPer,
    FedPAC, FedProto, FedeCouple and any other method the evidence names, in that order), one column per
    threat (``THREATS``), each cell the worst verdict of its evidence (``judge``, in the order of ``RANK``), and
    per row the worst exposure over its cells."""
    judged = [judge(evidence_of(e)) for e in evidence]
    named = list(dict.fromkeys([*methods, *[m for m in DEFAULT_METHODS if any(v.evidence.method == m for v in judged)],
                                *[v.evidence.method for v in judged]]))
    cells = {}
    for m in named:
        for t in THREAT_KEYS:
            mine = sorted((v for v in judged if v.evidence.method == m and v.evidence.threat == t), key=_key,
                          reverse=True)
            cells[(m, t)] = Cell(mine[0] if mine else None, tuple(v.word for v in mine[1:]))
    worst = {}
    for m in named:
        words = {t: cells[(m, t)].word for t in THREAT_KEYS if cells[(m, t)].verdict is not None}  # measured ones
        top = max(words.values(), key=RANK.get, default=NA)
        worst[m] = (top, tuple(t for t, w in words.items() if w == top and top != NA))
    return Matrix(tuple(named), THREAT_KEYS, cells, worst)


def _of(count: Any, total: Any) -> str:
    return f"{count}/{total}" if total else f"{count}"


def cell_text(cell: Cell) -> str:
    """A matrix cell in a few words: the verdict, its figure, the checks behind the word, where the
    figure comes from, and how many of the cell's other figures are n/a."""
    v = cell.verdict
    if v is None:
        return f"{NA}: not measured"
    e = v.evidence
    figure = figure_text(e)
    notes = []
    if v.word == EXPOSED:
        notes += [f"{_of(e.stopped_short, e.n_targets)} stopped short"] if e.stopped_short else []
        notes += [f"estimate, {NO_MODEL} {_of(e.no_model, e.n_targets)}"] if e.no_model else []
        notes += [f"MIS-SPECIFIED {_of(e.mis_specified, e.n_targets)}"] if e.mis_specified else []
    elif v.word == LOWER_BOUND:
        notes.append(f"{_of(e.stopped_short, e.n_targets)} stopped short")
    elif v.word == NO_MODEL:
        notes.append(f"estimate, {_of(e.no_model, e.n_targets)} targets" if figure else v.why)
    elif v.why:
        notes.append(v.why)
    text = v.word + (" (at least)" if v.word == EXPOSED and e.stopped_short else "")
    text += f": {'; '.join(x for x in [figure, *notes] if x)}" if figure or notes else ""
    where = ", ".join(x for x in (e.what, e.source) if x)
    text += f" ({where})" if where else ""
    n_a = sum(w == NA for w in cell.others)
    return text + (f"; {n_a} more n/a" if n_a else "")


def cell_summary(cell: Cell) -> str:
    """A matrix cell at a glance: the verdict word ("≥" where the optimiser stopped short, so the true
    figure can only be higher) and its figure with the interval; the rest is in ``cell_text``."""
    v = cell.verdict
    if v is None:
        return "not measured"
    e = v.evidence
    value = finite_or_none(e.value)
    if value is None or v.word in (REFUSED, NA):
        return v.word
    low, high = finite_or_none(e.low), finite_or_none(e.high)
    at_least = "≥ " if v.word in (EXPOSED, LOWER_BOUND) and e.stopped_short else ""
    unit = " dB" if e.metric == "psnr" else (" %" if e.metric in PERCENT else "")
    interval = f" [{_number(low, e.metric)}, {_number(high, e.metric)}]" if low is not None and high is not None else ""
    return f"{v.word} {at_least}{_number(value, e.metric)}{unit}{interval}"


def worst_text(matrix: Matrix, method: str) -> str:
    """The row's worst verdict and the threats that carry it (n/a alone: nothing could be judged)."""
    word, threats = matrix.worst[method]
    short = {k: s for k, _, s in THREATS}
    return word if word == NA else f"{word}: {', '.join(short[t] for t in threats)}"


def column_headers(matrix: Matrix, labels: Mapping[str, str] | None = None) -> list[str]:
    names = {k: h for k, h, _ in THREATS}
    names.update(labels or {})
    return ["method", *[names[t] for t in matrix.threats], "worst exposure"]


def matrix_rows(matrix: Matrix, labels: Mapping[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """(header, rows) as plain strings, shared by Markdown and HTML: each cell at a glance."""
    rows = [[m, *[cell_summary(matrix.cells[(m, t)]) for t in matrix.threats], worst_text(matrix, m)]
            for m in matrix.methods]
    return column_headers(matrix, labels), rows


def evidence_rows(matrix: Matrix, labels: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(method, threat, the cell's whole evidence: ``cell_text``) for every measured or refused cell."""
    names = {k: h for k, h, _ in THREATS}
    names.update(labels or {})
    return [(m, names[t], cell_text(matrix.cells[(m, t)])) for m in matrix.methods for t in matrix.threats
            if matrix.cells[(m, t)].verdict is not None]


def _md(text: Any) -> str:
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def matrix_markdown(matrix: Matrix, labels: Mapping[str, str] | None = None) -> str:
    """The matrix (a cell each at a glance), then each cell's evidence in a list."""
    header, rows = matrix_rows(matrix, labels)
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    lines += ["", "Each cell's evidence:", ""]
    lines += [f"* **{_md(m)}**, {_md(t)}: {_md(text)}" for m, t, text in evidence_rows(matrix, labels)]
    return "\n".join(lines)


def matrix_html(matrix: Matrix, labels: Mapping[str, str] | None = None) -> str:
    """The matrix as an HTML table; every string escaped, each cell classed by its verdict word and carrying
    its whole evidence as a tooltip, then the evidence as a list."""
    header, rows = matrix_rows(matrix, labels)
    out = ['<table class="exposure">', "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for m, row in zip(matrix.methods, rows):
        cells = [matrix.cells[(m, t)] for t in matrix.threats]
        tds = [f"<td>{html.escape(row[0])}</td>"]
        tds += [f'<td class="verdict-{html.escape(c.word.lower().replace(" ", "-").replace("/", ""))}" '
                f'title="{html.escape(cell_text(c))}">{html.escape(text)}</td>' for c, text in zip(cells, row[1:-1])]
        tds.append(f"<td>{html.escape(row[-1])}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</table>")
    out.append("<ul class=\"exposure-evidence\">" + "".join(
        f"<li><b>{html.escape(m)}</b>, {html.escape(t)}: {html.escape(text)}</li>"
        for m, t, text in evidence_rows(matrix, labels)) + "</ul>")
    return "\n".join(out)


def verdict_counts(matrix: Matrix) -> dict[str, int]:
    """How many cells carry each verdict word."""
    counts = {w: 0 for w in VERDICTS}
    for cell in matrix.cells.values():
        counts[cell.word] += 1
    return counts


# ------------------------------------------------------------------ paired comparisons

def paired_verdict(low: Any, high: Any, a: str, b: str, a_stopped: Any, b_stopped: Any) -> tuple[str, str]:
    """(verdict, why) of "``a`` leaks more than ``b``" from the 95 % interval [low, high] of a − b and the
    targets where each side's optimiser stopped short (None: not recorded): holds / does not hold where the
    interval excludes 0, "undetermined (lower bound)" where the side it puts lower stopped short (its true
    leakage may be higher, so the order could flip), else undetermined. A higher side that stopped short
    changes nothing: its true figure can only be higher still."""
    lo, hi = finite_or_none(low), finite_or_none(high)
    if lo is None or hi is None:
        return UNDETERMINED, "too few clients for an interval"
    if lo <= 0 <= hi:
        return UNDETERMINED, "the interval straddles 0"
    lower, stopped = (b, b_stopped) if lo > 0 else (a, a_stopped)
    count = finite_or_none(stopped)
    if count is None:
        return UNDETERMINED, f"the record does not say whether {lower}'s optimiser stopped short"
    if count > 0:
        return UNDETERMINED_LOWER_BOUND, (f"{lower}, the side that leaks less, stopped short on {count:.0f} "
                                          f"clients: its true leakage may be higher")
    return (HOLDS, "") if lo > 0 else (FAILS, "")


# ------------------------------------------------------------------ where a report cell belongs

SIZED = re.compile(r"real-n(\d+)")


def cell_threat(cell: str, rnd: int, real_by_default: bool = False) -> str:
    """The threat of an honest server's image cell ``<attack>[@setting]`` at round ``rnd``: its real-training
    cells (``@real``: the clients' own size; ``@real-n<N>``: clients of N images) by size, the others
    (textbook one-step attacks, prototype inversion) by round. ``real_by_default``: a cell without a
    setting attacks the real local training (the attack's default victim setting)."""
    setting = cell.partition("@")[2]
    sized = SIZED.fullmatch(setting)
    if sized:
        return "real-small" if int(sized.group(1)) <= SMALL_CLIENT_IMAGES else "real-default"
    if setting == "real" or (not setting and real_by_default):
        return "real-default"
    return "round0" if int(rnd) == 0 else "trained"
