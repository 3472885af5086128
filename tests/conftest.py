import pytest
import torch

from helpers import TEST_THREADS

torch.set_num_threads(TEST_THREADS)

# The longest files first (measured with --durations on two cores): with the README's --dist loadfile and
# pyproject's --no-loadscope-reorder, pytest-xdist hands whole files to the workers in collection order; a
# long file collected last would leave one worker running it alone.
LONGEST_FIRST = ("test_matrix.py", "test_matrix_flower.py", "test_flower.py", "test_backends.py", "test_attacks.py",
                 "test_report.py", "test_replay.py", "test_flower_malicious.py", "test_train_cli.py",
                 "test_devices.py", "test_docs.py", "test_batched.py", "test_defenses.py", "test_mia.py",
                 "test_candidates.py", "test_flower_secagg.py", "test_real_training.py", "test_front_ends.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(scope="session")
def digits():
    from fedecouple.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def mnist():
    from fedecouple.data import load_dataset

    return load_dataset("mnist5k")


@pytest.fixture(scope="session")
def shared_ray():
    """One Ray instance and ClientApp actor pool for the Flower simulations of this worker's whole session
    (``shared_ray`` in ``fedsec.flower.simulation``): Ray's start-up and the actors' (each imports torch
    and the app) are paid once per worker, not per module. ``tests/test_backends.py`` stops it to run the
    engine's own Ray backend; the next simulation starts it again. Nothing without Flower."""
    try:
        from fedsec.flower.simulation import shared_ray as sharing
    except ImportError:
        yield
        return
    with sharing():
        yield
