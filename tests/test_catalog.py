"""``fedsec.catalog`` (what the help lists, readable without torch) equals the registries it mirrors,
and the help imports no torch."""
from __future__ import annotations

from dataclasses import fields

from helpers import run_python


def test_the_catalog_equals_the_registries():
    import attacks
    from attacks.base import STARTS
    from attacks.inversion.observation import AUGMENTATION_MODELS, MODES
    from defenses import DEFENSES
    from fedecouple.data import DATASETS, SCHEMES
    from fedecouple.data.registry import EMBEDDED
    from fedecouple.methods import METHODS
    from fedecouple.models import ARCHITECTURES
    from fedecouple.secure_aggregation import SecureAggregation
    from fedsec import catalog
    from fedsec.jobs.defend import DefendSettings
    from fedsec.jobs.report.settings import DEFAULT_ATTACKS

    registered = {n: s for n, s in attacks.ATTACKS.items() if n in catalog.ATTACKS or n != "toy"}
    assert {n: (s.summary, s.kind, s.default_iterations, s.default_restarts, s.first_round)
            for n, s in registered.items()} == {n: tuple(e) for n, e in catalog.ATTACKS.items()}
    assert list(registered) == list(catalog.ATTACKS)  # the registry's order is the help's
    assert tuple(attacks.MEMBERSHIP) == catalog.MEMBERSHIP_ATTACKS
    assert tuple(METHODS) == catalog.METHODS and tuple(DATASETS) == catalog.DATASETS
    assert tuple(EMBEDDED) == catalog.EMBEDDED_DATASETS and tuple(SCHEMES) == catalog.PARTITIONS
    assert tuple(ARCHITECTURES) == catalog.ARCHITECTURES and tuple(DEFENSES) == catalog.DEFENSES
    assert tuple(MODES) == catalog.MODES and tuple(AUGMENTATION_MODELS) == catalog.AUGMENTATION_MODELS
    assert tuple(STARTS) == catalog.STARTS
    assert {f.name: f.default for f in fields(SecureAggregation) if f.name != "seed"} == catalog.SECURE_AGGREGATION
    assert DEFAULT_ATTACKS is catalog.REPORT_ATTACKS  # declared once, read by --help and the report
    assert DefendSettings("clip", [1]).attacks == list(catalog.DEFEND_ATTACKS)


def test_the_help_and_import_fedsec_load_no_torch():
    code = ("import sys, fedsec; from fedsec.cli import main\n"
            "for args in ([], ['attack'], ['report'], ['flower', 'attack'], ['defend'], ['mia']):\n"
            "    main([*args, '--help'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
