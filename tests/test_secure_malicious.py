"""A malicious server through secure aggregation: binning read out of the sum, model inconsistency
isolating one update in it, and the clients' download-consistency check."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import attacks
from attacks.malicious.craft import next_linear
from attacks.inversion.layer_inputs import relative_errors
from attacks.malicious.readout import true_inputs
from attacks.secure import inconsistency, sized_binning, sum_binning
from defenses.consistency_check import ConsistencyCheck
from fedecouple.channel import Interceptor, Recorder, ServerChannel
from fedecouple.data import load_dataset, make_partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth
from fedecouple.errors import UserError
from fedecouple.methods import make_method
from fedecouple.methods.base import TrainConfig
from fedecouple.methods.facets import download_reach
from fedecouple.secure_aggregation import SecureAggregation, weight_factor
from fedsec.malicious import MaliciousServer, public_images

CLIENTS, IMAGES = 6, 5


class Plaintext(Interceptor):
    """Each upload before the protocol masks it (what the test compares the sum with)."""

    def __init__(self):
        self.uploads = {}

    def on_upload(self, message):
        self.uploads[message.client_id] = {k: v.clone() for k, v in message.tensors.items()}
        return message


def federation(spec, craft, checks=(), protocol=None, seed=0):
    """One FedAvg round on digits, clients of one batch of IMAGES, under ``protocol`` (default:
    SecAgg at its defaults), every participant's download crafted by ``spec`` (None: honest)."""
    data = load_dataset("digits")
    part = make_partition(data.labels.numpy(), CLIENTS, "iid", train_images=IMAGES, seed=seed)
    protocol = protocol or SecureAggregation()
    plain = Plaintext()
    train = TrainConfig(lr=0.05, batch_size=IMAGES, local_epochs=1)
    channel = ServerChannel([plain], recorder=Recorder(), secure=protocol)
    fed = Federation(make_method("fedavg"), data, part, FederationConfig(rounds=1, seed=seed, train=train),
                     channel=channel, ground_truth=GroundTruth())
    initial = copy.deepcopy(fed.model)
    server = None
    if spec is not None:
        server = MaliciousServer(spec, craft, {(0, c) for c in fed.sample_clients(0)}, lambda: copy.deepcopy(initial),
                                 public_images(data.images, np.concatenate(part.train), seed),
                                 download_reach(fed.method), seed, method=fed.method, train=train, secure=protocol)
        channel.interceptors.append(server)
    channel.interceptors.extend(checks)
    fed.run_round()
    return fed, server, plain, lambda: copy.deepcopy(initial)


def client_images(fed, clients):
    return torch.cat([fed.dataset.images[torch.from_numpy(fed.ground_truth.samples(0, c))] for c in clients])


def test_binning_through_the_sum_reads_an_input_exactly_where_the_per_client_craft_drowns():
    fed, server, _, make = federation(sum_binning.SPEC, "binning")
    aggregate = fed.channel.recorder.aggregates[0]
    assert aggregate.clipped == 0
    record = server.records[(0, 0)]
    truths = true_inputs(make(), record, client_images(fed, range(CLIENTS)))
    candidates = sized_binning.read_sum(record, aggregate.total, error=len(aggregate.survivors) * aggregate.quantum)
    exact = relative_errors(candidates, truths).min(0).values <= 1e-3
    assert int(exact.sum()) >= 1
    # the per-client craft's update lies below one quantisation step of the protocol: nothing reads exactly
    fed, server, _, make = federation(attacks.get("binning"), "binning")
    record = server.records[(0, 0)]
    truths = true_inputs(make(), record, client_images(fed, range(CLIENTS)))
    candidates = sized_binning.read_sum(record, fed.channel.recorder.aggregates[0].total)
    assert len(candidates) == 0 or not bool((relative_errors(candidates, truths).min(0).values <= 1e-3).any())


def test_inconsistency_leaves_only_the_targets_update_in_the_attacked_layer_of_the_sum():
    fed, server, plain, make = federation(inconsistency.SPEC, "isolate")
    aggregate = fed.channel.recorder.aggregates[0]
    target, record = inconsistency.target_record({c: r for (_, c), r in server.records.items()})
    protocol = fed.channel.secure
    # the target's weight as the protocol sends it: Flower's factor round(n / W · Q), over Q
    n = int(plain.uploads[target]["sample_count"])
    layer, w = record.layer, weight_factor(protocol, n / protocol.max_weight) / protocol.quantization_range
    for client, upload in plain.uploads.items():
        if client != target:  # a silenced client's attacked layer never leaves zero
            assert not upload[f"{layer}.weight"].any() and not upload[f"{layer}.bias"].any()
    bound = len(aggregate.survivors) * aggregate.quantum
    for name in (f"{layer}.weight", f"{layer}.bias"):
        alone = w * plain.uploads[target][name].double()
        assert float((aggregate.total[name] - alone).abs().max()) <= bound
    following = next_linear(make(), layer)
    inputs, weight = inconsistency.read_isolated(record, aggregate.total, following, bound)
    assert weight == pytest.approx(w, rel=1e-3)
    truths = true_inputs(make(), record, client_images(fed, [target]))
    assert bool((relative_errors(inputs, truths).min(0).values <= 1e-3).any())
    # the target's sample count travels in the clear (Flower's SecAgg+): its weight is read there, exactly
    assert aggregate.clear[target] == {"sample_count": n}
    assert inconsistency.clear_weight(SimpleNamespace(clear=aggregate.clear, protocol=protocol), target) == w
    inputs, weight = inconsistency.read_isolated(record, aggregate.total, following, bound, w)
    assert weight == w and bool((relative_errors(inputs, truths).min(0).values <= 1e-3).any())


def test_the_consistency_check_flags_an_inconsistent_round_and_passes_a_consistent_one():
    check = ConsistencyCheck(SecureAggregation())
    fed, server, _, _ = federation(inconsistency.SPEC, "isolate", checks=[check])
    target, _ = inconsistency.target_record({c: r for (_, c), r in server.records.items()})
    assert check.flagged_rounds() == {0}
    aggregate = fed.channel.recorder.aggregates[0]
    assert target not in aggregate.survivors and target in check.withheld(0)
    honest = ConsistencyCheck(SecureAggregation())
    fed, _, _, _ = federation(None, None, checks=[honest])
    assert honest.flagged_rounds() == set() and honest.summary(set())["false_alarm_rate"] == 0.0
    assert len(fed.channel.recorder.aggregates[0].survivors) == CLIENTS


def test_the_consistency_check_needs_secure_aggregation():
    with pytest.raises(UserError, match="--secure-aggregation"):
        ConsistencyCheck(None)
