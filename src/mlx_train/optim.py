"""Build an ``mlx.optimizers`` optimizer and learning-rate schedule from a ``TrainConfig``.

Example::

    from mlx_train.config import TrainConfig
    from mlx_train.optim import build_optimizer

    config = TrainConfig(optimizer="adamw", learning_rate=3e-4, lr_schedule="cosine_decay",
                         lr_schedule_args=[10_000, 1e-5], warmup_steps=500)
    optimizer = build_optimizer(config)   # AdamW, 500 linear warmup steps from 0, then cosine

The name tables (``OPTIMIZERS``, ``SCHEDULES``) belong to the config, which checks names when a
config is loaded; this module only imports them (``mlx_train.config`` never imports this module).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlx_train.config import OPTIMIZERS, SCHEDULES, TrainConfig
from mlx_train.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import mlx.optimizers

__all__ = ["OPTIMIZERS", "SCHEDULES", "build_optimizer", "build_schedule"]

Schedule = Callable[["mlx.core.array"], "mlx.core.array"]


def build_schedule(config: TrainConfig) -> float | Schedule:
    """The learning rate for ``config``: a float, or a schedule of the optimizer step.

    ``lr_schedule`` (if set) is ``mlx.optimizers.<lr_schedule>(learning_rate, *lr_schedule_args)``;
    with ``warmup_steps > 0`` the rate first rises linearly from ``warmup_init`` to
    ``learning_rate`` over ``warmup_steps`` steps (``join_schedules``), and the schedule starts at
    its step 0 right after. Step ``s`` is the ``s``-th update (0-based), so the first update of a
    warmup uses ``warmup_init``.

    Example::

        lr = build_schedule(TrainConfig(learning_rate=1e-3, warmup_steps=100))
        float(lr(mx.array(50)))   # 5e-4
    """
    import mlx.optimizers as optim

    rate = float(config.learning_rate)
    schedule: float | Schedule = rate
    if config.lr_schedule is not None:
        name = config.lr_schedule
        if name not in SCHEDULES:
            raise ConfigError(
                f"unknown lr_schedule '{name}'{did_you_mean(name, SCHEDULES)}; "
                f"choose one of {', '.join(SCHEDULES)} (mlx.optimizers schedules)")
        function = getattr(optim, name)
        args = list(config.lr_schedule_args)
        try:
            inspect.signature(function).bind(rate, *args)
        except TypeError:
            raise ConfigError(
                f"lr_schedule_args {args} do not fit lr_schedule '{name}', which takes "
                f"({SCHEDULES[name][0]}) after the initial learning rate, "
                f"e.g. lr_schedule_args: {SCHEDULES[name][1]}") from None
        schedule = function(rate, *args)
    if config.warmup_steps > 0:
        warmup = optim.linear_schedule(float(config.warmup_init), rate, config.warmup_steps)
        if callable(schedule):
            schedule = optim.join_schedules([warmup, schedule], [config.warmup_steps])
        else:
            schedule = warmup  # linear_schedule holds `rate` after its last step
    return schedule


def build_optimizer(config: TrainConfig) -> mlx.optimizers.Optimizer:
    """The ``mlx.optimizers`` optimizer named by ``config.optimizer``, with its learning rate.

    Passes each class only the hyper-parameters it uses (see ``OPTIMIZERS``): ``betas=[beta1,
    beta2]``, ``eps=epsilon``, ``weight_decay``, ``momentum``, ``bias_correction`` (Adam, AdamW:
    off by default as in MLX; on, the update is PyTorch's and Hugging Face's). Adafactor gets
    ``relative_step=False`` so that ``learning_rate`` (and its schedule) is used as given.

    Example::

        optimizer = build_optimizer(TrainConfig(optimizer="sgd", momentum=0.9, learning_rate=0.1))
    """
    import mlx.optimizers as optim

    name = config.optimizer.lower()
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer '{config.optimizer}'{did_you_mean(name, OPTIMIZERS)}; "
            f"choose one of {', '.join(OPTIMIZERS)}")
    class_name, uses = OPTIMIZERS[name]
    # TrainConfig's names -> the keyword arguments of mlx.optimizers
    keywords = {"beta1": "betas", "beta2": "betas", "epsilon": "eps", "weight_decay": "weight_decay",
                "momentum": "momentum", "bias_correction": "bias_correction"}
    values = {"betas": [float(config.beta1), float(config.beta2)], "eps": float(config.epsilon),
              "weight_decay": float(config.weight_decay), "momentum": float(config.momentum),
              "bias_correction": bool(config.bias_correction)}
    kwargs = {keywords[key]: values[keywords[key]] for key in uses}
    if name == "adafactor":
        kwargs["relative_step"] = False
    optimizer: optim.Optimizer = getattr(optim, class_name)(learning_rate=build_schedule(config), **kwargs)
    return optimizer
