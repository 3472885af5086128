import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def digits():
    from fedecouple.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def mnist():
    from fedecouple.data import load_dataset

    return load_dataset("mnist5k")
