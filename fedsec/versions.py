"""Package versions and the machine, written next to every result.

What repeats where: a seeded run gives bit-identical numbers again on the same machine with the same
torch thread count (and the same package versions). Across CPUs (Intel, AMD: other vector kernels)
or thread counts, float rounding differs: training numbers agree to rounding, while an attack's
optimisation, being chaotic, can end in another basin — compare such results by their intervals,
not digit for digit. ``machine()`` records what decides the rounding.
"""
from __future__ import annotations

import platform
import re
from functools import lru_cache
from importlib import metadata

PACKAGES = ("fedsec", "torch", "torchvision", "numpy", "scipy", "scikit-image", "opacus", "pandas", "mlxtend",
            "scikit-learn", "click")
REPRODUCIBILITY = ("bit-identical on the same machine with the same torch thread count and package versions; "
                   "across CPUs or thread counts float rounding differs and an attack's optimisation may end "
                   "elsewhere: compare by intervals")


def package_versions() -> dict[str, str]:
    """The versions in this process (a copy: callers may extend it)."""
    return dict(_package_versions())


@lru_cache(maxsize=1)
def _package_versions() -> dict[str, str]:
    # installed packages do not change under a running process; reading their metadata takes milliseconds
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The CPU, torch's BLAS and vector kernels, and the thread count in force: what float rounding
    depends on (torch's own build report, ``torch.__config__.show()``, for the BLAS)."""
    import torch

    build = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", build)
    return {"cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "blas": blas.group(1) if blas else "unknown", "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(), "reproducibility": REPRODUCIBILITY}


def provenance() -> dict:
    """What is written next to every result: package versions and the machine."""
    return {"versions": package_versions(), "machine": machine()}
