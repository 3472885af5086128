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
* ``registry``: one ``DefenseSpec`` per choice of ``fedsec defend --defense`` (``DEFENSES``, ``get``).

Adding a defense: one module that defines it and calls ``register(DefenseSpec(...))``, plus its import
line here.
"""
# each module registers its defenses on import; this order is the registry's (the CLI's choices)
from . import dp, filters, download_check, consistency_check  # noqa: F401
from .dp import DPConfig, DPMethod, epsilon, privacy_report
from .filters import Exclude, FilterChain, GaussianNoise, NormClip, Prune, Quantize, UploadFilter
from .registry import DEFENSES, DefendedRun, DefenseSpec, get, register

__all__ = ["DEFENSES", "DPConfig", "DPMethod", "DefendedRun", "DefenseSpec", "Exclude", "FilterChain",
           "GaussianNoise", "NormClip", "Prune", "Quantize", "UploadFilter", "epsilon", "get", "privacy_report",
           "register"]
