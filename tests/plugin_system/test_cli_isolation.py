"""``kwplug plugins`` survives plugins that end or hold the process at import (issue 30 item 4):
before, a plugin calling ``os._exit(0)`` ended the listing with status 0 and no output, and one
leaving a non-daemon thread made the command never exit. Each plugin is pip-installed for
real and the command runs as a real process (``python -m kwplug``, the console script's
code path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from plugin_site import install_module_plugins

HOOK = """
import kwplug
@kwplug.hookimpl
def trackers():
    return {}
"""

PLUGINS = {
    "exitzero": "import os\nos._exit(0)\n",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "sysexit": "import sys\nsys.exit(4)\n",
    # Loads fine, and leaves a thread that would keep the interpreter alive for an hour.
    "threadleft": "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()\n" + HOOK,
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_module_plugins(
        {ep: textwrap.dedent(source) for ep, source in PLUGINS.items()},
        tmp_path_factory.mktemp("cli_isolation"),
    )


def kwplug_command(
    site: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    full_env = {**os.environ, "PYTHONPATH": str(site), "KWPLUG_NO_CACHE": "1", **env}
    full_env.pop("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kwplug", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return done, time.monotonic() - started


def test_plugins_ending_the_process_are_listed_failed_by_name(site: Path) -> None:
    done, seconds = kwplug_command(site, "plugins", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    exitzero, killed = rows["exitzero"], rows["killed"]
    assert exitzero["status"] == killed["status"] == "failed"
    assert exitzero["distribution"] == "kwplug-exitzero"
    assert exitzero["error"] == (
        "its import ended the process (exit status 0: os._exit() or the like)"
    )
    assert killed["error"] == "its import ended the process (killed by SIGKILL)"
    assert rows["sysexit"]["status"] == "failed"
    assert rows["sysexit"]["error"] == "SystemExit: 4"
    # The thread's plugin loads, and the command still exits (the thread sleeps for an hour).
    assert rows["threadleft"]["status"] == "loaded"
    assert rows["ddp"]["status"] == "loaded"  # the built-ins are listed as usual
    assert "handler plugin 'exitzero' (kwplug-exitzero) failed" in done.stderr
    assert "handler plugin 'killed' (kwplug-killed) failed" in done.stderr
    assert seconds < 120


def test_the_table_under_strict_mode(site: Path) -> None:
    # KWPLUG_STRICT_PLUGINS: the table still prints, and the status says a run would stop.
    done, _ = kwplug_command(site, "plugins", KWPLUG_STRICT_PLUGINS="1")
    assert done.returncode == 1, done.stderr
    lines = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert lines["exitzero"][-2:] == ["failed", "third-party"]
    assert lines["killed"][-2:] == ["failed", "third-party"]
    assert lines["threadleft"][-2:] == ["loaded", "third-party"]
    strict_error = done.stderr.splitlines()[-1]
    assert strict_error.startswith("kwplug: ") and "exitzero" in strict_error


def test_usage_errors_and_help_keep_their_status(site: Path) -> None:
    done, _ = kwplug_command(site, "plugins", "--no-such-flag")
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in done.stderr
    helped, _ = kwplug_command(site, "--help")
    assert helped.returncode == 0
    assert "usage: kwplug" in helped.stdout
