"""Print a memory plan: the micro-batch, accumulation, checkpointing and precision that fit the device.

By default the plan is measured: the config's built-in model runs a few real training steps
on its dataset at small micro-batches (a copy of the model; nothing is trained or written), and
the plan reaches the config's effective batch (batch_size x gradient_accumulation per device)
within the device memory (--device-memory, else memory_limit, else what the device has free).
--model-size plans from a parameter count alone, for a typical transformer.

Example::

    from mlx_train.cli.optimize import plan_for_config
    from mlx_train.config import TrainConfig

    plan = plan_for_config(TrainConfig(model="transformer", dataset="text", batch_size=256))
    print(plan)                       # the settings, the peak per device and its breakdown, and why
    config = plan.apply(TrainConfig(model="transformer", dataset="text"))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

EPILOG = """examples:
  mlx-train optimize                                  # mlp on digits, measured
  mlx-train optimize --config my.yaml --device-memory 16GB
  mlx-train optimize --model transformer --dataset text --batch-size 512
  mlx-train optimize --model-size 1e9 --devices 2     # from the size alone (a typical transformer)
  mlx-train train --config my.yaml --optimize-memory  # train with the measured plan
"""
_CONFIG_FLAGS = {"--model": "model", "--dataset": "dataset", "--batch-size": "batch_size",
                 "--precision": "precision"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``optimize`` flags."""
    from mlx_train.cli.flags import FLAGS
    from mlx_train.cli.flags import _flag_type as flag_type

    parser.add_argument("--config", metavar="FILE", help="YAML config to plan for (as for mlx-train train)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="set any TrainConfig field, as for mlx-train train; repeatable")
    parser.set_defaults(**{name: None for name in FLAGS.values()})
    helps = {"batch_size": "target batch per device (times gradient_accumulation) the plan must reach"}
    for flag, name in _CONFIG_FLAGS.items():
        parser.add_argument(flag, dest=name, default=None, type=flag_type(name), metavar=name.upper(),
                            help=helps.get(name, f"the config's {name} (as for mlx-train train)"))
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="devices training in data parallel (default: 1); the plan is per device")
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="memory per device, e.g. 16GB (default: memory_limit, else what the device has free)")
    parser.add_argument("--model-size", type=float, metavar="PARAMS",
                        help="plan from a parameter count alone (e.g. 1e9), for a typical transformer, "
                        "instead of measuring the config's model")
    parser.add_argument("--sequence-length", type=int, metavar="TOKENS",
                        help="tokens per sample for --model-size (default: 2048)")


def plan_for_config(config: Any, num_devices: int = 1, device_memory: int | str | None = None,
                    batch_size: int | None = None, log: Callable[[str], None] | None = None) -> Any:
    """Measure ``config``'s built-in model on its dataset and plan for its effective batch.

    The target is ``config.batch_size * config.gradient_accumulation * num_devices``;
    ``batch_size`` fixes the micro-batch instead (the plan then only chooses checkpointing).
    """
    import mlx.core as mx

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model
    from mlx_train.memory import MemoryOptimizer, plan_memory
    from mlx_train.optim import build_optimizer
    from mlx_train.training.state import rng_key, set_rng_key

    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    key = rng_key()
    mx.random.seed(config.seed)
    model = build_model(config.model, data["info"], **config.model_options)
    set_rng_key(key)  # planning must not move the random stream of the run it plans
    if log:
        log(f"measuring {config.model} on {config.dataset} ({config.precision}, {config.optimizer}) ...")
    profile = MemoryOptimizer.measure(model, data["train"], optimizer=build_optimizer(config),
                                      precision=config.precision, checkpoint_modules=config.checkpoint_modules)
    memory = device_memory if device_memory is not None else config.memory_limit
    target = config.batch_size * config.gradient_accumulation * num_devices
    return plan_memory(profile, num_devices, device_memory=memory, target_batch_size=target,
                       batch_size=batch_size)


def optimized_config(config: Any, batch_size: int | None = None, log: Callable[[str], None] = print) -> Any:
    """``config`` with its measured plan applied (``train --optimize-memory``); logs the plan.

    ``batch_size`` (``train --batch-size N``) keeps that micro-batch; the plan then chooses only
    gradient checkpointing.
    """
    plan = plan_for_config(config, batch_size=batch_size, log=log)
    log(str(plan))
    if not plan.fits:
        log("warning: the plan does not fit the memory; training starts with it anyway and the Trainer "
            "will shrink the micro-batch if it runs out")
    return plan.apply(config)


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train optimize`` from parsed arguments."""
    from mlx_train.cli.flags import build_config
    from mlx_train.errors import ConfigError, OutOfMemoryError

    if args.devices < 1:
        raise ConfigError(f"--devices must be at least 1, got {args.devices}")
    config = build_config(args)
    memory = args.device_memory if args.device_memory is not None else config.memory_limit
    if args.model_size is not None:
        from mlx_train.memory import MemoryOptimizer

        plan = MemoryOptimizer.suggest_config(
            args.model_size, args.devices, device_memory=memory,
            precision=args.precision or "auto", optimizer=config.optimizer,
            sequence_length=args.sequence_length,
            target_batch_size=config.batch_size * config.gradient_accumulation * args.devices)
    else:
        if args.sequence_length is not None:
            raise ConfigError("--sequence-length goes with --model-size; a measured plan uses the dataset's "
                              "own sequences (set dataset_options.block_size to change them)")
        plan = plan_for_config(config, args.devices, memory, log=print)
    print(plan)
    if not plan.fits:  # a script must be able to tell: the plan is printed, and the exit code says it fails
        raise OutOfMemoryError("the plan above does not fit the device memory; lower --batch-size, give more "
                               "--device-memory or --devices, or train a smaller model")
    settings = " ".join(f"--set {k}={v}" for k, v in plan.to_config().items())
    print(f"to train with it: mlx-train train ... {settings}   (or: mlx-train train ... --optimize-memory)")
    return 0
