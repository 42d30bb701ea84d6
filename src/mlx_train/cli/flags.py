"""The TrainConfig flags shared by ``mlx-train train`` and ``mlx-train optimize``: how a command
line becomes a ``TrainConfig`` (defaults < ``--config`` < ``--set`` < dedicated flags).

Example::

    from mlx_train.cli.flags import build_config
    config = build_config(parsed_args)      # a TrainConfig
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import yaml

from mlx_train.errors import ConfigError, did_you_mean

# Dedicated flag -> TrainConfig field; help and type come from the field (one source of truth).
FLAGS: dict[str, str] = {
    "--epochs": "epochs",
    "--batch-size": "batch_size",
    "--lr": "learning_rate",
    "--precision": "precision",
    "--seed": "seed",
    "--max-steps": "max_steps",
    "--model": "model",
    "--dataset": "dataset",
    "--run-dir": "run_dir",
    "--max-restarts": "max_restarts",
}


def _flag_type(name: str) -> Callable[[str], Any]:
    """An argparse type that converts and checks with TrainConfig.parse_value."""
    from mlx_train.config import TrainConfig

    def convert(text: str) -> Any:
        try:
            return TrainConfig.parse_value(name, text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _apply(config: Any, origin: str, changes: dict[str, Any]) -> Any:
    try:
        return config.replace(**changes)
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None


def _apply_set(config: Any, item: str) -> Any:
    """Apply one ``--set KEY=VALUE`` (``KEY`` a field, or ``model_options.NAME`` for a mapping field)."""
    from mlx_train.config import TrainConfig

    origin = f"--set {item}"
    key, sep, text = item.partition("=")
    name, dot, option = key.strip().replace("-", "_").partition(".")
    if not sep or not name:
        raise ConfigError(f"{origin}: expected KEY=VALUE, e.g. --set weight_decay=0.1")
    fields = TrainConfig.fields_help()
    if name not in fields:
        raise ConfigError(f"{origin}: unknown TrainConfig field '{name}'{did_you_mean(name, fields)}; "
                          "'mlx-train train --help' lists the flags, TrainConfig the fields")
    try:
        if not dot:
            return config.replace(**{name: TrainConfig.parse_value(name, text)})
        current = getattr(config, name)
        if not isinstance(current, dict):
            raise ConfigError(f"'{name}' is not a mapping, so '{key}' cannot be set; use --set {name}=VALUE")
        return config.replace(**{name: {**current, option: yaml.safe_load(text)}})
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: the value is not valid YAML: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None


def build_config(args: argparse.Namespace) -> Any:
    """The TrainConfig of a parsed ``train`` command line: defaults < --config < --set < flags."""
    from mlx_train.config import TrainConfig

    config = TrainConfig.from_yaml(args.config) if args.config else TrainConfig()
    for item in args.overrides:
        config = _apply_set(config, item)
    for flag, name in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            config = _apply(config, f"{flag} {value}", {name: value})
    return config
