"""Where a run's work is spread: one process, data parallel, tensor parallel, FSDP.

The Trainer takes one topology and calls it unconditionally; ``Single`` (one process) does nothing
anywhere, so the loop has no test of a group. A topology decides:

- who writes files (``is_main``), ``rank``/``size``, how many ranks split each batch (``batch_ranks``);
- how the data is sharded (``shard``) and the gradients reduced (``reduction``, built into the step);
- how values are summed over ranks at report time (``reduce``) and how the ranks agree to stop
  (``vote_stop``: the vote travels in the step's own all-reduce, ``Reduction.votes``);
- the checkpoint manager and what a save or restore does besides rank 0's checkpoint;
- extra callbacks (the rank's heartbeat and watchdog, parameter checksums), a ``barrier``, the
  watchdog around a blocking collective (``collective``) and transport errors (``errors``).

Example::

    group = init_group("auto")
    trainer = Trainer(model, optimizer, topology=DataParallel(group), batch_size=16)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.config import TrainConfig
from mlx_train.distributed import collectives
from mlx_train.distributed.environment import ENV_BACKEND, ENV_RUN_DIR, ENV_STATE_DIR, restart_resume, supervised
from mlx_train.distributed.reduction import Reduction, fused_average, sharded_reduction
from mlx_train.errors import ConfigError, DistributedError

if TYPE_CHECKING:
    from mlx_train.distributed.rank import RankMonitor

__all__ = ["DataParallel", "FSDP", "Group", "Single", "Topology", "any_rank", "init_group"]

_TRANSPORT_ERRORS = ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "connection to a peer")


class Topology:
    """One process: every hook is a no-op. Subclasses spread the work over ``group``.

    Example::

        topology = Single()
        topology.reduce({"loss_sum": mx.array(3.0)})      # {"loss_sum": 3.0}: read, nothing summed
    """

    #: The process group (None for one process).
    group: Any = None
    #: The strategy's name, as ``distributed_strategy`` spells it.
    strategy: str | None = None
    #: The rank's heartbeat and watchdog (None for one process outside the supervisor).
    monitor: RankMonitor | None = None
    #: The distributed backend in use (None for one process).
    backend: str | None = None

    def __init__(self) -> None:
        #: Gradient reduction across processes, passed into the step.
        self.reduction: Reduction | None = None
        #: Seconds of gradient communication per step (reports show it as time_comm).
        self.comm_seconds = 0.0

    # -- who ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def is_main(self) -> bool:
        """True on the process that writes files and prints."""
        return self.rank == 0

    @property
    def batch_ranks(self) -> int:
        """How many processes each train on their own slice of every batch (the global batch is that many
        times the loader's)."""
        return 1

    # -- set-up ------------------------------------------------------------------------------

    def prepare(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        """Join ``model`` to the group (same start on every rank, split or sharded); returns the model to train."""
        return model

    def check_run(self, model: nn.Module, config: TrainConfig, checkpoint_dir: str | None,
                  resume: str | None) -> str | None:
        """Refuse settings this topology cannot run; returns the ``resume`` to use."""
        return resume

    def callbacks(self, config: TrainConfig) -> list[Any]:
        """Callbacks the topology adds to a run (before the user's)."""
        return []

    def shard(self, batches: Any) -> None:
        """Give this rank its slice of every batch of ``batches`` (the Trainer's ``Batches``)."""

    def watch_step(self, guard: Any) -> None:
        """Called with the memory guard whenever the run (re)builds it."""

    # -- agreeing ----------------------------------------------------------------------------

    def start_run(self) -> None:
        """A new run: no vote carries over from the last one."""
        if self.reduction is not None and self.reduction.votes is not None:
            self.reduction.votes.reset()

    def vote_stop(self, requested: bool) -> bool | None:
        """After each step: did any rank ask to stop (all then stop at the same step)? None: no vote (one
        process), the local request decides."""
        return None

    def reduce(self, values: dict[str, mx.array]) -> dict[str, float]:
        """Sum on-device values over ranks and read them: the one place metrics cross processes."""
        return {k: float(v.item()) for k, v in values.items()}  # type: ignore[arg-type]  # real scalars

    def share_running(self, totals: dict[str, float]) -> dict[str, float] | None:
        """The running sums this rank keeps before a save (rank 0 the totals, the others zero), or None
        where they stay as they are."""
        return None

    def barrier(self, what: str) -> None:
        """Wait until every rank got here."""

    def collective(self, what: str) -> AbstractContextManager[Any]:
        """Guard a blocking collective (a watchdog when distributed)."""
        return nullcontext()

    def errors(self) -> AbstractContextManager[Any]:
        """Around a run or an evaluation: the backend's transport errors become ``DistributedError``."""
        return nullcontext()

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoints(self, directory: str, config: TrainConfig) -> CheckpointManager:
        """The checkpoint manager of ``directory``."""
        return CheckpointManager(directory, keep_last=config.keep_last, keep_best=config.keep_best,
                                 monitor=config.monitor, mode=config.monitor_direction())

    def before_save(self, checkpoints: CheckpointManager, step: int, model: nn.Module, optimizer: Any) -> None:
        """Every rank, right before rank 0 writes the checkpoint of ``step``."""

    def restoring(self, path: str) -> AbstractContextManager[Any]:
        """Around reading and restoring checkpoint ``path``."""
        return nullcontext()

    def restored_arrays(self, path: str, arrays: dict[str, dict[str, mx.array]],
                        saved: dict[str, Any]) -> dict[str, dict[str, mx.array]]:
        """This rank's part of the arrays (by group: model, optimizer...) of checkpoint ``path``: all of them,
        joined from every rank's slices when a tensor-parallel run of several ranks wrote it (as that run
        resumed on one rank would read it)."""
        if int((saved.get("tensor_parallel") or {}).get("world_size", 1)) > 1:
            from mlx_train.distributed.tensor.checkpoints import reshard  # (loads tensor parallelism only here)

            return reshard(path, arrays, saved, {}, 0, 1)
        return arrays

    # -- reports -----------------------------------------------------------------------------

    def before_report(self, meter: Any) -> None:
        """Every rank, before a report reads the meter."""


class Single(Topology):
    """One process: the Trainer's default."""


class Group(Topology):
    """A topology over ``group``: the shared parts of data parallel, tensor parallel and FSDP."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self._rank, self._size = int(group.rank()), int(group.size())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def prepare(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        self.monitor = self._make_monitor(config)
        return model

    def check_run(self, model: nn.Module, config: TrainConfig, checkpoint_dir: str | None,
                  resume: str | None) -> str | None:
        if resume is None and checkpoint_dir:
            return restart_resume()  # after a supervised restart: the last complete checkpoint
        return resume

    def callbacks(self, config: TrainConfig) -> list[Any]:
        extra: list[Any] = [self.monitor] if self.monitor is not None else []
        if config.checksum_every and self._size > 1:
            from mlx_train.distributed.checksum import ParameterChecksum

            extra.append(ParameterChecksum(config.checksum_every, config.checksum_action))
        return extra

    def vote_stop(self, requested: bool) -> bool | None:
        """Every rank votes right after each step, still under the step's watchdog; a reduction with votes
        sums them with the gradients (the vote cast before the step), with no collective of its own, and the
        step has already read the sum when it carried other votes (``Votes.summed``: one read a step)."""
        if self._size == 1:
            return None
        votes = self.reduction.votes if self.reduction is not None else None
        if votes is None:
            return any_rank(requested, self.group)
        voted = votes.summed()["stop"] > 0
        votes.cast(stop=requested)  # for the next step
        return voted

    def reduce(self, values: dict[str, mx.array]) -> dict[str, float]:
        if self._size > 1:
            with self.collective("metric reduction"):
                values = {k: collectives.all_sum(v, group=self.group, stream=mx.cpu) for k, v in values.items()}
                mx.eval(values)
        return super().reduce(values)

    def share_running(self, totals: dict[str, float]) -> dict[str, float] | None:
        if self._size == 1:
            return None
        # Canonical form of the running sums: rank 0 holds the totals, the others zero, as after a resume.
        return totals if self.is_main else {k: 0.0 for k in totals}

    def barrier(self, what: str) -> None:
        if self._size > 1:
            with self.collective(what):
                mx.eval(collectives.all_sum(mx.array(1, dtype=mx.int32), group=self.group, stream=mx.cpu))

    def collective(self, what: str) -> AbstractContextManager[Any]:
        return self.monitor.collective(what) if self.monitor is not None else nullcontext()

    @contextmanager
    def errors(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            self._raise_transport_error(error)
            raise

    def _arm(self, what: str) -> Callable[[], None] | None:
        """Arms the watchdog before the step's collectives are dispatched."""
        monitor = self.monitor
        return (lambda: monitor.arm(what)) if monitor is not None else None

    def _broadcast_parameters(self, model: nn.Module) -> None:
        from mlx_train.distributed.checksum import broadcast_from_rank0

        with self.collective("start-up broadcast of rank 0's parameters"):
            model.update(broadcast_from_rank0(model.parameters(), self.group))
            mx.eval(model.parameters())

    def _make_monitor(self, config: TrainConfig) -> RankMonitor | None:
        """The rank's heartbeat file and watchdog (None for a lone process outside the supervisor)."""
        if self._size == 1 and not supervised():
            return None
        from mlx_train.distributed.rank import RankMonitor, tee_output  # (only the ranks of a group load it)

        directory = os.environ.get(ENV_STATE_DIR) or (
            os.path.join(config.run_dir, "distributed") if config.run_dir else None)
        log_dir = os.environ.get(ENV_RUN_DIR) or config.run_dir
        if log_dir:  # each rank's own log: <run_dir>/logs/rank-<r>.log
            tee_output(log_dir, self._rank)
        monitor = RankMonitor(self._rank, self._size, directory, config.collective_timeout)
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


class DataParallel(Group):
    """Every rank holds the whole model and trains on its slice of each global batch; gradients, item
    counts and the ranks' votes (stop, out of memory) are summed in one all-reduce inside the compiled step
    (``fused_average``): a step makes no other collective, unless the memory guard checks it after its update.

    Example::

        trainer = Trainer(model, optimizer, topology=DataParallel(init_group("auto")), batch_size=16)
    """

    strategy = "data_parallel"

    @property
    def batch_ranks(self) -> int:
        return self._size

    def prepare(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        model = super().prepare(model, config)
        if self._size > 1:
            self.reduction = self._reduction()
            self._broadcast_parameters(model)  # every rank starts from rank 0's weights (before fsdp shards them)
            self._time_reduction(model)
        return model

    def shard(self, batches: Any) -> None:
        if self._size > 1:
            batches.shard(self._rank, self._size)

    def _reduction(self) -> Reduction:
        return fused_average(self.group, self._arm("gradient all-reduce"))

    def _time_reduction(self, model: nn.Module) -> None:
        from mlx_train.distributed.comm import estimate_step_comm_seconds

        with self.collective("start-up timing of the gradient all-reduce"):
            self.comm_seconds = estimate_step_comm_seconds(model, self.group)  # reports show time_comm


class FSDP(DataParallel):
    """MLX's ``nn.fully_shard``: a shard of the parameters and optimizer state per rank (NCCL or JACCL;
    the ring backend cannot run it). Checkpoints are not supported yet."""

    strategy = "fsdp"

    def prepare(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        model = super().prepare(model, config)
        return nn.fully_shard(model, group=self.group)  # the model itself alone

    def check_run(self, model: nn.Module, config: TrainConfig, checkpoint_dir: str | None,
                  resume: str | None) -> str | None:
        if self._size > 1 and checkpoint_dir:
            raise ConfigError(
                "checkpoints of strategy 'fsdp' runs are not supported yet: each rank holds only a shard of the "
                "parameters and optimizer state, and a checkpoint must hold them whole. Train without "
                "checkpoint_dir, or use strategy='data_parallel' (which resumes on any number of ranks)"
            )
        return super().check_run(model, config, checkpoint_dir, resume)

    def _reduction(self) -> Reduction:
        return sharded_reduction(self.group, self._arm("gradient all-reduce"))

    def _time_reduction(self, model: nn.Module) -> None:
        pass  # fully_shard's reduce-scatter is not the all-reduce that is timed


def init_group(backend: str) -> mx.distributed.Group:
    """``mx.distributed.init`` on the configured backend (or the one the launcher set up)."""
    from mlx_train.distributed.backends import active_backend

    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and os.path.getsize(hostfile) <= 1:
        # mlx.launch with one host writes an empty host file, which the ring backend cannot
        # parse: that is a group of one, which needs no backend at all.
        os.environ.pop("MLX_HOSTFILE")
        os.environ.pop(ENV_BACKEND, None)
    name = backend if backend != "auto" else (active_backend() or "any")
    try:
        return mx.distributed.init(backend=name)
    except RuntimeError as error:
        raise DistributedError(
            f"could not join the distributed group on the {name} backend: {error}. Launch the processes with "
            "mlx.launch (mlx-train train --distributed -n N) or check the host file with mlx-train check-network"
        ) from error


def any_rank(flag: bool, group: Any = None) -> bool:
    """True when ``flag`` is True on any rank of ``group``; every rank must call it (one all_sum).

    Alone (no group, or a group of one) it returns ``flag`` without communicating.

    Example::

        over = any_rank(mx.get_peak_memory() > budget, trainer.group)   # the same answer on every rank
    """
    if group is None or group.size() == 1:
        return bool(flag)
    votes = collectives.all_sum(mx.array(1 if flag else 0, dtype=mx.int32), group=group, stream=mx.cpu)
    return bool(votes.item() > 0)  # type: ignore[operator]  # an int32 scalar
