"""``fedsec report``'s malicious-server section: its rows (a method the attack cannot reach shows the
reason; with the download check the crafted downloads are refused and nothing is rebuilt), the CSV,
resuming, the audit preset's plan and ``--malicious-sizes`` errors.

A tiny federation: the 8×8 ``digits`` data set, 4 clients, 1 round, clients of 6 training images,
2 of them attacked, 3 inversion steps.
"""
from __future__ import annotations

import pandas as pd
import pytest

from fedsec.cli import main
from fedsec.jobs import report as rep
from fedsec.jobs.report.malicious import client_shares
from fedsec.runner import RunConfig
from helpers import TEST_THREADS

METHODS = ["fedavg", "fedproto"]
SIZE = 6


def build(out, **kw):
    config = RunConfig.of(dataset="digits", clients=4, rounds=1, threads=TEST_THREADS)
    settings = rep.ReportSettings(targets=2, iterations={"trap": 3}, malicious_sizes=(SIZE,))
    return rep.build_report(config, METHODS, out, attacks=["trap"], settings=settings, progress=False, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("malicious")
    return out, build(out)


def test_the_section_has_a_row_per_method_size_and_check(built):
    out, result = built
    assert result["failed"] == {}
    rows = pd.read_csv(out / "malicious.csv")
    assert list(rows.columns) == rep.SECTION_COLUMNS
    assert list(zip(rows["method"], rows["train_images"], rows["download_check"])) == [
        ("fedavg", SIZE, "off"), ("fedavg", SIZE, "on"), ("fedproto", SIZE, "off"), ("fedproto", SIZE, "on")]
    by = rows.set_index(["method", "download_check"])
    # FedProto trains nothing it downloads: refused before training, with the reason, not an error
    for check in ("off", "on"):
        assert by.loc[("fedproto", check), "status"] == "refused"
        assert "fedproto trains nothing the server sends" in by.loc[("fedproto", check), "reason"]
    off, on = by.loc[("fedavg", "off")], by.loc[("fedavg", "on")]
    # every image of the 2 attacked clients is scored; shares are of their 2 x 6 images, intervals around them
    assert (off["status"], off["n_targets"], off["n_images"], off["n_scored"]) == ("done", 2, 2 * SIZE, 2 * SIZE)
    for name in ("rebuilt_30db", "recovered", "inputs_exact"):
        share = off[f"{name}_share"]
        assert 0 <= off[f"{name}_ci_low"] <= share <= off[f"{name}_ci_high"] <= 1, name
    assert off["mean_psnr_ci_low"] <= off["mean_psnr"] <= off["mean_psnr_ci_high"]
    assert pd.isna(off["crafted_downloads"])  # no check ran
    # the check on: both crafted downloads refused, so nothing was uploaded and nothing rebuilt
    assert (on["crafted_downloads"], on["crafted_refused"]) == (2, 2)
    assert (on["rebuilt_30db"], on["rebuilt_30db_share"], on["recovered_share"], on["n_scored"]) == (0, 0.0, 0.0, 0)
    assert on["honest_downloads"] == 2 and 0 <= on["honest_refused"] <= 2  # the 2 clients not attacked
    assert 0 < on["rebuilt_30db_ci_high"] < 0.5  # Clopper-Pearson on 0 of 12

    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Malicious server" in md and "fedproto trains nothing the server sends" in md
    assert "| trap (binning) | 6 | on | 12 (2) | 0 % [0, 26] (0) |" in md and "| 2 / 2 |" in md
    assert "Malicious server" in (out / "report.html").read_text(encoding="utf-8")
    assert (out / "malicious_by_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a malicious attack is a section, not a headline cell
    assert not any(c.startswith("trap") for c in pd.read_csv(out / "summary.csv").columns)


def test_a_second_run_reuses_every_stage(built, tmp_path):
    out, first = built
    again = build(out)
    assert {r["source"] for r in again["stages"]} == {"done earlier"}
    assert again["malicious"].equals(first["malicious"])
    other = tmp_path / "other"
    reused = build(other, reuse=[out])
    assert {r["source"] for r in reused["stages"]} == {"reused"}
    assert pd.read_csv(other / "malicious.csv").drop(columns="seconds").equals(
        pd.read_csv(out / "malicious.csv").drop(columns="seconds"))


def test_shares_count_a_client_without_upload_as_nothing_rebuilt():
    """Two clients of 5 images: 3 of the first rebuilt at >= 30 dB (one twice: counted once), the
    second sent nothing: 3 of 10."""
    frame = pd.DataFrame({"round": 0, "client": 1, "image": [0, 1, 2, 2, 3],
                          "psnr": [40.0, float("inf"), 31.0, 35.0, 12.0], "prior_psnr": 12.0})
    shares = client_shares(frame, [(0, 1), (0, 2)], 5, seed=0)
    assert shares["rebuilt_30db"] == 3 and shares["rebuilt_30db_share"] == pytest.approx(0.3)
    assert shares["recovered"] == 3
    # at least Clopper-Pearson's interval on 3 of 10 ([0.067, 0.652]); the hull with the bootstrap over clients
    assert 0 <= shares["rebuilt_30db_ci_low"] <= 0.067 and 0.652 <= shares["rebuilt_30db_ci_high"] <= 1


def test_the_audit_preset_plans_trap_at_10_and_50_images_with_the_check_off_and_on():
    from fedsec.runner import AUDIT_FEDERATION, prepare

    settings = rep.audit_preset()
    cells = settings.malicious_cells(rep.AUDIT_ATTACKS)
    assert [c.key for c in cells] == ["trap@n10", "trap@n10+check", "trap@n50", "trap@n50+check"]
    assert all(c.settings.rounds == (0,) and c.settings.targets == 4 and c.settings.victim_batch == 0 for c in cells)
    assert [c.settings.download_check for c in cells] == [False, True, False, True]
    prep = prepare(RunConfig.of(dataset="mnist5k", **AUDIT_FEDERATION))
    assert min(len(t) for t in prep.partition.train) >= 50


def test_the_estimate_counts_no_rebuild_where_the_check_refuses_the_download():
    import attacks
    from fedsec import estimate

    off, on = (rep.ReportSettings(targets=4).for_malicious("trap", check).resolved(0) for check in (False, True))
    rebuilt, refused = (estimate.seconds(estimate.attack_work("fedavg", 10, 50, s, 1)) for s in (off, on))
    # 4 targets x 300 steps x 50 images at the rate trap declares, on top of the same training
    assert rebuilt - refused == pytest.approx(4 * 300 * 50 * attacks.get("trap").estimate_rate)
    # classifier fishing's rate is per target step, whatever the client's images
    fish = rep.ReportSettings(targets=4).for_malicious("fish", False).resolved(0)
    small, large = (estimate.seconds(estimate.attack_work("fedavg", 10, n, fish, 0)) for n in (10, 50))
    assert large - small == pytest.approx(4 * 40 * estimate.TARGET_SECONDS_PER_IMAGE)


@pytest.mark.parametrize("attack, sizes, message", [
    ("trap", "0", "--malicious-sizes needs image counts of at least 1"),
    ("trap", "10,x", "--malicious-sizes expects comma-separated image counts"),
    ("trap", "100000", "--malicious-sizes 100000: the smallest client holds"),
    ("ig", "10", "--malicious-sizes applies to the malicious-server attacks (trap, binning"),  # never ignored
])
def test_bad_malicious_sizes_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, attack, sizes, message):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(["report", "--dataset", "digits", "--clients", "4", "--methods", "fedavg", "--attacks", attack,
              "--malicious-sizes", sizes, "--threads", str(TEST_THREADS), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_fishing_in_the_section_attacks_its_first_round_not_round_0():
    """Classifier fishing reads the client's earlier upload: the section moves its round 0 to round 1
    (the other malicious attacks keep round 0)."""
    settings = rep.ReportSettings(rounds=(0, 19))
    assert settings.for_malicious("fish", False).rounds == (1, 19)
    assert settings.for_malicious("trap", True).rounds == (0, 19)
