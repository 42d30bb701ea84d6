"""The TrainConfig flags shared by ``mlx-train train`` and ``mlx-train optimize``: how a command
line becomes a ``TrainConfig`` (defaults < ``--config`` < ``--set`` < dedicated flags), and how a
resumed run takes its saved configuration with only the changes a resume allows.

Example::

    from mlx_train.cli.flags import build_config
    config = build_config(parsed_args)      # a TrainConfig
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

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
    "--report-to": "report_to",
    "--project-name": "project_name",
    "--run-name": "run_name",
}
# Other spellings of a dedicated flag (mlx_lm's scripts say --learning-rate).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"--lr": ("--learning-rate",)}

_DATA_ORDER = "the data order and the position in the epoch are restored from the checkpoint"
# Fields a resumed run must keep, and why: the checkpoint's state only fits the run as it was started.
FIXED_ON_RESUME: dict[str, str] = {
    "model": "the checkpoint holds the weights of that model",
    "model_options": "the checkpoint holds weights of that shape",
    "dataset": _DATA_ORDER,
    "dataset_options": _DATA_ORDER,
    "seed": "the data order and the random state come from the checkpoint, drawn with that seed",
    "batch_size": _DATA_ORDER + ", counted in batches of that size",
    "shuffle": _DATA_ORDER,
    "drop_last": _DATA_ORDER,
    "gradient_accumulation": "every optimizer step so far averaged that many micro-batches",
    "optimizer": "the checkpoint holds that optimizer's state",
    "checkpoint_dir": "the checkpoints to resume from are there",
    "lr_schedule": "the schedule goes on from the checkpoint's step",
    "lr_schedule_args": "the schedule goes on from the checkpoint's step",
    "warmup_steps": "the schedule goes on from the checkpoint's step",
    "warmup_init": "the schedule goes on from the checkpoint's step",
    "monitor": "the best checkpoint and early stopping restored from the checkpoint were measured with it",
    "monitor_mode": "the best checkpoint and early stopping restored from the checkpoint were measured with it",
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


def _set_value(item: str, current: Callable[[str], Any]) -> tuple[str, Any]:
    """``(field, value)`` of one ``--set KEY=VALUE`` (``KEY`` a field, or ``model_options.NAME`` for a
    mapping field, merged into ``current(field)``)."""
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
            return name, TrainConfig.parse_value(name, text)
        mapping = current(name)
        if not isinstance(mapping, dict):
            raise ConfigError(f"'{name}' is not a mapping, so '{key}' cannot be set; use --set {name}=VALUE")
        return name, {**mapping, option: yaml.safe_load(text)}
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: the value is not valid YAML: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None


def command_line_changes(args: argparse.Namespace, base: Any) -> dict[str, tuple[Any, str]]:
    """The fields ``--set`` and the dedicated flags set: ``{field: (value, origin)}``, flags last.

    Example: ``--set epochs=4 --lr 0.1`` gives ``{"epochs": (4, "--set epochs=4"), "learning_rate":
    (0.1, "--lr 0.1")}``.
    """
    changes: dict[str, tuple[Any, str]] = {}

    def current(name: str) -> Any:
        return changes[name][0] if name in changes else getattr(base, name)

    for item in args.overrides:
        name, value = _set_value(item, current)
        changes[name] = (value, f"--set {item}")
    for flag, name in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            changes[name] = (value, f"{flag} {value}")
    return changes


def apply_changes(config: Any, changes: dict[str, tuple[Any, str]]) -> Any:
    """``config`` with every change applied in one ``replace`` (so ``--set optimizer=sgd --set
    momentum=0.9`` works in either order); an error names the flags it comes from."""
    try:
        return config.replace(**{name: value for name, (value, _) in changes.items()})
    except ConfigError as error:
        named = [origin for name, (_, origin) in changes.items() if name in str(error)]
        origins = named or [origin for _, origin in changes.values()]
        raise ConfigError(f"{', '.join(origins)}: {error}") from None


def build_config(args: argparse.Namespace) -> Any:
    """The TrainConfig of a parsed ``train`` command line: defaults < --config < --set < flags."""
    from mlx_train.config import TrainConfig

    config = TrainConfig.from_yaml(args.config) if args.config else TrainConfig()
    return apply_changes(config, command_line_changes(args, config))


def _config_file_changes(path: str) -> dict[str, tuple[Any, str]]:
    """The fields a ``--config`` file sets (only those it names), each with its origin."""
    from mlx_train.config import SECTIONS, TrainConfig
    from mlx_train.config.files import read
    from mlx_train.config.options import options

    TrainConfig.from_yaml(path)  # the file alone must be valid: its errors name its lines
    return {name: (value, f"--config {path} ({name})") for name, value in read(path, options(TrainConfig),
                                                                              SECTIONS).items()}


def resume_config(args: argparse.Namespace, saved: Any, saved_path: str,
                  run_dir: str | None = None) -> tuple[Any, list[str]]:
    """The configuration of a resumed run: ``saved`` (its config.yaml) with the changes of the command line.

    Returns ``(config, notes)``: one note per changed field (``"epochs 1 -> 3 (--epochs 3)"``). A change
    that cannot be made on resume (the model, the dataset, the seed, ...) raises ``ConfigError`` that says
    why and what to do instead.

    Example::

        config, notes = resume_config(args, TrainConfig.from_yaml("runs/a/config.yaml"), "runs/a/config.yaml")
    """
    from pathlib import Path

    from mlx_train.rundir import CHECKPOINTS_DIR

    def derived(config_run_dir: Any, checkpoint_dir: Any) -> bool:  # RUN_DIR/checkpoints, the CLI's default
        if not (config_run_dir and checkpoint_dir):
            return False
        return Path(checkpoint_dir) == Path(config_run_dir) / CHECKPOINTS_DIR

    # A run directory that was moved or copied resumes from its own checkpoints, not from the old place's.
    if derived(saved.run_dir, saved.checkpoint_dir):
        saved = saved.replace(checkpoint_dir=None)
    saved = saved.replace(run_dir=run_dir or saved.run_dir)
    changes = _config_file_changes(args.config) if args.config else {}
    changes.update(command_line_changes(args, saved))
    if "checkpoint_dir" in changes and derived(saved.run_dir, changes["checkpoint_dir"][0]):
        del changes["checkpoint_dir"]
    changes = {name: change for name, change in changes.items()
               if name != "run_dir" and change[0] != getattr(saved, name)}
    refused = []
    for name, (_, origin) in changes.items():
        if name in ("batch_size", "gradient_accumulation"):
            continue  # the Trainer checks them against the checkpoint's global batch, which knows its rank count
        if name in FIXED_ON_RESUME:
            reason = FIXED_ON_RESUME[name]
        elif name == "learning_rate" and (saved.lr_schedule or saved.warmup_steps):
            reason = "it follows lr_schedule and warmup from the checkpoint's step"
        else:
            continue
        refused.append(f"{origin}: {name} cannot change on resume (the run has {name}={getattr(saved, name)!r} "
                       f"in {saved_path}; {reason})")
    if refused:
        raise ConfigError("; ".join(refused) + ". To resume, leave those out (the run's saved configuration is used);"
                          " to train with other values, start a new run: a new --run-dir, without --resume")
    config = apply_changes(saved, changes)
    notes = [f"{name} {getattr(saved, name)!r} -> {value!r} ({origin})" for name, (value, origin) in changes.items()]
    return config, notes
