"""Fine-tuning a language model split by tensor parallelism: the split (with the vocabulary, found from the
model's output head), the adapters on the split layers, and the adapters written whole.

``shard_language_model`` is ``distributed.tensor.shard_model`` with the head of an mlx-lm model
(``transforms.logits_head``), so the token embedding and the output head are split by vocabulary too.
``shard_for_finetune`` then adds the adapters (``llm.adapters``), split with their layers;
``save_gathered_adapters`` gathers them and writes mlx-lm's adapter format. ``TensorParallelAdapters`` is the
``llm.finetune.AdapterSplit`` that ``finetune`` uses for ``distributed_strategy: tensor_parallel``.

Example::

    layout = shard_for_finetune(model, AdapterConfig("lora", num_layers=8), mx.distributed.init())
    ...                                                      # train
    save_gathered_adapters(model, spec, "adapters", group)  # rank 0 writes them whole
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.distributed.tensor.checkpoints import read_shard
from mlx_train.distributed.tensor.layers import VocabParallelEmbedding, materialize, shard_model
from mlx_train.distributed.tensor.layout import Layout, axis_of, gather_parameters, shard_layout
from mlx_train.llm.adapters import AdapterConfig, apply_adapters, save_adapters
from mlx_train.llm.finetune import check_tensor_parallel
from mlx_train.transforms import logits_head

__all__ = ["shard_language_model", "shard_for_finetune", "replicated_vocabulary", "save_gathered_adapters",
           "TensorParallelAdapters", "finetune_split", "language_model_head"]


def language_model_head(model: nn.Module) -> nn.Module | None:
    """The module that gives an mlx-lm model's logits (``lm_head``, or the tied embedding), None for other
    models (``transforms.logits_head``). Example: ``language_model_head(model) is model.lm_head``"""
    return logits_head(model)


def shard_language_model(model: nn.Module, group: Any) -> Layout:
    """Split ``model`` over ``group`` (``distributed.tensor.shard_model``) with its vocabulary when it is an
    mlx-lm model with a plain output head; returns the layout.

    Example: ``layout = shard_language_model(model, mx.distributed.init())``
    """
    return shard_model(model, group, head=language_model_head)


def shard_for_finetune(model: nn.Module, spec: AdapterConfig, group: Any) -> Layout:
    """Split an (mlx-lm) model over ``group`` and add ``spec``'s adapters (an ``llm.adapters.AdapterConfig``),
    split with their layers; returns the layout. Call it on every rank before making the trainer.

    Example: ``shard_for_finetune(model, AdapterConfig("lora", num_layers=8), mx.distributed.init())``
    """
    shard_language_model(model, group)
    note = replicated_vocabulary(model, group)
    if note and group.rank() == 0:
        print(note, flush=True)
    materialize(model)
    apply_adapters(model, spec)
    return shard_layout(model)


def replicated_vocabulary(model: nn.Module, group: Any) -> str | None:
    """A line saying why the token embedding of a split ``model`` stays whole on every rank, None when it is
    split by vocabulary (or the model has no ``model.embed_tokens``).

    Example: ``replicated_vocabulary(model, group)`` -> ``"the vocabulary (49153 rows) does not divide ..."``
    """
    body = model.get("model") if isinstance(model, nn.Module) else None
    embedding = body.get("embed_tokens") if isinstance(body, nn.Module) else None
    if embedding is None or isinstance(embedding, VocabParallelEmbedding) or group.size() == 1:
        return None
    rows = embedding.weight.shape[0]
    why = (f"the vocabulary ({rows} rows) does not divide by {group.size()} ranks" if rows % group.size() else
           f"{type(embedding).__name__} (or the model's head) is not one that splits by vocabulary")
    return f"{why}: the token embedding and output head stay whole on every rank"


def save_gathered_adapters(model: nn.Module, spec: AdapterConfig, directory: str, group: Any,
                           extra: dict[str, Any] | None = None) -> str | None:
    """Write the trained parameters whole, in mlx-lm's adapter format (``mlx_lm.load(base,
    adapter_path=directory)`` reads them on one machine). Every rank must call it (the slices are
    gathered); rank 0 writes and returns the directory, the others return None.

    Example: ``save_gathered_adapters(model, spec, "adapters", group, extra={"model": "base-dir"})``
    """
    trained = dict(tree_flatten(model.trainable_parameters()))
    whole = gather_parameters(trained, shard_layout(model), group)
    if group is not None and group.rank() != 0:
        return None
    return save_adapters(model, spec, directory, extra=extra, weights=whole)


class TensorParallelAdapters:
    """The ``llm.finetune.AdapterSplit`` of a tensor-parallel run: the model is split over ``group`` with
    its ``shard(group)`` and the adapters added to the split layers (``shard_for_finetune``); they are
    written whole, gathered from the ranks (``save_gathered_adapters``).

    Example: ``finetune(config, trainer_class=DistributedTrainer, split=TensorParallelAdapters(group))``
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def add(self, model: Any, spec: Any) -> None:
        shard_for_finetune(model, spec, self.group)

    def save(self, model: Any, spec: Any, directory: str, extra: dict[str, Any]) -> None:
        save_gathered_adapters(model, spec, directory, self.group, extra=extra)

    def whole_at_checkpoint(self, model: Any, path: str, step: int) -> dict[str, Any]:
        """Rank 0's slices joined with those the other ranks wrote beside the checkpoint (at a checkpoint only
        rank 0 runs the callbacks, so nothing can be gathered), along the layout's axes."""
        mine = dict(tree_flatten(model.trainable_parameters()))
        layout = shard_layout(model)
        parts = [mine] + [read_shard(path, step, rank)["model"] for rank in range(1, self.group.size())]
        return {key: mx.concatenate([part[key] for part in parts], axis=axis_of(layout[key])) if key in layout
                else value for key, value in mine.items()}


def finetune_split(config: Any, group: Any) -> TensorParallelAdapters | None:
    """The split of a ``distributed_strategy: tensor_parallel`` fine-tune over ``group`` (None for a group of
    one). ``llm.finetune.prepare`` then loads an mlx-lm base lazily and ``shard_for_finetune`` evaluates it
    after splitting, so each rank reads only its slices into memory.

    Example: ``finetune(config, trainer_class=DistributedTrainer, split=finetune_split(config, group))``
    """
    check_tensor_parallel(config)
    if group.size() > 1 and str(config.model).endswith(".gguf") and group.rank() == 0:
        print(f"{config.model}: a GGUF base is dequantized as it loads, so every rank loads it whole before "
              "splitting it (an mlx-lm directory loads lazily: each rank keeps only its slices)", flush=True)
    return TensorParallelAdapters(group) if group.size() > 1 else None

