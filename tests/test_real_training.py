"""Real local training: a client's number of training images (``--train-images``), the
forward-model check on shuffled epochs, and the FedAvg leakage attack of Dimitrov et al. 2022."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedecouple.data import make_partition
from fedecouple.errors import UserError

from helpers import TEST_THREADS


# ------------------------------------------------------------------------------------------------
# --train-images: one meaning on every partition


@pytest.mark.parametrize("scheme", ["iid", "pathological", "weak", "dirichlet"])
def test_train_images_gives_every_client_exactly_that_many_training_images(scheme):
    labels = np.repeat(np.arange(10), 200)
    part = make_partition(labels, 5, scheme, num_classes=10, classes_per_client=2, beta=1.0, train_images=7)
    assert [len(t) for t in part.train] == [7] * 5
    assert all(len(t) > 0 for t in part.test)  # the test split is kept
    whole = make_partition(labels, 5, scheme, num_classes=10, classes_per_client=2, beta=1.0)
    assert all(len(t) > 7 for t in whole.train)


def test_train_images_refuses_a_client_that_holds_fewer():
    labels = np.repeat(np.arange(10), 200)
    with pytest.raises(UserError, match=r"train_images 9: client \d+ has only \d+ training images.*"
                                        r"raise samples_per_client"):
        make_partition(labels, 5, "weak", num_classes=10, samples_per_client=8, train_images=9)


def test_samples_per_client_keeps_its_meaning_for_weak_and_is_the_older_name_outside_it():
    labels = np.repeat(np.arange(10), 200)
    weak = make_partition(labels, 5, "weak", num_classes=10, samples_per_client=12)
    assert [len(a) + len(b) for a, b in zip(weak.train, weak.test)] == [12] * 5  # train + test
    older = make_partition(labels, 5, "iid", num_classes=10, samples_per_client=6)
    newer = make_partition(labels, 5, "iid", num_classes=10, train_images=6)
    assert all(np.array_equal(a, b) for a, b in zip(older.train, newer.train))


def test_samples_per_client_outside_weak_still_caps_at_most():
    """Outside ``weak`` the older option caps (a client holding fewer keeps what it has, as before
    --train-images existed); --train-images asks for exactly N and refuses a short client."""
    labels = np.repeat(np.arange(10), 20)
    capped = make_partition(labels, 4, "dirichlet", num_classes=10, beta=0.1, samples_per_client=40)
    sizes = [len(t) for t in capped.train]
    assert max(sizes) == 40 and min(sizes) < 40
    with pytest.raises(UserError, match="train_images 40: client"):
        make_partition(labels, 4, "dirichlet", num_classes=10, beta=0.1, train_images=40)


def test_both_size_options_outside_weak_are_one_line_exit_2(tmp_path, capsys):
    from fedsec.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--train-images", "5",
              "--samples-per-client", "5", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--train-images" in err[0], err
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# the forward-model check on real local training


def test_the_truth_is_scored_in_its_true_batches_when_the_slots_are_as_many_as_the_images():
    """One epoch of 6 images in batches of 2: the attack's 6 slots are the places of the client's
    shuffle, not its images in their own order. Scored in its own order the truth matched the upload
    worse than a poor reconstruction (objective 0.23 against 0.08: MIS-SPECIFIED)."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=4, rounds=1, train_images=6, batch_size=2,
                          threads=TEST_THREADS)
    summary = run_attack(config, AttackSettings(attack="ig", victim_batch=0, targets=2, iterations=2, restarts=1),
                         progress=False)
    for target in summary["per_target"]:
        assert target["replay_cosine"] > 0.99999
        assert target["objective_truth"] < 1e-4 < target["objective_reconstruction"]
        assert target["mis_specified"] is False


def test_the_truth_is_scored_when_the_client_holds_fewer_images_than_a_batch():
    """4 training images in batches of 10: one step of 4. The check laid the plain replay's step out
    as 10 slots, found it did not match the client's batch of 4 and gave no verdict (the N = 4 cells
    of the client-size curve had no forward check)."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=4, rounds=1, train_images=4, batch_size=10,
                          threads=TEST_THREADS)
    summary = run_attack(config, AttackSettings(attack="fedavg-leak", victim_batch=0, targets=2, iterations=2,
                                                restarts=1), progress=False)
    assert summary["mis_specified_targets"] == 0
    for target in summary["per_target"]:
        assert target["objective_truth"] < 1e-6 < target["objective_reconstruction"]


# ------------------------------------------------------------------------------------------------
# the FedAvg leakage attack (Dimitrov et al. 2022): attacks/inversion/fedavg_leakage.py


def test_the_epoch_order_term_is_zero_exactly_when_the_copies_hold_the_same_images():
    from attacks.inversion.fedavg_leakage import epoch_order_term

    gen = torch.Generator().manual_seed(0)
    images = torch.rand(5, 1, 8, 8, generator=gen)
    agree = torch.cat([images, images[torch.tensor([3, 0, 4, 1, 2])], images[torch.tensor([1, 2, 3, 4, 0])]])
    assert float(epoch_order_term(agree, 3)) == pytest.approx(0.0, abs=1e-12)
    differ = agree.clone()
    differ[7] = torch.rand(1, 8, 8, generator=gen)
    assert float(epoch_order_term(differ, 3)) > 1e-3
    assert float(epoch_order_term(images, 1)) == 0.0


def test_sinkhorn_labels_hold_the_counts_in_every_epoch_and_the_rounding_keeps_them():
    from attacks.inversion.fedavg_leakage import hard_labels, sinkhorn_labels

    counts = torch.tensor([0, 2, 0, 3, 1, 0, 0, 0, 0, 0])
    logits = torch.randn(12, 10, generator=torch.Generator().manual_seed(1))
    probs = sinkhorn_labels(logits, counts, copies=2)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(12), atol=1e-4, rtol=0)
    for block in probs.reshape(2, 6, 10):
        torch.testing.assert_close(block.sum(dim=0), counts.float(), atol=1e-3, rtol=0)
    labels = hard_labels(probs, counts, copies=2)
    assert all(torch.equal(torch.bincount(b, minlength=10), counts) for b in labels.reshape(2, 6))


def _trained_client(digits, method: str, n: int, batch: int, epochs: int, seed: int = 0):
    """One round of ``method`` on digits with clients of exactly ``n`` training images; the server's view
    of client 0 under the 'hyperparameters known' threat model, and its true training set."""
    import copy

    from attacks.base import LocalHyperparameters
    from attacks.inversion.observation import observe
    from fedecouple.channel import Recorder, ServerChannel
    from fedecouple.engine import Federation, FederationConfig, GroundTruth
    from fedecouple.methods import make_method
    from fedecouple.methods.base import TrainConfig, phase_steps
    from fedecouple.models import set_params

    part = make_partition(digits.labels.numpy(), 3, "iid", seed=seed, train_images=n)
    fed = Federation(make_method(method), digits, part,
                     FederationConfig(rounds=1, seed=seed, train=TrainConfig(lr=0.05, batch_size=batch,
                                                                             local_epochs=epochs)),
                     channel=ServerChannel((), recorder=Recorder()), ground_truth=GroundTruth())
    initial = copy.deepcopy(fed.model)
    set_params(initial, fed.initial_params)
    fed.run(1)
    steps = sum(phase_steps(e, n, batch) for _, e, _ in fed.method.local_phases(epochs))
    hp = LocalHyperparameters(lr=0.05, steps=steps, batch_size=batch, epochs=epochs, samples=n)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=lambda: copy.deepcopy(initial),
                  image_shape=tuple(digits.images.shape[1:]), num_classes=10, known_hyperparameters=hp)
    idx = torch.from_numpy(fed.ground_truth.training_set(0, 0))
    return obs, digits.images[idx], digits.labels[idx], fed.ground_truth.schedule(0, 0)


@pytest.mark.parametrize("n,batch,epochs", [(6, 2, 1), (8, 2, 2), (12, 4, 3)])
def test_label_counts_are_exact_on_a_multi_step_fedavg_client(digits, n, batch, epochs):
    from attacks.inversion.fedavg_leakage import _setup

    torch.set_num_threads(TEST_THREADS)
    obs, _, labels, _ = _trained_client(digits, "fedavg", n, batch, epochs)
    setup = _setup(obs)
    assert setup.matcher.epoch_copies == epochs and setup.slots == n * epochs
    assert setup.counts.tolist() == torch.bincount(labels, minlength=10).tolist()
    assert "interpolated" in setup.trace["closed_form"]["label_counts_source"]


@pytest.mark.parametrize("method", ["fedavg", "fedper", "fedrep", "fedpac", "fedecouple"])
def test_the_attacks_objective_is_zero_at_the_truth_in_its_true_slots(digits, method):
    """The forward model the attack minimises, evaluated at the client's true images in the places of
    its true shuffle (every epoch its own copy; augmented copies at their true draws), with the true
    labels: the data term is float rounding, and the order-invariant term is zero."""
    import torch.nn.functional as F

    from attacks.inversion.fedavg_leakage import _setup, epoch_order_term
    from attacks.inversion.forward_check import matching_term, replay_agreement, slot_positions, true_copies

    torch.set_num_threads(TEST_THREADS)
    obs, images, labels, records = _trained_client(digits, method, 6, 2, 2)
    assert replay_agreement(obs, images, labels, records)["replay_cosine"] >= 0.99999
    setup = _setup(obs)
    where = slot_positions(setup.matcher, len(images), records)
    index = torch.tensor(where)
    truth = matching_term(setup.matcher, "cosine", images[index], F.one_hot(labels[index], 10).float(),
                          copies=true_copies(setup.matcher, images, records, where))
    assert truth < 1e-4, (method, truth)
    assert float(epoch_order_term(images[index], setup.matcher.epoch_copies)) == 0.0
    other = images[index].flip(-1)  # other images with the same labels in the same places
    assert matching_term(setup.matcher, "cosine", other, F.one_hot(labels[index], 10).float(),
                         copies=true_copies(setup.matcher, images.flip(-1), records, where)) > 1e-3


# ------------------------------------------------------------------------------------------------
# leakage vs client size: the report's pure functions (reports/client_size.py)


def test_the_largest_exposed_size_is_the_largest_n_whose_interval_clears_the_prior():
    from reports.client_size import client_size_figure, client_size_table, largest_exposed

    rows = [{"method": "fedavg", "attack": "fedavg-leak", "train_images": n, "mean_psnr": m, "mean_psnr_low": lo,
             "mean_psnr_high": hi, "prior_psnr": 11.5, "success_rate": 0.5, "n_images": 8, "n_targets": 4,
             "seconds": 1.0}
            for n, m, lo, hi in [(4, 25.0, 20.0, 30.0), (10, 14.0, 12.0, 16.0), (25, 12.0, 10.0, 14.0)]]
    rows.append({"method": "fedproto", "attack": "proto", "train_images": 4, "mean_psnr": 12.0, "mean_psnr_low": 11.0,
                 "mean_psnr_high": 13.0, "prior_psnr": 11.5, "success_rate": 0.0, "n_images": 4, "n_targets": 4,
                 "seconds": 1.0})
    assert largest_exposed(rows) == {"fedavg": 10, "fedproto": None}
    table = client_size_table(rows + [{"method": "fedpac", "train_images": 180, "note": "not run (time)"}])
    assert "| fedavg | fedavg-leak | 10 | 14.00 [12.00, 16.00] | 11.50 | 50 % |" in table
    assert "fedavg: exposed up to N = 10" in table and "not run (time)" in table
    assert "| default | 1 | not recorded / not recorded |" in table  # no budget, no forward check recorded
    assert "| 8 (4) | 300 | 1 |" in client_size_table([dict(rows[0], iterations=300)])  # a cut budget is shown
    assert "| 8 (4) | 200 × 1 start | 1 |" in client_size_table([dict(rows[0], iterations=200, restarts=1)])
    checked = client_size_table([dict(rows[0], mis_specified_targets=0, not_converged_targets=4)])
    assert checked.splitlines()[2].endswith("| 0 / 4 |")  # a lower bound on all 4 targets
    assert client_size_figure(rows).startswith(b"\x89PNG")
    zero_prior = dict(rows[0], prior_psnr=0.0)  # a measured 0.0 is a number, not "missing"
    assert "| 0.00 |" in client_size_table([zero_prior])


# ------------------------------------------------------------------------------------------------
# the layer-input solve (attacks/inversion/disaggregation.py)


def test_label_splits_lists_every_distinct_assignment_of_the_counts_to_the_steps():
    from attacks.inversion.disaggregation import label_splits

    counts = torch.tensor([2, 1, 1])  # classes 0, 0, 1, 2 in two steps of two
    assert label_splits(counts, 2, 2) == [[0, 0, 1, 2], [0, 1, 0, 2], [0, 2, 0, 1], [1, 2, 0, 0]]
    assert label_splits(torch.tensor([4]), 1, 4) == [[0, 0, 0, 0]]
    assert label_splits(torch.tensor([1] * 8), 4, 2, limit=100) is None  # 2520 splits
    # 100 images in 10 steps of 10 (the client-size curve's N = 100): too many splits, said at once. The
    # split search once listed a step's C(100, 10) batches before the first split and never returned
    assert label_splits(torch.tensor([10] * 10), 10, 10) is None
    assert label_splits(torch.tensor([18] * 10), 18, 10) is None
    assert label_splits(torch.tensor([100] + [0] * 9), 10, 10) == [[0] * 100]


def test_the_layer_inputs_of_a_multi_step_client_are_solved_at_their_steps_weights(digits):
    """FedAvg, 4 images in two SGD steps of 2: the solve finds which labels went to which step and each
    image's input at the extractor's last linear layer under the weights of the step that used it."""
    from attacks.inversion.disaggregation import layer_inputs
    from attacks.inversion.fedavg_leakage import _setup
    from attacks.inversion.forward_check import slot_positions

    torch.set_num_threads(TEST_THREADS)
    obs, images, labels, records = _trained_client(digits, "fedavg", 4, 2, 1)
    setup = _setup(obs)
    layer = setup.layer
    assert layer is not None and setup.trace["closed_form"]["layer_inputs"]["solved"]
    index = torch.tensor(slot_positions(setup.matcher, len(images), records))
    _, states = setup.matcher.replay_states(images[index], labels[index])
    for t, params in enumerate(states):
        rows = slice(2 * t, 2 * t + 2)
        assert sorted(layer.labels[rows].tolist()) == sorted(labels[index][rows].tolist())
        truth = layer_inputs(setup.matcher, layer, params, images[index][rows])
        error = torch.cdist(layer.inputs[rows].double(), truth.double()).min(dim=0).values / truth.norm(dim=1)
        assert float(error.max()) < 1e-3, error


def test_fedavg_leak_takes_the_solved_labels_and_polishes_where_the_layer_inputs_are_solved(digits, monkeypatch):
    """The attack on the 4-image client: its labels are the true ones (from the solve, not the optimiser),
    the trace records the solve and the final stage, and the rebuilt images are in [0, 1]."""
    import attacks.inversion.fedavg_leakage as leakage
    from attacks.base import Budget
    from attacks.inversion.fedavg_leakage import _attack, _setup

    torch.set_num_threads(TEST_THREADS)
    monkeypatch.setattr(leakage, "START_ITERATIONS", 20)  # the start's inversion: short (its result is not asserted)
    obs, images, labels, records = _trained_client(digits, "fedavg", 4, 2, 1)
    result = _attack(_setup(obs), Budget(iterations=80, restarts=1), seed=0)
    assert sorted(result.labels.tolist()) == sorted(labels.tolist())
    assert result.trace["closed_form"]["layer_inputs"]["solved"]
    assert result.trace["final_stage"]["iterations_per_temperature"] == 2
    assert result.images.shape == images.shape and 0.0 <= float(result.images.min()) <= float(result.images.max()) <= 1.0
