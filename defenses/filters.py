"""Upload filters: client-side defenses that transform an upload before it leaves the client.

A ``FilterChain`` is one channel ``Interceptor`` that applies an ordered list of ``UploadFilter``
objects to every upload (composition = list order). It sits at the client's end of the channel: it
sees each download on its way to the client (``on_download``) and remembers it per
(round, client), so that on the way back it can work on the client's *update* Δ rather than on the
raw upload. Like every interceptor it only ever receives copies (``ServerChannel`` hands each
interceptor its own deep copy) and returns a new ``Upload``; nothing it does reaches client state.
The channel's ``Recorder`` stores uploads after all interceptors, i.e. what the server sees is the
filtered upload.

What Δ means for each uploaded field (the filter's *reference*, ``upload = reference + Δ``):

* model weights (manifest kinds ``extractor``/``classifier``) that the client received in this
  round's download: Δ = upload − download (the local update);
* model weights of the method's ``persistent_groups`` (parts the client keeps between rounds,
  e.g. FedeCouple's personal classifier): Δ = upload − the client's previous upload of that field
  as it entered the chain (= the client's own value before this round's local training); when the
  chain has seen no previous upload, the download's value if it carries the field (exact in round
  0, where the personal classifier starts at the global one), else the value itself;
* model weights with no download counterpart and no previous upload: Δ = the value itself;
* everything else — prototypes, class counts, statistics, sample counts — has no meaningful
  "before" on the client: Δ = the value itself (a filter on them acts on the values).

Filters act on floating-point fields of the kinds they select (default: the model weights,
``extractor`` and ``classifier``); integer fields (sample and class counts) are touched only by
``Exclude``. Each filter returns a record of what it did for every (round, client): fields touched,
L2 norm of the selected Δ before/after, fraction of entries that are zero after, σ used, levels.
``FilterChain.log`` holds them in order. Noise is drawn from a generator seeded by
(chain seed, round, client, filter position), so runs are reproducible.

The end of the module defines the specs of the filters ``fedsec defend`` sweeps (``NOISE``, ``CLIP``,
``PRUNE``, ``QUANTIZE``, ``EXCLUDE``: one filter at the swept value), which ``defenses.DEFENSES`` declares.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Sequence

import torch

from fedecouple.channel import Download, Interceptor, Upload
from fedecouple.engine import derive_seed
from fedecouple.errors import UserError
from fedecouple.methods.base import KINDS

from .registry import DefendedRun, DefenseSpec, non_negative, number

WEIGHT_KINDS = ("extractor", "classifier")


def infer_kind(name: str) -> str:
    """A field's kind from its name, when no manifest says otherwise."""
    head = name.split(".", 1)[0]
    if head in WEIGHT_KINDS:
        return head
    if head == "prototype":
        return "prototype"
    if head in ("class_count", "class_counts"):
        return "class_counts"
    if head == "sample_count":
        return "sample_count"
    return "statistic"


def kind_resolver(manifest=None):
    """name → kind, from a method manifest (``FieldSpec`` list) where it lists the field."""
    specs = list(manifest or ())

    def resolve(name: str) -> str:
        for spec in specs:
            if spec.pattern.match(name):
                return spec.kind
        return infer_kind(name)

    return resolve


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    parts = [t.reshape(-1).to(torch.float64) for t in tensors]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return float(_flat(tensors).norm())


class UploadFilter:
    """One transformation of the deltas of an upload. Subclasses implement ``transform``.

    ``kinds`` selects the field kinds acted on (default: model weights); ``fields`` (fnmatch
    patterns such as ``"extractor.*"``) narrows the selection further. Only floating-point
    tensors are ever selected.
    """

    name = "filter"

    def __init__(self, kinds: Sequence[str] | None = WEIGHT_KINDS, fields: Sequence[str] | None = None):
        unknown = sorted(set(kinds or ()) - set(KINDS))
        if unknown:
            raise UserError(f"unknown field kind {', '.join(unknown)}; kinds are: {', '.join(KINDS)}")
        self.kinds = None if kinds is None else tuple(kinds)
        self.fields = None if fields is None else tuple(fields)

    def params(self) -> dict:
        return {}

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({args})"

    def selected(self, deltas: Mapping[str, torch.Tensor], kinds: Mapping[str, str]) -> list[str]:
        out = []
        for name, value in deltas.items():
            if not torch.is_floating_point(value):
                continue
            if self.kinds is not None and kinds[name] not in self.kinds:
                continue
            if self.fields is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.fields):
                continue
            out.append(name)
        return out

    def apply(self, deltas: dict[str, torch.Tensor], kinds: Mapping[str, str],
              generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict]:
        """New deltas (never the tensors handed in, modified) and a record of what was done."""
        names = self.selected(deltas, kinds)
        before = [deltas[n] for n in names]
        record = {"filter": self.name, **self.params(), "fields": len(names), "norm_before": _norm(before)}
        if names:
            changed, extra = self.transform({n: deltas[n] for n in names}, generator)
        else:
            changed, extra = {}, {"note": "no field selected"}
        out = dict(deltas)
        out.update(changed)
        after = _flat(out[n] for n in names)
        record.update(extra)
        record["norm_after"] = float(after.norm())
        record["fraction_zero"] = float((after == 0).double().mean()) if after.numel() else 0.0
        record["field_names"] = names
        return out, record

    def transform(self, deltas: dict[str, torch.Tensor], generator: torch.Generator) -> tuple[dict, dict]:
        raise NotImplementedError


class GaussianNoise(UploadFilter):
    """Δ ← Δ + N(0, σ²) on every selected entry. ``sigma`` is absolute; or ``relative`` gives
    σ = relative × the ``percentile``-th percentile of |Δ| over the selected entries (NVIDIA
    FLARE's noise scaled to a percentile of |Δ|)."""

    name = "noise"

    def __init__(self, sigma: float | None = None, relative: float | None = None, percentile: float = 95.0, **kw):
        super().__init__(**kw)
        if (sigma is None) == (relative is None):
            raise UserError("noise filter: give exactly one of sigma (absolute) or relative")
        value = sigma if sigma is not None else relative
        if not (value >= 0 and math.isfinite(value)):
            raise UserError(f"noise filter: sigma must be a finite number >= 0, got {value}")
        if not 0 <= percentile <= 100:
            raise UserError(f"noise filter: percentile must be in [0, 100], got {percentile}")
        self.sigma, self.relative, self.percentile = sigma, relative, float(percentile)

    def params(self) -> dict:
        return {"sigma": self.sigma} if self.sigma is not None else {"relative": self.relative,
                                                                     "percentile": self.percentile}

    def transform(self, deltas, generator):
        if self.sigma is not None:
            sigma = float(self.sigma)
        else:
            flat = _flat(deltas.values()).abs()
            sigma = float(self.relative) * (float(torch.quantile(flat, self.percentile / 100)) if flat.numel() else 0.0)
        out = {}
        for n, d in deltas.items():
            noise = torch.randn(d.shape, generator=generator, dtype=torch.float64) * sigma
            out[n] = (d.to(torch.float64) + noise).to(d.dtype)
        return out, {"sigma": sigma}


class NormClip(UploadFilter):
    """Δ ← Δ · min(1, C / ‖Δ‖), the L2 norm taken jointly over all selected fields."""

    name = "clip"

    def __init__(self, max_norm: float, **kw):
        super().__init__(**kw)
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise UserError(f"clip filter: the norm bound must be a positive number, got {max_norm}")
        self.max_norm = float(max_norm)

    def params(self) -> dict:
        return {"max_norm": self.max_norm}

    def transform(self, deltas, generator):
        norm = _norm(deltas.values())
        factor = min(1.0, self.max_norm / norm) if norm > 0 else 1.0
        return {n: d * factor for n, d in deltas.items()}, {"scale": factor}


class Prune(UploadFilter):
    """Zero exactly round(p/100 · N) of the N selected entries of Δ: those of smallest |Δ| (ties
    broken by position), jointly over all selected fields. With ``gamma`` the survivors are also
    clipped to ±γ (NVIDIA FLARE's percentile privacy)."""

    name = "prune"

    def __init__(self, percent: float, gamma: float | None = None, **kw):
        super().__init__(**kw)
        if not 0 <= percent <= 100:
            raise UserError(f"prune filter: percent must be in [0, 100], got {percent}")
        if gamma is not None and not gamma > 0:
            raise UserError(f"prune filter: gamma must be positive, got {gamma}")
        self.percent, self.gamma = float(percent), gamma

    def params(self) -> dict:
        return {"percent": self.percent} if self.gamma is None else {"percent": self.percent, "gamma": self.gamma}

    def transform(self, deltas, generator):
        names = list(deltas)
        flat = torch.cat([deltas[n].reshape(-1) for n in names])
        k = int(round(self.percent / 100 * flat.numel()))
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        if k:
            order = torch.argsort(flat.abs(), stable=True)
            keep[order[:k]] = False
        pruned = torch.where(keep, flat, torch.zeros_like(flat))
        if self.gamma is not None:
            pruned = pruned.clamp(-self.gamma, self.gamma)
        out, pos = {}, 0
        for n in names:
            size = deltas[n].numel()
            out[n] = pruned[pos:pos + size].reshape(deltas[n].shape).clone()
            pos += size
        return out, {"zeroed": k, "entries": int(flat.numel())}


class Quantize(UploadFilter):
    """Uniform quantisation of each selected Δ tensor to 2^bits levels spanning [min, max] of that
    tensor (round to nearest). The server needs min and max per tensor (2 floats) to decode."""

    name = "quantize"

    def __init__(self, bits: int, **kw):
        super().__init__(**kw)
        if int(bits) != bits or not 1 <= bits <= 32:
            raise UserError(f"quantize filter: bits must be an integer in 1..32, got {bits}")
        self.bits = int(bits)

    def params(self) -> dict:
        return {"bits": self.bits}

    def transform(self, deltas, generator):
        levels = 2 ** self.bits
        out, used = {}, 0
        for n, d in deltas.items():
            x = d.to(torch.float64)
            if x.numel() == 0 or float(x.min()) == float(x.max()):
                out[n] = d.clone()
                used = max(used, 1 if x.numel() else 0)
                continue
            lo, hi = float(x.min()), float(x.max())
            step = (hi - lo) / (levels - 1)
            q = torch.round((x - lo) / step).clamp(0, levels - 1)
            out[n] = (lo + q * step).to(d.dtype)
            used = max(used, int(torch.unique(q).numel()))
        return out, {"levels": levels, "max_levels_used": used}


class Exclude(UploadFilter):
    """Drop fields from the upload: every field whose kind is in ``kinds`` or whose name matches
    one of the fnmatch patterns in ``fields`` (any dtype). The server must be able to aggregate
    without them (e.g. FedPAC without prototypes; not FedAvg without its classifier)."""

    name = "exclude"

    def __init__(self, fields: Sequence[str] = (), kinds: Sequence[str] = ()):
        super().__init__(kinds=kinds, fields=None)
        self.patterns = tuple(fields)
        if not self.patterns and not self.kinds:
            raise UserError("exclude filter: name at least one field pattern or kind")

    def params(self) -> dict:
        return {"fields": list(self.patterns), "kinds": list(self.kinds or ())}

    def apply(self, deltas, kinds, generator):
        gone = [n for n in deltas
                if kinds[n] in (self.kinds or ()) or any(fnmatch.fnmatchcase(n, p) for p in self.patterns)]
        out = {n: d for n, d in deltas.items() if n not in gone}
        return out, {"filter": self.name, **self.params(), "fields": len(gone), "field_names": gone,
                     "excluded": gone, "norm_before": float("nan"), "norm_after": float("nan"),
                     "fraction_zero": float("nan")}


class FilterChain(Interceptor):
    """Applies ``filters`` in order to every upload's Δ (see the module docstring for Δ).

    ``manifest`` (the method's ``FieldSpec`` list) gives each field's kind; ``persistent_groups``
    are the method's parameter groups kept on the client between rounds.
    """

    name = "filters"

    def __init__(self, filters: Sequence[UploadFilter], persistent_groups: Sequence[str] = (), manifest=None,
                 seed: int = 0):
        self.filters = list(filters)
        self.persistent_groups = tuple(persistent_groups)
        self.kind_of = kind_resolver(manifest)
        self.seed = int(seed)
        self.log: list[dict] = []
        self._downloads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._previous: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def for_method(cls, filters: Sequence[UploadFilter], method, model, seed: int = 0) -> "FilterChain":
        """A chain for ``method``'s uploads: its manifest gives the field kinds, its persistent groups
        the reference of Δ."""
        return cls(filters, method.persistent_groups, method.manifest(model), seed)

    def describe(self) -> str:
        return " → ".join(f.describe() for f in self.filters) or "none"

    def on_download(self, message: Download) -> Download:
        self._downloads[(message.round, message.client_id)] = dict(message.tensors)  # already our own copy
        return message

    def reference(self, name: str, kind: str, download: Mapping[str, torch.Tensor],
                  previous: Mapping[str, torch.Tensor], value: torch.Tensor) -> tuple[torch.Tensor | None, str]:
        """(reference, basis) for one field: ``upload = reference + Δ`` (None: Δ is the value)."""
        if kind not in WEIGHT_KINDS or not torch.is_floating_point(value):
            return None, "value"
        group = name.split(".", 1)[0]
        candidates = [(previous, "previous upload"), (download, "download")] if group in self.persistent_groups \
            else [(download, "download"), (previous, "previous upload")]
        for source, basis in candidates:
            ref = source.get(name)
            if ref is not None and ref.shape == value.shape:
                return ref.to(value.dtype), basis
        return None, "value"

    def on_upload(self, message: Upload) -> Upload:
        key = (message.round, message.client_id)
        download = self._downloads.pop(key, {})
        previous = self._previous.get(message.client_id, {})
        kinds = {n: self.kind_of(n) for n in message.tensors}
        refs, deltas, bases = {}, {}, {}
        for name, value in message.tensors.items():
            ref, basis = self.reference(name, kinds[name], download, previous, value)
            refs[name], bases[name] = ref, basis
            deltas[name] = value if ref is None else value - ref
        kept = {n: v.clone() for n, v in message.tensors.items()
                if kinds[n] in WEIGHT_KINDS and n.split(".", 1)[0] in self.persistent_groups}
        if kept:
            self._previous[message.client_id] = kept
        for position, flt in enumerate(self.filters):
            gen = torch.Generator().manual_seed(derive_seed(self.seed, message.round, message.client_id, position))
            deltas, record = flt.apply(deltas, kinds, gen)
            record.update({"round": message.round, "client": message.client_id, "position": position,
                           "basis": sorted({bases[n] for n in record.get("field_names", [])})})
            self.log.append(record)
        tensors = {}
        for name, delta in deltas.items():
            ref = refs[name]
            value = delta if ref is None else ref + delta
            tensors[name] = value.to(message.tensors[name].dtype)
        return replace(message, tensors=tensors)

    def summary(self) -> list[dict]:
        """Per filter position: mean norm before/after, mean fraction zero, mean σ, fields excluded."""
        out = []
        for position, flt in enumerate(self.filters):
            recs = [r for r in self.log if r["position"] == position]
            row = {"filter": flt.describe(), "uploads": len(recs)}
            for key in ("norm_before", "norm_after", "fraction_zero", "sigma"):
                vals = [r[key] for r in recs if key in r and r[key] == r[key]]
                if vals:
                    row[f"mean_{key}"] = float(sum(vals) / len(vals))
            excluded = sorted({n for r in recs for n in r.get("excluded", [])})
            if excluded:
                row["excluded"] = excluded
            out.append(row)
        return out


# ---------------------------------------------------------------------------------------------
# the sweep's defenses: one filter at the swept value


def _chain(flt: UploadFilter, run: DefendedRun) -> tuple[FilterChain, list]:
    """(``flt`` as the run's upload filter, the method's manifest): the manifest gives the field kinds,
    the persistent groups the reference of Δ (``FilterChain.for_method``)."""
    manifest = run.method.manifest(run.model())
    return FilterChain([flt], run.method.persistent_groups, manifest, seed=run.seed), manifest


def weight_filter(make: Callable[[object, DefendedRun], UploadFilter]):
    """The build of a filter on the update Δ of the model weights; refuses a method that uploads none."""
    def build(value, run: DefendedRun) -> FilterChain:
        flt = make(value, run)
        chain, manifest = _chain(flt, run)
        if not any(spec.kind in WEIGHT_KINDS for spec in manifest):
            raise UserError(f"{run.method.name} uploads no model weights: the {flt.name} filter (on the update Δ of "
                            f"the weights) has nothing to act on; use --defense exclude")
        return chain

    return build


def build_exclude(value: str, run: DefendedRun) -> FilterChain:
    """``value`` a field kind or an fnmatch pattern of field names; refuses one the method never uploads."""
    chain, manifest = _chain(Exclude(kinds=[value]) if value in KINDS else Exclude(fields=[value]), run)
    names = [spec.name.format(k=0) if spec.per_class else spec.name for spec in manifest]
    if value in KINDS:
        if not any(spec.kind == value for spec in manifest):
            raise UserError(f"{run.method.name} uploads no field of kind {value!r}; its kinds: "
                            f"{', '.join(sorted({s.kind for s in manifest}))}")
    elif not any(fnmatch.fnmatchcase(n, value) for n in names):
        raise UserError(f"--values {value!r} matches no field {run.method.name} uploads (fields: "
                        f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}; or a kind: {', '.join(KINDS)})")
    return chain


def _bounded(check: Callable[[float], bool], rule: str, integer: bool = False) -> Callable[[str], float | int]:
    """A ``--values`` parser: a number that ``check`` accepts (``rule``: the reason when it does not)."""
    def parse(item: str):
        value = number(item, integer)
        if not check(value):
            raise ValueError(f"{rule}, got {item}")
        return value

    return parse


def _filtered(chain: FilterChain, clients) -> dict:
    return {"kind": "filter", "filters": chain.summary()}


def _noise(value, run: DefendedRun) -> GaussianNoise:
    """The value is the variance v of the noise on the gradient the server reads, g = −Δ/lr (the DLG
    paper's unit): σ on Δ is lr·√v."""
    return GaussianNoise(sigma=run.lr * math.sqrt(float(value)))


NOISE = DefenseSpec("noise", "variance v of the noise on the gradient −Δ/lr (σ on Δ = lr·√v)", acts="upload",
                    formal=False, parse=non_negative, build=weight_filter(_noise), report=_filtered)
CLIP = DefenseSpec("clip", "bound on the L2 norm of Δ", acts="upload", formal=False,
                   parse=_bounded(lambda v: v > 0, "(a norm bound) must be positive"),
                   build=weight_filter(lambda value, run: NormClip(float(value))), report=_filtered)
PRUNE = DefenseSpec("prune", "percent of the entries of Δ zeroed (smallest |Δ| first)", acts="upload", formal=False,
                    parse=_bounded(lambda v: 0 <= v <= 100, "are percentages in [0, 100]"),
                    build=weight_filter(lambda value, run: Prune(float(value))), report=_filtered)
QUANTIZE = DefenseSpec("quantize", "bits per entry of Δ (2^k levels per tensor)", acts="upload", formal=False,
                       parse=_bounded(lambda v: 1 <= v <= 32, "are bits in 1..32", integer=True),
                       build=weight_filter(lambda value, run: Quantize(int(value))), report=_filtered)
EXCLUDE = DefenseSpec("exclude", "field kind or name pattern dropped from every upload", acts="upload", formal=False,
                      parse=str, build=build_exclude, report=_filtered)
