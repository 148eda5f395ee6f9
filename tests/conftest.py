from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

pytest_plugins = ["kwplug.testing"]

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


#: Test files that take minutes (differential runs against Accelerate, kill loops): collected
#: first, so that the suite's two workers (pytest-xdist, ``--dist loadfile``) start them at
#: once instead of one worker finishing them alone at the end.
_LONG_FILES = (
    "tests/parity/test_parity.py",
    "tests/compat/test_accelerate_scripts.py",
    "tests/checkpoint/test_checkpoint_kills.py",
    "tests/gates/test_quality.py",
    "tests/gates/test_benchmarks.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6 on) reorders --dist loadfile's files by their number of tests, most
    # first, unless told not to: the order above was lost and the one-test files that take a
    # minute or more (kill loops, test_exit.py, elastic restarts) ran last, one worker idle.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))

    def rank(item: pytest.Item) -> int:
        try:
            relative = Path(str(item.path)).relative_to(root).as_posix()
        except ValueError:
            return len(_LONG_FILES)
        return _LONG_FILES.index(relative) if relative in _LONG_FILES else len(_LONG_FILES)

    items.sort(key=rank)  # stable: the order inside a file and among the rest is kept


@pytest.fixture(autouse=True, scope="session")
def _private_discovery_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Tests (and the processes they start) keep discovery's on-disk cache out of the user's.
    saved = os.environ.get("KWPLUG_CACHE_DIR")
    os.environ["KWPLUG_CACHE_DIR"] = str(tmp_path_factory.mktemp("kwplug-cache"))
    yield
    if saved is None:
        os.environ.pop("KWPLUG_CACHE_DIR", None)
    else:
        os.environ["KWPLUG_CACHE_DIR"] = saved


@pytest.fixture(autouse=True, scope="session")
def _offline_trackers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # No test (nor a process it starts) reaches a tracking service or writes ./wandb, ./mlruns:
    # log_with="all" starts every installed tracker. Tests of a tracker point these at tmp_path.
    folder = tmp_path_factory.mktemp("trackers")
    values = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(folder),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",  # no capture of sys.stdout next to pytest's
        "MLFLOW_TRACKING_URI": (folder / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3.x refuses file: stores without it
        "COMET_START_ONLINE": "false",
        "COMET_OFFLINE_DIRECTORY": str(folder / "comet"),
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests in this process run as a plain single process, whatever the shell has set.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A one-process gloo group (in-memory store) for the test, destroyed after it."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        # torch's PowerSGD callbacks hold the group; give gloo's worker threads a moment to
        # release them, or the group's destructor may run on (and join) its own worker thread.
        # DDP modules the test built must go before the group too (a DDP module outliving its
        # group can abort the interpreter at exit).
        time.sleep(0.05)
        gc.collect()
        dist.destroy_process_group()
