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
from typing import Any, Callable

from mlx_train import rundir
from mlx_train.cli.flags import FLAGS, _flag_type, build_config
from mlx_train.rundir import choose_run_dir

__all__ = ["FLAGS", "add_arguments", "build_config", "format_metrics", "main", "run", "startup_line"]

EPILOG = """examples:
  mlx-train train                                   # mlp on digits, TrainConfig defaults
  mlx-train train --model cnn --epochs 5 --lr 3e-4
  mlx-train train --model transformer --dataset text --set model_options.num_layers=4
  mlx-train train --config my.yaml --run-dir runs/a   # later: ... --run-dir runs/a --resume
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags; their help is TrainConfig's field help."""
    from mlx_train.config import TrainConfig

    from mlx_train.builtin import DATASETS, MODELS  # names only: listing them loads no model code

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
    from mlx_train.launch.train import add_train_arguments

    add_train_arguments(parser)  # --distributed, -n, --hostfile


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


def run(config: Any, resume: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``config.model`` on ``config.dataset``, then evaluate on the test split.

    Returns ``{"run_dir", "config", "history", "test"}``.
    """
    import mlx.core as mx

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model
    from mlx_train.distributed.rank import in_group, is_main_process
    from mlx_train.training import DistributedTrainer, Trainer
    from mlx_train.optim import build_optimizer

    if not is_main_process():  # a rank of a distributed run: rank 0 speaks for the group
        log = lambda message: None  # noqa: E731
    run_dir = choose_run_dir(config, resume)
    checkpoint_dir = config.checkpoint_dir or str(run_dir / rundir.CHECKPOINTS_DIR)
    config = config.replace(run_dir=str(run_dir), checkpoint_dir=checkpoint_dir)
    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    mx.random.seed(config.seed)  # the model's initial weights follow the seed too
    model = build_model(config.model, data["info"], **config.model_options)
    log(startup_line())  # after the cheap checks of the names above, so that a typo gives one message
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        config.to_yaml(str(run_dir / rundir.CONFIG_FILE))
    log(f"model {config.model} on dataset {config.dataset}; run directory {run_dir}")

    trainer_class = DistributedTrainer if in_group() else Trainer  # a rank of a launched group
    trainer = trainer_class(model, build_optimizer(config), config=config)
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
        from mlx_train.launch.train import train_distributed

        return train_distributed(args, config)
    config = config.replace(run_dir=str(choose_run_dir(config, args.resume)))
    try:
        run(config, resume=args.resume)
    except KeyboardInterrupt:
        print(f"to continue: mlx-train train --run-dir {config.run_dir} --resume", file=sys.stderr)
        raise
    return 0
