"""FedPAC (Xu, Tong & Huang, ICLR 2023): feature alignment to global prototypes and classifier
collaboration by a per-client quadratic programme.

Client i in round t receives the global base θ^t, the global prototypes c̄_k and, from round 1 on,
its personalised head φ̂_i (the server's combination of the heads of round t−1); before that it
uses its own head (the common initial one). Then, as in the authors' reference code:

1. Statistics, with the received base and head and before any training, on the un-augmented
   training set: n_i, class counts n_ik, p_ik = n_ik/n_i, class means μ_ik,
   h_ik = p_ik·μ_ik (a C×d matrix, zero rows for absent classes) and the variance term
   V_i = Σ_k [p_ik · mean_{x∈k} ‖f(x)‖² − p_ik² · ‖μ_ik‖²]  (the reference code's formula).
   The class means double as local prototypes for classes without a global prototype.
2. ``head_epochs`` (paper code: 1) epochs of CE on the head with the base frozen, SGD at
   ``head_lr`` with ``momentum`` and ``weight_decay``.
3. ``local_epochs`` epochs on the base with the head frozen: CE + λ·MSE(f(x), c̄_y) (mean over batch
   and feature elements, torch ``MSELoss``); classes without a global prototype use the local one
   of step 1; in round 0 (no global prototypes at all) CE alone. SGD at the shared ``lr`` with
   ``momentum`` and ``weight_decay``; each phase builds a fresh optimiser (its momentum starts empty).
4. Upload: base θ_i, head φ_i, per-class prototypes c_ik (mean feature of the trained base) of the
   classes it holds, ``class_counts`` (the C-vector n_ik, kind ``class_counts``: it gives p_ik =
   n_ik/n_i and weights the prototype average, as the reference code's ``sizes_label``), ``h``
   (kind ``statistic``), ``V`` (kind ``statistic``, *not* yet divided by n_i) and ``sample_count``.

Server, from this round's uploads only, processed in client-id order:
* θ^{t+1} = Σ_i (n_i/Σ n) θ_i;  c̄_k = Σ_i n_ik c_ik / Σ_i n_ik (this round's set replaces the last);
* for each uploading client i: α_i = argmin_{α ∈ simplex} αᵀ P_i α with
  P_i = diag(V_j / n_j) + D_i,  (D_i)_{jl} = Σ_k (h_ik − h_jk)·(h_ik − h_lk),
  i.e. Σ_j α_j² V_j/n_j + Σ_k ‖h_ik − Σ_j α_j h_jk‖² (estimated variance + bias of combining heads);
  P_i is symmetrised and, if it has negative eigenvalues, rebuilt from its clipped (≥ 0)
  eigen-decomposition; solved with SLSQP; weights below ``min_weight`` (reference code: 1e-3) are
  zeroed and the rest renormalised; on any failure α_i = e_i (the client's own head).
  φ̂_i = Σ_j α_ij φ_j over the heads *as uploaded this round*; stored as ``head.{i}.classifier.*``
  and sent to client i in its next download.

Under secure aggregation (the server holds only sums) the per-client QP has nothing to read, so a
partial variant runs, an approximation of FedPAC: the base is the sample-weighted average from the sum
of n_i·θ_i and n_i; the global prototypes c̄_k = Σ n_ik c_ik / Σ n_ik from the sums of n_ik·c_ik and
n_ik, which every client sends for every class (zeros for the classes it lacks); heads stay local
(no combination: each client keeps the head it trained, as in round 0), and h, V and the head never
leave the client.

Personalised model for evaluation: newest global base + φ̂_i if the server has one for the client
(the reference code installs it at the end of the round), else the client's own head.

Defaults: λ = 1.0 (paper); from the reference code ``head_epochs`` = 1, ``head_lr`` = 0.1,
``momentum`` = 0.5 and ``weight_decay`` = 5e-4 (hyperparameters: ``make_method("fedpac", head_lr=...)``).
The reference trains the base at its learning rate (default 0.01) with batches of 50; ours trains it at
the shared ``TrainConfig`` ``lr`` and ``batch_size`` (0.05 and 10 by default). With the shared plain SGD
on both phases instead (head at ``lr``, no momentum, no weight decay), clients of 4 or 10 images (one
SGD step per phase) saw their uploaded prototypes grow round by round until the base step overflowed
(round 16 and 19 of 20 on the audit preset's federations); with the reference's settings both finish.
No data augmentation.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch
from scipy.optimize import minimize

from ..channel import Download, Upload
from ..errors import UserError
from ..models import SplitModel, get_params, set_params
from .averaging import by_client, sample_weighted_average, weighted_mean, weighted_summands
from .base import (SAMPLE_COUNT, ClassFeatureSums, ClientContext, FieldSpec, Method, State, add_prefix,
                   extract_features, make_upload, model_fields, only_group, strip_prefix)
from .facets import DPCoverage, DownloadReach, Replay, SecureSummation
from .replay import as_probabilities, batch, cross_entropy, features, head, momentum_step
from .replay import class_means as replay_class_means
from .prototypes import (CLASS_COUNT, PROTOTYPE, local_prototypes, prototype_field, prototype_loss, prototype_table,
                         prototypes_in, weighted_prototypes)
from .training import train_extractor, train_head

HEAD = "head.{cid}."


def statistics_from_sums(sums: ClassFeatureSums, num_samples: int):
    """(class counts, class means, h = p_k·μ_k, V) from per-class feature sums, counts and sums of
    squared norms (``ClientContext.class_feature_sums``), p_k = n_k/n with n the sample count."""
    means, counts = sums.means(), sums.counts
    dtype = sums.sums.dtype
    n = max(num_samples, 1)
    p = counts.to(dtype) / n
    h = p.unsqueeze(1) * means
    mean_sq = sums.squared_norms / sums.denominators()
    v = (p * mean_sq - p.pow(2) * means.pow(2).sum(dim=1)).sum()
    return counts, means, h, v


def soft_client_statistics(features: torch.Tensor, probs: torch.Tensor):
    """``statistics_from_sums`` of ``features`` with soft class membership (probability rows; one-hot
    rows give the exact statistics), written on the tensors so the replay can differentiate it."""
    means, counts = replay_class_means(features, probs)
    p = counts / max(int(probs.shape[0]), 1)
    h = p.unsqueeze(1) * means
    mean_sq = (probs.transpose(0, 1) @ features.pow(2).sum(dim=1)) / counts.clamp_min(1)
    v = (p * mean_sq - p.pow(2) * means.pow(2).sum(dim=1)).sum()
    return counts, means, h, v


def head_weight_matrix(i: int, h: torch.Tensor, v_over_n: torch.Tensor) -> np.ndarray:
    """P_i = diag(V_j/n_j) + D_i for client position i, h of shape (m, C, d), v_over_n of shape (m,)."""
    diff = (h[i].unsqueeze(0) - h).reshape(h.shape[0], -1).to(torch.float64)  # (m, C·d): h_i − h_j
    return (torch.diag(v_over_n.to(torch.float64)) + diff @ diff.T).numpy()


def solve_simplex_qp(p_matrix: np.ndarray, own: int, min_weight: float = 1e-3) -> tuple[np.ndarray, bool]:
    """argmin_{α ≥ 0, Σα = 1} αᵀPα. Returns (α, solved); α = e_own whenever it cannot be solved."""
    m = p_matrix.shape[0]
    fallback = np.zeros(m)
    fallback[own] = 1.0
    if m == 1:
        return fallback, True
    try:
        p = np.asarray(p_matrix, dtype=np.float64)
        if not np.all(np.isfinite(p)):
            return fallback, False
        p = 0.5 * (p + p.T)
        scale = float(np.abs(p).max())
        if not scale > 0:
            return fallback, False  # P = 0: every α is optimal; keep the client's own head
        p = p / scale  # same minimiser, better conditioned
        evals, evecs = np.linalg.eigh(p)
        if evals.min() < 0:
            p = (evecs * np.clip(evals, 0.0, None)) @ evecs.T
            p = 0.5 * (p + p.T)
        x0 = np.full(m, 1.0 / m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = minimize(lambda a: float(a @ p @ a), x0, jac=lambda a: 2.0 * (p @ a), method="SLSQP",
                           bounds=[(0.0, 1.0)] * m,
                           constraints=[{"type": "eq", "fun": lambda a: np.sum(a) - 1.0, "jac": lambda a: np.ones(m)}],
                           options={"maxiter": 500, "ftol": 1e-12})
        alpha = np.asarray(res.x, dtype=np.float64)
        if not res.success or not np.all(np.isfinite(alpha)):
            return fallback, False
        alpha = np.clip(alpha, 0.0, None)
        alpha[alpha < min_weight] = 0.0
        total = alpha.sum()
        if not total > 0:
            return fallback, False
        return alpha / total, True
    except (ValueError, ArithmeticError, np.linalg.LinAlgError):
        return fallback, False


@dataclass
class FedPAC(Method, Replay, DownloadReach, SecureSummation, DPCoverage):
    """FedPAC: λ = 1.0 (paper) weights the feature-alignment term; ``head_epochs`` = 1 (reference
    code); ``min_weight`` = 1e-3 (reference code) zeroes tiny combination weights; both phases use
    SGD with ``momentum`` 0.5 and ``weight_decay`` 5e-4, a fresh optimiser per phase, the head at
    ``head_lr`` 0.1 and the base at the shared ``lr`` (reference code)."""

    lam: float = 1.0
    head_epochs: int = 1
    min_weight: float = 1e-3
    head_lr: float = 0.1
    momentum: float = 0.5
    weight_decay: float = 5e-4

    name = "fedpac"
    # secure aggregation: the partial variant (module docstring)
    secure_variant_note = ("partial (heads local, no head combination): the base is the sample-weighted average of "
                           "the sums of n_i·θ_i and n_i, the global prototypes the count-weighted average of the sums "
                           "of n_ik·c_ik and n_ik (every class, zeros for classes a client lacks); h, V and the head "
                           "never leave the client, which keeps the head it trained: an approximation of FedPAC")
    # the downloaded base, and the server's combined head where one is sent (it replaces the client's)
    download_reaches = ("extractor", "classifier")
    # under secure aggregation (the partial variant) the download is the base and the global prototypes:
    # every client trains its own head, whatever a server sends
    secure_download_reaches = ("extractor",)
    extractor_phases = ("extractor",)
    # no "last-linear": the head is known and the replay exact, and matching that layer's input as well
    # trapped 3 of 8 tuning targets in local minima (36.3 dB against 45.1 dB without it)
    closed_form = ("labels", "statistics")
    dp_per_sample = ("CE on the head, then CE + λ·prototype alignment on the base: per-sample (the targets are the "
                     "global prototypes and the client's own released class means).")
    dp_statistics = ("two per round: before training, class counts, class means, h and V of the received base's "
                     "features (sums, counts, squared norms); after training, the uploaded prototypes (class means "
                     "of the trained base).")

    def __post_init__(self) -> None:
        if self.head_epochs < 0:
            raise UserError(f"head_epochs must be >= 0, got {self.head_epochs}", fields=("head_epochs",))
        if not self.head_lr > 0:
            raise UserError(f"head_lr must be > 0, got {self.head_lr}; pass e.g. head_lr=0.1", fields=("head_lr",))
        if not 0 <= self.momentum < 1:
            raise UserError(f"momentum must be in [0, 1), got {self.momentum}; pass e.g. momentum=0.5",
                            fields=("momentum",))
        if not self.weight_decay >= 0:
            raise UserError(f"weight_decay must be >= 0, got {self.weight_decay}; pass e.g. weight_decay=5e-4",
                            fields=("weight_decay",))

    def manifest(self, model: SplitModel):
        c, d = model.num_classes, model.feature_dim
        return (model_fields(model, "extractor") + model_fields(model, "classifier") + [
            prototype_field(model),
            FieldSpec("class_counts", "class_counts", (c,)),
            FieldSpec("h", "statistic", (c, d)),
            FieldSpec("V", "statistic", ()),
            SAMPLE_COUNT,
        ])

    def init_server(self, model: SplitModel) -> State:
        return add_prefix(get_params(model, "extractor"), "global.")

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return get_params(model, "classifier")

    def download(self, server: State, client_id: int, round: int):
        out = strip_prefix(server, "global.")  # base and global prototypes
        out.update(strip_prefix(server, HEAD.format(cid=client_id)))  # this client's combined head, if any
        return out

    def local_phases(self, epochs: int) -> list[tuple[str, int, bool]]:
        return [("classifier", self.head_epochs, False), ("extractor", epochs, False)]

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = ctx.model
        received = dict(download.tensors)
        set_params(model, only_group(state, "classifier"))
        set_params(model, only_group(received, "classifier"))  # the server's combination replaces it
        set_params(model, only_group(received, "extractor"))

        counts, local_means, h, v = statistics_from_sums(
            ctx.class_feature_sums(lambda images: extract_features(model, images), squared_norms=True),
            ctx.num_samples)
        settings = replace(ctx.config, momentum=self.momentum, weight_decay=self.weight_decay)
        train_head(ctx, model, self.head_epochs, "classifier", optimiser=replace(settings, lr=self.head_lr))

        global_protos = prototypes_in(received)
        extra = None
        if global_protos and self.lam != 0:
            table, has = prototype_table(global_protos, ctx.num_classes, model.feature_dim)
            held = counts > 0
            fill = held & ~has  # classes the client holds but nobody reported: its own prototypes
            table[fill] = local_means[fill]
            has = has | fill
            extra = lambda feats, y: self.lam * prototype_loss(feats, y, table, has)  # noqa: E731
        train_extractor(ctx, model, ctx.config.local_epochs, "extractor", extra, optimiser=settings)

        protos, counts_after = local_prototypes(ctx, model)
        tensors = {**get_params(model, "extractor"), **get_params(model, "classifier")}
        for k in torch.nonzero(counts_after).flatten().tolist():
            tensors[PROTOTYPE.format(k=k)] = protos[k].clone()
        tensors.update({"class_counts": counts.clone(), "h": h, "V": v})
        return get_params(model, "classifier"), make_upload(ctx, tensors)

    def replay(self, model, context, images, labels, copies):
        """Statistics on the received base, head steps (base frozen, at ``head_lr``), base steps (at
        ``context.lr``) with the new head frozen and the prototype term, each phase SGD with momentum and
        weight decay from an empty buffer, then the prototypes of the trained base: the whole upload but
        the sample count. The statistics and the prototypes (each a pass of the extractor) only where
        ``context`` asks for them or, for the statistics, the prototype term needs the client's class means."""
        probs = as_probabilities(labels, context.num_classes)
        base, cls = only_group(context.before, "extractor"), only_group(context.before, "classifier")
        statistics, extra = {}, None
        aligned = bool(prototypes_in(context.download)) and self.lam != 0
        before = context.features_before
        if before is None and (aligned or any(context.wants(n) for n in ("class_counts", "h", "V"))):
            before = features(model, base, images)
        if aligned or any(context.wants(n) for n in ("class_counts", "h", "V")):
            counts, local_means, h, v = soft_client_statistics(before, probs)
            counts = counts / context.copies  # the client counts its images once (means, h and V are ratios)
            statistics = {"class_counts": counts, "h": h, "V": v}
            extra = self._replayed_alignment(context, counts, local_means)
        buffer = None  # each phase builds a fresh optimiser: its momentum starts empty
        for i, step in context.phase("classifier"):
            xb, yb = batch(images, probs, step, copies[i])
            whole = before is not None and copies[i] is None and step.members == tuple(range(len(images)))
            feats = before if whole else features(model, base, xb)  # every image, in order: the same pass
            cls, buffer = momentum_step(cls, lambda c: cross_entropy(head(model, c, feats), yb), self.head_lr,
                                        self.momentum, self.weight_decay, buffer)
        # the base steps run on the head the client uploaded (trained before them, never changed after):
        # the same as the replayed head on the true data, and not a function of the dummy's head steps
        head_params = {**cls, **only_group(context.uploaded, "classifier")}
        buffer = None
        for i, step in context.phase("extractor"):
            xb, yb = batch(images, probs, step, copies[i])

            def loss(b):
                feats = features(model, b, xb)
                ce = cross_entropy(head(model, head_params, feats), yb)
                return ce if extra is None else ce + extra(feats, yb)

            base, buffer = momentum_step(base, loss, context.lr, self.momentum, self.weight_decay, buffer)
        names = [PROTOTYPE.format(k=k) for k in range(context.num_classes)]
        prototypes = {}
        if any(context.wants(n) for n in names):
            protos, _ = replay_class_means(features(model, base, images), probs)
            prototypes = {n: protos[k] for k, n in enumerate(names)}
        return {**base, **cls, **prototypes, **statistics}

    def _replayed_alignment(self, context, counts: torch.Tensor, local_means: torch.Tensor):
        """λ·MSE to the downloaded global prototypes (own class means where none was sent), soft labels."""
        global_protos = prototypes_in(context.download)
        if not global_protos or self.lam == 0:
            return None
        table, has = prototype_table(global_protos, context.num_classes, local_means.shape[1])
        fill = (counts > 0.5) & ~has
        table = torch.where(fill.unsqueeze(1), local_means, table)
        mask = (has | fill).to(local_means.dtype)

        def alignment(feats: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
            distances = ((feats.unsqueeze(1) - table.unsqueeze(0)) ** 2).sum(dim=2)  # (B, C)
            return self.lam * (probs * mask * distances).sum() / feats.numel()

        return alignment

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        uploads = by_client(uploads)
        first = uploads[0].tensors
        base_names = [k for k in first if k.startswith("extractor.")]
        head_names = [k for k in first if k.startswith("classifier.")]
        new = {k: v for k, v in server.items() if k.startswith("head.")}  # absent clients keep theirs
        new.update(add_prefix(sample_weighted_average(uploads, base_names), "global."))

        per_client = []
        for u in uploads:
            cc = u.tensors["class_counts"]
            per_client.append((prototypes_in(u.tensors), {k: float(cc[k]) for k in range(cc.shape[0])}))
        for k, proto in weighted_prototypes(per_client).items():
            new["global." + PROTOTYPE.format(k=k)] = proto

        h = torch.stack([u.tensors["h"].to(torch.float64) for u in uploads])
        n = torch.stack([u.tensors["sample_count"].to(torch.float64) for u in uploads]).clamp_min(1.0)
        v_over_n = torch.stack([u.tensors["V"].to(torch.float64) for u in uploads]) / n
        heads = {name: torch.stack([u.tensors[name] for u in uploads]) for name in head_names}
        for i, u in enumerate(uploads):
            alpha, _ = solve_simplex_qp(head_weight_matrix(i, h, v_over_n), i, self.min_weight)
            weights = torch.from_numpy(alpha)
            for name, stacked in heads.items():
                combined = torch.tensordot(weights.to(stacked.dtype), stacked, dims=1)
                new[HEAD.format(cid=u.client_id) + name] = combined
        return new

    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int):
        """n_i·θ_i and n_i, and for every class n_ik·c_ik and n_ik, all scaled by 1/max_weight."""
        out = weighted_summands(upload, [k for k in upload.tensors if k.startswith("extractor.")], max_weight)
        protos, counts = prototypes_in(upload.tensors), upload.tensors["class_counts"]
        dim = next(iter(protos.values())).shape if protos else None
        if dim is None:
            raise UserError(f"client {upload.client_id} sent no prototype in round {upload.round}: a FedPAC client "
                            f"with no training images cannot take part in secure aggregation")
        for k in range(num_classes):
            count = float(counts[k]) if k in protos else 0.0
            proto = protos[k].to(torch.float64) if k in protos else torch.zeros(dim, dtype=torch.float64)
            out[PROTOTYPE.format(k=k)] = proto * (count / max_weight)
            out[CLASS_COUNT.format(k=k)] = torch.tensor(count / max_weight, dtype=torch.float64)
        return out

    def secure_aggregate(self, server: State, total, round: int, max_weight: float) -> State:
        """The base from its weighted sum, each class's prototype from its count-weighted sum (classes no
        survivor holds get none, as in ``aggregate``); no combined head: the clients keep theirs."""
        base = {k: v for k, v in total.items() if k.startswith("extractor.") or k == "sample_count"}
        new = weighted_mean(base, server)
        for k in prototypes_in(total):
            count = float(total[CLASS_COUNT.format(k=k)]) * max_weight
            if count >= 0.5:  # half an image: an absent class decodes to quantisation noise far below it
                new["global." + PROTOTYPE.format(k=k)] = (total[PROTOTYPE.format(k=k)] * max_weight / count
                                                          ).to(torch.float32)
        return new

    def personalized(self, ctx: ClientContext, server: State, state: State):
        own = strip_prefix(server, HEAD.format(cid=ctx.client_id)) or only_group(state, "classifier")
        return {**only_group(strip_prefix(server, "global."), "extractor"), **own}
