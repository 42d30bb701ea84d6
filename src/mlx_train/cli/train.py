"""Train a built-in model on a built-in dataset (default: an MLP on the digits).

Settings come from TrainConfig's defaults, overlaid by --config FILE, then by
--set KEY=VALUE, then by the dedicated flags. The run directory receives
checkpoints/ and the config.yaml actually used.

Example::

    from mlx_train.cli.train import run
    from mlx_train.config import TrainConfig

    result = run(TrainConfig(epochs=2, run_dir="runs/quick"))
    result["test"]      # {"loss": ..., "accuracy": ...}
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from mlx_train.errors import ConfigError, did_you_mean

HELP = "train a model (defaults: mlp on the digits dataset)"
EPILOG = """examples:
  mlx-train train                                   # mlp on digits, TrainConfig defaults
  mlx-train train --model cnn --epochs 5 --lr 3e-4
  mlx-train train --model transformer --dataset text --set model_options.num_layers=4
  mlx-train train --config my.yaml --run-dir runs/a   # later: ... --run-dir runs/a --resume
"""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags; their help is TrainConfig's field help."""
    from mlx_train.config import TrainConfig

    from mlx_train.datasets import available_datasets
    from mlx_train.models import available_models

    notes = {  # what the field help cannot know: the CLI's own choices and defaults
        "model": f"; built-in: {', '.join(available_models())}",
        "dataset": f"; built-in: {', '.join(available_datasets())}",
        "run_dir": "; the CLI uses runs/<model>-<dataset>-<date>-<time>",
    }
    fields = TrainConfig.fields_help()
    parser.add_argument(
        "--config", metavar="FILE",
        help="YAML config (sections training/optimizer/model/data, or flat field names); "
        "overlays the defaults, the flags overlay it",
    )
    for flag, name in FLAGS.items():
        field = fields[name]
        choices = f"; one of {', '.join(field.choices)}" if field.choices else ""
        default = "none" if field.default is None else field.default
        text = f"{field.help} (default: {default}{choices}{notes.get(name, '')})".replace("%", "%%")
        parser.add_argument(flag, dest=name, default=None, type=_flag_type(name),
                            metavar=name.upper(), help=text)
    parser.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' (the default when bare) takes the newest "
        "complete checkpoint of the run directory (without --run-dir: of the newest "
        "runs/<model>-<dataset>-* run), PATH a given checkpoint directory",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="set any TrainConfig field, e.g. --set weight_decay=0.1, --set lr_schedule=cosine_decay, "
        "--set model_options.hidden_dims=[512,512]; repeatable; the dedicated flags win",
    )
    parser.add_argument(
        "--optimize-memory", action="store_true",
        help="measure the model first and train with the plan of 'mlx-train optimize': the micro-batch, "
        "accumulation and gradient checkpointing that reach batch_size x gradient_accumulation within "
        "the device memory (or memory_limit); with --batch-size N the micro-batch stays N",
    )
    from mlx_train.distributed.launch import add_train_arguments

    add_train_arguments(parser)  # --distributed, -n, --hostfile


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


def startup_line() -> str:
    """``mlx-train 0.1.0 | MLX 0.32.4 | device cpu | BLAS OpenBLAS ...``"""
    import mlx.core as mx

    import mlx_train
    from mlx_train import _blas

    return (
        f"mlx-train {getattr(mlx_train, '__version__', '?')} | MLX {mx.__version__} | "
        f"device {mx.default_device().type.name} | BLAS {_blas.describe()}"
    )


def format_metrics(metrics: dict[str, Any], prefix: str = "") -> str:
    """``{"loss": 0.1, "accuracy": 0.97}`` -> ``"loss 0.1000 | accuracy 0.9700"``"""
    return " | ".join(
        f"{prefix}{k} {v:.4f}" if isinstance(v, float) else f"{prefix}{k} {v}" for k, v in metrics.items()
    )


def resolve_run_dir(config: Any, resume: str | None, runs_root: str = "runs") -> Path:
    """Where a run writes: config.run_dir, else the run of --resume, else a new timestamped dir."""
    if config.run_dir:
        return Path(config.run_dir)
    if resume and resume != "auto" and Path(resume).parent.name == "checkpoints":
        return Path(resume).parent.parent
    prefix = f"{config.model}-{config.dataset}-"
    if resume == "auto":
        previous = sorted(p for p in Path(runs_root).glob(prefix + "*") if (p / "checkpoints").is_dir())
        if previous:
            return previous[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, count = Path(runs_root) / (prefix + stamp), 1
    while run_dir.exists():  # two runs started within the same second
        count += 1
        run_dir = Path(runs_root) / f"{prefix}{stamp}-{count}"
    return run_dir


def run(config: Any, resume: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``config.model`` on ``config.dataset``, then evaluate on the test split.

    Returns ``{"run_dir", "config", "history", "test"}``.
    """
    import mlx.core as mx

    from mlx_train.datasets import load_dataset
    from mlx_train.models import build_model
    from mlx_train.distributed.launch import is_main_process, trainer_class
    from mlx_train.optim import build_optimizer

    if not is_main_process():  # a rank of a distributed run: rank 0 speaks for the group
        log = lambda message: None  # noqa: E731
    run_dir = resolve_run_dir(config, resume)
    checkpoint_dir = config.checkpoint_dir or str(run_dir / "checkpoints")
    config = config.replace(run_dir=str(run_dir), checkpoint_dir=checkpoint_dir)
    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    mx.random.seed(config.seed)  # the model's initial weights follow the seed too
    model = build_model(config.model, data["info"], **config.model_options)
    log(startup_line())  # after the cheap checks of the names above, so that a typo gives one message
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        config.to_yaml(str(run_dir / "config.yaml"))
    log(f"model {config.model} on dataset {config.dataset}; run directory {run_dir}")

    trainer = trainer_class()(model, build_optimizer(config), config=config)
    history = trainer.train(
        data["train"], data["val"], epochs=config.epochs, checkpoint_dir=checkpoint_dir, resume=resume
    )
    test_metrics = trainer.evaluate(data["test"])
    log(f"test: {format_metrics(test_metrics)}")
    return {"run_dir": run_dir, "config": config, "history": history, "test": test_metrics}


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train train`` from parsed arguments."""
    config = build_config(args)
    if args.optimize_memory:
        from mlx_train.cli.optimize import optimized_config

        config = optimized_config(config, batch_size=args.batch_size)
    if args.distributed:
        from mlx_train.distributed.launch import train_distributed

        return train_distributed(args, config)
    config = config.replace(run_dir=str(resolve_run_dir(config, args.resume)))
    try:
        run(config, resume=args.resume)
    except KeyboardInterrupt:
        print(f"to continue: mlx-train train --run-dir {config.run_dir} --resume", file=sys.stderr)
        raise
    return 0
