"""``TrainConfig``: every knob the Trainer reads, declared once with its default, help, constraint and
section. The configs that extend it (``LaunchConfig``, ``FinetuneConfig``) register in
``config.sections``, so that a setting given to the wrong one says where it goes.

The name tables of the optimizer and distributed sections (``OPTIMIZERS``, ``SCHEDULES``,
``BACKENDS``) live here as plain data, so that a config is checked when it is loaded, with the
file and line of the mistake, without importing ``mlx`` or the distributed package.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple, TypeVar

from mlx_train.config import files, mlx_lm, sections
from mlx_train.config.metrics import metric_direction
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
C = TypeVar("C", bound="TrainConfig")
#: The YAML sections, in the order ``to_yaml`` writes them.
SECTIONS = ("training", "optimizer", "checkpoint", "memory", "distributed", "data", "model", "llm", "tracking")

#: The experiment trackers ``report_to`` names (``mlx_train.training.trackers``).
TRACKERS = ("tensorboard", "wandb", "mlflow")

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
    wrong = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, (int, float))), None)
    if wrong is not None:  # the schedule is called with them: a word would fail only at its first step
        name = values["lr_schedule"]
        return (f"has {value[wrong]!r} ({type(value[wrong]).__name__}) at position {wrong}, which must be a number: "
                f"{name}'s arguments after the initial rate are {SCHEDULES[name][0]}, e.g. {SCHEDULES[name][1]}")
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
in_tracking = partial(option, section="tracking")

def _all_batches(value: Any) -> Any:
    """mlx_lm.lora's ``-1`` batches means all of them: null here."""
    return None if value == -1 and not isinstance(value, bool) else value


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


def _epochs_or_steps(value: Any, values: Mapping[str, Any]) -> str | None:
    if value is None and values["max_steps"] is None:
        return ("is null (as many epochs as max_steps needs) but max_steps is null too: set epochs, or "
                "max_steps (mlx_lm.lora: iters)")
    return None


@dataclass
class TrainConfig:
    """What the Trainer reads, flat: ``config.batch_size``, ``TrainConfig(precision="bf16")``.

    Each field says which YAML section it belongs to (training, optimizer, checkpoint, memory,
    distributed, data, model, tracking); values are converted and checked whenever a config is made.
    The launcher's settings are ``LaunchConfig``'s and fine-tuning's ``FinetuneConfig``'s (both extend
    this one); given here, they are an error that says so.

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
               "least 1024 tokens only (shorter rows recompute nothing), and whole blocks with --train-mode grpo "
               "(TRL's GRPOTrainer's default); false: nothing. mlx-train finetune's default: auto. Which blocks: "
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

    # ----- tracking: experiment trackers (mlx-lm's --report-to, Hugging Face's report_to) -----
    report_to: list = in_tracking([], "Experiment trackers that receive the config, the metrics and the final "  # type: ignore[type-arg]
                                      "weights: tensorboard, wandb, mlflow (a list, or comma-separated).",
                                  parse=_trackers)
    project_name: str | None = in_tracking(None, "Tracker project (W&B project, MLflow experiment; null: the "
                                                 "tracker's default).")
    run_name: str | None = in_tracking(None, "Name of the run in the trackers (null: the run directory's name).")


    #: Whether missing values take ``mlx-train finetune``'s defaults (mlx_lm.lora's) instead of the declared ones.
    finetune_defaults: ClassVar[bool] = False
    #: A field a config that extends this one declares -> the field it follows in the YAML layout.
    placed_after: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        check_fields(self)

    # ----- building -----
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], finetune: bool = False) -> TrainConfig:
        """Load a YAML file, sectioned (see ``mlx_train.config``) or flat; an empty file gives the defaults.
        ``finetune`` (or ``FinetuneConfig.from_yaml``): a ``FinetuneConfig`` on ``mlx-train finetune``'s
        defaults, mlx_lm.lora's; mlx_lm.lora's files load as they are (``mlx_train.config.mlx_lm``).

        Errors name the file and line: ``custom.yaml:5: unknown key 'batch_sise' in section
        'training' (did you mean 'batch_size'?)``; a fine-tuning setting in a file for the Trainer
        says where it goes.
        """
        target: type[TrainConfig] = sections.section_class(cls, finetune)
        values = files.read(path, sections.all_fields(), SECTIONS, dialect(target.finetune_defaults),
                            defaults=mlx_lm.finetune_defaults if target.finetune_defaults else None)
        return target(**sections.own_values(target, values, os.fspath(path)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>", finetune: bool = False) -> TrainConfig:
        """Build from a dict shaped like the YAML (sections and/or flat field names and aliases, mlx_lm.lora's
        keys too), e.g. ``to_dict()``; ``finetune``: a ``FinetuneConfig``, on ``mlx-train finetune``'s defaults.
        A fine-tuning setting at its default value (in a dict a former version wrote) says nothing and is
        left out; another value of one is an error saying where it goes.

        Example: ``TrainConfig.from_dict({"iters": 100, "grad_accumulation_steps": 4}).max_steps`` -> ``25``.
        """
        target: type[TrainConfig] = sections.section_class(cls, finetune)
        values = files.build(data, source, {}, sections.all_fields(), SECTIONS, dialect(target.finetune_defaults),
                             defaults=mlx_lm.finetune_defaults if target.finetune_defaults else None)
        return target(**sections.own_values(target, values, source))

    @classmethod
    def from_saved(cls, data: Mapping[str, Any] | str | os.PathLike[str], source: str = "<dict>") -> TrainConfig:
        """The config a run recorded (its checkpoint's dict, or its config.yaml's path), as the config that holds
        every setting it has: ``TrainConfig``, or the ``LaunchConfig`` or ``FinetuneConfig`` that extends it.

        Example: ``TrainConfig.from_saved({"train_mode": "dpo"})`` is a ``FinetuneConfig``.
        """
        candidates: list[type[TrainConfig]] = [cls, *(c for c in sections.extensions() if issubclass(c, cls))]
        for candidate in candidates:
            try:
                if isinstance(data, Mapping):
                    return candidate.from_dict(data, source)
                return candidate.from_yaml(data)
            except sections.MisplacedSetting:
                if candidate is candidates[-1]:
                    raise
        raise AssertionError("unreachable: the last candidate returns or raises")

    @classmethod
    def for_finetune(cls, given: Mapping[str, Any]) -> TrainConfig:
        """The ``FinetuneConfig`` of ``mlx-train finetune``: its defaults (mlx_lm.lora's) under field values
        ``given``, which may hold ``Deferred`` counts (``--iters``) resolved here.

        Example: ``TrainConfig.for_finetune({"model": "base", "dataset": "data"}).optimizer`` -> ``"adam"``.
        """
        target: type[TrainConfig] = sections.section_class(cls, True)
        return target(**given)

    @property
    def data(self) -> str:
        """``dataset``, by mlx_lm.lora's name for it (``config.data``)."""
        return self.dataset

    def replace(self: C, **overrides: Any) -> C:
        """A copy with some fields changed; unknown names, settings of another section's config and wrong
        values raise ``ConfigError``."""
        sections.check_names(type(self), overrides)
        return dataclasses.replace(self, **overrides)

    # ----- exporting -----
    def to_dict(self) -> dict[str, Any]:
        """All fields as a flat JSON-able dict; ``TrainConfig.from_dict(c.to_dict()) == c``."""
        return {name: copy.deepcopy(getattr(self, name)) for name in options(self)}

    def sections(self) -> dict[str, dict[str, Any]]:
        """The config in the YAML layout; optimizer hyper-parameters the optimizer does not use are left out,
        and so is the llm section when all of it is at its defaults.

        Example::

            TrainConfig(optimizer="sgd").sections()["optimizer"]
            # {"name": "sgd", "learning_rate": 0.001, ..., "weight_decay": 0.01, "momentum": 0.0, ...}
        """
        fields = options(self)
        unused = HYPER_PARAMETERS - set(OPTIMIZERS[self.optimizer][1])
        llm = {name for name, f in fields.items() if f.metadata["option"].section == "llm"}
        if all(getattr(self, name) == default_of(fields[name]) for name in llm):
            unused |= llm
        return files.sectioned(self.to_dict(), fields, SECTIONS, leave_out=unused)

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the config by sections; ``from_yaml`` reads it back to an equal config."""
        files.write(path, self.sections(), _YAML_HEADER)

    def yaml_text(self) -> str:
        """The text ``to_yaml`` writes (``rundir.write_config`` writes it atomically)."""
        return files.dump(self.sections(), _YAML_HEADER)

    # ----- helpers for the CLI and the trainer -----
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default for this config: the declared one (``FinetuneConfig``: fine-tuning's)."""
        return {name: default_of(f) for name, f in options(cls).items()}

    @classmethod
    def fields_help(cls) -> dict[str, FieldHelp]:
        """Per field: ``FieldHelp(type, default, help, choices, section)``, in declaration order.

        ``type`` is the annotation as text (``"int | None"``); ``default`` a fresh copy of this config's
        default (``FinetuneConfig``: fine-tuning's, batch 4, adam at 1e-5); ``choices`` a tuple of allowed
        strings or None. The CLI builds its flags and ``--help`` from this.
        """
        defaults = cls.defaults()
        return {name: FieldHelp(str(f.type), copy.deepcopy(defaults[name]), f.metadata["option"].help,
                                f.metadata["option"].choices, f.metadata["option"].section)
                for name, f in options(cls).items()}

    @classmethod
    def parse_value(cls, name: str, text: str) -> Any:
        """Convert a command-line string to field ``name``'s type, e.g. ``("lr_schedule_args",
        "[1000, 1e-5]") -> [1000, 1e-05]``; ``none``/``null`` mean None for optional fields."""
        sections.check_names(cls, {name: None})
        field = options(cls)[name]
        kind, optional = kind_of(field)
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
            return convert(field, value)
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


sections.root(TrainConfig)


def check_values(values: Mapping[str, Any], explicit: set[str]) -> tuple[str, str] | None:
    """``(field, problem)`` for the first field check that fails on a complete set of values."""
    return first_problem(sections.all_fields(), values, explicit)
