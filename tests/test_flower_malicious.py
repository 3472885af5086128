"""fedsec.flower.malicious_workflow and fedsec.flower.secagg_defences: a SecAgg+ server that deviates from the
protocol, against Flower's own secaggplus_mod, and the client mods that stop it.

Most tests drive one SecAgg+ round in this process (``run_in_process``: Flower's real workflow and client
mods on a LocalGrid, a fixed update per node; about 0.1 s each). Two run the example app
(examples/flower_secagg) in Flower's simulation engine through the command line, 4 nodes and 1 round in
the textbook setting (one SGD step on one image): the deviating server recovers every node's update, then
a short image attack on it; and the same run with the signed-consistency mod recovers nothing. 10 to 20 s
each on a shared 2-core machine, mostly Ray's start-up; the whole file about 25 s.
"""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is first imported: no network calls
pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install -e '.[flower]'")
pytestmark = pytest.mark.usefixtures("shared_ray")  # simulations share one Ray instance and its actors
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.server.workflow import SecAggPlusWorkflow  # noqa: E402

from fedsec.cli import main  # noqa: E402
from fedsec.flower.malicious_workflow import (AttackPlan, MaliciousSecAggPlusWorkflow,  # noqa: E402
                                              SybilMod, decode_update, mask_seed32, mask_seed_evidence, max_error,
                                              pairwise_mask, recover_secret, relative_error, run_in_process,
                                              search_mask_seed, unmask_vector, update_bound)
from fedsec.flower.secagg_defences import (ConsistencyCheckedSecAggPlusWorkflow, KeyDirectory,  # noqa: E402
                                           SignedConsistency, UnmaskListCheck, unmask_list_problem)
from helpers import TEST_THREADS  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_secagg"
MODULUS = 2 ** 32


# -- the arithmetic, no protocol run ------------------------------------------------------------------
def test_the_mask_generator_folds_its_seed_to_32_bits():
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    seed = bytes(range(32))
    twin = bytearray(seed)
    for i in range(4):  # the same flip in two words cancels in the fold
        twin[i] ^= 0xA5
        twin[8 + i] ^= 0xA5
    assert bytes(twin) != seed and mask_seed32(bytes(twin)) == mask_seed32(seed)
    first, second = pseudo_rand_gen(seed, MODULUS, [(32,)]), pseudo_rand_gen(bytes(twin), MODULUS, [(32,)])
    assert np.array_equal(first[0], second[0])
    # the self mask's first value (what a server reads once it knows the node's weight and pairwise masks)
    # gives the seed back by search; here over 3000 candidates instead of 2**32
    value = int(np.random.RandomState(2718).randint(0, MODULUS - 1))
    assert search_mask_seed(value, MODULUS, range(3000)) == 2718
    evidence = mask_seed_evidence(trials=500)
    assert evidence["different_seeds_same_mask"] is True and evidence["seed_bits"] == 32
    assert evidence["core_hours_for_every_seed"] > 0 and any("seed32" in line for line in evidence["source"])


def _masked_by_flower(update, num_examples=30, max_weight=100.0, clipping=8.0, steps=2 ** 22):
    """One node's masked vector as Flower's ``_collect_masked_vectors`` builds it, with one neighbour; returns
    (masked, the node's self-mask seed, its secret key, its node id, the neighbour's public key and id)."""
    import importlib

    from flwr.common import ndarrays_to_parameters
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt, generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
    from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key, generate_key_pairs,
                                                      private_key_to_bytes, public_key_to_bytes)

    module = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the module, not the mod
    keys = {node: [generate_key_pairs(), generate_key_pairs()] for node in (7, 3)}
    pem = {node: [(private_key_to_bytes(sk), public_key_to_bytes(pk)) for sk, pk in pairs]
           for node, pairs in keys.items()}
    state = module.SecAggPlusState(nid=7, threshold=1, max_weight=max_weight, target_range=steps,
                                   clipping_range=clipping, mod_range=MODULUS, rd_seed=os.urandom(32),
                                   sk1=pem[7][0][0], public_keys_dict={3: (pem[3][0][1], pem[3][1][1])})
    state.ss2_dict = {3: generate_shared_key(bytes_to_private_key(pem[7][1][0]), bytes_to_public_key(pem[3][1][1]))}
    state.rd_seed_share_dict, state.sk1_share_dict = {}, {}
    ciphertext = encrypt(state.ss2_dict[3], share_keys_plaintext_concat(3, 7, b"s" * 20, b"k" * 20))
    configs = {Key.CIPHERTEXT_LIST: [ciphertext], Key.SOURCE_LIST: [3]}
    np.random.seed(0)
    reply = module._collect_masked_vectors(state, configs, num_examples, ndarrays_to_parameters(update))
    from flwr.common import bytes_to_ndarray

    masked = [bytes_to_ndarray(b) for b in reply[Key.MASKED_PARAMETERS]]
    return masked, state.rd_seed, pem[7][0][0], 7, pem[3][0][1], 3


def test_unmasking_inverts_flowers_masking_within_the_quantisation_bound():
    rng = np.random.default_rng(1)
    update = [rng.uniform(-1, 1, (5, 3)).astype(np.float32), rng.uniform(-1, 1, 4).astype(np.float32)]
    masked, seed, sk1, node, neighbour_pk1, neighbour = _masked_by_flower(update)
    shapes = [a.shape for a in masked]
    pairwise = pairwise_mask(sk1, node, neighbour_pk1, neighbour, MODULUS, shapes)
    weight, recovered = decode_update(unmask_vector(masked, seed, [pairwise], MODULUS), 8.0, 2 ** 22)
    assert weight == round(30 / 100.0 * 2 ** 22)  # the clear num_examples gives the weight back
    bound = update_bound(8.0, 2 ** 22, weight)
    assert bound == pytest.approx((16 / 2 ** 22 + 8 * 2 ** -22) * 2 ** 22 / weight)
    assert max_error(recovered, update) <= bound and relative_error(recovered, update) < 1e-4
    # without the pairwise mask the vector stays masked: its weight is noise
    stale = unmask_vector(masked, seed, [], MODULUS)
    assert int(stale[0][0]) != weight


def test_a_secret_needs_its_threshold_of_shares():
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    secret = os.urandom(32)
    shares = create_shares(secret, 2, 3)
    assert recover_secret(shares[:2], 2) == secret and recover_secret(shares[1:], 2) == secret
    assert recover_secret(shares[:1], 2) is None


def test_the_unmask_lists_are_checked_against_what_the_node_saw():
    assert unmask_list_problem(5, [6, 7], [5, 6, 7], []) is None
    assert unmask_list_problem(5, [6, 7], [5, 6], [7]) is None  # 7 dropped after sending its key shares
    assert "listed both as surviving and as dropped" in unmask_list_problem(5, [6, 7], [5, 6, 7], [7])
    assert "this node is listed as dropped" in unmask_list_problem(5, [6, 7], [6, 7], [5])
    assert "they name 9" in unmask_list_problem(5, [6, 7], [5, 6, 7, 9], [])
    assert "they omit 7" in unmask_list_problem(5, [6, 7], [5, 6], [])
    assert "without a masking stage" in unmask_list_problem(5, None, [5], [])


def test_the_key_directory_keeps_the_first_key_of_a_node(tmp_path):
    directory = KeyDirectory(tmp_path)
    directory.publish(12, b"first")
    directory.publish(12, b"first")
    with pytest.raises(ValueError, match="already registered"):
        directory.publish(12, b"second")
    assert directory.lookup(12) == b"first" and directory.lookup(13) is None and directory.roster() == [12]


# -- one round in this process: each attack against each defence --------------------------------------
DEFENSES = {"none": lambda folder: [],
            "unmask-check": lambda folder: [UnmaskListCheck()],
            "signed-consistency": lambda folder: [SignedConsistency(KeyDirectory(folder))]}


def _attack(attack, defense, folder, *, nodes=4, shares=3, threshold=2, sybils=0):
    """One round of ``attack`` against nodes behind ``defense`` (the last ``sybils`` nodes the server's)."""
    plan = AttackPlan(attack, rounds=(1,), sybils={1: sybils})
    workflow = MaliciousSecAggPlusWorkflow(shares, threshold, plan=plan, max_weight=100.0,
                                           signed_rounds=defense == "signed-consistency")
    sybil = [SybilMod(range(nodes - sybils, nodes))] if sybils else []
    mods = DEFENSES[defense](folder)
    run = run_in_process(workflow, lambda i: sybil + mods + [secaggplus_mod], nodes=nodes)
    report = workflow.reports[0]
    for target, outcome in report.targets.items():
        if outcome.vector is not None:
            weight, recovered = decode_update(outcome.vector, workflow.clipping_range, workflow.quantization_range)
            assert max_error(recovered, run.updates[target]) <= update_bound(workflow.clipping_range,
                                                                             workflow.quantization_range, weight)
    return run, report


def _average_is_right(run):
    mean = [np.mean([u[i] for u in run.updates.values()], axis=0) for i in range(2)]
    return run.average is not None and all(np.allclose(a, m, atol=1e-4) for a, m in zip(run.average, mean))


@pytest.mark.parametrize("defense,recovered,completed", [("none", 4, True), ("unmask-check", 0, False),
                                                         ("signed-consistency", 0, False)])
def test_unmask_dropout_unmasks_every_node_unless_the_lists_are_checked(tmp_path, defense, recovered, completed):
    run, report = _attack("unmask-dropout", defense, tmp_path)
    assert len(report.recovered) == recovered and report.completed is completed
    if defense == "none":
        assert _average_is_right(run) and not report.refused  # the round trains on as if nothing happened
        assert all(o.seed_shares == 3 and o.key_shares == 3 for o in report.targets.values())
    else:
        assert len(report.refused) == 4
        assert all("refused by fedsec's client check" in r for r in report.refused.values())
        assert run.average is None  # SecAgg+ halted: the strategy received nothing


@pytest.mark.parametrize("defense,recovered", [("unmask-check", 1), ("signed-consistency", 0)])
def test_a_split_view_passes_the_per_node_check_not_the_signed_round(tmp_path, defense, recovered):
    # every node holds shares of every other (5 shares of 5 nodes), 2 of them unmask: two disjoint groups fit
    run, report = _attack("split-view", defense, tmp_path, nodes=5, shares=5, threshold=2)
    assert len(report.recovered) == recovered
    assert _average_is_right(run)  # the nodes that were shown the true list still complete the sum
    if defense == "signed-consistency":
        assert any("signed the survivor list" in r for r in report.refused.values())


def test_a_split_view_is_infeasible_when_the_threshold_is_a_majority_of_the_shares(tmp_path):
    _, report = _attack("split-view", "unmask-check", tmp_path, nodes=4, shares=3, threshold=2)
    (outcome,) = report.targets.values()
    assert outcome.vector is None and outcome.reason.startswith("split view infeasible")


@pytest.mark.parametrize("defense,recovered", [("none", 4), ("unmask-check", 4), ("signed-consistency", 0)])
def test_key_substitution_is_stopped_only_by_signed_keys(tmp_path, defense, recovered):
    run, report = _attack("key-substitution", defense, tmp_path)
    assert len(report.recovered) == recovered
    if recovered:
        assert report.completed and _average_is_right(run) and not report.refused  # nobody noticed
    else:
        assert all(r.startswith("share_keys: ") and "no valid signature" in r for r in report.refused.values())


@pytest.mark.parametrize("sybils,recovered", [(0, 0), (1, 0), (2, 1)])
def test_sybil_neighbours_unmask_the_target_at_the_threshold_whatever_the_checks(tmp_path, sybils, recovered):
    # 5 nodes, the last 2 the server's; each node's shares are held by itself and 2 neighbours, 2 unmask
    run, report = _attack("sybil", "signed-consistency", tmp_path, nodes=5, sybils=sybils)
    (outcome,) = report.targets.values()
    assert outcome.sybil_neighbours == sybils and len(report.recovered) == recovered
    assert outcome.key_shares == sybils and not report.refused and _average_is_right(run)


def test_the_signed_rounds_leave_an_honest_round_intact_and_need_the_servers_part(tmp_path):
    honest = ConsistencyCheckedSecAggPlusWorkflow(3, 2, max_weight=100.0)
    run = run_in_process(honest, lambda i: [SignedConsistency(KeyDirectory(tmp_path / "a")), secaggplus_mod])
    assert _average_is_right(run)
    # Flower's own workflow skips the signed rounds: the nodes refuse its relayed keys and nothing is summed
    plain = run_in_process(SecAggPlusWorkflow(3, 2, max_weight=100.0),
                           lambda i: [SignedConsistency(KeyDirectory(tmp_path / "b")), secaggplus_mod])
    assert plain.average is None


def test_the_audit_demonstrates_what_the_apps_own_mods_answer(tmp_path):
    from fedsec.flower.harness import secagg_protocol_findings

    import flwr

    findings = {f["code"]: f for f in secagg_protocol_findings(EXAMPLE)}
    unmask, keys, seed = (findings["UNMASK_REQUEST_NOT_CHECKED"], findings["RELAYED_KEYS_NOT_AUTHENTICATED"],
                          findings["MASK_SEED_32_BIT"])
    assert unmask["severity"] == keys["severity"] == "high" and seed["severity"] == "medium"
    for finding in (unmask, keys):
        shown = finding["evidence"]["demonstration"]
        assert shown["recovered"] is True and shown["max_error"] <= shown["bound"]
        assert finding["evidence"]["flwr"] == flwr.__version__
        assert finding["evidence"]["client_mods"] == ["secaggplus_mod"]
    assert seed["evidence"]["different_seeds_same_mask"] is True and f"Flower {flwr.__version__}" in seed["finding"]
    # a copy of the app whose ClientApp checks the unmask lists: that finding turns info, the keys stay open
    app = tmp_path / "checked"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "secagg_mnist").rename(app / "secagg_checked")
    for path in [app / "pyproject.toml", *(app / "secagg_checked").glob("*.py")]:
        path.write_text(path.read_text().replace("secagg_mnist", "secagg_checked"))
    client = app / "secagg_checked" / "client_app.py"
    client.write_text(client.read_text().replace(
        "app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])",
        "from fedsec.flower.secagg_defences import UnmaskListCheck\n\n"
        "app = ClientApp(client_fn=client_fn, mods=[UnmaskListCheck(), secaggplus_mod])"))
    checked = {f["code"]: f for f in secagg_protocol_findings(app)}
    assert checked["UNMASK_REQUEST_CHECKED"]["severity"] == "info"
    assert checked["UNMASK_REQUEST_CHECKED"]["evidence"]["client_mods"] == ["UnmaskListCheck", "secaggplus_mod"]
    assert checked["RELAYED_KEYS_NOT_AUTHENTICATED"]["severity"] == "high"


# -- the command line: one-line refusals before anything runs ----------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["ig", str(EXAMPLE), "--client-defense", "unmask-check"], "--client-defense: only the SecAgg+ server attacks"),
    (["sybil", str(EXAMPLE), "--nodes", "3", "--sybils", "2"], "sybil needs at least --sybils + 2 = 4 nodes"),
    (["unmask-dropout", str(EXAMPLE), "--image-attack", "sum-labels"], "--image-attack sum-labels: the image attack"),
    (["sybil", str(EXAMPLE), "--attack-rounds", "1"], "sybil attacks rounds 0 to --sybils"),
    (["unmask-dropout", str(EXAMPLE.parent / "flower_mnist")], "unmask-dropout attacks Flower's SecAgg+, but"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["flower", "attack", *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and message in err, err


# -- the example app in Flower's simulation engine -----------------------------------------------------------
def _command(tmp_path, *extra):
    out = tmp_path / "out"
    main(["flower", "attack", "unmask-dropout", str(EXAMPLE), "--nodes", "4", "--ray-cpus", "1",
          "--threads", str(TEST_THREADS), "--out", str(out), *extra])
    return out, json.loads((out / "summary.json").read_text())


def test_the_deviating_server_recovers_every_update_in_the_simulation(tmp_path, capsys):
    import pandas as pd

    out, summary = _command(tmp_path, "--iterations", "20")
    rows = pd.read_csv(out / "recovery.csv")
    assert len(rows) == 4 and rows["recovered"].all() and rows["within_bound"].all()
    assert sorted(rows["client"]) == [0, 1, 2, 3]
    assert (rows["seed_shares"] == 3).all() and (rows["key_shares"] == 3).all()
    # one SGD step on one image: w = 1 / max-weight 2000, so the rounding step of w·θ weighs 2000 times in θ
    assert (rows["max_error"] <= rows["bound"]).all() and (rows["relative_error"] < 0.2).all()
    assert summary["rounds_completed"] == [0] and summary["recovered"] == 4 and summary["within_bound"] is True
    images = summary["image_attack"]
    assert images["attack"] == "ig" and images["paired_psnr_difference"]["n_pairs"] == 4
    for name in ("unmasked-update", "plain-update"):
        assert (out / name / "attack.csv").is_file() and (out / name / "reconstructions.png").is_file()
    printed = capsys.readouterr().out
    assert "unmask-dropout (no client defense): the server unmasked 4 of 4 targeted upload(s) in round(s) 0" in printed
    assert "ig on the unmasked updates: mean PSNR" in printed and (out / "config.toml").is_file()


def test_with_the_signed_consistency_mod_the_same_run_recovers_nothing(tmp_path, capsys):
    out, summary = _command(tmp_path, "--client-defense", "signed-consistency", "--image-attack", "none")
    assert summary["recovered"] == 0 and summary["targets"] == 4 and summary["rounds_completed"] == []
    assert summary["protocol"]["signed_rounds"] is True and "image_attack" not in summary
    refusals = summary["refusals"]["0"]
    assert len(refusals) == 4 and all("listed both as surviving and as dropped" in r for r in refusals.values())
    printed = capsys.readouterr().out
    assert "the server unmasked 0 of 4" in printed and "round(s) completed: none (SecAgg+ halted)" in printed
