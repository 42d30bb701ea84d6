"""Which checkpoint a run resumes from, the global batch it must keep, the locks that keep one run per
directory, and what a new run does in a directory that holds a run (refused; with ``overwrite`` the old
run is moved aside first).

Example::

    with run_locks(checkpoints, "runs/a", main=True):
        for path in resume_candidates(checkpoints, "auto", print):
            ...                                    # the newest first, then older ones to fall back on
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mlx_train import rundir
from mlx_train.checkpointing.lock import RunLock
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.config import TrainConfig
from mlx_train.data import DataLoader
from mlx_train.errors import CheckpointError, ConfigError


def resume_candidates(checkpoints: CheckpointManager | None, resume: str | None,
                      log: Callable[[str], None]) -> list[str]:
    """Checkpoints to try, newest first: one for an explicit path; for "auto" every complete one.

    "auto" with no checkpoint yet starts from scratch; with checkpoints that are all damaged it
    refuses (starting over silently would hide the damage).
    """
    if not resume:
        return []
    if resume != "auto":
        # A path resolves to a checked path (or raises), never None.
        return [checkpoints.resolve(resume) if checkpoints is not None else resume]  # type: ignore[list-item]
    if checkpoints is None:
        raise ConfigError("resume='auto' needs a checkpoint_dir to look in; pass checkpoint_dir=... or a "
                          "checkpoint path")
    newest = checkpoints.resolve("auto")
    if newest is None:
        if checkpoints.has_step_directories():
            raise CheckpointError(
                f"every checkpoint in {checkpoints.directory} is incomplete or damaged (see the warnings above), "
                "so there is nothing to resume from. To start fresh, use a new checkpoint_dir or remove those "
                "checkpoints; nothing was deleted")
        log(f"no checkpoint in {checkpoints.directory} yet; starting from scratch")
        return []
    older = [info.path for info in reversed(checkpoints.checkpoints()) if info.path != newest]
    return [newest] + older


@contextlib.contextmanager
def run_locks(checkpoints: CheckpointManager | None, run_dir: str | None, main: bool) -> Iterator[None]:
    """One run per checkpoint and run directory (the main process holds the locks); proves them writable."""
    locks = []
    if main:
        if checkpoints is not None:
            locks.append(RunLock(checkpoints.directory, "checkpoint_dir"))
        if run_dir and (checkpoints is None or os.path.abspath(run_dir) != os.path.abspath(checkpoints.directory)):
            locks.append(RunLock(run_dir, "run_dir"))
    try:
        for lock in locks:
            lock.acquire()
        yield
    finally:
        for lock in locks:
            lock.release()


def _previous_runs(checkpoints: CheckpointManager | None, run_dir: str | None) -> list[tuple[str, list[str]]]:
    """``[(directory, what of a run it holds)]``: the run directory, and a checkpoint directory outside it."""
    inside = checkpoints is not None and run_dir is not None and \
        os.path.abspath(checkpoints.directory).startswith(os.path.abspath(run_dir) + os.sep)
    found = []
    if run_dir:
        contents = rundir.run_contents(run_dir, inside and checkpoints.has_step_directories())  # type: ignore[union-attr]
        found.append((run_dir, contents))
    if checkpoints is not None and not inside and checkpoints.has_step_directories():
        found.append((checkpoints.directory, ["checkpoints"]))
    return [(where, contents) for where, contents in found if contents]


def refuse_fresh_start(checkpoints: CheckpointManager | None, run_dir: str | None) -> None:
    """Raise ConfigError when a new run (no resume) would write into a directory that holds another run's
    checkpoints, metrics or config: it would overwrite them and mix two runs. Called under the run locks."""
    for where, contents in _previous_runs(checkpoints, run_dir):
        raise rundir.fresh_start_refused(where, contents)


def make_room(checkpoints: CheckpointManager | None, run_dir: str | None, overwrite: bool,
              log: Callable[[str], None]) -> None:
    """Clear the way for a new run: a directory that holds a run is refused (ConfigError), or with
    ``overwrite`` (``--overwrite``) renamed to ``<dir>.old-<date>-<time>``, never deleted. A directory a
    live run holds is refused first (CheckpointError, the lock's message); nothing is changed then.

    Example: ``make_room(CheckpointManager("runs/a/checkpoints"), "runs/a", overwrite=True, log=print)``
    """
    for where, contents in _previous_runs(checkpoints, run_dir):
        if "://" in where:
            raise ConfigError(f"{where} holds a run and is not a local directory, so it cannot be moved aside; "
                              "choose a new checkpoint_dir, or resume the run")
        with RunLock(where, "run_dir" if where == run_dir else "checkpoint_dir"):
            pass  # taken and given back at once: raises while another run holds the directory
        if not overwrite:
            raise rundir.fresh_start_refused(where, contents)
        moved = rundir.move_aside(where)
        log(f"moved the previous run in {where} aside to {moved}")


def keep_global_batch(path: str, saved: dict[str, Any], loader: Iterable[Any], config: TrainConfig, world_size: int,
                      log: Callable[[str], None]) -> tuple[Iterable[Any], TrainConfig]:
    """The step loader and configuration that keep the global batch checkpoint ``path`` was trained with.

    The global batch (samples per optimizer step) is the step loader's batch (``batch_size x
    gradient_accumulation`` per process) times the number of processes; the loader's batches are
    global and each rank takes its slice, so keeping it keeps the optimisation and the data order.
    On another number of processes with the checkpoint's ``batch_size``, ``gradient_accumulation``
    is changed to keep it (and logged); any other change of the global batch raises ``ConfigError``
    naming the settings that keep it.

    Example::

        loader, config = keep_global_batch(path, state, loader, config, world_size=1, log=print)
        # a 2-rank checkpoint of batch_size 32: config.gradient_accumulation == 2, loader.batch_size == 64
    """
    recorded_loader, recorded = saved.get("loader") or {}, saved.get("config") or {}
    if not isinstance(loader, DataLoader) or not {"batch_size", "world_size"} <= set(recorded_loader):
        return loader, config  # a plain iterable of batches, or an old checkpoint: nothing to compare
    saved_world = recorded_loader["world_size"]
    saved_global = recorded_loader["batch_size"] * saved_world
    accumulation = config.gradient_accumulation
    if loader.batch_size * world_size == saved_global:
        return loader, config
    micro = loader.batch_size // accumulation  # the per-process micro-batch
    saved_batch, saved_accumulation = recorded.get("batch_size", micro), recorded.get("gradient_accumulation", 1)
    if config.batch_size == saved_batch and saved_global % (micro * world_size) == 0:
        kept = saved_global // (micro * world_size)
        log(f"gradient_accumulation {accumulation} -> {kept} to keep the global batch of {saved_global} that {path} "
            f"was trained with ({_plural(saved_world, 'process')} x batch {saved_batch} x accumulation "
            f"{saved_accumulation}) on {_plural(world_size, 'process')} x batch {saved_batch} x accumulation {kept}")
        return loader.replace(batch_size=micro * kept), config.replace(gradient_accumulation=kept)
    raise ConfigError(_global_batch_error(path, saved_global, (saved_world, saved_batch, saved_accumulation),
                                          (world_size, config.batch_size, accumulation)))


def _global_batch_error(path: str, saved_global: int, saved: tuple[int, int, int], now: tuple[int, int, int]) -> str:
    """Why a resume that changes the global batch is refused, and the settings that keep it."""
    world, batch, accumulation = now
    changed = "batch_size" if batch != saved[1] else "gradient_accumulation" if accumulation != saved[2] else \
        "the number of processes"
    keep = []
    if saved_global % (world * batch) == 0:
        keep.append(f"--set gradient_accumulation={saved_global // (world * batch)} (with batch_size {batch})")
    if saved_global % (world * accumulation) == 0:
        keep.append(f"--batch-size {saved_global // (world * accumulation)} (with gradient_accumulation "
                    f"{accumulation})")
    keep.append(f"the checkpoint's {_plural(saved[0], 'process')} x batch_size {saved[1]} x gradient_accumulation "
                f"{saved[2]}")
    return (f"{changed} cannot change on resume unless the global batch stays {saved_global}: {path} was trained with "
            f"{_plural(saved[0], 'process')} x batch_size {saved[1]} x gradient_accumulation {saved[2]} = "
            f"{saved_global} samples per step, and this run has {_plural(world, 'process')} x {batch} x {accumulation} "
            f"= {world * batch * accumulation}, which changes the optimisation and the data order. Keep "
            f"{saved_global} on {_plural(world, 'process')} with {'; or '.join(keep)}; to train with another batch, "
            "start a new run: a new --run-dir, without --resume")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'es' if count != 1 and noun.endswith('s') else 's' if count != 1 else ''}"
