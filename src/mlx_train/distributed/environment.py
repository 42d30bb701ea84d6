"""What a process learns from its environment about the group it belongs to: launched, supervised, which rank.

The supervisor (``mlx_train.launch``) sets these variables for its ranks, and the ranks, the CLI and
``mlx-train reset-distributed`` read them. This module needs neither MLX nor the training stack, so
that the supervisor process does not load them.

Environment set by the supervisor for its ranks: ``MLX_TRAIN_RUN_ID``, ``MLX_TRAIN_STATE_DIR``
(the run's ``distributed/`` folder, inside the run directory that holds the heartbeats),
``MLX_TRAIN_RUN_DIR`` (per-rank logs go to ``logs/rank-<r>.log``), ``MLX_TRAIN_ATTEMPT``
(0, 1, ... one per restart), ``MLX_TRAIN_BACKEND``, ``MLX_TRAIN_SUPERVISOR`` (``PID@HOST`` of the
supervisor, which its ranks watch) and, on restarts, ``MLX_TRAIN_RESUME=auto``.

Example::

    from mlx_train.distributed.environment import in_group, is_main_process
    if in_group() and not is_main_process():
        ...  # ranks other than 0 print nothing and write no files
"""

from __future__ import annotations

import os

ENV_RUN_ID = "MLX_TRAIN_RUN_ID"
ENV_STATE_DIR = "MLX_TRAIN_STATE_DIR"
ENV_RUN_DIR = "MLX_TRAIN_RUN_DIR"
ENV_ATTEMPT = "MLX_TRAIN_ATTEMPT"
ENV_RESUME = "MLX_TRAIN_RESUME"
ENV_BACKEND = "MLX_TRAIN_BACKEND"
ENV_SUPERVISOR = "MLX_TRAIN_SUPERVISOR"

def supervised() -> bool:
    """True inside a rank started by the mlx-train supervisor."""
    return bool(os.environ.get(ENV_STATE_DIR))


def supervisor_process() -> tuple[int, str] | None:
    """``(pid, host)`` of the supervisor that started this rank (None outside a supervised group).

    Example: ``supervisor_process()`` is ``(4242, "mac1")`` in a rank started with ``MLX_TRAIN_SUPERVISOR=4242@mac1``.
    """
    pid, _, host = os.environ.get(ENV_SUPERVISOR, "").partition("@")
    return (int(pid), host) if pid.isdigit() and host else None


def restart_resume() -> str | None:
    """``"auto"`` when the supervisor restarted this group (resume from the last checkpoint)."""
    return os.environ.get(ENV_RESUME) or None


def launched_rank() -> int | None:
    """This process's rank when a launcher started it (``MLX_RANK``, or MPI's), else None."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def is_main_process() -> bool:
    """False on the ranks other than 0 of a launched group (they print nothing and write no files)."""
    return (launched_rank() or 0) == 0


def in_group() -> bool:
    """True inside a launched or supervised group (the CLI then trains with a ``DistributedTrainer``)."""
    return launched_rank() is not None or supervised()
