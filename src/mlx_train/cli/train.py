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
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_train import rundir
from mlx_train.cli.flags import FLAG_ALIASES, FLAGS, _flag_type, build_config, resume_config
from mlx_train.errors import ConfigError, TrainingInterrupted, did_you_mean
from mlx_train.rundir import choose_run_dir

__all__ = ["FLAGS", "add_arguments", "build_config", "format_metrics", "main", "resolve_config", "run",
           "startup_line"]

EPILOG = """examples:
  mlx-train train                                   # mlp on digits, TrainConfig defaults
  mlx-train train --model cnn --epochs 5 --lr 3e-4
  mlx-train train --model transformer --dataset text --set model_options.num_layers=4
  mlx-train train --config my.yaml --run-dir runs/a   # later: mlx-train train --run-dir runs/a --resume

--resume continues with the run's saved configuration (RUN_DIR/config.yaml); flags given with it
change only what a resume can change (epochs, max_steps, lr without a schedule, cadences, ...).
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags; their help is TrainConfig's field help."""
    from mlx_train.builtin import DATASETS, MODELS  # names only: listing them loads no model code
    from mlx_train.config import TrainConfig

    notes = {  # what the field help cannot know: the CLI's own choices and defaults
        "model": f"; built-in: {', '.join(MODELS)}",
        "dataset": f"; built-in: {', '.join(DATASETS)}",
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
        parser.add_argument(flag, *FLAG_ALIASES.get(flag, ()), dest=name, default=None, type=_flag_type(name),
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
    from mlx_train.launch.train import add_train_arguments

    add_train_arguments(parser)  # --distributed, -n, --hostfile
    parser.unknown_flag_hint = _unknown_flag_hint  # type: ignore[attr-defined]


def _unknown_flag_hint(flag: str, flags: list[str]) -> str:
    """`` (did you mean ...?)`` for an unknown flag: the closest flag, or --set for a TrainConfig field."""
    from mlx_train.config import TrainConfig

    name = flag.lstrip("-").replace("-", "_")
    if name in TrainConfig.fields_help() and name not in FLAGS.values():
        return f" (did you mean '--set {name}=VALUE'? every TrainConfig field without its own flag is set that way)"
    return did_you_mean(flag, flags)


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


def _check_run_dir(run_dir: Path) -> None:
    """Create ``run_dir``, or say in one line why it cannot be (a file, a read-only place)."""
    fix = "pass --run-dir a directory that can be written (it is created if missing)"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"the run directory {run_dir} is a file, not a directory; {fix}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the run directory {run_dir}: {error.strerror or error}; {fix}") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"the run directory {run_dir} is not writable; {fix}")


def _precision_warning(config: Any) -> None:
    """One line at start-up: bfloat16/float16 matmuls on the Linux CPU are many times slower than float32."""
    import mlx.core as mx

    if config.precision != "float32" and sys.platform.startswith("linux") and mx.default_device() == mx.cpu:
        warnings.warn(f"precision {config.precision} on the Linux CPU is much slower than float32 (no fast "
                      f"{config.precision} matmul there), so steps can take minutes; use --precision float32 "
                      "unless you mean to test it", stacklevel=2)


class _ResumeSucceeded:
    """Callback of a resumed run: once the checkpoint is restored (``on_fit_start``), apply a new
    constant learning rate (the optimizer state restored it to the old one) and record the
    configuration in config.yaml, which a failed restore must leave as it was."""

    def __init__(self, config: Any, config_path: Path | None) -> None:
        self.config, self.config_path = config, config_path

    def on_fit_start(self, trainer: Any) -> None:
        if not self.config.lr_schedule and not self.config.warmup_steps:
            trainer.optimizer.learning_rate = self.config.learning_rate
        if self.config_path is not None:
            self.config.to_yaml(str(self.config_path))


def run(config: Any, resume: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``config.model`` on ``config.dataset``, then evaluate on the test split.

    With ``resume`` the run's config.yaml is rewritten only after the checkpoint was restored.
    Returns ``{"run_dir", "config", "history", "test"}``.
    """
    import mlx.core as mx

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model
    from mlx_train.distributed.rank import in_group, is_main_process
    from mlx_train.optim import build_optimizer
    from mlx_train.training import DistributedTrainer, Trainer

    if not is_main_process():  # a rank of a distributed run: rank 0 speaks for the group
        log = lambda message: None  # noqa: E731
    run_dir = choose_run_dir(config, resume)
    checkpoint_dir = config.checkpoint_dir or str(run_dir / rundir.CHECKPOINTS_DIR)
    config = config.replace(run_dir=str(run_dir), checkpoint_dir=checkpoint_dir)
    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    mx.random.seed(config.seed)  # the model's initial weights follow the seed too
    model = build_model(config.model, data["info"], **config.model_options)
    log(startup_line())  # after the cheap checks of the names above, so that a typo gives one message
    _precision_warning(config)
    _check_run_dir(run_dir)
    config_path = run_dir / rundir.CONFIG_FILE if is_main_process() else None
    callbacks: list[Any] = []
    if resume:
        callbacks.append(_ResumeSucceeded(config, config_path))
    elif config_path is not None:
        config.to_yaml(str(config_path))
    log(f"model {config.model} on dataset {config.dataset}; run directory {run_dir}")

    trainer_class = DistributedTrainer if in_group() else Trainer  # a rank of a launched group
    trainer = trainer_class(model, build_optimizer(config), config=config)
    history = trainer.train(data["train"], data["val"], epochs=config.epochs, checkpoint_dir=checkpoint_dir,
                            resume=resume, callbacks=callbacks)
    test_metrics = trainer.evaluate(data["test"])
    log(f"test: {format_metrics(test_metrics)}")
    return {"run_dir": run_dir, "config": config, "history": history, "test": test_metrics}


def resolve_config(args: argparse.Namespace, log: Callable[[str], None] = print) -> Any:
    """The TrainConfig of a ``train`` command line, with ``run_dir`` resolved.

    Without --resume: defaults < --config < --set < flags. With --resume and a run that has a
    config.yaml: that saved configuration, changed only by the flags given (each change is logged;
    one a resume cannot make is refused).

    Example::

        from mlx_train.cli.main import build_parser
        args = build_parser("train").parse_args(["train", "--run-dir", "runs/a", "--resume", "--epochs", "20"])
        resolve_config(args).epochs     # 20; the model, dataset, seed ... are runs/a/config.yaml's
    """
    from mlx_train.config import TrainConfig

    for given, flag in ((args.num_processes, "-n"), (args.hostfile, "--hostfile")):
        if given is not None and not args.distributed:
            raise ConfigError(f"{flag} {given} only applies to a distributed run: add --distributed "
                              f"(mlx-train train --distributed {flag} {given} ...), or leave {flag} out")
    config = build_config(args)
    if args.resume:
        run_dir = choose_run_dir(config, args.resume)
        saved_path = run_dir / rundir.CONFIG_FILE
        if saved_path.is_file():
            if args.optimize_memory:
                raise ConfigError("--optimize-memory cannot go with --resume: its plan changes batch_size and "
                                  "gradient_accumulation, which a resumed run keeps (out of memory, the Trainer "
                                  "halves the micro-batch itself); resume without it, or start a new run with it")
            config, notes = resume_config(args, TrainConfig.from_yaml(saved_path), str(saved_path), str(run_dir))
            log(f"resuming {run_dir} with its saved configuration"
                + (f", changed: {'; '.join(notes)}" if notes else ""))
    if args.optimize_memory:
        from mlx_train.cli.optimize import optimized_config

        config = optimized_config(config, batch_size=args.batch_size)
    return config.replace(run_dir=str(choose_run_dir(config, args.resume)))


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train train`` from parsed arguments."""
    config = resolve_config(args)
    if args.distributed:
        from mlx_train.launch.train import train_distributed

        return train_distributed(args, config)
    again = f"to continue: mlx-train train --run-dir {config.run_dir} --resume"
    try:
        run(config, resume=args.resume)
    except TrainingInterrupted as stop:  # the Trainer saved a checkpoint and said so: say how to go on
        print(again, file=sys.stderr)
        return int(stop.code)  # 128 + signal, as schedulers expect
    except KeyboardInterrupt:
        print(again, file=sys.stderr)
        raise
    return 0
