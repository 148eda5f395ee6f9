"""``kwplug.testing``: the kit for testing kwplug handler plugins (and kwplug itself).

Enable the pytest fixtures in a plugin's ``conftest.py`` with
``pytest_plugins = ["kwplug.testing"]``. The fixture ``kwplug_plugins`` is a
:class:`PluginSandbox` (discovery isolated to kwplug's built-ins and the plugins the test adds
or keeps, ``KWPLUG_*`` variables cleared); ``kwplug_plugin_manager`` is the
``pluggy.PluginManager`` built in that sandbox. :func:`check_handler` is the conformance check
of a handler class, :func:`run_distributed` calls a function in N CPU processes under
torchrun (gloo), :func:`run_script` runs a script there and :func:`run_torchrun` returns such
a job's exit status and output, and :func:`resize_hook_state` applies a communication hook's
``resize`` rule as a resume on another number of processes does. The fixtures need pytest
(``pip install "kwplug[testing]"``).
"""

from __future__ import annotations

from kwplug.errors import DistributedRunError
from kwplug.testing.conformance import check_handler, conformance_problems
from kwplug.testing.distributed import free_port, run_distributed, run_script, run_torchrun
from kwplug.testing.fixtures import kwplug_plugin_manager, kwplug_plugins
from kwplug.testing.resize import resize_hook_state
from kwplug.testing.sandbox import PluginSandbox

__all__ = [
    "DistributedRunError",
    "PluginSandbox",
    "check_handler",
    "conformance_problems",
    "free_port",
    "kwplug_plugin_manager",
    "kwplug_plugins",
    "resize_hook_state",
    "run_distributed",
    "run_script",
    "run_torchrun",
]
