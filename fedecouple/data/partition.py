"""Seeded label-skew partitions of one pooled data set into per-client train/test index sets.

Each client's indices are split per class into train and test (``test_fraction`` held out from
every class it holds), so a client's test data follows its own training label distribution, as
in the paper's evaluation protocol.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..errors import UserError
from .registry import SCHEMES


@dataclass
class Partition:
    scheme: str
    num_classes: int
    train: list[np.ndarray]  # per-client indices into the pooled data set
    test: list[np.ndarray]

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def class_counts(self, labels: np.ndarray, split: str = "train") -> pd.DataFrame:
        """Rows = clients, columns = classes, values = sample counts."""
        parts = self.train if split == "train" else self.test
        rows = [np.bincount(labels[idx], minlength=self.num_classes) for idx in parts]
        frame = pd.DataFrame(rows, columns=[str(c) for c in range(self.num_classes)])
        frame.index.name = "client"
        frame["total"] = frame.sum(axis=1)
        return frame

    def summary(self, labels: np.ndarray) -> str:
        """A printable table of training-class counts per client plus test sizes."""
        frame = self.class_counts(labels, "train")
        frame["test"] = [len(t) for t in self.test]
        return f"partition {self.scheme}: {self.num_clients} clients\n" + frame.to_string()


def _check_common(labels: np.ndarray, num_clients: int, num_classes: int) -> None:
    if num_clients < 1:
        raise UserError(f"num_clients must be at least 1, got {num_clients}", fields=("num_clients",))
    if num_clients > len(labels):
        raise UserError(f"num_clients {num_clients} exceeds the {len(labels)} samples of the data set",
                        fields=("num_clients",))
    if num_classes < 1:
        raise UserError("the data set has no classes")


def iid_split(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


def _class_slots(num_clients: int, k: int, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """K distinct classes per client, spread evenly over classes (round robin on a shuffled order),
    so that every class is held by about the same number of clients."""
    order = rng.permutation(num_classes)
    return [order[(i * k + np.arange(k)) % num_classes] for i in range(num_clients)]


def pathological_split(labels: np.ndarray, num_clients: int, num_classes: int, classes_per_client: int,
                       rng: np.random.Generator) -> list[np.ndarray]:
    """Each client holds ``classes_per_client`` classes; a class's samples are divided equally among
    the clients holding it. Every sample goes to exactly one client (unless a class has no holder)."""
    if not 1 <= classes_per_client <= num_classes:
        raise UserError(f"classes_per_client must be in [1, {num_classes}] for this data set, got {classes_per_client}",
                        fields=("classes_per_client",))
    slots = _class_slots(num_clients, classes_per_client, num_classes, rng)
    holders: dict[int, list[int]] = {c: [] for c in range(num_classes)}
    for client, classes in enumerate(slots):
        for c in classes:
            holders[int(c)].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, clients in holders.items():
        if not clients:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for client, chunk in zip(clients, np.array_split(idx, len(clients))):
            parts[client].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]


def weak_pathological_split(labels: np.ndarray, num_clients: int, num_classes: int, s: float,
                            samples_per_client: int, dominant_classes: int,
                            rng: np.random.Generator) -> list[np.ndarray]:
    """The paper's weak-pathological setting: every client gets ``samples_per_client`` samples;
    ``s`` % of them spread uniformly over all classes (equal share per class), the other (100-s) %
    from ``dominant_classes`` randomly chosen dominant classes (equal share each). Samples are
    drawn without replacement, so clients stay disjoint."""
    if not 0 <= s <= 100:
        raise UserError(f"s must be a percentage in [0, 100], got {s}", fields=("s",))
    if not 1 <= dominant_classes <= num_classes:
        # make_partition passes its classes_per_client as the dominant classes
        raise UserError(f"classes_per_client (dominant classes) must be in [1, {num_classes}], got {dominant_classes}",
                        fields=("classes_per_client",))
    if samples_per_client < 1:
        raise UserError(f"samples_per_client must be at least 1, got {samples_per_client}",
                        fields=("samples_per_client",))
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)}
    n_uniform = int(round(samples_per_client * s / 100.0))
    n_dominant = samples_per_client - n_uniform
    dominant = _class_slots(num_clients, dominant_classes, num_classes, rng)
    parts = []
    for client in range(num_clients):
        want = np.zeros(num_classes, dtype=np.int64)
        want += _even_counts(n_uniform, np.arange(num_classes), num_classes, rng)
        want += _even_counts(n_dominant, dominant[client], num_classes, rng)
        chosen = []
        for c in range(num_classes):
            if want[c] > len(pools[c]):
                raise UserError(
                    f"weak partition needs {int(want[c])} more samples of class {c} but only {len(pools[c])} are left; "
                    f"lower samples_per_client or num_clients", fields=("samples_per_client", "num_clients"))
            chosen.extend(pools[c][: want[c]])
            pools[c] = pools[c][want[c]:]
        parts.append(np.sort(np.asarray(chosen, dtype=np.int64)))
    return parts


def _even_counts(total: int, classes: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``total`` as evenly as possible over ``classes``; the remainder goes to random ones."""
    counts = np.zeros(num_classes, dtype=np.int64)
    base, rest = divmod(total, len(classes))
    counts[classes] = base
    if rest:
        counts[rng.choice(classes, size=rest, replace=False)] += 1
    return counts


def dirichlet_split(labels: np.ndarray, num_clients: int, num_classes: int, beta: float,
                    rng: np.random.Generator, min_size: int = 10, max_tries: int = 1000) -> list[np.ndarray]:
    """Per class, proportions over clients ~ Dir(beta); redrawn until every client has ``min_size``
    samples (the usual practice, so no client is empty)."""
    if not beta > 0:
        raise UserError(f"beta must be positive, got {beta}", fields=("beta",))
    min_size = min(min_size, len(labels) // num_clients)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, beta))
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise UserError(f"could not draw a Dirichlet({beta}) partition giving every client {min_size} samples; "
                    f"raise beta or lower num_clients", fields=("beta", "num_clients"))


def split_train_test(labels: np.ndarray, indices: np.ndarray, test_fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``test_fraction`` of each class the client holds (at least one sample stays in train)."""
    train, test = [], []
    for c in np.unique(labels[indices]):
        idx = rng.permutation(indices[labels[indices] == c])
        n_test = min(int(round(len(idx) * test_fraction)), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    if not train:
        return np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def make_partition(labels, num_clients: int, scheme: str, *, num_classes: int | None = None,
                   classes_per_client: int = 3, s: float = 20.0, samples_per_client: int | None = None,
                   beta: float = 0.1, test_fraction: float = 0.25, seed: int = 0,
                   train_images: int | None = None) -> Partition:
    """Partition ``labels`` (array-like of class ids) into ``num_clients`` clients.

    ``samples_per_client``: for ``weak`` it counts train + test (the paper's setting); its default is
    600 (the paper's) capped at 80 % of an equal share of the pool so that the draw without
    replacement can succeed. For the other schemes it caps each client's training set at that many
    (at most; ``train_images`` asks for exactly that many).

    ``train_images``: every client trains on exactly that many images, on any scheme: a seeded sample
    of its training split (the test split is kept), e.g. the small clients a gradient attack on real
    local training or a malicious-server attack is measured on; a client whose split holds fewer is
    an error naming the fix. None keeps the training sets whole.
    """
    labels = np.asarray(labels, dtype=np.int64)
    num_classes = int(num_classes if num_classes is not None else labels.max() + 1)
    _check_common(labels, num_clients, num_classes)
    if not 0 <= test_fraction < 1:
        raise UserError(f"test fraction must be in [0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = iid_split(labels, num_clients, rng)
    elif scheme == "pathological":
        parts = pathological_split(labels, num_clients, num_classes, classes_per_client, rng)
    elif scheme == "weak":
        if samples_per_client is None:
            samples_per_client = min(600, int(0.8 * len(labels) / num_clients))
        parts = weak_pathological_split(labels, num_clients, num_classes, s, samples_per_client,
                                        classes_per_client, rng)
    elif scheme == "dirichlet":
        parts = dirichlet_split(labels, num_clients, num_classes, beta, rng)
    else:
        raise UserError(f"unknown partition {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    train, test = zip(*(split_train_test(labels, p, test_fraction, rng) for p in parts))
    train = list(train)
    cap, name = ((train_images, "train_images") if train_images is not None else
                 (samples_per_client, "samples_per_client") if scheme != "weak" else (None, ""))
    if cap is not None:
        # the older name caps (at most N, as it always did); train_images asks for exactly N
        train = cap_training_sets(train, cap, rng, name, scheme, exact=train_images is not None)
    return Partition(scheme, num_classes, train, list(test))


def cap_training_sets(train: list[np.ndarray], cap: int, rng: np.random.Generator, name: str = "train_images",
                      scheme: str = "", exact: bool = True) -> list[np.ndarray]:
    """Each client's training indices cut to ``cap`` (a seeded sample, kept sorted); ``name`` is the
    parameter of ``make_partition`` that set it. ``exact``: a client whose split holds fewer is a
    ``UserError`` naming the fix; otherwise it keeps what it has."""
    if cap < 1:
        raise UserError(f"{name} must be at least 1, got {cap}", fields=(name,))
    short = [(c, len(t)) for c, t in enumerate(train) if len(t) < cap] if exact else []
    if short:
        c, have = short[0]
        fix, named = (("raise samples_per_client (train + test per client)", ("samples_per_client",)) if scheme == "weak"
                      else ("use scheme iid or weak, or fewer num_clients", ("scheme", "num_clients")))
        raise UserError(f"{name} {cap}: client {c} has only {have} training images ({len(short)} client(s) short); "
                        f"lower {name} or {fix}", fields=(name, *named))
    return [np.sort(rng.permutation(t)[:cap]) if len(t) > cap else t for t in train]
