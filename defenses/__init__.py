"""Client-side defenses: DP-SGD (a method wrapper), upload filters and the download check (channel
interceptors). They import ``fedecouple`` and ``attacks`` (the download check reads the malicious family's
crafted layer), never the command line.

* ``dp``: ``DPMethod`` / ``DPConfig`` — Opacus DP-SGD for every method's local training, with one
  accountant per client kept in client state (cumulative ε); ``dp_statistics``: the Gaussian mechanism
  for a method's whole-data statistics;
* ``filters``: ``FilterChain`` with ``GaussianNoise``, ``NormClip``, ``Prune``, ``Quantize``,
  ``Exclude`` — act on each upload's Δ before it leaves the client;
* ``download_check``: ``DownloadCheck`` — each client tests a download before training and refuses
  one that looks crafted;
* ``consistency_check``: ``ConsistencyCheck`` — under secure aggregation each client compares its
  download's digest with its masking-graph neighbours' and withholds its upload on a mismatch;
* ``registry``: ``DefenseSpec``, what ``fedsec defend`` needs of a defense (its value's meaning, where it
  acts, how a value is read and how the defense is built for a run).

Every choice of ``fedsec defend --defense`` is declared once, below (``DEFENSES``): its name, the
``DefenseSpec`` its module binds to a name (imported when the defense is first used) and its ``summary``, a
line the help can show without importing torch. Importing this package imports no torch; ``DPMethod``,
``FilterChain`` and the other classes are read from their modules on first access.

Adding a defense: one module in ``defenses/`` that defines it and binds its spec,
``MINE = DefenseSpec("mine", ...)``, plus its line here: ``DEFENSES.declare("mine", "defenses.mine:MINE",
summary="...")``. A defense outside this package (a user's own, a test's toy) is declared the same way at
run time: ``defenses.DEFENSES.declare("mine", "package.module:MINE", summary="...")``.
"""
from __future__ import annotations

from fedecouple.plugins import Plugins

from .registry import DefendedRun, DefenseSpec, register

DEFENSES = Plugins("defense")  # name → its DefenseSpec, in the command line's order
DEFENSES.declare("dp", "defenses.dp:DP",
                 summary="DP-SGD (Opacus) in every client's local training and a Gaussian mechanism for its "
                         "whole-data statistics; the value is the noise multiplier")
DEFENSES.declare("noise", "defenses.filters:NOISE",
                 summary="Gaussian noise on each upload's update; the value is its variance on the gradient")
DEFENSES.declare("clip", "defenses.filters:CLIP", summary="each upload's update clipped to an L2 norm bound")
DEFENSES.declare("prune", "defenses.filters:PRUNE",
                 summary="the smallest entries of each upload's update zeroed; the value is their percent")
DEFENSES.declare("quantize", "defenses.filters:QUANTIZE", summary="each upload's update quantised to k bits")
DEFENSES.declare("exclude", "defenses.filters:EXCLUDE",
                 summary="a field kind or name pattern dropped from every upload")
DEFENSES.declare("download-check", "defenses.download_check:DOWNLOAD_CHECK",
                 summary="every client tests each download and refuses a crafted one")
DEFENSES.declare("consistency-check", "defenses.consistency_check:CONSISTENCY_CHECK",
                 summary="under secure aggregation every client compares a digest of its download with its "
                         "neighbours' and withholds its upload on a mismatch")

_DP = ("DPConfig", "DPMethod", "epsilon", "privacy_report")
_FILTERS = ("Exclude", "FilterChain", "GaussianNoise", "NormClip", "Prune", "Quantize", "UploadFilter")


def get(name: str) -> DefenseSpec:
    """The spec of the defense declared as ``name`` (``KeyError`` naming the choices when there is none)."""
    if name not in DEFENSES:
        raise KeyError(f"unknown defense {name!r}; choose one of: {', '.join(DEFENSES)}")
    return DEFENSES[name]


def __getattr__(name: str):
    """``DPConfig``, ``DPMethod``, ``epsilon``, ``privacy_report`` and the upload filters, imported on first access."""
    if name in _DP:
        from . import dp

        return getattr(dp, name)
    if name in _FILTERS:
        from . import filters

        return getattr(filters, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFENSES", "DPConfig", "DPMethod", "DefendedRun", "DefenseSpec", "Exclude", "FilterChain",
           "GaussianNoise", "NormClip", "Prune", "Quantize", "UploadFilter", "epsilon", "get", "privacy_report",
           "register"]
