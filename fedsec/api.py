"""fedsec's Python API: one call per job, the same jobs as the command line.

    import fedsec
    r = fedsec.attack("dlg", method="fedecouple", targets=2, iterations=50)
    r.mean_psnr, r.rows.head(), r.reconstructions.shape

Each function takes the flags of its command as keywords (``--attack-rounds`` is ``attack_rounds``),
converted and checked by the types of the very flags the command line declares (``fedsec.keywords``; no
command line is parsed), so a bad value is the same one-line ``fedecouple.errors.UserError``, naming keywords where the command line names flags
(``fedsec.field_names``). Keywords left out take the flag's default;
``config="run/config.toml"`` reads settings from a file (keywords override it). Two keywords are the
API's own: ``out=None`` (the default) keeps everything in memory and writes no file (report, defend,
mia and compare work in a temporary folder, removed when they return), and ``progress=False`` silences
the progress bars and messages. A folder given as ``out`` is treated as on the command line: a folder
holding results of another configuration is refused unless ``force=True``; one holding this
configuration's finished results is read back instead of recomputed; every run writes the
``config.toml`` it ran with.

Each returns a result: the summary's figures as attributes (``r.mean_psnr``; any other summary key
too), the per-target or per-row results as a pandas ``DataFrame`` (``r.rows``), images as tensors where
the job rebuilds them, the output folder (``r.out``, None in memory) and ``r.lines``, what the command
line prints.

Stability: the functions and result classes in ``fedsec.__all__`` and their keywords are the public
interface; keywords follow the command line's flags, so a flag renamed is a keyword renamed. A
deprecated flag or keyword keeps working for one release, with a ``FutureWarning`` naming its
replacement (the command line prints it as a ``warning:`` line), and is listed in the CHANGELOG.
Everything else (``fedsec.*`` modules, ``attacks``, ``fedecouple``) may change between releases.
"""
from __future__ import annotations

from fedecouple.errors import UserError

from . import field_names
from .bodies import BODIES
from .invocation import Shell
from .keywords import request
from .results import (AttackResult, AuditResult, CompareResult, DefendResult, MiaResult, ReportResult, Result,
                      TrainResult)

__all__ = ["train", "attack", "audit", "report", "defend", "mia", "compare", "Result", "TrainResult",
           "AttackResult", "AuditResult", "ReportResult", "DefendResult", "MiaResult", "CompareResult"]


# ------------------------------------------------------------------------------------------------
# the public functions: keywords are the flags of the command of the same name


def train(*, progress: bool = True, **options) -> TrainResult:
    """``fedsec train``: train a federation; ``rows`` are its metrics per round and client."""
    return _call("train", options, progress)


def attack(attack: str | None = None, *, progress: bool = True, **options) -> AttackResult:
    """``fedsec attack ATTACK``: train, record what the server receives, attack it, score it (``attack``
    None: the one in ``config``'s file)."""
    return _call("attack", options if attack is None else {"attack": attack, **options}, progress)


def audit(*, progress: bool = True, **options) -> AuditResult:
    """``fedsec audit``: what leaves each client, and what it gives away (findings with evidence)."""
    return _call("audit", options, progress)


def report(*, progress: bool = True, **options) -> ReportResult:
    """``fedsec report``: train, audit and attack several methods; one comparison."""
    return _call("report", options, progress)


def defend(*, progress: bool = True, **options) -> DefendResult:
    """``fedsec defend``: a defense swept over ``values`` (e.g. ``defense="dp", values="0.5,1"``)."""
    return _call("defend", options, progress)


def mia(*, progress: bool = True, **options) -> MiaResult:
    """``fedsec mia``: membership inference on the federation's models and uploads."""
    return _call("mia", options, progress)


def compare(*, progress: bool = True, **options) -> CompareResult:
    """``fedsec compare``: several methods on the same partitions and seeds; their accuracy."""
    return _call("compare", options, progress)


def _call(name: str, options: dict, progress: bool):
    """``options`` as the command's ``Request`` (each converted and checked, and counted as given), then
    the command's body. An engine error names the keywords that set its fields."""
    try:
        return _run(name, options, progress)
    except UserError as exc:
        translated = field_names.for_api(exc)
        if translated is exc:
            raise
        raise translated from exc.__cause__  # exc's cause, not exc: its message is shown once


def _run(name: str, options: dict, progress: bool):
    return BODIES[name](request(name, options), Shell(cli=False, progress=progress))
