"""The server channel is the only path from clients to the server, and interceptors act on copies."""
import pytest
import torch

from fedecouple.channel import Download, Interceptor, Recorder, ServerChannel, Upload

from helpers import tiny_federation


class Counter(Interceptor):
    def __init__(self):
        self.uploads, self.downloads = [], []

    def on_download(self, message):
        self.downloads.append((message.round, message.client_id))
        return message

    def on_upload(self, message):
        self.uploads.append((message.round, message.client_id))
        return message


def test_interceptors_see_every_message_exactly_once(digits):
    counter = Counter()
    fed = tiny_federation(digits, clients=3, rounds=2, interceptors=[counter])
    fed.run()
    expected = [(r, c) for r in range(2) for c in range(3)]
    assert counter.uploads == expected and counter.downloads == expected
    assert sorted(fed.channel.recorder.exchanges) == expected


def test_dropping_every_upload_leaves_the_server_unchanged(digits):
    class DropAll(Interceptor):
        def on_upload(self, message):
            return None

    fed = tiny_federation(digits, clients=2, interceptors=[DropAll()])
    before = {k: v.clone() for k, v in fed.server.items()}
    fed.run_round()
    assert all(torch.equal(before[k], fed.server[k]) for k in before)
    assert list(fed.channel.recorder.uploads()) == []


def test_dropped_download_means_the_client_sits_out(digits):
    class DropClient1(Interceptor):
        def on_download(self, message):
            return None if message.client_id == 1 else message

    fed = tiny_federation(digits, clients=2, interceptors=[DropClient1()])
    fed.run_round()
    assert (0, 1) not in fed.ground_truth.batches and (0, 0) in fed.ground_truth.batches


def test_replacing_uploads_changes_what_the_server_aggregates(digits):
    class Zero(Interceptor):
        def on_upload(self, message):
            tensors = {k: (torch.zeros_like(v) if v.is_floating_point() else v) for k, v in message.tensors.items()}
            return Upload(message.round, message.client_id, tensors, message.meta)

    fed = tiny_federation(digits, clients=2, interceptors=[Zero()])
    fed.run_round()
    # all-zero models have cosine 0 with their average: eq. 16 falls back to α and averages zeros
    assert all(float(v.abs().sum()) == 0 for k, v in fed.server.items())


def test_interceptor_mutation_in_place_cannot_reach_client_state(digits):
    class Vandal(Interceptor):
        def on_upload(self, message):
            for t in message.tensors.values():
                if t.is_floating_point():
                    t.fill_(123.0)
            return None  # and then drops it

    fed = tiny_federation(digits, clients=1, interceptors=[Vandal()])
    fed.run_round()
    assert all(float(v.abs().max()) != 123.0 for v in fed.clients[0].values())


def test_later_interceptor_sees_earlier_replacement_and_recorder_sees_final():
    seen = []

    class Double(Interceptor):
        def on_upload(self, message):
            return Upload(message.round, message.client_id, {"w": message.tensors["w"] * 2}, message.meta)

    class Look(Interceptor):
        def on_upload(self, message):
            seen.append(float(message.tensors["w"]))
            return message

    channel = ServerChannel([Double(), Look()], recorder=Recorder())
    channel.download(Download(0, 7, {"w": torch.tensor(0.0)}))
    client_tensor = torch.tensor(1.5)
    got = channel.upload(Upload(0, 7, {"w": client_tensor}))
    assert seen == [3.0] and float(got.tensors["w"]) == 3.0
    assert float(channel.recorder.get(0, 7).upload.tensors["w"]) == 3.0
    assert float(client_tensor) == 1.5


def test_bad_interceptor_return_type_is_rejected():
    class Bad(Interceptor):
        def on_upload(self, message):
            return {"w": 1}

    channel = ServerChannel([Bad()])
    channel.download(Download(0, 0, {}))
    with pytest.raises(TypeError, match="expected Upload"):
        channel.upload(Upload(0, 0, {"w": torch.ones(1)}))


def test_recorder_keeps_previous_upload_outside_recorded_rounds():
    recorder = Recorder(rounds={2})
    channel = ServerChannel(recorder=recorder)
    for r in range(3):
        channel.download(Download(r, 0, {}))
        channel.upload(Upload(r, 0, {"w": torch.tensor(float(r))}))
    assert set(recorder.exchanges) == {(2, 0)}
    assert float(recorder.previous_upload(0, before_round=2).tensors["w"]) == 1.0
    assert recorder.previous_upload(0, before_round=0) is None


def test_a_channel_without_a_recorder_keeps_no_upload_per_client():
    """Plain training holds nothing per client in the channel (memory at 1,000 clients)."""
    channel = ServerChannel()
    for r in range(2):
        for cid in range(3):
            channel.download(Download(r, cid, {}))
            channel.upload(Upload(r, cid, {"w": torch.ones(1000)}))
    recorder = channel.recorder
    assert recorder.exchanges == {} and recorder._latest == {} and not recorder._pending
    assert recorder.previous_upload(0, before_round=2) is None
    with pytest.raises(RuntimeError, match="answers no download"):
        channel.upload(Upload(5, 0, {"w": torch.ones(1)}))


def test_messages_only_carry_tensors():
    with pytest.raises(TypeError):
        Upload(0, 0, {"w": [1, 2, 3]})


def test_ground_truth_is_kept_apart_from_the_server_view(digits):
    fed = tiny_federation(digits, clients=2)
    fed.run_round()
    for ex in fed.channel.recorder.exchanges.values():
        assert "indices" not in ex.upload.meta and all("index" not in k for k in ex.upload.tensors)
    samples = fed.ground_truth.samples(0, 0)
    assert set(samples.tolist()) == set(fed.partition.train[0].tolist())


def test_recorder_relabel_moves_exchanges_pending_and_memory():
    recorder = Recorder(rounds=[1])
    for rnd in range(3):
        for cid in (7, 9):
            recorder.on_download(Download(rnd, cid, {"w": torch.zeros(1)}))
            recorder.on_upload(Upload(rnd, cid, {"w": torch.full((1,), 10.0 * rnd + cid)}))
    recorder.relabel({7: 0, 9: 1})
    assert sorted(recorder.exchanges) == [(1, 0), (1, 1)]
    assert recorder.get(1, 1).upload.client_id == 1 and float(recorder.get(1, 1).upload.tensors["w"]) == 19.0
    assert recorder.get(1, 0).download.client_id == 0
    assert float(recorder.previous_upload(0, 3).tensors["w"]) == 27.0  # remembered outside the recorded rounds
    assert recorder.previous_upload(7, 3) is None
    with pytest.raises(ValueError, match="merge"):
        recorder.relabel({0: 1})
