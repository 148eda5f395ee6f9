"""Accelerate's own pytest files on kwplug (issue 28, item 3): a developer tool, not a test.

Accelerate's ``tests/test_*.py`` are not in the wheel, but they are in its source
distribution on PyPI, at exactly the installed release: ``--sdist PATH`` reads them from that
archive (``pip download accelerate==<installed version> --no-binary :all: --no-deps -d DIR``
writes ``DIR/accelerate-<version>.tar.gz``; a package registry is all it needs). Otherwise they
come from a git mirror of huggingface/accelerate (``--mirror``; the ``fetch`` tool leaves one
under ``/work/.mirror``) at ``--ref`` (default: the tag of the installed release,
``v<accelerate.__version__>``, else ``HEAD``, said in the output). Each file runs twice with
pytest on the CPU, in a fresh temporary copy of that ``tests/`` folder:

* **accelerate**: as written;
* **kwplug**: with only its import statements renamed (:func:`rename_imports`).

``accelerate.test_utils`` (decorators, ``AccelerateTestCase``, ``RegressionModel``) stays
Accelerate's in both runs: it is the test kit, not the library under test. A test is
*counted* when it passes under Accelerate; the table gives, per file, how many of the counted
tests pass on kwplug, and the failures' first lines.

Needs network-free inputs only (the archive or the mirror), plus ``parameterized``, which the
files import. Run from the repository root::

    .venv/bin/python -m pip download "accelerate==$(.venv/bin/python -c 'import accelerate; \
        print(accelerate.__version__)')" --no-binary :all: --no-deps -d /tmp/sdist
    .venv/bin/python tests/compat/peer_suite.py --sdist /tmp/sdist/accelerate-*.tar.gz
    .venv/bin/python tests/compat/peer_suite.py --mirror /work/.mirror/huggingface+accelerate/repo
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

#: The files run by default: Accelerate's tests of what kwplug implements (the Accelerator,
#: data loaders, handlers, schedulers, utilities, checkpointing, logging, memory, trackers,
#: optimizers). Left out: big-model inference (test_big_modeling, test_modeling_utils,
#: test_hooks, test_offload, test_quantization, test_load_checkpoint_and_dispatch_*), the
#: command line and launcher (test_cli, test_launch, test_examples, test_sagemaker, test_tpu),
#: DeepSpeed/FSDP1/FP8 folders, and the files that only start Accelerate's shipped scripts
#: (test_cpu, test_grad_sync, test_metrics, test_multidevice: tests/compat runs those scripts).
FILES: tuple[str, ...] = (
    "test_accelerator.py",
    "test_data_loader.py",
    "test_kwargs_handlers.py",
    "test_scheduler.py",
    "test_utils.py",
    "test_state_checkpointing.py",
    "test_optimizer.py",
    "test_logging.py",
    "test_memory_utils.py",
    "test_tracking.py",
)

_KIT = "accelerate.test_utils"


def rename_imports(source: str) -> str:
    """``source`` with ``from accelerate[.sub] import`` -> ``from kwplug[.sub] import`` and
    ``import accelerate[.sub]`` -> ``import kwplug[.sub]`` on import statements found by
    :mod:`ast` (strings, such as ``mock.patch("accelerate.x")`` targets, are untouched), except
    ``accelerate.test_utils``, the test kit."""
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] != "accelerate":
                continue
            if module == _KIT or module.startswith(_KIT + "."):
                continue
            renamed = "kwplug" + module[len("accelerate") :]
            for lineno in range(node.lineno - 1, (node.end_lineno or node.lineno)):
                pattern = rf"(?<![\w.]){re.escape(module)}(?![\w])"
                new, count = re.subn(pattern, renamed, lines[lineno], count=1)
                if count:
                    lines[lineno] = new
                    break
    return "".join(lines)


def _submodule(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def drop_missing(source: str, library: str = "accelerate") -> tuple[str, list[str]]:
    """``source`` without the names its ``from <library>... import`` statements ask for but
    the installed ``library`` lacks, each bound to ``None`` instead on the statement's last
    line (line numbers kept), so that only the tests using one fail, not the whole file; and
    the names dropped. For accelerate: tests newer or older than the wheel (failing under both
    libraries, hence not counted). For kwplug (``--lenient``, a diagnostic): what each test
    meets beyond the imports."""
    lines = source.splitlines(keepends=True)
    dropped: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] != library or ".test_utils" in node.module:
            continue
        try:
            module = importlib.import_module(node.module)
        except ImportError:
            module = None
        missing = [
            alias
            for alias in node.names
            if module is None
            or not (
                hasattr(module, alias.name)
                or (hasattr(module, "__path__") and _submodule(f"{node.module}.{alias.name}"))
            )
        ]
        if not missing:
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        indent = " " * node.col_offset
        bound = "; ".join(f"{a.asname or a.name} = None" for a in missing)
        kept = [a for a in node.names if a not in missing]
        statement = ""
        if kept:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
            statement = f"from {node.module} import {names}; "
        lines[first] = f"{indent}{statement}{bound}  # not in {library}\n"
        for index in range(first + 1, last + 1):
            lines[index] = "\n"
        dropped.extend(f"{node.module}.{a.name}" for a in missing)
    return "".join(lines), dropped


def default_ref(mirror: Path) -> str:
    """``v<installed accelerate>`` when the mirror has that tag, else ``HEAD``."""
    tag = "v" + importlib.metadata.version("accelerate")
    found = subprocess.run(
        ["git", "-C", str(mirror), "rev-parse", "--verify", "-q", f"refs/tags/{tag}"],
        capture_output=True,
        check=False,
    )
    return tag if found.returncode == 0 else "HEAD"


def extract(mirror: Path, ref: str, into: Path) -> None:
    """The mirror's ``tests/`` folder at ``ref``, written under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(mirror), "archive", ref, "tests"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def extract_sdist(archive: Path, into: Path) -> None:
    """The ``tests/`` folder of Accelerate's source distribution ``archive``, written under
    ``into`` (members outside ``<name>/tests/`` are skipped; tarfile's ``data`` filter refuses
    links and paths that leave ``into``)."""
    import tarfile

    with tarfile.open(archive) as sdist:
        members = []
        for member in sdist.getmembers():
            parts = member.name.split("/")
            if len(parts) > 2 and parts[1] == "tests":
                member.name = "/".join(parts[1:])
                members.append(member)
        if not members:
            raise SystemExit(f"{archive}: no tests/ folder in this source distribution")
        sdist.extractall(into, members=members, filter="data")


def run_pytest(root: Path, files: Sequence[str], timeout: int) -> dict[str, dict[str, str]]:
    """``{file: {test id: outcome or first error line}}`` of one pytest run in ``root``."""
    report = root / "report.xml"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov",
        "-o", "addopts=", "--continue-on-collection-errors", f"--rootdir={root}",
        f"--timeout={timeout}", f"--junitxml={report}", *[f"tests/{name}" for name in files],
    ]  # fmt: skip
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    subprocess.run(command, cwd=root, env=environment, capture_output=True, check=False)
    results: dict[str, dict[str, str]] = {name: {} for name in files}
    for case in ET.parse(report).getroot().iter("testcase"):
        classname = case.get("classname", "")
        name = next((f for f in files if classname.startswith("tests." + f[:-3])), None)
        if name is None:  # a collection error: reported against the file
            name = next((f for f in files if f[:-3] in case.get("name", "")), files[0])
        outcome = "pass"
        for child in case:
            if child.tag in ("failure", "error"):
                lines = [ln for ln in (child.text or "").splitlines() if ln.startswith("E  ")]
                first = lines[-1][1:].strip() if lines else (child.get("message") or "")
                outcome = "fail: " + first[:160]
            elif child.tag == "skipped":
                outcome = "skip"
        results[name][f"{classname.split('.')[-1]}::{case.get('name')}"] = outcome
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mirror", type=Path, default=Path("/work/.mirror/huggingface+accelerate/repo")
    )
    parser.add_argument("--ref", default=None)
    parser.add_argument(
        "--sdist", type=Path, default=None, help="Accelerate's source archive (instead of --mirror)"
    )
    parser.add_argument("--files", nargs="*", default=list(FILES))
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    parser.add_argument(
        "--reference", type=Path, default=None, help="reuse the accelerate outcomes of a --json"
    )
    parser.add_argument(
        "--lenient", action="store_true", help="kwplug's missing names bound to None (diagnostic)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="list kwplug failures")
    args = parser.parse_args(argv)
    if args.sdist:
        ref = commit = args.sdist.name
    else:
        ref = args.ref or default_ref(args.mirror)
        commit = subprocess.run(
            ["git", "-C", str(args.mirror), "rev-parse", "--short", ref],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    print(f"accelerate tests at {ref} ({commit}); installed accelerate "
          f"{importlib.metadata.version('accelerate')}")  # fmt: skip
    outcomes: dict[str, dict[str, dict[str, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.reference:
            outcomes["accelerate"] = json.loads(args.reference.read_text())["accelerate"]
        for library in ("accelerate", "kwplug"):
            if library in outcomes:
                continue
            root = Path(tmp) / library
            root.mkdir()
            if args.sdist:
                extract_sdist(args.sdist, root)
            else:
                extract(args.mirror, ref, root)
            for name in args.files:
                path = root / "tests" / name
                source, dropped = drop_missing(path.read_text())
                if dropped and library == "accelerate":
                    print(f"{name}: not in the installed accelerate: {', '.join(dropped)}")
                if library == "kwplug":
                    source = rename_imports(source)
                    if args.lenient:
                        source, dropped = drop_missing(source, "kwplug")
                        print(f"{name}: lenient, not in kwplug: {', '.join(dropped) or '-'}")
                path.write_text(source)
            outcomes[library] = run_pytest(root, args.files, args.timeout)
    total_counted = total_passed = 0
    print(f"{'file':32} {'counted':>7} {'kwplug':>7}   (accelerate: fail/skip)")
    for name in args.files:
        reference, candidate = outcomes["accelerate"][name], outcomes["kwplug"][name]
        counted = [test for test, outcome in reference.items() if outcome == "pass"]
        passed = [test for test in counted if candidate.get(test) == "pass"]
        other = len(reference) - len(counted)
        total_counted += len(counted)
        total_passed += len(passed)
        print(f"{name:32} {len(counted):7} {len(passed):7}   ({other})")
        if args.verbose:
            collection = [o for t, o in candidate.items() if t.startswith("::")]
            for outcome in collection:
                print(f"    <collection>: {outcome}")
            for test in counted if not collection else ():
                if candidate.get(test) != "pass":
                    print(f"    {test}: {candidate.get(test, 'not run')}")
    share = 100 * total_passed / total_counted if total_counted else 0.0
    print(f"{'total':32} {total_counted:7} {total_passed:7}   {share:.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"ref": ref, "commit": commit, **outcomes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
