"""Distributed differential privacy under secure aggregation: each client adds Skellam noise before masking
(``fedecouple.secure_aggregation``), accounted by ``defenses.distributed_dp``."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from defenses import distributed_dp as ddp
from fedecouple.errors import UserError
from fedecouple.secure_aggregation import SecureAggregation, dequantize_sum, decode, Layout, secure_round
from helpers import run_cli

SMALL = ["--method", "fedavg", "--dataset", "digits", "--clients", "3", "--threads", "1"]


def _noise_of(protocol: SecureAggregation, participants: int, survivors: int, size: int = 40_000) -> np.ndarray:
    """The integer noise in a decoded sum of zeros (every value decodes to noise x quantum)."""
    summands = {c: {"v": torch.zeros(size, dtype=torch.float64)} for c in range(survivors)}
    record, _ = secure_round(protocol, 0, list(range(participants)), summands)
    assert record.aborted is None
    return np.rint(record.total["v"].numpy() / protocol.quantum)


def test_the_decoded_sum_carries_the_survivors_skellam_variance():
    protocol = SecureAggregation(dp_noise=5_000.0, dp_l2_clip=1.0, seed=3)
    noise = _noise_of(protocol, 5, 5)
    # Skellam(5μ, 5μ): variance 2·5·μ = 50,000; the sample variance over 40,000 values is within 0.8 % (one
    # standard error) of it, so 4 % is five standard errors
    assert abs(noise.var() / 50_000 - 1) < 0.04
    assert abs(noise.mean()) < 5 * math.sqrt(50_000 / len(noise))


def test_dropouts_leave_the_noise_of_the_survivors_only():
    protocol = SecureAggregation(dp_noise=5_000.0, dp_l2_clip=1.0, seed=4)
    noise = _noise_of(protocol, 6, 3)  # 3 of 6 survived: Skellam(3μ, 3μ)
    assert abs(noise.var() / 30_000 - 1) < 0.04


def test_without_noise_decoding_is_unchanged_and_centred_decoding_agrees_on_a_noise_free_sum():
    plain, private = SecureAggregation(), SecureAggregation(dp_noise=1.0, dp_l2_clip=1.0)
    layout = Layout((("v", (4,)),))
    total = np.array([0, 3 * 2 ** 21, 3 * 2 ** 22, 12_345], dtype=np.uint64)  # three clients' quantised values
    assert np.array_equal(decode(plain, layout, total, 3), dequantize_sum(plain, total, 3))
    assert np.allclose(decode(private, layout, total, 3), dequantize_sum(plain, total, 3), atol=1e-12, rtol=0)
    assert plain.describe() == {"clipping_range": 8.0, "quantization_range": 2 ** 22, "modulus": 2 ** 32,
                                "num_shares": 1.0, "reconstruction_threshold": 0.5, "max_weight": 1000.0,
                                "clear_fields": "flower"}
    assert private.describe()["dp_noise"] == 1.0 and private.describe()["dp_l2_clip"] == 1.0


def test_a_noisy_sum_below_zero_decodes_negative_and_the_clip_is_counted():
    protocol = SecureAggregation(dp_noise=100.0, dp_l2_clip=0.5, seed=1)
    summands = {0: {"v": torch.full((8,), -0.5, dtype=torch.float64)},   # norm √2: clipped to 0.5
                1: {"v": torch.full((8,), 0.01, dtype=torch.float64)}}   # norm 0.028: kept
    record, _ = secure_round(protocol, 0, [0, 1], summands)
    expected = -0.5 / math.sqrt(8) + 0.01
    # each value within its noise (std √(2·2·100) = 20 steps, ten of them) and rounding of the truth
    assert np.all(np.abs(record.total["v"].numpy() - expected) < (200 + 2) * protocol.quantum)
    assert record.dp_clipped == 1 and record.noise == 200.0 and record.dimension == 8


def test_the_weight_factor_travels_without_noise():
    protocol = SecureAggregation(dp_noise=1e6, dp_l2_clip=1.0, seed=2)
    summands = {c: {"sample_count": torch.tensor(0.25, dtype=torch.float64), "v": torch.zeros(5, dtype=torch.float64)}
                for c in range(3)}
    record, _ = secure_round(protocol, 0, [0, 1, 2], summands)
    assert float(record.total["sample_count"]) == 0.75 and record.dimension == 5


def test_fields_are_checked_and_a_noise_that_could_wrap_is_refused():
    with pytest.raises(UserError, match=r"^dp_l2_clip must be positive when dp_noise is set, got None$"):
        SecureAggregation(dp_noise=2.0)
    with pytest.raises(UserError, match=r"^dp_noise must be"):
        SecureAggregation(dp_noise=-1.0, dp_l2_clip=1.0)
    wide = SecureAggregation(quantization_range=2 ** 20, modulus=2 ** 24, dp_noise=1e12, dp_l2_clip=1.0)
    with pytest.raises(UserError) as refused:
        wide.check_headroom(4)
    message = str(refused.value)
    assert "could wrap" in message and "raise modulus" in message and "dp_noise" in message
    summands = {c: {"v": torch.zeros(3, dtype=torch.float64)} for c in range(4)}
    with pytest.raises(UserError, match="could wrap"):
        secure_round(wide, 0, [0, 1, 2, 3], summands)
    SecureAggregation(quantization_range=2 ** 20, modulus=2 ** 24, dp_noise=1e6, dp_l2_clip=1.0).check_headroom(4)


PROTOCOL = SecureAggregation(dp_noise=1.0, dp_l2_clip=1.0)  # quantisation and clip of the accounting below


def test_calibration_hits_the_target_and_epsilon_moves_the_right_way():
    for target, rounds, survivors in ((1.0, 5, 10), (8.0, 3, 4)):
        mu = ddp.calibrate(target, 1e-5, rounds, survivors, 5_000, 1.0, PROTOCOL)
        protocol = SecureAggregation(dp_noise=mu, dp_l2_clip=1.0)
        assert abs(ddp.total_epsilon(protocol, [survivors] * rounds, 5_000) / target - 1) < 0.01
    small, large = (SecureAggregation(dp_noise=mu, dp_l2_clip=1.0) for mu in (1e9, 4e9))
    assert ddp.round_epsilon(large, 10, 5_000) < ddp.round_epsilon(small, 10, 5_000)
    assert ddp.total_epsilon(small, [10] * 2, 5_000) < ddp.total_epsilon(small, [10] * 3, 5_000)
    # fewer survivors (dropouts) leave less noise: a larger epsilon
    assert ddp.round_epsilon(small, 10, 5_000) < ddp.round_epsilon(small, 7, 5_000)
    assert ddp.isolated_epsilon(small, 3, 5_000) > ddp.total_epsilon(small, [10] * 3, 5_000)


def test_the_skellam_bound_tends_to_the_gaussian_and_the_conversion_matches_an_independent_one():
    l1, l2 = PROTOCOL.sensitivity(1_000)
    assert l2 == 2 ** 22 / 16 + math.sqrt(1_000) and l1 == math.sqrt(1_000) * l2
    mu_total = 1e14  # variance 2e14 ≫ Δ₂²: the discrete surcharge is negligible
    gaussian = ddp.ORDERS * l2 ** 2 / (4 * mu_total)
    assert np.allclose(ddp.rdp(ddp.ORDERS, l1, l2, mu_total), gaussian, rtol=1e-3, atol=0)
    # (ε, δ) of that Gaussian RDP, by Balle et al.'s conversion written out here over the same orders
    delta = 1e-5
    by_hand = min(r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
                  for a, r in zip(ddp.ORDERS, gaussian))
    assert abs(ddp.epsilon_of(ddp.rdp(ddp.ORDERS, l1, l2, mu_total), delta) / by_hand - 1) < 1e-3
    # and within the classic bound ρ + 2√(ρ log(1/δ)) of zCDP ρ = Δ₂²/(4μ_total) (Bun and Steinke)
    rho = l2 ** 2 / (4 * mu_total)
    assert by_hand <= rho + 2 * math.sqrt(rho * math.log(1 / delta))


def test_an_attack_under_distributed_dp_reports_its_epsilon(tmp_path, capsys):
    out = tmp_path / "inversion"
    code, printed, err = run_cli(["attack", "sum-inversion", *SMALL, "--clients", "4", "--secure-aggregation",
                                  "--sa-dp-epsilon", "8", "--train-images", "1", "--iterations", "2", "--out", out],
                                 capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    spent = summary["distributed_dp"]
    assert abs(spent["epsilon_total"] / 8 - 1) < 0.01 and spent["epsilon_isolated"] > spent["epsilon_total"]
    assert spent["per_round"][0]["survivors"] == [4] and spent["mu_per_client"] > 0
    assert abs(summary["per_target"][0]["epsilon_round"] / 8 - 1) < 0.01
    assert summary["notes"][0].startswith("distributed DP: each client added Skellam noise")
    assert "distributed DP: each survivor added Skellam noise" in summary["threat_model"]["server_sees"]
    assert any("note: distributed DP" in line for line in (printed + err).splitlines())


def test_training_under_distributed_dp_writes_epsilon_per_round(tmp_path, capsys):
    out = tmp_path / "train"
    code, _, err = run_cli(["train", *SMALL, "--rounds", "2", "--secure-aggregation", "--sa-dp-epsilon", "4",
                            "--sa-dp-clip", "0.5", "--out", out], capsys)
    assert code == 0, err[-2000:]
    rounds = pd.read_csv(out / "rounds.csv")
    assert list(rounds.columns)[-4:] == ["dp_clipped", "epsilon_round", "epsilon_total", "epsilon_isolated"]
    assert rounds["dp_clipped"].between(0, 3).all()  # at most the round's 3 survivors
    assert abs(rounds["epsilon_total"].iloc[-1] / 4 - 1) < 0.01  # no dropout: the planned 3 survivors a round
    assert rounds["epsilon_total"].iloc[0] < rounds["epsilon_total"].iloc[1] < rounds["epsilon_isolated"].iloc[1]
    held = json.loads((out / "summary.json").read_text())["secure_aggregation"]
    assert held["protocol"]["dp_l2_clip"] == 0.5 and held["protocol"]["dp_noise"] > 0
    assert held["distributed_dp"]["target_epsilon"] == 4 and held["distributed_dp"]["dimension"] > 0


@pytest.mark.parametrize("flags, expected", [
    (["--sa-dp-epsilon", "8"], "--sa-dp-epsilon sets the secure-aggregation protocol, which is off"),
    (["--secure-aggregation", "--sa-dp-epsilon", "0"], "--sa-dp-epsilon must be positive"),
    (["--secure-aggregation", "--sa-dp-epsilon", "1", "--sa-dp-delta", "1"], "--sa-dp-delta must be in (0, 1)"),
    (["--secure-aggregation", "--sa-dp-epsilon", "1", "--sa-dp-clip", "0"], "--sa-dp-clip must be positive"),
    (["--secure-aggregation", "--sa-dp-clip", "2"], "--sa-dp-clip sets distributed differential privacy, which is off"),
])
def test_bad_distributed_dp_options_are_one_line_errors(tmp_path, capsys, flags, expected):
    code, _, err = run_cli(["train", *SMALL, "--rounds", "1", *flags, "--out", tmp_path / "x"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and expected in errors[0], err[-2000:]
    assert not (tmp_path / "x").exists()


def test_sybils_subtract_their_own_noise_leaving_the_targets_alone():
    """A server whose sybils fill a round knows the noise they drew: the target's summand it reads back
    carries the target's noise only (the isolated client's ε applies), not the round's."""
    from types import SimpleNamespace

    from attacks.secure.sybil import sybil_noise, without_sybils

    protocol = SecureAggregation(dp_noise=5_000.0, dp_l2_clip=1e9, seed=6)
    generator = torch.Generator().manual_seed(0)
    summands = {c: {"v": 1e-3 * torch.randn(40_000, generator=generator, dtype=torch.float64)} for c in range(4)}
    record, _ = secure_round(protocol, 2, [0, 1, 2, 3], summands)
    crafted = {0: SimpleNamespace(role="target"), **{c: SimpleNamespace(role="sybil") for c in (1, 2, 3)}}
    known = [summands[c] for c in (1, 2, 3)] + sybil_noise(protocol, record.total, crafted, record.survivors, 2)
    residual = (without_sybils(record.total, known)["v"] - summands[0]["v"]).numpy() / protocol.quantum
    # one client's Skellam(μ, μ): variance 2μ = 10,000 (the quantisation adds at most 4 x 1/4); four
    # clients' would be 40,000
    assert abs(residual.var() / 10_000 - 1) < 0.05
    without = (without_sybils(record.total, known[:3])["v"] - summands[0]["v"]).numpy() / protocol.quantum
    assert abs(without.var() / 40_000 - 1) < 0.05


def test_the_clip_bounds_the_update_against_the_download_not_the_parameters():
    """A model's values are far from zero; what it learnt in a round is not. Clipped against its download,
    a small update passes whole and the sum decodes to the true one (within the noise); clipped against
    zero, the same values would be shrunk to the clip."""
    protocol = SecureAggregation(dp_noise=1.0, dp_l2_clip=1.0, seed=8)
    generator = torch.Generator().manual_seed(1)
    download = {"v": torch.full((1000,), 2.0, dtype=torch.float64)}
    summands = {c: {"v": download["v"] + 1e-3 * torch.randn(1000, generator=generator, dtype=torch.float64)}
                for c in range(3)}
    truth = sum(s["v"] for s in summands.values())
    record, _ = secure_round(protocol, 0, [0, 1, 2], summands, downloads={c: download for c in range(3)})
    assert record.dp_clipped == 0
    assert (record.total["v"] - truth).abs().max() < 50 * protocol.quantum  # noise of 3 clients at mu 1
    against_zero, _ = secure_round(protocol, 0, [0, 1, 2], summands)
    assert against_zero.dp_clipped == 3 and float(against_zero.total["v"].norm()) < 3.01
