"""DP for whole-data statistics (defenses/dp_statistics.py): the noise has the variance the
formula says, releases compose in the client's accountant as Opacus composes them, σ → 0 gives the
plain method's upload, coverage is what the methods declare, and label-count inference from
FedProto/FedPAC uploads is at chance at small ε (measured against a precisely defined chance)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from attacks.base import NotApplicable
from attacks.inversion.label_distribution import label_inference
from attacks.metrics import presence_threshold
from attacks.inversion.observation import observe
from defenses import DPConfig, DPMethod, epsilon, privacy_report
from defenses.dp import ACCOUNT_KEY, history_rows
from defenses.dp_statistics import COUNTS_KEY, RELEASES_KEY, StatisticsMechanism, held_threshold
from fedecouple.channel import Download
from fedecouple.errors import UserError
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import ClientContext, Method, TrainConfig, make_upload
from fedecouple.methods.facets import DPCoverage, Replay, SecureSummation, facets_of, local_phases
from fedecouple.models import build_model, set_params

from helpers import dp_federation


def _mechanism(features, labels, sigma, clip, seed=0, state=None, classes=3):
    steps = []
    mech = StatisticsMechanism(features, labels, classes, sigma=sigma, clip=clip, probe=0,
                               generator=torch.Generator().manual_seed(seed), state=state or {},
                               account=steps.append, method="toy", declared="toy statistics")
    return mech, steps


# ------------------------------------------------------------------------------------------------
# the mechanism's noise


def test_noisy_class_mean_has_the_variance_the_formula_says():
    """Var(mean_k coordinate) = (σ·C)² / n̂_k² given the released count n̂_k; E = clipped sum / n̂_k;
    the clip bound is the sensitivity: a row of norm 3C enters the sum at norm C."""
    gen = torch.Generator().manual_seed(0)
    d, sigma, clip, draws = 12, 2.0, 0.5, 3000
    labels = torch.tensor([0] * 40 + [1] * 25 + [2] * 2)
    feats = torch.randn(len(labels), d, generator=gen)
    feats = feats / feats.norm(dim=1, keepdim=True) * torch.where(torch.arange(len(labels)) % 2 == 0, 3 * clip, 0.5 * clip).unsqueeze(1)
    mech, steps = _mechanism(feats, labels, sigma, clip)
    means = torch.stack([mech.release(lambda x: x, squared_norms=False).means() for _ in range(draws)]).double()
    counts = mech.release(lambda x: x, squared_norms=False).counts  # released once, then kept
    assert steps == [1, 1] + [1] * draws  # counts once, then one step per release
    assert counts[2] == 0 and counts[0] > 0 and counts[1] > 0  # 2 samples < 3σ = 6: not held, row zero
    assert torch.equal(means[:, 2], torch.zeros(draws, d, dtype=torch.float64))
    clipped = feats * torch.where(torch.arange(len(labels)) % 2 == 0, 1 / 3, 1.0).unsqueeze(1)
    for k in (0, 1):
        n_hat = float(counts[k])
        expected_var = (sigma * clip / n_hat) ** 2
        var = means[:, k].var(dim=0)  # d coordinates, each an unbiased variance estimate
        # pooled over d coordinates the estimate has relative std sqrt(2/(d·(draws−1))) ≈ 0.7 %
        assert float(var.mean()) == pytest.approx(expected_var, rel=0.04)
        centre = clipped[labels == k].sum(0).double() / n_hat
        stderr = math.sqrt(expected_var / draws)
        assert float((means[:, k].mean(0) - centre).abs().max()) < 5 * stderr


def test_noisy_counts_and_squared_norms_have_the_formula_variance():
    labels = torch.tensor([0] * 30 + [1] * 20)
    feats = torch.full((50, 4), 1.0)  # norm 2 → clipped to C = 0.5: ‖f̄‖² = 0.25
    sigma, clip = 1.5, 0.5
    noisy, squares = [], []
    for seed in range(1500):  # a fresh client state each time: a fresh count release
        mech, _ = _mechanism(feats, labels, sigma, clip, seed=seed, classes=2)
        out = mech.release(lambda x: x, squared_norms=True)
        noisy.append(mech.noisy_counts)
        squares.append(out.squared_norms)
    noisy, squares = torch.stack(noisy), torch.stack(squares).double()
    assert float(noisy.var(dim=0).mean()) == pytest.approx(sigma ** 2, rel=0.06)
    assert float((noisy.mean(0) - torch.tensor([30.0, 20.0], dtype=torch.float64)).abs().max()) < 5 * sigma / math.sqrt(1500)
    assert float(squares.var(dim=0).mean()) == pytest.approx((sigma * clip ** 2) ** 2, rel=0.06)
    assert float(squares[:, 0].mean()) == pytest.approx(30 * clip ** 2, abs=5 * sigma * clip ** 2 / math.sqrt(1500))


def test_counts_are_released_once_per_data_and_kept_in_state():
    labels = torch.tensor([0] * 10 + [1] * 10)
    feats = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    mech, steps = _mechanism(feats, labels, 1.0, 1.0)
    first = mech.release(lambda x: x, False).counts
    state = mech.state_entries()
    assert steps == [1, 1] and int(state[RELEASES_KEY]) == 1
    again, steps2 = _mechanism(feats, labels, 1.0, 1.0, seed=5, state=state)
    assert torch.equal(again.release(lambda x: x, False).counts, first) and steps2 == [1]  # no new count release
    other, steps3 = _mechanism(feats[:15], labels[:15], 1.0, 1.0, seed=5, state=state)  # other data: fresh release
    other.release(lambda x: x, False)
    assert steps3 == [1, 1] and not torch.equal(other.state_entries()[COUNTS_KEY], state[COUNTS_KEY])
    assert held_threshold(0.1) == 1.0 and held_threshold(2.0) == 6.0


# ------------------------------------------------------------------------------------------------
# accounting


def test_statistic_releases_compose_in_the_accountant_as_opacus_composes_them(digits):
    """FedPAC, 2 rounds: DP-SGD steps at (σ, q) and statistic releases at (σ_stat, 1) in one history;
    ε equals Opacus' RDP accountant stepped through the same mechanisms, and k releases at σ_stat
    equal one Gaussian release at σ_stat/√k (Gaussian RDP composes exactly)."""
    from opacus.accountants import RDPAccountant

    sigma, sigma_stat, delta, rounds = 1.3, 2.5, 1e-5, 2
    fed = dp_federation(digits, "fedpac", DPConfig(noise_multiplier=sigma, statistics_noise_multiplier=sigma_stat),
                        rounds=rounds)
    fed.run(rounds)
    state = fed.clients[0]
    rows = history_rows(state[ACCOUNT_KEY])
    stat_steps = sum(n for s, q, n in rows if s == sigma_stat and q == 1.0)
    assert stat_steps == 1 + 3 * rounds  # counts once; per round sums + squared norms, then prototypes
    assert int(state[RELEASES_KEY]) == 2 * rounds
    sgd = [(s, q, n) for s, q, n in rows if s == sigma]
    assert sgd and all(q < 1 for _, q, _ in sgd)
    manual = RDPAccountant()
    for s, q, n in rows:
        for _ in range(n):
            manual.step(noise_multiplier=s, sample_rate=q)
    ours = privacy_report(fed.clients, fed.method.dp)["epsilon_per_client"]["0"]
    assert ours == pytest.approx(manual.get_epsilon(delta), rel=1e-12)
    k = stat_steps
    single = RDPAccountant()
    single.step(noise_multiplier=sigma_stat / math.sqrt(k), sample_rate=1.0)
    assert epsilon([(sigma_stat, 1.0, k)], delta) == pytest.approx(single.get_epsilon(delta), rel=1e-9)
    assert ours > epsilon([(sigma_stat, 1.0, k)], delta) > 0


def test_kept_counts_and_epsilon_survive_a_checkpoint(digits):
    """FedProto 2 rounds straight = 1 round, checkpoint, load, 1 round: same ε, same kept noisy counts,
    same uploads (the counts are released once, in round 0)."""
    def fed():
        return dp_federation(digits, "fedproto", DPConfig(noise_multiplier=1.0), rounds=2)

    straight = fed()
    straight.run(2)
    first = fed()
    first.run_round()
    resumed = fed()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    resumed.run_round()
    for cid in straight.clients:
        assert torch.equal(resumed.clients[cid][COUNTS_KEY], straight.clients[cid][COUNTS_KEY])
        assert torch.equal(first.clients[cid][COUNTS_KEY], straight.clients[cid][COUNTS_KEY])
        up_a = straight.channel.recorder.get(1, cid).upload.tensors
        up_b = resumed.channel.recorder.get(1, cid).upload.tensors
        assert up_a.keys() == up_b.keys() and all(torch.equal(up_a[k], up_b[k]) for k in up_a)
    report = privacy_report(straight.clients, straight.method.dp)
    assert privacy_report(resumed.clients, resumed.method.dp)["epsilon_max"] == report["epsilon_max"]
    assert report["statistic_releases_per_client"] == {"0": 2, "1": 2}


# ------------------------------------------------------------------------------------------------
# σ → 0: the plain method's upload


def _context(digits, n=24, seed=0):
    torch.manual_seed(seed)
    model = build_model("digits", digits.channels, digits.image_size, digits.num_classes, digits.mean, digits.std)
    ctx = ClientContext(0, 0, digits.images[:n], digits.labels[:n], np.arange(n), model,
                        TrainConfig(lr=0.05, batch_size=n, local_epochs=1), digits.num_classes,
                        torch.Generator().manual_seed(seed))
    return ctx, model


@pytest.mark.parametrize("name,hp", [("fedecouple", {"da": False}), ("fedpac", {}), ("fedproto", {})])
def test_dp_upload_equals_plain_upload_as_noise_vanishes(digits, name, hp):
    """σ_stat = 1e-12 with a clip bound that never binds, DP-SGD without noise or clipping on a full
    batch: the statistics (anchors, prototypes, counts, h, V) and the whole upload are the plain ones."""
    method = make_method(name, **hp)
    ctx, model = _context(digits)
    down = Download(0, 0, method.download(method.init_server(model), 0, 0))
    state = method.init_client(model, 0)
    _, plain = method.client_update(ctx, dict(state), down)
    ctx2, _ = _context(digits)
    dp = DPMethod(method, DPConfig(noise_multiplier=0.0, max_grad_norm=1e9, statistics_noise_multiplier=1e-12,
                                   statistics_clip=1e3))
    new_state, private = dp.client_update(ctx2, dict(state), down)
    assert set(private.tensors) == set(plain.tensors)
    for k, v in plain.tensors.items():
        assert private.tensors[k].dtype == v.dtype, k
        assert torch.allclose(private.tensors[k].double(), v.double(), atol=1e-5, rtol=1e-5), k
    if name == "fedecouple":
        assert torch.allclose(ctx2.private["anchors"], ctx.private["anchors"], atol=1e-5)
    assert int(new_state[RELEASES_KEY]) == {"fedecouple": 1, "fedpac": 2, "fedproto": 1}[name]


# ------------------------------------------------------------------------------------------------
# coverage is what the methods declare


class UndeclaredStatistic(Method):
    name = "toy-undeclared"

    def manifest(self, model):
        return []

    def client_update(self, ctx, state, download):
        ctx.class_means(ctx.model)
        return {}, make_upload(ctx, {})


class MixedFeatures(UndeclaredStatistic, DPCoverage):
    name = "toy-mixed"
    dp_statistics = "class means of batch-centred features"

    def client_update(self, ctx, state, download):
        ctx.class_feature_sums(lambda x: x.flatten(1) - x.flatten(1).mean(0))  # each row depends on all images
        return {}, make_upload(ctx, {})


class Uncovered(UndeclaredStatistic, DPCoverage):
    name = "toy-uncovered"

    def dp_uncovered(self):
        return "it sends the median of its images"


def test_coverage_follows_the_declarations(digits):
    for name in ("fedecouple", "fedpac", "fedproto"):  # every mission method is coverable now
        DPMethod(make_method(name), DPConfig(noise_multiplier=1.0))
    with pytest.raises(UserError, match="DP cannot cover toy-uncovered: it sends the median"):
        DPMethod(Uncovered(), DPConfig(noise_multiplier=1.0))
    ctx, _ = _context(digits)
    with pytest.raises(UserError, match="declares none"):
        DPMethod(UndeclaredStatistic(), DPConfig(noise_multiplier=1.0)).client_update(ctx, {}, Download(0, 0, {}))
    ctx, _ = _context(digits)
    with pytest.raises(UserError, match="not per-sample"):
        DPMethod(MixedFeatures(), DPConfig(noise_multiplier=1.0)).client_update(ctx, {}, Download(0, 0, {}))
    with pytest.raises(UserError, match="--counts"):
        DPConfig(noise_multiplier=1.0, counts="rounded").validate()
    with pytest.raises(UserError, match="--stat-clip"):
        DPConfig(noise_multiplier=1.0, statistics_clip=0.0).validate()


def test_withheld_counts_leave_the_upload_and_the_server_still_aggregates(digits):
    for name, field in (("fedproto", "class_count."), ("fedpac", "class_counts")):
        fed = dp_federation(digits, name, DPConfig(noise_multiplier=1.0, counts="withheld"), clients=3, rounds=2,
                            init_server=True)
        fed.run(1)
        uploads = list(fed.channel.recorder.uploads())
        assert uploads and not any(k.startswith(field) for u in uploads for k in u.tensors)
        assert any(k.startswith("global.prototype.") for k in fed.server)  # unit weights stood in for counts


# ------------------------------------------------------------------------------------------------
# label-count inference at small ε


def _presence(distribution: torch.Tensor) -> torch.Tensor:
    return distribution > presence_threshold(distribution.numel())


def _label_scores(fed, make_model, digits):
    """(predicted presence, true presence) per client of round 0. A client whose upload carries
    nothing to read (no class passed the noisy-count threshold) is predicted to hold no class:
    that is what its empty upload says."""
    predicted, truth = [], []
    for cid in sorted(fed.clients):
        obs = observe(fed.channel.recorder, 0, cid, method=fed.method, make_model=make_model,
                      image_shape=tuple(digits.images.shape[1:]), num_classes=digits.num_classes)
        try:
            dist = label_inference(obs, None, 0).trace["label_distribution"]
            predicted.append(_presence(dist))
        except NotApplicable:
            predicted.append(torch.zeros(digits.num_classes, dtype=torch.bool))
        idx = torch.from_numpy(fed.ground_truth.training_set(0, cid))
        counts = torch.bincount(digits.labels[idx], minlength=digits.num_classes).double()
        truth.append(_presence(counts / counts.sum()))
    return torch.stack(predicted), torch.stack(truth)


def presence_accuracy_and_chance(predicted: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """(mean class-presence accuracy of each client's prediction against its own classes, chance).

    Chance is the same predictions scored against *another* client's classes, averaged over all
    ordered pairs i ≠ j: what a prediction that carries no information about its own client's labels
    scores on this partition (it keeps the prediction's and the truth's marginals, so e.g. "predict
    nothing present" scores the share of absent classes, as it should)."""
    hits = (predicted.unsqueeze(1) == truth.unsqueeze(0)).double().mean(dim=2)  # [i, j]: pred i vs truth j
    m = hits.shape[0]
    own = float(hits.diagonal().mean())
    others = float((hits.sum() - hits.diagonal().sum()) / (m * (m - 1)))
    return own, others


@pytest.mark.parametrize("name", ["fedproto", "fedpac"])
def test_label_count_inference_falls_to_chance_at_small_epsilon(digits, name):
    """At σ = 0.5 (large ε) the uploaded noisy counts still give every client's classes away; at
    σ = 100 (ε < 0.2) presence accuracy is within three standard errors of chance (the sampling
    error of a mean of clients × classes presence decisions at the chance rate). At σ = 100 the guard
    (a class is held only when its noisy count is ≥ 3σ = 300) exceeds every class of these small
    clients, so chance is reached by withholding: the check fails if counts or prototypes get past the
    guard, not if noisy counts were uploaded and happened to be informative. Sample-level DP hides a
    class only when the noise on its count dwarfs the count (a class of n_k samples is a group of n_k
    people)."""
    results = {}
    clients = 16
    for sigma in (0.5, 100.0):
        fed = dp_federation(digits, name, DPConfig(noise_multiplier=sigma, probe=0), clients=clients, init_server=True)
        initial = copy.deepcopy(fed.model)
        set_params(initial, fed.initial_params)
        fed.run(1)
        own, chance = presence_accuracy_and_chance(*_label_scores(fed, lambda: copy.deepcopy(initial), digits))
        results[sigma] = (own, chance, privacy_report(fed.clients, fed.method.dp)["epsilon_max"])
    own, chance, eps = results[0.5]
    assert own == 1.0 and own > chance + 0.3  # the measurement can tell leakage from chance
    own, chance, eps = results[100.0]
    assert eps < 0.2
    stderr = math.sqrt(chance * (1 - chance) / (clients * digits.num_classes))
    assert abs(own - chance) <= 3 * stderr, results


def test_the_dp_wrapper_exposes_the_method_replay_attacks_use():
    """Attacks on a DP run replay the method's own local training (the adaptive attacker), as on a
    plain run: the wrapper has each facet the method has (``Replay``: ``local_phases``, ``replay``)."""
    for name in ("fedecouple", "fedpac", "fedproto", "fedper"):
        inner = make_method(name)
        dp = DPMethod(inner, DPConfig(noise_multiplier=1.0))
        assert facets_of(dp) == facets_of(inner) and isinstance(dp, Replay) == isinstance(inner, Replay)
        assert local_phases(dp, 2) == local_phases(inner, 2)
    assert isinstance(DPMethod(make_method("fedecouple"), DPConfig(noise_multiplier=1.0)), Replay)


def test_the_dp_wrapper_forwards_each_facet_member_and_pickles():
    """Every member of the wrapped method's facets reads through the wrapper, except what DP changes: the
    secure summands (under withheld counts) and the closed form (none holds under DP-SGD); the wrapper
    pickles (Ray ships it) into the same class."""
    import pickle

    from fedecouple.methods.facets import facet_members

    inner = make_method("fedecouple", lam=0.5)
    dp = DPMethod(inner, DPConfig(noise_multiplier=1.0))
    for kind in facets_of(inner):
        for name in facet_members(kind):
            if not callable(getattr(inner, name)) and name != "closed_form":
                assert getattr(dp, name) == getattr(inner, name), name
    assert inner.closed_form and dp.closed_form == ()
    assert type(dp).secure_summands is not type(inner).secure_summands and isinstance(dp, SecureSummation)
    assert not hasattr(DPMethod, "__getattr__") and not hasattr(dp, "gfa")
    again = pickle.loads(pickle.dumps(dp))
    assert type(again) is type(dp) and again.inner == inner and again.dp == dp.dp
    assert again.hyperparameters() == dp.hyperparameters() and again.summary == METHODS.facts("fedecouple")["summary"] + " [DP]"
