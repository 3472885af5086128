"""``sum-fishing``: classifier fishing through secure aggregation.

Wen et al. 2022, "Fishing for User Data in Large-Batch Federated Learning via Gradient Magnification",
made fishing for aggregated batches: the classifier sent makes one class's (or one feature bin's) images
the only ones whose gradient reaches the extractor, so the aggregate update is theirs alone. Under
secure aggregation the server holds only the round's sum, and a download tailored per client would be
caught by a consistency check, so every participant gets the same fishing download
(``attacks.malicious.fishing.fishing_download``), crafted for the round as if it were one client:

* the label counts it crafts for are the round's, read from the previous round's aggregate the server
  made itself: the honest download of this round minus the one it sent in the previous round is that
  round's weighted mean update, whose classifier-bias row reads the label histogram by the rule of
  ``attacks.secure.observation.round_counts`` (exact for one SGD step of a model with near-uniform
  predictions). The rule needs the round's image count N; the server holds the previous round's summed
  weight N / max_weight, which the craft request does not carry, so N is taken as the participants times
  one participant's sample count (exact for clients of equal size). Without a previous exchange (round 0,
  or a participant new to the federation) the counts are the public data's class prior scaled to N;
  the record's notes say which;
* the target is then the round's rarest present class, class fishing where it holds one image, feature
  fishing where it holds more and the clients take at most ``MAX_FEATURE_STEPS`` steps.

The round's decoded sum divided by its summed weight is the sent model plus the weighted mean update, and
the mean update of the extractor and of row t is the fished images' alone, whichever clients hold them
(every other image sends no gradient there). ``read_fished`` reads it as one upload: with clients of one
batch each image's bias update carries lr / max_weight in the sum, so the mean's row-t bias update is
lr·k/N, read as one client of N images (``round_hyperparameters``); ``invert_fished`` rebuilds the k
fished images from it. The harness scores them as the per-client attack does (``score_fished``) against
the round's images of class t, each row naming the image's owner.

The protocol clips every weighted value to its clipping range and quantises it: the other classes'
biases (``FISH_BIAS``) are clipped in the sum, which nothing here reads; the fished update, a few images'
gradient at weight n / max_weight, can sink into the quantisation unless ``--sa-max-weight`` is near the
clients' sample count (the record's notes give the bound on the fished count).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields, replace

import torch

from attacks.malicious.fishing import (COLUMNS, CRAFT, FishingRecord, fishing_download,
                                       fishing_statistics, fishing_unreachable, invert_fished, read_fished,
                                       score_fished)
from fedecouple.methods.base import phase_steps
from fedecouple.methods.facets import SecureSummation, facet, local_phases
from fedecouple.secure_aggregation import SecureAggregation

from ..base import AttackResult, Budget, LocalHyperparameters, NotApplicable, Observation
from ..inversion.closed_form import round_to_total
from ..registry import CraftRequest, MaliciousRoundSpec
from .observation import image_weight, public_prediction, sample_total, weight_of
from .sized_binning import fingerprint

# seconds per inversion step of one round (``attacks.malicious``'s rate for the per-client fishing target)
STEP_SECONDS = 0.009
# the share of the clipping range a client's weighted row t may fill (its training moves it a little)
MARGIN = 0.5
# the latest round craft, [its key, (download, record)]: every participant of a round gets the same one
_LATEST: list = []


@dataclass
class RoundFishingRecord(FishingRecord):
    """The fishing record of a whole round (``FishingRecord``) and where its label counts came from.
    ``role`` and ``binning`` are what the round-level harness looks up to find the record a round's
    read-back is scored under (``attacks.secure.sized_binning.scored_record``): every participant's
    record is this one."""

    source: str = ""
    images: int = 0  # the round's image count N the craft assumed
    role: str = "target"

    @property
    def binning(self) -> "RoundFishingRecord":
        return self


def round_images(request: CraftRequest) -> tuple[int, str]:
    """(N̂, how): the round's image count the craft plans for, the participants times one participant's
    sample count from its previous exchange (else the configured batch size: clients of one batch)."""
    participants = max(len(request.round_clients), 1)
    earlier = request.earlier
    if earlier is not None and earlier[2] is not None and "sample_count" in earlier[2]:
        n = int(round(float(earlier[2]["sample_count"])))
        return participants * n, f"{participants} participants of {n} images (a client's sample count)"
    n = int(request.train.batch_size) if request.train is not None else 1
    return participants * n, f"{participants} participants of one batch of {n} images"


def round_histogram(request: CraftRequest, images: int) -> tuple[torch.Tensor, str, list[str]]:
    """((C,) the round's label counts as the server estimates them at craft time, their source, notes):
    the previous round's aggregate read by the bias rule where the server has it, else the public
    class prior (module docstring)."""
    model = request.make_model()
    classes = model.num_classes
    earlier, download, train = request.earlier, request.download, request.train
    previous = earlier is not None and earlier[0] == request.round - 1 and train is not None and \
        "classifier.bias" in download and "classifier.bias" in earlier[1]
    if previous:
        sent = earlier[1]
        mean_update = download["classifier.bias"].double() - sent["classifier.bias"].double()
        predicted, how = public_prediction(model, sent, (request.public, request.public_labels),
                                           tuple(request.public.shape[1:]))
        participants = max(len(request.round_clients), 1)
        hp = LocalHyperparameters(lr=float(train.lr), steps=1, batch_size=int(train.batch_size),
                                  epochs=int(train.local_epochs))
        # Σ yⱼ = N·p̂ + max_weight·Σ wᵢΔbᵢ / (lr·image weight); Σ wᵢΔbᵢ = (N / max_weight)·the mean update
        raw = images * (predicted + mean_update / (hp.lr * image_weight(hp, images / participants)))
        source = f"round {request.round - 1}'s aggregate (its classifier-bias update, Σp from {how})"
        return round_to_total(raw, images).double(), source, [
            f"the target class was chosen from {source}, for a round of {images} images"]
    labels = torch.as_tensor(request.public_labels) if request.public_labels is not None else None
    if labels is None or len(labels) == 0:
        prior = torch.full((classes,), 1.0 / classes, dtype=torch.float64)
    else:
        prior = torch.bincount(labels.long(), minlength=classes).double() / len(labels)
    source = "the public data's class prior"
    return round_to_total(prior * images, images).double(), source, [
        f"no previous round's aggregate to read the labels from: the target class was chosen from {source}"]


def client_steps(request: CraftRequest, images: int) -> int:
    """The SGD steps a participant of ``images`` images takes against the classifier (1 where unknown)."""
    if request.train is None or request.method is None:
        return 1
    return sum(phase_steps(e, images, request.train.batch_size) for phase, e, _ in
               local_phases(request.method, request.train.local_epochs) if phase in ("local", "classifier")) or 1


def clipped_row(request: CraftRequest, sent: dict[str, torch.Tensor], target: int, size: int) -> str | None:
    """Why feature fishing's row t would reach the sum clipped (None: it fits). A client of ``size`` images
    uploads w·θ with w = size / max_weight, each value clipped to the protocol's clipping range; its
    trained row stays near the sharp one sent, so that row times w must stay within ``MARGIN`` of it."""
    protocol = request.secure if request.secure is not None else SecureAggregation()
    weight = size / protocol.max_weight
    largest = max(float(sent["classifier.weight"][target].abs().max()), float(sent["classifier.bias"][target].abs()))
    if weight * largest <= MARGIN * protocol.clipping_range:
        return None
    return (f"feature fishing's sharp row (values up to {largest:.3g}) at the clients' weight {weight:.3g} would be "
            f"clipped to the protocol's range {protocol.clipping_range:g}: class fishing instead (every image of the "
            f"target class is fished)")


def sum_fishing_craft(request: CraftRequest) -> tuple[dict[str, torch.Tensor], RoundFishingRecord]:
    """``MaliciousRoundSpec.craft_download``: ``fishing_download`` for the round's estimated label counts, the
    same download for every participant (the round's first craft is kept and copied for the others)."""
    key = (request.round, fingerprint(dict(request.download)), fingerprint({"public": request.public}),
           request.secure, request.train, tuple(request.round_clients))
    if _LATEST and _LATEST[0] == key:
        sent, record = _LATEST[1]
        return {k: v.clone() for k, v in sent.items()}, copy.deepcopy(record)
    images, size_how = round_images(request)
    counts, source, notes = round_histogram(request, images)
    participants = max(len(request.round_clients), 1)
    args = (dict(request.download), request.make_model(), request.public, request.public_labels, counts,
            client_steps(request, images // participants))
    sent, base = fishing_download(*args)
    if base.direction is not None:
        too_large = clipped_row(request, sent, base.target, images // participants)
        if too_large is not None:  # the sharp row would reach the sum clipped: fish the whole class instead
            sent, base = fishing_download(*args, feature=False)
            notes.append(too_large)
    record = RoundFishingRecord(**{f.name: getattr(base, f.name) for f in fields(FishingRecord)},
                                source=source, images=images)
    record.notes[:0] = notes + [f"the round's image count was taken as {size_how}"]
    _LATEST[:] = [key, ({k: v.clone() for k, v in sent.items()}, copy.deepcopy(record))]
    return sent, record


def unreachable(method, model) -> str | None:
    """``fishing_unreachable``, and under secure aggregation the download must still hold the extractor
    and the classifier (a method may download less there)."""
    summation = facet(method, SecureSummation)
    reaches = summation.secure_download_reaches if summation is not None else None
    if reaches is not None and not {"extractor", "classifier"} <= set(reaches):
        return (f"{method.name} downloads only {', '.join(sorted(reaches))} under secure aggregation: classifier "
                f"fishing needs every client to train its extractor against the classifier the server sends")
    return fishing_unreachable(method, model)


def round_hyperparameters(hp: LocalHyperparameters | None, images: int,
                          participants: int) -> LocalHyperparameters | None:
    """The round as one client for ``read_fished``: N images, and the batch that makes its bias rule
    (k = Δb·B/(lr·passes)) read the mean update of the sum. Each fished image enters its client's update
    once per pass at lr/B, weighted by n / max_weight, and the mean divides by N / max_weight: Δb = lr·k·n/(B·N)
    for clients of n images, so B is N·min(B, n)/n (N itself for clients of one batch)."""
    if hp is None:
        return None
    size = max(images / max(participants, 1), 1.0)
    batch = max(1, int(round(images * min(hp.batch_size, size) / size)))
    return replace(hp, batch_size=batch, samples=images)


def sum_fishing(observation, budget: Budget, seed: int) -> AttackResult:
    """``MaliciousRoundSpec.attack_round``: the fished images' count and mean feature read from the round's mean
    update, then the images rebuilt from it (module docstring)."""
    start = time.perf_counter()
    records = [r for r in observation.crafted.values() if isinstance(r, FishingRecord)]
    if not records:
        raise NotApplicable("no fishing download was sent in this round (the server must be malicious)")
    record = records[0]
    missing = [n for n in ("classifier.weight", "classifier.bias") if n not in observation.total]
    if missing or "classifier" in observation.method.persistent_groups:
        raise NotApplicable("the secure sum holds no classifier the server sent: the crafted layer's update is "
                            "not summed")
    weight = weight_of(observation.total)
    if weight is None:
        raise NotApplicable("the secure sum holds no sample weight: its mean update cannot be read")
    counts = observation.sample_counts()
    images = sum(counts.values()) if counts is not None else sample_total(observation.total, observation.max_weight)
    participants = len(observation.survivors)
    hp = round_hyperparameters(observation.known_hyperparameters, int(images), participants)
    mean = {k: (v.double() / weight).cpu() for k, v in observation.total.items() if k != "sample_count"}
    model = observation.make_model().cpu()
    view = Observation(observation.method, observation.round, -1, record.sent, mean, None,
                       lambda: copy.deepcopy(model), observation.image_shape, observation.num_classes,
                       known_hyperparameters=hp, crafted=record)
    k, feature, how = read_fished(view, record) if record.expected else (0, None, "nothing was crafted")
    notes = list(record.notes)
    if hp is not None and record.expected:
        # each summed value is within survivors × quantum; the bias reading scales it by B/(lr·passes·Σw)
        bound = participants * observation.quantum / weight * hp.batch_size / (hp.lr * max(hp.epochs, 1))
        if bound >= 0.5:
            notes.append(f"the protocol's quantisation alone can move the fished count by up to {bound:.2f}: "
                         f"--sa-max-weight near the clients' sample count narrows it")
    trace = {"mode": "sum-" + (CRAFT if record.direction is None else "feature-fishing"),
             "target_class": record.target, "k_inferred": k, "k_source": how, "k_expected": record.expected,
             "threshold": record.threshold, "isolation_chance": record.chance, "label_source": record.source}
    if k < 1:
        notes.append("nothing was fished (no image of the round sent gradient through the target row)")
        result = AttackResult(torch.zeros(0, *observation.image_shape), torch.zeros(0, dtype=torch.long),
                              trace={**trace, "seconds": time.perf_counter() - start}, notes=notes)
    else:
        rebuilt, objective = invert_fished(view, record, k, feature, budget.iterations, seed)
        result = AttackResult(rebuilt, torch.full((k,), record.target, dtype=torch.long),
                              trace={**trace, "objective": objective, "seconds": time.perf_counter() - start},
                              notes=notes)
    # what the read-back read from the crafted layer (the classifier): the fished images' mean input; its
    # presence is what has the harness score the result under the craft record (``score_fished``)
    dim = int(record.sent["classifier.weight"].shape[1])
    result.variables["inputs"] = feature.reshape(1, -1).float() if feature is not None else torch.zeros(0, dim)
    return result


def round_fishing_statistics(rows: list[dict], seed: int) -> dict:
    """``fishing_statistics`` per attacked round: the rows of one round are one target, whichever clients
    own its images."""
    out = fishing_statistics([{**r, "client": "all"} for r in rows], seed)
    if out.get("fishing_targets"):
        out["fishing_success_rule"] = ("an image the craft isolated rebuilt at PSNR >= prior + 6 dB (per attacked "
                                       "round; nothing isolated = failure)")
    return out


def summary_lines(summary: dict) -> list[str]:
    """The fishing line of the summary, per attacked round."""
    if not summary.get("fishing_targets"):
        return []
    low, high = summary["fishing_success_share_ci"]
    return [f"  fishing through the sum: an isolated image rebuilt at >= prior + 6 dB in "
            f"{summary['fishing_success_share']:.0%} [{low:.0%}, {high:.0%}] of {summary['fishing_targets']} "
            f"attacked rounds; exactly one image of the round isolated in {summary['fishing_one_isolated_share']:.0%}; "
            f"fished count read right in {summary['fishing_k_correct_share']:.0%}"]


SPEC = MaliciousRoundSpec(
    "sum-fishing", default_victim_batch=0, applies_to=frozenset({"extractor"}), scoring="images",
    needs="model weights in the sum",
    hint="a crafted download is read back from the summed weights; try `fedsec attack sum-labels --method {method}`",
    crafts=(CRAFT,), extra_columns=COLUMNS, craft_download=sum_fishing_craft, unreachable=unreachable,
    score_target=score_fished, statistics=round_fishing_statistics, summary_lines=summary_lines,
    estimate_rate=STEP_SECONDS, estimate_per="target", attack_round=sum_fishing)

__all__ = ["SPEC", "RoundFishingRecord", "round_histogram", "round_hyperparameters", "sum_fishing",
           "sum_fishing_craft"]
