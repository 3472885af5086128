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
