"""Data loading for mlx-train: the DataLoader, collation and batching strategies.

Example::

    from mlx_train.data import DataLoader, LengthBucketing

    loader = DataLoader((x, y), batch_size=32, shuffle=True, num_workers=2, seed=0)
    augmented = DataLoader(images, batch_size=32, num_workers=2, worker_type="process")  # Python work per sample
    text = DataLoader(rows, batch_size=16, batching=LengthBucketing(lengths="input_ids"))

Names load on first use (``mlx_train._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.data.batching import EpochPlan, LengthBucketing, RepeatedBatches, TokenBudget, plan_epoch
    from mlx_train.data.collate import default_collate, pad_collate, round_up, to_mx
    from mlx_train.data.loader import DataLoader
    from mlx_train.data.prefetch import THREAD_PREFIX
    from mlx_train.data.workers import PROCESS_PREFIX

_LAZY = {
    "EpochPlan": "mlx_train.data.batching",
    "LengthBucketing": "mlx_train.data.batching",
    "RepeatedBatches": "mlx_train.data.batching",
    "TokenBudget": "mlx_train.data.batching",
    "plan_epoch": "mlx_train.data.batching",
    "default_collate": "mlx_train.data.collate",
    "pad_collate": "mlx_train.data.collate",
    "round_up": "mlx_train.data.collate",
    "to_mx": "mlx_train.data.collate",
    "DataLoader": "mlx_train.data.loader",
    "THREAD_PREFIX": "mlx_train.data.prefetch",
    "PROCESS_PREFIX": "mlx_train.data.workers",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "DataLoader",
    "LengthBucketing",
    "RepeatedBatches",
    "TokenBudget",
    "default_collate",
    "pad_collate",
    "to_mx",
    "round_up",
    "plan_epoch",
    "EpochPlan",
    "THREAD_PREFIX",
    "PROCESS_PREFIX",
]
