"""Small builders shared by tests."""
import os
import subprocess
import sys

from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import make_partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth
from fedecouple.methods import make_method
from fedecouple.methods.base import TrainConfig

# torch threads for the whole suite (conftest) and for every test that pins them: 1 by default;
# FEDSEC_TEST_THREADS=2 provokes other float rounding on the same machine, which no test may depend on
TEST_THREADS = int(os.environ.get("FEDSEC_TEST_THREADS", "1"))


def tiny_federation(dataset, method="fedecouple", clients=3, rounds=1, interceptors=(), seed=0, hp=None,
                    partition="pathological", lr=0.05, **kwargs):
    part = make_partition(dataset.labels.numpy(), clients, partition, seed=seed)
    channel = ServerChannel(interceptors, recorder=Recorder())
    fed = Federation(make_method(method, **(hp or {})), dataset, part,
                     FederationConfig(rounds=rounds, seed=seed, train=TrainConfig(lr=lr, batch_size=10, local_epochs=1)),
                     channel=channel, ground_truth=GroundTruth(), **kwargs)
    return fed


def dp_federation(dataset, method, dp, clients=2, rounds=1, init_server=False):
    """``tiny_federation`` whose method runs under the DP wrapper of ``defenses`` with ``dp`` (a ``DPConfig``);
    the clients built for the plain method are dropped so each starts with its own accountant."""
    from defenses import DPMethod  # tests of the engine alone never import the harness

    fed = tiny_federation(dataset, method, clients=clients, rounds=rounds)
    fed.method = DPMethod(fed.method, dp)
    if init_server:
        fed.method.init_server(fed.model)
    fed.clients.clear()
    return fed


def digits_model():
    """(sklearn digits, an initial seeded 8×8 model): the malicious-server tests' client and server."""
    import torch
    from fedecouple.data import load_dataset
    from fedecouple.models import build_model

    data = load_dataset("digits")
    torch.manual_seed(0)
    return data, build_model("digits", 1, 8, 10, data.mean, data.std)


def model_factory(model):
    """A function returning fresh copies of ``model`` at its current weights (the attacks' make_model)."""
    from fedecouple.models import build_model

    state = {k: v.clone() for k, v in model.state_dict().items()}

    def make():
        fresh = build_model("digits", 1, 8, 10, [0.0], [1.0])
        fresh.load_state_dict(state)
        return fresh
    return make


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """``code`` run by this Python in a fresh process (what a new user's ``import`` sees: no module of the
    test session loaded), its output captured as text; ``kwargs`` go to ``subprocess.run`` (cwd, timeout)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, **kwargs)


# -- running the command line in this process (the entry-point matrix) ---------------------------------
def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, standard output and standard error of ``fedsec ARGV`` run in this process. Anything
    raised other than the CLI's own exit fails the test with its traceback."""
    from fedsec.cli import main

    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exc:
        code = exc.code
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def assert_refused(code: int, err: str, attack: str, method: str) -> None:
    """Exit status 2 and one ``error:`` line (progress bars aside) that names the method or the attack
    (whichever the first check that refused was about)."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert method in errors[0] or attack in errors[0], errors[0]


def declared_refusal(attack: str, method: str) -> str | None:
    """What the attack's spec says before any training (None: it applies)."""
    import attacks
    from fedecouple.methods import make_method
    from fedecouple.methods.base import upload_kinds

    _, model = digits_model()
    return attacks.get(attack).not_applicable(method, upload_kinds(make_method(method), model))


def assert_attack_result(summary: dict, attack: str, method: str) -> None:
    """A written attack: scored images or labels, or the reason nothing could be scored."""
    import attacks

    assert summary["attack"] == attack and summary["method"] == method
    scored = summary["images_scored"] if attacks.get(attack).rebuilds_images else len(summary.get("label_scores") or [])
    assert scored > 0 or summary.get("not_applicable"), summary["notes"]
