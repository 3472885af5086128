"""Package versions written next to every result."""
from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("fedsec", "torch", "torchvision", "numpy", "scipy", "scikit-image", "opacus", "pandas", "mlxtend",
            "scikit-learn", "click")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
