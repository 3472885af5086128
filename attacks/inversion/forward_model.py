"""The forward model of the gradient attacks: how a dummy batch is compared with an update target
(``attacks.inversion.observation.update_target``).

Three ways to compare a dummy batch with Δ (``GradientMatcher``), named in every output:

* ``scaled-gradient``: the target is g = −Δ/(lr·steps) (one big step on the batch); with unknown
  hyperparameters g = −Δ/‖Δ‖ (the scale is unknown: cosine objectives ignore it, DLG fits it);
  the dummy's quantity is the loss gradient at the before-state.
* ``replay``: needs the hyperparameters (lr, steps, batch size): T plain cross-entropy SGD steps
  are replayed differentiably from the before-state on the dummy batch, and the resulting
  Δ̂ is compared with Δ (both divided by −lr·steps, so they read as gradients). This is exact for
  FedAvg-style local training; for methods that train in phases or with extra losses
  (FedeCouple, FedRep, FedPAC, ...) it is an approximation, and the notes say so.
* ``method``: needs the hyperparameters; the attacked method's own local training
  (``Replay.replay``: its phases, losses, frozen parts and augmented copies, in the layout of
  ``plan_layout``) is replayed on the dummy data and matched to the upload group by group, plus the
  statistics the method uploads (prototypes, ``h``, counts) as relative errors.

Parameters the client trained but the server does not hold (a private head after round 0:
``UpdateTarget.unknown``) are unknowns beside the images (``GradientMatcher.private_names``, carried in
the extra variable z after the copies' parameters), unless the head-free closed form fits what they do.

``mode="auto"`` (``resolve_mode``) takes ``method`` when the hyperparameters are known and the
method's local training is not plain SGD; otherwise it replays for more than one step, and with one
step, where replay and scaled gradient are the same computation, it is named ``scaled-gradient``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedecouple.methods.base import phase_steps
from fedecouple.methods.facets import local_phases, trains_plain_sgd
from fedecouple.methods.replay import ReplayContext, Step, parameter_gradients
from fedecouple.models import group_of, use_batch_statistics

from ..base import LocalHyperparameters, Observation
from .closed_form import derive as derive_closed_form
from .closed_form_terms import ClosedFormTerms, one_hot
from .matching_terms import MatchingTerms
from .matching_terms import one_minus_cosine  # noqa: F401  (classifier fishing reads it from here)
from .observation import CLASSIFIER_WEIGHT, COPY_MODELS, UpdateTarget, kept_model, resolve_mode, update_target


def scaled_gradient(target: UpdateTarget, hyperparameters: LocalHyperparameters | None) -> dict[str, torch.Tensor]:
    """g = −Δ/(lr·steps), or −Δ/‖Δ‖ when the hyperparameters are unknown."""
    if hyperparameters is not None:
        scale = 1.0 / (hyperparameters.lr * max(hyperparameters.steps, 1))
    else:
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in target.delta.values()))
        scale = 1.0 / norm if norm > 0 else 1.0
    return {n: -scale * d for n, d in target.delta.items()}


def soft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for hard labels (B,) or probability rows (B, C)."""
    if labels.ndim == 1:
        return F.cross_entropy(logits, labels)
    return torch.sum(-labels * F.log_softmax(logits, dim=-1), dim=-1).mean()


@dataclass
class Layout:
    """How the dummy images map onto the client's SGD steps.

    In the victim setting every step uses all ``reconstructed`` images (slots are the images). In
    real local training each epoch takes ``reconstructed`` = (n // batch) · batch images in a shuffle
    the server does not know: every epoch of every phase gets its own copy of the image set (the
    multi-epoch setting of Dimitrov et al., 2022), ``epoch_copies`` of them, slot = copy · m + its
    place in the epoch; ``combine`` aligns the copies and averages them into one reconstruction each."""

    steps: list[Step]
    augmented: list[bool]
    slots: int
    reconstructed: int
    epoch_copies: int


def plan_layout(method, hp: LocalHyperparameters) -> Layout:
    """The method's phases (``Replay.local_phases``), ``phase_steps`` steps each (ragged last batches
    dropped, as the client does), laid out on dummy slots (``Layout``)."""
    n = int(hp.samples if hp.samples is not None else hp.batch_size)
    bs = min(hp.batch_size, n)
    per_epoch = n // bs
    steps, augmented, copy = [], [], 0
    for phase, epochs, aug in local_phases(method, hp.epochs):
        for j in range(phase_steps(epochs, n, bs, hp.steps_per_phase)):
            if hp.steps_per_phase is not None:
                members = tuple(range(n))
            else:
                if j and j % per_epoch == 0:
                    copy += 1
                start = copy * per_epoch * bs + (j % per_epoch) * bs
                members = tuple(range(start, start + bs))
            steps.append(Step(phase, members))
            augmented.append(aug)
        if hp.steps_per_phase is None and steps and steps[-1].phase == phase:
            copy += 1
    if hp.steps_per_phase is not None:
        return Layout(steps, augmented, n, n, 1)
    return Layout(steps, augmented, max(copy, 1) * per_epoch * bs, per_epoch * bs, max(copy, 1))


def combine_epoch_copies(images: torch.Tensor, copies: int) -> torch.Tensor:
    """(copies · m, ...) dummy images → m reconstructions: every later copy of the image set aligned to
    the first one (``scipy.optimize.linear_sum_assignment`` on pixel MSE), then all averaged."""
    if copies <= 1:
        return images
    from scipy.optimize import linear_sum_assignment

    sets = images.reshape(copies, -1, *images.shape[1:])
    reference = sets[0].flatten(1).clamp(0, 1).double()
    aligned = [sets[0]]
    for later in sets[1:]:
        cost = torch.cdist(reference, later.flatten(1).clamp(0, 1).double()).pow(2).cpu().numpy()
        rows, cols = linear_sum_assignment(cost)
        aligned.append(later[torch.from_numpy(cols[np.argsort(rows)])])
    return torch.stack(aligned).mean(0)


def replay_context(obs: Observation, before: dict[str, torch.Tensor], steps: list[Step],
                   copies: int = 1) -> ReplayContext:
    """What ``Replay.replay`` starts from, from the observation alone (``before`` from
    ``update_target``; the client's kept model: its previous upload, else the initial weights);
    ``copies``: epoch copies of the image set in the replayed images (``Layout.epoch_copies``)."""
    initial = {n: p.detach() for n, p in obs.make_model().named_parameters()}
    previous = obs.previous_upload or {}
    kept = kept_model(obs, initial)
    notes = []
    if obs.round > 0 and not any(n in previous for n in initial):
        notes.append("no previous upload of this client: its kept model is taken to be the initial one")
    uploaded = {n: v.to(torch.get_default_dtype()) for n, v in obs.upload.items() if n in initial}
    return ReplayContext(before=before, kept=kept, download=dict(obs.download), lr=obs.known_hyperparameters.lr,
                         uploaded=uploaded,
                         steps=steps, num_classes=obs.num_classes, notes=notes, copies=int(copies))


FAMILY_PARAMETERS = 8  # per copy: gain a, offset b, and a 2x3 affine map


def family_start(count: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """(count, 8) family parameters of the identity: gain 1, offset 0, the identity affine map."""
    return torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0], device=device).repeat(count, 1)


def family_copy(images: torch.Tensor, parameters: torch.Tensor) -> torch.Tensor:
    """clamp(a · warp_θ(x) + b, 0, 1) per image: one differentiable family that holds every operation
    of the paper's augmentation (crop and resize, flip and rotation are affine warps; brightness is a
    gain a; inversion is a = −1, b = 1). The sampling grid is built by matrix product (not
    ``affine_grid``) so that it runs under ``torch.func.vmap``."""
    n, c, h, w = images.shape
    like = {"dtype": images.dtype, "device": images.device}
    ys = (torch.arange(h, **like) * 2 + 1) / h - 1  # pixel centres, align_corners=False
    xs = (torch.arange(w, **like) * 2 + 1) / w - 1
    base = torch.stack([xs.repeat(h), ys.repeat_interleave(w), torch.ones(h * w, **like)], dim=1)
    theta = parameters[:, 2:].reshape(n, 2, 3)
    grid = (base.unsqueeze(0) @ theta.transpose(1, 2)).reshape(n, h, w, 2)
    warped = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return (parameters[:, :1, None, None] * warped + parameters[:, 1:2, None, None]).clamp(0.0, 1.0)


class GradientMatcher(ClosedFormTerms, MatchingTerms):
    """Computes, for a dummy batch, the quantity comparable with the observed update.

    ``target`` is the list of observed tensors and ``dummy(x, y)`` the dummy's counterpart (same
    order, differentiable in x and y). In the ``replay`` and ``scaled-gradient`` modes they are
    gradient-like (g = −Δ/(lr·steps), or −Δ/‖Δ‖ when only the direction is known: ``scale_known``
    False). In the ``method`` mode the method's own replay (``Replay.replay``) is run on the dummy:
    the targets are the observed Δ of each attacked weight and the uploaded statistics the replay
    also produces (FedPAC's prototypes, h, class counts), in ``groups``: one per weight group, one per
    statistic (``l2_objective``, ``cosine_objective``). ``dummy_images`` images are optimised: the ``originals`` reconstructions, then one
    free image per augmented copy the client trained on when ``observation.copies`` is "free" (the
    default); with "family" each copy is ``family_copy`` of its image with ``copy_parameters`` unknown
    parameters; with known draws (oracle) the copies are the client's. Its closed-form terms are
    ``ClosedFormTerms`` (``attacks.inversion.closed_form_terms``), its objectives ``MatchingTerms``
    (``attacks.inversion.matching_terms``).
    """

    def __init__(self, obs: Observation, mode: str = "auto"):
        self.observation = obs
        self.update = update_target(obs)
        self.mode = resolve_mode(obs, mode)
        self.hyperparameters = obs.known_hyperparameters
        self.scale_known = self.hyperparameters is not None
        self.model = obs.make_model()
        self.model.requires_grad_(False)
        use_batch_statistics(self.model.eval())  # eval() would switch BatchNorm to its running statistics
        self.names = self.update.names
        self.notes = list(self.update.notes)
        self.originals = None  # dummy images the replay uses (None: the attack's batch)
        self.reconstructed = None  # images rebuilt from them (``reconstructions``)
        self.epoch_copies = 1
        self.free_copies = 0
        self.copy_parameters = 0  # family mode: copies × FAMILY_PARAMETERS unknowns
        self.copy_model = None
        self.augmented: list[bool] = []
        self.aux_names: list[str] = []
        self.closed = derive_closed_form(self.observation, self.update, self.model, self.mode)
        if self.mode == "method":
            self._set_up_method()
        else:
            gradient = scaled_gradient(self.update, self.hyperparameters)
            self.target = [gradient[n] for n in self.names]
            self.groups = [list(range(len(self.names)))]
            self._note_plain_modes()
            self._set_up_plain_layout()
        self._set_up_closed_form()
        self._set_up_private()

    def _set_up_private(self) -> None:
        """The private parameters the server cannot know (``UpdateTarget.unknown``) become unknowns of
        the fit, unless the head-free closed form already fits all they do: ``private`` =
        stand-in + ``private_scale``·u with u (``private_size`` numbers) optimised with the images, from 0."""
        unknown = [] if self.labels_unused else list(self.update.unknown)
        self.private_names = unknown
        self.private_size = sum(self.update.before[n].numel() for n in unknown)
        stand_in = torch.cat([self.update.before[n].reshape(-1) for n in unknown]) if unknown else torch.zeros(0)
        # the stand-in's RMS (set, not tuned): the optimisers' steps, sized for pixels in [0, 1], then move
        # each parameter by a share of its typical size
        self.private_scale = float(stand_in.pow(2).mean().sqrt().clamp_min(1e-3)) if unknown else 1.0
        if unknown:
            self.notes.append(f"the private {', '.join(dict.fromkeys(group_of(n) for n in unknown))} "
                              f"({self.private_size} numbers) is an unknown, fitted jointly with the images from the "
                              f"stand-in")

    @property
    def z_size(self) -> int:
        """Numbers in the extra variable z: the copies' family parameters, then the private parameters."""
        return self.copy_parameters + self.private_size

    def z_start(self, device: str | torch.device | None = None) -> torch.Tensor:
        """The start of z: the copies' family parameters at the identity, (copies, 8); with private
        parameters fitted, one flat vector of those, then u = 0 (``split_z``)."""
        family = family_start(self.copy_parameters // FAMILY_PARAMETERS, device or self.observation.device)
        if not self.private_size:
            return family
        return torch.cat([family.reshape(-1), self.private_start().to(family.device)])

    def split_z(self, z: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the copies' family parameters, the private parameters u or None) of z (``z_start``'s layout)."""
        if z is None or not self.private_size:
            return z, None
        flat = z.reshape(-1)
        return flat[:self.copy_parameters].reshape(-1, FAMILY_PARAMETERS), flat[self.copy_parameters:]

    def private_start(self) -> torch.Tensor:
        """u = 0: the stand-in (``_set_up_private``), on the observation's device."""
        return torch.zeros(self.private_size, device=self.observation.device)

    def fitted_before(self, private: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The before-state with the private parameters at stand-in + scale·``private`` (None: the stand-in)."""
        before = self.update.before
        if private is None or not self.private_names:
            return before
        out, used = dict(before), 0
        for n in self.private_names:
            k = before[n].numel()
            out[n] = before[n] + self.private_scale * private[used:used + k].reshape(before[n].shape)
            used += k
        return out

    def _note_plain_modes(self) -> None:
        hp, obs = self.hyperparameters, self.observation
        if self.mode == "replay":
            self.notes.append(f"replay mode: {hp.steps} plain cross-entropy SGD step(s) with lr {hp.lr:g} on "
                              f"batches of {hp.batch_size} are replayed from the before-state and matched to the upload")
            if not trains_plain_sgd(obs.method):
                self.notes.append(f"{obs.method.name} does not train with plain cross-entropy SGD on all parameters "
                                  f"(phases, extra losses or augmentation): the replay is an approximation")
        elif hp is None:
            self.notes.append("scaled-gradient mode with unknown hyperparameters: the update is used as "
                              "g = -delta/||delta|| (direction only)")
        else:
            self.notes.append(f"scaled-gradient mode: the update is used as g = -delta/(lr*steps) "
                              f"with lr {hp.lr:g}, {hp.steps} step(s)")
            if not trains_plain_sgd(obs.method):
                self.notes.append(f"{obs.method.name}'s local update is not one cross-entropy gradient step "
                                  f"(phases, extra losses or augmentation): matching it as one is an approximation")

    def _set_up_method(self) -> None:
        obs, hp = self.observation, self.hyperparameters
        known = obs.known_schedule
        if known is not None:
            steps, self.draws = list(known.steps), list(known.draws)
            augmented = [d is not None for d in self.draws]
            self.reconstructed = int(hp.samples if hp.samples is not None else hp.batch_size)
        else:
            layout = plan_layout(obs.method, hp)
            steps, augmented = layout.steps, layout.augmented
            self.draws = None
            self.reconstructed, self.epoch_copies = layout.reconstructed, layout.epoch_copies
        self.augmented = augmented
        self.context = replay_context(obs, self.update.before, steps, self.epoch_copies)
        self.originals = (int(hp.samples if hp.samples is not None else hp.batch_size) if known is not None
                          else layout.slots)
        if obs.copies not in COPY_MODELS:
            raise ValueError(f"unknown copy model {obs.copies!r}; choose one of: {', '.join(COPY_MODELS)}")
        copies = 0 if known is not None else sum(len(s.members) for s, a in zip(steps, augmented) if a)
        self.copy_model = "oracle" if known is not None else obs.copies
        self.free_copies = copies if self.copy_model == "free" else 0
        self.copy_parameters = copies * FAMILY_PARAMETERS if self.copy_model == "family" else 0
        # the method's replay produces every field of its manifest but the sample count: besides the
        # weights, the statistics it uploads are matched too, but scalar ones (FedPAC's V, a variance
        # computed as a difference of large terms, zero by construction for a one-image client): their
        # float rounding outweighs what they carry
        statistics = [s for s in obs.manifest() if s.kind in ("prototype", "statistic", "class_counts") and s.shape]
        self.aux_names = sorted(n for n in obs.upload if any(s.pattern.match(n) for s in statistics))
        if self.closed.feature_means:
            # the closed form matches these statistics as features under the extractors they were computed
            # on (the uploaded one for prototypes): better conditioned than through the replayed step, and
            # of one shape for every target, so that targets of different classes share a model
            self.aux_names = []
        self.target = [self.update.delta[n] for n in self.names] + [obs.upload[n].to(torch.get_default_dtype())
                                                                      for n in self.aux_names]
        # the replay computes only what is matched (FedPAC's statistics and prototypes cost a pass each)
        self.context = dataclasses.replace(self.context, outputs=frozenset(self.names) | frozenset(self.aux_names))
        kinds = [group_of(n) for n in self.names] + [n.split(".")[0] for n in self.aux_names]
        order = list(dict.fromkeys(kinds))
        self.groups = [[i for i, k in enumerate(kinds) if k == g] for g in order]
        self.weight_groups = len(dict.fromkeys(group_of(n) for n in self.names))
        phases = ", ".join(f"{p}: {sum(s.phase == p for s in steps)}" for p in dict.fromkeys(s.phase for s in steps))
        own = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in obs.method.hyperparameters().items())
        self.notes.append(f"method mode: {obs.method.name}'s own local training is replayed on the dummy data "
                          f"({len(steps)} SGD steps; {phases}) with lr {hp.lr:g}"
                          + (f" and its settings ({own})" if own else "") + " and matched to the upload: "
                          f"the weights ({', '.join(order[:self.weight_groups])})"
                          + (f" and the statistics ({', '.join(order[self.weight_groups:])})"
                             if len(order) > self.weight_groups else ""))
        self.notes += self.context.notes
        if self.free_copies:
            self.notes.append(f"each augmented copy the client trained on is a free unknown image "
                              f"({self.free_copies} of them; the augmentation draws are not known)")
        elif self.copy_parameters:
            self.notes.append(f"each augmented copy the client trained on is modelled as a transform of its image "
                              f"from the augmentation family (gain, offset, affine warp: "
                              f"{self.copy_parameters // FAMILY_PARAMETERS} copies, their draws unknown)")
        elif known is not None:
            self.notes.append("oracle threat model: the client's batch order and augmentation draws are known "
                              "(an upper bound on what leaks)")
        if hp.steps_per_phase is None and known is None:
            self.notes.append(f"real local training: the client's shuffle is unknown; each of its "
                              f"{self.epoch_copies} epoch(s) gets its own copy of the {self.reconstructed} images it "
                              f"trains on (ragged last batches dropped), aligned and averaged afterwards")

    def _set_up_plain_layout(self) -> None:
        """Real local training in the plain replay: each epoch its own copy of the image set."""
        hp = self.hyperparameters
        if self.mode != "replay" or hp.steps_per_phase is not None or hp.samples is None:
            return
        layout = plan_layout(self.observation.method, hp)
        self.originals, self.reconstructed, self.epoch_copies = layout.slots, layout.reconstructed, layout.epoch_copies

    def reconstructions(self, dummy_images: torch.Tensor) -> torch.Tensor:
        """The rebuilt images from the optimised dummy images: epoch copies combined, free augmented
        copies dropped."""
        slots = self.originals if self.originals is not None else dummy_images.shape[0] - self.free_copies
        return combine_epoch_copies(dummy_images[:slots], self.epoch_copies)

    # -- the dummy's side ---------------------------------------------------------------------
    # Written with torch.func so that the same code serves one target (ordinary autograd on x and y
    # differentiates through torch.func.grad) and a batch of targets (torch.func.vmap over x, y).
    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return soft_cross_entropy(functional_call(self.model, params, (x,)), y)

    def _gradient(self, params: dict[str, torch.Tensor], names: list[str], x: torch.Tensor,
                  y: torch.Tensor) -> dict[str, torch.Tensor]:
        def loss(trained: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._loss({**params, **trained}, x, y)

        return parameter_gradients(loss, {n: params[n] for n in names})

    def dummy(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None = None,
              copies: list | None = None, target: list[torch.Tensor] | None = None,
              private: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The dummy batch's counterpart of every target, differentiable in x, y (and the family
        parameters z of the augmented copies; one target: x (dummy images, C, H, W); under
        ``torch.func.vmap`` one target per batch row). ``copies`` overrides the augmented copies
        (per step; the forward-model check gives the client's true ones). ``target``: this target's
        observed tensors (under vmap, its row; default ``self.target``), which a head-free closed form
        reads its error signal from. ``private``: the fitted private parameters (``fitted_before``; None:
        those z carries, ``split_z``, else the stand-in). After the method's own counterparts come those
        of the closed-form terms (``extra_weights``)."""
        last = self.closed.last_linear
        target = self.target if target is None else target
        if last is not None and last.head_free:
            return self._head_free(x, target)
        z, fitted = self.split_z(z)
        private = fitted if private is None else private
        before_features = self._features_before(x)  # one pass, shared by the replay and the closed form
        if self.mode == "method":
            out = self._method_replay(x, y, z, copies, target, before_features, private)
        elif self.mode == "replay":
            out = self.replay_states(x, y, private)[0]
        else:
            gradients = self._gradient(self.fitted_before(private), self.names, x, y)
            out = [gradients[n] for n in self.names]
        if last is not None:
            out.append(self.dummy_linear_input(x))
        return out + self._feature_means(x, y, target, before_features) + self._row_space_share(x, target, z, copies)

    def _copies(self, x: torch.Tensor, z: torch.Tensor | None) -> list:
        """Each step's augmented copies under the copy model (None for an unaugmented step)."""
        originals = x[:self.originals]
        copies, used = [], 0
        for i, (step, augmented) in enumerate(zip(self.context.steps, self.augmented)):
            members = torch.tensor(step.members, device=x.device)
            if not augmented:
                copies.append(None)
            elif self.copy_model == "oracle":
                copies.append(batch_augmenter(x.shape[-1]).apply(originals[members], self.draws[i]))
            elif self.copy_model == "family":
                copies.append(family_copy(originals[members], z[used:used + len(members)]))
            else:
                copies.append(x[self.originals + used:self.originals + used + len(members)])
            used += 0 if not augmented else len(members)
        return copies

    def _method_replay(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, copies: list | None,
                       target: list[torch.Tensor], features_before: torch.Tensor | None = None,
                       private: torch.Tensor | None = None):
        originals = x[:self.originals]
        probs = one_hot(y, self.observation.num_classes) if y.ndim == 1 else y
        copies = self._copies(x, z) if copies is None else copies
        # this target's upload (before + its observed Δ): the lead's context serves every batched target
        uploaded = {n: self.update.before[n] + target[i] for i, n in enumerate(self.names)}
        context = dataclasses.replace(self.context, uploaded=uploaded, features_before=features_before)
        if private is not None and self.private_names:  # the fitted private part replaces its stand-in
            fitted = self.fitted_before(private)
            context = dataclasses.replace(context, before=fitted,
                                          kept={**context.kept, **{n: fitted[n] for n in self.private_names}})
        simulated = self.observation.method.replay(self.model, context, originals, probs, copies)
        before = self.update.before
        return [simulated[n] - before[n] for n in self.names] + [simulated[n] for n in self.aux_names]

    def _replay(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return self.replay_states(x, y)[0]

    def replay_states(self, x: torch.Tensor, y: torch.Tensor,
                      private: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[dict]]:
        """The plain replay's counterpart of the targets, and the weights each step started from (a
        closed form that holds the images' inputs at their step's weights reads them there); the private
        parameters at ``private`` (``fitted_before``)."""
        hp = self.hyperparameters
        start = self.fitted_before(private)
        trained = list(start)  # plain SGD on every parameter (uploaded or kept private)
        current, states = dict(start), []
        b = x.shape[0]
        bs = max(1, min(hp.batch_size, b))
        for step in range(hp.steps):
            lo = (step * bs) % b
            states.append(current)
            gradients = self._gradient(current, trained, x[lo:lo + bs], y[lo:lo + bs])
            current = {n: current[n] - hp.lr * gradients[n] for n in trained}
        factor = -1.0 / (hp.lr * max(hp.steps, 1))
        return [factor * (current[n] - start[n]) for n in self.names], states

    @functools.cached_property
    def model_key(self) -> tuple:
        """Everything ``shares_model_with`` compares except tensor values, hashable (for bucketing)."""
        hp, obs = self.hyperparameters, self.observation
        method = (None if self.mode != "method" else
                  (obs.method.name, tuple(sorted(obs.method.hyperparameters().items())), tuple(self.context.steps),
                   tuple(self.augmented), tuple(self.aux_names), self.copy_model,
                   # known draws make each target's function its own: never batched with another
                   None if self.draws is None else (obs.round, obs.client_id)))
        last = self.closed.last_linear
        closed = (None if last is None else (last.weight, last.head_free, last.images),
                  tuple(m.source for m in self.closed.feature_means), self.closed.row_space_rank,
                  tuple(self.extra_weights))
        return (self.mode, tuple(self.names), None if hp is None else (hp.lr, hp.steps, hp.batch_size), method, closed,
                self.scale_known, obs.image_shape, obs.num_classes,
                type(self.model).__name__, str(self.model), getattr(self.model, "arch", None))

    def shares_model_with(self, other: "GradientMatcher") -> bool:
        """Whether ``other``'s dummy quantity is the same function of (x, y) as this one's: same
        before-state, buffers, attacked parameters, mode, hyperparameters and architecture (and, in
        the method mode, the same download and kept model). Targets that share a model can be
        attacked in one batched optimisation (``attacks.inversion.batching``)."""
        if self.model_key != other.model_key or type(self.model) is not type(other.model):
            return False
        # buffers too: functional_call takes them (e.g. the normalisation's mean and std) from one model
        buffers, other_buffers = dict(self.model.named_buffers()), dict(other.model.named_buffers())
        if not _same_tensors(buffers, other_buffers) or not _same_tensors(self.update.before, other.update.before):
            return False
        if self.mode == "method":
            return (_same_tensors(self.context.download, other.context.download)
                    and _same_tensors(self.context.kept, other.context.kept))
        return True

    def classifier_weight_target(self) -> torch.Tensor | None:
        """The classifier weight's observed update as a positive multiple of a gradient (−Δ up to a
        positive scale; None if not attacked): what iDLG's sign rule reads."""
        if CLASSIFIER_WEIGHT not in self.names:
            return None
        target = self.target[self.names.index(CLASSIFIER_WEIGHT)]
        return -target if self.mode == "method" else target


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@functools.lru_cache(maxsize=8)
def batch_augmenter(image_size: int):
    """FedeCouple's augmenter for images of this size (imported late: only DA replays need it)."""
    from fedecouple.data.augment import BatchAugmenter

    return BatchAugmenter(image_size)
