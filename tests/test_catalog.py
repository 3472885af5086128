"""What the help lists is read without torch: methods, data sets, architectures and defenses from their
declarations (``fedecouple.plugins.Plugins``), the secure aggregation's defaults from
``fedecouple.secure_defaults``; the packages that declare them import no torch."""
from __future__ import annotations

from dataclasses import fields

from helpers import run_python


def test_the_attack_choices_are_the_declarations():
    import attacks
    from fedsec import catalog

    assert list(catalog.ATTACKS) == list(attacks.ATTACKS) == catalog.attack_names()
    assert catalog.ATTACKS["ig"].default_restarts == attacks.ATTACKS.facts("ig")["default_restarts"]
    assert catalog.attack_summaries()["dlg"] == attacks.ATTACKS.facts("dlg")["summary"]


def test_the_catalog_reads_the_declarations():
    import defenses
    from fedecouple.architectures import ARCHITECTURES
    from fedecouple.data import DATASETS, SCHEMES
    from fedecouple.methods import METHODS
    from fedsec import catalog

    assert catalog.METHODS == METHODS.names() and catalog.DATASETS == DATASETS.names()
    assert catalog.EMBEDDED_DATASETS == ("mnist5k", "digits") and catalog.PARTITIONS is SCHEMES
    assert catalog.ARCHITECTURES == ARCHITECTURES.names() and catalog.DEFENSES == defenses.DEFENSES.names()
    assert set(catalog.summaries("method")) == set(METHODS)  # every method has its one line
    METHODS.declare("late", "fedecouple.methods.fedavg:FedAvg", summary="declared after the catalog was read")
    try:
        assert catalog.METHODS[-1] == "late"  # read when read
    finally:
        METHODS.remove("late")
    assert "late" not in catalog.METHODS


def test_the_command_lines_own_defaults():
    from fedsec import catalog
    from fedsec.jobs.defend import DefendSettings
    from fedsec.jobs.report.settings import DEFAULT_ATTACKS

    assert DEFAULT_ATTACKS is catalog.REPORT_ATTACKS  # declared once, read by --help and the report
    assert DefendSettings("clip", [1]).attacks == list(catalog.DEFEND_ATTACKS)


def test_secure_aggregation_takes_its_defaults_from_the_declaration():
    from fedecouple.secure_aggregation import CLEAR_FIELDS, SecureAggregation
    from fedecouple.secure_defaults import DEFAULTS
    from fedsec import catalog

    assert {f.name: f.default for f in fields(SecureAggregation) if f.name != "seed"} == DEFAULTS
    assert catalog.SECURE_AGGREGATION is DEFAULTS and catalog.SECURE_AGGREGATION_CLEAR_FIELDS is CLEAR_FIELDS


def test_the_declaring_packages_load_no_torch():
    code = ("import sys, fedecouple.methods, fedecouple.data, fedecouple.architectures, defenses\n"
            "from fedecouple.methods import METHODS, make_method, method_class\n"
            "from fedecouple.data import DATASETS, SCHEMES, load_dataset\n"
            "assert METHODS.facts('fedavg')['summary'] and DATASETS.facts('digits')['embedded']\n"
            "assert defenses.DEFENSES.facts('dp')['summary'] and 'clip' in defenses.DEFENSES\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from fedecouple.methods import FedAvg, Method\n"  # the lazy names still import
            "from defenses import DPConfig, FilterChain\n"
            "from fedecouple.data import ImageDataset, make_partition\n"
            "assert issubclass(FedAvg, Method) and method_class('fedavg') is FedAvg\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_the_help_and_import_fedsec_load_no_torch():
    code = ("import sys, fedsec; from fedsec.cli import main\n"
            "for args in ([], ['attack'], ['report'], ['flower', 'attack'], ['defend'], ['mia']):\n"
            "    main([*args, '--help'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
