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
  mlx-train optimize --model transformer --strategy tensor_parallel -n 2 --device-memory 8GB
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
    parser.add_argument("-n", "--devices", type=int, default=1, metavar="N",
                        help="devices training in data parallel (default: 1), or with --strategy tensor_parallel "
                        "the ranks the model is split over; the plan is per device")
    from mlx_train.launch.train import add_strategy_argument

    add_strategy_argument(parser, "the split the plan is for (default: the config's distributed.strategy)")
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="memory per device, e.g. 16GB (default: memory_limit, else what the device has free)")
    parser.add_argument("--model-size", type=float, metavar="PARAMS",
                        help="plan from a parameter count alone (e.g. 1e9), for a typical transformer, "
                        "instead of measuring the config's model")
    parser.add_argument("--sequence-length", type=int, metavar="TOKENS",
                        help="tokens per sample for --model-size (default: 2048)")


class _Stand_in_group:  # noqa: N801 - a private stand-in
    """What ``shard(group)`` asks of a group while it splits layers (its size, this rank), with no backend:
    MLX's sharded layers only communicate when they run, and these never run."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def measure_split(model: Any, most: int = 64) -> Any:
    """The ``memory.TensorSplit`` of ``model``: which parameters its ``shard(group)`` splits, found by
    splitting copies of it over stand-in groups of 2, 4, ... ``most`` ranks (no process is launched; the
    copies are dropped), and the rank counts it splits over. None for a model without ``shard``.

    Example: ``measure_split(CharTransformerLM(vocab_size=96, dims=64)).parameters``
    """
    import copy

    from mlx.utils import tree_flatten

    from mlx_train.distributed.tensor import Shardable
    from mlx_train.errors import ConfigError
    from mlx_train.llm.tensor_parallel import shard_language_model
    from mlx_train.memory import TensorSplit

    shardable = isinstance(model, Shardable)  # (a test that does not narrow the model's type)
    if not shardable:
        return None
    whole = dict(tree_flatten(model.parameters()))
    trainable = {key for key, _ in tree_flatten(model.trainable_parameters())}
    layout: dict[str, Any] = {}
    ranks: list[int] = []
    size = 2
    while size <= most:
        try:
            found = shard_language_model(copy.deepcopy(model), _Stand_in_group(size))
        except ConfigError:  # heads or widths that do not divide: nor will they by a larger power of two
            break
        # split at every rank count listed: a vocabulary that divides by 2 but not by 4 splits only over 2
        layout = {key: axis for key, axis in found.items() if key in layout} if ranks else found
        ranks.append(size)
        size *= 2
    if not layout:
        return None
    return TensorSplit(parameters=sum(whole[key].size for key in layout),
                       parameter_bytes=sum(whole[key].nbytes for key in layout),
                       trainable=sum(whole[key].size for key in layout if key in trainable), ranks=tuple(ranks))


def plan_for_config(config: Any, num_devices: int = 1, device_memory: int | str | None = None,
                    batch_size: int | None = None, log: Callable[[str], None] | None = None,
                    strategy: str = "data_parallel") -> Any:
    """Measure ``config``'s built-in model on its dataset and plan for its effective batch.

    The target is ``config.batch_size * config.gradient_accumulation * num_devices`` (data parallel),
    or that without ``num_devices`` for ``strategy="tensor_parallel"``, where the model is split over
    ``num_devices`` ranks which all train on the whole batch (``measure_split``, ``MemoryModel.over_ranks``);
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
    from dataclasses import replace

    from mlx_train.memory import for_strategy

    profile = replace(profile, split=measure_split(model))
    profile, devices = for_strategy(profile, num_devices, strategy)
    memory = device_memory if device_memory is not None else config.memory_limit
    target = config.batch_size * config.gradient_accumulation * devices
    return plan_memory(profile, devices, device_memory=memory, target_batch_size=target, batch_size=batch_size)


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
    strategy = args.strategy or config.distributed_strategy
    memory = args.device_memory if args.device_memory is not None else config.memory_limit
    if args.model_size is not None:
        from mlx_train.memory import MemoryOptimizer

        sharing = 1 if strategy == "tensor_parallel" else args.devices  # tensor parallel ranks share one batch
        plan = MemoryOptimizer.suggest_config(
            args.model_size, args.devices, device_memory=memory,
            precision=args.precision or "auto", optimizer=config.optimizer,
            sequence_length=args.sequence_length,
            target_batch_size=config.batch_size * config.gradient_accumulation * sharing, strategy=strategy)
    else:
        if args.sequence_length is not None:
            raise ConfigError("--sequence-length goes with --model-size; a measured plan uses the dataset's "
                              "own sequences (set dataset_options.block_size to change them)")
        plan = plan_for_config(config, args.devices, memory, log=print, strategy=strategy)
    print(plan)
    if not plan.fits:  # a script must be able to tell: the plan is printed, and the exit code says it fails
        raise OutOfMemoryError("the plan above does not fit the device memory; lower --batch-size, give more "
                               "--device-memory or --devices (with --strategy tensor_parallel: more ranks), or "
                               "train a smaller model")
    settings = " ".join(f"--set {k}={v}" for k, v in plan.to_config().items())
    if plan.model.tensor_parallel > 1:
        settings = f"--distributed -n {plan.model.tensor_parallel} --strategy tensor_parallel {settings}"
    print(f"to train with it: mlx-train train ... {settings}   (or: mlx-train train ... --optimize-memory)")
    return 0
