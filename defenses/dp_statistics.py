"""A Gaussian mechanism for the whole-data statistics a method reads through
``ClientContext.class_feature_sums`` (FedeCouple's anchors, FedPAC's class means, h, V and
prototypes, FedProto's prototypes and counts), used by ``defenses.dp``'s private context.

One release, for features f_i = features(x_i) of the client's un-augmented training images
(one person = one sample) with labels y_i, clip bound C and noise multiplier σ:

* clip: f̄_i = f_i · min(1, C / ‖f_i‖) (Opacus' rule, ‖f_i‖ + 1e-6 in the denominator);
* sums: S̃_k = Σ_{y_i=k} f̄_i + N(0, σ²C²·I_d) for **every** class k (absent ones too, so which
  rows are noise-only is not revealed); sensitivity of the (C, d) sum matrix: C;
* squared norms (when asked, FedPAC's V): Q̃_k = Σ_{y_i=k} ‖f̄_i‖² + N(0, σ²C⁴); sensitivity C²;
* counts: ñ_k = n_k + N(0, σ²); sensitivity 1. The client's labels do not change between rounds,
  so the noisy counts are released **once** and kept in the client's state (``COUNTS_KEY``, with a
  fingerprint of the data they describe; other data — e.g. a victim batch — gets a fresh release);
  every later use is post-processing and costs nothing.

Guard for noisy counts: a class is *held* when ñ_k ≥ m with m = max(1, 3σ) (an absent class
passes with probability Φ(−3) ≈ 0.13 %; a smaller noisy count could be mostly noise, and dividing a
noisy sum by it would blow the noise up). Held classes get the count round(ñ_k) ≥ 1; the others
count 0 and their sum rows are zeroed. The statistics are then formed from these by the method's
own formulas (mean = S̃_k / n_k, FedPAC's h_k = (n_k/n)·mean_k and V), exactly as without DP.

Accounting (add/remove one sample; the sample count n is public, as for DP-SGD): a sample moves
S by at most C, Q by C² and one count by 1, so each of the three is a Gaussian mechanism with noise
multiplier σ relative to its sensitivity; in RDP, k such releases of the same data compose to
k·α/(2σ²), exactly k steps of (σ, sample rate 1). Each ``release`` therefore adds 1 step (sums)
+ 1 (squared norms, if asked) + 1 (counts, the first time only) at (σ, 1.0) to the client's
accountant history, the same history as its DP-SGD steps. A statistic computed with a model the
client trained under DP-SGD is an adaptively chosen query (the model is post-processing of earlier
noisy releases), so the sensitivity above holds given the model, and RDP composition applies.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch

from fedecouple.channel import Upload
from fedecouple.errors import UserError
from fedecouple.methods.base import ClassFeatureSums, FieldSpec, State

COUNTS_KEY = "dp.noisy_counts"
COUNTS_DATA_KEY = "dp.noisy_counts_data"
RELEASES_KEY = "dp.statistic_releases"
COUNTS_CHOICES = ("noised", "withheld")
HELD_THRESHOLD_SIGMAS = 3.0
PROBE_TOLERANCE = 1e-4


def clip_rows(features: torch.Tensor, bound: float) -> torch.Tensor:
    """Each row scaled to L2 norm ≤ ``bound`` (rows already inside are unchanged up to 1e-6)."""
    factor = (bound / (features.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
    return features * factor


def held_threshold(sigma: float) -> float:
    """m = max(1, 3σ): the smallest noisy count a class is treated as held with."""
    return max(1.0, HELD_THRESHOLD_SIGMAS * sigma)


def guarded_counts(noisy: torch.Tensor, sigma: float) -> torch.Tensor:
    """int64 counts from noisy ones: round(ñ_k) where ñ_k ≥ m (``held_threshold``), else 0."""
    held = noisy >= held_threshold(sigma)
    return torch.where(held, noisy.round(), torch.zeros_like(noisy)).to(torch.int64)


def data_fingerprint(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers naming a client's data (its size and a SHA-256 of images and labels), so
    kept noisy counts are reused only for the data they were released for."""
    digest = hashlib.sha256(images.detach().cpu().contiguous().numpy().tobytes())
    digest.update(labels.detach().cpu().contiguous().numpy().tobytes())
    head = int(np.frombuffer(digest.digest()[:8], dtype=np.int64)[0])
    return torch.tensor([int(labels.shape[0]), head], dtype=torch.int64, device=labels.device)


def _gaussian(like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """Noise shaped like ``like``, on its device, drawn on the CPU's generator: the same noise on every device."""
    if std <= 0:
        return torch.zeros_like(like)
    return torch.normal(0.0, std, tuple(like.shape), generator=generator, dtype=like.dtype).to(like.device)


class StatisticsMechanism:
    """The mechanism of the module docstring for one client update.

    ``state`` is the client's DP state (kept noisy counts, release counter); ``account(steps)``
    adds ``steps`` releases at (σ, 1.0) to the client's accountant; ``refuse(what)`` raises the
    session's refusal. After the update, ``state_entries()`` is what goes back into client state."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, *, sigma: float, clip: float,
                 probe: int, generator: torch.Generator, state: State, account: Callable[[int], None],
                 method: str, declared: str | None):
        self.images, self.labels, self.num_classes = images, labels, num_classes
        self.sigma, self.clip, self.probe = float(sigma), float(clip), int(probe)
        self.generator, self.account, self.method, self.declared = generator, account, method, declared
        self._kept, self._kept_for = state.get(COUNTS_KEY), state.get(COUNTS_DATA_KEY)
        self.noisy_counts: torch.Tensor | None = None
        self.fingerprint: torch.Tensor | None = None
        previous = state.get(RELEASES_KEY)
        self.releases = int(previous) if previous is not None else 0

    def release(self, features: Callable[[torch.Tensor], torch.Tensor], squared_norms: bool) -> ClassFeatureSums:
        """Noisy per-class sums (and squared norms) of ``features`` over the client's data, guarded
        counts; accounted (module docstring)."""
        if self.declared is None:
            raise UserError(f"DP ({self.method}): the method computed a whole-data statistic through "
                            f"ctx.class_feature_sums but declares none (DPCoverage.dp_statistics); declare it so "
                            f"the coverage DP reports stays true")
        feats = features(self.images).detach()
        if feats.ndim != 2 or feats.shape[0] != self.labels.shape[0]:
            raise UserError(f"DP ({self.method}): the features for a statistic must be one row per image, got shape "
                            f"{tuple(feats.shape)} for {int(self.labels.shape[0])} images")
        self._probe(features, feats)
        counts = guarded_counts(self._counts(), self.sigma)
        held = (counts > 0).unsqueeze(1)
        exact = ClassFeatureSums.of(clip_rows(feats, self.clip), self.labels, self.num_classes, squared_norms)
        sums = exact.sums + _gaussian(exact.sums, self.sigma * self.clip, self.generator)
        squares = None
        if squared_norms:
            squares = exact.squared_norms + _gaussian(exact.squared_norms, self.sigma * self.clip ** 2, self.generator)
            squares = squares * held.squeeze(1).to(squares.dtype)
        self.account(1 + int(squared_norms))
        self.releases += 1
        return ClassFeatureSums(sums * held.to(sums.dtype), counts, squares)

    def _counts(self) -> torch.Tensor:
        """The client's noisy class counts: the kept ones, or a fresh (accounted) release."""
        if self.noisy_counts is None:
            self.fingerprint = data_fingerprint(self.images, self.labels)  # hashes the images: once per update
            if (self._kept is not None and self._kept_for is not None
                    and torch.equal(self._kept_for.cpu(), self.fingerprint.cpu())):
                self.noisy_counts = self._kept
        if self.noisy_counts is None:
            exact = torch.bincount(self.labels, minlength=self.num_classes).to(torch.float64)
            self.noisy_counts = exact + _gaussian(exact, self.sigma, self.generator)
            self.account(1)
        return self.noisy_counts

    def _probe(self, features: Callable[[torch.Tensor], torch.Tensor], feats: torch.Tensor) -> None:
        """Features of a few images computed alone must equal their rows in the whole computation:
        otherwise one image's row depends on others and the sensitivity C does not hold."""
        n = int(feats.shape[0])
        for j in range(min(self.probe, n) if n >= 2 else 0):
            alone = features(self.images[j:j + 1]).detach()
            scale = max(float(feats[j].norm()), 1e-12)
            diff = float((alone.reshape(-1) - feats[j]).norm()) / scale
            if diff > PROBE_TOLERANCE:
                raise UserError(f"DP ({self.method}): a statistic's features are not per-sample (an image's features "
                                f"alone differ from its row among all images by {diff:.3g} relative); clipping "
                                f"rows would not bound one sample's influence")

    def state_entries(self) -> State:
        """The client's DP state after this update: the release counter and the noisy counts (the
        ones released now, else the ones it kept)."""
        out: State = {RELEASES_KEY: torch.tensor(self.releases, dtype=torch.int64)}
        if self.noisy_counts is not None:
            out[COUNTS_KEY], out[COUNTS_DATA_KEY] = self.noisy_counts, self.fingerprint
        elif self._kept is not None and self._kept_for is not None:
            out[COUNTS_KEY], out[COUNTS_DATA_KEY] = self._kept, self._kept_for
        return out


# ---------------------------------------------------------------------------------------------
# withheld counts: the client sends none; the server weights every sent prototype equally


def count_specs(manifest: list[FieldSpec]) -> tuple[list[FieldSpec], list[FieldSpec]]:
    """(fields of kind ``class_counts``, fields of kind ``prototype``) of a method's manifest."""
    return ([s for s in manifest if s.kind == "class_counts"], [s for s in manifest if s.kind == "prototype"])


def withhold_counts(upload: Upload, manifest: list[FieldSpec]) -> Upload:
    """The upload without its fields of kind ``class_counts``."""
    counts, _ = count_specs(manifest)
    kept = {k: v for k, v in upload.tensors.items() if not any(s.pattern.match(k) for s in counts)}
    return Upload(upload.round, upload.client_id, kept, dict(upload.meta))


def unit_counts(upload: Upload, manifest: list[FieldSpec]) -> Upload:
    """The server's stand-in for withheld counts: count 1 for every class a prototype was sent for
    (the methods here use class counts on the server only to weight the prototype average, so the
    average becomes unweighted over the clients that sent a class)."""
    counts, protos = count_specs(manifest)
    classes = set()
    for name in upload.tensors:
        for spec in protos:
            match = spec.pattern.match(name) if spec.per_class else None
            if match:
                classes.add(int(match.group(1)))
    tensors = dict(upload.tensors)
    for spec in counts:
        if spec.per_class:
            tensors.update({spec.name.format(k=k): torch.tensor(1, dtype=torch.int64) for k in classes})
        else:
            vector = torch.zeros(spec.shape, dtype=torch.int64)
            vector[[k for k in sorted(classes) if k < spec.shape[0]]] = 1
            tensors[spec.name] = vector
    return Upload(upload.round, upload.client_id, tensors, dict(upload.meta))


__all__ = ["COUNTS_CHOICES", "COUNTS_KEY", "RELEASES_KEY", "StatisticsMechanism", "clip_rows", "guarded_counts",
           "held_threshold", "unit_counts", "withhold_counts"]
