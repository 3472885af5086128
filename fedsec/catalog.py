"""The names ``--help`` lists, declared where they can be read without importing torch.

``fedsec --help`` and ``fedsec <command> --help`` must start in well under a second, so the command
line reads the choices it shows (attacks with their one-line summaries and defaults, methods, data
sets, partitions, architectures, defenses, threat-model choices) from here; the registries they
mirror (``attacks.ATTACKS``, ``fedecouple.methods.METHODS``, ``defenses.DEFENSES``, ...) import torch.
``tests/test_catalog.py`` holds the two equal, so adding an attack, method, defense or data set means adding
its line here too.

An attack registered at run time (``attacks.register``, e.g. a plugin or a test's toy attack) is still a
valid choice: ``attack_names`` reads the live registry once ``attacks`` has been imported.
"""
from __future__ import annotations

import sys
from typing import NamedTuple


class AttackEntry(NamedTuple):
    """What the help shows of one registered attack (``attacks.registry.AttackSpec``'s fields)."""

    summary: str
    kind: str
    default_iterations: int
    default_restarts: int
    first_round: int


# in the registry's order (``attacks/__init__.py``'s imports)
ATTACKS: dict[str, AttackEntry] = {
    "dlg": AttackEntry("Deep Leakage from Gradients: image and soft label by L-BFGS gradient matching",
                       "gradient", 300, 1, 0),
    "idlg": AttackEntry("improved DLG: the label from the classifier's gradient, then DLG", "gradient", 300, 1, 0),
    "ig": AttackEntry("Inverting Gradients: cosine gradient matching with a TV prior, signed Adam",
                      "gradient", 1000, 3, 0),
    "proto": AttackEntry("prototype inversion: a class-typical image from each uploaded class prototype",
                         "image", 300, 1, 0),
    "labels": AttackEntry("label-distribution inference from counts, statistics, prototype keys or the "
                          "classifier's update", "labels", 300, 1, 0),
    "trap": AttackEntry("malicious server: trap weights in the first linear layer (--craft binning: Fowl et al.'s "
                        "bins, exact; plain: Boenisch et al.'s random rows)", "malicious", 300, 1, 0),
    "binning": AttackEntry("malicious server: binning rows in the first linear layer (= trap --craft binning)",
                           "malicious", 300, 1, 0),
    "fish": AttackEntry("malicious server: classifier fishing (Wen et al.): the classifier sent isolates one image "
                        "of the client's rarest class, rebuilt from the update", "malicious", 1000, 1, 1),
    "fedavg-leak": AttackEntry("Dimitrov et al. 2022: simulate the client's local epochs, label counts first, epoch "
                               "copies tied by an order-invariant term, every image rebuilt", "gradient", 3000, 2, 0),
    "spear": AttackEntry("SPEAR: every image of a one-step batch, exactly, from the update of a linear layer followed "
                         "by ReLU (its sparse gradients), each certified by the ReLU's pattern", "gradient", 300, 1, 0),
    "sum-binning": AttackEntry('malicious server under secure aggregation: the same binning rows '
                               'for every client, sized to the protocol; a bin holding one image '
                               'of the whole round reads it out of the sum (Robbing the Fed)',
                               "aggregate", 300, 1, 0),
    "inconsistency": AttackEntry('malicious server under secure aggregation: model inconsistency '
                                 '(Eluding Secure Aggregation via Model Inconsistency) zeroes '
                                 "every other client's first-layer update; binning reads the "
                                 "target's from the sum",
                                 "aggregate", 300, 1, 0),
    "sybil": AttackEntry('malicious server under secure aggregation with sybils: every other '
                         "participant is the server's, so it subtracts their updates from the sum"
                         " and reads the target's binning (an upper bound)",
                         "aggregate", 300, 1, 0),
    "sum-fishing": AttackEntry("malicious server under secure aggregation: the same fishing classifier for every "
                               "client (Wen et al.); the sum's mean update is the round's fished images', rebuilt",
                               "aggregate", 1000, 1, 1),
    "sum-labels": AttackEntry("secure aggregation: the round's label histogram from the sum (class counts, or the "
                              "summed classifier-bias update)", "aggregate", 1, 1, 0),
    "sum-inversion": AttackEntry("secure aggregation: the round's sum inverted as one batch of every survivor's images "
                                 "(cosine gradient matching, TV prior)", "aggregate", 1000, 1, 0),
    "sum-disaggregation": AttackEntry("secure aggregation: per-client label counts and updates by least squares over "
                                      "many rounds' sums (gradient disaggregation), then iDLG and the closed form",
                                      "aggregate", 300, 1, 0),
}
# fedecouple.secure_aggregation.SecureAggregation's defaults (Flower's SecAggPlusWorkflow's): the options' defaults
SECURE_AGGREGATION = {"clipping_range": 8.0, "quantization_range": 2 ** 22, "modulus": 2 ** 32, "num_shares": 1.0,
                      "reconstruction_threshold": 0.5, "max_weight": 1000.0, "clear_fields": "flower",
                      "dp_noise": 0.0, "dp_l2_clip": None, "dp_delta": 1e-5}
SECURE_AGGREGATION_CLEAR_FIELDS = ("flower", "hidden")  # fedecouple.secure_aggregation.CLEAR_FIELDS
MEMBERSHIP_ATTACKS = ("lira", "loss", "entropy", "population", "rmia")  # attacks.MEMBERSHIP
METHODS = ("fedecouple", "fedavg", "ft-fedavg", "fedper", "fedrep", "fedpac", "fedproto", "local")
DATASETS = ("mnist5k", "digits", "cifar10", "cifar100", "fmnist", "emnist", "cinic10")
EMBEDDED_DATASETS = ("mnist5k", "digits")  # fedecouple.data.registry.EMBEDDED
PARTITIONS = ("iid", "pathological", "weak", "dirichlet")  # fedecouple.data.SCHEMES
ARCHITECTURES = ("cnn32", "cnn28", "cnn28-same", "pfllib-cnn", "digits", "mlp", "mlp-relu", "resnet18", "resnet18-bn",
                 "resnet50")
# the attacks ``fedsec report`` runs unless --attacks is given (read by ``fedsec.jobs.report.settings``)
REPORT_ATTACKS = ("dlg", "ig", "proto", "labels", "sum-labels")
REPORT_METHODS = ("fedecouple", "fedper", "fedpac", "fedproto")  # the report's default methods
# the attacks ``fedsec defend`` runs against each value unless --attacks is given (``DefendSettings``)
DEFEND_ATTACKS = ("dlg", "ig", "labels")
DEFENSES = ("dp", "noise", "clip", "prune", "quantize", "exclude", "download-check", "consistency-check")  # defenses.DEFENSES
MODES = ("auto", "method", "replay", "scaled")  # attacks.inversion.observation.MODES
AUGMENTATION_MODELS = ("free", "family", "oracle")
STARTS = ("noise", "mean")  # attacks.base.STARTS


def _live():
    """The attack registry when ``attacks`` is already imported (else None: the help stays torch-free)."""
    registry = sys.modules.get("attacks.registry")
    return None if registry is None or "attacks" not in sys.modules else registry.ATTACKS


def attack_names(kind: str | None = None) -> list[str]:
    """Registered attack names (of one kind), in registration order."""
    live = _live()
    if live is not None:
        return [n for n, s in live.items() if kind is None or s.kind == kind]
    return [n for n, e in ATTACKS.items() if kind is None or e.kind == kind]


def attack_summaries() -> dict[str, str]:
    """{attack: its one-line summary}."""
    live = _live()
    if live is not None:
        return {n: s.summary for n, s in live.items()}
    return {n: e.summary for n, e in ATTACKS.items()}


def attack_defaults(field: str) -> dict[str, int]:
    """{attack: its declared ``default_iterations`` or ``default_restarts``}."""
    live = _live()
    if live is not None:
        return {n: getattr(s, field) for n, s in live.items()}
    return {n: getattr(e, field) for n, e in ATTACKS.items()}
