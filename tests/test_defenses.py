"""Defenses: upload filters (order, no mutation, each filter's effect), DP-SGD (refusals, per-sample
gradients, cumulative ε, agreement with Opacus' own accountant), and the defend sweep/CLI."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from defenses import (DPConfig, DPMethod, Exclude, FilterChain, GaussianNoise, NormClip, Prune, Quantize, epsilon,
                      privacy_report)
from defenses.dp import ACCOUNT_KEY, DPSession, history_rows
from fedecouple.channel import Download, Upload
from fedecouple.errors import UserError
from fedecouple.methods import make_method
from fedecouple.methods.base import ClientContext, Method, TrainConfig, make_upload
from fedecouple.methods.training import sgd
from fedecouple.models import build_model, get_params

from helpers import dp_federation, tiny_federation
from helpers import TEST_THREADS


# ------------------------------------------------------------------------------------------------
# hand-made messages


def _messages(seed=0):
    gen = torch.Generator().manual_seed(seed)
    down = {"extractor.w": torch.randn(20, 10, generator=gen), "classifier.w": torch.randn(5, 10, generator=gen)}
    up = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in down.items()}
    up["prototype.3"] = torch.randn(10, generator=gen)
    up["class_counts"] = torch.tensor([0, 4, 0, 7, 1])
    up["sample_count"] = torch.tensor(12)
    return Download(0, 1, down), Upload(0, 1, up)


def _run(chain, down, up):
    chain.on_download(down.copy())
    return chain.on_upload(up.copy())


def test_filters_compose_in_order_and_match_manual_application():
    down, up = _messages()
    delta = {k: up.tensors[k] - down.tensors[k] for k in down.tensors}
    a = _run(FilterChain([NormClip(0.5), Quantize(2)]), down, up)
    b = _run(FilterChain([Quantize(2), NormClip(0.5)]), down, up)
    # manual: clip jointly, then quantise each tensor to 4 levels (and the other way round)
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
    clipped = {k: d * min(1.0, 0.5 / norm) for k, d in delta.items()}

    def quant(d):
        lo, hi = float(d.min()), float(d.max())
        step = (hi - lo) / 3
        return lo + torch.round((d - lo) / step) * step

    for k in delta:
        assert torch.allclose(a.tensors[k] - down.tensors[k], quant(clipped[k]), atol=1e-5)
    q = {k: quant(d) for k, d in delta.items()}
    qn = math.sqrt(sum(float(d.pow(2).sum()) for d in q.values()))
    for k in delta:
        assert torch.allclose(b.tensors[k] - down.tensors[k], q[k] * min(1.0, 0.5 / qn), atol=1e-5)
    assert not torch.allclose(a.tensors["extractor.w"], b.tensors["extractor.w"])


def test_filters_never_touch_the_message_handed_in():
    down, up = _messages()
    before = {k: v.clone() for k, v in up.tensors.items()}
    chain = FilterChain([GaussianNoise(sigma=0.3), Prune(50), NormClip(0.1), Quantize(1), Exclude(kinds=["prototype"])])
    chain.on_download(down)
    out = chain.on_upload(up)
    for k, v in before.items():
        assert torch.equal(up.tensors[k], v)
    assert out is not up and "prototype.3" not in out.tensors and "prototype.3" in up.tensors


def test_filters_never_mutate_client_state_in_a_federation(digits):
    hp = {"da": False, "gfa": False}
    plain = tiny_federation(digits, "fedecouple", clients=2, hp=hp)
    plain.run_round()
    chain = FilterChain([GaussianNoise(sigma=0.5), Prune(50)], persistent_groups=("classifier",))
    fed = tiny_federation(digits, "fedecouple", clients=2, hp=hp, interceptors=[chain])
    fed.run_round()
    for cid in plain.clients:
        for k, v in plain.clients[cid].items():
            assert torch.equal(fed.clients[cid][k], v), k  # the client's own state is what it trained
        received = fed.channel.recorder.get(0, cid).upload.tensors
        assert not torch.allclose(received["extractor.fc.weight"], fed.clients[cid]["extractor.fc.weight"])
    assert {r["position"] for r in chain.log} == {0, 1} and len(chain.log) == 4


def test_prune_zeroes_exactly_p_percent_of_the_smallest():
    down, up = _messages()
    delta = torch.cat([(up.tensors[k] - down.tensors[k]).flatten() for k in down.tensors])
    chain = FilterChain([Prune(37)])
    out = _run(chain, down, up)
    new = torch.cat([(out.tensors[k] - down.tensors[k]).flatten() for k in down.tensors])
    k = round(0.37 * delta.numel())
    zero = new.abs() < 1e-7
    assert int(zero.sum()) == k
    assert float(delta[zero].abs().max()) <= float(delta[~zero].abs().min())
    assert torch.allclose(new[~zero], delta[~zero], atol=1e-6)
    assert chain.log[0]["fraction_zero"] == pytest.approx(k / delta.numel(), abs=1e-9)


def test_clip_bounds_the_norm_and_keeps_the_direction():
    down, up = _messages()
    delta = torch.cat([(up.tensors[k] - down.tensors[k]).flatten() for k in down.tensors])
    for bound in (0.05, 1e6):
        chain = FilterChain([NormClip(bound)])
        out = _run(chain, down, up)
        new = torch.cat([(out.tensors[k] - down.tensors[k]).flatten() for k in down.tensors])
        assert float(new.norm()) <= bound * (1 + 1e-4)
        assert float(F.cosine_similarity(new, delta, dim=0)) > 0.9999
        assert chain.log[0]["norm_before"] == pytest.approx(float(delta.norm()), rel=1e-5)
    assert torch.allclose(new, delta, atol=1e-6)  # a loose bound changes nothing


def _levels(x: torch.Tensor, tol: float = 1e-4) -> int:
    """Distinct values of ``x`` up to float round-off (values closer than tol·range are one level)."""
    v = torch.sort(x.flatten().double()).values
    span = float(v[-1] - v[0]) or 1.0
    return 1 + int((v.diff() > tol * span).sum())


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_quantize_gives_at_most_two_to_the_k_levels(bits):
    down, up = _messages()
    chain = FilterChain([Quantize(bits)])
    out = _run(chain, down, up)
    for k in down.tensors:  # Δ = upload − download, decoded in float32
        assert _levels(out.tensors[k] - down.tensors[k]) <= 2 ** bits
    assert torch.equal(out.tensors["prototype.3"], up.tensors["prototype.3"])  # not a model weight: untouched
    out = _run(FilterChain([Quantize(bits, kinds=["prototype"])]), down, up)  # Δ = the value: exact levels
    assert torch.unique(out.tensors["prototype.3"]).numel() <= 2 ** bits
    assert chain.log[0]["max_levels_used"] <= 2 ** bits


def test_exclude_removes_fields_by_kind_and_pattern():
    down, up = _messages()
    out = _run(FilterChain([Exclude(kinds=["class_counts", "prototype"])]), down, up)
    assert set(out.tensors) == {"extractor.w", "classifier.w", "sample_count"}
    out = _run(FilterChain([Exclude(fields=["classifier.*"])]), down, up)
    assert "classifier.w" not in out.tensors and torch.equal(out.tensors["extractor.w"], up.tensors["extractor.w"])
    with pytest.raises(UserError):
        Exclude()


def test_noise_absolute_and_relative_and_delta_semantics():
    down, up = _messages()
    chain = FilterChain([GaussianNoise(sigma=0.2)])
    out = _run(chain, down, up)
    noise = torch.cat([(out.tensors[k] - up.tensors[k]).flatten() for k in down.tensors])
    assert float(noise.std()) == pytest.approx(0.2, rel=0.15)
    assert torch.equal(out.tensors["sample_count"], up.tensors["sample_count"])  # integer fields untouched
    delta = torch.cat([(up.tensors[k] - down.tensors[k]).flatten() for k in down.tensors]).abs()
    chain = FilterChain([GaussianNoise(relative=0.5, percentile=90)])
    _run(chain, down, up)
    assert chain.log[0]["sigma"] == pytest.approx(0.5 * float(torch.quantile(delta.double(), 0.9)), rel=1e-6)
    # prototypes selected explicitly: Δ is the value itself, so noise lands on the value
    chain = FilterChain([NormClip(1e-3, kinds=["prototype"])])
    out = _run(chain, down, up)
    assert float(out.tensors["prototype.3"].norm()) == pytest.approx(1e-3, rel=1e-4)


def test_persistent_groups_measure_delta_from_the_previous_upload():
    gen = torch.Generator().manual_seed(1)
    chain = FilterChain([NormClip(1e-3)], persistent_groups=("classifier",))
    first = {"classifier.w": torch.randn(3, 4, generator=gen)}
    chain.on_download(Download(0, 0, {"classifier.w": first["classifier.w"].clone()}))
    chain.on_upload(Upload(0, 0, first))
    second = {"classifier.w": first["classifier.w"] + 0.5}
    chain.on_download(Download(1, 0, {"classifier.w": torch.zeros(3, 4)}))  # a global head far away
    out = chain.on_upload(Upload(1, 0, second))
    assert float((out.tensors["classifier.w"] - first["classifier.w"]).norm()) == pytest.approx(1e-3, rel=1e-4)
    assert chain.log[-1]["basis"] == ["previous upload"]


# ------------------------------------------------------------------------------------------------
# DP-SGD


class BatchPrototypeMethod(Method):
    """A toy method whose loss pulls each feature to the *batch* mean of its class (not per-sample)."""

    name = "toy-batch-proto"

    def manifest(self, model):
        return []

    def client_update(self, ctx, state, download):
        model = ctx.model
        opt = sgd(model.parameters(), ctx.config)
        for x, y in ctx.batches(1, "local"):
            feats = model.features(x)
            centre = torch.stack([feats[y == label].mean(0) for label in y])
            loss = F.cross_entropy(model.classifier(feats), y) + (feats - centre).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return {}, make_upload(ctx, get_params(model))


class ReadsAllData(BatchPrototypeMethod):
    name = "toy-reads-all"

    def client_update(self, ctx, state, download):
        _ = ctx.images.mean()
        return {}, make_upload(ctx, {})


def _context(digits, n=20, batch=10, epochs=1, seed=0):
    torch.manual_seed(seed)
    model = build_model("digits", digits.channels, digits.image_size, digits.num_classes, digits.mean, digits.std)
    idx = np.arange(n)
    ctx = ClientContext(0, 0, digits.images[:n], digits.labels[:n], idx, model,
                        TrainConfig(lr=0.05, batch_size=batch, local_epochs=epochs), digits.num_classes,
                        torch.Generator().manual_seed(seed))
    return ctx, model


def test_dp_refuses_a_loss_that_is_not_per_sample(digits):
    ctx, model = _context(digits)
    method = DPMethod(BatchPrototypeMethod(), DPConfig(noise_multiplier=1.0))
    with pytest.raises(UserError, match="not per-sample"):
        method.client_update(ctx, method.init_client(model, 0), Download(0, 0, {}))


def test_dp_refuses_whole_data_reads_outside_both_mechanisms(digits):
    """Reading ctx.images directly is refused; statistics through ctx.class_feature_sums are covered
    (tests/test_dp_statistics.py)."""
    ctx, model = _context(digits)
    method = DPMethod(ReadsAllData(), DPConfig(noise_multiplier=1.0))
    with pytest.raises(UserError, match="whole training set"):
        method.client_update(ctx, {}, Download(0, 0, {}))
    for name, hp in (("fedecouple", {}), ("fedecouple", {"gfa": False}), ("fedpac", {}), ("fedproto", {})):
        DPMethod(make_method(name, **hp), DPConfig(noise_multiplier=1.0))  # accepted


@pytest.mark.parametrize("name,hp", [("fedavg", {}), ("fedecouple", {"gfa": False, "da": False})])
def test_dp_without_noise_or_clipping_is_plain_sgd_on_a_full_batch(digits, name, hp):
    """σ = 0, C huge, q = 1: the per-sample machinery must give exactly the ordinary gradient."""
    method = make_method(name, **hp)
    ctx, model = _context(digits, n=8, batch=8)
    down = Download(0, 0, method.download(method.init_server(model), 0, 0))
    state = method.init_client(model, 0)
    _, plain = method.client_update(ctx, dict(state), down)
    ctx2, _ = _context(digits, n=8, batch=8)  # same seed: same initial model
    dp = DPMethod(method, DPConfig(noise_multiplier=0.0, max_grad_norm=1e9))
    new_state, private = dp.client_update(ctx2, {**state, ACCOUNT_KEY: torch.zeros(0, 3, dtype=torch.float64)}, down)
    for k, v in plain.tensors.items():
        assert torch.allclose(private.tensors[k].float(), v.float(), atol=1e-5), k
    assert math.isinf(epsilon(new_state[ACCOUNT_KEY], 1e-5))  # no noise: no guarantee


def test_dp_groups_an_original_with_its_augmented_copy(digits):
    """FedeCouple's DA doubles each batch; the probe's per-sample gradients (pair summed) must agree."""
    ctx, model = _context(digits, n=20, batch=10)
    method = make_method("fedecouple", gfa=False)
    down = Download(0, 0, method.download(method.init_server(model), 0, 0))
    session = DPSession(make_method("fedecouple", gfa=False), ctx, DPConfig(noise_multiplier=1.0))
    with session:
        method.client_update(session.ctx, method.init_client(model, 0), down)
    phases = {r["phase"] for r in session.probe_results}
    assert {"classifier", "extractor-glf", "extractor"} <= phases
    assert max(r["relative_difference"] for r in session.probe_results) < 1e-4
    # the classifier phase trains student and teacher on each batch: one step at σ/√2 per batch
    sigmas = {round(s, 6) for s, _, _ in history_rows(session.history_tensor())}
    assert sigmas == {round(1 / math.sqrt(2), 6), 1.0}


def test_cumulative_epsilon_grows_across_rounds_and_survives_a_checkpoint(digits):
    def fed():
        return dp_federation(digits, "fedper", DPConfig(noise_multiplier=1.0), rounds=3)

    a = fed()
    eps = []
    for _ in range(3):
        a.run_round()
        eps.append(privacy_report(a.clients, a.method.dp)["epsilon_max"])
    assert 0 < eps[0] < eps[1] < eps[2]
    b = fed()
    b.run_round()
    state = copy.deepcopy(b.state_dict())
    c = fed()
    c.load_state_dict(state)
    c.run_round()
    c.run_round()
    assert privacy_report(c.clients, c.method.dp)["epsilon_max"] == pytest.approx(eps[2], rel=1e-12)


def test_epsilon_matches_opacus_accountants(digits):
    from opacus import PrivacyEngine
    from opacus.accountants import RDPAccountant

    sigma, n, batch, epochs, delta = 1.1, 100, 10, 2, 1e-5
    ctx, model = _context(digits, n=n, batch=batch, epochs=epochs)
    method = DPMethod(make_method("fedavg"), DPConfig(noise_multiplier=sigma, probe=0))
    down = Download(0, 0, method.download(method.init_server(model), 0, 0))
    state, _ = method.client_update(ctx, method.init_client(model, 0), down)
    rows = history_rows(state[ACCOUNT_KEY])
    assert rows == [(sigma, batch / n, epochs * n // batch)]
    ours = privacy_report({0: state}, method.dp)["epsilon_max"]

    manual = RDPAccountant()
    for _ in range(epochs * n // batch):
        manual.step(noise_multiplier=sigma, sample_rate=batch / n)
    assert ours == pytest.approx(manual.get_epsilon(delta), rel=1e-12)

    # Opacus' own training loop with its own accountant, same steps, sample rate and noise
    torch.manual_seed(0)
    net = build_model("digits", digits.channels, digits.image_size, digits.num_classes, digits.mean, digits.std)
    data = torch.utils.data.TensorDataset(digits.images[:n], digits.labels[:n])
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    engine = PrivacyEngine(accountant="rdp")
    net, opt, loader = engine.make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                                           data_loader=loader, noise_multiplier=sigma, max_grad_norm=1.0)
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            if len(y):
                F.cross_entropy(net(x), y).backward()
            opt.step()
            steps += 1
    assert steps == epochs * n // batch
    assert ours == pytest.approx(engine.get_epsilon(delta), rel=1e-9)
    # the PRV accountant reads the same history (a tighter bound than RDP's)
    assert 0 < epsilon(rows, delta, "prv") <= ours * 1.01


def test_epsilon_edge_cases():
    assert epsilon([], 1e-5) == 0.0
    assert math.isinf(epsilon([(0.0, 0.1, 5)], 1e-5))
    with pytest.raises(UserError):
        DPConfig(noise_multiplier=-1).validate()


# ------------------------------------------------------------------------------------------------
# the registry


def test_every_defense_declares_itself_once_in_the_registry():
    import defenses
    from defenses.registry import PLACES, DefenseSpec

    assert list(defenses.DEFENSES) == ["dp", "noise", "clip", "prune", "quantize", "exclude", "download-check",
                                       "consistency-check"]
    assert all(spec.name == name and spec.acts in PLACES and spec.meaning for name, spec in defenses.DEFENSES.items())
    assert [n for n, s in defenses.DEFENSES.items() if s.formal] == ["dp"]  # only DP's value gives an ε
    assert {n: s.acts for n, s in defenses.DEFENSES.items() if s.acts != "upload"} == \
        {"dp": "local training", "download-check": "download", "consistency-check": "download"}
    with pytest.raises(KeyError, match="choose one of: dp, noise, clip"):
        defenses.get("nope")
    with pytest.raises(ValueError, match="acts on"):
        DefenseSpec("x", "", acts="server", formal=False, parse=str, build=None, report=None)


def test_a_spec_reads_its_values_and_builds_the_defense_for_a_run(digits):
    import defenses
    from defenses.registry import DefendedRun

    get = defenses.get
    assert get("quantize").read("4") == 4 and isinstance(get("quantize").read("4"), int)
    assert get("exclude").read("prototype.*") == "prototype.*" and get("download-check").read("on") == "on"
    for name, item, needle in [("quantize", "4.5", "not an integer"), ("prune", "120", "percentages"),
                               ("dp", "-1", ">= 0"), ("clip", "0", "must be positive"), ("noise", "inf", "finite"),
                               ("download-check", "off", "no knob")]:
        with pytest.raises(UserError, match=f"--values for {name} .*{needle}"):
            get(name).read(item)

    def run(method, **dp):
        return DefendedRun(method=make_method(method), lr=0.1, seed=0, images_of=lambda c: digits.images[:4], dp=dp,
                           model=lambda: build_model("digits", digits.channels, digits.image_size,
                                                     digits.num_classes, digits.mean, digits.std))

    chain = get("noise").build(0.01, run("fedavg"))
    assert isinstance(chain, FilterChain) and chain.filters[0].sigma == pytest.approx(0.1 * math.sqrt(0.01))
    assert get("dp").build(2.0, run("fedavg", max_grad_norm=3.0)) == DPConfig(noise_multiplier=2.0, max_grad_norm=3.0)
    with pytest.raises(UserError, match="no field of kind 'prototype'"):
        get("exclude").build("prototype", run("fedavg"))
    assert get("exclude").build("prototype", run("fedproto")).filters[0].kinds == ("prototype",)
    assert get("download-check").build("on", run("fedavg")).images_of(0).shape[0] == 4


# ------------------------------------------------------------------------------------------------
# the sweep and the CLI


def test_defend_sweep_writes_outputs_and_resumes(tmp_path):
    from fedsec.jobs.defend import DefendSettings, defend
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=2, rounds=1, threads=TEST_THREADS)
    noisy = defend(config, DefendSettings(defense="noise", values="0.01", attacks="dlg", iterations=2, targets=1,
                                          baseline=False), tmp_path / "noise", progress=False)
    assert list(noisy["value"]) == [0.01] and noisy["mean_psnr_dlg"].notna().all()
    out = tmp_path / "sweep"
    settings = DefendSettings(defense="prune", values="30", attacks="dlg", iterations=2, targets=1)
    frame = defend(config, settings, out, progress=False)
    assert list(frame["defense"]) == ["none", "prune"] and list(frame["value"]) == ["none", 30.0]
    for name in ("tradeoff.csv", "tradeoff.md", "tradeoff.png", "baseline/done.json", "value-30.0/done.json",
                 "value-30.0/train/defense.json", "value-30.0/attack-dlg/summary.json"):
        assert (out / name).exists(), name
    stamp = (out / "value-30.0" / "done.json").stat().st_mtime_ns
    settings = DefendSettings(defense="prune", values="30", attacks="dlg", iterations=2, targets=1)
    defend(config, settings, out, progress=False)
    assert (out / "value-30.0" / "done.json").stat().st_mtime_ns == stamp  # skipped, not recomputed
    with pytest.raises(UserError, match="different settings"):
        defend(config, DefendSettings(defense="prune", values="30", attacks="dlg", iterations=3, targets=1), out,
               progress=False)


def test_defend_measures_membership_inference_next_to_epsilon(tmp_path):
    from fedsec.jobs.defend import DefendSettings, defend
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=2, rounds=1, threads=TEST_THREADS)
    frame = defend(config, DefendSettings(defense="dp", values="1", attacks="mia"), tmp_path / "m", progress=False)
    assert list(frame["value"].astype(str)) == ["none", "1.0"]
    assert frame["mia_auc"].between(0, 1).all()
    assert frame["mia_tpr_1pct_fpr"].isna().all()  # refused: digits has fewer than 1,000 held-out records
    assert math.isnan(frame.loc[0, "epsilon"]) and frame.loc[1, "epsilon"] > 0
    assert "MIA AUC" in (tmp_path / "m" / "tradeoff.md").read_text(encoding="utf-8")
    with pytest.raises(UserError, match="--defense dp only"):
        defend(config, DefendSettings(defense="clip", values="1", attacks="mia"), tmp_path / "c", progress=False)


def test_dp_sweep_numbers_move_the_right_way(tmp_path):
    """tradeoff.csv of a DP sweep: ε falls as σ grows, the baseline has no ε, accuracy stays a
    probability, PSNR and class presence are measured for every value."""
    from fedsec.jobs.defend import DefendSettings, defend
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=2, rounds=1, threads=TEST_THREADS)
    settings = DefendSettings(defense="dp", values="0.5,2", attacks="ig,labels", iterations=20, targets=1)
    defend(config, settings, tmp_path / "dp", progress=False)
    frame = pd.read_csv(tmp_path / "dp" / "tradeoff.csv")
    assert list(frame["value"].astype(str)) == ["none", "0.5", "2.0"]
    assert math.isnan(frame.loc[0, "epsilon"]) and frame.loc[1, "epsilon"] > frame.loc[2, "epsilon"] > 0
    assert frame["accuracy"].between(0, 1).all()
    assert frame["mean_psnr_ig"].notna().all() and (frame["mean_psnr_ig"] > 0).all()
    assert frame["prior_psnr_ig"].notna().all() and "prior_psnr" not in frame  # each attack its own prior
    # the forward-model check travels with every PSNR: the undefended baseline is modelled right, and a
    # flagged row is named in the table
    assert frame["mis_specified_ig"].dtype == bool and not frame.loc[0, "mis_specified_ig"]
    table = (tmp_path / "dp" / "tradeoff.md").read_text()
    assert ("MIS-SPECIFIED" in table) == bool(frame["mis_specified_ig"].any())
    assert frame["class_presence_labels"].between(0, 1).all()
    # the attacked client's ε (one step on one image, q = 1) is finite and grows as σ shrinks
    assert frame.loc[1, "epsilon_attacked"] > frame.loc[2, "epsilon_attacked"] > 0


def test_dp_sweep_covers_fedecouple_with_gfa_from_the_cli(tmp_path):
    """`fedsec defend --method fedecouple --defense dp` runs with GFA on: ε falls as σ grows, the
    statistics mechanism and the counts choice are in the outputs."""
    import json

    from fedsec.cli import main

    out = tmp_path / "dp-fedecouple"
    main(["defend", "--method", "fedecouple", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--threads",
          "1", "--defense", "dp", "--values", "0.5,2", "--attacks", "ig,labels", "--iterations", "5", "--targets",
          "1", "--no-baseline", "--counts", "withheld", "--out", str(out)])
    frame = pd.read_csv(out / "tradeoff.csv")
    assert list(frame["value"]) == [0.5, 2.0] and frame.loc[0, "epsilon"] > frame.loc[1, "epsilon"] > 0
    assert frame["accuracy"].between(0, 1).all() and frame["class_presence_labels"].notna().all()
    defense = json.loads((out / "value-0.5" / "train" / "defense.json").read_text())
    assert defense["counts"] == "withheld" and defense["statistics_noise_multiplier_used"] == 0.5
    assert set(defense["statistic_releases_per_client"].values()) == {1}  # the anchors of the one round
    assert "GFA anchors" in (out / "tradeoff.md").read_text()
    ig = json.loads((out / "value-0.5" / "attack-ig" / "summary.json").read_text())
    assert ig["threat_model"]["modes_used"] == ["method"]  # the same adaptive attacker as without DP


@pytest.mark.parametrize("args,needle", [
    (["--defense", "prune", "--values", "120"], "percentages"),
    (["--defense", "dp", "--values", "abc"], "numbers"),
    (["--defense", "dp", "--values", "1", "--stat-clip", "-1"], "--stat-clip must be positive"),
    (["--defense", "noise", "--values", "0.1", "--counts", "withheld"], "apply to --defense dp only"),
    (["--defense", "exclude", "--values", "prototype", "--method", "fedavg"], "no field of kind"),
    (["--defense", "noise", "--values", "0.1", "--attacks", "dlg,nope"], "unknown attack"),
])
def test_defend_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, args, needle):
    from fedsec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["defend", "--dataset", "digits", "--out", str(tmp_path / "x"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_defend_membership_cells_train_under_the_rows_whole_dp_configuration(tmp_path, monkeypatch):
    """``defend --attacks mia`` trains its shadow federations with the same DP as the row it sits in,
    statistics mechanism included (--stat-noise-multiplier, --stat-clip, --counts); the baseline
    row without DP."""
    from types import SimpleNamespace

    import fedsec.jobs.mia
    from fedsec.jobs.defend import DefendSettings, dp_config, membership_defended

    seen = []
    monkeypatch.setattr(fedsec.jobs.mia, "run_mia", lambda config, mia, out, **kw: seen.append(mia) or {})
    settings = DefendSettings(defense="dp", values="1", attacks="mia", stat_noise_multiplier=4.0, stat_clip=2.0,
                              counts="withheld")
    membership_defended(SimpleNamespace(config=None), settings, 1.0, tmp_path / "dp")
    membership_defended(SimpleNamespace(config=None), settings, "none", tmp_path / "none")
    assert seen[0].dp_config() == dp_config(settings, 1.0)
    assert seen[1].dp_config() is None


def test_defend_attacks_the_rounds_asked_for_under_a_filter(tmp_path):
    """--attack-rounds is an attack setting, not one of the DP statistics mechanism's: a channel filter
    takes it, and the attack summary records the round it attacked."""
    from fedsec.cli import main

    out = tmp_path / "sweep"
    main(["defend", "--method", "fedavg", "--defense", "clip", "--values", "1", "--no-baseline", "--attacks", "dlg",
          "--attack-rounds", "1", "--dataset", "digits", "--clients", "2", "--rounds", "2", "--train-images", "10",
          "--targets", "1", "--iterations", "1", "--out", str(out)])
    summary = json.loads((out / "value-1.0" / "attack-dlg" / "summary.json").read_text())
    assert summary["attack_rounds"] == [1]
