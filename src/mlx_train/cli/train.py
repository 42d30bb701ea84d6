"""Train a built-in model on a built-in dataset (default: an MLP on the digits).

Settings come from TrainConfig's defaults, overlaid by --config FILE, then by
--set KEY=VALUE, then by the dedicated flags. The run directory receives
checkpoints/ and the config.yaml actually used. A directory that holds a run is
continued with --resume (its checkpoint's configuration, changed by the flags given)
or moved aside with --overwrite; a new run never writes over it.

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
from mlx_train.cli.flags import FLAGS, add_flags, build_config, resume_config
from mlx_train.errors import ConfigError, TrainingInterrupted, did_you_mean
from mlx_train.rundir import choose_run_dir

__all__ = ["FLAGS", "add_arguments", "build_config", "format_metrics", "main", "resolve_config", "run",
           "startup_line"]

EPILOG = """examples:
  mlx-train train                                   # mlp on digits, TrainConfig defaults
  mlx-train train --model cnn --epochs 5 --lr 3e-4
  mlx-train train --model transformer --dataset text --set model_options.num_layers=4
  mlx-train train --config my.yaml --run-dir runs/a   # later: mlx-train train --run-dir runs/a --resume

--resume continues with the configuration its checkpoint recorded (RUN_DIR/config.yaml when the run
stopped before its first checkpoint); flags given with it change only what a resume can change
(epochs, max_steps, lr without a schedule, cadences, ...). A run directory that holds a run is not
started over: --resume continues it, --overwrite moves it aside to RUN_DIR.old-<date>-<time> first.
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags; their help is TrainConfig's field help."""
    from mlx_train.builtin import DATASETS, MODELS  # names only: listing them loads no model code

    notes = {  # what the field help cannot know: the CLI's own choices and defaults
        "model": f"; built-in: {', '.join(MODELS)}",
        "dataset": f"; built-in: {', '.join(DATASETS)}",
        "run_dir": "; the CLI uses runs/<model>-<dataset>-<date>-<time>",
    }
    parser.add_argument(
        "-c", "--config", metavar="FILE",
        help="YAML config (sections training/optimizer/model/data, or flat field names; mlx_lm.lora's keys "
        "too); overlays the defaults, the flags overlay it",
    )
    add_flags(parser, FLAGS, notes)
    parser.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' (the default when bare) takes the newest "
        "complete checkpoint of the run directory (without --run-dir: of the newest "
        "runs/<model>-<dataset>-* run), PATH a given checkpoint directory",
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help="start a new run in a --run-dir that holds one: the old run is moved aside to "
        "RUN_DIR.old-<date>-<time> (never deleted); without it such a start is refused",
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
    """``mlx-train 0.1.0 | MLX 0.32.4 | device cpu | BLAS OpenBLAS ...`` (and a second line when an MLX CUDA
    wheel is installed but MLX runs on the CPU, with the command that fixes it)."""
    import mlx.core as mx

    import mlx_train
    from mlx_train import _blas
    from mlx_train.device import shadowed_gpu_library

    mlx_version = mx.__version__  # type: ignore[attr-defined]  # not in the stubs
    device = mx.default_device().type.name
    line = (f"mlx-train {getattr(mlx_train, '__version__', '?')} | MLX {mlx_version} | "
            f"device {device} | BLAS {_blas.describe()}")
    shadowed = shadowed_gpu_library() if device == "cpu" else None  # a CUDA install that runs on the CPU
    return line + (f"\nnote: {shadowed}" if shadowed else "")


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
    constant learning rate (the optimizer state restored it to the old one). config.yaml is written
    by the Trainer's MetricsLogger at that moment too: after the lock is held and the restore succeeded."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def on_fit_start(self, trainer: Any) -> None:
        if not self.config.lr_schedule and not self.config.warmup_steps:
            trainer.optimizer.learning_rate = self.config.learning_rate


def run(config: Any, resume: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``config.model`` on ``config.dataset``, then evaluate on the test split.

    config.yaml is written once, under the run lock, after a resume's checkpoint was restored.
    A ``run_dir`` that holds another run is refused (a resume continues it).
    Returns ``{"run_dir", "config", "history", "test"}``.
    """
    import mlx.core as mx

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model
    from mlx_train.distributed.environment import in_group, is_main_process
    from mlx_train.optim import build_optimizer
    from mlx_train.run_directory import RunDirectory
    from mlx_train.training.trainer import Trainer

    if not is_main_process():  # a rank of a distributed run: rank 0 speaks for the group
        log = lambda message: None  # noqa: E731
    run_directory = RunDirectory.choose(config, resume)
    run_dir, checkpoint_dir = Path(str(run_directory.path)), run_directory.checkpoint_dir
    config = run_directory.configure(config)
    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    mx.random.seed(config.seed)  # the model's initial weights follow the seed too
    model = build_model(config.model, data["info"], **config.model_options)
    log(startup_line())  # after the cheap checks of the names above, so that a typo gives one message
    _precision_warning(config)
    _check_run_dir(run_dir)
    callbacks: list[Any] = [_ResumeSucceeded(config)] if resume else []
    log(f"model {config.model} on dataset {config.dataset}; run directory {run_dir}")

    trainer_class: type[Trainer] = Trainer
    if in_group():  # a rank of a launched group
        from mlx_train.training.distributed import DistributedTrainer

        trainer_class = DistributedTrainer
    trainer = trainer_class(model, build_optimizer(config), config=config)
    history = trainer.train(data["train"], data["val"], epochs=config.epochs, checkpoint_dir=checkpoint_dir,
                            resume=resume, callbacks=callbacks)
    test_metrics = trainer.evaluate(data["test"])
    log(f"test: {format_metrics(test_metrics)}")
    return {"run_dir": run_dir, "config": config, "history": history, "test": test_metrics}


def resolve_config(args: argparse.Namespace, log: Callable[[str], None] = print) -> Any:
    """The TrainConfig of a ``train`` command line, with ``run_dir`` resolved.

    Without --resume: defaults < --config < --set < flags. With --resume: the configuration the
    checkpoint to resume recorded (config.yaml when the run stopped before its first checkpoint),
    changed only by the flags given (each change is logged; one a resume cannot make is refused).

    Example::

        from mlx_train.cli.main import build_parser
        args = build_parser("train").parse_args(["train", "--run-dir", "runs/a", "--resume", "--epochs", "20"])
        resolve_config(args).epochs     # 20; the model, dataset, seed ... are the checkpoint's
    """
    for given, flag in ((args.num_processes, "-n"), (args.hostfile, "--hostfile"), (args.strategy, "--strategy")):
        if given is not None and not args.distributed:
            raise ConfigError(f"{flag} {given} only applies to a distributed run: add --distributed "
                              f"(mlx-train train --distributed {flag} {given} ...), or leave {flag} out")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts the run over and --resume continues it: give one of them")
    config = build_config(args)
    if args.resume:
        if args.optimize_memory:
            raise ConfigError("--optimize-memory cannot go with --resume: its plan changes batch_size and "
                              "gradient_accumulation, which a resumed run keeps (out of memory, the Trainer "
                              "halves the micro-batch itself); resume without it, or start a new run with it")
        from mlx_train.distributed.environment import supervised

        run_dir = choose_run_dir(config, args.resume)
        found = saved_config(run_dir, config.checkpoint_dir, args.resume, required=not supervised())
        if found is not None:  # else a group restarted before it saved anything: its --config is the run's
            config, notes = resume_config(args, found[0], found[1], str(run_dir))
            log(f"resuming {run_dir} with the configuration of {found[1]}"
                + (f", changed: {'; '.join(notes)}" if notes else ""))
    if args.optimize_memory:
        from mlx_train.cli.optimize import optimized_config

        config = optimized_config(config, batch_size=args.batch_size)
    return config.replace(run_dir=str(choose_run_dir(config, args.resume)))


def refuse_finetune_checkpoint(path: str, state: dict[str, Any], command: str) -> None:
    """A checkpoint of ``mlx-train finetune`` (it records the frozen base model it trains on) given to a command
    for the runs of ``mlx-train train``: a ConfigError saying what to run instead."""
    base = state.get("base_model")
    if not isinstance(base, dict):
        return
    model = base.get("path", "MODEL")
    run_dir = os.path.dirname(os.path.dirname(os.path.normpath(path))) or "RUN_DIR"
    raise ConfigError(
        f"checkpoint {path} is from a fine-tuning run (mlx-train finetune of {model}), which `mlx-train {command}` "
        f"does not rebuild: continue it with `mlx-train finetune --run-dir {run_dir} --resume`; use "
        f"its adapters with `mlx_lm.generate --model {model} --adapter-path {run_dir}/adapters`; for a standalone "
        "model, add --fuse DIR to the finetune command")


def saved_config(run_dir: Path, checkpoint_dir: str | None, resume: str,
                 required: bool = True, command: str = "train") -> tuple[Any, str] | None:
    """``(config, where it was read)`` of the run a ``--resume`` continues: the configuration its checkpoint
    recorded (the source of truth), or the run's config.yaml when it stopped before its first checkpoint.
    Neither is an error (None when not ``required``): a resume never falls back to the defaults.
    ``command="finetune"``: read as a FinetuneConfig (the run's llm section too), else a LaunchConfig.

    Example: ``saved_config(Path("runs/a"), None, "auto")`` is
    ``(TrainConfig(...), "runs/a/checkpoints/step-00000400")``.
    """
    from mlx_train.checkpointing import load_checkpoint
    from mlx_train.config import FinetuneConfig, LaunchConfig
    from mlx_train.errors import CheckpointError
    from mlx_train.run_directory import RunDirectory

    command_config = FinetuneConfig if command == "finetune" else LaunchConfig
    run = RunDirectory.of(run_dir, checkpoint_dir)
    checkpoint_dir = run.checkpoint_dir
    path = run.resolve(resume)
    if path is not None:
        _, state = load_checkpoint(path, groups=[])
        if command == "train":
            refuse_finetune_checkpoint(path, state, "train --resume")
        if isinstance(state.get("config"), dict):
            return command_config.from_dict(state["config"], f"{path}/trainer_state.json"), path
    config_path = run_dir / rundir.CONFIG_FILE
    if config_path.is_file():
        return command_config.from_yaml(config_path), str(config_path)
    if not required:
        return None
    if path is not None:
        raise CheckpointError(f"checkpoint {path} holds no training config and {config_path} does not exist, so "
                              "the run's settings are unknown; resume it from Python with Trainer.train(resume=...)")
    raise CheckpointError(f"there is nothing to resume in {run_dir}: no checkpoint in {checkpoint_dir} and no "
                          f"{rundir.CONFIG_FILE}. Pass the --run-dir of the run to continue, or start a new run "
                          "without --resume")


def _make_room(config: Any, args: argparse.Namespace) -> None:
    """A new run (no --resume) into a run directory that holds one: refused, or with --overwrite moved aside."""
    from mlx_train.distributed.environment import is_main_process

    if args.resume or not is_main_process():  # a launched rank: the launcher made room before starting it
        return
    from mlx_train.run_directory import RunDirectory

    RunDirectory.of(config.run_dir, config.checkpoint_dir).make_room(args.overwrite, print)


def _how_to_continue(config: Any) -> str:
    """The command that continues an interrupted run, only when it would: a checkpoint or config.yaml exists.
    A rank of a launched group says nothing: its supervisor prints the command with --distributed."""
    from mlx_train.distributed.environment import in_group

    if in_group():
        return ""
    from mlx_train.run_directory import RunDirectory

    if RunDirectory.of(config.run_dir, config.checkpoint_dir).has_checkpoint_or_config():
        return f"to continue: mlx-train train --run-dir {config.run_dir} --resume"
    return ("nothing of this run was saved yet (no checkpoint, no config.yaml): to start it, run the same "
            "command again")


def _say(line: str) -> None:
    if line:
        print(line, file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train train`` from parsed arguments."""
    config = resolve_config(args)
    _make_room(config, args)
    if args.distributed:
        from mlx_train.launch.train import train_distributed

        return train_distributed(args, config)
    try:
        run(config, resume=args.resume)
    except TrainingInterrupted as stop:  # the Trainer saved a checkpoint and said so: say how to go on
        _say(_how_to_continue(config))
        return 128 + stop.signum  # its exit code (SystemExit.code), as schedulers expect
    except KeyboardInterrupt:
        _say(_how_to_continue(config))
        raise
    return 0
