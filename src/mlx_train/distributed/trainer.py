"""Multi-process training over ``mlx.core.distributed``: data parallel, tensor parallel, or FSDP where the
backend allows.

Example (run with ``mlx.launch -n 2 python train.py``, or under the supervisor with
``mlx-train train --distributed -n 2``)::

    trainer = DistributedTrainer(model=model, optimizer=optimizer, device_config=hw_config,
                                 strategy="data_parallel")
    trainer.train(train_dataset, val_dataset)
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.config import TrainConfig
from mlx_train.distributed import rank as rank_runtime
from mlx_train.distributed.backends import STRATEGIES, active_backend, check_strategy
from mlx_train.distributed.comm import Collective, StepCommunication
from mlx_train.errors import ConfigError, DistributedError
from mlx_train.training.callbacks import Callback, CallbackList
from mlx_train.training.meter import Meter
from mlx_train.training.oom import MemoryGuard
from mlx_train.training.step import Reduction
from mlx_train.training.trainer import Trainer

__all__ = ["DistributedTrainer", "STRATEGIES", "fused_average", "sharded_reduction"]

FUSE_BYTES = 32 * 2**20  # nn.average_gradients' bucket size: larger gradients keep its bucketing
GUARD_VOTE = Collective("all_sum", (2,), mx.int32)  # the memory guard's vote after each step, when it votes
_TRANSPORT_ERRORS = ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "connection to a peer")


def fused_average(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """Data-parallel reduction: gradients up to ``FUSE_BYTES``, their item count and the ranks' stop
    vote summed in ONE all-reduce (the ring's latency, not its bandwidth, bounds small models: a
    collective of its own for the vote made a small step up to 3x slower); larger gradients use
    ``nn.average_gradients``' buckets.

    The vote is ``reduction.state["stop"]``: each rank sets it to 1.0 (a stop signal arrived) or 0.0
    before a step, and reads after it how many ranks voted to stop.
    """
    world = group.size()
    votes = {"stop": mx.array(0.0)}

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        flat = tree_flatten(grads)
        dtypes = {g.dtype for _, g in flat}
        if n_items is None or len(dtypes) != 1 or sum(g.nbytes for _, g in flat) > FUSE_BYTES:
            grads = nn.average_gradients(grads, group=group)
            counts = mx.stack([votes["stop"]] + ([] if n_items is None else [n_items.astype(mx.float32)]))
            counts = mx.distributed.all_sum(counts, group=group)
            votes["stop"] = counts[0]
            return grads, None if n_items is None else (counts[1] / world).astype(n_items.dtype)
        dtype = dtypes.pop()
        tail = [n_items.reshape(1).astype(dtype), votes["stop"].reshape(1).astype(dtype)]
        joined = mx.distributed.all_sum(mx.concatenate([g.reshape(-1) for _, g in flat] + tail), group=group)
        parts = mx.split(joined, list(itertools.accumulate(g.size for _, g in flat)))
        averaged = [(k, (part / world).reshape(g.shape)) for (k, g), part in zip(flat, parts, strict=False)]
        votes["stop"] = parts[-1][1].astype(mx.float32)
        return tree_unflatten(averaged), (parts[-1][0] / world).astype(n_items.dtype)

    return Reduction(reduce, before_update=before_update, state=votes)


def sharded_reduction(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """FSDP: ``nn.fully_shard`` already reduce-scatters (and averages) each rank's gradient shard; only
    the item count is summed, and clipping uses the norm over all shards."""
    world = group.size()

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        if n_items is not None:
            n_items = mx.distributed.all_sum(n_items, group=group) / world
        return grads, n_items

    def clip(grads: Any, max_norm: float | None) -> tuple[Any, mx.array | None]:
        if max_norm is not None:
            clipped: tuple[Any, mx.array] = nn.utils.clip_grad_norm_sharded(grads, max_norm, group=group)
            return clipped
        squares = functools.reduce(mx.add, [mx.sum(mx.square(g)) for _, g in tree_flatten(grads)])
        return grads, mx.sqrt(mx.distributed.all_sum(squares, group=group))

    return Reduction(reduce, clip, before_update)


class DistributedTrainer(Trainer):
    """A Trainer whose processes each train on their slice of every global batch.

    ``strategy="data_parallel"``: every rank holds the whole model; gradients are averaged
    across ranks inside the compiled step. ``strategy="tensor_parallel"``: the model is split with
    its ``shard(group)`` method (mlx-lm's models, the built-in transformer; see
    ``mlx_train.distributed.tensor_parallel``): every rank holds a slice of each split matrix and
    its optimizer state and trains on the whole batch; checkpoints hold each rank's slices (tensor x
    data parallelism is not supported: the whole group is one tensor-parallel group).
    ``strategy="fsdp"``: MLX's ``nn.fully_shard`` keeps a shard of the parameters and optimizer
    state per rank (NCCL or JACCL; the ring backend cannot run it and is refused with an error).
    ``strategy=None`` takes the config's ``distributed_strategy``. Metrics are summed across ranks at report time; only
    rank 0 prints and writes checkpoints and metrics. ``batch_size`` is per process: the global
    batch is ``world_size * batch_size * gradient_accumulation`` (``distributed_config=`` sets
    these from a ``DistributedConfig``). With one process it trains exactly like ``Trainer``.

    Reports split out the communication (``time_comm``): data parallel, the gradient all-reduce timed
    once at start-up; tensor parallel, the collectives inside the step counted for each micro-batch
    shape and timed on the group at reports, with ``comm_collectives`` and ``comm_bytes`` per step
    (``distributed.comm.StepCommunication`` says what is measured and what is estimated).

    Each rank keeps a heartbeat file (under the supervisor, or in ``run_dir/distributed``); a
    collective that waits more than ``collective_timeout`` seconds ends the run with a
    ``DistributedError`` naming the missing rank. ``checksum_every=K`` compares the ranks'
    parameters every K steps (``checksum_action`` says what a mismatch does).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer | None = None,
        loss_fn: Callable[..., Any] | None = None,
        device_config: Any = None,
        strategy: str | None = None,
        config: TrainConfig | None = None,
        distributed_config: Any = None,
        **overrides: Any,
    ) -> None:
        if distributed_config is not None:
            overrides = {**distributed_config.train_overrides(), **overrides}
        super().__init__(model, optimizer, loss_fn, device_config, config=config, **overrides)
        self.group: mx.distributed.Group = init_group(self.config.distributed_backend)
        world = self.group.size()
        self.backend = active_backend(world_size=world)
        strategy = strategy or self.config.distributed_strategy
        check_strategy(strategy, self.backend, world)
        if distributed_config is not None:
            distributed_config.check_world_size(world)
        self.strategy = strategy
        self.monitor = self._make_monitor()
        if self.monitor is not None:
            self.collective = self.monitor.collective
        #: Tensor parallelism: the split axis of each sharded parameter (``tensor_parallel.shard_layout``).
        self.layout: dict[str, int] = {}
        #: Tensor parallelism: the collectives inside the steps, counted and timed for time_comm.
        self.step_communication: StepCommunication | None = None
        if strategy == "tensor_parallel":
            self._setup_tensor_parallel(model)
        elif world > 1:
            monitor = self.monitor
            arm = (lambda: monitor.arm("gradient all-reduce")) if monitor is not None else None
            sharded = strategy == "fsdp"
            self.gradient_reduction = (sharded_reduction if sharded else fused_average)(self.group, arm)
            from mlx_train.distributed.checksum import broadcast_from_rank0

            # every rank starts from rank 0's weights (before fsdp shards them)
            with self.collective("start-up broadcast of rank 0's parameters"):
                model.update(broadcast_from_rank0(model.parameters(), self.group))
                mx.eval(model.parameters())
            if not sharded:
                from mlx_train.distributed.comm import estimate_step_comm_seconds

                with self.collective("start-up timing of the gradient all-reduce"):
                    self.comm_seconds = estimate_step_comm_seconds(model, self.group)  # reports show time_comm
        if strategy == "fsdp":
            self.model = nn.fully_shard(model, group=self.group)  # the model itself when alone

    def _setup_tensor_parallel(self, model: nn.Module) -> None:
        """Split ``model`` over the group (its ``shard(group)``, unless already split) and make the
        replicated parameters rank 0's; gradients then need no all-reduce (``tensor_parallel_reduction``)."""
        if self.world_size == 1:
            return
        from mlx_train.distributed import tensor_parallel
        from mlx_train.distributed.checksum import broadcast_from_rank0

        self.layout.update(tensor_parallel.shard_model(model, self.group))
        mx.eval(model.parameters())  # collectives pending in lazy parameters run first, in the same order
        replicated = [k for k, _ in tree_flatten(model.parameters()) if k not in self.layout]
        with self.collective("start-up broadcast of rank 0's replicated parameters"):
            for key in replicated:  # one at a time: the old and new copy of only one array at once
                value = dict(tree_flatten(model.parameters()))[key]
                model.update(broadcast_from_rank0(tree_unflatten([(key, value)]), self.group), strict=False)
                del value
                mx.eval(model.parameters())
        monitor = self.monitor
        arm = (lambda: monitor.arm("tensor-parallel step")) if monitor is not None else None
        self.gradient_reduction = tensor_parallel.tensor_parallel_reduction(self.group, self.layout, arm)
        # The all-reduces run inside the forward and backward passes: counted from the step's own code for
        # each micro-batch shape and timed on the group at reports (see distributed.comm.StepCommunication).
        self.step_communication = StepCommunication(self.group)

    def _guard(self, callbacks: CallbackList) -> MemoryGuard:
        guard = super()._guard(callbacks)
        counting = self.step_communication
        if counting is not None and self._tensor_parallel:
            # MemoryGuard._vote: (over budget, out of memory) as two int32, summed after each step
            counting.set_per_step([GUARD_VOTE] if guard.group is not None else [])
            guard.observe(counting)
        return guard

    def _report(self, loader: Iterable[Any], callbacks: CallbackList, meter: Meter) -> None:
        counting = self.step_communication
        if counting is not None and self._tensor_parallel:
            meter.pause()  # the timing is not training time
            with self.collective("timing the collectives of the tensor-parallel step"):
                comm = counting.window(meter.pending_steps)
            meter.resume()
            meter.comm_seconds = comm.seconds
            meter.comm_counts = {"comm_collectives": comm.collectives, "comm_bytes": comm.nbytes}
        super()._report(loader, callbacks, meter)

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    def train(self, train_dataset: Any = None, val_dataset: Any = None, epochs: int | None = None,
              checkpoint_dir: str | None = None, callbacks: list[Any] | None = None, resume: str | None = None,
              overwrite: bool = False) -> dict[str, Any]:
        """``Trainer.train``; after a supervised restart it resumes from the last complete checkpoint."""
        if self.strategy == "fsdp" and self.world_size > 1 and (checkpoint_dir or self.config.checkpoint_dir):
            raise ConfigError(
                "checkpoints of strategy 'fsdp' runs are not supported yet: each rank holds only a shard of the "
                "parameters and optimizer state, and a checkpoint must hold them whole. Train without "
                "checkpoint_dir, or use strategy='data_parallel' (which resumes on any number of ranks)"
            )
        if self._tensor_parallel:
            from mlx_train.distributed.tensor_parallel import shard_layout

            self.layout.clear()  # adapters added since the trainer was made are sharded too
            self.layout.update(shard_layout(self.model))
            if self.config.checksum_every:
                raise ConfigError(
                    "checksum_every compares the ranks' whole parameters, but with strategy 'tensor_parallel' "
                    "each rank holds other slices: leave checksum_every unset (tensor_parallel.replicated_agree "
                    "compares the replicated parameters)")
        if resume is None and (checkpoint_dir or self.config.checkpoint_dir):
            resume = rank_runtime.restart_resume()
        extra: list[Callback] = [self.monitor] if self.monitor is not None else []
        if self.config.checksum_every and self.world_size > 1:
            from mlx_train.distributed.checksum import ParameterChecksum

            extra.append(ParameterChecksum(self.config.checksum_every, self.config.checksum_action))
        try:
            return super().train(train_dataset, val_dataset, epochs, checkpoint_dir, extra + list(callbacks or []),
                                 resume, overwrite)
        except RuntimeError as error:
            self._raise_transport_error(error)
            raise

    @property
    def _tensor_parallel(self) -> bool:
        return self.strategy == "tensor_parallel" and self.world_size > 1

    def _batch_ranks(self) -> int:
        return 1 if self._tensor_parallel else super()._batch_ranks()

    def _shard(self, *loaders: Any) -> None:
        if not self._tensor_parallel:  # tensor parallel ranks all train on the whole batch
            super()._shard(*loaders)

    def _reduce(self, values: dict[str, mx.array]) -> dict[str, float]:
        if self._tensor_parallel:  # every rank computed the same sums (on the whole batch): report rank 0's
            values = {k: v if self.rank == 0 else mx.zeros_like(v) for k, v in values.items()}
        return super()._reduce(values)

    # -- tensor-parallel checkpoints: each rank's slices (see tensor_parallel's checkpoint section) --

    def _checkpoints(self, directory: str | None) -> Any:
        if not directory or not self._tensor_parallel:
            return super()._checkpoints(directory)
        from mlx_train.distributed.tensor_parallel import ShardedCheckpoints

        if "://" in directory:
            raise ConfigError(f"checkpoint_dir {directory}: a tensor-parallel run writes each rank's slices beside "
                              "the checkpoints, on a file system every rank reaches; use a local or shared path")
        cfg = self.config
        return ShardedCheckpoints(directory, {"world_size": self.world_size, "layout": self.layout},
                                  keep_last=cfg.keep_last, keep_best=cfg.keep_best, monitor=cfg.monitor,
                                  mode=cfg.monitor_direction())

    def _save(self, checkpoints: Any, loader: Any, callbacks: Any, meter: Any) -> None:
        """Tensor parallel: every rank other than 0 writes its slices first; rank 0 then saves the checkpoint
        (its own slices and the loop state), so a complete checkpoint always has all its slices."""
        if self._tensor_parallel and not self._poisoned:
            from mlx_train.distributed import tensor_parallel
            from mlx_train.training.state import saved_parameters

            if self.rank == 0:
                tensor_parallel.prune_shards(checkpoints.directory)
            else:
                tensor_parallel.write_shard(checkpoints.directory, self.state.step, self.rank,
                                            saved_parameters(self.model), dict(tree_flatten(self.optimizer.state)))
            with self.collective("the barrier after writing the tensor-parallel slices"):
                mx.eval(mx.distributed.all_sum(mx.array(1, dtype=mx.int32), group=self.group, stream=mx.cpu))
        super()._save(checkpoints, loader, callbacks, meter)

    def _restore(self, path: str, loader: Any, callbacks: Any) -> Any:
        """Tensor parallel: the loop state from rank 0's checkpoint, this rank's slices from its file (or cut
        from the whole arrays when the checkpoint was written by another number of ranks, or whole)."""
        if self.strategy != "tensor_parallel":  # (a group of one reads a tensor-parallel checkpoint whole)
            return super()._restore(path, loader, callbacks)
        from mlx_train.checkpointing import load_checkpoint
        from mlx_train.distributed.tensor_parallel import reshard
        from mlx_train.errors import CheckpointError
        from mlx_train.training.resume import keep_global_batch

        try:
            arrays, saved = load_checkpoint(path)
            arrays = reshard(path, arrays, saved, self.layout, self.rank, self.world_size)
            resized, config = keep_global_batch(path, saved, loader, self.config, 1, self.log)
            self.state.restore(path, arrays, saved, self.model, self.optimizer, resized, callbacks, rank=self.rank)
        except (CheckpointError, KeyError, ValueError) as error:  # no rank may fall back to an older one alone
            raise ConfigError(f"rank {self.rank} cannot restore its part of tensor-parallel checkpoint {path} "
                                   f"({type(error).__name__}: {error}); the ranks must resume from the same step: "
                                   "resume from an earlier checkpoint of the run (--resume PATH)") from error
        if resized is not loader:  # written by data-parallel ranks: another micro-batch count per step
            self.config = config
            self.state.record_micro_batch({**self.state.micro_batch, "step_batch": None})
            if self._loaders is not None and self._loaders[0] is loader:
                self._loaders = (resized, *self._loaders[1:])
        return resized

    def evaluate(self, dataset: Any) -> dict[str, float]:
        try:
            return super().evaluate(dataset)
        except RuntimeError as error:
            self._raise_transport_error(error)
            raise

    def _interruption(self, signum: int, checkpoints: Any) -> Any:
        """Every rank stopped at the same step; none leaves before rank 0 has written its checkpoint
        (a rank that exits makes ``mlx.launch`` stop the others, which would cut that save short)."""
        if self.world_size > 1:
            with self.collective("the barrier after the stop checkpoint"):
                mx.eval(mx.distributed.all_sum(mx.array(1, dtype=mx.int32), group=self.group, stream=mx.cpu))
        return super()._interruption(signum, checkpoints)

    def _make_monitor(self) -> rank_runtime.RankMonitor | None:
        """The rank's heartbeat file and watchdog (None for a lone process outside the supervisor)."""
        supervised = rank_runtime.supervised()
        if self.world_size == 1 and not supervised:
            return None
        directory = os.environ.get(rank_runtime.ENV_STATE_DIR) or (
            os.path.join(self.config.run_dir, "distributed") if self.config.run_dir else None)
        log_dir = os.environ.get(rank_runtime.ENV_RUN_DIR) or self.config.run_dir
        if log_dir:  # each rank's own log: <run_dir>/logs/rank-<r>.log
            rank_runtime.tee_output(log_dir, self.rank)
        monitor = rank_runtime.RankMonitor(self.rank, self.world_size, directory, self.config.collective_timeout)
        return monitor.start()

    def _raise_transport_error(self, error: RuntimeError) -> None:
        """Re-raise the backend's "connection lost" error as a DistributedError naming the peer."""
        if not any(marker in str(error) for marker in _TRANSPORT_ERRORS):
            return
        if self.monitor is None:
            raise DistributedError(f"the distributed group failed: {error}") from error
        converted = self.monitor.lost_peer_error(error)
        self.monitor.record_failure(converted)
        raise converted from error


def init_group(backend: str) -> mx.distributed.Group:
    """``mx.distributed.init`` on the configured backend (or the one the launcher set up)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and os.path.getsize(hostfile) <= 1:
        # mlx.launch with one host writes an empty host file, which the ring backend cannot
        # parse: that is a group of one, which needs no backend at all.
        os.environ.pop("MLX_HOSTFILE")
        os.environ.pop(rank_runtime.ENV_BACKEND, None)
    name = backend if backend != "auto" else (active_backend() or "any")
    try:
        return mx.distributed.init(backend=name)
    except RuntimeError as error:
        raise DistributedError(
            f"could not join the distributed group on the {name} backend: {error}. Launch the processes with "
            "mlx.launch (mlx-train train --distributed -n N) or check the host file with mlx-train check-network"
        ) from error
