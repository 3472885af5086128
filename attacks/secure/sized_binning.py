"""The binning craft sized to a secure-aggregation protocol, and its readout from a round's sum: what the
malicious server's round-level attacks (``sum_binning``, ``inconsistency``, ``sybil``) share.

Binning through the secure sum: a malicious server's crafted bins read out of the aggregate.

Fowl et al. 2022, "Robbing the Fed: Directly Obtaining Private Data in Federated Learning with
Modified Models", send every client the same crafted first linear layer (``attacks.malicious.craft``'s
``binning``). Under secure aggregation the server holds only the sum; but the bins are the same for
every client, so in the summed update each bin holds the sum over *all* clients' inputs that fell
in it, and a bin hit by exactly one image of the whole round still reads out that image's input
exactly: the readout is a ratio of a weight row to its bias, which no client's weight
w_i = n_i / max_weight changes.

The per-client craft alone does not survive the protocol: it keeps each sample's update a few
thousand float32 rounding steps above its tiny biases (about 1e-9), while the protocol quantises
every summand value to steps of 2·clipping_range / quantization_range (3.8e-6 at the defaults), so
the update vanishes in the rounding. The server runs the protocol and knows its parameters, so
``secure_binning`` sizes the craft to them (``ClientPlan``: the clients' sample count and the local
training the server configures; the registered attacks plan for clients of one batch):

* the next layer's equalised columns, which set every sample's upstream gradient, are scaled up
  as far as the clipping range lets them go: they are uploaded too, so w times a column, and w
  times a client's worst-case bias update, stay within ``margin`` of it;
* the layer before the crafted one is rescaled (exact: LeakyReLU and max-pooling are positively
  homogeneous; the crafted rows are rescaled inversely, so every bin keeps its thresholds) until a
  client's worst-case weight-row update fills the same margin: the inputs grow (to about 10 at the
  defaults), and with them each input's share of a bin stands far above the quantisation noise.

The price is the one the per-client craft avoids: a sample's step now moves the other inputs'
pre-activations by many bins, so the reading is exact only for one local step per client (a
client whose data fits one batch, one epoch); the record's notes say so when the plan has more.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from attacks.malicious.craft import CraftRecord, craft, layer_before, layer_inputs, layer_module, load, next_linear
from attacks.malicious.readout import rebuild_images, recover_inputs
from attacks.malicious.scoring import input_statistics, score_recovered
from fedecouple.secure_aggregation import SecureAggregation

from ..base import AttackResult, Budget, NotApplicable
from ..registry import CraftRequest

# the worst-case summand (weighted update) the craft aims for, as a share of the clipping range: the
# clients' inputs may reach beyond the public ones the bound is measured on
MARGIN = 0.5
# the public inputs' largest coordinate is measured at this quantile over the images, so that one odd
# public image does not set the scale
LARGEST_QUANTILE = 0.99
# the latest sized craft, [its inputs' key, (download, record)]: a round's participants all get the same honest
# download, so one craft serves them (binning draws nothing from the seed, which the key leaves out)
_LATEST: list = []
# seconds per L-BFGS step and image rebuilt (``attacks.malicious``'s rate for the per-client binning)
STEP_SECONDS = 0.0025
# what the malicious server's round-level attacks declare alike in their ``MaliciousRoundSpec`` (each adds
# its name, crafts, craft and attack); their read-back is scored as the per-client binning's, one row
# per image of the clients read with its recovered input's relative error (``score_recovered``), and
# summed up the same way (``input_statistics``: the share of inputs recovered exactly)
SPEC_COMMON = dict(default_victim_batch=0, applies_to=frozenset({"extractor"}), scoring="images",
                   needs="model weights in the sum",
                   hint="a crafted download is read back from the summed weights; try `fedsec attack sum-labels "
                        "--method {method}`", estimate_rate=STEP_SECONDS, estimate_per="image",
                   score_target=score_recovered, statistics=input_statistics)


@dataclass(frozen=True)
class ClientPlan:
    """What the server sizes a craft for: each client's sample count and its local training (the
    learning rate, batch size and epochs the server configures)."""

    samples: int
    lr: float
    batch_size: int
    epochs: int = 1

    @property
    def steps(self) -> int:
        """Local SGD steps of a client of ``samples`` images (a ragged last batch dropped)."""
        batch = min(self.batch_size, self.samples)
        return self.epochs * (self.samples // batch) if batch else 0

    @property
    def step_size(self) -> float:
        """η / B: the weight of one sample's gradient in one SGD step."""
        return self.lr / max(1, min(self.batch_size, self.samples))


def secure_binning(download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor,
                   reached: tuple[str, ...], protocol, plan: ClientPlan, seed: int = 0,
                   margin: float = MARGIN) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    """The binning craft sized to ``protocol`` (a ``SecureAggregation``) for clients that follow
    ``plan``; the same bins as ``craft("binning", ...)``. Returns the download and its record. A
    round's participants get the same honest download: the latest craft is kept and copied for them."""
    key = (fingerprint(download), fingerprint({"public": public}), tuple(reached), protocol, plan, margin)
    if _LATEST and _LATEST[0] == key:
        sent, record = _LATEST[1]
        return {k: v.clone() for k, v in sent.items()}, copy.deepcopy(record)
    sent, record = _sized(download, model, public, reached, protocol, plan, seed, margin)
    _LATEST[:] = [key, ({k: v.clone() for k, v in sent.items()}, copy.deepcopy(record))]
    return sent, record


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _sized(download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor, reached: tuple[str, ...],
           protocol, plan: ClientPlan, seed: int, margin: float) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    sent, record = craft("binning", download, model, public, reached, seed)
    model = load(model, sent)
    if record.next_equalised:
        sent.update(_size_to_protocol(model, record, sent, public, protocol, plan, margin))
    else:
        record.notes.append("the client trains against its own next layer: the craft cannot size the rows' upstream "
                            "gradient, so it stays at the per-client scale, below the protocol's quantisation")
    if plan.steps > 1:
        record.notes.append(f"a client takes {plan.steps} local steps: after the first, the other inputs' "
                            f"pre-activations have moved across bins, so only a one-step update reads exactly")
    record.sent = {k: v.detach().clone() for k, v in sent.items()}
    return {k: v.clone() for k, v in sent.items()}, record


def _size_to_protocol(model: nn.Module, record: CraftRecord, sent: dict[str, torch.Tensor], public: torch.Tensor,
                      protocol, plan: ClientPlan, margin: float) -> dict[str, torch.Tensor]:
    """The tensors that size the craft (module docstring). Every bound is a summand w·value against
    ``margin`` of the clipping range: the next layer's columns are themselves uploaded, so they are at
    most that over w; a sample's upstream gradient per row is column·c with |c| <= 2 (the alternating
    columns against softmax minus one-hot), and it enters a client's update epochs·n times at η/B."""
    layer = record.layer
    following = next_linear(model, layer)
    w = min(1.0, plan.samples / protocol.max_weight)
    room = margin * protocol.clipping_range / w
    per_client = 2.0 * plan.epochs * plan.samples * plan.step_size  # a row's update per unit of column·input
    column = room / max(1.0, per_client)
    changed = _widen_inputs(model, layer, public, room / (per_client * column), room)
    inputs = layer_inputs(model, layer, public).double()
    weight = changed.get(f"{layer}.weight", sent[f"{layer}.weight"]).double()
    hidden = torch.nn.functional.leaky_relu(inputs @ weight.T + sent[f"{layer}.bias"].double(), 0.01)
    old = sent[f"{following}.weight"]
    factor = max(column, float(old.abs().max())) / float(old.abs().max())
    # logits beyond O(1) would starve half the classes' gradient: shrink the rows (every bin keeps its order)
    shrink = min(1.0, 1.0 / max(factor * float(old.abs().max()) * float((hidden @ record.signs.double()).abs().max()),
                                1e-30))
    changed.update({f"{following}.weight": old * factor, f"{layer}.weight": (weight * shrink).float(),
                    f"{layer}.bias": sent[f"{layer}.bias"] * shrink})
    record.thresholds = record.thresholds * shrink
    record.notes.append(f"sized for secure aggregation: next-layer columns {factor * float(old.abs().max()):.3g} "
                        f"(x{factor:.3g} the per-client craft), inputs up to {float(inputs.abs().max()):.3g}, "
                        f"for clients of {plan.samples} images at weight {w:.3g}")
    return changed


def _widen_inputs(model: nn.Module, layer: str, public: torch.Tensor, largest: float,
                  room: float) -> dict[str, torch.Tensor]:
    """Scale the layer before ``layer`` by κ (and ``layer``'s weight by 1/κ, so every pre-activation
    is unchanged) until the public inputs' largest coordinate (its ``LARGEST_QUANTILE``) is
    ``largest``, its own largest parameter staying within ``room``; changes ``model`` in place and
    returns the changed tensors ({} when the layer sees the pixels)."""
    before = layer_before(model, layer)
    if before is None:
        return {}
    name, module = before
    inputs = layer_inputs(model, layer, public).double()
    now = float(torch.quantile(inputs.abs().amax(1), LARGEST_QUANTILE))
    biggest = max(float(p.detach().abs().max()) for p in module.parameters(recurse=False))
    kappa = min(largest / max(now, 1e-30), room / max(biggest, 1e-30))
    crafted = layer_module(model, layer)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.mul_(kappa)
        crafted.weight.div_(kappa)
    changed = {f"{name}.{k}": p.detach().clone() for k, p in module.named_parameters(recurse=False)}
    changed[f"{layer}.weight"] = crafted.weight.detach().clone()
    return changed


def sum_upload(total: dict[str, torch.Tensor], weight: float | None = None) -> dict[str, torch.Tensor]:
    """The summed tensors divided by the summed weight (``total["sample_count"]`` unless ``weight``):
    Σ w_i·θ_i / Σ w_i = what was sent + the weighted mean update, which ``recover_inputs`` reads as
    one upload (its ratios do not see the weights)."""
    scale = float(total["sample_count"]) if weight is None else float(weight)
    if not scale > 0:
        raise ValueError("the sum's weight is not positive: no survivor's update to read")
    return {k: v.double() / scale for k, v in total.items() if k != "sample_count"}


def denoise(record: CraftRecord, upload: dict[str, torch.Tensor], error: float) -> dict[str, torch.Tensor]:
    """``upload`` with every bin that the quantisation alone could have filled emptied: ``error`` bounds
    how far each decoded value may lie from the exact one, so a bin (two rows of one sign) whose bias
    difference is within 2·error and whose weight difference is within 2·error·√d holds no input.
    Left alone, such a bin's ratio of two rounding errors is a spurious candidate, and it keeps the
    readout from pinning its cells at zero. The rows are rebuilt down each sign's chain from its top
    row, adding only the bins that hold something."""
    if error <= 0 or record.craft != "binning":
        return dict(upload)
    weight, bias = f"{record.layer}.weight", f"{record.layer}.bias"
    rows = torch.cat([upload[weight].double() - record.sent[weight].double(),
                      (upload[bias].double() - record.sent[bias].double())[:, None]], dim=1)
    bins = rows[:-2] - rows[2:]
    held = (bins[:, -1].abs() > 2 * error) | (bins[:, :-1].norm(dim=1) > 2 * error * (rows.shape[1] - 1) ** 0.5)
    clean = rows.clone()
    for m in range(len(rows) - 3, -1, -1):
        clean[m] = clean[m + 2] + (bins[m] if bool(held[m]) else 0.0)
    return {**upload, weight: record.sent[weight].double() + clean[:, :-1],
            bias: record.sent[bias].double() + clean[:, -1]}


def read_sum(record: CraftRecord, total: dict[str, torch.Tensor], weight: float | None = None,
             error: float = 0.0) -> torch.Tensor:
    """(m, d) candidate inputs of the crafted layer from a round's decoded sum (every survivor was
    sent ``record.sent``): one per bin (and per cell) of the summed update that holds any input.
    ``error``: how far each summed value may lie from the exact sum (survivors × quantum), which
    ``denoise`` clears from the bins."""
    upload = sum_upload(total, weight)
    scale = float(total["sample_count"]) if weight is None else float(weight)
    return recover_inputs(record, denoise(record, upload, error / scale))


def request_plan(request: CraftRequest) -> tuple[object, ClientPlan, list[str]]:
    """(protocol, plan, notes) a craft request sizes for: the protocol the server runs (the defaults
    when the request carries none) and clients of one batch of the configured local training, the only
    ones whose update reads exactly. The craft goes out before the round, so the sample counts that
    travel in the clear with this round's uploads (``clear_fields="flower"``) come too late for it; a
    server that knows the clients' sizes (from earlier rounds' clear counts) could plan for those."""
    notes = []
    protocol = request.secure
    if protocol is None:
        protocol = SecureAggregation()
        notes.append("the server was not handed the protocol: the craft is sized for its default parameters")
    train = request.train
    if train is None:
        raise ValueError("sizing a craft to the protocol needs the clients' local training settings")
    plan = ClientPlan(samples=int(train.batch_size), lr=float(train.lr), batch_size=int(train.batch_size),
                      epochs=int(train.local_epochs))
    return protocol, plan, notes


def sum_binning_craft(request: CraftRequest) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    """``MaliciousRoundSpec.craft_download``: the sized binning craft, the same for every participant."""
    protocol, plan, notes = request_plan(request)
    sent, record = secure_binning(dict(request.download), request.make_model(), request.public, request.reached,
                                  protocol, plan, request.seed)
    record.notes[:0] = notes
    return sent, record


def rebuild_each(make_model, record: CraftRecord, inputs: torch.Tensor, image_shape: tuple[int, int, int],
                 iterations: int, seed: int) -> torch.Tensor:
    """(m, C, H, W) one image per input (``attacks.malicious.readout.rebuild_images``), each from its own
    L-BFGS run: in one joint run the shared line search lets every image steer the others, so an image
    would hinge on which other candidates (spurious ones included) the bins held."""
    if len(inputs) == 0:
        return torch.zeros(0, *image_shape)
    return torch.cat([rebuild_images(make_model(), record, inputs[i:i + 1], image_shape, iterations, seed)
                      for i in range(len(inputs))])


def rebuilt(observation, record: CraftRecord, inputs: torch.Tensor, budget: Budget, seed: int, trace: dict,
            notes: list[str]) -> AttackResult:
    """The images rebuilt from ``inputs`` (the crafted layer's), unlabelled (``rebuild_each``); the result
    keeps the inputs, which the harness scores against the true ones (``scored_record``)."""
    images = rebuild_each(observation.make_model, record, inputs, observation.image_shape, budget.iterations, seed)
    result = AttackResult(images, torch.full((len(images),), -1, dtype=torch.long),
                          trace={"candidates": len(inputs), **trace}, notes=list(dict.fromkeys(notes)))
    result.variables["inputs"] = inputs
    return result


# ------------------------------------------------------------------------------------------------
# a round crafted as a whole (model inconsistency, sybils): each participant's record

ROLES = ("target", "neighbour", "silenced", "sybil")


@dataclass
class RoundCraft:
    """What the server sent one participant of a round it attacks as a whole: the participant's
    ``role`` (``ROLES``), the round's ``target``, the crafted layer, the download as sent, and for
    the target (and its neighbours under ``neighbourhood``) the binning record. A sybil's record
    also keeps the upload its client sent (``keeps_upload``: the server runs that client)."""

    role: str
    target: int
    layer: str
    sent: dict[str, torch.Tensor]
    binning: CraftRecord | None = None
    keeps_upload: bool = False
    upload: dict[str, torch.Tensor] | None = None
    notes: list[str] = field(default_factory=list)


def pick_target(clients, round: int) -> int:
    """The round's target: a choice among ``clients`` seeded by the round, the same for every
    participant's craft (each is crafted on its own)."""
    ids = sorted(int(c) for c in clients)
    if not ids:
        raise ValueError("a round with no participant has no target")
    return ids[int(np.random.default_rng([int(round), 0x150]).integers(len(ids)))]


def scored_record(crafted: dict[int, object]) -> CraftRecord | None:
    """The binning record a round's read-back was made under (None: none was crafted): the target's under a
    round crafted as a whole (``RoundCraft``), else the one every participant got (``sum_binning``)."""
    for record in crafted.values():
        if getattr(record, "role", None) == "target":
            return record.binning
    return next((r for r in crafted.values() if isinstance(r, CraftRecord)), None)


def target_record(crafted: dict[int, object]) -> tuple[int, CraftRecord]:
    """(the round's target, its binning record) from the round's records by client (``RoundCraft``)."""
    for client, record in crafted.items():
        if getattr(record, "role", None) == "target":
            return int(client), record.binning
    raise NotApplicable("the server crafted no target's download in this round")
