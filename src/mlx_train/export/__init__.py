"""Export any ``mlx.nn.Module`` to ONNX, to MLX's own ``.mlxfn`` or to safetensors + a JSON description.

ONNX export traces the model with ``mx.export_function`` and translates MLX's
primitives one by one (:mod:`mlx_train.export.onnx`), so it works for models
built from any layers whose primitives have a translation. It needs the
``export`` extra (``pip install 'mlx-train[export]'``: onnx, onnxruntime).

Example::

    from mlx_train.export import export

    report = export(model, [mx.zeros((1, 64))], "model.onnx")   # format from the suffix
    report["max_abs_diff"]                                        # vs MLX, checked in onnxruntime
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_train.export.graph import ExportError, trace, trace_pair, with_batch
from mlx_train.paths import writable_file

__all__ = ["FORMATS", "ExportError", "export", "random_inputs", "verify_onnx"]

FORMATS = ("onnx", "mlxfn", "safetensors")
TOLERANCE = 1e-4


def _has_onnxruntime() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _format_of(path: str, format: str | None) -> str:
    if format is None:
        format = Path(path).suffix.lstrip(".")
        if format not in FORMATS:
            raise ExportError(f"cannot tell the export format from '{path}': pass a format (--format, or format= in "
                              "Python): one of "
                              f"{', '.join(FORMATS)}, or use a .onnx / .mlxfn / .safetensors suffix")
    if format not in FORMATS:
        raise ExportError(f"unknown export format '{format}'; formats: {', '.join(FORMATS)}")
    return format


def random_inputs(examples: Sequence[mx.array], batch: int, seed: int = 0) -> list[mx.array]:
    """Fresh random inputs shaped like ``examples`` with ``batch`` rows.

    Floats are standard normal; integers (token ids, class ids) are uniform in
    ``[0, max(example) + 1)`` so that an embedding lookup stays in range.

    Example::

        random_inputs([mx.zeros((1, 8), dtype=mx.int32)], batch=3)   # one [3, 8] int32 array
    """
    key = mx.random.key(seed)
    fresh = []
    for i, x in enumerate(examples):
        shape = (batch, *x.shape[1:]) if x.ndim else ()
        sub = mx.random.split(key, len(examples))[i]
        if mx.issubdtype(x.dtype, mx.floating):
            fresh.append(mx.random.normal(shape, key=sub).astype(x.dtype))
        elif x.dtype == mx.bool_:
            fresh.append(mx.random.bernoulli(0.5, shape, key=sub))
        else:
            high = max(int(float(mx.max(x).item())) + 1, 1) if x.size else 1  # type: ignore[arg-type]  # a real scalar
            fresh.append(mx.random.randint(0, high, shape, key=sub).astype(x.dtype))
    return fresh


def _as_tuple(outputs: Any) -> list[mx.array]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def verify_onnx(path: str, fn: Any, examples: Sequence[mx.array], batches: Sequence[int] = (2, 5),
                tolerance: float = TOLERANCE) -> float:
    """Run the ONNX file in onnxruntime and ``fn`` in MLX on fresh random inputs; return the largest difference.

    Raises ExportError when it exceeds ``tolerance``. ``batches`` are the batch
    sizes tried (only the example's own when the export has a fixed batch).

    Example::

        verify_onnx("model.onnx", model, [mx.zeros((1, 64))])     # 3.1e-07
    """
    try:
        import onnxruntime
    except ImportError:
        raise ExportError("verifying an ONNX export needs onnxruntime: pip install 'mlx-train[export]'") from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed, batch in enumerate(batches):
        inputs = random_inputs(examples, batch, seed=seed + 1)
        expected = _as_tuple(fn(*inputs))
        feeds = {f"input_{i}": np.array(x) for i, x in enumerate(inputs)}
        got = session.run(None, feeds)
        if len(got) != len(expected):
            raise ExportError(f"{path} has {len(got)} outputs, the model {len(expected)}")
        for i, (mine, theirs) in enumerate(zip(expected, got, strict=False)):
            if tuple(mine.shape) != tuple(theirs.shape):
                raise ExportError(f"{path}: output {i} has shape {tuple(theirs.shape)} in onnxruntime but "
                                  f"{tuple(mine.shape)} in MLX at batch {batch}")
            diff = float(np.max(np.abs(np.array(mine, dtype=np.float64) - theirs.astype(np.float64)), initial=0.0))
            worst = max(worst, diff)
            if not diff <= tolerance:
                raise ExportError(f"{path}: output {i} differs from MLX by up to {diff:.3g} at batch {batch} "
                                  f"(tolerance {tolerance:g}); please report the model that shows it")
    return worst


def write_safetensors(model: nn.Module, path: str | Path, examples: Sequence[mx.array] = (),
                      description: Mapping[str, Any] | None = None) -> None:
    """Write the weights to ``path`` and a JSON description (class, parameter shapes, inputs) beside it.

    Example::

        write_safetensors(model, "out/model.safetensors", description={"config": {...}})  # + out/model.json
    """
    from mlx.utils import tree_flatten

    path = Path(path)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    info = {
        "format": "mlx-train model",
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": {name: {"shape": list(w.shape), "dtype": str(w.dtype).replace("mlx.core.", "")}
                       for name, w in weights.items()},
        **dict(description or {}),
    }
    if examples:
        info["inputs"] = [{"shape": ["batch", *x.shape[1:]], "dtype": str(x.dtype).replace("mlx.core.", "")}
                          for x in examples]
    path.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")


def export(model: nn.Module, example_inputs: Sequence[mx.array] | mx.array, path: str | Path,
           format: str | None = None, dynamic_batch: bool = True, verify: bool | None = None,
           description: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Export ``model`` (in eval mode) called on ``example_inputs`` to ``path``; return a small report.

    ``format`` (default: from the suffix): ``"onnx"``; ``"mlxfn"``, MLX's own
    (``mx.import_function`` reloads it: any batch size when MLX can trace the model
    shapelessly, else one trace per size in ``MLXFN_BATCH_SIZES``, listed in the
    report's ``batch_sizes``); or ``"safetensors"``, the weights plus ``<path>.json``
    describing the model (``description`` adds keys to it). ``dynamic_batch``: axis 0
    of every input (and output) is the batch and may change. ``verify`` (default: on
    when onnxruntime is installed; always for mlxfn) runs the file on random inputs
    of two batch sizes and raises ExportError when it differs from MLX by more than 1e-4.

    Example::

        report = export(model, [mx.zeros((1, 64))], "mlp.onnx")
        # {"format": "onnx", "path": "mlp.onnx", "seconds": 0.05, "max_abs_diff": 2.4e-07, "bytes": 35210}
    """
    format = _format_of(str(path), format)
    examples = [example_inputs] if isinstance(example_inputs, mx.array) else list(example_inputs)
    if not examples or not all(isinstance(x, mx.array) for x in examples):
        raise ExportError("example_inputs must be an mx.array or a list of them (one per model input), e.g. "
                          "[mx.zeros((1, 64))]")
    path = Path(writable_file(path, "the export's output"))
    was_training = model.training
    model.eval()  # dropout off: an exported model is for inference
    try:
        mx.eval(model.parameters())  # unevaluated weights would be traced as their initialisers

        def forward(*inputs: mx.array) -> Any:
            return model(*inputs)

        start = time.perf_counter()
        report: dict[str, Any] = {"format": format, "path": str(path)}
        if format == "onnx":
            _export_onnx(path, forward, examples, dynamic_batch, name=type(model).__name__)
        elif format == "mlxfn":
            report.update(_export_mlxfn(str(path), forward, examples, dynamic_batch))
        else:
            write_safetensors(model, path, examples, description)
        report["seconds"] = time.perf_counter() - start
        if format == "onnx" and (verify if verify is not None else _has_onnxruntime()):
            batches = (2, 5) if dynamic_batch else (examples[0].shape[0] if examples[0].ndim else 1,)
            report["max_abs_diff"] = verify_onnx(str(path), forward, examples, batches)
        elif format == "mlxfn" and (verify if verify is not None else True):
            report["max_abs_diff"] = _verify_mlxfn(str(path), forward, examples, report["batch_sizes"])
        report["bytes"] = path.stat().st_size
        return report
    finally:
        model.train(was_training)


def _export_onnx(path: Path, fn: Any, examples: Sequence[mx.array], dynamic_batch: bool, name: str) -> None:
    from mlx_train.export.onnx import check_supported, to_onnx

    if dynamic_batch:
        first, second, batch = trace_pair(fn, examples, check=check_supported)
    else:
        first, second, batch = trace(fn, *examples), None, 0
    path.write_bytes(to_onnx(first, second, batch, name=name).SerializeToString())


# Batch sizes traced into an .mlxfn when the model cannot be traced shapelessly.
MLXFN_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def _export_mlxfn(path: str, fn: Any, examples: Sequence[mx.array], dynamic_batch: bool) -> dict[str, Any]:
    """Write ``path``; with a dynamic batch, shapeless when that reproduces the model, else one trace per size."""
    if not dynamic_batch:
        mx.export_function(path, fn, *examples)
        return {"batch_sizes": [examples[0].shape[0] if examples[0].ndim else 1]}
    try:
        # Traced at batch 2, so no axis of size 1 is mistaken for a broadcast one.
        mx.export_function(path, fn, *with_batch(examples, 2), shapeless=True)
        _verify_mlxfn(path, fn, examples, (2, 5))
        return {"batch_sizes": "any"}
    except (ExportError, ValueError, RuntimeError):
        pass  # a reshape to a traced shape: MLX cannot replay it at another batch size
    own = examples[0].shape[0]
    sizes = sorted({*MLXFN_BATCH_SIZES, own})
    with mx.exporter(path, fn) as exporter:
        for size in sizes:
            exporter(*with_batch(examples, size))
    return {"batch_sizes": sizes}


def _verify_mlxfn(path: str, fn: Any, examples: Sequence[mx.array], batch_sizes: Sequence[int] | str) -> float:
    batches: Sequence[int] = (2, 5) if isinstance(batch_sizes, str) else list(batch_sizes)[:2]
    imported: Any = mx.import_function(path)
    worst = 0.0
    for seed, batch in enumerate(batches):
        inputs = random_inputs(examples, batch, seed=seed + 1)
        for mine, theirs in zip(_as_tuple(fn(*inputs)), _as_tuple(imported(*inputs)), strict=False):
            if mine.shape != theirs.shape:
                raise ExportError(f"{path}: the reloaded function returns shape {tuple(theirs.shape)} at batch "
                                  f"{batch}, MLX {tuple(mine.shape)}")
            worst = max(worst, float(mx.max(mx.abs(mine - theirs)).item()))  # type: ignore[arg-type]  # a real scalar
    if not worst <= TOLERANCE:
        raise ExportError(f"{path}: the reloaded function differs from the model by {worst:.3g} "
                          f"(tolerance {TOLERANCE:g}); export with dynamic_batch=False")
    return worst
