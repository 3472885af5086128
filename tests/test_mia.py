"""fedsec mia: attacks, statistics, shadow federations, outputs and one-line errors."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import norm

from attacks import statistics as st
from attacks.membership.lira import lira_online, scaled_logit
from attacks.membership.mia_threshold import entropy_scores, loss_scores, modified_entropy, population_scores
from attacks.membership.mia_update import update_scores
from attacks.membership.rmia import probability, rmia_scores, tune_offline_a
from fedecouple.data import make_partition
from fedecouple.models import build_model
from fedsec.cli import main
from attacks.membership.scoring import attack_metrics
from fedsec.jobs.mia import MiaSettings, audit_records, parse_attacks, reference_membership, split_partition


# ---------------------------------------------------------------------------------------------
# helpers: small centrally trained models on the 8x8 digits


def train_model(dataset, indices, epochs, seed, lr=0.05, batch=32):
    torch.manual_seed(seed)
    model = build_model("digits", 1, 8, 10, dataset.mean, dataset.std)
    x, y = dataset.images[indices], dataset.labels[indices]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(indices), generator=gen)
        for start in range(0, len(indices), batch):
            sel = order[start:start + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[sel]), y[sel]).backward()
            opt.step()
    return model


@torch.no_grad()
def logits_of(model, dataset, indices):
    return model(dataset.images[indices]).double().numpy()


# ---------------------------------------------------------------------------------------------
# threshold attacks


def test_memorising_model_gives_high_loss_auc_and_a_model_trained_on_neither_gives_chance(digits):
    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits))
    members, nonmembers, other = order[:16], order[16:416], order[460:860]
    labels = digits.labels.numpy()
    memoriser = train_model(digits, torch.from_numpy(members), epochs=300, seed=0, batch=8)
    both = np.concatenate([members, nonmembers])
    is_member = np.r_[np.ones(len(members)), np.zeros(len(nonmembers))]
    auc_memorised = st.auc(loss_scores(logits_of(memoriser, digits, both), labels[both]), is_member)
    assert auc_memorised > 0.9

    neither = train_model(digits, torch.from_numpy(other), epochs=30, seed=1)
    a, b = order[860:1160], order[1160:1460]  # two sets neither model trained on
    ab = np.concatenate([a, b])
    auc_unseen = st.auc(loss_scores(logits_of(neither, digits, ab), labels[ab]), np.r_[np.ones(300), np.zeros(300)])
    assert 0.4 <= auc_unseen <= 0.6


def test_modified_entropy_matches_its_formula_and_ranks_confident_correct_lowest():
    logits = np.array([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [1.0, 1.0, 1.0]])
    labels = np.array([0, 0, 0])
    p = torch.softmax(torch.tensor(logits), 1).numpy()
    expected = [-(1 - p[i, 0]) * np.log(p[i, 0]) - sum(p[i, k] * np.log(1 - p[i, k]) for k in (1, 2)) for i in range(3)]
    assert np.allclose(modified_entropy(logits, labels), expected)
    scores = entropy_scores(logits, labels)
    assert scores[0] > scores[2] > scores[1]  # confident and right > unsure > confident and wrong


def test_population_attack_compares_each_record_only_with_its_own_group_and_keeps_ranks_exact():
    loss_x = np.array([0.1, 2.0, 0.1])
    loss_z = np.array([0.5, 1.0, 3.0, 0.05])
    group_z = np.array([0, 0, 0, 1])
    scores = population_scores(loss_x, loss_z, [0, 0, 1], group_z)
    assert np.allclose(scores, [1.0, 1 / 3, 0.0])
    shifted = population_scores(loss_x, np.r_[loss_z[:3], 9.0], [0, 0, 1], group_z)
    assert np.allclose(shifted[:2], scores[:2])  # another group's population changes nothing here
    # a population record scored against its own population ties with itself: one denominator for
    # every record, so a member and a non-member are ordered exactly as their losses are
    rng = np.random.default_rng(0)
    loss_members, loss_nonmembers = rng.exponential(size=50), rng.exponential(size=20)
    both = np.r_[loss_members, loss_nonmembers]
    scores = population_scores(both, loss_nonmembers)
    member = np.r_[np.ones(50), np.zeros(20)]
    assert st.auc(scores, member) == pytest.approx(st.auc(-both, member))


# ---------------------------------------------------------------------------------------------
# reference-model attacks


@pytest.fixture(scope="module")
def shadow_models(digits):
    """A target and 4 reference models (2 complementary pairs) on halves of a 600-record pool;
    400 other records are the population."""
    rng = np.random.default_rng(3)
    order = rng.permutation(len(digits))
    pool, population = order[:600], order[600:1000]
    target_in = np.zeros(len(pool), bool)
    target_in[rng.permutation(len(pool))[:300]] = True
    ref_in = np.zeros((len(pool), 4), bool)
    for pair in range(2):
        ref_in[rng.permutation(len(pool))[:300], 2 * pair] = True
        ref_in[:, 2 * pair + 1] = ~ref_in[:, 2 * pair]
    models = [train_model(digits, torch.from_numpy(pool[target_in]), epochs=60, seed=10)]
    models += [train_model(digits, torch.from_numpy(pool[ref_in[:, r]]), epochs=60, seed=11 + r) for r in range(4)]
    labels = digits.labels.numpy()
    logits_x = np.stack([logits_of(m, digits, torch.from_numpy(pool)) for m in models])
    logits_z = np.stack([logits_of(m, digits, torch.from_numpy(population)) for m in models])
    return {"x": logits_x, "z": logits_z, "y_x": labels[pool], "y_z": labels[population], "member": target_in,
            "ref_in": ref_in}


def test_rmia_beats_loss_at_1pct_fpr_on_a_seeded_small_case(shadow_models):
    s = shadow_models
    p_x, p_z = probability(s["x"], s["y_x"]), probability(s["z"], s["y_z"])
    p_out_x = p_x[1:].T[~s["ref_in"]].reshape(len(s["member"]), 2)
    p_out_z = p_z[[1, 3]].T  # population records are OUT of every reference; use one per pair
    rmia = rmia_scores(p_x[0], p_out_x, p_z[0], p_out_z, gamma=2.0, a=0.3)
    loss = loss_scores(s["x"][0], s["y_x"])
    tpr_rmia, tpr_loss = st.tpr_at_fpr(rmia, s["member"], 0.01), st.tpr_at_fpr(loss, s["member"], 0.01)
    assert tpr_rmia > tpr_loss, (tpr_rmia, tpr_loss)  # 300 non-members: 1 % FPR is 3 false positives
    assert st.auc(rmia, s["member"]) > st.auc(loss, s["member"]) + 0.03


def test_rmia_calibrates_per_record_difficulty_where_loss_cannot():
    """Synthetic: records differ in difficulty far more than training moves them; RMIA's
    reference models measure each record's difficulty, LOSS cannot (2000 non-members)."""
    rng = np.random.default_rng(0)
    n, m = 4000, 1000
    member = rng.random(n) < 0.5
    difficulty_x, difficulty_z = rng.normal(0, 2.0, n), rng.normal(0, 2.0, m)

    def p(logit):
        return 1 / (1 + np.exp(-logit))

    p_target = p(difficulty_x + 1.5 * member + rng.normal(0, 0.3, n))
    p_out = p(difficulty_x[:, None] + rng.normal(0, 0.3, (n, 2)))
    z_target, z_out = p(difficulty_z + rng.normal(0, 0.3, m)), p(difficulty_z[:, None] + rng.normal(0, 0.3, (m, 2)))
    rmia = rmia_scores(p_target, p_out, z_target, z_out, gamma=2.0, a=0.3)
    loss = np.log(p_target)  # −cross-entropy of the true label
    assert st.tpr_at_fpr(rmia, member, 0.01) > st.tpr_at_fpr(loss, member, 0.01) + 0.2


def test_rmia_without_membership_signal_scores_chance_when_the_population_is_the_nonmembers():
    """Members and non-members exchangeable; each client's non-members are its population. A score
    whose denominator differed between members and non-members ranked them apart (AUC ≈ 0.3)."""
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(20), 250)
    member = np.tile(np.r_[np.ones(188, bool), np.zeros(62, bool)], 20)
    p_out = rng.uniform(0.5, 0.9, (5000, 2))
    p_target = np.clip(p_out.mean(1) * np.exp(rng.normal(0, 0.05, 5000)), 0, 1)
    p_target[rng.random(5000) < 0.05] = 0.01  # a few misclassified records: the z most records beat
    z = ~member
    scores = rmia_scores(p_target, p_out, p_target[z], p_out[z], 2.0, 0.3, owner, owner[z])
    assert 0.45 <= st.auc(scores, member) <= 0.55
    per_client = [st.auc(scores[owner == c], member[owner == c]) for c in range(20)]
    assert 0.4 <= np.median(per_client) <= 0.6


def test_rmia_a_is_tuned_on_a_reference_pair_and_lira_separates_members(shadow_models):
    s = shadow_models
    p_x = probability(s["x"], s["y_x"])
    members0 = s["ref_in"][:, 0]  # pseudo-target: reference run 0, attacked with the other pair
    p_out = p_x[3:].T[~s["ref_in"][:, 2:]].reshape(-1, 1)
    a, aucs = tune_offline_a(p_x[1], p_out, p_x[1][~members0], p_out[~members0], members0)
    assert a in aucs and len(aucs) == 11 and aucs[a] == max(aucs.values())

    phi = scaled_logit(s["x"], s["y_x"])
    refs = phi[1:].T
    scores = lira_online(phi[0], refs[s["ref_in"]].reshape(-1, 2), refs[~s["ref_in"]].reshape(-1, 2))
    assert st.auc(scores, s["member"]) > 0.58


def test_scaled_logit_and_probability_match_their_definitions():
    logits = np.array([[2.0, 1.0, -1.0]])
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.isclose(scaled_logit(logits, [0])[0], np.log(p[0, 0]) - np.log(p[0, 1] + p[0, 2]))
    q = np.exp(logits / 2) / np.exp(logits / 2).sum()
    assert np.isclose(probability(logits, [1], temperature=2.0)[0], q[0, 1])


def test_update_test_flags_the_owner_whose_loss_fell_more_than_the_other_clients():
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(10), 40)
    member = np.tile(np.r_[np.ones(20, bool), np.zeros(20, bool)], 10)
    decrease = rng.normal(size=(10, 400))
    decrease[owner[member], np.flatnonzero(member)] += 2.0  # training on x lowers x's loss more
    scores = update_scores(decrease, owner)
    assert st.auc(scores, member) > 0.9
    with pytest.raises(ValueError):
        update_scores(decrease[:2], np.zeros(400, int))


# ---------------------------------------------------------------------------------------------
# statistics


def test_cluster_bootstrap_auc_interval_covers_the_true_auc_at_about_its_nominal_rate():
    d, sigma_client, k = 0.8, 0.3, 30  # score = client effect + noise + d·member; k clients of 20 records
    # P(member > non-member) over pairs: same client (1/k of pairs) or two clients' effects apart
    true_auc = (norm.cdf(d / np.sqrt(2)) + (k - 1) * norm.cdf(d / np.sqrt(2 + 2 * sigma_client ** 2))) / k
    covered = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        clients = np.repeat(np.arange(k), 20)
        member = rng.random(20 * k) < 0.5
        scores = rng.normal(0, sigma_client, k)[clients] + rng.normal(size=20 * k) + d * member
        low, high = st.cluster_bootstrap((scores, member), clients, st.auc, n_boot=200, seed=seed)
        covered += low <= true_auc <= high
    assert covered >= 90, covered


def test_clopper_pearson_and_mean_bootstrap_cover_at_about_their_nominal_rate():
    cp = boot = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        low, high = st.clopper_pearson(rng.binomial(200, 0.03), 200)
        cp += low <= 0.03 <= high
        low, high = st.bootstrap_mean(rng.normal(1.0, 2.0, 60), n_boot=400, seed=seed)
        boot += low <= 1.0 <= high
    assert cp >= 93, cp  # exact intervals are conservative
    assert boot >= 88, boot
    assert st.clopper_pearson(0, 100)[0] == 0.0 and st.clopper_pearson(100, 100)[1] == 1.0


def test_low_fpr_refusal_below_10_over_alpha_nonmembers():
    assert st.min_nonmembers(0.01) == 1000 and st.min_nonmembers(0.001) == 10000
    assert "1000" in st.low_fpr_refusal(999, 0.01) and st.low_fpr_refusal(1000, 0.01) is None
    rng = np.random.default_rng(0)
    for n_neg, refused in ((999, True), (1000, False)):
        member = np.r_[np.ones(300, bool), np.zeros(n_neg, bool)]
        scores = rng.normal(size=len(member)) + member
        m = attack_metrics(scores, member, np.arange(len(member)) % 10, n_boot=20, seed=0, delta=1e-5)
        assert isinstance(m["tpr_at_1pct_fpr"], str) == refused
        assert isinstance(m["tpr_at_0_1pct_fpr"], str)  # 10,000 needed
        if refused:
            assert "not reported" in m["tpr_at_1pct_fpr"] and m["tpr_at_1pct_fpr_ci"] is None
        else:
            low, high = m["tpr_at_1pct_fpr_ci"]
            assert low <= m["tpr_at_1pct_fpr"] <= high


def test_tpr_at_fpr_advantage_and_the_epsilon_bound_on_known_scores():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    member = np.array([1, 1, 0, 1, 0, 0])
    assert st.tpr_at_fpr(scores, member, 0.0) == pytest.approx(2 / 3)
    assert st.advantage(scores, member) == pytest.approx(2 / 3)
    assert st.auc(scores, member) == pytest.approx(8 / 9)
    assert st.epsilon_from_rates(0.5, 0.05, 0.0) == pytest.approx(np.log(10))
    assert st.epsilon_from_rates(0.5, 0.5, 1e-5) == 0.0
    rng = np.random.default_rng(1)
    member = rng.random(4000) < 0.5
    strong = st.empirical_epsilon(member + rng.normal(0, 0.2, 4000), member, 1e-5, select=np.arange(4000) < 2000)
    chance = st.empirical_epsilon(rng.normal(size=4000), member, 1e-5, select=np.arange(4000) < 2000)
    assert strong["epsilon_lower_bound"] > 2.0 and chance["epsilon_lower_bound"] < 0.3


# ---------------------------------------------------------------------------------------------
# records and shadow federations


def test_nonmembers_follow_each_clients_own_label_mix_and_reference_halves_are_complementary(digits):
    labels = digits.labels.numpy()
    part = make_partition(labels, 6, "pathological", classes_per_client=2, seed=0)
    records = audit_records(part, labels)
    for cid in range(6):
        mine = records.owner == cid
        members, nonmembers = records.member & mine, ~records.member & mine
        assert set(records.index[mine]) == set(part.train[cid]) | set(part.test[cid])
        assert set(labels[records.index[nonmembers]]) <= set(labels[records.index[members]])
        share_train = np.bincount(records.labels[members], minlength=10) / members.sum()
        share_test = np.bincount(records.labels[nonmembers], minlength=10) / nonmembers.sum()
        assert np.abs(share_train - share_test).max() < 0.05
    others = np.concatenate([part.train[c] for c in range(1, 6)] + [part.test[c] for c in range(1, 6)])
    assert not np.isin(records.index[(records.owner == 0) & ~records.member], others).any()

    ref_in = reference_membership(records, 4, seed=0)
    assert (ref_in.sum(axis=1) == 2).all()
    assert (ref_in[:, 0] ^ ref_in[:, 1]).all() and (ref_in[:, 2] ^ ref_in[:, 3]).all()
    for cid in range(6):
        for k in np.unique(records.labels[records.owner == cid]):
            rows = (records.owner == cid) & (records.labels == k)
            assert abs(int(ref_in[rows, 0].sum()) - int(ref_in[rows, 1].sum())) <= 1
    half = split_partition(records, ref_in[:, 0], part)
    assert all(set(half.train[c]) | set(half.test[c]) == set(part.train[c]) | set(part.test[c]) for c in range(6))
    assert not np.array_equal(ref_in[:, 0], reference_membership(records, 4, seed=1)[:, 0])


# ---------------------------------------------------------------------------------------------
# the command


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr()


TINY = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--bootstrap", "30", "--exposed", "4"]


def test_cli_writes_every_output_and_reuses_finished_runs(tmp_path, capsys):
    out = tmp_path / "mia"
    main(["mia", "--method", "fedavg", *TINY, "--reference-runs", "2", "--out", str(out)])
    for name in ("mia.csv", "summary.json", "mia.md", "per_client_auc.csv", "roc.png", "histograms.png",
                 "exposed.csv", "exposed.png"):
        assert (out / name).stat().st_size > 0, name
    frame = pd.read_csv(out / "mia.csv")
    assert {"record", "client", "target", "member", "loss", "entropy", "population", "rmia", "lira",
            "update"} <= set(frame.columns)
    assert set(frame["target"]) == {"personal", "global", "upload"}
    assert frame.loc[frame["target"] != "upload", "update"].isna().all()
    summary = json.loads((out / "summary.json").read_text())
    m = summary["targets"]["personal"]["attacks"]["loss"]
    assert {"auc", "auc_ci", "advantage", "tpr_at_1pct_fpr", "tpr_at_1pct_fpr_ci", "tpr_at_0_1pct_fpr",
            "n_members", "n_nonmembers"} <= set(m)
    assert m["n_members"] + m["n_nonmembers"] == len(frame[frame["target"] == "personal"])
    assert isinstance(m["tpr_at_0_1pct_fpr"], str) and "10000" in m["tpr_at_0_1pct_fpr"]
    assert summary["versions"]["torch"] and summary["seed"] == 0 and summary["config"]["clients"] == 3
    assert summary["targets"]["personal"]["offline_a"]["tuned"] is False  # 2 reference runs: default a
    assert 0.3 < summary["targets"]["personal"]["chance_level"]["loss_auc_mean"] < 0.7
    stamp = (out / "runs" / "ref-1" / "done.json").stat().st_mtime_ns
    main(["mia", "--method", "fedavg", *TINY, "--reference-runs", "2", "--out", str(out)])
    assert (out / "runs" / "ref-1" / "done.json").stat().st_mtime_ns == stamp
    again = json.loads((out / "summary.json").read_text())
    assert again["targets"]["personal"]["attacks"]["loss"]["auc"] == m["auc"]


def test_kinds_follow_what_each_method_has_and_dp_reports_both_epsilons(tmp_path, capsys):
    out = tmp_path / "proto"
    main(["mia", "--method", "fedproto", *TINY, "--rounds", "1", "--reference-runs", "2", "--attacks", "loss,update",
          "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"]["personal"]["available"]
    assert not summary["targets"]["global"]["available"] and "no model weights" in summary["targets"]["global"]["note"]
    assert not summary["targets"]["upload"]["available"]

    out = tmp_path / "dp"
    main(["mia", "--method", "fedper", *TINY, "--rounds", "1", "--reference-runs", "2", "--attacks", "loss,lira",
          "--dp", "1.0", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp"]["epsilon_accounted_max"] > 0
    assert "probe" not in json.dumps(summary["targets"]["personal"])
    assert "linear head" in summary["targets"]["global"]["note"]  # FedPer's server holds a base only
    eps = summary["targets"]["personal"]["attacks"]["loss"]["empirical_epsilon"]
    assert 0 <= eps["epsilon_lower_bound"] <= summary["dp"]["epsilon_accounted_max"]


def test_dp_statistics_flags_reach_every_run(tmp_path):
    """``mia --dp`` on a method that releases statistics: --stat-noise-multiplier is the statistics
    mechanism's σ in every run (recorded in the summary), and more noise there spends less ε."""
    eps = {}
    for sigma_stat in (1.0, 4.0):
        out = tmp_path / f"stat-{sigma_stat:g}"
        main(["mia", "--method", "fedproto", *TINY, "--rounds", "1", "--reference-runs", "2", "--attacks", "loss",
              "--dp", "1.0", "--stat-noise-multiplier", str(sigma_stat), "--out", str(out)])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["dp"]["statistics_noise_multiplier"] == sigma_stat and summary["dp"]["counts"] == "noised"
        eps[sigma_stat] = summary["dp"]["epsilon_accounted_max"]
    assert 0 < eps[4.0] < eps[1.0]


@pytest.mark.parametrize("args, fragment", [
    (["--stat-noise-multiplier", "4"], "--stat-noise-multiplier needs --dp"),
    (["--reference-runs", "3"], "--reference-runs must be an even number"),
    (["--reference-runs", "0"], "--reference-runs must be an even number"),
    (["--attacks", "loss,bogus"], "unknown attack(s) bogus"),
    (["--gamma", "0"], "--gamma"),
    (["--temperature", "-1"], "--temperature"),
    (["--offline-a", "2"], "--offline-a"),
    (["--offline-a", "tune", "--reference-runs", "2"], "--offline-a tune needs --reference-runs >= 4"),
    (["--dp", "-1"], "--dp must be at least 0"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--bootstrap", "5"], "--bootstrap"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, args, fragment):
    out = tmp_path / "mia"
    code, captured = run_cli(["mia", "--dataset", "digits", "--clients", "3", *args, "--out", str(out)], capsys)
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], captured.err
    assert not out.exists()


def test_parse_attacks_keeps_order_and_drops_duplicates():
    assert parse_attacks("rmia, loss,rmia") == ("rmia", "loss")
    MiaSettings().validate()


def test_rendering_escapes_every_string_and_shows_refusals_and_missing_models():
    from reports.mia import html_table, markdown_table, method_rows, summary_rows

    summary = {"method": "<b>fedx</b>", "target_accuracy": 0.9, "dp": {"noise_multiplier": 1.0,
                                                                       "epsilon_accounted_max": 7.5},
               "targets": {
                   "personal": {"available": True, "attacks": {"lira": {
                       "auc": 0.61, "auc_ci": [0.58, 0.64], "tpr_at_1pct_fpr": 0.05, "tpr_at_1pct_fpr_ci": [0.03, 0.07],
                       "tpr_at_0_1pct_fpr": "not reported: TPR at 0.1% FPR needs at least 10000 non-members; x",
                       "n_members": 10, "n_nonmembers": 5, "empirical_epsilon": {"epsilon_lower_bound": 0.2,
                                                                                  "delta": 1e-5}}}},
                   "global": {"available": False, "note": "the server holds <no> model weights"}}}
    rows = summary_rows(summary)
    assert rows[0]["AUC [95% CI]"] == "0.610 [0.580, 0.640]" and rows[0]["TPR@0.1%FPR"].startswith("not reported")
    page = html_table(rows)
    assert "<b>fedx" not in page and "&lt;b&gt;fedx&lt;/b&gt;" in page and "&lt;no&gt;" in page
    row = method_rows([summary])[0]
    assert row["personal TPR@1%FPR"] == "0.050 [0.030, 0.070]" and row["global AUC"] == "—"
    assert row["empirical ε ≥ (personal)"] == "0.200" and row["accounted ε"] == "7.5"
    assert markdown_table(rows).count("\n") == len(rows) + 1
