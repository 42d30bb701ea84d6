"""The configuration, declared once per setting: default, help, constraint, YAML section, aliases.

Two configs, one YAML layout: ``TrainConfig`` holds what the Trainer reads (the sections training,
optimizer, checkpoint, memory, distributed, data, model, tracking); ``FinetuneConfig`` wraps it for
``mlx-train finetune`` and ``finetune()``, adding the llm section on mlx_lm.lora's defaults. A
fine-tuning setting given to ``TrainConfig`` (or to the Trainer) is an error naming where it goes.
YAML files and CLI flags only overlay them; no default or rule is written anywhere else.
``DistributedConfig`` and ``DeviceConfig`` reuse the same field declarations (``same_as``).

Example::

    config = TrainConfig.from_yaml("custom_config.yaml")      # sectioned (below) or flat
    config = config.replace(batch_size=64, learning_rate="3e-4")
    config.to_yaml("runs/a/config.yaml")                       # written by sections
    parse_every(config.eval_every)                             # Every(n=1, unit='epoch')
    metric_direction("val_f1")                                 # "max"

YAML layout (every part optional; a flat file of field names also works)::

    training:      # epochs (alias num_epochs), max_steps, gradient_accumulation (alias
                   # gradient_accumulation_steps), seed, compile, report_every, eval_every, monitor,
                   # monitor_mode, early_stopping_patience, early_stopping_min_delta, run_dir;
                   # also any field of the other sections, and the aliases checkpoint_frequency
                   # (N -> "N epochs") and mixed_precision (true -> bfloat16, false -> float32)
    optimizer:     # name (-> optimizer), learning_rate, lr_schedule, lr_schedule_args, warmup_steps,
                   # warmup_init, beta1, beta2, epsilon, weight_decay, momentum, max_grad_norm
    checkpoint:    # checkpoint_dir, checkpoint_every (alias checkpoint_frequency), keep_last, keep_best
    memory:        # precision (alias mixed_precision), loss_scale, loss_scale_window,
                   # gradient_checkpointing, checkpoint_modules, memory_limit, oom_recovery
    distributed:   # backend (-> distributed_backend), max_restarts, collective_timeout,
                   # checksum_every, checksum_action
    data:          # name (-> dataset), batch_size, eval_batch_size, num_workers, shuffle,
                   # drop_last; other keys -> dataset_options
    model:         # name (-> model); other keys -> model_options
    llm:           # FinetuneConfig only (mlx-train finetune): fine_tune_type, num_layers, lora_parameters,
                   # max_seq_length, mask_prompt, pack, adapter_path, resume_adapter_file, quantized, test,
                   # test_batches, train_mode, beta, dpo_loss_type, label_smoothing, reference_free,
                   # reference_model_path, precompute_ref_log_probs

mlx_lm.lora's flat files load too (``mlx_train.config.mlx_lm``): ``iters`` and its other counts of
iterations become optimizer steps, ``optimizer_config`` and the ``lr_schedule`` mapping become the
optimizer fields; ``from_yaml(path, finetune=True)`` starts from mlx_lm.lora's defaults.

A hyper-parameter the chosen optimizer does not use (``beta1`` with ``sgd``) is an error when it
is written under a section or differs from its default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.config.configs import FinetuneConfig, LaunchConfig, MisplacedSetting, TrainConfig
    from mlx_train.config.metrics import metric_direction
    from mlx_train.config.options import Every, Option, option, parse_bytes, parse_every, same_as
    from mlx_train.config.train import (
        BACKEND_CHOICES,
        BACKENDS,
        HYPER_PARAMETERS,
        OPTIMIZERS,
        SCHEDULES,
        SECTIONS,
        FieldHelp,
    )

# The configs resolve through config.configs, which loads them together: a config that extends
# TrainConfig registers when its module loads, so that a setting given to the wrong one says where it goes.
_LAZY = {
    "Every": "mlx_train.config.options",
    "Option": "mlx_train.config.options",
    "option": "mlx_train.config.options",
    "parse_bytes": "mlx_train.config.options",
    "parse_every": "mlx_train.config.options",
    "same_as": "mlx_train.config.options",
    "BACKEND_CHOICES": "mlx_train.config.train",
    "BACKENDS": "mlx_train.config.train",
    "HYPER_PARAMETERS": "mlx_train.config.train",
    "OPTIMIZERS": "mlx_train.config.train",
    "SCHEDULES": "mlx_train.config.train",
    "SECTIONS": "mlx_train.config.train",
    "FieldHelp": "mlx_train.config.train",
    "TrainConfig": "mlx_train.config.configs",
    "LaunchConfig": "mlx_train.config.configs",
    "FinetuneConfig": "mlx_train.config.configs",
    "MisplacedSetting": "mlx_train.config.configs",
    "metric_direction": "mlx_train.config.metrics",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["BACKENDS", "BACKEND_CHOICES", "Every", "FieldHelp", "FinetuneConfig", "HYPER_PARAMETERS",
           "LaunchConfig", "MisplacedSetting", "OPTIMIZERS", "Option", "SCHEDULES", "SECTIONS", "TrainConfig",
           "metric_direction", "option", "parse_bytes", "parse_every", "same_as"]
