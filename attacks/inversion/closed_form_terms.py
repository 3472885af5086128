"""The closed form's side of ``attacks.inversion.forward_model.GradientMatcher``: the exact facts the
closed-form stage (``attacks.inversion.closed_form``) derived become matching terms after the method's
own (the last linear layer's input, class-mean features, the classifier update's row space), a
head-free last linear layer gives the dummy's update from its known error signal, and the layer input it
fixed gives the image of DLG's first start (``closed_form_start``)."""
from __future__ import annotations

import torch
from torch.func import functional_call

from fedecouple.methods.replay import features as replay_features, parameter_gradients

from .layer_inputs import invert_layer_inputs
from .closed_form import ROW_SPACE_WEIGHT, STATISTICS_WEIGHT
from .closed_form import row_space as closed_row_space
from .observation import CLASSIFIER_WEIGHT

# L-BFGS iterations of the image rebuilt from a closed-form layer input (``closed_form_start``), as a
# malicious server's readout takes them (``fedsec attack trap``'s default budget)
START_ITERATIONS = 300


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Probability rows for class ids (written to run under ``torch.func.vmap``)."""
    return (labels.unsqueeze(-1) == torch.arange(num_classes, device=labels.device)).to(torch.float32)


class ClosedFormTerms:
    """``GradientMatcher``'s closed-form terms (a part of it: they read its ``closed``, ``update``,
    ``model``, ``names``, ``target``, ``originals`` and ``observation``)."""

    def _set_up_closed_form(self) -> None:
        """The method's closed-form stage (``attacks.inversion.closed_form``): its exact facts become extra
        matching terms after the targets (``extra_weights``), and with a head-free last linear layer
        the dummy's update is computed with the layer's known error signal instead of a stand-in head."""
        self.notes += self.closed.notes
        self.extra_weights: list[float] = []
        last = self.closed.last_linear
        if last is not None and last.head_free and self.mode == "method" and self.aux_names:
            last.head_free = False  # the statistics need the method's replay
        if last is not None and last.input is not None:
            self.target = list(self.target) + [last.input]
            self.extra_weights.append(last.term_weight)
        for means in self.closed.feature_means:
            self.target = list(self.target) + [means.means]
            self.extra_weights.append(STATISTICS_WEIGHT)
        self.extra_values = len(self.extra_weights)  # the terms from here on are values, not (dummy, target) pairs
        if self.closed.row_space_rank:
            weight = self.target[self.names.index(CLASSIFIER_WEIGHT)]
            self.target = list(self.target) + [closed_row_space(weight, self.closed.row_space_rank)]
            self.extra_weights.append(ROW_SPACE_WEIGHT)

    def _features_before(self, x: torch.Tensor) -> torch.Tensor | None:
        """The dummy originals' features under the extractor before training, where the closed form
        matches them (the method's replay then reuses them); else None."""
        if not any(m.source == "before" for m in self.closed.feature_means):
            return None
        return replay_features(self.model, self.update.before, x[:self.originals] if self.originals is not None else x)

    def _row_space_share(self, x: torch.Tensor, target: list[torch.Tensor], z: torch.Tensor | None = None,
                         copies: list | None = None) -> list[torch.Tensor]:
        """The mean share of the squared feature norms of the dummy images the classifier phase trained on
        (under the client's kept extractor, which that phase ran on) outside the classifier update's row
        space (``target[-1]``)."""
        if not self.closed.row_space_rank:
            return []
        basis = target[-1]
        copies = self._copies(x, z) if copies is None else copies
        trained = [torch.cat([x[:self.originals][list(step.members)]] + ([] if c is None else [c]))
                   for step, c in zip(self.context.steps, copies) if step.phase == "classifier"]
        feats = replay_features(self.model, self.context.kept, torch.cat(trained))
        outside = feats - (feats @ basis) @ basis.T
        return [(outside.pow(2).sum(dim=1) / feats.pow(2).sum(dim=1).clamp_min(1e-12)).mean()]

    def _feature_means(self, x: torch.Tensor, y: torch.Tensor, target: list[torch.Tensor],
                       before_features: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The dummy's class-mean features under the extractors the closed form names (the uploaded one
        is before + Δ, read from ``target``), on the rows of the classes the target holds
        (``before_features``: the originals' features before training, when already computed)."""
        if not self.closed.feature_means:
            return []
        originals = x[:self.originals] if self.originals is not None else x
        probs = one_hot(y, self.observation.num_classes) if y.ndim == 1 else y
        before = self.update.before
        uploaded = {n: before[n] + target[i] for i, n in enumerate(self.names) if n.startswith("extractor.")}
        out, first = [], len(target) - len(self.closed.feature_means)
        for j, means in enumerate(self.closed.feature_means):
            params = {**before, **uploaded} if means.source == "upload" else before
            reuse = means.source == "before" and before_features is not None
            feats = before_features if reuse else replay_features(self.model, params, originals)
            sums, counts = (probs[:len(originals)].transpose(0, 1) @ feats), probs[:len(originals)].sum(dim=0)
            held = (target[first + j].abs().sum(dim=1, keepdim=True) > 0).to(feats.dtype)
            out.append(held * sums / counts.clamp_min(1e-6).unsqueeze(1))
        return out

    def _linear_input(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The input of the extractor's last linear layer for ``x`` under ``params`` (B, in_features)."""
        last = self.closed.last_linear
        below = self.model.extractor[:last.position]
        return functional_call(below, {n[len("extractor."):]: params[n] for n in last.below},
                               (self.model.normalize(x),))

    def _head_free(self, x: torch.Tensor, target: list[torch.Tensor]) -> list[torch.Tensor]:
        """The extractor's update for one image in one step, with the last linear layer's error signal
        read from the observed bias update (any positive multiple of δ: the target's scale): below the
        layer the gradient of ⟨a(x), Wᵀδ⟩, at the layer δ·a(x)ᵀ and δ; then a(x) itself."""
        last, before = self.closed.last_linear, self.update.before
        if last.images > 1:
            return self._head_free_batch(x, target)
        signal = target[self.names.index(last.bias)]
        upstream = signal @ before[last.weight]

        def inner(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return (self._linear_input({**before, **params}, x) * upstream).sum()

        below = parameter_gradients(inner, {n: before[n] for n in last.below})
        a = self._linear_input(before, x)[0]
        update = {**below, last.weight: signal.unsqueeze(1) * a.unsqueeze(0), last.bias: signal}
        return [update[n] for n in self.names] + [a]

    def head_free_signals(self, a: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        """(B, out): each image's error signal δ_i at the last linear layer, the least-squares solution
        of [ΔW Δb] = Σ_i δ_i [a_i 1] for the inputs ``a`` (B, in) (in the target's units; a ridge of
        1e-6 of the Gram matrix's mean diagonal keeps coinciding dummy inputs solvable)."""
        last = self.closed.last_linear
        both = torch.cat([target[self.names.index(last.weight)], target[self.names.index(last.bias)].unsqueeze(1)], 1)
        inputs = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
        gram = inputs @ inputs.T
        ridge = 1e-6 * gram.diagonal().mean() * torch.eye(len(a), dtype=a.dtype, device=a.device)
        return torch.linalg.solve(gram + ridge, inputs @ both.T)

    def _head_free_batch(self, x: torch.Tensor, target: list[torch.Tensor]) -> list[torch.Tensor]:
        """The extractor's update for one step on B images under an unknown head: the signals δ_i solved
        for the dummy's inputs (``head_free_signals``), then below the layer the gradient of
        Σ_i ⟨a_i(x), Wᵀδ_i⟩, at the layer Σ_i δ_i a_i(x)ᵀ and Σ_i δ_i."""
        last, before = self.closed.last_linear, self.update.before
        a = self._linear_input(before, x)
        signals = self.head_free_signals(a, target)
        upstream = signals @ before[last.weight]

        def inner(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return (self._linear_input({**before, **params}, x) * upstream).sum()

        below = parameter_gradients(inner, {n: before[n] for n in last.below})
        update = {**below, last.weight: signals.T @ a, last.bias: signals.sum(0)}
        return [update[n] for n in self.names]

    @property
    def has_closed_form_start(self) -> bool:
        """Whether ``closed_form_start`` rebuilds images: the closed form fixed the last linear layer's input
        of every image the attack rebuilds (one, or each of several: ``LastLinear.images``)."""
        last = self.closed.last_linear
        return last is not None and last.input is not None and (self.originals or 1) == last.images

    def dummy_linear_input(self, x: torch.Tensor) -> torch.Tensor:
        """The dummy's side of the closed form's layer-input term: the first image's input of the extractor's
        last linear layer (in_features,), or with several images (``LastLinear.images``) the originals' (B, in)."""
        images = self.closed.last_linear.images
        a = self._linear_input(self.update.before, x if images == 1 else x[:images])
        return a[0] if images == 1 else a

    @property
    def closed_form_start(self) -> torch.Tensor | None:
        """(B, C, H, W): the images rebuilt from the inputs of the extractor's last linear layer that the
        closed form fixed (one image: its best candidate; several: each image's, in the order of the attack's
        labels; ``attacks.inversion.layer_inputs`` through the layers below it, as the client downloaded them, from
        the grey image), where it fixed every rebuilt image's; else None. DLG's and IG's first start.
        Computed once per observation (``Observation.memo``)."""
        if not self.has_closed_form_start:
            return None
        last = self.closed.last_linear
        key = ("closed-form-start", START_ITERATIONS)
        memo = self.observation.memo
        if key not in memo:
            a = last.input if last.input.dim() == 1 else last.input[0]  # several images: their first order
            grey = torch.full(tuple(self.observation.image_shape), 0.5, device=a.device)
            with torch.enable_grad():
                memo[key] = invert_layer_inputs(lambda x: self._linear_input(self.update.before, x),
                                                a.reshape(-1, a.shape[-1]), grey, START_ITERATIONS)
        return memo[key]

    @property
    def labels_unused(self) -> bool:
        """Whether the dummy's update does not depend on the labels (a head-free closed form)."""
        last = self.closed.last_linear
        return last is not None and last.head_free
