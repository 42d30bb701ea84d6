"""Ctrl-C at the very start of the ``mlx-train`` command: one line and exit code 130, never a traceback.

The command's own ``KeyboardInterrupt`` handling (``cli.main.main``) starts only once its modules are
imported, a few tenths of a second in. Before that, in a process started as the command (``mlx-train``
or ``python -m mlx_train``), SIGINT prints ``mlx-train: interrupted`` and ends the process at once:
nothing has been written then. ``mlx_train/__init__`` calls ``guard()`` before anything else; ``main``
gives SIGINT back to Python (``release()``) inside its ``try``. A program that imports mlx_train keeps
its own SIGINT handling, and a SIGINT the process was started to ignore stays ignored.

This module runs before every other part of mlx_train, and imports only modules built into the interpreter
(``_signal`` rather than ``signal``, which is looked for on ``sys.path``), so that its own import is as short
as it can be: a Ctrl-C can land there too.

Example::

    from mlx_train import _start
    _start.guard()      # first thing in the package
    ...
    _start.release()    # main() catches KeyboardInterrupt from here on
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C module: no stub, no search on sys.path
import atexit
import os
import sys
import time
from types import FrameType  # (already imported by the interpreter's start)

HOLD_ENV = "MLX_TRAIN_HOLD_AT_START"  # test hook: the point to wait at (see hold)
INTERRUPTED = b"mlx-train: interrupted\n"


def started_as_command() -> bool:
    """True in a process started as the command: the ``mlx-train`` script or ``python -m mlx_train``."""
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv[1:]:
        after = argv.index("-m", 1) + 1
        return argv[after:after + 1] == ["mlx_train"]
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return os.path.splitext(script)[0] == "mlx-train"


def _interrupted(signum: int, frame: FrameType | None) -> None:
    os.write(2, INTERRUPTED)
    os._exit(128 + signum)


def guard() -> None:
    """In the command's process, make SIGINT end it with one line until ``release``."""
    if started_as_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _interrupted)
    hold("start")


def release() -> None:
    """Give SIGINT back to Python (``KeyboardInterrupt``), where the command catches it."""
    if _signal.getsignal(_signal.SIGINT) is _interrupted:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def end(code: int) -> None:
    """In the command's process, exit now with ``code``, after the exit handlers and a flush. Python would
    otherwise end a process whose KeyboardInterrupt was raised inside ``exec``'d code (dataclasses, namedtuple
    build their methods so) by SIGINT, whatever ``main`` returned; elsewhere, return."""
    if not started_as_command():
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def hold(point: str) -> None:
    """Test hook, not a feature: with ``MLX_TRAIN_HOLD_AT_START=point``, say so on stderr and wait there (up to a
    minute) for a signal, so that a test interrupts the command at a moment the command reports."""
    if os.environ.get(HOLD_ENV) != point:
        return
    os.write(2, f"mlx-train test hook: held at {point}\n".encode())
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        time.sleep(0.01)
