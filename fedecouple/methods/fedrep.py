"""FedRep (Collins et al., ICML 2021): a shared representation, a personal head trained first.

Client i in round t receives the global base θ^t and keeps its own head φ_i. It first trains the
head alone (base frozen) for ``head_epochs`` epochs, then the base alone (the just-trained head
frozen) for ``local_epochs`` epochs, both on cross-entropy. It uploads the base θ_i and its
training-set size n_i, never the head. Server: θ^{t+1} = Σ_i (n_i / Σ_j n_j) θ_i. Personalised model
for evaluation: newest global base + the client's own head (as FedPer).

Epoch split (a choice; the sources differ):
* FedRep's reference code runs ``local_ep`` epochs in all, the first ``local_ep − local_rep_ep``
  on the head and ``local_rep_ep`` (1) on the base (10 epochs → 9 head + 1 base);
* PFLlib runs ``plocal_epochs`` (default 1) head epochs, then ``local_epochs`` base epochs.
We default ``head_epochs`` to ``local_epochs`` (E head epochs then E base epochs), the same split
FedeCouple uses (E_cl = E_fe), so methods compare at equal local work; pass
``head_epochs=9`` with ``local_epochs`` 1 for the reference code's split. No data augmentation.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..channel import Download, Upload
from ..errors import UserError
from .base import ClientContext, State, only_group
from .fedper import FedPer
from .replay import as_probabilities, batch, cross_entropy, features, head, sgd_step
from .training import train_extractor, train_head


@dataclass
class FedRep(FedPer):
    """FedRep: ``head_epochs`` (default: ``local_epochs``) head epochs with the base frozen, then
    ``local_epochs`` base epochs with the head frozen; uploads the base only."""

    head_epochs: int | None = None

    name = "fedrep"
    plain_sgd = False  # two phases, each on one group
    extractor_phases = ("extractor",)
    dp_per_sample = "cross-entropy (head phase, then base phase): per-sample."

    def __post_init__(self) -> None:
        if self.head_epochs is not None and self.head_epochs < 0:
            raise UserError(f"head_epochs must be >= 0, got {self.head_epochs}", fields=("head_epochs",))

    def local_phases(self, epochs: int) -> list[tuple[str, int, bool]]:
        return [("classifier", self.head_epochs if self.head_epochs is not None else epochs, False),
                ("extractor", epochs, False)]

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = self._start(ctx, state, download)
        e_head = self.head_epochs if self.head_epochs is not None else ctx.config.local_epochs
        train_head(ctx, model, e_head, "classifier")
        train_extractor(ctx, model, ctx.config.local_epochs, "extractor")
        return self._finish(ctx, model)

    def replay(self, model, context, images, labels, copies):
        """Head steps on the frozen downloaded base (from the head as the server knows it), then base
        steps with the new head frozen."""
        probs = as_probabilities(labels, context.num_classes)
        base, cls = only_group(context.before, "extractor"), only_group(context.before, "classifier")
        for i, step in context.phase("classifier"):
            xb, yb = batch(images, probs, step, copies[i])
            feats = features(model, base, xb)
            cls = sgd_step(cls, lambda c: cross_entropy(head(model, c, feats), yb), context.lr)
        for i, step in context.phase("extractor"):
            xb, yb = batch(images, probs, step, copies[i])
            base = sgd_step(base, lambda b: cross_entropy(head(model, cls, features(model, b, xb)), yb), context.lr)
        return {**base, **cls}
