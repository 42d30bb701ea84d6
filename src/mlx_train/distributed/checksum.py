"""Gradient-synchronization validation: the ranks compare a checksum of their parameters.

Data-parallel ranks apply the same averaged gradients to the same weights, so their parameters
stay bitwise equal. Every ``every`` steps each rank computes two float32 sums over its parameters
(plain, and weighted by the parameter's position), the ranks exchange them with one small
``all_sum``, and any rank whose sums differ from rank 0's is reported by number. ``action``:
``raise`` (``DistributedError`` on every rank at once), ``warn``, or ``broadcast`` (copy rank 0's
parameters and optimizer state to every rank, then go on).

Example::

    trainer = DistributedTrainer(model, optimizer, checksum_every=100, checksum_action="broadcast")
    # or by hand: callbacks=[ParameterChecksum(every=100, action="warn")]
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.distributed import collectives
from mlx_train.errors import ConfigError, DistributedError

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

ACTIONS = ("raise", "warn", "broadcast")


def parameter_checksum(tree: Any) -> mx.array:
    """Two float32 sums over a tree of arrays: plain, and weighted by each leaf's position."""
    leaves = [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]
    if not leaves:
        return mx.zeros((2,), dtype=mx.float32)
    sums = mx.stack([mx.sum(v.astype(mx.float32)) for v in leaves])
    weights = mx.arange(1, len(leaves) + 1, dtype=mx.float32)
    return mx.stack([mx.sum(sums), mx.sum(mx.abs(sums) * weights)])


def gather_checksums(checksum: mx.array, group: Any) -> np.ndarray:
    """Every rank's checksum as a ``(world_size, 2)`` array (one ``all_sum``, so any backend works)."""
    world, rank = group.size(), group.rank()
    table = mx.zeros((world, checksum.size), dtype=mx.float32)
    table[rank] = checksum
    return np.array(collectives.all_sum(table, group=group, stream=mx.cpu))


def mismatching_ranks(table: np.ndarray) -> list[int]:
    """Ranks whose checksum row differs (bitwise) from rank 0's.

    Example: ``mismatching_ranks(np.array([[1., 2.], [1., 2.], [1., 3.]]))  # [2]``
    """
    return [rank for rank in range(1, len(table)) if not np.array_equal(table[rank], table[0])]


def broadcast_from_rank0(tree: Any, group: Any) -> Any:
    """``tree`` with every array replaced by rank 0's copy (``all_sum`` with zeros elsewhere)."""
    is_root = group.rank() == 0
    flat = []
    for key, value in tree_flatten(tree):
        if isinstance(value, mx.array):
            mine = value if is_root else mx.zeros_like(value)
            value = collectives.all_sum(mine, group=group, stream=mx.cpu).astype(value.dtype)
        flat.append((key, value))
    return tree_unflatten(flat)


def sync_from_rank0(model: Any, optimizer: Any, group: Any) -> None:
    """Copy rank 0's parameters (and optimizer state, when given) to every rank, in place."""
    model.update(broadcast_from_rank0(model.parameters(), group))
    if optimizer is not None and optimizer.state:
        optimizer.state.update(broadcast_from_rank0(optimizer.state, group))
        mx.eval(optimizer.state)
    mx.eval(model.parameters())


class ParameterChecksum:
    """Every ``every`` optimizer steps, check that all ranks hold the same parameters."""

    def __init__(self, every: int, action: str = "raise") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"ParameterChecksum every must be an integer >= 1, got {every!r}")
        if action not in ACTIONS:
            raise ConfigError(f"ParameterChecksum action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.every, self.action = every, action
        self.mismatches: list[tuple[int, list[int]]] = []  # (step, ranks) of each mismatch seen

    def on_batch_end(self, trainer: Trainer, step: int) -> None:
        if step % self.every == 0:
            self.check(trainer)

    def check(self, trainer: Trainer) -> list[int]:
        """Compare now; returns the ranks that disagree with rank 0 (and acts on them)."""
        group = trainer.group
        if group is None or group.size() == 1:
            return []
        with _guard(trainer, "parameter checksum"):
            table = gather_checksums(parameter_checksum(trainer.model.parameters()), group)
        bad = mismatching_ranks(table)
        if not bad:
            return bad
        self.mismatches.append((trainer.step, bad))
        detail = ", ".join(f"rank {r} {table[r][0]:.9g}" for r in bad)
        message = (f"parameter checksums differ at step {trainer.step}: {_ranks(bad)} disagree"
                   f"{'s' if len(bad) == 1 else ''} with rank 0 (sum of parameters: rank 0 {table[0][0]:.9g}, "
                   f"{detail}); the gradient all-reduce or a rank's memory went wrong")
        if self.action == "raise":
            raise DistributedError(f"{message}. Restart from the last checkpoint (a supervised run does this "
                                   "itself), or set checksum_action='broadcast' to copy rank 0's state and go on")
        if self.action == "warn":
            if trainer.is_main:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return bad
        with _guard(trainer, "broadcast of rank 0's state"):
            sync_from_rank0(trainer.model, trainer.optimizer, group)
        trainer.log(f"{message}; copied rank 0's parameters and optimizer state to every rank")
        return bad

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _guard(trainer: Trainer, what: str) -> AbstractContextManager[None]:
    """The trainer's collective watchdog (a DistributedTrainer), or nothing."""
    return trainer.collective(what) if hasattr(trainer, "collective") else nullcontext()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
