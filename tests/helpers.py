"""Small builders shared by tests."""
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import make_partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth
from fedecouple.methods import make_method
from fedecouple.methods.base import TrainConfig


def tiny_federation(dataset, method="fedecouple", clients=3, rounds=1, interceptors=(), seed=0, hp=None,
                    partition="pathological", lr=0.05, **kwargs):
    part = make_partition(dataset.labels.numpy(), clients, partition, seed=seed)
    channel = ServerChannel(interceptors, recorder=Recorder())
    fed = Federation(make_method(method, **(hp or {})), dataset, part,
                     FederationConfig(rounds=rounds, seed=seed, train=TrainConfig(lr=lr, batch_size=10, local_epochs=1)),
                     channel=channel, ground_truth=GroundTruth(), **kwargs)
    return fed
