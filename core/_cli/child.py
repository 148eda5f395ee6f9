"""The ``kwplug`` command runs in a child process, so that a plugin's import cannot end or
hold the command silently.

Discovery isolates what a plugin *raises* at import (``SystemExit`` included), but nothing in
Python can catch ``os._exit(0)`` or a signal, and a non-daemon thread a plugin starts keeps
the interpreter from exiting. So the console command (:func:`run`) starts
``python -m kwplug <args>`` as a child that reports, through a pipe, each plugin it is about to
import (:func:`kwplug._plugins.listen_imports`) and ``done`` once its output is flushed; it
then ends with ``os._exit`` (a plugin's thread cannot keep it). When the child ends without
``done``, the plugin it was importing ended it: the command runs again with that plugin
blocked (``KWPLUG_BLOCK_PLUGINS``, ``<distribution>:<name>``), and the listing shows it
``failed``, naming how its import ended the process; stderr says so too. At most one run per
plugin. ``kwplug.cli.main(argv)`` called from Python runs in-process, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from kwplug._plugins import PluginRecord, listen_imports

#: The child's progress pipe (a file descriptor number); set only in the child.
PROGRESS_ENV = "_KWPLUG_CLI_PROGRESS"
#: ``{entry point name: why}`` for the plugins whose import ended an earlier child (JSON).
ENDED_ENV = "_KWPLUG_CLI_ENDED"
_BLOCK_ENV = "KWPLUG_BLOCK_PLUGINS"
_DONE = "done"


def in_child() -> bool:
    """Whether this process is the child of :func:`run`."""
    return PROGRESS_ENV in os.environ


def ended_plugins() -> dict[str, str]:
    """The plugins whose import ended an earlier child, with why (in the child; else ``{}``)."""
    raw = os.environ.get(ENDED_ENV)
    return dict(json.loads(raw)) if raw else {}


def child(argv: Sequence[str], main: Callable[[Sequence[str]], int]) -> NoReturn:
    """Run ``main(argv)`` as the child of :func:`run`: announce each plugin import on the
    progress pipe, flush the output, write ``done``, and end with ``os._exit`` (never
    returns normally)."""
    fd = int(os.environ.pop(PROGRESS_ENV))

    def announce(record: PluginRecord) -> None:
        line = f"import\t{record.name}\t{record.distribution or ''}\n"
        os.write(fd, line.encode())

    listen_imports(announce)
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 2)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # `| head` closed it: nothing to say
            stream.flush()
    os.write(fd, f"{_DONE}\n".encode())
    # A plugin's non-daemon thread would keep a normal exit waiting for ever.
    os._exit(status)


def _how(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}: os._exit() or the like"


def _start(argv: Sequence[str], ended: dict[str, str], blocked: list[str]) -> tuple[int, str]:
    # One child; its exit status and what it wrote on the progress pipe.
    read_end, write_end = os.pipe()
    env = {**os.environ, PROGRESS_ENV: str(write_end), ENDED_ENV: json.dumps(ended)}
    if blocked:
        env[_BLOCK_ENV] = ",".join(filter(None, [os.environ.get(_BLOCK_ENV, ""), *blocked]))
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kwplug", *argv], env=env, pass_fds=(write_end,)
        )
    finally:
        os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:  # EOF once the child (and the fd) are gone
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    return process.wait(), b"".join(chunks).decode(errors="replace")


def run(argv: Sequence[str]) -> int:
    """The console command: ``argv`` run in a child process (see the module docstring).

    Returns:
        The child's exit status; ``1`` when it ended without finishing and no plugin import
        explains it.
    """
    ended: dict[str, str] = {}
    blocked: list[str] = []
    while True:
        try:
            status, progress = _start(argv, ended, blocked)
        except KeyboardInterrupt:  # the child got the same Ctrl-C and says so itself
            return 130
        lines = progress.splitlines()
        if lines[-1:] == [_DONE]:
            return status
        last = lines[-1].split("\t") if lines else []
        if len(last) != 3 or last[0] != "import" or last[1] in ended:
            print(
                f"kwplug: the command's process ended before finishing ({_how(status)}) and "
                "not while importing a plugin",
                file=sys.stderr,
            )
            return status or 1
        _, name, distribution = last
        why = f"its import ended the process ({_how(status)})"
        ended[name] = why
        blocked.append(f"{distribution}:{name}" if distribution else name)
        shown = f"{name!r} ({distribution})" if distribution else repr(name)
        print(
            f"kwplug: handler plugin {shown} failed: {why}; listed as failed, the command ran "
            "again without it",
            file=sys.stderr,
        )
