"""``DistributedTrainer``: a Trainer whose topology is the launched group's (see ``mlx_train.distributed.topology``).

Example (run with ``mlx.launch -n 2 python train.py``, or under the supervisor with
``mlx-train train --distributed -n 2``)::

    trainer = DistributedTrainer(model=model, optimizer=optimizer, device_config=hw_config,
                                 strategy="data_parallel")
    trainer.train(train_dataset, val_dataset)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train.config import TrainConfig
from mlx_train.distributed.backends import STRATEGIES, active_backend, check_strategy
from mlx_train.distributed.topology import FSDP, DataParallel, Group, init_group
from mlx_train.training.trainer import Trainer

__all__ = ["STRATEGIES", "DistributedTrainer", "join"]


class DistributedTrainer(Trainer):
    """A Trainer whose processes each train on their slice of every global batch: it joins the launched
    group and trains with the topology of ``strategy``; nothing else differs from ``Trainer``.

    ``strategy="data_parallel"``: every rank holds the whole model; gradients are averaged
    across ranks inside the compiled step. ``strategy="tensor_parallel"``: the model is split with
    its ``shard(group)`` method (mlx-lm's models, the built-in transformer; see
    ``mlx_train.distributed.tensor``): every rank holds a slice of each split matrix and
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
        config = (config or TrainConfig()).replace(**overrides)
        if device_config is not None and hasattr(device_config, "apply"):
            device_config.apply()  # the device first: the group's backend runs on it
        topology = join(strategy or config.distributed_strategy, config.distributed_backend)
        if distributed_config is not None:
            distributed_config.check_world_size(topology.size)
        super().__init__(model, optimizer, loss_fn, device_config, config=config, topology=topology)

    world_size = property(lambda self: self.topology.size, doc="Processes in the group.")
    rank = property(lambda self: self.topology.rank, doc="This process's rank.")
    strategy = property(lambda self: self.topology.strategy, doc="data_parallel, tensor_parallel or fsdp.")
    backend = property(lambda self: self.topology.backend, doc="The distributed backend in use.")
    monitor = property(lambda self: self.topology.monitor, doc="The rank's heartbeat and watchdog, or None.")
    layout = property(lambda self: getattr(self.topology, "layout", {}),
                      doc="Tensor parallelism: the split axis of each sharded parameter.")
    step_communication = property(lambda self: getattr(self.topology, "step_communication", None),
                                  doc="Tensor parallelism: the collectives inside the steps, counted and timed.")


def join(strategy: str, backend: str) -> Group:
    """Join the launched group (``init_group``) and return the topology of ``strategy`` over it, after
    checking that the backend can run it."""
    group = init_group(backend)
    active = active_backend(world_size=group.size())
    check_strategy(strategy, active, group.size())
    topology: Group
    if strategy == "tensor_parallel":
        from mlx_train.distributed.tensor_topology import TensorParallel  # (loads tensor parallelism only here)

        topology = TensorParallel(group)
    else:
        topology = FSDP(group) if strategy == "fsdp" else DataParallel(group)
    topology.backend = active
    return topology
