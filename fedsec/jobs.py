"""``fedsec.attack`` is both a module (the library behind ``fedsec attack``) and the API function
``fedsec.attack(...)``: importing a submodule sets the package's attribute of its name to the module,
which would shadow the function, so the modules that share a name with an API function (attack, audit,
report, defend, mia, compare) are made callable here: calling one calls ``fedsec.api``'s function."""
from __future__ import annotations

import sys
import types


class JobModule(types.ModuleType):
    """A module that, called, runs the ``fedsec.api`` function of its name."""

    def __call__(self, *args, **kwargs):
        from . import api

        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


def make_callable(module_name: str) -> None:
    """Make the module ``module_name`` (one of ``fedsec``'s job modules) callable as its API function."""
    sys.modules[module_name].__class__ = JobModule
