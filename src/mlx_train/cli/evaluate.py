"""Evaluate a checkpoint written by ``mlx-train train`` on a split of its dataset.

The checkpoint's trainer_state.json holds the TrainConfig it trained with; the
dataset and model are rebuilt from it and the saved weights loaded. --checkpoint
may also name a run directory (whose checkpoints are where its config.yaml's
checkpoint_dir says, an s3:// or gs:// URL included) or a directory or URL of
checkpoints: the newest complete checkpoint there is used.

Example::

    from mlx_train.cli.evaluate import evaluate_checkpoint

    metrics = evaluate_checkpoint("runs/mlp-digits-20250101-120000/checkpoints/step-00000390")
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from mlx_train.errors import CheckpointError

SPLITS = ("test", "val", "train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``evaluate`` flags."""
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="a checkpoint directory or URL (step-NNNNNNNN), or a run / checkpoints directory or URL "
        "(its newest complete checkpoint is used; a run's checkpoint_dir is followed)",
    )
    parser.add_argument(
        "--dataset-split", choices=SPLITS, default="test",
        help="which split of the checkpoint's dataset to evaluate on (default: test)",
    )


def resolve_checkpoint(path: str) -> str:
    """A checkpoint for ``path``: itself, or the newest complete one of a run or checkpoints directory (or URL).

    A run directory's checkpoints are where its config.yaml says (``checkpoint_dir``, which may be
    an s3:// or gs:// URL), else its checkpoints/ folder.

    Example::

        resolve_checkpoint("runs/a")     # "runs/a/checkpoints/step-00000390"
    """
    from mlx_train.checkpointing.format import STEP_DIR
    from mlx_train.checkpointing.storage import MANIFEST, open_store, split_location
    from mlx_train.run_directory import RunDirectory

    how = "pass a checkpoint (RUN_DIR/checkpoints/step-NNNNNNNN) or a run directory"
    if "://" in path:
        if STEP_DIR.match(split_location(path)[1]) or open_store(path).size(MANIFEST) is not None:
            return path  # load_checkpoint reads and checks it
        directory = path
    else:
        local = Path(path)
        if not local.exists():
            raise CheckpointError(f"there is no checkpoint at {path}: no such file or directory; {how}")
        if (local / "manifest.json").exists() or local.name.startswith("step-"):
            return path  # load_checkpoint checks it and explains a torn one
        directory = _checkpoints_of(local)
        if "://" not in directory and (not Path(directory).is_dir() or not any(Path(directory).glob("step-*"))):
            raise CheckpointError(f"{path} is neither a checkpoint (no manifest.json) nor a directory of "
                                  f"step-* checkpoints; {how}")
    latest = RunDirectory(None, directory).resolve("auto")
    if latest is None:
        raise CheckpointError(f"no complete checkpoint in {directory} (none there, or every one is torn or corrupt)")
    return str(latest)


def _checkpoints_of(local: Path) -> str:
    """Where the checkpoints of run directory ``local`` are: its config.yaml's checkpoint_dir when that is
    a URL or an existing directory, else ``local/checkpoints``, else ``local`` itself."""
    from mlx_train import rundir
    from mlx_train.config import TrainConfig
    from mlx_train.errors import ConfigError

    saved = None
    if (local / rundir.CONFIG_FILE).is_file():
        try:
            saved = TrainConfig.from_saved(local / rundir.CONFIG_FILE).checkpoint_dir
        except ConfigError:
            saved = None  # a damaged config.yaml: look for the usual folder instead
    if saved and "://" in saved:
        return saved
    usual = str(rundir.checkpoints_path(local))
    if Path(usual).is_dir():
        return usual
    return saved if saved and Path(saved).is_dir() else str(local)


def _evaluate_advice(message: str) -> str:
    """A checkpoint error's advice for ``evaluate``, which has --checkpoint, not --resume."""
    message = re.sub(r": resume with --resume (\S+)$", r": evaluate that one with --checkpoint \1", message)
    return re.sub(r": start without --resume$", ": train the run further to get one", message)


def rebuild_from_checkpoint(path: str, python_instead: str,
                            command: str = "evaluate") -> tuple[Any, dict[str, Any], Any]:
    """(config, dataset splits, model with the checkpoint's weights) of a checkpoint written by
    ``mlx-train train``. ``python_instead`` says how to do without a saved config.

    Example::

        config, data, model = rebuild_from_checkpoint("runs/a/checkpoints/step-00000390", "use Trainer.evaluate")
    """
    import mlx.core as mx

    from mlx_train.builtin.datasets import load_dataset
    from mlx_train.builtin.models import build_model
    from mlx_train.checkpointing import load_checkpoint
    from mlx_train.config import TrainConfig
    from mlx_train.training.state import load_weights

    arrays, state = load_checkpoint(path, groups=["model"])  # the optimizer state is not needed
    from mlx_train.cli.train import refuse_finetune_checkpoint

    refuse_finetune_checkpoint(path, state, command)
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(
            f"checkpoint {path} holds no training config in its trainer_state.json, so the model and "
            f"dataset cannot be rebuilt; {python_instead}"
        )
    config = TrainConfig.from_saved(state["config"], source=f"{path}/trainer_state.json")
    data = load_dataset(config.dataset, seed=config.seed, **config.dataset_options)
    mx.random.seed(config.seed)
    model = build_model(config.model, data["info"], **config.model_options)
    try:
        load_weights(model, path, dict(arrays["model"]))
    except CheckpointError as error:
        raise CheckpointError(
            f"the weights in {path} do not fit model '{config.model}' built from its config: {error}"
        ) from error
    return config, data, model


def evaluate_checkpoint(path: str, split: str = "test") -> dict[str, Any]:
    """Metrics of the checkpoint at ``path`` on ``split`` of the dataset it trained on.

    Example::

        evaluate_checkpoint("runs/a/checkpoints/step-00000390", split="val")
        # {"loss": 0.09, "accuracy": 0.97}
    """
    from mlx_train.training import Trainer

    path = resolve_checkpoint(path)
    try:
        config, data, model = rebuild_from_checkpoint(
            path, "evaluate it from Python with Trainer.evaluate instead")
    except CheckpointError as error:
        raise CheckpointError(_evaluate_advice(str(error))) from error
    return Trainer(model, config=config).evaluate(data[split])


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train evaluate`` from parsed arguments."""
    from mlx_train.cli.train import format_metrics, startup_line

    path = resolve_checkpoint(args.checkpoint)  # before the startup line: a bad path gives one message
    print(startup_line())
    metrics = evaluate_checkpoint(path, args.dataset_split)
    print(f"{args.dataset_split}: {format_metrics(metrics)}")
    return 0
