"""A rank whose supervisor is gone stops as on SIGTERM: it finishes its step, saves a checkpoint and exits.

A supervisor killed with SIGKILL cannot stop its group, and ranks that trained on would hold the run
with no one to restart them or read their output. So each rank of a supervised group watches the
supervisor named by ``MLX_TRAIN_SUPERVISOR`` (``PID@HOST``): the rank's monitor thread asks every half
second whether the supervisor still runs (when it runs on the rank's host) and whether the rank's parent
changed (its launcher died and it was handed to another process), and once either is so sends the rank
SIGTERM, exactly once. (Not the kernel's parent-death signal, ``PR_SET_PDEATHSIG``: when a supervisor with
several threads is killed, its child passes from one dying thread to the next and gets the signal once per
thread, and a second SIGTERM stops a rank at once, without its checkpoint.)

The Trainer's SIGTERM handler then stops every rank at one step and rank 0 saves there.

Example::

    watch = SupervisorWatch.from_environment()     # None outside a supervised group
    if watch is not None:
        watch.check(rank=0)                         # SIGTERM to this process once the supervisor is gone
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from mlx_train import processes
from mlx_train.distributed.environment import supervisor_process


class SupervisorWatch:
    """Watches supervisor ``pid`` on ``host`` from a rank; ``check`` sends the rank SIGTERM once it is gone."""

    def __init__(self, pid: int, host: str) -> None:
        self.pid, self.host = pid, host
        self.local = host == socket.gethostname()
        self.started = processes.start_time(pid) if self.local else None
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
        """Once the supervisor is gone: say so and send this process SIGTERM, once (not with ``stop`` False: a
        rank already stopping, which only says why); True then."""
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
        if stop:
            os.kill(os.getpid(), signal.SIGTERM)
        return True
