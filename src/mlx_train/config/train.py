"""``TrainConfig``: every training knob, declared once with its default, help, constraint and section.

The name tables of the optimizer and distributed sections (``OPTIMIZERS``, ``SCHEDULES``,
``BACKENDS``) live here as plain data, so that a config is checked when it is loaded, with the
file and line of the mistake, without importing ``mlx`` or the distributed package.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from mlx_train.config import files, mlx_lm
from mlx_train.config.options import (
    Invalid,
    byte_count,
    cadence,
    check_fields,
    convert,
    default_of,
    first_problem,
    kind_of,
    option,
    options,
    resolve,
)
from mlx_train.errors import ConfigError, did_you_mean

# name -> (mlx.optimizers class, the TrainConfig hyper-parameters it uses: beta1 and beta2 become
# betas=[beta1, beta2], epsilon becomes eps). Adafactor's eps is a pair with another meaning, so
# epsilon is not passed to it.
OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "adam": ("Adam", ("beta1", "beta2", "epsilon", "bias_correction")),
    "adamw": ("AdamW", ("beta1", "beta2", "epsilon", "bias_correction", "weight_decay")),
    "adamax": ("Adamax", ("beta1", "beta2", "epsilon")),
    "lion": ("Lion", ("beta1", "beta2", "weight_decay")),
    "sgd": ("SGD", ("momentum", "weight_decay")),
    "rmsprop": ("RMSprop", ("epsilon",)),
    "adagrad": ("Adagrad", ("epsilon",)),
    "adadelta": ("AdaDelta", ("epsilon",)),
    "adafactor": ("Adafactor", ("weight_decay",)),
    "muon": ("Muon", ("momentum", "weight_decay")),
}

#: The fields some optimizers use and others ignore.
HYPER_PARAMETERS = frozenset(name for _, uses in OPTIMIZERS.values() for name in uses)

# Schedules of mlx.optimizers, called as fn(learning_rate, *lr_schedule_args):
# name -> (the parameters after the initial rate, an example of lr_schedule_args).
SCHEDULES: dict[str, tuple[str, str]] = {
    "cosine_decay": ("decay_steps, end=0.0", "[10000, 1e-5]"),
    "exponential_decay": ("decay_rate", "[0.999]"),
    "linear_schedule": ("end, steps", "[0.0, 10000]"),
    "step_decay": ("decay_rate, step_size", "[0.5, 1000]"),
}

#: The backends of mlx.core.distributed; ``auto`` picks the best the installed MLX has.
BACKENDS = ("ring", "mpi", "jaccl", "nccl")
BACKEND_CHOICES = ("auto",) + BACKENDS

_YAML_HEADER = "mlx-train configuration (TrainConfig), by section"
#: The YAML sections, in the order ``to_yaml`` writes them.
SECTIONS = ("training", "optimizer", "checkpoint", "memory", "distributed", "data", "model", "llm", "tracking")

#: The experiment trackers ``report_to`` names (``mlx_train.training.trackers``).
TRACKERS = ("tensorboard", "wandb", "mlflow")

# Metric-name words that say which way is better; a word is a run of letters and digits.
_HIGHER = re.compile(r"acc\w*|f\d*|f1\w*|precision|recall|auc\w*|ap|map|ndcg\w*|bleu\w*|rouge\w*|iou|miou|"
                     r"dice|r2|top\d+|score|reward\w*|return|psnr|ssim|correct|hits?")
_LOWER = re.compile(r"loss\w*|errors?|err|perplexity|ppl|mse|mae|rmse|mape|nll|wer|cer|kl|fid|time|seconds|"
                    r"latency|distance")


def metric_direction(name: str, mode: str = "auto") -> str:
    """``"min"`` or ``"max"``: which way metric ``name`` improves. The one rule in mlx-train.

    An explicit ``mode`` (``"min"``/``"max"``) wins. With ``"auto"``, a name with a loss-like
    word (loss, error, perplexity, mse, ...) goes down; one with a score-like word (accuracy,
    f1, precision, recall, auc, bleu, ...) goes up; any other name is taken to go down, like a
    loss, with a warning (set ``mode`` for such metrics).

    Example::

        metric_direction("val_loss"), metric_direction("val_f1")        # ("min", "max")
        metric_direction("val_reward", mode="max")                      # "max"
    """
    if mode not in ("auto", "min", "max"):
        raise ConfigError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
    if mode != "auto":
        return mode
    words = re.findall(r"[a-z0-9]+", name.lower())
    if any(_LOWER.fullmatch(word) for word in words):
        return "min"
    if any(_HIGHER.fullmatch(word) for word in words):
        return "max"
    warnings.warn(f"mode='auto' cannot tell which way metric '{name}' improves: taking lower as better; "
                  "pass mode='max' or mode='min'", stacklevel=2)
    return "min"


def _users(name: str) -> str:
    users = [optimizer for optimizer, (_, uses) in OPTIMIZERS.items() if name in uses]
    return ", ".join(users[:-1]) + " and " + users[-1] if len(users) > 1 else users[0]


def _used_by_optimizer(name: str) -> Callable[[Any, Mapping[str, Any]], str | None]:
    """The check of a hyper-parameter: set, it must be one the chosen optimizer uses."""

    def check(value: Any, values: Mapping[str, Any]) -> str | None:
        chosen = values["optimizer"]
        uses = OPTIMIZERS[chosen][1]
        if name in uses:
            return None
        return (f"is set to {value!r}, but optimizer '{chosen}' does not use {name} (it uses "
                f"{', '.join(uses)}); remove {name}, or choose an optimizer that uses it: {_users(name)}")

    return check


def _schedule_needed(value: list[Any], values: Mapping[str, Any]) -> str | None:
    if value and values["lr_schedule"] is None:
        return (f"is set but lr_schedule is null: also set lr_schedule (one of {', '.join(SCHEDULES)}) "
                "or remove lr_schedule_args")
    return None


_DTYPES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
           "half": "float16"}


def _dtype(value: Any) -> Any:
    return _DTYPES.get(value.strip().lower(), value) if isinstance(value, str) else value


def _mixed_precision(value: Any) -> str:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false (true: bfloat16 compute, false: float32), got {value!r} "
                      f"({type(value).__name__}); for another dtype set precision: float16")
    return "bfloat16" if value else "float32"


def _trackers(value: Any) -> list[str]:
    """``report_to``: a list, or mlx-lm's comma-separated text (``"wandb,mlflow"``); ``"none"`` is no tracker."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise Invalid(f"must be a list of trackers ({', '.join(TRACKERS)}), got {value!r}")
    names = [str(name).strip().lower() for name in names if str(name).strip().lower() not in ("", "none")]
    for name in names:
        if name not in TRACKERS:
            raise Invalid(f"names an unknown tracker {name!r}{did_you_mean(name, TRACKERS)}: "
                          f"the trackers are {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


def _epochs_if_number(value: Any) -> Any:
    # The seed schema counts checkpoint_frequency in epochs; "500 steps" passes through.
    return f"{value} epochs" if isinstance(value, int) and not isinstance(value, bool) else value


in_training = partial(option, section="training")
in_optimizer = partial(option, section="optimizer")
in_checkpoint = partial(option, section="checkpoint")
in_memory = partial(option, section="memory")
in_distributed = partial(option, section="distributed")
in_data = partial(option, section="data")
in_model = partial(option, section="model")
in_llm = partial(option, section="llm")
in_tracking = partial(option, section="tracking")

#: The fine-tuning methods and training modes of ``mlx-train finetune`` (llm section).
FINE_TUNE_TYPES = ("lora", "dora", "full")
TRAIN_MODES = ("sft", "dpo", "orpo", "cpo")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def _all_batches(value: Any) -> Any:
    """mlx_lm.lora's ``-1`` batches means all of them: null here."""
    return None if value == -1 and not isinstance(value, bool) else value


PACKINGS = ("best_fit", "by_length")


def _packing(value: Any) -> Any:
    """``pack``: true/false, or a packing by name (``best_fit``, ``by_length``; ``--pack`` alone is best_fit)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, str) and value.strip().lower() in PACKINGS:
        return value.strip().lower()
    raise Invalid(f"must be true, false or one of {', '.join(PACKINGS)}, got {value!r}"
                  f"{did_you_mean(str(value), PACKINGS)}")


def _checkpointing(value: Any) -> Any:
    """``gradient_checkpointing``: true/false, or what is recomputed by name (``blocks`` is true, ``off`` false)."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "blocks"):
        return True
    if text in ("false", "off", "none"):
        return False
    if text in ("attention", "auto"):
        return text
    raise Invalid(f"must be true (= blocks), false, blocks, attention or auto, got {value!r}"
                  f"{did_you_mean(str(value), ('blocks', 'attention', 'auto'))}")


def _layers(value: int, values: Mapping[str, Any]) -> str | None:
    if value == -1 or value >= 1:
        return None
    return f"must be -1 (all blocks, as in mlx_lm.lora) or at least 1, got {value}"


def _epochs_or_steps(value: Any, values: Mapping[str, Any]) -> str | None:
    if value is None and values["max_steps"] is None:
        return ("is null (as many epochs as max_steps needs) but max_steps is null too: set epochs, or "
                "max_steps (mlx_lm.lora: iters)")
    return None


def _smoothing(value: float, values: Mapping[str, Any]) -> str | None:
    if value and (values["train_mode"] == "orpo" or values["dpo_loss_type"] != "sigmoid"):
        return "applies to the DPO sigmoid loss only; set it to 0 or use dpo_loss_type: sigmoid"
    return None


@dataclass
class TrainConfig:
    """All training options, flat: ``config.batch_size``, ``TrainConfig(precision="bf16")``.

    Each field says which YAML section it belongs to (training, optimizer, checkpoint, memory,
    distributed, data, model, tracking); values are converted and checked whenever a config is made.

    Example::

        config = TrainConfig(epochs=3, batch_size=64, precision="bf16")   # -> "bfloat16"
        config.replace(optimizer="sgd", momentum=0.9)
    """

    # ----- training: the loop -----
    epochs: int | None = in_training(10, "Passes over the training data (YAML: training.num_epochs); null: as "
                                         "many as max_steps needs (mlx_lm.lora's iters loop over the data).",
                                  minimum=1, aliases={"num_epochs": None}, check=_epochs_or_steps)
    max_steps: int | None = in_training(None, "Stop after this many optimizer steps, even mid-epoch "
                                           "(null: run all epochs); mlx_lm.lora's iters counts micro-batches: "
                                           "iters / gradient_accumulation steps.", minimum=1)
    gradient_accumulation: int = in_training(1, "Micro-batches whose gradients are averaged into one optimizer "
                                             "step (YAML: training.gradient_accumulation_steps, or mlx_lm.lora's "
                                             "grad_accumulation_steps).", minimum=1,
                                          aliases={"gradient_accumulation_steps": None,
                                                   "grad_accumulation_steps": None})
    seed: int = in_training(0, "Seed of parameter initialisation, dropout and data order.", minimum=0)
    compile: bool = in_training(True, "Compile the training step with mx.compile (false: easier debugging).")
    report_every: str = in_training("10 steps", "How often to log training metrics: 'N steps' or 'N epochs' "
                                             "(a bare number means steps).", parse=lambda v: str(cadence(v)))
    eval_every: str = in_training("1 epoch", "How often to run validation: 'N steps' or 'N epochs'.",
                               parse=lambda v: str(cadence(v)))
    monitor: str = in_training("val_loss", "Metric that picks the best checkpoint and drives early stopping, "
                                        "e.g. val_loss or val_accuracy.")
    monitor_mode: str = in_training("auto", "Whether monitor should go down (min) or up (max); auto: up for "
                                         "accuracy, f1, precision, recall, auc and the like, down for "
                                         "losses, errors, perplexity and other names.",
                                 choices=("auto", "min", "max"))
    early_stopping_patience: int | None = in_training(None, "Stop after this many evaluations without "
                                                         "improvement of monitor (null: never stop early).",
                                                   minimum=0)
    val_batches: int | None = in_training(None, "Validate on the first N batches of the validation set only "
                                                "(null or -1: all of it); evaluate() always uses all.", minimum=1,
                                          parse=_all_batches)
    nonfinite: str = in_training("raise", "What a NaN/Inf loss or gradient does: 'raise' (stop with an error naming "
                                         "the step and batch), 'skip' (the update is undone and training goes on) "
                                         "or 'stop' (stop, keeping the last finite checkpoint).",
                                 choices=("raise", "skip", "stop"))
    early_stopping_min_delta: float = in_training(0.0, "Smallest change of monitor that counts as an improvement.",
                                               minimum=0)
    run_dir: str | None = in_training(None, "Directory for this run's metrics.jsonl and logs (null: the Trainer "
                                         "writes none).")
    ema_decay: float | None = in_training(None, "Keep an exponential moving average of the weights with this decay "
                                              "(0.999: ~the last 1000 steps); validation and checkpoints use it, "
                                              "`mlx-train export --ema` exports it (null: off).", minimum=0, below=1)
    prune_sparsity: float | None = in_training(None, "Magnitude-prune the Linear and convolution weights to this "
                                                   "fraction of zeros (null: no pruning).", minimum=0, below=1)
    prune_start: int = in_training(0, "Optimizer step at which pruning starts.", minimum=0)
    prune_end: int | None = in_training(None, "Step at which prune_sparsity is reached (null: the run's last "
                                              "step).", minimum=1)
    prune_frequency: int = in_training(100, "Recompute the pruning masks every this many steps.", minimum=1)
    prune_schedule: str = in_training("polynomial", "How sparsity grows: 'polynomial' (cubic, from 0 at prune_start "
                                                    "to prune_sparsity at prune_end) or 'one_shot' (all at "
                                                    "prune_start).", choices=("polynomial", "one_shot"))
    prune_scope: str = in_training("global", "'global' (one magnitude threshold over all pruned tensors) or "
                                             "'layer' (each tensor to the same sparsity).",
                                   choices=("global", "layer"))

    # ----- optimizer: mlx.optimizers class, learning rate and its schedule -----
    optimizer: str = in_optimizer("adamw", "Optimizer from mlx.optimizers (YAML: optimizer.name).",
                               choices=tuple(OPTIMIZERS), key="name")
    learning_rate: float = in_optimizer(1e-3, "Peak learning rate: the end of the warmup and the start of "
                                           "lr_schedule.", above=0,
                                       hint="a rate of 0 never changes the weights and a negative one climbs "
                                            "the loss; typical values are 1e-4 to 1e-2")
    lr_schedule: str | None = in_optimizer(None, "Learning-rate schedule from mlx.optimizers after the warmup "
                                              "(null: constant learning_rate).", choices=tuple(SCHEDULES))
    # Bare list/dict: options.kind_of and the config help read the annotation text ("list", "dict") at runtime.
    lr_schedule_args: list = in_optimizer([], "Arguments of lr_schedule after the initial rate, e.g. "  # type: ignore[type-arg]
                                           "[10000, 1e-5] for cosine_decay (decay_steps, end).",
                                       check=_schedule_needed)
    warmup_steps: int = in_optimizer(0, "Optimizer steps of linear warmup from warmup_init to learning_rate "
                                     "(0: no warmup).", minimum=0)
    warmup_init: float = in_optimizer(0.0, "Learning rate of the first warmup step.", minimum=0)
    beta1: float = in_optimizer(0.9, f"First-moment decay: betas[0] of {_users('beta1')}.", minimum=0, below=1,
                             check=_used_by_optimizer("beta1"))
    beta2: float = in_optimizer(0.999, f"Second-moment decay: betas[1] of {_users('beta2')} (Lion's authors use "
                                    "0.99).", minimum=0, below=1, check=_used_by_optimizer("beta2"))
    epsilon: float = in_optimizer(1e-8, f"Added to denominators for numerical stability ({_users('epsilon')}).",
                               minimum=0, check=_used_by_optimizer("epsilon"))
    bias_correction: bool = in_optimizer(False, "Divide the moments by 1 - beta**step as PyTorch and Hugging Face "
                                             f"do ({_users('bias_correction')}); false: MLX's and mlx-lm's update.",
                                         check=_used_by_optimizer("bias_correction"))
    weight_decay: float = in_optimizer(0.01, f"Weight decay of {_users('weight_decay')} (0: none).", minimum=0,
                                    check=_used_by_optimizer("weight_decay"))
    momentum: float = in_optimizer(0.0, f"Momentum of {_users('momentum')} (muon is usually run with 0.95).",
                                minimum=0, below=1, check=_used_by_optimizer("momentum"))
    max_grad_norm: float | None = in_optimizer(None, "Clip gradients to this global L2 norm (null: no clipping).",
                                            above=0)

    # ----- checkpoint: where, how often, how many -----
    checkpoint_dir: str | None = in_checkpoint(None, "Directory or fsspec URL (s3://, gs://) for checkpoints "
                                                  "(null: no checkpoints unless a directory is given to train()).")
    checkpoint_every: str = in_checkpoint("1 epoch", "How often to save a checkpoint: 'N steps' or 'N epochs' "
                                                  "(YAML: training.checkpoint_frequency: N = N epochs).",
                                       parse=lambda v: str(cadence(v)),
                                       aliases={"checkpoint_frequency": _epochs_if_number})
    keep_last: int = in_checkpoint(3, "Newest checkpoints to keep (the newest complete one is never deleted).",
                                minimum=0)
    keep_best: int = in_checkpoint(1, "Best checkpoints by monitor to keep as well.", minimum=0)

    # ----- memory: precision, recomputation, budget -----
    precision: str = in_memory("float32", "Compute dtype; weights stay float32. bfloat16/float16 matmuls are "
                                       "slow on the Linux CPU (YAML: training.mixed_precision: true = "
                                       "bfloat16).", choices=("float32", "bfloat16", "float16"), parse=_dtype,
                            aliases={"mixed_precision": _mixed_precision})
    loss_scale: float = in_memory(65536.0, "Initial dynamic loss scale (float16 only): halved when gradients "
                                        "overflow, doubled after loss_scale_window good steps.", above=0)
    loss_scale_window: int = in_memory(1000, "Optimizer steps without overflow before the float16 loss scale "
                                          "doubles.", minimum=1)
    gradient_checkpointing: bool | str = in_memory(
        False, "Recompute activations in the backward pass (mx.checkpoint): true or blocks: each repeated block "
               "whole (least memory, about a third more compute for the blocks that train); attention: only "
               "each block's attention module (its attention probabilities are most of a block's activations "
               "at long sequences; a fraction of the blocks' recomputation); auto: attention, on rows of at "
               "least 1024 tokens only (shorter rows recompute nothing); false: nothing. mlx-train finetune's "
               "default: auto. Which blocks: "
               "checkpoint_modules (YAML alias: grad_checkpoint, mlx_lm.lora's name; --grad-checkpoint alone "
               "is blocks).", parse=_checkpointing, aliases={"grad_checkpoint": None})
    checkpoint_modules: list = in_memory([], "Blocks gradient_checkpointing recomputes: dotted paths to a module "  # type: ignore[type-arg]
                                          "or a list of modules, e.g. ['encoder.layers'] (empty: model.layers).")
    memory_limit: int | None = in_memory(None, "Memory budget per device, bytes or a size like '8GB': a step whose "
                                            "peak memory goes over it counts as out of memory (null: no budget; "
                                            "DeviceConfig(memory_limit=...) also sets one).", parse=byte_count, above=0)
    oom_recovery: bool = in_memory(True, "On out of memory, retry the step with half the micro-batch and twice "
                                      "the accumulation (same effective batch), then with gradient "
                                      "checkpointing, before failing with advice.")

    # ----- distributed: backend and recovery (DistributedConfig shares these fields) -----
    distributed_backend: str = in_distributed("auto", "Backend of a multi-process run (mlx.core.distributed): ring "
                                                   "(TCP, every MLX build), mpi, jaccl (Thunderbolt 5 RDMA), nccl "
                                                   "(CUDA); auto picks the best the installed MLX has "
                                                   "(YAML: distributed.backend).",
                                           choices=BACKEND_CHOICES, key="backend")
    distributed_strategy: str = in_distributed("data_parallel", "How a multi-process run splits the work: "
                                                "data_parallel (each rank a slice of every batch, whole model), "
                                                "tensor_parallel (each rank a slice of every large matrix, the "
                                                "whole batch; models with a shard(group) method), fsdp "
                                                "(nccl/jaccl only) (YAML: distributed.strategy).",
                                            choices=("data_parallel", "tensor_parallel", "fsdp"), key="strategy")
    max_restarts: int = in_distributed(3, "Times the supervisor of a distributed run restarts the whole group from "
                                       "the last complete checkpoint after a rank dies or hangs (0: never).",
                                    minimum=0)
    collective_timeout: float = in_distributed(300.0, "Seconds a rank may wait in a collective (gradient "
                                                   "all-reduce, metric reduction) before the run ends with "
                                                   "DistributedError naming the missing rank.", above=0)
    checksum_every: int | None = in_distributed(None, "Every N optimizer steps the ranks of a distributed run "
                                                   "compare a checksum of their parameters (null: never).",
                                             minimum=1)
    checksum_action: str = in_distributed("raise", "What a parameter-checksum mismatch does: raise "
                                                "(DistributedError naming the ranks), warn, or broadcast (copy "
                                                "rank 0's parameters and optimizer state to every rank and go on).",
                                       choices=("raise", "warn", "broadcast"))

    # ----- data: the dataset and its batches -----
    dataset: str = in_data("digits", "What to train on. train: a built-in dataset (YAML: data.name); finetune: a "
                                     "directory with train.jsonl/valid.jsonl/test.jsonl or a Hugging Face dataset "
                                     "name (YAML: data, mlx_lm.lora's name).", key="name", aliases={"data": None})
    batch_size: int = in_data(32, "Samples (rows) per micro-batch on each device; one optimizer step uses "
                               "batch_size x gradient_accumulation x devices samples (mlx_lm.lora's batch_size "
                               "per iteration; its distributed runs split it over the ranks, mlx-train's do not).",
                              minimum=1)
    eval_batch_size: int | None = in_data(None, "Batch size for validation and evaluation (null: batch_size).",
                                       minimum=1)
    num_workers: int = in_data(2, "Background threads that prefetch batches (0: load in the training thread).",
                            minimum=0)
    shuffle: bool = in_data(True, "Shuffle the training data each epoch (the order follows seed and epoch).")
    drop_last: bool = in_data(True, "Drop the last incomplete training batch of each epoch "
                                 "(keeps one batch shape for the compiled step).")
    dataset_options: dict = in_data({}, "Options of the built-in dataset (YAML: the other keys of data:).",  # type: ignore[type-arg]
                                 other_keys=True)

    # ----- model: the built-in model -----
    model: str = in_model("mlp", "The model. train: a built-in model (YAML: model.name); finetune: the base "
                                 "language model, an mlx-lm/Hugging Face directory, a Hugging Face repo id or a "
                                 ".gguf file (YAML: model, as in mlx_lm.lora).", key="name")
    model_options: dict = in_model({}, "Keyword arguments of the built-in model (YAML: the other keys of model:).",  # type: ignore[type-arg]
                                other_keys=True)

    # ----- llm: fine-tuning a language model (mlx-train finetune; mlx_lm.lora's and mlx-lm-lora's names) -----
    fine_tune_type: str = in_llm("lora", "How the base is tuned: lora, dora (adapters) or full (the blocks' weights).",
                                 choices=FINE_TUNE_TYPES)
    num_layers: int = in_llm(16, "Blocks to fine-tune, counted from the last (-1: all; 0 is refused). Under "
                                 "model: a built-in model's option of that name instead.",
                             check=_layers, shared_name=True)
    lora_parameters: dict = in_llm({"rank": 8, "scale": 20.0, "dropout": 0.0},  # type: ignore[type-arg]
                                   "LoRA/DoRA rank, scale, dropout and keys (mlx_lm.lora's lora_parameters).")
    max_seq_length: int = in_llm(2048, "Longest sequence in tokens; longer documents are cut (and counted).",
                                 minimum=1)
    mask_prompt: bool = in_llm(False, "Train on completions only (prompt/completion and chat records).")
    pack: bool | str = in_llm(False, "Pack the training rows: true or best_fit (several documents per row up to "
                                     "max_seq_length, no loss or attention across them), by_length (one document a "
                                     "row, batches of similar lengths), false.", parse=_packing)
    loss_chunk: int | None = in_llm(None, "Tokens per chunk of the loss's output projection: the loss never holds "
                                          "more logits than this many tokens x vocabulary (null: 8M logits a "
                                          "chunk, 160 tokens of a 49,152-token vocabulary; 0: the full logits, "
                                          "as mlx_lm.lora).", minimum=0)
    adapter_path: str = in_llm("adapters", "Where the adapters are written (mlx-lm format); relative to run_dir.")
    resume_adapter_file: str | None = in_llm(None, "Adapters (directory or adapters.safetensors) to start from.")
    quantized: bool | None = in_llm(None, "Keep a quantized base quantized (QLoRA); null: keep it on a GPU, "
                                          "dequantize to float32 on a CPU (quantized matmuls are slow there).")
    test: bool = in_llm(False, "Evaluate on the test split (test.jsonl) after training.")
    test_batches: int | None = in_llm(500, "Test batches (null or -1: the whole test set).", minimum=1,
                                      parse=_all_batches)
    train_mode: str = in_llm("sft", "sft (next-token loss), dpo, orpo or cpo (preference rows: prompt, chosen, "
                                    "rejected).", choices=TRAIN_MODES)
    beta: float = in_llm(0.1, "DPO: temperature of the implicit reward; ORPO: weight of the odds-ratio term.",
                         above=0)
    dpo_loss_type: str = in_llm("sigmoid", "DPO/CPO loss: sigmoid, hinge or ipo (YAML alias: dpo_cpo_loss_type).",
                                choices=DPO_LOSS_TYPES, aliases={"dpo_cpo_loss_type": None})
    label_smoothing: float = in_llm(0.0, "DPO sigmoid: share of preference labels assumed wrong (conservative "
                                         "DPO).", minimum=0, below=0.5, check=_smoothing)
    reference_free: bool = in_llm(False, "DPO against a uniform reference (reference log-probabilities 0).")
    reference_model_path: str | None = in_llm(None, "DPO reference model (null: the base model; with LoRA/DoRA "
                                                    "the adapters are switched off, with full fine-tuning its "
                                                    "log-probabilities are computed once before training).")
    precompute_ref_log_probs: bool = in_llm(False, "DPO with LoRA/DoRA: compute the reference log-probabilities "
                                                   "once before training (adapters off) instead of in every step.")

    # ----- tracking: experiment trackers (mlx-lm's --report-to, Hugging Face's report_to) -----
    report_to: list = in_tracking([], "Experiment trackers that receive the config, the metrics and the final "  # type: ignore[type-arg]
                                      "weights: tensorboard, wandb, mlflow (a list, or comma-separated).",
                                  parse=_trackers)
    project_name: str | None = in_tracking(None, "Tracker project (W&B project, MLflow experiment; null: the "
                                                 "tracker's default).")
    run_name: str | None = in_tracking(None, "Name of the run in the trackers (null: the run directory's name).")

    def __post_init__(self) -> None:
        check_fields(self)

    # ----- building -----
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], finetune: bool = False) -> TrainConfig:
        """Load a YAML file, sectioned (see ``mlx_train.config``) or flat; an empty file gives the defaults
        (``finetune``: ``mlx-train finetune``'s, mlx_lm.lora's). mlx_lm.lora's files load as they are
        (``mlx_train.config.mlx_lm``).

        Errors name the file and line: ``custom.yaml:5: unknown key 'batch_sise' in section
        'training' (did you mean 'batch_size'?)``.
        """
        return cls(**files.read(path, options(cls), SECTIONS, dialect(finetune),
                                defaults=mlx_lm.finetune_defaults if finetune else None))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>", finetune: bool = False) -> TrainConfig:
        """Build from a dict shaped like the YAML (sections and/or flat field names and aliases, mlx_lm.lora's
        keys too), e.g. ``to_dict()``; ``finetune``: on ``mlx-train finetune``'s defaults.

        Example: ``TrainConfig.from_dict({"iters": 100, "grad_accumulation_steps": 4}).max_steps`` -> ``25``.
        """
        return cls(**files.build(data, source, {}, options(cls), SECTIONS, dialect(finetune),
                                 defaults=mlx_lm.finetune_defaults if finetune else None))

    @classmethod
    def for_finetune(cls, given: Mapping[str, Any]) -> TrainConfig:
        """The config of ``mlx-train finetune``: its defaults (mlx_lm.lora's) under field values ``given``,
        which may hold ``Deferred`` counts (``--iters``) resolved here.

        Example: ``TrainConfig.for_finetune({"model": "base", "dataset": "data"}).optimizer`` -> ``"adam"``.
        """
        return cls(**resolve({**mlx_lm.finetune_defaults(given), **given}, _FIELDS))

    @property
    def data(self) -> str:
        """``dataset``, by mlx_lm.lora's name for it (``config.data``)."""
        return self.dataset

    def replace(self, **overrides: Any) -> TrainConfig:
        """A copy with some fields changed; unknown names and wrong values raise ``ConfigError``."""
        for name in overrides:
            if name not in _FIELDS:
                raise ConfigError(f"unknown TrainConfig option '{name}'{did_you_mean(name, _FIELDS)}")
        return dataclasses.replace(self, **overrides)

    # ----- exporting -----
    def to_dict(self) -> dict[str, Any]:
        """All fields as a flat JSON-able dict; ``TrainConfig.from_dict(c.to_dict()) == c``."""
        return {name: copy.deepcopy(getattr(self, name)) for name in _FIELDS}

    def sections(self) -> dict[str, dict[str, Any]]:
        """The config in the YAML layout; optimizer hyper-parameters the optimizer does not use are left out,
        and so is the llm section when all of it is at its defaults (a ``train`` run).

        Example::

            TrainConfig(optimizer="sgd").sections()["optimizer"]
            # {"name": "sgd", "learning_rate": 0.001, ..., "weight_decay": 0.01, "momentum": 0.0, ...}
        """
        unused = HYPER_PARAMETERS - set(OPTIMIZERS[self.optimizer][1])
        if all(getattr(self, name) == default_of(f) for name, f in _FIELDS.items()
               if f.metadata["option"].section == "llm"):
            unused |= {name for name, f in _FIELDS.items() if f.metadata["option"].section == "llm"}
        return files.sectioned(self.to_dict(), options(self), SECTIONS, leave_out=unused)

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the config by sections; ``from_yaml`` reads it back to an equal config."""
        files.write(path, self.sections(), _YAML_HEADER)

    def yaml_text(self) -> str:
        """The text ``to_yaml`` writes (``rundir.write_config`` writes it atomically)."""
        return files.dump(self.sections(), _YAML_HEADER)

    # ----- helpers for the CLI and the trainer -----
    @classmethod
    def fields_help(cls) -> dict[str, FieldHelp]:
        """Per field: ``FieldHelp(type, default, help, choices, section)``, in declaration order.

        ``type`` is the annotation as text (``"int | None"``); ``default`` a fresh copy; ``choices``
        a tuple of allowed strings or None. The CLI builds its flags and ``--help`` from this.
        """
        return {name: FieldHelp(str(f.type), default_of(f), f.metadata["option"].help,
                                f.metadata["option"].choices, f.metadata["option"].section)
                for name, f in options(cls).items()}

    @classmethod
    def parse_value(cls, name: str, text: str) -> Any:
        """Convert a command-line string to field ``name``'s type, e.g. ``("lr_schedule_args",
        "[1000, 1e-5]") -> [1000, 1e-05]``; ``none``/``null`` mean None for optional fields."""
        if name not in _FIELDS:
            raise ConfigError(f"unknown TrainConfig option '{name}'{did_you_mean(name, _FIELDS)}")
        kind, optional = kind_of(_FIELDS[name])
        if optional and text.strip().lower() in ("none", "null", "~"):
            return None
        value: Any = text
        if kind != "str":
            import yaml

            try:
                value = files.load_yaml(text)
            except yaml.YAMLError:
                pass
        try:
            return convert(_FIELDS[name], value)
        except Invalid as error:
            raise ConfigError(f"{name} {error}") from None

    def monitor_direction(self) -> str:
        """``"min"`` or ``"max"``: ``monitor_mode``, with ``auto`` resolved by ``metric_direction``."""
        return metric_direction(self.monitor, self.monitor_mode)


def dialect(finetune: bool) -> files.Dialect:
    """The translation of mlx_lm.lora's keys, with the optimizer in force when a file names none."""
    return partial(mlx_lm.translate, optimizer="adam" if finetune else "adamw", finetune=finetune)


class FieldHelp(NamedTuple):
    """What ``TrainConfig.fields_help()`` says about one field."""

    type: str
    default: Any
    help: str
    choices: tuple[str, ...] | None
    section: str


_FIELDS = options(TrainConfig)


def check_values(values: Mapping[str, Any], explicit: set[str]) -> tuple[str, str] | None:
    """``(field, problem)`` for the first field check that fails on a complete set of values."""
    return first_problem(_FIELDS, values, explicit)
