"""Private machinery about this process and the processes it starts, below the Accelerator
and the checkpoint package (docs/architecture.md, "Layers").

- ``environment``: where this process runs (``ProcessInfo``), the built-in device choice,
  ending the process group.
- ``rank_logging``: the rank-aware logger adapter under :mod:`kwplug.logging`.
- ``umask``: file modes that follow the process's umask.
- ``forked``, ``forked_wait``: jobs of N ranks (and single processes) forked from a server
  that imported torch once, for :mod:`kwplug.testing` and the test suite.

No face: each module is imported by its own path, so that importing one (``environment``, by
nearly every module) never imports the others (``forked`` starts a forkserver).
"""
