"""The library behind the jobs of the command line and the Python API: ``attack``, ``audit``,
``compare``, ``defend``, ``mia`` and the ``report`` package. Each takes its settings and a folder and
writes its files (e.g. ``fedsec.jobs.attack.run_attack``); ``fedsec.bodies`` turns a command's flags
into those settings. Training a federation is ``fedsec.runner``'s.

They live in this package, not beside ``fedsec.api``, because ``fedsec.attack(...)``, ``fedsec.report(...)``
and the others are the API's functions: a submodule ``fedsec.attack`` would replace the function of its
name on the package once imported. Importing this package imports none of them.
"""
