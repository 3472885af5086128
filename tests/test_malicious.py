"""A malicious server: the crafting interceptor, the exact readout of a binned layer, the
methods' declarations and the client-side download check."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import attacks
from attacks.malicious import craft, match_inputs, not_reachable, recover_inputs, true_inputs
from fedecouple.channel import Download, Recorder, ServerChannel
from fedecouple.data.partition import make_partition
from fedecouple.methods import make_method
from fedecouple.models import get_params
from defenses.download_check import inspect
from fedsec.malicious import MaliciousServer
from helpers import digits_model, model_factory


def test_interceptor_rewrites_only_the_attacked_download_and_the_recorder_keeps_the_honest_one():
    data, model = digits_model()
    honest = get_params(model)
    server = MaliciousServer(attacks.get("binning"), "binning", {(1, 2)}, model_factory(model), data.images[:200],
                             ("extractor", "classifier"))
    channel = ServerChannel([server], recorder=Recorder())
    received = {(r, c): channel.download(Download(r, c, honest)) for r in (0, 1) for c in range(4)}
    for (r, c), down in received.items():
        same = all(torch.equal(down.tensors[k], honest[k]) for k in honest)
        assert same == ((r, c) != (1, 2))
        assert all(torch.equal(channel.recorder.get(r, c).download.tensors[k], honest[k]) for k in honest)
    assert not torch.equal(received[(1, 2)].tensors["extractor.fc.weight"], honest["extractor.fc.weight"])
    assert set(server.records) == {(1, 2)}


def _one_sgd_step(model, tensors, images, labels, lr=0.05):
    own = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in tensors.items():
            if k in own:
                own[k].copy_(v)
    loss = F.cross_entropy(model(images), labels)
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return get_params(model)


def test_an_input_alone_in_its_bin_is_recovered_exactly():
    data, model = digits_model()
    make = model_factory(model)
    sent, record = craft("binning", get_params(model), make(), data.images[100:600], ("extractor", "classifier"))
    images, labels = data.images[:4], data.labels[:4]
    upload = _one_sgd_step(make(), sent, images, labels)
    truths = true_inputs(make(), record, images)
    thresholds = -record.sent["extractor.fc.bias"].double()
    bins = torch.bucketize(truths.double() @ record.sent["extractor.fc.weight"][0].double(), thresholds)
    # bin k lies between thresholds k-1 and k: below the first nothing fires, above the last only the top row
    alone = [j for j in range(4) if int((bins == bins[j]).sum()) == 1 and 1 <= int(bins[j]) < len(thresholds)]
    assert alone, "the test needs an input alone in its bin"
    _, errors = match_inputs(recover_inputs(record, upload), truths)
    assert all(errors[j] <= 1e-3 for j in alone)
    honest_upload = _one_sgd_step(make(), get_params(model), images, labels)  # without the craft: nothing exact
    record_honest = type(record)(record.craft, record.layer, get_params(model), record.signs, record.thresholds)
    _, honest_errors = match_inputs(recover_inputs(record_honest, honest_upload), truths)
    assert not np.all(honest_errors <= 1e-3)


def test_methods_declare_what_a_crafted_download_reaches():
    _, model = digits_model()
    assert make_method("fedavg").download_reaches == ("extractor", "classifier")
    assert not_reachable(make_method("fedper"), model) is None
    reason = not_reachable(make_method("fedproto"), model)
    assert reason is not None and "fedproto" in reason


def test_the_download_check_refuses_crafted_downloads_and_passes_an_honest_one():
    data, model = digits_model()
    make = model_factory(model)
    honest = get_params(model)
    own = data.images[600:650]
    reasons, _ = inspect(honest, None, make(), own)
    assert reasons == []
    for kind in ("binning", "plain"):
        crafted, _ = craft(kind, honest, make(), data.images[100:600], ("extractor", "classifier"))
        reasons, _ = inspect(crafted, honest, make(), own)
        assert reasons, kind


def test_samples_per_client_caps_every_clients_training_set_outside_weak():
    labels = np.repeat(np.arange(10), 60)
    part = make_partition(labels, 5, "pathological", num_classes=10, classes_per_client=2, samples_per_client=10)
    assert all(len(t) == 10 for t in part.train)
    whole = make_partition(labels, 5, "pathological", num_classes=10, classes_per_client=2)
    assert all(len(t) > 10 for t in whole.train)


def test_defend_download_check_reports_detections_and_false_alarms(tmp_path):
    from fedsec.jobs.defend import DefendSettings, defend
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=4, rounds=2, samples_per_client=10, threads=1)
    settings = DefendSettings(defense="download-check", values=["on"], attacks=["trap"], targets=2, iterations=2)
    frame = defend(config, settings, tmp_path, progress=False)
    on = frame[frame["value"] == "on"].iloc[0]
    assert on["detection_rate_trap"] == 1.0
    assert on["false_alarm_rate"] == 0.0
    assert "false alarms" in (tmp_path / "tradeoff.md").read_text(encoding="utf-8")


def test_fedsec_attack_trap_recovers_the_inputs_of_real_local_training_and_keeps_the_honest_record(tmp_path):
    import pandas as pd

    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.recording import recording_federation
    from fedsec.runner import RunConfig, prepare

    config = RunConfig.of(method="fedavg", dataset="digits", clients=4, rounds=1, samples_per_client=6, threads=1)
    settings = AttackSettings(attack="trap", targets=2, iterations=3)
    summary = run_attack(config, settings, out=tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "attack.csv")
    assert len(rows) == 12 and "input_error" in rows  # every image of both clients, one step each
    assert summary["inputs_exact_share"] >= 0.5
    assert summary["threat_model"]["server"].startswith("malicious")
    # the recorder keeps what an honest server sends; the attacked clients got the crafted weights
    fed, run, targets = recording_federation(prepare(config.updated(rounds=1)), settings.resolved(0, 1))
    fed.run(1)
    for c in targets[0]:
        honest = run.recorder.get(0, c).download.tensors["extractor.fc.weight"]
        assert torch.equal(honest, fed.initial_params["extractor.fc.weight"])
        assert not torch.equal(run.crafted[(0, c)].sent["extractor.fc.weight"], honest)
    fed.close()
