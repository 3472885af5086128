"""DP-SGD (Opacus) for any method's local training, as a wrapper around the method.

``DPMethod(method, DPConfig(...))`` is a ``Method`` whose ``client_update`` runs the wrapped
method's own ``client_update`` inside a ``DPSession``; nothing inside the algorithms changes (the
same idea as Flower adding DP as a mod around a client). During the session:

* every optimizer the method builds with ``fedecouple.methods.training.sgd`` comes back as a ``DPSGD``
  (an ``opacus.optimizers.DPOptimizer``): per-sample gradients clipped to ``max_grad_norm`` C,
  summed, Gaussian noise of std σ·C added, divided by the expected batch size (Opacus' rule);
* per-sample gradients come from Opacus' per-layer grad samplers (``GradSampleHooks.GRAD_SAMPLERS``,
  functorch for other layers), fed by *global* module hooks installed for the session only. Not
  ``GradSampleModule``: methods deep-copy modules mid-update (FedeCouple's teacher and frozen
  global classifier) and hand ``sgd`` bare parameter iterators, so the hooks must reach every
  module whose parameters a DP optimizer trains, wherever it was created;
* ``ctx.batches`` draws **Poisson** batches (each sample independently with probability
  q = batch_size / n; ceil(n / batch_size) steps per epoch, Opacus' ``DPDataLoader`` convention —
  the non-DP loop instead drops a ragged last batch), which is what the accountant assumes; an empty
  draw still takes a noise-only step;
* the client's data can be read only through ``ctx.batches`` (DP-SGD) and
  ``ctx.class_feature_sums`` (whole-data statistics: FedeCouple's anchors, FedPAC's class means,
  h, V, prototypes and counts, FedProto's prototypes and counts), which here runs the Gaussian
  mechanism of ``defenses.dp_statistics`` (features clipped per sample to C_stat, noise
  σ_stat·C_stat on class sums, σ_stat on counts); reading ``ctx.images``, ``ctx.labels`` or
  ``ctx.class_counts()`` raises ``UserError``, because neither mechanism would cover it;
* on the first batch of every phase (every ``ctx.batches`` call) a **per-sample probe** takes the
  method's steps without applying them (parameters unchanged, nothing released) on the whole batch
  and on single samples of it and compares each sample's gradient: a loss that mixes samples
  (batch statistics, batch prototypes computed inside the loss) gives a different gradient for a
  sample alone than inside the batch, and the run is refused. An empirical check, not a proof.

Accounting. One accountant per client (``opacus.accountants.RDPAccountant``, or ``PRVAccountant``),
stored in the client's persistent state as ``dp.accountant`` (rows: noise multiplier, sample rate,
steps), so ε is cumulative across rounds, survives checkpoints, and the client update stays a
function of (state, download). One accountant step per drawn batch: when k optimizer steps use
the same batch (FedeCouple trains its personal classifier and its teacher on each batch), their
joint release is one Gaussian mechanism with L2 sensitivity √k·C and noise σ·C per coordinate, so
the step is accounted with noise multiplier σ/√k. Every statistic release goes into the same
history as (σ_stat, sample rate 1, steps): one step for the class sums, one for the sums of squared
norms (FedPAC's V), one for the class counts — released once per client and kept in its state,
since its labels never change (``dp_statistics``). RDP composes all of them, DP-SGD steps and
statistics alike, because they all read the same data: per round FedeCouple with GFA adds 1
statistic step (anchors), FedProto 1 (prototypes), FedPAC 3 (sums and squared norms before
training, sums after), plus the counts once. ε at δ (default 1e-5) per client; the report gives
every client's ε and the maximum. Sample-level ("one training example") add/remove DP of
everything the client uploads; the client's sample count n is treated as public (it sets q and is
uploaded by most methods).

Class counts (``counts``): a class is held when its noisy count is at least max(1, 3σ_stat), with
count round(ñ_k); the others count 0 and their rows are zeroed (``dp_statistics``). ``noised``
uploads these guarded noisy counts wherever the method uploads counts; ``withheld`` removes every field of kind ``class_counts`` from the upload (the counts are
still released inside the client: the means divide by them) and the server weights every sent
prototype equally (``dp_statistics.unit_counts``).

Data augmentation (FedeCouple's DA: every batch is the originals followed by one augmented copy of
each): an augmented copy belongs to the same person as its original, so per-sample gradients are
summed over the pair *before* clipping (one clipped gradient per original sample); the sensitivity
is therefore still C per person.

What each method declares in its ``DPCoverage`` facet (``dp_per_sample``: loss terms under DP-SGD;
``dp_statistics``: whole-data statistics under the Gaussian mechanism; what neither covers is its
``dp_uncovered()``, named in the refusal):
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.grad_sample import GradSampleHooks
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from opacus.optimizers import DPOptimizer
from torch.nn.modules.module import register_module_forward_hook

from fedecouple.data.augment import BatchAugmenter
from fedecouple.errors import UserError
from fedecouple.engine import derive_seed
from fedecouple.methods import METHODS
from fedecouple.methods.base import BatchRecord, ClassFeatureSums, ClientContext, Method, State
from fedecouple.methods.facets import (DPCoverage, Facet, Replay, SecureSummation, dp_coverage, facet_members,
                                       facets_of)
from fedecouple.methods.training import optimizer_hook

from .dp_statistics import (COUNTS_CHOICES, RELEASES_KEY, StatisticsMechanism, count_specs, unit_counts,
                            withhold_counts)
from .registry import DefendedRun, DefenseSpec, non_negative, register

ACCOUNT_KEY = "dp.accountant"
ACCOUNTANTS = ("rdp", "prv")
PROBE_TOLERANCE = 1e-3

def _declared_coverage() -> str:
    from fedecouple.methods import METHODS

    declared = {name: cls if issubclass(cls, DPCoverage) else DPCoverage for name, cls in METHODS.items()}
    return "".join(f"\n* ``{name}``: per-sample — {cls.dp_per_sample} Statistics — {cls.dp_statistics or 'none.'}"
                   for name, cls in declared.items()) + "\n"


__doc__ += _declared_coverage()  # each method declares its own (``DPCoverage``)


@dataclass(frozen=True)
class DPConfig:
    noise_multiplier: float
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    probe: int = 3  # samples compared by the per-sample probe of each phase's first batch (0: no probe)
    # the statistics mechanism (``dp_statistics``): noise multiplier and clip bound (None: the DP-SGD
    # ones), and whether class counts are uploaded noised or withheld
    statistics_noise_multiplier: float | None = None
    statistics_clip: float | None = None
    counts: str = "noised"

    @property
    def stat_sigma(self) -> float:
        return self.noise_multiplier if self.statistics_noise_multiplier is None else self.statistics_noise_multiplier

    @property
    def stat_clip(self) -> float:
        return self.max_grad_norm if self.statistics_clip is None else self.statistics_clip

    def validate(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise UserError(f"DP-SGD noise multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise UserError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")
        if not 0 < self.delta < 1:
            raise UserError(f"--delta must be in (0, 1), got {self.delta}")
        if self.accountant not in ACCOUNTANTS:
            raise UserError(f"unknown accountant {self.accountant!r}; choose one of: {', '.join(ACCOUNTANTS)}")
        if self.probe < 0:
            raise UserError(f"the per-sample probe size must be >= 0, got {self.probe}")
        if not (self.stat_sigma >= 0 and math.isfinite(self.stat_sigma)):
            raise UserError(f"--stat-noise-multiplier must be a finite number >= 0, got {self.stat_sigma}")
        if not (self.stat_clip > 0 and math.isfinite(self.stat_clip)):
            raise UserError(f"--stat-clip must be positive, got {self.stat_clip}")
        if self.counts not in COUNTS_CHOICES:
            raise UserError(f"--counts must be one of {', '.join(COUNTS_CHOICES)}, got {self.counts!r}")


# ---------------------------------------------------------------------------------------------
# accounting


def empty_history() -> torch.Tensor:
    return torch.zeros(0, 3, dtype=torch.float64)


def history_rows(history: torch.Tensor | None) -> list[tuple[float, float, int]]:
    if history is None:
        return []
    return [(float(s), float(q), int(round(float(n)))) for s, q, n in history.tolist()]


def history_tensor(rows: dict[tuple[float, float], int]) -> torch.Tensor:
    if not rows:
        return empty_history()
    return torch.tensor([[s, q, float(n)] for (s, q), n in sorted(rows.items())], dtype=torch.float64)


def make_accountant(kind: str = "rdp"):
    if kind == "rdp":
        return RDPAccountant()
    if kind == "prv":
        return PRVAccountant()
    raise UserError(f"unknown accountant {kind!r}; choose one of: {', '.join(ACCOUNTANTS)}")


def epsilon(history: torch.Tensor | list | None, delta: float, kind: str = "rdp") -> float:
    """ε at δ of the steps in ``history`` (tensor rows or (σ, q, steps) tuples); 0 without steps,
    inf when any step had no noise."""
    rows = history if isinstance(history, list) else history_rows(history)
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        return 0.0
    if any(s <= 0 for s, _, _ in rows):
        return math.inf
    accountant = make_accountant(kind)
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in rows]
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": only for huge ε (tiny σ)
        warnings.simplefilter("ignore")
        return float(accountant.get_epsilon(delta=delta))


def privacy_report(clients: dict[int, State], config: DPConfig) -> dict:
    """Per-client cumulative ε (from the accountants kept in client state) and the maximum, the
    accountant steps and statistic releases per client, and the resolved statistics settings."""
    per_client, steps, releases = {}, {}, {}
    for cid in sorted(clients):
        hist = clients[cid].get(ACCOUNT_KEY)
        if hist is None:
            continue
        rows = history_rows(hist)
        per_client[str(cid)] = epsilon(rows, config.delta, config.accountant)
        steps[str(cid)] = sum(n for _, _, n in rows)
        releases[str(cid)] = int(clients[cid].get(RELEASES_KEY, torch.tensor(0)))
    values = list(per_client.values())
    return {**asdict(config), "statistics_noise_multiplier_used": config.stat_sigma,
            "statistics_clip_used": config.stat_clip, "epsilon_max": max(values) if values else 0.0,
            "epsilon_per_client": per_client, "accountant_steps_per_client": steps,
            "statistic_releases_per_client": releases}


# ---------------------------------------------------------------------------------------------
# the optimizer


class DPSGD(DPOptimizer):
    """Opacus' DPOptimizer driven by a ``DPSession``: per-sample gradients are grouped by person
    (original + augmented copy), clipped per person, summed, noised, divided by the expected
    batch size; the session counts the step for its accountant (or, in the probe, records the
    per-sample gradients and leaves the parameters untouched)."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: "DPSession"):
        super().__init__(optimizer, noise_multiplier=session.config.noise_multiplier,
                         max_grad_norm=session.config.max_grad_norm, expected_batch_size=session.expected_batch,
                         generator=session.noise_generator)
        self.session = session

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad_sample = None
            p.summed_grad = None
        self.original_optimizer.zero_grad(set_to_none)

    def per_sample_gradients(self) -> torch.Tensor:
        """(persons, D): each person's gradient of the (row-mean) loss, over this optimizer's parameters."""
        s = self.session
        groups, persons = s.groups, s.persons
        columns = []
        for p in self.params:
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                if p.grad is not None and bool(p.grad.ne(0).any()):
                    raise UserError(f"DP-SGD ({s.method}): a parameter of shape {tuple(p.shape)} got a gradient but no "
                                    f"per-sample gradient (it is not trained through a supported layer)")
                columns.append(torch.zeros(persons, p.numel(), dtype=p.dtype, device=p.device))
                continue
            if gs.shape[0] != groups.numel():
                raise UserError(f"DP-SGD ({s.method}): a layer saw {gs.shape[0]} rows but the batch drawn from the "
                                f"client's data had {groups.numel()}; the loss must be computed on the batch that "
                                f"ctx.batches yields")
            per = torch.zeros((persons,) + tuple(gs.shape[1:]), dtype=gs.dtype, device=gs.device).index_add_(
                0, groups.to(gs.device), gs) * persons
            columns.append(per.reshape(persons, -1).to(p.dtype))
        return torch.cat(columns, dim=1)

    def _write(self, flat: torch.Tensor) -> None:
        pos = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[pos:pos + n].reshape(p.shape).to(device=p.device, dtype=p.dtype).clone()
            pos += n

    def _noisy_sum(self, per_sample: torch.Tensor) -> torch.Tensor:
        c = self.max_grad_norm
        if per_sample.shape[0]:
            factor = (c / (per_sample.norm(dim=1) + 1e-6)).clamp(max=1.0)
            summed = (factor.unsqueeze(1) * per_sample).sum(dim=0)
        else:
            summed = torch.zeros(per_sample.shape[1], dtype=per_sample.dtype, device=per_sample.device)
        if self.noise_multiplier > 0:  # drawn on the CPU's generator: the same noise on every device
            summed = summed + torch.normal(0.0, self.noise_multiplier * c, summed.shape, generator=self.generator,
                                           dtype=summed.dtype).to(summed.device)
        return summed / self.expected_batch_size

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        mode = self.session.on_step(self)
        per_sample = self.per_sample_gradients()
        if mode == "probe":
            self.session.record_probe(self, per_sample)
            self.zero_grad()
            return None
        self._write(self._noisy_sum(per_sample))
        return self.original_optimizer.step()

    def noise_only_step(self) -> None:
        """The step of an empty Poisson batch: noise only (nothing of anyone's data)."""
        dim = sum(p.numel() for p in self.params)
        self._write(self._noisy_sum(torch.zeros(0, dim, device=self.params[0].device)))
        self.original_optimizer.step()
        self.zero_grad()


# ---------------------------------------------------------------------------------------------
# the client context seen by the wrapped method


class _PrivateContext(ClientContext):
    """The engine's ClientContext, except that the data can only be read through ``batches``."""

    def __init__(self, base: ClientContext, session: "DPSession"):  # noqa: D107 — no dataclass init
        state = dict(base.__dict__)
        self.__dict__["_dp_images"] = state.pop("images")
        self.__dict__["_dp_labels"] = state.pop("labels")
        self.__dict__["_dp_session"] = session
        self.__dict__.update(state)

    def _refuse(self, what: str):
        raise UserError(self._dp_session.refusal(what))

    images = property(lambda self: self._refuse("ctx.images"), lambda self, v: None)
    labels = property(lambda self: self._refuse("ctx.labels"), lambda self, v: None)

    @property
    def num_samples(self) -> int:  # public: it sets the sample rate and is uploaded by most methods
        return int(self._dp_labels.shape[0])

    def class_counts(self) -> torch.Tensor:
        self._refuse("ctx.class_counts()")

    def class_feature_sums(self, features, squared_norms: bool = False) -> ClassFeatureSums:
        return self._dp_session.statistics.release(features, squared_norms)

    def batches(self, epochs: int, phase: str, augment: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._dp_session.batches(epochs, phase, augment)

    def __repr__(self) -> str:
        return f"PrivateClientContext(client={self.client_id}, round={self.round})"


class DPSession:
    """DP-SGD for one client update: optimizer hook, per-sample-gradient hooks, Poisson batches,
    probe and accountant steps. Use as a context manager around the method's ``client_update``."""

    def __init__(self, method: Method, ctx: ClientContext, config: DPConfig, history: torch.Tensor | None = None,
                 dp_state: State | None = None):
        self.method, self.config = method.name, config
        coverage = dp_coverage(method)
        self.uncovered = coverage.dp_uncovered()
        self.base = ctx
        self.n = ctx.num_samples
        self.batch_size = min(ctx.config.batch_size, self.n) if self.n else 0
        self.sample_rate = self.batch_size / self.n if self.n else 0.0
        self.expected_batch = max(self.batch_size, 1)
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=ctx.generator))
        self.noise_generator = torch.Generator().manual_seed(seed)
        self.ctx = _PrivateContext(ctx, self)
        self.rows: dict[tuple[float, float], int] = {}
        for s, q, n in history_rows(history):
            self.rows[(s, q)] = self.rows.get((s, q), 0) + n
        # its own stream, derived from the DP-SGD seed: methods without statistics draw exactly as before
        self.statistics = StatisticsMechanism(
            ctx.images, ctx.labels, ctx.num_classes, sigma=config.stat_sigma, clip=config.stat_clip,
            probe=config.probe, generator=torch.Generator().manual_seed(derive_seed(seed, 1)),
            state=dp_state or {}, account=self._account_statistic, method=method.name,
            declared=coverage.dp_statistics)
        self.optimizers: list[DPSGD] = []
        self._unclaimed: list[DPSGD] = []
        self._augmenter: BatchAugmenter | None = None
        self.groups: torch.Tensor | None = None
        self.persons = 0
        self.mode = "idle"
        self._stepped: list[DPSGD] = []
        self._probe_records: list[tuple[DPSGD, torch.Tensor]] = []
        self._stack: ExitStack | None = None
        self.probe_results: list[dict] = []

    # -- context management --------------------------------------------------------------------
    def __enter__(self) -> "DPSession":
        stack = ExitStack()
        stack.enter_context(optimizer_hook(self.wrap))
        handle = register_module_forward_hook(self._forward_hook)
        stack.callback(handle.remove)
        stack.callback(self._clear)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _clear(self) -> None:
        for opt in self.optimizers:
            for p in opt.params:
                p.grad_sample = None
                p.summed_grad = None

    def wrap(self, optimizer: torch.optim.Optimizer) -> DPSGD:
        dp = DPSGD(optimizer, self)
        self.optimizers.append(dp)
        self._unclaimed.append(dp)
        return dp

    def refusal(self, what: str) -> str:
        hint = self.uncovered or "it computes statistics of the whole data set"
        return (f"DP-SGD cannot cover {self.method}: it reads the client's whole training set ({what}) outside the "
                f"per-sample training loop and outside ctx.class_feature_sums — {hint}; its upload would not be "
                f"covered by ε, so the run is refused")

    # -- per-sample gradients --------------------------------------------------------------------
    def _forward_hook(self, module, inputs, output) -> None:
        if self.groups is None or not torch.is_grad_enabled():
            return
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        activations = [t.detach() for t in inputs if isinstance(t, torch.Tensor)]

        def on_grad(grad, module=module, activations=activations):
            self._grad_sample(module, activations, grad.detach())

        output.register_hook(on_grad)

    @staticmethod
    def _grad_sample(module, activations, backprops) -> None:
        sampler = GradSampleHooks.GRAD_SAMPLERS.get(type(module))
        if sampler is None:
            if not hasattr(module, "ft_compute_sample_grad"):
                prepare_layer(module)
            sampler = ft_compute_per_sample_gradient
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = sampler(module, activations, backprops)
        for p, gs in samples.items():
            if not p.requires_grad:
                continue
            existing = getattr(p, "grad_sample", None)
            p.grad_sample = gs if existing is None or existing.shape != gs.shape else existing + gs

    # -- batches ----------------------------------------------------------------------------------
    def _set_batch(self, groups: torch.Tensor | None, persons: int, mode: str) -> None:
        self._clear()  # per-sample gradients never carry over from one batch to the next
        self.groups, self.persons, self.mode = groups, persons, mode
        self._stepped = []
        self._probe_records = []

    def on_step(self, optimizer: DPSGD) -> str:
        if self.groups is None:
            raise UserError(f"DP-SGD ({self.method}): an optimizer stepped outside a batch drawn with ctx.batches; "
                            f"only gradients of drawn batches can be clipped and accounted")
        if self.mode == "train":
            self._stepped.append(optimizer)
        return self.mode

    def record_probe(self, optimizer: DPSGD, per_sample: torch.Tensor) -> None:
        self._probe_records.append((optimizer, per_sample.detach().clone()))

    def _account(self, k: int) -> None:
        sigma = self.config.noise_multiplier / math.sqrt(max(k, 1))
        key = (float(sigma), float(self.sample_rate))
        self.rows[key] = self.rows.get(key, 0) + 1

    def _account_statistic(self, steps: int) -> None:
        """``steps`` Gaussian releases of the whole data at the statistics' σ (sample rate 1)."""
        key = (float(self.config.stat_sigma), 1.0)
        self.rows[key] = self.rows.get(key, 0) + steps

    def history_tensor(self) -> torch.Tensor:
        return history_tensor(self.rows)

    def _augmenter_for(self, x: torch.Tensor) -> BatchAugmenter:
        if self._augmenter is None:
            self._augmenter = BatchAugmenter(x.shape[-1])
        return self._augmenter

    def batches(self, epochs: int, phase: str, augment: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Poisson batches (see the module docstring), probe on the first one, one accountant step each."""
        phase_optimizers, self._unclaimed = self._unclaimed, []
        n = self.n
        if n == 0:
            return
        ctx = self.base
        steps = ctx.steps_per_phase if ctx.steps_per_phase is not None else epochs * math.ceil(n / self.batch_size)
        q = self.sample_rate
        probe = self.config.probe > 0
        previous: list[DPSGD] = []
        for _ in range(steps):
            draw = torch.rand(n, generator=ctx.generator)
            sel = torch.arange(n) if q >= 1 else torch.nonzero(draw < q).flatten()
            if sel.numel() == 0:
                known = list(dict.fromkeys(previous or phase_optimizers))
                for opt in known:
                    opt.noise_only_step()
                self._account(len(known))
                continue
            record = BatchRecord(phase, sel.numpy(), ctx.indices[sel.numpy()])
            ctx.batch_log.append(record)
            x, y = ctx.images[sel], ctx.labels[sel]
            persons = int(sel.numel())
            groups = torch.arange(persons)
            if augment:
                copies, record.draws = self._augmenter_for(x).augment(x)
                x = torch.cat([x, copies])
                y = torch.cat([y, y])
                groups = torch.cat([groups, groups])
            if probe and persons >= 2:
                probe = False
                yield from self._probe(x, y, groups, persons, phase)
            self._set_batch(groups, persons, "train")
            try:
                yield x, y
            finally:
                stepped = self._stepped
                self._set_batch(None, 0, "idle")
            if not stepped:
                raise UserError(f"DP-SGD ({self.method}): a batch of the client's data was used in phase {phase!r} "
                                f"without a DP-SGD step; whatever was computed from it is not covered by ε")
            self._account(len(stepped))
            previous = stepped

    def _probe(self, x, y, groups, persons: int, phase: str):
        self._set_batch(groups, persons, "probe")
        try:
            yield x, y
            full = self._probe_records
            if not full:
                return
            checked = list(range(min(self.config.probe, persons)))
            singles = []
            for j in checked:
                rows = torch.nonzero(groups == j).flatten()
                self._set_batch(torch.zeros(rows.numel(), dtype=torch.long), 1, "probe")
                yield x[rows], y[rows]
                singles.append(self._probe_records)
        finally:
            self._set_batch(None, 0, "idle")
        order = [id(o) for o, _ in full]
        for j, single in zip(checked, singles):
            if [id(o) for o, _ in single] != order:
                raise UserError(f"DP-SGD ({self.method}): in phase {phase!r} the method takes different optimizer "
                                f"steps on a one-sample batch than on a full batch; its loss is not per-sample")
        for i, (_, whole) in enumerate(full):
            a = whole[checked]
            b = torch.stack([single[i][1][0] for single in singles])
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
            denom = float((b64 * b64).sum())
            scale = float((a64 * b64).sum()) / denom if denom > 0 else 1.0
            resid = float((a64 - scale * b64).norm()) / max(float(a64.norm()), 1e-12)
            self.probe_results.append({"phase": phase, "step": i, "samples": len(checked), "scale": scale,
                                       "relative_difference": resid})
            if float(a64.norm()) > 1e-12 and resid > PROBE_TOLERANCE:
                raise UserError(
                    f"DP-SGD ({self.method}): the loss in phase {phase!r} is not per-sample — a sample's gradient "
                    f"inside the batch differs from its gradient alone (relative difference {resid:.3g}), so "
                    f"per-sample clipping would not bound one sample's influence; refusing instead of reporting a "
                    f"meaningless ε")


# ---------------------------------------------------------------------------------------------
# the wrapper


def check_supported(method: Method) -> None:
    """Refuse, before any training, what the method declares neither DP-SGD nor the statistics
    mechanism covers (``DPCoverage.dp_uncovered``)."""
    reason = dp_coverage(method).dp_uncovered()
    if reason is not None:
        raise UserError(f"DP cannot cover {method.name}: {reason}; its ε would be meaningless (for methods "
                        f"without a DP mode, use an upload filter such as noise or exclude instead)")


def check_dp_model(prep) -> None:
    """A one-line UserError, before anything trains, when Opacus cannot compute the configured model's
    per-sample gradients (e.g. BatchNorm, which mixes the samples of a batch: ``resnet18-bn``)."""
    from opacus.validators import ModuleValidator

    from fedecouple.backends import ModelSpec

    federation = prep.config.federation
    with torch.random.fork_rng(devices=[]):
        model = ModelSpec.for_data(prep.dataset, federation.arch, federation.model).build()
    problems = ModuleValidator.validate(model, strict=False)
    if problems:
        first = (str(problems[0]).splitlines() or [""])[0].split(". ")[0]
        raise UserError(f"DP-SGD cannot train model {model.arch}: {first} (per-sample gradients need every sample "
                        f"normalised on its own: use a GroupNorm model such as --arch resnet18)")


class DPMethod(Method):
    """``method`` with DP-SGD local training, its whole-data statistics through the Gaussian
    mechanism of ``dp_statistics``, and one accountant per client in its state.

    It implements the core (``Method``) around the wrapped method's, and has each facet the wrapped method
    has (``fedecouple.methods.facets``): ``DPMethod(method, config)`` is an instance of a subclass that also
    derives from those facets and forwards every member they declare to the wrapped method, except what DP
    changes (``_DP_CHANGES``). So attacks on a DP run replay the method's own local training (Kerckhoffs:
    the attacker knows the method; DP's noise it cannot replay, which the forward-model check then
    reports), and secure aggregation runs the method's variant on the upload DP left (distributed DP: noise
    added on each client, the server sees only the sum)."""

    def __new__(cls, method: Method, config: DPConfig):
        return super().__new__(_wrapper_class(facets_of(method)) if cls is DPMethod else cls)

    def __init__(self, method: Method, config: DPConfig):
        config.validate()
        check_supported(method)
        self.inner, self.dp = method, config
        self._manifest = None  # the inner method's manifest, once a model was seen (withheld counts)

    def __reduce__(self):
        # pickled (Ray ships the method to its tasks) as the call that builds it: its class is made at run time
        return DPMethod, (self.inner, self.dp), dict(self.__dict__)

    name = property(lambda self: self.inner.name)
    @property
    def summary(self) -> str:
        """The wrapped method's declared one line, marked as trained under DP."""
        declared = METHODS.facts(self.inner.name) if self.inner.name in METHODS else {}
        return declared.get("summary", self.inner.name) + " [DP]"
    persistent_groups = property(lambda self: self.inner.persistent_groups)
    communicates = property(lambda self: self.inner.communicates)

    @staticmethod
    def _strip(state: State) -> State:
        return {k: v for k, v in state.items() if not k.startswith("dp.")}

    def manifest(self, model):
        return self.inner.manifest(model)

    def _see(self, model) -> list:
        if self._manifest is None:
            self._manifest = self.inner.manifest(model)
        return self._manifest

    def init_server(self, model):
        self._see(model)
        return self.inner.init_server(model)

    def init_client(self, model, client_id: int) -> State:
        self._see(model)
        return {**self.inner.init_client(model, client_id), ACCOUNT_KEY: empty_history()}

    def download(self, server, client_id, round):
        return self.inner.download(server, client_id, round)

    def client_update(self, ctx, state, download):
        dp_state = {k: v for k, v in state.items() if k.startswith("dp.")}
        session = DPSession(self.inner, ctx, self.dp, state.get(ACCOUNT_KEY), dp_state)
        with session:
            new_state, upload = self.inner.client_update(session.ctx, self._strip(state), download)
        if self.dp.counts == "withheld":
            upload = withhold_counts(upload, self._see(ctx.model))
        return {**new_state, **session.statistics.state_entries(), ACCOUNT_KEY: session.history_tensor()}, upload

    def aggregate(self, server, uploads, round):
        if self.dp.counts == "withheld" and uploads and count_specs(self._known_manifest())[0]:
            uploads = [unit_counts(u, self._manifest) for u in uploads]
        return self.inner.aggregate(server, uploads, round)

    def _known_manifest(self) -> list:
        if self._manifest is None:
            raise RuntimeError("DPMethod with withheld counts aggregates before it saw a model (init_server)")
        return self._manifest

    def personalized(self, ctx, server, state):
        return self.inner.personalized(ctx, server, self._strip(state))

    def hyperparameters(self) -> dict:
        """The inner method's, plus the DP settings as flat ``dp.*`` entries (flat values stay
        hashable: attacks key batched targets by them)."""
        return {**self.inner.hyperparameters(), **{f"dp.{k}": v for k, v in asdict(self.dp).items()}}


class _DPSecureSummation:
    """What DP changes of ``SecureSummation``: with withheld counts every prototype a client sends weighs
    the same in the sum (``dp_statistics.unit_counts``), as in ``DPMethod.aggregate``."""

    def secure_summands(self, upload, max_weight, num_classes):
        if self.dp.counts == "withheld" and count_specs(self._known_manifest())[0]:
            upload = unit_counts(upload, self._manifest)
        return self.inner.secure_summands(upload, max_weight, num_classes)


class _DPReplay:
    """What DP changes of ``Replay``: no closed form. Each of a method's closed-form facts solves its update
    exactly from the data; DP-SGD clips every sample's gradient and adds noise, so none holds (an attack
    still replays the method's own training, and its forward-model check reports the noise)."""

    closed_form: tuple[str, ...] = ()


# facet → the members DP changes of it (a class defining them); every other facet member is forwarded
_DP_CHANGES: dict[type[Facet], type] = {SecureSummation: _DPSecureSummation, Replay: _DPReplay}


def _forward(kind: type[Facet], name: str):
    """The wrapper's ``name`` of facet ``kind``: a call of the wrapped method's, or for data a property
    reading it."""
    declared = inspect.getattr_static(kind, name, None)
    if not inspect.isfunction(declared):
        return property(lambda self: getattr(self.inner, name), doc=f"the wrapped method's ``{name}``")

    def forward(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__, forward.__qualname__, forward.__doc__ = name, name, declared.__doc__
    return forward


@functools.cache
def _wrapper_class(kinds: tuple[type[Facet], ...]) -> type[DPMethod]:
    """``DPMethod`` with the facets ``kinds``: each member they declare forwarded to the wrapped method,
    except those ``_DP_CHANGES`` holds for them."""
    changes = tuple(dict.fromkeys(_DP_CHANGES[base] for kind in kinds for base in kind.__mro__
                                  if base in _DP_CHANGES))
    changed = {name for change in changes for name in vars(change) if not name.startswith("_")}
    members = {name: _forward(kind, name) for kind in kinds for name in facet_members(kind) if name not in changed}
    label = ", ".join(kind.__name__ for kind in kinds)
    return type(f"DPMethod[{label}]", (DPMethod, *changes, *kinds), {"__module__": __name__, **members})


# ---------------------------------------------------------------------------------------------
# the sweep's defense


def build_dp(value, run: DefendedRun) -> DPConfig:
    """DP-SGD at noise multiplier ``value`` with the run's other DP settings; refuses a configuration or a
    method it cannot cover."""
    config = DPConfig(noise_multiplier=float(value), **run.dp)
    config.validate()
    check_supported(run.method)
    return config


register(DefenseSpec(
    "dp", "noise multiplier σ of DP-SGD (and of the statistics mechanism unless --stat-noise-multiplier is set)",
    acts="local training", formal=True, parse=non_negative, build=build_dp,
    report=lambda config, clients: {"kind": "dp", **privacy_report(clients, config)}))
