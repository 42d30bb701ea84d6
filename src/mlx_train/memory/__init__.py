"""Memory planning: how much a training step needs, and settings that fit a device.

- ``MemoryOptimizer.suggest_config(model_size, num_devices, ...)`` plans from the size alone;
- ``MemoryOptimizer.measure(model, data, ...)`` measures the real model with a few real steps, and
  ``suggest_config`` plans from that measurement;
- ``MemoryModel.over_ranks(n)`` is the per-rank model of a tensor-parallel split (a ``TensorSplit``
  says what the model's ``shard`` splits), and ``MemoryPlan.ranks_needed`` how many ranks fit;
- a ``MemoryPlan`` holds the micro-batch, accumulation, checkpointing and precision, the estimated
  peak per device with its breakdown, and explains itself when printed.

Example::

    from mlx_train import MemoryOptimizer
    print(MemoryOptimizer.suggest_config(model_size=1e9, num_devices=2))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.memory.model import MemoryBreakdown, MemoryModel, TensorSplit, optimizer_slots
    from mlx_train.memory.plan import HEADROOM, MemoryOptimizer, MemoryPlan, for_strategy, plan_memory

_LAZY = {
    "MemoryBreakdown": "mlx_train.memory.model",
    "MemoryModel": "mlx_train.memory.model",
    "TensorSplit": "mlx_train.memory.model",
    "optimizer_slots": "mlx_train.memory.model",
    "HEADROOM": "mlx_train.memory.plan",
    "MemoryOptimizer": "mlx_train.memory.plan",
    "MemoryPlan": "mlx_train.memory.plan",
    "for_strategy": "mlx_train.memory.plan",
    "plan_memory": "mlx_train.memory.plan",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["HEADROOM", "MemoryBreakdown", "MemoryModel", "MemoryOptimizer", "MemoryPlan", "TensorSplit",
           "for_strategy", "optimizer_slots", "plan_memory"]
