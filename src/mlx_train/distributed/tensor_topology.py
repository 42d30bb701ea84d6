"""Tensor parallelism as a topology: every rank holds a slice of each split matrix and trains on the
whole batch; checkpoints hold each rank's slices (see ``mlx_train.distributed.tensor``).

Example::

    trainer = Trainer(model, optimizer, topology=TensorParallel(init_group("auto")))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.config import TrainConfig
from mlx_train.distributed.comm import Collective, StepCommunication

# The tensor-parallel functions, by name: the one place this topology reaches them.
from mlx_train.distributed.tensor import (
    Layout,
    ShardedCheckpoints,
    prune_shards,
    reshard,
    shard_layout,
    shard_model,
    tensor_parallel_reduction,
    write_shard,
)
from mlx_train.distributed.topology import Group
from mlx_train.errors import CheckpointError, ConfigError
from mlx_train.snapshot import saved_parameters
from mlx_train.transforms import logits_head

__all__ = ["GUARD_VOTE", "TensorParallel"]

GUARD_VOTE = Collective("all_sum", (2,), mx.int32)  # the memory guard's vote after each step, when it votes


class TensorParallel(Group):
    """The model split with its ``shard(group)`` method (mlx-lm's models, the built-in transformer); the
    replicated parameters are made rank 0's. Gradients need no all-reduce (``tensor_parallel_reduction``);
    the collectives inside the steps are counted and timed for ``time_comm`` (``StepCommunication``).
    Tensor x data parallelism is not supported: the whole group is one tensor-parallel group."""

    strategy = "tensor_parallel"

    def __init__(self, group: Any, layout: Layout | None = None) -> None:
        super().__init__(group)
        #: The split axis of each sharded parameter (``tensor_parallel.shard_layout``).
        self.layout: Layout = dict(layout or {})
        #: The collectives inside the steps, counted and timed for time_comm.
        self.step_communication: StepCommunication | None = None

    @property
    def _split(self) -> bool:
        return self._size > 1

    def prepare(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        """Split ``model`` over the group (its ``shard(group)``, unless already split) and make the
        replicated parameters rank 0's."""
        model = super().prepare(model, config)
        if not self._split:
            return model
        self.layout.update(shard_model(model, self.group, head=logits_head))  # an mlx-lm model's vocabulary too
        mx.eval(model.parameters())  # collectives pending in lazy parameters run first, in the same order
        replicated = [k for k, _ in tree_flatten(model.parameters()) if k not in self.layout]
        from mlx_train.distributed.checksum import broadcast_from_rank0

        with self.collective("start-up broadcast of rank 0's replicated parameters"):
            for key in replicated:  # one at a time: the old and new copy of only one array at once
                value = dict(tree_flatten(model.parameters()))[key]
                model.update(broadcast_from_rank0(tree_unflatten([(key, value)]), self.group), strict=False)
                del value
                mx.eval(model.parameters())
        self.reduction = tensor_parallel_reduction(self.group, self.layout, self._arm("tensor-parallel step"))
        # The all-reduces run inside the forward and backward passes: counted from the step's own code for
        # each micro-batch shape and timed on the group at reports (see distributed.comm.StepCommunication).
        self.step_communication = StepCommunication(self.group)
        return model

    def check_run(self, model: nn.Module, config: TrainConfig, checkpoint_dir: str | None,
                  resume: str | None) -> str | None:
        if self._split:
            self.layout.clear()  # adapters added since the trainer was made are sharded too
            self.layout.update(shard_layout(model))
            if config.checksum_every:
                raise ConfigError(
                    "checksum_every compares the ranks' whole parameters, but with strategy 'tensor_parallel' "
                    "each rank holds other slices: leave checksum_every unset (tensor_parallel.replicated_agree "
                    "compares the replicated parameters)")
        return super().check_run(model, config, checkpoint_dir, resume)

    def shard(self, batches: Any) -> None:
        pass  # every rank trains on the whole batch

    def watch_step(self, guard: Any) -> None:
        counting = self.step_communication
        if counting is None or not self._split:
            return
        # MemoryGuard._vote: (over budget, out of memory) as two int32, summed after each step
        counting.set_per_step([GUARD_VOTE] if guard.group is not None else [])
        guard.observe(counting)

    def before_report(self, meter: Any) -> None:
        counting = self.step_communication
        if counting is None or not self._split:
            return
        meter.pause()  # the timing is not training time
        with self.collective("timing the collectives of the tensor-parallel step"):
            comm = counting.window(meter.pending_steps)
        meter.resume()
        meter.comm_seconds = comm.seconds
        meter.comm_counts = {"comm_collectives": comm.collectives, "comm_bytes": comm.nbytes}

    def reduce(self, values: dict[str, mx.array]) -> dict[str, float]:
        if self._split:  # every rank computed the same sums (on the whole batch): report rank 0's
            values = {k: v if self._rank == 0 else mx.zeros_like(v) for k, v in values.items()}
        return super().reduce(values)

    # -- checkpoints: each rank's slices (see tensor_parallel's checkpoint section) --------------

    def checkpoints(self, directory: str, config: TrainConfig) -> CheckpointManager:
        if not self._split:
            return super().checkpoints(directory, config)
        if "://" in directory:
            raise ConfigError(f"checkpoint_dir {directory}: a tensor-parallel run writes each rank's slices beside "
                              "the checkpoints, on a file system every rank reaches; use a local or shared path")
        return ShardedCheckpoints(directory, {"world_size": self._size, "layout": self.layout},
                                  keep_last=config.keep_last, keep_best=config.keep_best, monitor=config.monitor,
                                  mode=config.monitor_direction())

    def before_save(self, checkpoints: CheckpointManager, step: int, model: nn.Module, optimizer: Any) -> None:
        """Every rank other than 0 writes its slices first; rank 0 then saves the checkpoint (its own slices
        and the loop state), so a complete checkpoint always has all its slices."""
        if not self._split:
            return
        if self._rank == 0:
            prune_shards(checkpoints.directory)
        else:
            write_shard(checkpoints.directory, step, self._rank, saved_parameters(model),
                        dict(tree_flatten(optimizer.state)))
        self.barrier("the barrier after writing the tensor-parallel slices")

    @contextmanager
    def restoring(self, path: str) -> Iterator[None]:
        try:
            yield
        except (CheckpointError, KeyError, ValueError) as error:  # no rank may fall back to an older one alone
            raise ConfigError(f"rank {self._rank} cannot restore its part of tensor-parallel checkpoint {path} "
                              f"({type(error).__name__}: {error}); the ranks must resume from the same step: "
                              "resume from an earlier checkpoint of the run (--resume PATH)") from error

    def restored_arrays(self, path: str, arrays: dict[str, dict[str, mx.array]],
                        saved: dict[str, Any]) -> dict[str, dict[str, mx.array]]:
        """This rank's slices from its file (or cut from the whole arrays when the checkpoint was written by
        another number of ranks, or whole); a group of one reads a tensor-parallel checkpoint whole."""
        return reshard(path, arrays, saved, self.layout, self._rank, self._size)
