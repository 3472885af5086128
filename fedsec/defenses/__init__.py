"""Client-side defenses: upload filters (channel interceptors) and DP-SGD (a method wrapper).

* ``filters``: ``FilterChain`` with ``GaussianNoise``, ``NormClip``, ``Prune``, ``Quantize``,
  ``Exclude`` — act on each upload's Δ before it leaves the client;
* ``dp``: ``DPMethod`` / ``DPConfig`` — Opacus DP-SGD for every method's local training, with one
  accountant per client kept in client state (cumulative ε).
"""
from .dp import DPConfig, DPMethod, epsilon, privacy_report
from .filters import Exclude, FilterChain, GaussianNoise, NormClip, Prune, Quantize, UploadFilter

__all__ = ["DPConfig", "DPMethod", "Exclude", "FilterChain", "GaussianNoise", "NormClip", "Prune", "Quantize",
           "UploadFilter", "epsilon", "privacy_report"]
