import numpy as np
import pytest
import torch

from fedecouple.data import make_partition
from fedecouple.data.partition import weak_pathological_split
from fedecouple.errors import UserError


def _all(part):
    return [np.concatenate([tr, te]) for tr, te in zip(part.train, part.test)]


@pytest.mark.parametrize("scheme", ["iid", "pathological", "weak", "dirichlet"])
def test_disjoint_and_seeded(mnist, scheme):
    labels = mnist.labels.numpy()
    a = make_partition(labels, 20, scheme, seed=3)
    b = make_partition(labels, 20, scheme, seed=3)
    allidx = np.concatenate(_all(a))
    assert len(allidx) == len(np.unique(allidx)), "a sample was given to two clients"
    for x, y in zip(_all(a), _all(b)):
        assert np.array_equal(x, y)
    for tr, te in zip(a.train, a.test):
        assert not set(tr) & set(te)
        # the test split follows the client's own label distribution
        assert set(labels[te]) <= set(labels[tr])


@pytest.mark.parametrize("scheme", ["iid", "pathological", "dirichlet"])
def test_complete(mnist, scheme):
    labels = mnist.labels.numpy()
    part = make_partition(labels, 20, scheme, seed=0)
    assert np.array_equal(np.sort(np.concatenate(_all(part))), np.arange(len(labels)))


def test_pathological_classes_per_client(mnist):
    labels = mnist.labels.numpy()
    part = make_partition(labels, 20, "pathological", classes_per_client=3, seed=1)
    counts = part.class_counts(labels).drop(columns="total").to_numpy()
    assert ((counts > 0).sum(axis=1) == 3).all()
    assert ((counts > 0).sum(axis=0) == 6).all()  # 60 slots spread evenly over 10 classes


def test_weak_s_semantics(mnist):
    labels = mnist.labels.numpy()
    rng = np.random.default_rng(0)
    parts = weak_pathological_split(labels, 10, 10, s=20, samples_per_client=200, dominant_classes=2, rng=rng)
    for p in parts:
        counts = np.bincount(labels[p], minlength=10)
        assert counts.sum() == 200
        assert (counts >= 4).all()  # 20 % of 200 spread evenly: 4 per class
        dominant = np.sort(counts)[-2:]
        assert dominant.sum() == 160 + 8  # 80 % in the two dominant classes, plus their uniform share
    # s = 100: all uniform; s = 0: only the dominant classes
    rng = np.random.default_rng(0)
    uniform = weak_pathological_split(labels, 5, 10, s=100, samples_per_client=100, dominant_classes=2, rng=rng)
    assert all((np.bincount(labels[p], minlength=10) == 10).all() for p in uniform)
    rng = np.random.default_rng(0)
    skewed = weak_pathological_split(labels, 5, 10, s=0, samples_per_client=100, dominant_classes=2, rng=rng)
    assert all((np.bincount(labels[p], minlength=10) > 0).sum() == 2 for p in skewed)


def test_dirichlet_beta_controls_skew(mnist):
    labels = mnist.labels.numpy()

    def mean_classes(beta):
        part = make_partition(labels, 20, "dirichlet", beta=beta, seed=0)
        counts = part.class_counts(labels).drop(columns="total").to_numpy()
        share = counts / counts.sum(axis=1, keepdims=True)
        return (share > 0.05).sum(axis=1).mean()

    assert mean_classes(0.1) < mean_classes(100.0)
    assert mean_classes(100.0) >= 9


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheme="pathological", classes_per_client=11), "^classes_per_client must be"),
    (dict(scheme="weak", s=-1), "^s must be"),
    (dict(scheme="weak", s=101), "^s must be"),
    (dict(scheme="dirichlet", beta=0.0), "^beta must be"),
    (dict(scheme="nope"), "unknown partition"),
])
def test_bad_input(mnist, kwargs, message):
    with pytest.raises(UserError, match=message):
        make_partition(mnist.labels.numpy(), 10, **kwargs)


def test_clients_bounds(mnist):
    with pytest.raises(UserError, match="^num_clients must be at least 1"):
        make_partition(mnist.labels.numpy(), 0, "iid")


def test_summary_is_printable(mnist):
    labels = mnist.labels.numpy()
    text = make_partition(labels, 4, "pathological", seed=0).summary(labels)
    assert "client" in text and "total" in text and len(text.splitlines()) == 3 + 4


def test_channel_stats_do_not_depend_on_the_thread_count():
    """Normalisation statistics (and so every number of a run) must not change with torch's thread
    count at load time: they are accumulated in float64 and rounded to float32."""
    from fedecouple.data.dataset import channel_stats

    images = torch.rand(3000, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = channel_stats(images)
        torch.set_num_threads(2)
        two = channel_stats(images)
    finally:
        torch.set_num_threads(previous)
    assert one == two
    exact = images.to(torch.float64)
    want_mean = exact.mean(dim=(0, 2, 3)).to(torch.float32).tolist()
    want_std = exact.std(dim=(0, 2, 3)).to(torch.float32).tolist()
    assert list(one[0]) == want_mean and list(one[1]) == pytest.approx(want_std, rel=1e-7)
