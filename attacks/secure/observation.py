"""What a server under secure aggregation holds about one round: the ``RoundObservation`` every
round-level attack (kind ``"aggregate"``, ``attacks.registry``) takes.

Under secure aggregation (``fedecouple.secure_aggregation``, SecAgg+) the server never reads one
client's upload: each masked upload is uniform noise. What it holds, per round, is

* who took part (``participants``: the clients it sent the round's download to), whose masked upload
  arrived (``survivors``) and who dropped out (``dropped``);
* ``total``: the decoded sum of the survivors' summands (``SecureSummation.secure_summands``, float64), e.g. for
  FedAvg Σ wᵢ·θᵢ per parameter and Σ wᵢ under ``sample_count``, with wᵢ = nᵢ / ``max_weight``; for
  FedProto Σ nᵢₖ·cᵢₖ / max_weight and Σ nᵢₖ / max_weight per class k. Each value lies within
  ``len(survivors) * quantum`` of the exact sum (the protocol's quantisation); empty when the round was
  ``aborted`` (too few survivors to unmask);
* ``clear``: what each survivor's upload carried unmasked beside its masked vector. Under the default
  ``clear_fields="flower"`` that is what Flower's SecAgg+ leaves in the clear, the client's sample count
  nᵢ (``sample_count``, its FitRes num_examples) and its training metrics (``metric.*``); under
  ``"hidden"`` nothing. ``sample_counts()`` reads the nᵢ where every survivor reported one;
* what it sent each participant (``downloads``, the tensors as sent), and its own initial model
  (``make_model``);
* every earlier round the same way (``history``: one ``RoundSum`` per recorded round up to and
  including this one), which is what a multi-round attack (gradient disaggregation) reads.

Beside the traffic, the threat model may hand the attacker the clients' local training settings
(``known_hyperparameters``: lr, steps, batch size, epochs, for a client of the round's mean size; each
client's own size is known only where it travels in the clear, ``clear``), public data of the same
domain (``auxiliary``: images in [0, 1] and their labels) and, for a malicious server, its record of
what it crafted for each client (``crafted``: client → record, as
``attacks.registry.MaliciousRoundSpec.craft_download`` returns it; empty for an honest server). It never holds
a client's data: the harness (``attacks.harness.rounds``) scores a result against the survivors'
training images only after the attack returned.

A round-level attack is ``attack_round(observation: RoundObservation, budget: attacks.base.Budget,
seed: int) -> attacks.base.AttackResult``, its spec a ``RoundAttackSpec`` (kind ``"aggregate"``,
``attacks.registry``); it raises ``attacks.base.NotApplicable`` when the round carries nothing it
can use. What its result may carry, and how each part is scored, is ``attacks.harness.rounds``'s
docstring.

``observe_round(run, round, ...)`` builds the observation from an ``attacks.recorded.RecordedRun``
whose recorder has ``secure`` set (``fedsec attack --secure-aggregation``). The helpers below
(``summed_update``, ``weight_of``, ``sample_total``) read the sum the way FedAvg-family sums are built
(``fedecouple.methods.averaging.weighted_summands``, each weight sent as Flower's rounded factor, so that the
sum is Σ ŵᵢ·θᵢ and Σ ŵᵢ with ŵᵢ = round(wᵢ·Q)/Q: ``fedecouple.secure_aggregation.with_flower_weight``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedecouple.devices import to_device
from fedecouple.methods.base import Method, phase_steps
from fedecouple.methods.facets import local_phases
from fedecouple.models import SplitModel, use_batch_statistics

from ..base import LocalHyperparameters, NotApplicable

SAMPLE_COUNT = "sample_count"  # the FedAvg family's summed weight Σ wᵢ (``weighted_summands``)


@dataclass(frozen=True)
class RoundSum:
    """One recorded round as the server holds it: who took part, whose upload is in the sum, the decoded
    sum (empty when ``aborted`` says why it could not be unmasked), and ``sent``: the download every
    participant got when it was the same for all (the FedAvg family's global model), else None."""

    round: int
    participants: tuple[int, ...]
    survivors: tuple[int, ...]
    total: dict[str, torch.Tensor]
    aborted: str | None = None
    sent: dict[str, torch.Tensor] | None = None
    clear: dict[int, dict[str, float]] = field(default_factory=dict)  # survivor -> its unmasked fields

    def sample_counts(self) -> dict[int, int] | None:
        """Each survivor's nᵢ as it travelled in the clear (None: some survivor's did not)."""
        return clear_sample_counts(self.clear, self.survivors)


@dataclass
class RoundObservation:
    """The server's view of one round under secure aggregation (module docstring). The tensors are the
    recorder's own where ``device`` is the CPU: attacks read them and never write to them."""

    method: Method
    round: int
    participants: tuple[int, ...]
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    total: dict[str, torch.Tensor]
    max_weight: float
    downloads: dict[int, dict[str, torch.Tensor]]
    make_model: Callable[[], SplitModel]  # a fresh model of the architecture at the federation's initial weights
    image_shape: tuple[int, int, int]
    num_classes: int
    known_hyperparameters: LocalHyperparameters | None = None  # None: the server does not know them
    quantum: float = 0.0  # one quantisation step: each summed value is within len(survivors) * quantum
    aborted: str | None = None
    auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None  # public images in [0, 1] and labels
    crafted: dict[int, object] = field(default_factory=dict)  # a malicious server's record per client
    history: dict[int, RoundSum] = field(default_factory=dict)  # every recorded round <= ``round``
    device: str = "cpu"
    clear: dict[int, dict[str, float]] = field(default_factory=dict)  # survivor -> its unmasked fields
    protocol: object = None  # the ``SecureAggregation`` the round ran under (None: not handed over)

    def sent(self) -> dict[str, torch.Tensor] | None:
        """The download every participant got this round when it was one for all, else None."""
        return common_download(self.downloads)

    def sample_counts(self) -> dict[int, int] | None:
        """Each survivor's nᵢ as it travelled in the clear (None: some survivor's did not)."""
        return clear_sample_counts(self.clear, self.survivors)


def clear_sample_counts(clear: dict[int, dict[str, float]], survivors) -> dict[int, int] | None:
    """{survivor: nᵢ} from the fields in the clear, or None unless every survivor sent its count."""
    counts = {int(c): clear.get(int(c), {}).get(SAMPLE_COUNT) for c in survivors}
    if not counts or any(n is None for n in counts.values()):
        return None
    return {c: int(n) for c, n in counts.items()}


def common_download(downloads: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The one download every client got (same names, equal tensors), or None."""
    tensors = list(downloads.values())
    if not tensors:
        return None
    first = tensors[0]
    for other in tensors[1:]:
        if set(other) != set(first) or any(not torch.equal(other[k], first[k]) for k in first):
            return None
    return first


def weight_of(total: dict[str, torch.Tensor]) -> float | None:
    """Σ wᵢ of a FedAvg-family sum (None: the method sums no weight)."""
    return float(total[SAMPLE_COUNT]) if SAMPLE_COUNT in total else None


def sample_total(total: dict[str, torch.Tensor], max_weight: float) -> int | None:
    """Σ nᵢ, the survivors' training images, from the summed weight (wᵢ = nᵢ / max_weight), rounded."""
    weight = weight_of(total)
    return None if weight is None else int(round(weight * max_weight))


def summed_update(total: dict[str, torch.Tensor], sent: dict[str, torch.Tensor],
                  names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Σ wᵢ·(θᵢ − θ_sent) per summed parameter (float64): the survivors' weighted updates, from a
    FedAvg-family sum Σ wᵢ·θᵢ, its Σ wᵢ and the parameters every client was sent."""
    weight = weight_of(total)
    if weight is None:
        raise NotApplicable("the secure sum holds no sample weight: it is not a FedAvg-family sum of models")
    names = [n for n in total if n != SAMPLE_COUNT and n in sent] if names is None else names
    return {n: total[n].to(torch.float64) - weight * sent[n].detach().cpu().to(torch.float64) for n in names}


# ------------------------------------------------------------------------------------------------
# what one round's sum says about the survivors' labels (``sum-labels``, and per round ``sum-disaggregation``)


@dataclass
class RoundCounts:
    """The survivors' per-class training images in one round read from its sum: ``counts`` (C,)
    integers, ``raw`` the unrounded reading, ``source`` how, and the ``notes`` for the user."""

    counts: torch.Tensor
    raw: torch.Tensor
    source: str
    notes: list[str] = field(default_factory=list)


def summed_class_counts(method: Method, model: SplitModel, total: dict[str, torch.Tensor], max_weight: float,
                        num_classes: int) -> torch.Tensor | None:
    """(C,) Σ nᵢₖ from a sum of per-class count fields (FedProto sums nᵢₖ / max_weight for every
    class), or None when the method sums none."""
    from ..inversion.prototypes import per_class_values  # reads per-class field names

    specs = [s for s in method.manifest(model) if s.kind == "class_counts" and s.per_class]
    values = per_class_values(total, specs)
    if not values:
        return None
    raw = torch.zeros(num_classes, dtype=torch.float64)
    for k, v in values.items():
        if 0 <= k < num_classes:
            raw[k] = float(v) * max_weight
    return raw


def public_prediction(model: SplitModel, sent: dict[str, torch.Tensor], auxiliary,
                      image_shape: tuple[int, int, int]) -> tuple[torch.Tensor, str]:
    """(C,) the mean softmax of the model the server sent (``sent`` over ``model``'s initial weights) on
    its public images (``auxiliary``), or at the pixel-mean image without public data; and how."""
    model = copy.deepcopy(model).cpu().eval()
    model.load_state_dict({**model.state_dict(), **{k: v.detach().cpu() for k, v in sent.items()}}, strict=False)
    with torch.no_grad():
        if auxiliary is not None and len(auxiliary[0]):
            images = auxiliary[0]
            probs = torch.cat([torch.softmax(model(images[i:i + 1000]), dim=-1) for i in range(0, len(images), 1000)])
            return probs.double().mean(0), f"the sent model's mean prediction on {len(images)} public images"
        mean = model.normalize.mean.reshape(1, -1, 1, 1).expand(1, -1, *image_shape[1:]).clone()
        return torch.softmax(model(mean), dim=-1)[0].double(), "the sent model's prediction at the pixel-mean image"


def round_counts(obs: RoundObservation, total: dict[str, torch.Tensor] | None = None,
                 sent: dict[str, torch.Tensor] | None = None,
                 sizes: dict[int, int] | None = None) -> RoundCounts:
    """The survivors' label histogram from one round's sum (``total``/``sent``/``sizes``: another round's,
    default this one's; ``sizes``: its survivors' nᵢ where they travelled in the clear), by the first rule
    that applies:

    * summed class counts (FedProto): Σᵢ nᵢₖ exactly, up to the quantisation;
    * a FedAvg-family sum with the classifier's bias: one plain SGD step on a client's nᵢ images moves
      the bias by Δbᵢ = −lr·(1/nᵢ)·Σⱼ (pⱼ − yⱼ), so with wᵢ = nᵢ/max_weight the summed weighted update is
      ΔB = −(lr/max_weight)·Σⱼ (pⱼ − yⱼ) over every survivor's image: the counts are
      Σⱼ yⱼ = Σⱼ pⱼ + max_weight·ΔB/lr, with Σⱼ pⱼ estimated as N·p̂ (N = Σ nᵢ, from the clear sample
      counts where they travel in the clear, else from the summed weight; p̂ the sent model's mean
      prediction on public data: ``public_prediction``) and rounded to N by largest remainders. Exact
      where |Σⱼ pⱼ − N·p̂ₖ| < ½ (an untrained model's near-uniform predictions); for clients taking
      several local steps it is an approximation (noted): each image's weight in the bias update
      depends on its client's size, taken from the clear counts where the server has them (their
      image-weighted mean), else as the round's mean size.

    Raises ``NotApplicable`` when the sum holds neither."""
    from ..inversion.closed_form import round_to_total  # largest-remainder rounding to a total

    if total is None:
        total, sizes = obs.total, obs.sample_counts()
    sent = obs.sent() if sent is None else sent
    model = obs.make_model()
    raw = summed_class_counts(obs.method, model, total, obs.max_weight, obs.num_classes)
    if raw is not None:
        return RoundCounts(raw.round().clamp_min(0).to(torch.int64), raw, "summed class counts",
                           [f"{obs.method.name} sums its clients' class counts: the round's histogram is read exactly"])
    n = sample_total(total, obs.max_weight) if sizes is None else sum(sizes.values())
    hp = obs.known_hyperparameters
    if "classifier.bias" not in total or sent is None or "classifier.bias" not in sent or n is None:
        raise NotApplicable(f"{obs.method.name}'s secure sum holds no class counts and no update of a classifier "
                            f"the server sent: it carries no label information")
    if hp is None:
        raise NotApplicable("reading labels from the summed classifier update needs the clients' learning rate "
                            "(drop --hyperparameters-unknown)")
    delta = summed_update(total, sent, ["classifier.bias"])["classifier.bias"]
    predicted, how = public_prediction(model, sent, obs.auxiliary, obs.image_shape)
    clients = max(len(sizes) if sizes is not None else len(obs.survivors), 1)
    weight = (image_weight(hp, n / clients) if sizes is None else
              sum(c * image_weight(hp, c) for c in sizes.values()) / max(n, 1))
    raw = n * predicted + obs.max_weight * delta / (hp.lr * weight)
    notes = [f"label histogram from the summed classifier-bias update of {n} images, Σp estimated from {how}"]
    if sizes is not None:
        notes.append("the survivors' sample counts travel in the clear (Flower's SecAgg+ leaves num_examples "
                     "unmasked): the round's image count is their sum")
    if hp.steps != 1:
        sizes_note = ("each image weighted by its client's size, read in the clear" if sizes is not None else
                      f"clients are taken to hold the round's mean of {n / clients:.0f} images (their sizes are "
                      f"hidden)")
        notes.append(f"the clients take {hp.steps} local steps, not one: the bias rule is an approximation (the "
                     f"predictions move between steps, and {sizes_note})")
    return RoundCounts(round_to_total(raw, n), raw, "summed classifier-bias update", notes)


def image_weight(hp: LocalHyperparameters, images: float) -> float:
    """How many full-batch steps' worth of bias update one image makes in a client's local training of
    ``images`` images: T for T steps on the whole batch (the victim setting), else epochs × images ÷
    batch (each image enters once per epoch, at weight 1/batch), so 1 for one step on all of them."""
    if hp.steps_per_phase is not None:
        return float(hp.steps_per_phase)
    return hp.epochs * images / max(min(hp.batch_size, images), 1.0)


# ------------------------------------------------------------------------------------------------
# building it from a recorded run


def known_hyperparameters(run, samples: int | None, survivors: int) -> LocalHyperparameters:
    """The clients' local training settings as the server knows them, for a client of the round's mean
    size (``samples`` Σ nᵢ over ``survivors`` clients; its own count stays hidden: ``samples`` None)."""
    train = run.train
    n = max(1, round((samples or train.batch_size * max(survivors, 1)) / max(survivors, 1)))
    steps = sum(phase_steps(epochs, n, train.batch_size)
                for _, epochs, _ in local_phases(run.method, train.local_epochs))
    return LocalHyperparameters(lr=train.lr, steps=steps, batch_size=train.batch_size, epochs=train.local_epochs)


def round_sums(recorder, upto: int) -> dict[int, RoundSum]:
    """Every round the recorder holds a secure-aggregation record of, up to ``upto``, as ``RoundSum``."""
    out = {}
    for r, record in sorted(recorder.aggregates.items()):
        if r > upto:
            continue
        downloads = {c: dict(ex.download.tensors) for c in record.participants
                     if (ex := recorder.get(r, c)) is not None}
        sent = common_download(downloads) if len(downloads) == len(record.participants) else None
        out[r] = RoundSum(r, tuple(record.participants), tuple(record.survivors), dict(record.total), record.aborted,
                          sent, {int(c): dict(v) for c, v in getattr(record, "clear", {}).items()})
    return out


def observe_round(run, round: int, *, hyperparameters_known: bool = True,
                  auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None, crafted: dict | None = None,
                  device: str = "cpu") -> RoundObservation:
    """The ``RoundObservation`` of ``round`` of ``run`` (an ``attacks.recorded.RecordedRun`` whose
    recorder has ``secure`` set and every round up to ``round`` recorded). ``auxiliary``: the public data
    the threat model hands the server; ``crafted``: a malicious server's records of this round, by client."""
    recorder = run.recorder
    protocol = getattr(recorder, "secure", None)
    if protocol is None:
        raise ValueError("the run was not recorded under secure aggregation: attack its uploads one by one")
    record = recorder.aggregates.get(round)
    if record is None:
        raise NotApplicable(f"round {round} has no secure-aggregation record (not trained or not recorded)")
    history = round_sums(recorder, round)
    downloads = {c: to_device(dict(ex.download.tensors), device) for c in record.participants
                 if (ex := recorder.get(round, c)) is not None}
    clear = {int(c): dict(v) for c, v in getattr(record, "clear", {}).items()}
    counts = clear_sample_counts(clear, record.survivors)
    samples = sample_total(record.total, protocol.max_weight) if counts is None else sum(counts.values())
    model = run.make_model
    return RoundObservation(
        method=run.method, round=round, participants=tuple(record.participants), survivors=tuple(record.survivors),
        dropped=tuple(record.dropped), total=to_device(dict(record.total), device), max_weight=protocol.max_weight,
        downloads=downloads, make_model=lambda: use_batch_statistics(model()).to(device),
        image_shape=tuple(run.dataset.images.shape[1:]), num_classes=run.dataset.num_classes,
        known_hyperparameters=(known_hyperparameters(run, samples, len(record.survivors))
                               if hyperparameters_known else None),
        quantum=float(record.quantum), aborted=record.aborted, auxiliary=auxiliary, crafted=dict(crafted or {}),
        history=history, device=str(device), clear=clear, protocol=protocol)
