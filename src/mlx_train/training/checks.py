"""The Trainer's checks of what it is given, each a sentence saying what is wrong and how to fix it (Keras users
pass names and numbers where MLX expects objects; a silent surprise is worse than an error)."""

from __future__ import annotations

import numbers
from typing import Any

import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError


def optimizer_of(optimizer: Any, config: TrainConfig) -> optim.Optimizer:
    """The optimizer to train with: the one given, one built from ``config`` (None), or from a name ("adam", as
    Keras' ``compile(optimizer="adam")`` takes), with the config's optimizer settings."""
    if optimizer is None or isinstance(optimizer, str):
        from mlx_train.optim import build_optimizer

        return build_optimizer(config if optimizer is None else config.replace(optimizer=optimizer))
    if not isinstance(optimizer, optim.Optimizer):
        raise ConfigError(f"optimizer must be an mlx.optimizers.Optimizer (e.g. optim.AdamW(1e-3)) or the name of one "
                          f"(e.g. 'adamw', set up by the config's optimizer section), got {type(optimizer).__name__}")
    return optimizer


def check_epochs(epochs: Any, config: TrainConfig) -> None:
    """``epochs`` of ``train``/``fit``: None (the config's) or a whole number >= 1, as the CLI's --epochs."""
    if epochs is None:
        return
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral):
        raise ConfigError(f"epochs must be a whole number >= 1, or None for the config's epochs ({config.epochs}); "
                          f"got {type(epochs).__name__} {epochs!r}")
    if epochs < 1:
        raise ConfigError(f"epochs={epochs} trains nothing: give epochs >= 1, or leave it out to train the config's "
                          f"epochs ({config.epochs})")


def check_trainable(model: nn.Module) -> None:
    if not tree_flatten(model.trainable_parameters()):
        raise ConfigError(f"the model ({type(model).__name__}) has no trainable parameters: every parameter is "
                          "frozen, so training would change nothing. Unfreeze what should learn (model.unfreeze(), "
                          "or unfreeze(keys=[...]) on a submodule), or add adapters, before training")


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"the model must be an mlx.nn.Module, got {type(model).__name__}; wrap a function in a Module "
            "subclass whose __call__ computes the outputs (its parameters are then found and trained)")


