"""Export a checkpoint written by ``mlx-train train`` to ONNX, MLX's .mlxfn, or safetensors + JSON.

The model is rebuilt from the checkpoint's training config (like ``evaluate``),
its weights loaded, and it is exported with a dynamic batch axis (for .mlxfn:
any batch size when MLX traces the model shapelessly, else only the batch sizes
the message lists). --verify (on
by default when onnxruntime is installed) runs the export on fresh random inputs
of two batch sizes and fails if it differs from MLX by more than 1e-4.

Example::

    from mlx_train.cli.export import export_checkpoint

    report = export_checkpoint("runs/a", "model.onnx", format="onnx")
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from mlx_train.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

HELP = "export a checkpoint's model to ONNX, .mlxfn or safetensors (+ JSON description)"
FORMATS = ("onnx", "mlxfn", "safetensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``export`` flags."""
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="a checkpoint directory (step-NNNNNNNN), or a run / checkpoints directory "
        "(its newest complete checkpoint is used)",
    )
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="output format (default: from the -o suffix)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")
    parser.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=None,
        help="check the export against MLX on random inputs of two batch sizes (max |diff| <= 1e-4); "
        "default: on when onnxruntime is installed (always on for mlxfn)",
    )
    parser.add_argument("--ema", action="store_true",
                        help="export the exponential moving average of the weights the checkpoint holds "
                        "(trained with ema_decay set) instead of the trained weights")


def rebuild_model(path: str) -> tuple[nn.Module, mx.array, dict[str, Any]]:
    """The model of checkpoint ``path`` with its weights, an example input batch, and its config.

    Example::

        model, example, config = rebuild_model("runs/a/checkpoints/step-00000390")
    """
    import mlx.core as mx

    from mlx_train.cli.evaluate import rebuild_from_checkpoint

    config, data, model = rebuild_from_checkpoint(
        path, "export it from Python with mlx_train.export.export(model, example_inputs, path)", "export")
    test = data["test"]
    inputs = test[0] if isinstance(test, tuple) else test.get("tokens") if isinstance(test, dict) else None
    if inputs is None:
        raise CheckpointError(f"dataset '{config.dataset}' gives no array inputs to trace the model with; "
                              "export from Python with mlx_train.export.export(model, example_inputs, path)")
    example = mx.array(inputs[:1])
    if config.model == "transformer":
        example = example[:, :-1]  # the dataset's chunks are block_size + 1 long (inputs and targets)
    return model, example, {"model": config.model, "model_options": config.model_options,
                            "dataset": config.dataset, "dataset_info": _plain_info(data["info"])}


def _plain_info(info: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in info.items()
            if isinstance(v, (int, float, str, bool, list, tuple))}


def export_checkpoint(checkpoint: str, output: str, format: str | None = None,
                      verify: bool | None = None, ema: bool = False) -> dict[str, Any]:
    """Export the model of a checkpoint (or the newest one of a run directory) to ``output``; with
    ``ema`` its exponential moving average of the weights (a CheckpointError when it holds none).

    Example::

        export_checkpoint("runs/a", "digits.onnx")     # {"format": "onnx", "max_abs_diff": 2e-07, ...}
    """
    from mlx_train.cli.evaluate import resolve_checkpoint
    from mlx_train.export import export

    path = resolve_checkpoint(checkpoint)
    model, example, description = rebuild_model(path)
    if ema:
        import mlx.core as mx

        from mlx_train.training.ema import checkpoint_ema_weights

        model.load_weights(list(checkpoint_ema_weights(path).items()), strict=False)
        mx.eval(model.parameters())
        description["weights"] = "ema"
    report = export(model, [example], output, format=format, verify=verify,
                    description={"mlx_train": {**description, "checkpoint": path}})
    return {**report, "checkpoint": path}


def _check_suffix(output: str, format: str | None) -> None:
    """Refuse ``--format X -o file.Y`` where ``.Y`` is another format's suffix: which one was meant is unclear."""
    import os

    suffix = os.path.splitext(output)[1].lstrip(".")
    if format is not None and suffix in FORMATS and suffix != format:
        raise ConfigError(f"--format {format} disagrees with -o {output}, whose suffix .{suffix} means the {suffix} "
                          f"format: name the file *.{format}, or pass --format {suffix} (or leave --format out)")


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train export`` from parsed arguments."""
    from mlx_train.paths import writable_file

    _check_suffix(args.output, args.format)
    writable_file(args.output, "the export's output (-o)")  # before the model is rebuilt
    report = export_checkpoint(args.checkpoint, args.output, args.format, args.verify, args.ema)
    size = report["bytes"] / 1024
    line = f"exported {report['checkpoint']} to {report['path']} ({report['format']}, {size:.1f} KiB)"
    if "max_abs_diff" in report:
        line += f"; verified against MLX: max |diff| {report['max_abs_diff']:.2g}"
    print(line)
    if report.get("batch_sizes") == "any":
        print("the .mlxfn takes any batch size (traced shapelessly)")
    elif "batch_sizes" in report:
        sizes = ", ".join(map(str, report["batch_sizes"]))
        print(f"the .mlxfn holds batch sizes {sizes} only (MLX cannot trace this model shapelessly): "
              "mx.import_function refuses others, so split or pad inputs to one of them")
    return 0
