import pytest
import torch

from helpers import TEST_THREADS

torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def digits():
    from fedecouple.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def mnist():
    from fedecouple.data import load_dataset

    return load_dataset("mnist5k")


@pytest.fixture(scope="module")
def shared_ray():
    """One Ray instance for a test module's Flower simulations (``shared_ray`` in
    ``fedsec.flower.simulation``), shut down at the module's end so that the engine's own Ray backend
    (``tests/test_backends.py``) starts its own; nothing without Flower."""
    try:
        from fedsec.flower.simulation import shared_ray as sharing
    except ImportError:
        yield
        return
    with sharing():
        yield
