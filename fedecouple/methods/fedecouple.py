"""FedeCouple (Alg. 1 and eqs. 8-16 of the paper), exactly as we read it.

Client i in round t receives ω^t = {θ^t, φ^t} and keeps {θ_i, φ_i} (its last local extractor and
its personal classifier) between rounds.

1. Classifier phase, E_cl epochs (eqs. 12-13). Teacher φ_{g,i} ← φ^t. On every mini-batch the
   features come from the client's *previous local extractor* θ_i (Alg. 1 trains the classifiers
   before the reset θ_i ← θ^t), frozen in this phase. The personal classifier minimises
   CE(g(φ_i; f), y) + λ·KL(p_T ‖ p_S) with p_T = softmax(teacher logits/τ) (no gradient to the
   teacher through this term) and p_S = softmax(personal logits/τ) ("GPC"); the teacher is
   adapted on CE(g(φ_{g,i}; f), y) ("Adapted" teacher; ``teacher="fixed"`` freezes it).
2. Extractor phase. θ_i ← θ^t. Anchors An_k = mean of f(θ^t; x) over the client's training
   samples of class k, computed once with the frozen global extractor, kept on the client
   ("GFA"). One epoch of CE(g(φ^t; f_i(x)), y) + μ·Ω with the frozen *global* classifier φ^t
   ("GLF", eq. 14), then E_fe epochs of CE(g(φ_i^{t+1}; f_i(x)), y) + μ·Ω with the freshly trained
   personal classifier frozen (eq. 15).
3. Upload {θ_i^{t+1}, φ_i^{t+1}} and the client's sample count (needed for α_i in eq. 16). No
   anchors and no per-class counts leave the client.

Server (eq. 16): α_i = n_i/Σn, ω_avg = Σ α_i ω_i, ι_i = cos(ω_i, ω_avg)/Σ_j cos(ω_j, ω_avg),
ω^{t+1} = Σ ι_i ω_i, cosine over the flattened vector of all uploaded parameters (extractor and
classifier together). Negative cosines are clipped to 0; if all are 0 the weights fall back to α.

Under secure aggregation (the server holds only sums) eq. 16 runs exactly, in two passes of the
protocol: the first sums n_i·ω_i and n_i (as FedAvg), whose quotient ω_avg the server sends back to
that pass's survivors; each computes c_i = max(0, cos(ω_i, ω_avg)) on its own upload, and the second
sums c_i·ω_i and c_i; ω^{t+1} = Σ c_i ω_i / Σ c_i (ω_avg if Σ c_i = 0). A client that drops out
between the passes is in ω_avg but not in the second sums: ω^{t+1} is eq. 16 over the second pass's
survivors, with their cosines to the first pass's average. With fewer than three of them the second
pass does not run and the round keeps ω_avg: from two clients' sums of both passes (and their sample
counts) the server could solve for both models.

Decisions where the paper is silent (also in docs/methods.md, "FedeCouple, and the ambiguities we decided"):
* the centre loss Ω is the mean squared error over batch and feature elements
  (``center_reduction="mean"``, as torch's ``MSELoss``); the literal per-sample sum over the 128
  feature dimensions (``"sum"``, averaged over the batch like CE) collapses features at μ = 2 on
  our data (mnist5k, 3 classes per client: accuracy at chance);
* KL is ``batchmean`` without the τ² factor of Hinton-style distillation (the paper shows none);
* data augmentation ("DA") applies in both phases: each batch is the originals plus one augmented
  copy of each; anchors use the un-augmented training images;
* E_cl = E_fe = ``local_epochs`` unless ``classifier_epochs`` is set; the GLF epoch comes on top;
* personalised model for evaluation = the client's {θ_i, φ_i} after its last local update;
* ablations: ``glf=False`` skips the frozen-global-classifier epoch, ``gfa=False`` drops Ω,
  ``gpc=False`` trains the personal classifier with CE only (no teacher), ``da=False`` no DA.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from ..errors import UserError
from ..secure_aggregation import WEIGHT
from .averaging import weighted_mean, weighted_summands
from .base import (SAMPLE_COUNT, ClientContext, Method, State, add_prefix, make_upload, model_fields, only_group,
                   strip_prefix)
from .facets import ClassifierStep, DPCoverage, DownloadReach, PaperPreset, SecureTwoPass
from .replay import as_probabilities, batch, cross_entropy, features, head, sgd_step
from .replay import class_means as replay_class_means
from .training import sgd


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(p_T ‖ p_S) with p = softmax(logits/τ), averaged over the batch; the teacher is detached."""
    p_teacher = F.softmax(teacher_logits.detach() / tau, dim=1)
    return F.kl_div(F.log_softmax(student_logits / tau, dim=1), p_teacher, reduction="batchmean")


def center_loss(features: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Ω (eq. 8): squared L2 distance of each feature to its class anchor."""
    diff = features - anchors[labels]
    if reduction == "mean":
        return diff.pow(2).mean()
    if reduction == "sum":
        return diff.pow(2).sum(dim=1).mean()
    raise ValueError(f"unknown centre-loss reduction {reduction!r}")


def soft_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``distillation_loss`` without cutting the teacher's logits from the graph: the replay holds the
    teacher's parameters fixed in the student's step, but the value stays a function of the data."""
    p_teacher = F.softmax(teacher_logits / tau, dim=1)
    return F.kl_div(F.log_softmax(student_logits / tau, dim=1), p_teacher, reduction="batchmean")


def soft_center_loss(features: torch.Tensor, anchors: torch.Tensor, probs: torch.Tensor,
                     reduction: str = "mean") -> torch.Tensor:
    """``center_loss`` with soft class membership (probability rows; one-hot gives the same)."""
    distances = ((features.unsqueeze(1) - anchors.unsqueeze(0)) ** 2).sum(dim=2)  # (B, C)
    per_sample = (probs * distances).sum(dim=1)
    if reduction == "mean":
        return per_sample.sum() / features.numel()
    if reduction == "sum":
        return per_sample.mean()
    raise ValueError(f"unknown centre-loss reduction {reduction!r}")


def cosine_aggregation_weights(vectors: torch.Tensor, sample_counts: torch.Tensor) -> torch.Tensor:
    """ι of eq. 16 for row vectors ω_i and their sample counts n_i."""
    alpha = sample_counts.to(vectors.dtype) / sample_counts.sum()
    average = (alpha.unsqueeze(1) * vectors).sum(dim=0)
    cos = F.cosine_similarity(vectors, average.unsqueeze(0), dim=1).clamp_min(0.0)
    if float(cos.sum()) <= 0.0:
        return alpha
    return cos / cos.sum()


@dataclass
class FedeCouple(Method, ClassifierStep, DownloadReach, SecureTwoPass, DPCoverage, PaperPreset):
    lam: float = 0.8
    mu: float = 2.0
    tau: float = 2.0
    glf: bool = True
    gfa: bool = True
    gpc: bool = True
    da: bool = True
    teacher: str = "adapted"
    center_reduction: str = "mean"
    classifier_epochs: int | None = None

    name = "fedecouple"
    persistent_groups = ("classifier",)
    download_reaches = ("extractor", "classifier")  # θ_i ← θ^t; the GLF step trains against φ^t
    extractor_phases = ("extractor-glf", "extractor")
    closed_form = ("labels", "classifier-features", "classifier-row-space", "extractor-linear-input")
    paper_preset = {"lam": 0.8, "mu": 2.0, "tau": 2.0}  # Section V (equal to the defaults)
    dp_per_sample = ("CE and λ·KL(teacher ‖ student) (the teacher's logits of the same sample, detached) are "
                     "per-sample; the adapted teacher's CE is per-sample and is trained under DP-SGD on the same batch "
                     "(accounted as one mechanism, σ/√2); the centre loss is per-sample given the anchors, which are a "
                     "statistic released before the extractor phase; DA: original + augmented copy clipped together.")
    # secure aggregation: eq. 16 in two passes of the protocol (module docstring; ``Federation._second_pass``)
    secure_second_pass_minimum = 3  # from two clients' sums of both passes the server could solve both models
    secure_variant_note = ("two passes: the first sums n_i·ω_i and n_i, whose quotient ω_avg (what FedAvg's sum "
                           "reveals) the server sends back to that pass's survivors; each computes "
                           "c_i = max(0, cos(ω_i, ω_avg)) itself and the second sums c_i·ω_i and c_i, so the server "
                           "also learns Σ c_i·ω_i and Σ c_i; ω^{t+1} = Σ c_i·ω_i / Σ c_i is the paper's eq. 16 up to "
                           "quantisation (fewer than 3 clients left for the second pass: the round keeps ω_avg)")
    dp_statistics = ("GFA anchors, once per round: class means of the frozen global extractor's features over the "
                     "client's un-augmented training images (kept on the client, never uploaded).")

    def manifest(self, model: SplitModel):
        return model_fields(model, "extractor") + model_fields(model, "classifier") + [SAMPLE_COUNT]

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return get_params(model)  # {θ_i, φ_i} start at ω^0

    def local_phases(self, epochs: int) -> list[tuple[str, int, bool]]:
        e_cl = self.classifier_epochs if self.classifier_epochs is not None else epochs
        return ([("classifier", e_cl, self.da)] + ([("extractor-glf", 1, self.da)] if self.glf else [])
                + [("extractor", epochs, self.da)])

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = ctx.model
        glob = dict(download.tensors)
        global_classifier = strip_prefix(glob, "classifier.")
        set_params(model, state)
        e_cl = self.classifier_epochs if self.classifier_epochs is not None else ctx.config.local_epochs
        self._classifier_phase(ctx, model, global_classifier, e_cl)

        set_params(model, {k: v for k, v in glob.items() if k.startswith("extractor.")})  # θ_i ← θ^t
        anchors = None
        if self.gfa:
            anchors, counts = ctx.class_means(model)
            ctx.private["anchors"] = anchors[counts > 0].clone()
        frozen_global = copy.deepcopy(model.classifier)
        frozen_global.load_state_dict(global_classifier)
        if self.glf:
            self._extractor_epochs(ctx, model, frozen_global, anchors, 1, "extractor-glf")
        self._extractor_epochs(ctx, model, model.classifier, anchors, ctx.config.local_epochs, "extractor")

        new_state = get_params(model)
        return new_state, make_upload(ctx, new_state)

    def _classifier_phase(self, ctx: ClientContext, model: SplitModel, global_classifier, epochs: int) -> None:
        student = model.classifier
        teacher = copy.deepcopy(student)
        teacher.load_state_dict(global_classifier)
        adapt_teacher = self.gpc and self.teacher == "adapted"
        opt_s = sgd(student.parameters(), ctx.config)
        opt_t = sgd(teacher.parameters(), ctx.config) if adapt_teacher else None
        for x, y in ctx.batches(epochs, "classifier", augment=self.da):
            with torch.no_grad():
                feats = model.features(x)  # the extractor is not trained in this phase
            student_logits = student(feats)
            loss = F.cross_entropy(student_logits, y)
            if self.gpc:
                teacher_logits = teacher(feats)
                loss = loss + self.lam * distillation_loss(student_logits, teacher_logits, self.tau)
            ctx.check_finite(loss)
            opt_s.zero_grad(set_to_none=True)
            loss.backward()
            opt_s.step()
            if adapt_teacher:
                teacher_loss = F.cross_entropy(teacher(feats), y)
                opt_t.zero_grad(set_to_none=True)
                teacher_loss.backward()
                opt_t.step()

    def _extractor_epochs(self, ctx, model, classifier, anchors, epochs: int, phase: str) -> None:
        for p in classifier.parameters():
            p.requires_grad_(False)
        opt = sgd(model.extractor.parameters(), ctx.config)
        try:
            for x, y in ctx.batches(epochs, phase, augment=self.da):
                feats = model.features(x)
                loss = F.cross_entropy(classifier(feats), y)
                if anchors is not None:
                    loss = loss + self.mu * center_loss(feats, anchors, y, self.center_reduction)
                ctx.check_finite(loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        finally:
            for p in classifier.parameters():
                p.requires_grad_(True)

    def replay(self, model, context, images, labels, copies):
        """Both phases as the client runs them (module docstring), from the server's view: the
        personal classifier from its previous upload (``context.before``), the classifier phase on
        the client's previous local extractor (``context.kept``), teacher, GLF classifier and the
        extractor's start from the download."""
        probs = as_probabilities(labels, context.num_classes)
        glob = context.download
        student = self._replayed_classifier_phase(model, context, images, probs, copies)
        extractor = only_group(glob, "extractor")  # θ_i ← θ^t
        anchors = replay_class_means(features(model, extractor, images), probs)[0] if self.gfa else None
        phases = ([("extractor-glf", only_group(glob, "classifier"))] if self.glf else []) + [("extractor", student)]
        for phase, classifier in phases:
            for i, step in context.phase(phase):
                xb, yb = batch(images, probs, step, copies[i])

                def loss(e, classifier=classifier):
                    feats = features(model, e, xb)
                    value = cross_entropy(head(model, classifier, feats), yb)
                    if anchors is not None:
                        value = value + self.mu * soft_center_loss(feats, anchors, yb, self.center_reduction)
                    return value

                extractor = sgd_step(extractor, loss, context.lr)
        return {**extractor, **student}

    def _replayed_classifier_phase(self, model, context, images, probs, copies):
        previous_extractor = only_group(context.kept, "extractor")
        student, teacher = only_group(context.before, "classifier"), only_group(context.download, "classifier")
        for i, step in context.phase("classifier"):
            xb, yb = batch(images, probs, step, copies[i])
            feats = features(model, previous_extractor, xb)
            student, teacher = self.classifier_step(model, student, teacher, feats, yb, context.lr)
        return student

    def classifier_step(self, model, student, teacher, feats, probs, lr):
        """One step of the classifier phase on a batch's features (under the kept extractor): the
        personal classifier and the teacher after it. The replay's, and what the attacks' closed form
        solves for the features (``attacks.inversion.closed_form``)."""
        teacher_logits = head(model, teacher, feats)  # fixed inside the student's step, not cut from x

        def student_loss(c):
            logits = head(model, c, feats)
            value = cross_entropy(logits, probs)
            if self.gpc:
                value = value + self.lam * soft_distillation_loss(logits, teacher_logits, self.tau)
            return value

        new_student = sgd_step(student, student_loss, lr)
        if self.gpc and self.teacher == "adapted":
            teacher = sgd_step(teacher, lambda t: cross_entropy(head(model, t, feats), probs), lr)
        return new_student, teacher

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        names = [k for k in uploads[0].tensors if k != "sample_count"]
        vectors = torch.stack([torch.cat([u.tensors[n].flatten() for n in names]) for u in uploads])
        counts = torch.stack([u.tensors["sample_count"] for u in uploads])
        iota = cosine_aggregation_weights(vectors, counts)
        new = {n: sum(w * u.tensors[n] for w, u in zip(iota, uploads)) for n in names}
        return add_prefix(new, "global.")

    @staticmethod
    def _aggregated_names(upload: Upload) -> list[str]:
        return [k for k in upload.tensors if k != "sample_count"]

    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int):
        """The first pass: n_i·ω_i and n_i, scaled by 1/max_weight (FedAvg's summands)."""
        return weighted_summands(upload, self._aggregated_names(upload), max_weight)

    def secure_aggregate(self, server: State, total, round: int, max_weight: float) -> State:
        """ω_avg from the first pass's sum: the round's model when the second pass cannot run (and eq. 16's
        own fallback when no cosine is positive)."""
        return {**server, **weighted_mean(total, server)}

    def secure_broadcast(self, total, max_weight: float) -> dict[str, torch.Tensor]:
        """ω_avg (float64) from the first pass's sum, which the server sends back to that pass's survivors."""
        weight = total[WEIGHT]
        if not float(weight) > 0:
            raise UserError("the secure sum's total weight is not positive: every survivor reported 0 samples")
        return {name: value / weight for name, value in total.items() if name != WEIGHT}

    def secure_second_summands(self, upload: Upload, broadcast, max_weight: float, num_classes: int):
        """The second pass, on the client: c_i = max(0, cos(ω_i, ω_avg)) over every uploaded parameter, then
        c_i·ω_i and c_i (in the protocol's weight slot, so Σ c_i is summed exactly as Flower sums weights)."""
        names = self._aggregated_names(upload)
        own = torch.cat([upload.tensors[n].detach().to(torch.float64).flatten() for n in names])
        average = torch.cat([broadcast[n].to(torch.float64).flatten() for n in names])
        c = float(F.cosine_similarity(own, average, dim=0).clamp_min(0.0))
        return {WEIGHT: torch.tensor(c, dtype=torch.float64),
                **{n: c * upload.tensors[n].detach().to(torch.float64) for n in names}}

    def secure_second_aggregate(self, server: State, first, second, round: int, max_weight: float) -> State:
        """ω^{t+1} = Σ c_i·ω_i / Σ c_i from the second pass's sum; ω_avg when Σ c_i = 0 (as ``aggregate``)."""
        if not float(second[WEIGHT]) > 0:
            return self.secure_aggregate(server, first, round, max_weight)
        return {**server, **weighted_mean(second, server)}

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return state
