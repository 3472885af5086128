"""Label-distribution inference: which classes a client holds, and in what proportions.

``label_inference(observation, budget, seed)`` reads the upload through the method's manifest
(field *kinds*, per-class names from the FieldSpec pattern) and uses the most direct source it
finds, named in ``trace["source"]``:

1. ``class_counts`` — a field of kind ``class_counts`` (FedProto's ``class_count.{k}``, FedPAC's
   ``class_counts`` vector): the proportions are exact.
2. ``statistics`` — fields of kind ``statistic``: a (C,) non-negative vector summing to 1 is read
   as the label proportions p_k (exact); a (C, D) matrix is read as FedPAC's h_k = p_k·μ_k: its
   non-zero rows are the classes held, and p_k is estimated as ⟨h_k, c_k⟩/‖c_k‖² with c_k the
   uploaded prototype of class k (FedPAC's prototypes are class means of the trained base, h uses
   the base before training, so this is approximate), or ∝ ‖h_k‖ without prototypes.
3. ``prototype_keys`` — per-class prototype fields: the classes whose prototype was sent are the
   classes held (presence is exact); proportions are uniform over them unless a classifier update
   is also available, which then splits the mass among those classes
   (``prototype_keys+classifier_update``).
4. ``classifier_update`` — the classifier's update Δ = upload − before. For a classifier the
   server sends every round (FedAvg), "before" is this round's download, as for every gradient
   attack (``attacks.inversion.observation.update_target``). For a classifier the client keeps across rounds
   (FedeCouple's personal classifier, ``persistent_groups``), "before" is the federation's
   *initial* classifier (``observation.make_model()``, known to the server; every method here
   starts client state from it): the update then spans the client's whole training history on
   its own labels. Measured from the client's previous upload instead (``reference="round"``),
   the update of an already fitted personal classifier carries little label signal: on digits,
   FedeCouple, 5 clients, 3 classes each, presence accuracy fell from 1.0 in round 0 to 0.6 in
   round 2, while from the initial weights it stayed 1.0 (total variation 0.04-0.09). Not used
   when the threat model says the head is unknown.
5. Nothing else carries labels (FedPer/FedRep upload only the extractor): ``NotApplicable``.

The classifier-update estimator (in the spirit of iDLG's sign rule and LLG, Wainakh et al. 2022,
"User-level label leakage from gradients in federated learning"; our own formulation). For
cross-entropy the last layer's bias gradient on a batch is mean_i(p_ik − 1[y_i = k]), so after
local SGD, Δb_k = lr·Σ_t (π_t,k − p̄_t,k): a class's bias rises when the client's batches hold
more of it than the model predicts. With the weight instead of the bias, the same holds for the
row sums Σ_j ΔW_kj weighted by the (mostly non-negative, LeakyReLU) features. Let s_k be Δb_k
(or the row sum when the classifier has no bias). Classes with s_k ≤ 0 are taken as absent (the
update pushes them down: absent classes, or classes the model already over-predicts). For the
others, s_k ≈ c·(π_k − p̄_k) with an unknown scale c; the offset c·p̄_k is estimated from the
pushed-down classes as o = mean_{s_j<0} (−s_j) (LLG+'s offset, taken from the update itself
instead of auxiliary data, i.e. assuming the model's predicted share is similar across classes),
and π̂_k ∝ s_k + o over the present classes. Proportions are therefore approximate; presence is
the reliable part (see ``tests/test_proto_labels.py``).

Result: ``images`` is an empty (0, C, H, W) tensor and ``labels`` an empty tensor; ``trace`` holds
``label_distribution`` ((C,) float64 proportions summing to 1), ``source`` (above; also as
``mode``), ``present_classes`` (proportion > 1/(2C), the scoring rule), ``support`` (proportion
> 0), ``label_counts`` (exact counts, or proportions × the uploaded sample count when there is
one), ``classifier_scores`` (s_k, when used) and ``seconds``.

Scoring a prediction against the client's true class counts is ``attacks.metrics.score_label_distribution``.
"""
from __future__ import annotations

import time

import torch

from fedecouple.methods.base import FieldSpec

from ..base import AttackResult, Budget, NotApplicable, Observation
from ..metrics import presence_threshold
from .prototypes import per_class_values, uploaded_prototypes

PROPORTION_TOLERANCE = 1e-3


def _empty_images(observation: Observation) -> torch.Tensor:
    return torch.zeros((0, *tuple(int(v) for v in observation.image_shape)))


def _normalise(weights: torch.Tensor) -> torch.Tensor:
    weights = weights.to(torch.float64).clamp_min(0.0)
    total = float(weights.sum())
    if total <= 0:
        return torch.full_like(weights, 1.0 / len(weights))
    return weights / total


# ------------------------------------------------------------------------------------------------
# sources


def counts_from_upload(observation: Observation, manifest: list[FieldSpec]) -> torch.Tensor | None:
    """(C,) class counts from fields of kind ``class_counts`` (per-class scalars or one vector)."""
    c = observation.num_classes
    specs = [s for s in manifest if s.kind == "class_counts"]
    counts = torch.zeros(c, dtype=torch.float64)
    found = False
    for k, v in per_class_values(observation.upload, [s for s in specs if s.per_class]).items():
        if 0 <= k < c:
            counts[k] = float(v.sum())
            found = True
    for spec in specs:
        if not spec.per_class and spec.name in observation.upload:
            vec = observation.upload[spec.name].detach().to(torch.float64).flatten()
            if vec.numel() == c:
                counts = vec.clone()
                found = True
    return counts if found and float(counts.sum()) > 0 else None


def proportions_from_statistics(observation: Observation, manifest: list[FieldSpec]) -> tuple[torch.Tensor, str] | None:
    """(proportions, how) from fields of kind ``statistic`` (see the module docstring)."""
    c = observation.num_classes
    tensors = {}
    for spec in (s for s in manifest if s.kind == "statistic"):
        if spec.per_class:
            values = per_class_values(observation.upload, [spec])
            if values and all(v.numel() == 1 for v in values.values()):
                vec = torch.zeros(c, dtype=torch.float64)
                for k, v in values.items():
                    if 0 <= k < c:
                        vec[k] = float(v)
                tensors[spec.name] = vec
            elif values:
                dim = next(iter(values.values())).numel()
                mat = torch.zeros(c, dim, dtype=torch.float64)
                for k, v in values.items():
                    if 0 <= k < c and v.numel() == dim:
                        mat[k] = v.detach().to(torch.float64).flatten()
                tensors[spec.name] = mat
        elif spec.name in observation.upload:
            tensors[spec.name] = observation.upload[spec.name].detach().to(torch.float64)
    for name, t in tensors.items():  # a label-proportion vector: exact
        if t.ndim == 1 and t.numel() == c and bool((t >= 0).all()) and abs(float(t.sum()) - 1.0) < PROPORTION_TOLERANCE:
            return t.clone(), f"statistic '{name}' is the label-proportion vector p_k"
    for name, t in tensors.items():  # h_k = p_k·μ_k
        if t.ndim == 2 and t.shape[0] == c:
            present = t.abs().sum(dim=1) > 0
            if not bool(present.any()):
                continue
            protos = uploaded_prototypes(observation, manifest)
            weights = torch.zeros(c, dtype=torch.float64)
            use_protos = all(k in protos and protos[k].numel() == t.shape[1] for k in torch.nonzero(present).flatten().tolist())
            for k in torch.nonzero(present).flatten().tolist():
                if use_protos:
                    proto = protos[k].to(torch.float64)
                    weights[k] = max(float(t[k] @ proto) / max(float(proto @ proto), 1e-12), 0.0)
                else:
                    weights[k] = float(t[k].norm())
            if float(weights.sum()) <= 0:
                weights = present.to(torch.float64)
            how = ("p_k ≈ <h_k, c_k>/|c_k|^2 with the uploaded prototypes c_k" if use_protos
                   else "p_k ∝ |h_k| (no prototypes to divide by)")
            return _normalise(weights), f"statistic '{name}' is h_k = p_k·μ_k: non-zero rows are the classes held; {how}"
    return None


def classifier_scores(observation: Observation, reference: str = "auto") -> tuple[torch.Tensor, str, list[str]] | None:
    """(s_k, what was used, notes) from the classifier's update, or None when there is none usable.

    ``reference`` is the before-state the update is measured from: ``"round"`` — this round's
    before-state as every gradient attack uses it (``attacks.inversion.observation.update_target``);
    ``"initial"`` — the federation's initial classifier (``observation.make_model()``);
    ``"auto"`` — ``initial`` for a classifier the client keeps across rounds (its whole training
    history on its own labels, see the module docstring), ``round`` otherwise."""
    from .observation import update_target  # the before-state rules every gradient attack uses

    if reference not in ("auto", "round", "initial"):
        raise ValueError(f"unknown reference {reference!r}; choose auto, round or initial")
    c = observation.num_classes
    persistent = "classifier" in observation.method.persistent_groups
    if reference == "initial" or (reference == "auto" and persistent):
        initial = {n: p.detach() for n, p in observation.make_model().named_parameters() if n.startswith("classifier.")}
        delta = {n: observation.upload[n].detach().to(torch.float64) - v.to(torch.float64)
                 for n, v in initial.items() if n in observation.upload and observation.upload[n].shape == v.shape}
        if not delta:
            return None
        notes = [("the client keeps its classifier across rounds: its update is measured from the federation's "
                  "initial classifier (known to the server), i.e. over the client's whole training history")
                 if persistent else "the classifier's update is measured from the federation's initial classifier"]
        label = "the classifier since the initial weights"
    else:
        try:
            target = update_target(observation)
        except NotApplicable:
            return None
        if not target.classifier_update:
            return None
        delta = {n: d.to(torch.float64) for n, d in target.delta.items() if n.startswith("classifier.")}
        notes = list(target.notes)
        label = "the classifier in this round"
    bias = [n for n, d in delta.items() if n.endswith("bias") and d.ndim == 1 and d.numel() == c]
    if bias:
        return delta[bias[0]], f"{bias[0]} ({label})", notes
    weight = [n for n, d in delta.items() if d.ndim == 2 and d.shape[0] == c]
    if weight:
        return delta[weight[0]].sum(dim=1), f"{weight[0]} row sums ({label})", notes
    return None


def proportions_from_scores(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """π̂ from the per-class update scores s_k (see the module docstring).

    ``allowed`` (a boolean (C,) mask, e.g. the classes whose prototypes were sent) fixes the
    support: the offset is then taken from the classes known to be absent, and the mass is split
    over the allowed classes by s_k + offset (uniformly if that is nowhere positive)."""
    s = scores.to(torch.float64)
    if allowed is not None:
        absent = ~allowed
        reference = absent if bool(absent.any()) else s < 0
        offset = float((-s[reference]).clamp_min(0.0).mean()) if bool(reference.any()) else 0.0
        weights = torch.where(allowed, (s + offset).clamp_min(0.0), torch.zeros_like(s))
        return _normalise(weights if float(weights.sum()) > 0 else allowed.to(torch.float64))
    present = s > 0
    if not bool(present.any()):
        return torch.full_like(s, 1.0 / len(s))
    pushed_down = s < 0
    offset = float((-s[pushed_down]).mean()) if bool(pushed_down.any()) else 0.0
    return _normalise(torch.where(present, s + offset, torch.zeros_like(s)))


def _kinds_sent(observation: Observation, manifest: list[FieldSpec]) -> list[str]:
    kinds = []
    for spec in manifest:
        if any(spec.pattern.match(k) for k in observation.upload) and spec.kind not in kinds:
            kinds.append(spec.kind)
    return kinds


# ------------------------------------------------------------------------------------------------
# the attack


def label_inference(observation: Observation, budget: Budget, seed: int, reference: str = "auto") -> AttackResult:
    """Predicted class proportions of the client's training data; see the module docstring.

    ``budget`` and ``seed`` are unused (the inference is analytic and deterministic); ``reference``
    chooses the classifier's before-state (``classifier_scores``)."""
    start = time.perf_counter()
    c = observation.num_classes
    manifest = observation.manifest()
    notes: list[str] = []
    trace: dict = {}

    counts = counts_from_upload(observation, manifest)
    if counts is not None:
        distribution, source = _normalise(counts), "class_counts"
        trace["label_counts"] = counts
        notes.append(f"{observation.method.name} uploads per-class sample counts: the label distribution is read exactly")
    else:
        stats = proportions_from_statistics(observation, manifest)
        protos = uploaded_prototypes(observation, manifest) if any(s.kind == "prototype" for s in manifest) else {}
        if stats is not None:
            distribution, how = stats
            source = "statistics"
            notes.append(f"read from the uploaded statistics: {how}")
        elif protos:
            allowed = torch.zeros(c, dtype=torch.bool)
            allowed[[k for k in protos if 0 <= k < c]] = True
            cls = classifier_scores(observation, reference) if observation.head_known else None
            if cls is not None:
                scores, which, cls_notes = cls
                distribution = proportions_from_scores(scores, allowed)
                source = "prototype_keys+classifier_update"
                trace["classifier_scores"] = scores
                notes += cls_notes
                notes.append(f"classes held = the classes whose prototypes were sent; proportions among them from "
                             f"the update of {which}")
            else:
                distribution = _normalise(allowed.to(torch.float64))
                source = "prototype_keys"
                notes.append("classes held = the classes whose prototypes were sent (exact presence); the upload "
                             "carries nothing about proportions, so they are uniform over those classes")
        else:
            cls = classifier_scores(observation, reference) if observation.head_known else None
            if cls is None:
                sent = [k for k in _kinds_sent(observation, manifest) if k != "sample_count"]
                why = ("the threat model treats the head as unknown" if not observation.head_known
                       and "classifier" in sent else
                       f"it uploads only: {', '.join(sent) or 'nothing'}")
                raise NotApplicable(f"{observation.method.name}'s upload carries no label information: no class counts, "
                                    f"label statistics, prototypes or classifier update ({why}).")
            scores, which, cls_notes = cls
            distribution = proportions_from_scores(scores)
            source = "classifier_update"
            trace["classifier_scores"] = scores
            notes += cls_notes
            notes.append(f"estimated from the update of {which}: classes whose output the update raises are taken "
                         f"as present, proportions from the size of the rise (approximate)")
    sample_count = observation.upload.get("sample_count")
    if "label_counts" not in trace and sample_count is not None:
        trace["label_counts"] = distribution * float(sample_count)
    trace.update({"label_distribution": distribution.to(torch.float64), "source": source,
                  "present_classes": torch.nonzero(distribution > presence_threshold(c)).flatten().tolist(),
                  "support": torch.nonzero(distribution > 0).flatten().tolist(),
                  "mode": source, "seconds": time.perf_counter() - start})
    return AttackResult(images=_empty_images(observation), labels=torch.zeros(0, dtype=torch.int64),
                        trace=trace, notes=notes)
