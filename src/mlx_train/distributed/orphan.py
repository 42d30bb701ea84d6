"""A rank whose supervisor is gone stops as on SIGTERM: it finishes its step, saves a checkpoint and exits.

A supervisor killed with SIGKILL cannot stop its group, and ranks that trained on would hold the run
with no one to restart them or read their output. So each rank of a supervised group watches the
supervisor named by ``MLX_TRAIN_SUPERVISOR`` (``PID@HOST``):

- on Linux, a rank whose parent is the supervisor (one local process, started without mlx.launch)
  has the kernel send it SIGTERM when that parent dies (``prctl(PR_SET_PDEATHSIG)``);
- everywhere, the rank's monitor thread asks every half second whether the supervisor still runs
  (when it runs on the rank's host) and whether the rank's parent changed (its launcher died and it
  was handed to init), and if not, sends the rank SIGTERM itself.

The Trainer's SIGTERM handler then stops every rank at one step and rank 0 saves there.

Example::

    watch = SupervisorWatch.from_environment()     # None outside a supervised group
    if watch is not None:
        watch.check(rank=0)                         # SIGTERM to this process once the supervisor is gone
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

from mlx_train import processes
from mlx_train.distributed.environment import supervisor_process

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _signal_when_parent_dies(signum: int) -> bool:
    """Linux: ask the kernel to send ``signum`` to this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class SupervisorWatch:
    """Watches supervisor ``pid`` on ``host`` from a rank; ``check`` sends the rank SIGTERM once it is gone."""

    def __init__(self, pid: int, host: str) -> None:
        self.pid, self.host = pid, host
        self.local = host == socket.gethostname()
        self.started = processes.start_time(pid) if self.local else None
        # The kernel's notice needs the supervisor to be the parent; armed before the parent is read
        # again, so that a parent that died in between is seen as a changed parent.
        self.kernel_notice = self.local and os.getppid() == pid and _signal_when_parent_dies(signal.SIGTERM)
        self.parent = os.getppid()
        self.stopped = False

    @classmethod
    def from_environment(cls) -> SupervisorWatch | None:
        """The watch of the supervisor that started this process (None outside a supervised group)."""
        found = supervisor_process()
        return cls(*found) if found is not None else None

    def gone(self) -> str | None:
        """Why this rank has lost its supervisor, or None while it has one."""
        if self.local and not processes.alive(self.pid, self.started):
            return f"the supervisor (pid {self.pid}) is gone"
        if os.getppid() != self.parent:
            return f"the launcher of this rank (pid {self.parent}) is gone"
        return None

    def check(self, rank: int, stop: bool = True) -> bool:
        """Once the supervisor is gone: say so and send this process SIGTERM (unless the kernel did, or not
        ``stop``: a rank already stopping, which only says why); True then."""
        if self.stopped:
            return True
        why = self.gone()
        if why is None:
            return False
        self.stopped = True
        try:
            print(f"mlx-train: {why}: rank {rank} stops after its current step and saves a checkpoint, as on "
                  "SIGTERM", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # a console that died with the supervisor: the stop matters, not the line
        if stop and not (self.kernel_notice and self.parent == self.pid):
            os.kill(os.getpid(), signal.SIGTERM)
        return True
