"""The config flags shared by ``mlx-train train``, ``mlx-train finetune`` and ``mlx-train optimize``:
how a command line becomes a ``TrainConfig`` (``finetune``: a ``FinetuneConfig``; defaults < ``--config``
< ``--set`` < dedicated flags),
and how a resumed run takes its saved configuration with only the changes a resume allows.
``finetune`` has train's flags plus one per field of the llm section and mlx_lm.lora's flag names
(``finetune_flags()``, ``ITERATION_FLAGS``); every flag's help and default is its field's, in the config
of that command (``finetune --help`` shows fine-tuning's defaults).

Example::

    from mlx_train.cli.flags import build_config
    config = build_config(parsed_args)      # a TrainConfig
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import yaml

from mlx_train.config.files import load_yaml
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
# Other spellings of a dedicated flag (mlx_lm's scripts say --learning-rate and --data).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"--lr": ("--learning-rate",), "--dataset": ("--data",),
                                            "--dpo-loss-type": ("--dpo-cpo-loss-type",),
                                            "--group-size": ("--num-generations",),
                                            "--clip-epsilon": ("--epsilon",), "--fine-tune-type": ("--train-type",)}
# mlx_lm.lora's flags counted in iterations (micro-batches): flag -> its key (mlx_train.config.mlx_lm).
ITERATION_FLAGS: dict[str, str] = {"--iters": "iters", "--steps-per-report": "steps_per_report",
                                   "--steps-per-eval": "steps_per_eval", "--save-every": "save_every"}
# mlx_lm.lora's other flag names for TrainConfig fields.
_MLX_LM_FLAGS: dict[str, str] = {"--optimizer": "optimizer", "--grad-accumulation-steps": "gradient_accumulation",
                                 "--grad-checkpoint": "gradient_checkpointing", "--val-batches": "val_batches"}


def finetune_flags() -> dict[str, str]:
    """``finetune``'s dedicated flags: train's, mlx_lm.lora's and one per llm field (``--num-layers``).

    Example: ``finetune_flags()["--mask-prompt"]`` -> ``"mask_prompt"``.
    """
    from mlx_train.config import FinetuneConfig

    llm = {f"--{name.replace('_', '-')}": name for name, field in FinetuneConfig.fields_help().items()
           if field.section == "llm"}
    return {**FLAGS, **_MLX_LM_FLAGS, **llm}


def is_switch(name: str) -> bool:
    """A bool field gets a switch (``--pack``) rather than a flag with a value."""
    from mlx_train.config.sections import all_fields

    return str(all_fields()[name].type) in ("bool", "bool | None")


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, str], notes: dict[str, str] | None = None,
              config: Any = None) -> None:
    """One flag per entry of ``flags`` (flag -> field of ``config``, default train's LaunchConfig): its type,
    check, help and default (``config``'s: FinetuneConfig shows fine-tuning's) are the field's."""
    from mlx_train.config import LaunchConfig

    config = config or LaunchConfig
    fields = config.fields_help()
    for flag, name in flags.items():
        field = fields[name]
        choices = f"; one of {', '.join(field.choices)}" if field.choices else ""
        default = "none" if field.default in (None, "") else field.default
        text = f"{field.help} (default: {default}{choices}{(notes or {}).get(name, '')})".replace("%", "%%")
        names = (flag, *FLAG_ALIASES.get(flag, ()))
        if is_switch(name) and field.default is True:  # on by default: --no-NAME turns it off
            parser.add_argument(*names, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif is_switch(name):
            parser.add_argument(*names, dest=name, action="store_true", default=None, help=text)
        elif field.type == "bool | str":  # a switch that may name its kind: --pack, --pack by_length
            parser.add_argument(*names, dest=name, nargs="?", const=True, default=None, type=_flag_type(name, config),
                                metavar="KIND", help=text)
        else:
            parser.add_argument(*names, dest=name, default=None, type=_flag_type(name, config), metavar=name.upper(),
                                help=text)

_DATA_ORDER = "the data order and the position in the epoch are restored from the checkpoint"
_LOSS = "the checkpoint's run was trained with that loss"
_SAMPLED = "the completions so far were sampled with it (a resumed run samples what the run would have)"
_SCORED = "the completions so far were scored with those reward functions and weights"
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
    "fine_tune_type": "the checkpoint holds the trained parameters of that method",
    "num_layers": "the checkpoint holds adapters of those blocks",
    "lora_parameters": "the checkpoint holds adapters of that rank",
    "max_seq_length": _DATA_ORDER + ", of rows cut at that length",
    "pack": _DATA_ORDER + ", of rows packed that way",
    "mask_prompt": "the rows and their trained tokens were built with it",
    "assistant_only_loss": "the rows and their trained tokens were built with it",
    "train_on_tool_calls": "the rows and their trained tokens were built with it",
    "train_on_reasoning": "the rows and their trained tokens were built with it",
    "train_mode": "the checkpoint's run was trained with that loss",
    "beta": _LOSS,
    "group_size": "the completions so far were compared in groups of that size",
    "max_completion_length": _SAMPLED,
    "temperature": _SAMPLED,
    "top_p": _SAMPLED,
    "top_k": _SAMPLED,
    "clip_epsilon": _LOSS,
    "epsilon_high": _LOSS,
    "grpo_loss_type": _LOSS,
    "importance_sampling_level": _LOSS,
    "scale_rewards": _LOSS,
    "reward_functions": _SCORED,
    "reward_functions_file": _SCORED,
    "reward_weights": _SCORED,
    "num_iterations": _DATA_ORDER + ", each batch of prompts handed out that many times in a row",
}


def _flag_type(name: str, config: Any = None) -> Callable[[str], Any]:
    """An argparse type that converts and checks with ``config.parse_value`` (default train's LaunchConfig)."""
    if config is None:
        from mlx_train.config import LaunchConfig

        config = LaunchConfig

    def convert(text: str) -> Any:
        try:
            return config.parse_value(name, text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _set_value(item: str, current: Callable[[str], Any], config: Any) -> tuple[str, Any]:
    """``(field, value)`` of one ``--set KEY=VALUE`` (``KEY`` a field of ``config``, or ``model_options.NAME``
    for a mapping field, merged into ``current(field)``)."""
    from mlx_train.config.sections import where_it_goes

    origin = f"--set {item}"
    key, sep, text = item.partition("=")
    name, dot, option = key.strip().replace("-", "_").partition(".")
    if not sep or not name:
        raise ConfigError(f"{origin}: expected KEY=VALUE, e.g. --set weight_decay=0.1")
    fields = config.fields_help()
    if name not in fields:
        goes = where_it_goes(name)
        if goes:
            raise ConfigError(f"{origin}: {goes}")
        raise ConfigError(f"{origin}: unknown TrainConfig field '{name}'{did_you_mean(name, fields)}; "
                          "'mlx-train train --help' lists the flags, TrainConfig the fields")
    try:
        if not dot:
            return name, config.parse_value(name, text)
        mapping = current(name)
        if not isinstance(mapping, dict):
            raise ConfigError(f"'{name}' is not a mapping, so '{key}' cannot be set; use --set {name}=VALUE")
        return name, {**mapping, option: load_yaml(text)}
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: the value is not valid YAML: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None


def command_line_changes(args: argparse.Namespace, base: Any, flags: dict[str, str] | None = None,
                         given: dict[str, tuple[Any, str]] | None = None) -> dict[str, tuple[Any, str]]:
    """The fields ``--set`` and the dedicated flags (``flags``, default train's) set: ``{field: (value,
    origin)}``, flags last. mlx_lm.lora's counts (``--iters``) are ``Iterations``, resolved with the
    final gradient_accumulation. ``base`` is the config they change (or its class, whose defaults apply
    under the changes ``given`` before them, e.g. a --config file's); ``--set NAME.KEY=`` merges into it.

    Example: ``--set epochs=4 --lr 0.1`` gives ``{"epochs": (4, "--set epochs=4"), "learning_rate":
    (0.1, "--lr 0.1")}``.
    """
    from mlx_train.config.mlx_lm import ITERATION_KEYS, iterations

    changes: dict[str, tuple[Any, str]] = dict(given or {})
    config_class = base if isinstance(base, type) else type(base)

    def current(name: str) -> Any:
        if name in changes:
            return changes[name][0]
        return config_class.defaults()[name] if base is config_class else getattr(base, name)

    for item in args.overrides:
        name, value = _set_value(item, current, config_class)
        changes[name] = (value, f"--set {item}")
    for flag, name in (flags or FLAGS).items():
        value = getattr(args, name, None)
        if value is not None:
            switch = flag if value is True else f"--no-{flag[2:]}"
            changes[name] = (value, switch if is_switch(name) else f"{flag} {value}")
    for flag, key in ITERATION_FLAGS.items():
        value = getattr(args, key, None)
        if value is not None:
            origin = f"{flag} {value}"
            changes[ITERATION_KEYS[key]] = (iterations(key, value, origin), origin)
            if key == "iters" and "epochs" not in changes:
                changes["epochs"] = (None, origin)  # mlx_lm.lora loops over the data until iters
    return changes


def apply_changes(config: Any, changes: dict[str, tuple[Any, str]]) -> Any:
    """``config`` with every change applied in one ``replace`` (so ``--set optimizer=sgd --set
    momentum=0.9`` works in either order); an error names the flags it comes from."""
    from mlx_train.config.options import Deferred, options, resolve

    values = {name: value for name, (value, _) in changes.items()}
    try:
        if any(isinstance(value, Deferred) for value in values.values()):
            values = {name: value for name, value in resolve({**config.to_dict(), **values}, options(config)).items()
                      if name in values}
        return config.replace(**values)
    except ConfigError as error:
        named = [origin for name, (_, origin) in changes.items() if name in str(error)]
        origins = named or [origin for _, origin in changes.values()]
        raise ConfigError(f"{', '.join(origins)}: {error}") from None


def build_config(args: argparse.Namespace, finetune: bool = False) -> Any:
    """The config of a parsed ``train`` command line (a LaunchConfig: the Trainer's with the launcher's), or
    ``finetune``'s (a FinetuneConfig, on mlx_lm.lora's defaults, with its flags): defaults < --config < --set
    < flags."""
    from mlx_train.config import FinetuneConfig, LaunchConfig

    if not finetune:
        config = LaunchConfig.from_yaml(args.config) if args.config else LaunchConfig()
        return apply_changes(config, command_line_changes(args, config))
    changes = _config_file_changes(args.config, finetune=True) if args.config else {}
    changes = command_line_changes(args, FinetuneConfig, finetune_flags(), given=changes)
    try:  # built once, from every layer's values
        return FinetuneConfig(**{name: value for name, (value, _) in changes.items()})
    except ConfigError as error:
        named = [origin for name, (_, origin) in changes.items() if name in str(error)]
        raise ConfigError(f"{', '.join(named) + ': ' if named else ''}{error}") from None


def _config_file_changes(path: str, finetune: bool = False) -> dict[str, tuple[Any, str]]:
    """The fields a ``--config`` file sets (only those it names), each with its origin; mlx_lm.lora's
    iteration counts stay ``Iterations`` until the final gradient_accumulation is known."""
    from mlx_train.config import SECTIONS, LaunchConfig
    from mlx_train.config.files import read
    from mlx_train.config.sections import all_fields
    from mlx_train.config.train import dialect

    LaunchConfig.from_yaml(path, finetune=finetune)  # the file alone must be valid: its errors name its lines
    values = read(path, all_fields(), SECTIONS, dialect(finetune), defer=True)
    return {name: (value, f"--config {path} ({name})") for name, value in values.items()}


def resume_config(args: argparse.Namespace, saved: Any, saved_path: str,
                  run_dir: str | None = None, finetune: bool = False) -> tuple[Any, list[str]]:
    """The configuration of a resumed run: ``saved`` (its config.yaml) with the changes of the command line.

    Returns ``(config, notes)``: one note per changed field (``"epochs 1 -> 3 (--epochs 3)"``). A change
    that cannot be made on resume (the model, the dataset, the seed, ...) raises ``ConfigError`` that says
    why and what to do instead.

    Example::

        config, notes = resume_config(args, TrainConfig.from_yaml("runs/a/config.yaml"), "runs/a/config.yaml")
    """
    from pathlib import Path

    from mlx_train.rundir import checkpoints_path

    def derived(config_run_dir: Any, checkpoint_dir: Any) -> bool:  # RUN_DIR/checkpoints, the CLI's default
        if not (config_run_dir and checkpoint_dir):
            return False
        return Path(checkpoint_dir) == Path(str(checkpoints_path(config_run_dir)))

    # A run directory that was moved or copied resumes from its own checkpoints, not from the old place's.
    if derived(saved.run_dir, saved.checkpoint_dir):
        saved = saved.replace(checkpoint_dir=None)
    saved = saved.replace(run_dir=run_dir or saved.run_dir)
    changes = _config_file_changes(args.config, finetune) if args.config else {}
    changes.update(command_line_changes(args, saved, finetune_flags() if finetune else None))
    if "checkpoint_dir" in changes and derived(saved.run_dir, changes["checkpoint_dir"][0]):
        del changes["checkpoint_dir"]
    from mlx_train.config.options import Deferred

    changes = {name: change for name, change in changes.items()
               if name != "run_dir" and (isinstance(change[0], Deferred) or change[0] != getattr(saved, name))}
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
    notes = [f"{name} {getattr(saved, name)!r} -> {getattr(config, name)!r} ({origin})"
             for name, (_, origin) in changes.items() if getattr(config, name) != getattr(saved, name)]
    return config, notes
