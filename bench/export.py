"""ONNX export: export time, file size, max |ONNX - MLX|, and onnxruntime vs MLX inference latency.

For each model (the built-in MLP, CNN and char transformer at their `mlx-train train`
sizes, and a small mlx-lm llama with random weights) the script exports to ONNX,
then times one forward pass of a batch in MLX (``mx.eval(model(x))``, float32, CPU)
and in onnxruntime (CPU provider, default threads) on the same inputs, alternating
rounds so machine noise hits both. Latency is the median over rounds.

    python bench/export.py                 # every model
    python bench/export.py --model llama --rounds 50
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split

import mlx.core as mx
import numpy as np

from mlx_train.builtin.models import build_model
from mlx_train.export import export, random_inputs


def _llama():
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=688,
                     num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=1000)
    return Model(args), mx.zeros((1, 64), dtype=mx.int32) + 999


def _builtin(name, info, example, **options):
    return lambda: (build_model(name, info, **options), example)


MODELS = {
    # name: (factory -> (model, example input), batch size timed)
    "mlp": (_builtin("mlp", {"in_dims": 64, "num_classes": 10}, mx.zeros((1, 64))), 256),
    "cnn": (_builtin("cnn", {"image_shape": (8, 8, 1), "num_classes": 10}, mx.zeros((1, 8, 8, 1))), 256),
    "transformer": (_builtin("transformer", {"vocab_size": 100, "block_size": 64},
                             mx.zeros((1, 64), dtype=mx.int32) + 99), 32),
    "llama": (_llama, 8),
}


def measure(name: str, rounds: int, folder: Path) -> dict:
    import onnxruntime

    factory, batch = MODELS[name]
    mx.random.seed(0)
    model, example = factory()
    model.eval()
    mx.eval(model.parameters())
    path = folder / f"{name}.onnx"
    report = export(model, [example], path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (x,) = random_inputs([example], batch, seed=7)
    feed = {"input_0": np.array(x)}
    mx.eval(model(x)), session.run(None, feed)  # warm up both
    mlx_times, ort_times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(model(x))
        mlx_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        session.run(None, feed)
        ort_times.append(time.perf_counter() - start)
    diff = float(np.abs(session.run(None, feed)[0] - np.array(model(x))).max())
    return {"model": name, "params": sum(v.size for _, v in _flat(model)), "batch": batch,
            "export_s": report["seconds"], "kib": report["bytes"] / 1024, "verify_diff": report["max_abs_diff"],
            "diff": diff, "mlx_ms": 1e3 * statistics.median(mlx_times), "ort_ms": 1e3 * statistics.median(ort_times)}


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append", help="default: all")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    import onnx
    import onnxruntime

    print(f"mlx {mx.__version__}, onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"device {mx.default_device()}; export s excludes importing onnx")
    header = (f"{'model':<12}{'params':>9}{'batch':>6}{'export s':>10}{'ONNX KiB':>10}{'max|diff|':>11}"
              f"{'MLX ms':>9}{'ORT ms':>9}{'ORT/MLX':>9}")
    print(header)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.model or list(MODELS):
            r = measure(name, args.rounds, Path(folder))
            print(f"{r['model']:<12}{r['params']:>9}{r['batch']:>6}{r['export_s']:>10.3f}{r['kib']:>10.0f}"
                  f"{max(r['diff'], r['verify_diff']):>11.1e}{r['mlx_ms']:>9.2f}{r['ort_ms']:>9.2f}"
                  f"{r['ort_ms'] / r['mlx_ms']:>9.2f}")


if __name__ == "__main__":
    main()
