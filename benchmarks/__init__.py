"""Benchmarks: kwplug against raw PyTorch (the floor) and Hugging Face Accelerate, side by side.

Each module is a command, ``python -m benchmarks.<name> [--quick] [--json PATH]``, and
``python -m benchmarks [--quick] [--json PATH]`` runs them all (each in a fresh process) and
prints the combined three-way table. Accelerate is compared when it is installed
(``pip install -e ".[bench]"``). See docs/benchmarks.md for the measured figures.
"""

#: The benchmark modules, in the order ``python -m benchmarks`` runs them.
BENCHMARKS: tuple[str, ...] = (
    "step_overhead",
    "autocast_enter",
    "dispatch",
    "construct_import",
    "per_call",
    "ddp_2proc",
)
