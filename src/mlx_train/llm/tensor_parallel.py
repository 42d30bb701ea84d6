"""Fine-tuning a language model split by tensor parallelism: the split (with the vocabulary, found from the
model's output head), the adapters on the split layers, and the adapters written whole.

``shard_language_model`` is ``distributed.tensor.shard_model`` with the head of an mlx-lm model
(``transforms.logits_head``), so the token embedding and the output head are split by vocabulary too.
``shard_for_finetune`` then adds the adapters (``llm.adapters``), split with their layers;
``save_gathered_adapters`` gathers them and writes mlx-lm's adapter format. ``TensorParallelAdapters`` is the
``llm.finetune.AdapterSplit`` that ``finetune`` uses for ``distributed_strategy: tensor_parallel``.
``check_process_count`` refuses, before any rank is launched, a number of processes that the base model's
config.json says cannot split it.

Example::

    layout = shard_for_finetune(model, AdapterConfig("lora", num_layers=8), mx.distributed.init())
    ...                                                      # train
    save_gathered_adapters(model, spec, "adapters", group)  # rank 0 writes them whole
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.distributed.tensor.checkpoints import read_shard
from mlx_train.distributed.tensor.layers import (
    VocabParallelEmbedding,
    describe_counts,
    materialize,
    process_counts,
    shard_model,
    split_problem,
)
from mlx_train.distributed.tensor.layout import Layout, axis_of, gather_parameters, shard_layout
from mlx_train.errors import ConfigError
from mlx_train.llm.adapters import AdapterConfig, apply_adapters, save_adapters
from mlx_train.llm.finetune import check_tensor_parallel
from mlx_train.transforms import logits_head

__all__ = ["shard_language_model", "shard_for_finetune", "replicated_vocabulary", "save_gathered_adapters",
           "TensorParallelAdapters", "finetune_split", "language_model_head", "base_model_config",
           "check_process_count"]


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



_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")  # a mixture of experts splits its MLPs its own way


def base_model_config(path: str) -> tuple[dict[str, Any], str] | None:
    """``(config.json, where it was read)`` of a base model, without loading it: an mlx-lm / Hugging Face
    directory, or a Hugging Face repo id already in the local cache; None otherwise (a GGUF file, a repo id not
    downloaded yet, an unreadable file: the ranks then check the model they load).

    Example: ``base_model_config("base")`` -> ``({"num_attention_heads": 9, ...}, "base/config.json")``
    """
    found: str | None = os.path.join(path, "config.json")
    if not os.path.isfile(str(found)):
        found = None
        if not path.endswith(".gguf") and not os.path.exists(path):
            try:
                from huggingface_hub import try_to_load_from_cache

                cached = try_to_load_from_cache(path, "config.json")
                found = cached if isinstance(cached, str) else None
            except Exception:  # noqa: BLE001 - not a repo id, no hub library: the ranks will say
                found = None
    if found is None:
        return None
    try:
        with open(found, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    return (config, found) if isinstance(config, dict) else None


def check_process_count(config: Any, processes: int) -> None:
    """Refuse, before launching, ``processes`` ranks that cannot split ``config.model`` (a FinetuneConfig's base)
    by tensor parallelism: its attention and key/value heads and its MLP size as its config.json gives them,
    by the rule the ranks apply (``distributed.tensor.layers.split_problem``). The error names the numbers of
    processes that split it. Nothing is checked when the config cannot be read without loading the model.

    Example: ``check_process_count(FinetuneConfig(model="base"), 4)`` raises ConfigError for 3 key/value heads.
    """
    found = base_model_config(str(config.model)) if config.model and processes > 1 else None
    if found is None:
        return
    model_config, where = found
    sizes = {key: model_config.get(key) for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    heads, kv, width = (value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
                        for value in sizes.values())
    mlp = [width] if width is not None and not any(key in model_config for key in _EXPERTS) else []
    quantized = config.quantized if config.quantized is not None else mx.default_device() == mx.gpu
    uneven = not (quantized and "quantization" in model_config)  # quantized layers are split only evenly
    why = split_problem(processes, heads, kv, mlp, uneven)
    if why is None:
        return
    counts = describe_counts(process_counts(max(processes, kv or heads or 1), heads, kv, mlp, uneven))
    given = ", ".join(f"{key} {value}" for key, value in sizes.items() if value is not None)
    fits = f"launch -n {counts}" if counts else "no number of processes splits it"
    raise ConfigError(
        f"-n {processes} cannot split {config.model} by tensor parallelism: {why} ({where}: {given}); {fits}, or "
        "train with --strategy data_parallel. Nothing was launched")
