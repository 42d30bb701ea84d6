"""One rank of a 2-rank tensor-parallel load (launched by tests/test_tensor_parallel_load.py with mlx.launch):
loads the mlx-lm directory argv[1] lazily or eagerly (argv[2]), splits it with ``shard_for_finetune`` and writes
this rank's peak memory and parameter bytes to argv[3]/rank-R.json."""

from __future__ import annotations

import json
import os
import sys

import mlx_train  # noqa: F401  (BLAS preload before mlx)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train.llm.adapters import AdapterConfig
from mlx_train.llm.models import load_model
from mlx_train.llm.tensor_parallel import shard_for_finetune

directory, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
group = mx.distributed.init()
mx.reset_peak_memory()
model, _, _ = load_model(directory, lazy=mode == "lazy")
shard_for_finetune(model, AdapterConfig("lora", num_layers=2), group)
mx.eval(model.parameters())
peak = mx.get_peak_memory()
held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
with open(os.path.join(out, f"rank-{group.rank()}.json"), "w") as f:
    json.dump({"peak": peak, "held": held, "size": group.size()}, f)
