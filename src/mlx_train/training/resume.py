"""The global batch a resumed run must keep.

Which checkpoint a run resumes from, the run locks and what a new run does in a directory that holds a
run are the run directory's policy: ``mlx_train.run_directory.RunDirectory``.

Example::

    loader, config = keep_global_batch(path, state, loader, config, world_size=1, log=print)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mlx_train.config import TrainConfig
from mlx_train.data import DataLoader
from mlx_train.errors import ConfigError


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
