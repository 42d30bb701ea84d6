"""Data loading for mlx-train: the DataLoader, collation and batching strategies.

Example::

    from mlx_train.data import DataLoader, LengthBucketing

    loader = DataLoader((x, y), batch_size=32, shuffle=True, num_workers=2, seed=0)
    augmented = DataLoader(images, batch_size=32, num_workers=2, worker_type="process")  # Python work per sample
    text = DataLoader(rows, batch_size=16, batching=LengthBucketing(lengths="input_ids"))
"""

from __future__ import annotations

from .batching import EpochPlan, LengthBucketing, TokenBudget, plan_epoch
from .collate import default_collate, pad_collate, round_up, to_mx
from .loader import DataLoader
from .prefetch import THREAD_PREFIX
from .workers import PROCESS_PREFIX

__all__ = [
    "DataLoader",
    "LengthBucketing",
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
