"""``sum-disaggregation``: per-client label counts and updates from many rounds' sums, by least squares.

Gradient disaggregation (Lam et al. 2021, "Gradient Disaggregation: Breaking Privacy in Federated
Learning by Reconstructing the User Participant Matrix"): secure aggregation hides one client's update
inside each round's sum, but the server knows who took part in every round. With clients sampled
anew each round (``--join-ratio`` below 1), the rounds' sums S_r = Σ_{i ∈ survivors(r)} x_i form a
linear system S = P·X in the per-client contributions X, whose participation matrix P (rounds ×
clients, 1 where the client's upload is in the sum) the server holds; Lam et al. reconstruct P from
side information, here it is given. Where P has full column rank (about as many informative rounds as
clients) least squares recovers every x_i that stays the same across rounds; a client whose column is
not determined (its indicator vector outside P's row space) is reported unresolved, never guessed.

What is constant across rounds, and so recovered:

* the per-client label counts: each round's histogram is read from its sum (``round_counts``: exact
  for FedProto's summed class counts, the classifier-bias rule for the FedAvg family), least squares
  gives each client's (C,) counts, rounded to integers (exact when every round's histogram is, and the
  client's data set is fixed: ``--train-images N``, not the victim setting, whose batch changes per round);
* the per-client weight wᵢ = nᵢ/max_weight (FedAvg's summed ``sample_count``), hence nᵢ. Where the
  clients' sample counts travel in the clear (``clear_fields="flower"``, as in Flower's SecAgg+, which
  leaves each FitRes' num_examples unmasked) the server reads nᵢ there instead, exactly, and the weight
  each client's update carries in the sum is Flower's ŵᵢ = round(nᵢ/max_weight · Q)/Q;
* the per-client weighted update wᵢ·Δθᵢ: it changes as the global model trains, so least squares returns
  a combination of each client's updates over the window, plus what the other clients' changes leave
  behind; how much of the client survives that is what the per-client attack below measures.

The per-client attack on what is recovered (``attack_update``), for a one-image client: its label by
iDLG's rule on the classifier's update (Zhao et al. 2020, "iDLG: Improved Deep Leakage from Gradients"),
and its image from the closed form of the extractor's last linear layer (a one-image update of
z = W a + b is ΔW = Δb·aᵀ, so a = ΔWᵀΔb/‖Δb‖²; ``attacks.inversion.closed_form.linear_input``) inverted
through the layers below (``attacks.inversion.layer_inputs``) at the window's mean sent model. The same
function applies to a client's true update without secure aggregation (``bench/secure_curious.py``
compares the two).

Result: one image per resolved one-image client (``trace["image_clients"]``), its iDLG label;
``trace["client_label_counts"]`` ({client: counts, None where unresolved}), ``trace["clients"]`` (every
client of the window: the harness scores the images against their training images) and the window's
rank and residuals.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from fedecouple.secure_aggregation import weight_factor

from ..base import AttackResult, Budget, NotApplicable
from ..inversion.closed_form import last_linear_layer, linear_input
from ..inversion.idlg_rule import idlg_applies, idlg_labels
from ..inversion.layer_inputs import invert_layer_inputs
from ..registry import RoundAttackSpec
from .observation import SAMPLE_COUNT, RoundObservation, RoundSum, round_counts, summed_update, weight_of

RANK_TOLERANCE = 1e-9  # a client is resolved when its share of P's null space is below this


def window(obs: RoundObservation) -> list[RoundSum]:
    """The rounds the server can use: every recorded round up to this one that was unmasked and whose
    download was one model for every participant."""
    return [s for _, s in sorted(obs.history.items()) if not s.aborted and s.total and s.sent is not None]


def participation(rounds: list[RoundSum]) -> tuple[list[int], np.ndarray]:
    """(clients, P): every client in some round's sum, and the rounds × clients 0/1 matrix of who is in
    which sum."""
    clients = sorted({c for s in rounds for c in s.survivors})
    matrix = np.array([[float(c in s.survivors) for c in clients] for s in rounds], dtype=np.float64)
    return clients, matrix.reshape(len(rounds), len(clients))


def resolved(matrix: np.ndarray) -> tuple[np.ndarray, int]:
    """(per client whether least squares determines its contribution, the rank of P): a client is
    determined when P's null space has no component along it."""
    _, singular, vt = np.linalg.svd(matrix, full_matrices=True)
    rank = int((singular > singular.max(initial=0) * 1e-10).sum()) if singular.size else 0
    null = vt[rank:]
    share = np.abs(null).max(axis=0) if len(null) else np.zeros(matrix.shape[1])
    return share < RANK_TOLERANCE, rank


def solve(matrix: np.ndarray, sums: np.ndarray) -> tuple[np.ndarray, float]:
    """(least-squares per-client values X with P·X ≈ sums, the relative residual ‖P·X − S‖/‖S‖)."""
    values, *_ = np.linalg.lstsq(matrix, sums, rcond=None)
    scale = float(np.linalg.norm(sums)) or 1.0
    return values, float(np.linalg.norm(matrix @ values - sums)) / scale


def client_counts(obs: RoundObservation, rounds: list[RoundSum], matrix: np.ndarray, ok: np.ndarray,
                  clients: list[int], notes: list[str]) -> tuple[dict, float | None]:
    """({client: its (C,) label counts, None where unresolved}, the residual) from the rounds' histograms."""
    try:
        histograms = np.stack([round_counts(obs, s.total, s.sent, s.sample_counts()).counts.numpy()
                               for s in rounds]).astype(np.float64)
    except NotApplicable as exc:
        notes.append(f"no per-client label counts: {exc}")
        return {}, None
    values, residual = solve(matrix, histograms)
    counts = np.clip(np.rint(values), 0, None).astype(np.int64)
    return {c: counts[i].tolist() if ok[i] else None for i, c in enumerate(clients)}, residual


def client_updates(rounds: list[RoundSum], matrix: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, float]:
    """(names, per-client weighted updates wᵢ·Δθᵢ (clients × values), per-client weights wᵢ, residual)."""
    names = [n for n in rounds[0].total if n != SAMPLE_COUNT and n in rounds[0].sent]
    flat = np.stack([torch.cat([u.reshape(-1) for u in summed_update(s.total, s.sent, names).values()]).numpy()
                     for s in rounds])
    updates, residual = solve(matrix, flat)
    weights, _ = solve(matrix, np.array([weight_of(s.total) for s in rounds], dtype=np.float64))
    return names, updates, weights, residual


def clear_counts(rounds: list[RoundSum]) -> dict[int, int]:
    """{client: nᵢ} for every client whose sample count travelled in the clear in the window, and was the
    same in every round it did (a changing count is left to least squares)."""
    seen: dict[int, set[int]] = {}
    for s in rounds:
        for client, fields in s.clear.items():
            if SAMPLE_COUNT in fields and client in s.survivors:
                seen.setdefault(int(client), set()).add(int(fields[SAMPLE_COUNT]))
    return {c: next(iter(values)) for c, values in seen.items() if len(values) == 1}


def flower_weight(obs: RoundObservation, n: int) -> float:
    """The weight nᵢ's update carries in the sum: n / max_weight as Flower's rounded factor over Q (the
    exact ratio where the round's protocol was not handed over)."""
    protocol = obs.protocol
    if protocol is None:
        return n / obs.max_weight
    return weight_factor(protocol, n / protocol.max_weight) / protocol.quantization_range


def unflatten(vector: np.ndarray, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for n in names:
        size = like[n].numel()
        out[n] = torch.from_numpy(np.array(vector[start:start + size])).reshape(like[n].shape)
        start += size
    return out


def mean_model(rounds: list[RoundSum]) -> dict[str, torch.Tensor]:
    """The mean of the window's sent models (where the recovered update's layer inputs are read)."""
    names = list(rounds[0].sent)
    return {n: torch.stack([s.sent[n].detach().cpu().float() for s in rounds]).mean(0) for n in names}


def attack_update(update: dict[str, torch.Tensor], model: nn.Module, params: dict[str, torch.Tensor],
                  image_shape: tuple[int, int, int], iterations: int) -> tuple[torch.Tensor | None, int, dict]:
    """The per-client attack on one client's model update Δθ (any positive multiple): (its image rebuilt
    through the extractor's last linear layer, or None where the model has none; its label by iDLG's rule,
    -1 without a classifier update; what was read: the rank-1 residual and iDLG's applicability). ``model``
    is the architecture, ``params`` the weights the layers below are inverted at, ``image_shape`` (C, H, W)
    the images', ``iterations`` the inversion's L-BFGS budget."""
    info: dict = {}
    label = -1
    if "classifier.weight" in update:
        gradient = -update["classifier.weight"].double()
        label = int(idlg_labels(gradient, 1)[0][0])
        info["idlg_applies"] = bool(idlg_applies(gradient))
    found = last_linear_layer(model)
    if found is None:
        return None, label, {**info, "image": "the extractor has no last linear layer to read an input from"}
    position, child = found
    weight, bias = f"extractor.{child}.weight", f"extractor.{child}.bias"
    if weight not in update or bias not in update:
        return None, label, {**info, "image": f"the update holds no {weight}"}
    layer_input, residual = linear_input(update[weight].double(), update[bias].double())
    info["rank1_residual"] = residual
    model.load_state_dict({**model.state_dict(), **params}, strict=False)
    model.requires_grad_(False)
    below = nn.Sequential(*list(model.extractor.children())[:position])
    start = model.normalize.mean.reshape(-1, 1, 1).expand(*image_shape)
    image = invert_layer_inputs(lambda x: below(model.normalize(x)).flatten(1), layer_input.float().reshape(1, -1),
                                start.clone(), iterations)
    return image[0], label, info


def disaggregation(observation: RoundObservation, budget: Budget, seed: int) -> AttackResult:
    """Per-client label counts and updates from the rounds up to this one, then the per-client attack on
    each recovered one-image update (module docstring). ``seed`` is unused (least squares and L-BFGS from
    the mean image are deterministic)."""
    start = time.perf_counter()
    rounds = window(observation)
    if not rounds:
        raise NotApplicable("no unmasked round with one download for every participant: nothing to disaggregate")
    clients, matrix = participation(rounds)
    ok, rank = resolved(matrix)
    notes = [f"{len(rounds)} rounds' sums, {len(clients)} clients: the participation matrix has rank {rank}; "
             f"{int(ok.sum())} of {len(clients)} clients are determined by least squares"]
    if rank < len(clients):
        notes.append(f"{len(clients) - int(ok.sum())} clients are not determined (too few rounds or clients that "
                     f"always take part together): attack a later round or sample fewer clients per round")
    counts, count_residual = client_counts(observation, rounds, matrix, ok, clients, notes)
    trace = {"mode": "least-squares", "clients": clients, "rounds": [s.round for s in rounds], "rank": rank,
             "client_label_counts": counts, "count_residual": count_residual}
    images, labels, image_clients = _images(observation, rounds, matrix, ok, clients, budget, trace, notes)
    trace["image_clients"] = image_clients
    trace["seconds"] = time.perf_counter() - start
    shape = (len(images), *observation.image_shape)
    return AttackResult(images=torch.stack(images) if images else torch.zeros(shape),
                        labels=torch.tensor(labels, dtype=torch.int64), trace=trace, notes=notes)


def _images(obs: RoundObservation, rounds: list[RoundSum], matrix: np.ndarray, ok: np.ndarray, clients: list[int],
            budget: Budget, trace: dict, notes: list[str]) -> tuple[list, list, list]:
    """Each resolved one-image client's image and label from its recovered update (``attack_update``)."""
    if weight_of(rounds[0].total) is None:
        notes.append(f"{obs.method.name} sums no model: no per-client update to attack")
        return [], [], []
    names, updates, weights, residual = client_updates(rounds, matrix)
    trace["update_residual"] = residual
    known = clear_counts(rounds)
    if known:
        notes.append(f"{len(known)} of {len(clients)} clients' sample counts read in the clear (Flower's SecAgg+ "
                     f"leaves num_examples unmasked), not solved for")
        for i, c in enumerate(clients):
            if c in known:
                weights[i] = flower_weight(obs, known[c])
    params = mean_model(rounds)
    images, labels, image_clients, per_client = [], [], [], {}
    for i, c in enumerate(clients):
        n = known[c] if c in known else int(round(weights[i] * obs.max_weight))
        if not ok[i] or n != 1 or not weights[i] > 0:
            per_client[c] = {"images": n, "attacked": False}
            continue
        update = unflatten(updates[i] / weights[i], rounds[0].total, names)
        image, label, info = attack_update(update, obs.make_model().cpu(), params, obs.image_shape, budget.iterations)
        per_client[c] = {"images": n, "attacked": image is not None, **info}
        if image is not None:
            images.append(image.cpu())
            labels.append(label)
            image_clients.append(c)
    trace["per_client"] = per_client
    if not images:
        notes.append("no resolved one-image client: the closed form reads one image's update only")
    return images, labels, image_clients


def summary_lines(summary: dict) -> list[str]:
    """The per-client label counts' exactness, under the headline."""
    counts = summary.get("client_counts") or {}
    if not counts.get("clients"):
        return []
    low, high = counts["exact_rate_ci"]
    return [f"  per-client label counts exact for {counts['exact']} of {counts['clients']} clients "
            f"[{100 * low:.0f}, {100 * high:.0f}] % ({counts['unresolved']} not determined by the rounds)"]


SPEC = RoundAttackSpec("sum-disaggregation", attack_round=disaggregation, default_victim_batch=0,
                       applies_to=frozenset({"classifier", "class_counts", "extractor"}), scoring="images",
                       needs="model or class counts in the sum", hint="its secure sum carries nothing per client",
                       estimate_rate=0.05, estimate_per="target", summary_lines=summary_lines)
