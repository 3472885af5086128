"""Classifier fishing (Wen et al., "Fishing for User Data in Large-Batch Federated Learning", ICML 2022).

The server rewrites the classifier it sends one client so that one class's (or one feature's)
images are the only ones whose gradient reaches the extractor; the client's update of a whole
batch is then the update of those images alone, and the server inverts it.

Craft (``fishing_download``; a pure function of the honest download, a model of the architecture,
public labelled images and the client's label counts the server read from its earlier upload):

* the target class t is the client's rarest present class (k its count, as the server estimated it);
* *class fishing* (k = 1): every row but t's is zeroed and given the bias ``FISH_BIAS``; row t stays
  as sent. For an image of another class y, ∂L/∂h = Σ_c W_c (p_c − 1[c = y]) = p_t·w_t and p_t =
  exp(z_t − FISH_BIAS)/… is 0 in float32: no gradient reaches the extractor. For a class-t image
  p_t = 0, so ∂L/∂h = −w_t, ∂L/∂W_t = −h and ∂L/∂b_t = −1: row t's weight update over its bias
  update is the fished image's feature h, and the bias update counts the fished images (lr·k/B);
* *feature fishing* (k ≥ 2): row t = s·v, bias log(C − 1) − s·τ, every other row and bias 0, so the
  logit margin z_t − logsumexp(others) = s·(v·h − τ): an image with v·h > τ has p_t ≈ 1 (a class-t
  image then sends no gradient: p_t − 1 ≈ 0), one with v·h < τ has p_t ≈ 0 (a class-t image is
  fished, another class's sends p_t·s·v ≈ 0). The same sign of p_t silences both other classes and
  fished images, so no threshold can split class t without every other-class image on the fished
  side: v is chosen so that class t sits above the client's other classes. Over the candidates
  (each feature ±e_f, and the regularised discriminant of class t against the client's other present
  classes on public features) and thresholds at public class-t quantiles, the server keeps the pair
  that maximises, on its public features, P(exactly one of the k class-t images below τ) × P(every
  other-class image below τ) (the first factor alone peaks at the class-t quantile 1/k). The
  sharpness s puts ``SHARPNESS`` public class-t standard deviations of the projection in one logit.

Attack (``fish_attack``): k̂ from row t's bias update (rounded Δb_t·B/(lr·passes), where the client
trains against the downloaded classifier and uploads it; else the server's own estimate k), the
fished images' mean feature ΔW_t/Δb_t, then the k̂ images rebuilt jointly, all labelled t, from the
public class-t mean image: Inverting Gradients' objective and optimiser, from the inversion template
(``attacks.inversion.optimise``: 1 − cosine, IG's total variation prior ``IG_PRIOR``, IG's signed Adam
``IG_ADAM`` with its learning-rate drops, every step of the budget) on
the crafted model's gradient of the k̂ images over what fished images move (the extractor and row
t), plus the relative squared error of their mean feature against the closed-form one
(``FEATURE_WEIGHT``, as ``attacks.inversion.closed_form``'s last-linear term).

Scoring (``score_fished``, the evaluator's truth, read after the attack): the images the craft
isolated are the client's class-t images with p_t < ½ under the download as sent; they are matched
one to one (``linear_sum_assignment`` on PSNR) to the rebuilt images. A target succeeds when an
isolated image is rebuilt at ≥ prior + 6 dB; a target where nothing was isolated or nothing was
rebuilt counts as a failure.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch.func import functional_call

from fedecouple.methods.facets import local_phases

from ..base import AttackResult, Budget, NotApplicable, Observation
from ..inversion.forward_model import one_minus_cosine
from ..inversion.optimise import IG_ADAM, IG_PRIOR, around, generator, run_adam
from ..metrics import PSNR_CAP_DB, SUCCESS_MARGIN_DB, mean_interval, psnr, rate_interval, ssim
from ..registry import CraftRequest
from .craft import load, nothing_reached, reached_groups
from .earlier_labels import label_counts

CRAFT = "fishing"
# the bias of every other class in class fishing: exp(z_t − FISH_BIAS) underflows to 0 in float32
FISH_BIAS = 1000.0
# feature fishing: one public class-t standard deviation of v·h spans this many logits
SHARPNESS = 50.0
# thresholds tried: these public class-t quantiles of v·h
THRESHOLD_LEVELS = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
# ridge of the discriminant direction, relative to the mean feature variance
RIDGE = 0.1
# weight of ‖mean h(x) − h‖²/‖h‖² (the closed-form fished feature) in the inversion objective
FEATURE_WEIGHT = 1.0
# feature fishing only where the client takes at most this many steps against the crafted classifier:
# FedAvg's training diverged at 5 steps (50 images, seeds 0 and 1); at 2 steps (20 images, tuning seed
# 1) it stayed finite and 5 of 10 client-rounds succeeded, against 0 of 10 with class fishing only
MAX_FEATURE_STEPS = 2
COLUMNS = ("target_class", "fished", "k_true", "k_inferred")


@dataclass
class FishingRecord:
    """What the server sent one client and why: the download as sent, the target class, the number
    of its images the server expected (0: it found no earlier upload and crafted nothing), the
    feature-fishing direction and threshold (None: class fishing), its estimated chance of
    isolating one image, the label counts it read, and the public class-t mean image."""

    sent: dict[str, torch.Tensor]
    target: int
    expected: int
    counts: list[float]
    direction: torch.Tensor | None = None
    threshold: float | None = None
    sharpness: float | None = None
    chance: float | None = None
    class_mean: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)
    craft: str = CRAFT
    layer: str = "classifier"


def rarest_present(counts: torch.Tensor) -> tuple[int, int] | None:
    """(class, count) of the smallest rounded count ≥ 1 (lowest index on ties); None if none."""
    rounded = torch.as_tensor(counts, dtype=torch.float64).round()
    present = torch.nonzero(rounded >= 1).flatten().tolist()
    if not present:
        return None
    t = min(present, key=lambda k: (float(rounded[k]), k))
    return t, int(rounded[t])


def fishing_download(download: dict[str, torch.Tensor], model, public: torch.Tensor, public_labels: torch.Tensor,
                     counts: torch.Tensor, steps: int = 1,
                     feature: bool = True) -> tuple[dict[str, torch.Tensor], FishingRecord]:
    """The crafted download for a client whose label counts the server estimated as ``counts`` (C,)
    and who trains ``steps`` SGD steps against the classifier, and the server's record of it (module
    docstring). With more than ``MAX_FEATURE_STEPS`` steps, class fishing only: the sharp feature row
    moves the extractor so far that later steps' images cross τ and the client's loss diverges.
    ``feature`` False: class fishing only, whatever the counts (the caller says why)."""
    sent = {k: v.detach().clone() for k, v in download.items()}
    counts = torch.as_tensor(counts, dtype=torch.float64)
    found = rarest_present(counts)
    if found is None:
        record = FishingRecord(sent, -1, 0, counts.tolist())
        record.notes.append("the client's earlier upload showed no class: nothing was crafted")
        return sent, record
    t, k = found
    model = load(model, download)
    with torch.no_grad():
        features = model.features(public).double()
    c = model.num_classes
    weight, bias = torch.zeros(c, model.feature_dim), torch.full((c,), FISH_BIAS)
    own = public_labels == t
    record = FishingRecord(sent, t, k, counts.tolist(), class_mean=public[own].mean(0) if bool(own.any()) else None)
    if k > 1 and int(own.sum()) < 2:
        record.notes.append(f"fewer than two public images of class {t}: class fishing only (no threshold)")
    if k > 1 and steps > MAX_FEATURE_STEPS:
        record.notes.append(f"the client trains {steps} steps against the classifier: class fishing only (a sharp "
                            f"feature-fishing row would make its training diverge)")
    if k == 1 or int(own.sum()) < 2 or steps > MAX_FEATURE_STEPS or not feature:
        weight[t], bias[t] = download["classifier.weight"][t], download["classifier.bias"][t]
    else:
        others = {j: int(round(float(counts[j]))) for j in range(c) if j != t and round(float(counts[j])) >= 1}
        v, tau, s, chance = feature_threshold(features, public_labels, t, k, others)
        weight[t], bias[:] = (s * v).float(), 0.0
        bias[t] = math.log(c - 1) - s * tau
        record.direction, record.threshold, record.sharpness, record.chance = v.float(), tau, s, chance
    sent["classifier.weight"], sent["classifier.bias"] = weight, bias
    return {k2: v2.clone() for k2, v2 in sent.items()}, record


def fishing_craft(request: CraftRequest) -> tuple[dict[str, torch.Tensor], FishingRecord]:
    """The server's craft (``MaliciousSpec.craft_download``): ``fishing_download`` for the label counts and
    steps it reads from the client's earlier exchange (``attacks.malicious.earlier_labels``)."""
    counts, steps = label_counts(request)
    return fishing_download(dict(request.download), request.make_model(), request.public, request.public_labels,
                            counts, steps)


def fishing_unreachable(method, model) -> str | None:
    """Why a fishing download cannot reach ``method``'s update (None: it can): the client must train
    its extractor from the download against the classifier the server sends."""
    reason = nothing_reached(method)
    if reason is not None:
        return reason
    reached = reached_groups(method)
    missing = sorted({"extractor", "classifier"} - reached)
    if not missing:
        return None
    return (f"{method.name} trains only {', '.join(sorted(reached))} as sent, not the downloaded "
            f"{' and '.join(missing)}: classifier fishing needs the client to train its extractor against the "
            f"classifier the server sends" + (" (it trains under its own head)" if missing == ["classifier"] else ""))


def feature_threshold(features: torch.Tensor, labels: torch.Tensor, t: int, k: int,
                      others: dict[int, int]) -> tuple[torch.Tensor, float, float, float]:
    """(v, τ, s, estimated chance): the direction and threshold that best isolate one of ``k``
    class-t images with ``others`` ({class: count}) all on the fished side (module docstring)."""
    own = features[labels == t]
    rest = {j: features[labels == j] for j in others if int((labels == j).sum()) > 0}
    axes = torch.eye(features.shape[1], dtype=torch.float64)
    candidates = [axes, -axes]
    if rest:
        pooled = torch.cat(list(rest.values()))
        spread = torch.cov(torch.cat([own - own.mean(0), pooled - pooled.mean(0)]).T)
        spread = spread + RIDGE * float(spread.diagonal().mean()) * torch.eye(len(spread), dtype=torch.float64)
        d = torch.linalg.solve(spread, own.mean(0) - pooled.mean(0))
        candidates.append((d / d.norm().clamp_min(1e-12))[None])
    directions = torch.cat(candidates)  # (m, D) unit rows
    own_proj = own @ directions.T  # (n_t, m)
    taus = torch.quantile(own_proj, THRESHOLD_LEVELS, dim=0)  # (levels, m)
    below = (own_proj[None] < taus[:, None]).double().mean(1)  # (levels, m)
    chance = k * below * (1 - below) ** (k - 1)
    for j, proj in ((j, f @ directions.T) for j, f in rest.items()):
        chance = chance * ((proj[None] < taus[:, None]).double().mean(1)) ** others[j]
    level, m = divmod(int(chance.argmax()), chance.shape[1])
    v, tau = directions[m], float(taus[level, m])
    s = SHARPNESS / float(own_proj[:, m].std().clamp_min(1e-12))
    return v, tau, s, float(chance[level, m])


def fished_weights(model, record: FishingRecord, images: torch.Tensor) -> torch.Tensor:
    """(n,) 1 − p_t of ``images`` under the download as sent: how much of a class-t image's gradient
    the craft lets through (≈ 1 fished, ≈ 0 silenced)."""
    model = load(model, record.sent)
    with torch.no_grad():
        return 1.0 - torch.softmax(model(images).double(), dim=1)[:, record.target]


def classifier_passes(method, epochs: int) -> int:
    """How many times a client's local training passes its data through the downloaded classifier:
    the epochs of its phases that train the classifier from the download."""
    return sum(e for phase, e, _ in local_phases(method, epochs) if phase in ("local", "classifier"))


def read_fished(observation: Observation, record: FishingRecord) -> tuple[int, torch.Tensor | None, str]:
    """(k̂, the fished images' mean feature or None, how k̂ was read)."""
    upload, t, hp = observation.upload, record.target, observation.known_hyperparameters
    trained = "classifier" not in observation.method.persistent_groups and "classifier.bias" in upload
    if not trained or hp is None:
        why = ("the client does not upload the classifier it trained against" if not trained
               else "the local hyperparameters are unknown")
        return record.expected, None, f"the server's estimate from the earlier upload ({why})"
    db = float(upload["classifier.bias"][t].double() - record.sent["classifier.bias"][t].double())
    dw = upload["classifier.weight"][t].double() - record.sent["classifier.weight"][t].double()
    batch = min(int(hp.batch_size), int(hp.samples or hp.batch_size))
    passes = max(1, classifier_passes(observation.method, int(hp.epochs)))
    k = int(round(db * batch / (float(hp.lr) * passes)))
    feature = (dw / db).float() if k >= 1 and abs(db) > 0 else None
    how = "row t's bias update (lr·k/B per pass)"
    if hp.samples and k > int(hp.samples):  # a defense rescaled the update: no client fishes more than it holds
        return int(hp.samples), feature, f"{how} read {k}, more than the client's {int(hp.samples)} images: capped"
    return max(k, 0), feature, how


def fish_attack(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    """Read how many images were fished and their mean feature, then rebuild them (module docstring)."""
    start = time.perf_counter()
    record = getattr(observation, "crafted", None)
    if not isinstance(record, FishingRecord):
        raise NotApplicable("no fishing download was sent to this client (the server must be malicious)")
    k, feature, how = read_fished(observation, record) if record.expected else (0, None, "nothing was crafted")
    trace = {"mode": CRAFT if record.direction is None else "feature-fishing", "target_class": record.target,
             "k_inferred": k, "k_source": how, "k_expected": record.expected, "threshold": record.threshold,
             "isolation_chance": record.chance}
    notes = list(record.notes)
    if k < 1:
        notes.append("nothing was fished (no image sent gradient through the target row)")
        return AttackResult(torch.zeros(0, *observation.image_shape), torch.zeros(0, dtype=torch.long),
                            trace={**trace, "seconds": time.perf_counter() - start}, notes=notes)
    images, objective = invert_fished(observation, record, k, feature, budget.iterations, seed)
    trace.update(objective=objective, seconds=time.perf_counter() - start)
    return AttackResult(images, torch.full((k,), record.target, dtype=torch.long), trace=trace, notes=notes)


def _fished_update(observation: Observation, record: FishingRecord, names: list[str]) -> list[torch.Tensor]:
    """The observed −Δ over ``names`` (row t only for the classifier): a gradient up to its scale."""
    out = []
    for name in names:
        delta = observation.upload[name].double() - record.sent[name].double()
        out.append(-(delta[record.target] if name.startswith("classifier.") else delta).float())
    return out


def invert_fished(observation: Observation, record: FishingRecord, k: int, feature: torch.Tensor | None,
                  iterations: int, seed: int) -> tuple[torch.Tensor, float]:
    """(k, C, H, W) images whose crafted-model gradient (label t) matches the fished update: IG's
    signed Adam from the public class-t mean image (module docstring); returns the images and the
    final objective."""
    model = load(observation.make_model(), record.sent).to(torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = [n for n in params if n.startswith("extractor.") and n in observation.upload]
    if "classifier" not in observation.method.persistent_groups:  # else the upload holds the client's own head
        names += [n for n in ("classifier.weight", "classifier.bias") if n in observation.upload]
    target = flat_list(_fished_update(observation, record, names))
    labels = torch.full((k,), record.target, dtype=torch.long)
    start = record.class_mean if record.class_mean is not None else torch.full(observation.image_shape, 0.5)
    x = around(start, (k, *observation.image_shape), 0.05, generator(seed)).clamp(0, 1)
    x = x.clone().requires_grad_(True)
    live = {n: p.clone().requires_grad_(n in names) for n, p in params.items()}

    def objective() -> torch.Tensor:
        loss = F.cross_entropy(functional_call(model, live, (x,)), labels, reduction="sum")
        grads = torch.autograd.grad(loss, [live[n] for n in names], create_graph=True)
        rows = [g[record.target] if n.startswith("classifier.") else g for n, g in zip(names, grads)]
        value = one_minus_cosine(flat_list(rows), target) + IG_PRIOR(x)
        if feature is not None:
            got = model_features(model, live, x).mean(0)
            value = value + FEATURE_WEIGHT * (got - feature).pow(2).sum() / feature.pow(2).sum().clamp_min(1e-20)
        return value

    def evaluate() -> tuple[torch.Tensor, list[torch.Tensor]]:
        value = objective()
        return value.detach().reshape(1), [torch.autograd.grad(value, [x])[0]]

    run = run_adam(IG_ADAM, [x], evaluate, iterations)
    return x.detach().clone(), float("nan") if run.values is None else float(run.values[0])


def model_features(model, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The extractor's output (the classifier's input) under ``params``, differentiable."""
    extractor = {n[len("extractor."):]: p for n, p in params.items() if n.startswith("extractor.")}
    return functional_call(model.extractor, extractor, (model.normalize(x),))


def flat_list(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def score_fished(make_model, record: FishingRecord, result: AttackResult, truths: torch.Tensor,
                 truth_labels: torch.Tensor, prior: torch.Tensor) -> list[dict]:
    """Rows for one target (module docstring): one per image the craft isolated, matched one to one
    to the rebuilt images (an unmatched one scored as the prior); where none was isolated, the
    rebuilt images against their best match among the client's images (``fished`` False), or one
    row with the prior when nothing was rebuilt either."""
    weights = fished_weights(make_model(), record, truths) if record.target >= 0 else torch.zeros(len(truths))
    isolated = [j for j in range(len(truths)) if int(truth_labels[j]) == record.target and float(weights[j]) > 0.5]
    rebuilt, k_hat = result.images, int(result.trace.get("k_inferred", len(result.images)))
    # every rebuilt image is labelled with the target class
    common = {"target_class": record.target, "k_true": len(isolated), "k_inferred": k_hat, "label_pred": record.target}
    score = np.array([[psnr(rebuilt[i], truths[j]) for j in range(len(truths))] for i in range(len(rebuilt))])
    rows = []
    if isolated:
        chosen = {}
        if len(rebuilt):
            r_idx, c_idx = linear_sum_assignment(-score[:, isolated])
            chosen = {isolated[c]: r for r, c in zip(r_idx, c_idx)}
        for j in isolated:
            image = rebuilt[chosen[j]] if j in chosen else prior
            rows.append(_row(j, chosen.get(j, -1), image, truths[j], truth_labels[j], prior, True, common))
    elif len(rebuilt):
        for i in range(len(rebuilt)):
            j = int(score[i].argmax())
            rows.append(_row(j, i, rebuilt[i], truths[j], truth_labels[j], prior, False, common))
    else:
        j = int(np.argmax([psnr(prior, t) for t in truths]))
        rows.append(_row(j, -1, prior, truths[j], truth_labels[j], prior, False, common))
    return rows


def _row(j: int, reconstruction: int, image, truth, label, prior, fished: bool, common: dict) -> dict:
    return {"truth_index": j, "reconstruction": int(reconstruction), "psnr": psnr(image, truth),
            "ssim": ssim(image, truth), "prior_psnr": psnr(prior, truth), "label_true": int(label),
            "fished": bool(fished), **common}


def fishing_statistics(rows: list[dict], seed: int) -> dict:
    """Per attacked round (target): success when an isolated image was rebuilt at ≥ prior + 6 dB (a
    target with nothing isolated fails), its share with a 95 % interval, the mean PSNR of each
    target's best isolated image (the prior where none; capped as every PSNR mean) with a 95 %
    interval over targets, and k inferred against true."""
    targets: dict[str, list[dict]] = {}
    for r in rows:
        targets.setdefault(f"{r['round']}/{r['client']}", []).append(r)
    if not targets:
        return {"fishing_targets": 0}
    success, best, exact_k = [], [], []
    for group in targets.values():
        fished = [r for r in group if r["fished"]]
        success.append(any(float(r["psnr"]) - float(r["prior_psnr"]) >= SUCCESS_MARGIN_DB for r in fished))
        best.append(max(float(r["psnr"]) for r in fished) if fished else float(group[0]["prior_psnr"]))
        exact_k.append(int(group[0]["k_true"]) == int(group[0]["k_inferred"]))
    hits, clusters = np.array(success), np.array(list(targets))
    interval, _ = mean_interval(np.minimum(np.array(best), PSNR_CAP_DB), clusters, seed=seed)
    return {"fishing_targets": len(targets), "fishing_success_share": float(hits.mean()),
            "fishing_success_share_ci": [float(v) for v in rate_interval(hits, clusters, seed)],
            "fishing_success_rule": "an image the craft isolated rebuilt at PSNR >= prior + 6 dB (per attacked "
                                    "round and client; nothing isolated = failure)",
            "fishing_best_psnr_mean": float(np.mean(np.minimum(best, PSNR_CAP_DB))), "fishing_best_psnr_ci": interval,
            "fishing_best_psnr": best,
            "fishing_one_isolated_share": float(np.mean([int(g[0]["k_true"]) == 1 for g in targets.values()])),
            "fishing_k_correct_share": float(np.mean(exact_k))}


def fishing_lines(summary: dict) -> list[str]:
    """The terminal's line for ``fishing_statistics`` in an attack's summary (none without targets)."""
    if not summary.get("fishing_targets"):
        return []
    low, high = summary["fishing_success_share_ci"]
    return [f"  fishing: an isolated image rebuilt at >= prior + 6 dB in {summary['fishing_success_share']:.0%} "
            f"[{low:.0%}, {high:.0%}] of {summary['fishing_targets']} attacked client-rounds; exactly one image "
            f"isolated in {summary['fishing_one_isolated_share']:.0%}; fished count read right in "
            f"{summary['fishing_k_correct_share']:.0%}"]
