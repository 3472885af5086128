"""``--preset paper|audit``: the values a preset sets, merged under what the user gave explicitly
(a preset never overrides an explicit flag). ``is_explicit(name)`` says whether ``--name`` was given
on the command line (the CLI passes click's answer)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import attacks
from fedecouple.errors import UserError
from fedecouple.methods import METHODS

from .runner import AUDIT_FEDERATION, PAPER_FEDERATION

Explicit = Callable[[str], bool]
FEDERATIONS = {"paper": PAPER_FEDERATION, "audit": AUDIT_FEDERATION}


def merge_federation(preset: str | None, opts: dict, hyperparameters: dict, is_explicit: Explicit) -> None:
    """Fill the train flags (``opts``) and, for ``paper``, the method's paper hyperparameters with the
    preset's values where the user gave none."""
    for key, value in FEDERATIONS.get(preset, {}).items():
        if not is_explicit(key):
            opts[key] = value
    if preset == "paper" and opts["method"] in METHODS:  # compare/report set methods later: each its own preset
        from fedecouple.methods.facets import PaperPreset

        cls = METHODS[opts["method"]]
        for key, value in (cls.paper_preset if issubclass(cls, PaperPreset) else {}).items():
            hyperparameters.setdefault(key, value)


def attack_plan(attack: str, given: dict, is_explicit: Explicit, train_images: int | None = None) -> dict:
    """``fedsec attack --preset audit``: the audit's plan for this attack (``fedsec.jobs.report.audit_preset``'s
    cell: ``<attack>@real`` — ``@real-n<N>`` with ``--train-images N`` — or ``@textbook`` with an
    explicit ``--victim-batch``; a malicious server's attack: the malicious-server section's round and
    targets) under the explicit flags. ``given`` and the result hold attack_rounds, targets,
    iterations, restarts, victim_batch."""
    from .jobs.report import audit_preset

    kind = attacks.get(attack).kind
    gradient = kind == "gradient"
    textbook = is_explicit("victim_batch") and given["victim_batch"] and gradient
    preset = audit_preset()
    real = "real" if train_images is None else f"real-n{int(train_images)}"  # a size of the curve, or the clients'
    plan = (preset.for_malicious(attack, False) if kind == "malicious"  # the section's round and targets
            else preset.for_attack(f"{attack}@{'textbook' if textbook else real}" if gradient else attack))
    planned = {"attack_rounds": ",".join(map(str, plan.rounds)), "targets": plan.targets,
               "iterations": plan.iterations, "restarts": plan.restarts, "victim_batch": plan.victim_batch}
    return {k: given[k] if is_explicit(k) else v for k, v in planned.items()}


def report_methods(preset: str | None, methods: str, is_explicit: Explicit) -> str:
    """``fedsec report``'s ``--methods``: with ``--preset audit`` and no explicit ``--methods``, the
    preset's (``fedsec.jobs.report.settings.AUDIT_METHODS``: FedAvg beside the four mission methods), else ``methods``."""
    from .jobs.report.settings import AUDIT_METHODS

    return ",".join(AUDIT_METHODS) if preset == "audit" and not is_explicit("methods") else methods


def report_plan(preset: str | None, attack_text: str, attack_rounds: str, targets: int, iterations: str | None,
                is_explicit: Explicit, malicious_sizes: str | None = None, real_sizes: str | None = None):
    """(attacks, ``ReportSettings``) of ``fedsec report``: the audit's plan under the explicit flags
    with ``--preset audit`` (IG keeps the textbook cell only while ``fedavg-leak`` carries the real
    ones: ``--attacks ig`` alone gets IG's real cells back), else the flags (``--real-sizes`` alone:
    each gradient attack on the real local training of clients of each size, no textbook cell)."""
    from .jobs import report as rep
    from .jobs.report.settings import REAL_TRAINING_ATTACK

    sizes = rep.parse_sizes(malicious_sizes)
    real = rep.parse_sizes(real_sizes, "--real-sizes", ()) if real_sizes is not None else None
    attack_list = rep.parse_attacks(attack_text if preset != "audit" or is_explicit("attacks")
                                    else ",".join(rep.AUDIT_ATTACKS))
    for given, kind, flag in ((malicious_sizes, "malicious", "--malicious-sizes"), (real_sizes, "gradient", "--real-sizes")):
        if given is not None and not any(attacks.get(a).kind == kind for a in attack_list):
            names = ", ".join(attacks.names(kind))
            raise UserError(f"{flag} applies to the {'malicious-server' if kind == 'malicious' else 'gradient'} "
                            f"attacks ({names}): add one to --attacks or drop {flag}")
    if preset != "audit":
        sized = {} if real is None else {"victim_settings": ("real",), "real_sizes": real}
        return attack_list, rep.ReportSettings(rounds=tuple(rep.parse_rounds(attack_rounds)), targets=targets,
                                               iterations=rep.parse_iterations(iterations), malicious_sizes=sizes,
                                               **sized)
    settings = rep.audit_preset(rep.parse_iterations(iterations))
    if REAL_TRAINING_ATTACK not in attack_list:  # nothing else carries the real cells: each attack keeps them
        settings = replace(settings, settings_by={a: s for a, s in settings.settings_by.items()
                                                  if a == REAL_TRAINING_ATTACK})
    if is_explicit("malicious_sizes"):
        settings = replace(settings, malicious_sizes=sizes)
    if real is not None:
        settings = replace(settings, real_sizes=real)
    if is_explicit("attack_rounds"):  # the malicious-server section's rounds too
        settings = replace(settings, rounds=tuple(rep.parse_rounds(attack_rounds)), malicious_rounds=None)
    if is_explicit("targets"):
        settings = replace(settings, targets=targets, targets_by={})
    return attack_list, settings
