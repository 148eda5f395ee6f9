"""Architecture gate (issue 29): imports run down kwplug's layers, without circles, without
function-local imports that only break a loop, and without private names crossing a package
boundary. Counted over the source with ``ast`` (:mod:`import_graph`): module-level,
function-local and ``if TYPE_CHECKING:`` imports all count.

The layer table is docs/architecture.md's ("Layers"); a new module must be placed in it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from import_graph import (
    Graph,
    build,
    cycles,
    layer_violations,
    loop_breakers,
    private_crossings,
)

ROOT = Path(__file__).parents[2]

#: Bottom first. A module may import modules of its own layer and of the layers below. An
#: entry ``"a.b"`` names module ``a.b`` and everything under it, ``"a.b."`` everything under
#: it, ``"=a.b"`` that module alone (a package's face); the longest matching entry wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "contracts",
        (
            "kwplug.errors",
            "kwplug.validators",
            "kwplug.handler",
            "kwplug.hookspecs",
            "kwplug.precision",
            "kwplug.comm_hooks",
            "kwplug.attached_state",
            "kwplug.tracking",
            # what the contracts are built from: hook spec declarations, answer types, the
            # ADDITIVE merge, the faces' lazy tables
            "kwplug._contracts",
        ),
    ),
    (
        "machinery",
        (
            "kwplug._plugins",
            "kwplug._runtime",
            # this process and those it starts: ProcessInfo, the rank-aware logger adapter the
            # checkpoint package logs Accelerate's save/load lines through (issue 28), umask
            # file modes, the forked test jobs
            "kwplug._process",
            "kwplug.config",
            "kwplug.utils.",  # every module of kwplug.utils (its face is an entry point, below)
        ),
    ),
    (
        "building blocks",
        (
            "kwplug.checkpoint",
            "kwplug._data",
            "kwplug.data",
            "kwplug.optimizer",
            "kwplug.scheduler",
        ),
    ),
    ("plugins", ("kwplug.plugins",)),
    ("accelerator", ("kwplug.accelerator",)),
    (
        "accelerate surface",
        (
            "kwplug.state",
            "kwplug.data_loader",
            "kwplug.logging",
            "kwplug.launchers",
            "kwplug.local_sgd",
            "kwplug.big_modeling",
            "kwplug.hooks",
            "kwplug.parallelism_config",
            # their private parts: GradientState, Accelerate's tracker names kwplug has no
            # plugin for (kwplug.tracking's lazy table)
            "kwplug._accelerate",
        ),
    ),
    (
        "faces and tools",
        (
            "=kwplug",
            "=kwplug.utils",
            # kwplug's face under Accelerate's name and version (``import kwplug.accelerate as
            # accelerate``): the top of the Accelerate-compatible surface, above kwplug's face
            "kwplug.accelerate",
            "kwplug.cli",
            "kwplug._cli",  # kwplug launch and its config file, kwplug env's text, the child
            "kwplug.__main__",
            "kwplug.testing",
        ),
    ),
)

#: The imports allowed to point up a layer (at most 2), each with its reason.
UPWARD = {
    # ``accelerator.state`` is Accelerate's AcceleratorState describing this Accelerator; the
    # class lives in the layer above, which imports nothing of the Accelerator (no circle).
    ("kwplug.accelerator._api_process", "kwplug.state"),
}

#: Import circles still there (none). The test fails on a new circle and on one of these
#: disappearing.
KNOWN_CIRCLES: set[frozenset[str]] = set()

#: Function-local imports that only break one of those circles.
KNOWN_LOOP_BREAKERS: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``.

    Raises:
        KeyError: no entry matches (place the module in the table).
    """
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.startswith("="):
                hit = module == entry[1:]
            elif entry.endswith("."):
                hit = module.startswith(entry)
            else:
                hit = module == entry or module.startswith(entry + ".")
            if hit and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/gates/test_layers.py's LAYERS")
    return best[1]


def counts(root: Path) -> dict[str, int]:
    """The four counts for the checkout at ``root`` (issue 29's "Done when")."""
    graph = build(root)
    layers = {module: layer_of(module) for module in graph.files}
    breakers = {(i.source, i.line, i.target) for i in loop_breakers(graph)}
    return {
        "upward imports": len(layer_violations(graph, layers)),
        "circles": len(cycles(graph.edges())),
        "loop-breaking function-local imports": len(breakers),
        "private names across packages": len(private_crossings(graph)),
    }


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build(ROOT)


def test_every_module_has_a_layer(graph: Graph) -> None:
    unplaced = []
    for module in graph.files:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == []


def test_imports_point_down_the_layers(graph: Graph) -> None:
    layers = {module: layer_of(module) for module in graph.files}
    upward = {(i.source, i.target): i for i in layer_violations(graph, layers)}
    shown = [
        f"{i.source}:{i.line} ({LAYERS[layers[i.source]][0]}) imports {i.target} "
        f"({LAYERS[layers[i.target]][0]})"
        for pair, i in upward.items()
        if pair not in UPWARD
    ]
    assert shown == [], "imports pointing up the layers"
    assert set(upward) == UPWARD, "an allowed upward import is gone: remove it from UPWARD"
    assert len(UPWARD) <= 2


def test_no_new_import_circle(graph: Graph) -> None:
    found = set(cycles(graph.edges()))
    assert sorted(map(sorted, found - KNOWN_CIRCLES)) == [], "new import circles"
    assert sorted(map(sorted, KNOWN_CIRCLES - found)) == [], "gone: remove from KNOWN_CIRCLES"


def test_no_function_local_import_only_breaks_a_loop(graph: Graph) -> None:
    found = {(i.source, i.target): i for i in loop_breakers(graph)}
    new = [
        f"{i.source}:{i.line} -> {i.target}"
        for pair, i in found.items()
        if pair not in KNOWN_LOOP_BREAKERS
    ]
    assert new == [], "function-local imports whose target imports the importer at module level"
    assert set(found) == KNOWN_LOOP_BREAKERS, "gone: remove from KNOWN_LOOP_BREAKERS"


def test_no_private_name_crosses_a_package_boundary(graph: Graph) -> None:
    # None allowed: kwplug.plugins' face has its own PEP 562 look-up (a third-party plugin's
    # rules), so no private module or name is imported from outside the package owning it.
    found = [
        f"{i.source}:{i.line} imports {i.path} (private to {owner})"
        for i, owner in private_crossings(graph)
    ]
    assert found == [], "private names imported from outside their package"


def test_core_top_level_holds_no_private_module(graph: Graph) -> None:
    # Private modules live in a private folder named for what they are (docs/architecture.md,
    # "The layout of core/"); core/'s top level holds the public module names only.
    loose = [
        m
        for m in graph.files
        if m.count(".") == 1
        and m.split(".")[1].startswith("_")
        and not m.endswith("__main__")
        and m not in graph.packages
    ]
    assert loose == []


def test_each_private_folder_is_one_layer(graph: Graph) -> None:
    folders: dict[str, set[str]] = {}
    for module in graph.files:
        parts = module.split(".")
        if len(parts) > 1 and parts[1].startswith("_") and f"kwplug.{parts[1]}" in graph.packages:
            folders.setdefault(parts[1], set()).add(LAYERS[layer_of(module)][0])
    assert folders, "no private folder found"
    assert {f: layers for f, layers in folders.items() if len(layers) > 1} == {}


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_counts_see_each_kind_of_problem(tmp_path: Path) -> None:
    # A made-up checkout with one of each: the gate must be able to fail.
    _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/errors.py": "def f():\n    from kwplug import state\n",
            "core/state.py": (
                "from kwplug.errors import f\nfrom kwplug.accelerator._setup import _x\n"
            ),
            "core/accelerator/__init__.py": "from kwplug.accelerator._setup import run\n",
            "core/accelerator/_setup.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kwplug.state\n"
                "_x = 1\ndef run():\n    pass\n"
            ),
            "plugins/__init__.py": "",
        },
    )
    graph = build(tmp_path)
    layers = {m: layer_of(m) for m in graph.files}
    assert {(i.source, i.target) for i in layer_violations(graph, layers)} == {
        ("kwplug.errors", "kwplug.state"),
        ("kwplug.accelerator._setup", "kwplug.state"),
    }
    # two loops through kwplug.state: one circle (a strongly connected component)
    assert sorted(map(sorted, cycles(graph.edges()))) == [
        ["kwplug.accelerator._setup", "kwplug.errors", "kwplug.state"]
    ]
    assert [(i.source, i.target, i.kind) for i in loop_breakers(graph)] == [
        ("kwplug.errors", "kwplug.state", "function")
    ]
    assert [(i.source, owner) for i, owner in private_crossings(graph)] == [
        ("kwplug.state", "kwplug.accelerator")
    ]
    assert counts(tmp_path) == {
        "upward imports": 2,
        "circles": 1,
        "loop-breaking function-local imports": 1,
        "private names across packages": 1,
    }


if __name__ == "__main__":  # python tests/gates/test_layers.py [ROOT]: the four counts
    import sys

    print(counts(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
