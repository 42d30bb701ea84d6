"""Export a trained model to ONNX and MLX's .mlxfn, and check both against MLX.

export() traces the model with mx.export_function and translates MLX's operations
to ONNX; with an onnxruntime installed it runs the file on random inputs of two
batch sizes and fails if it differs from MLX by more than 1e-4. Needs
pip install 'mlx-train[export,examples]'.

    python examples/export_onnx.py

From the command line, for a run of `mlx-train train`:

    mlx-train export --checkpoint runs/<run> --format onnx -o model.onnx
"""

import mlx_train  # noqa: F401 — first: it loads an optimized BLAS before MLX starts (much faster on Linux)

# isort: split


import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import onnxruntime

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import SmallCNN
from mlx_train.export import export
from mlx_train.training import Trainer


def main() -> float:
    mx.random.seed(0)
    data = load_dataset("digits", seed=0)
    model = SmallCNN(image_shape=(8, 8, 1), num_classes=10, channels=(8, 16), hidden_dims=32, dropout=0.1)
    Trainer(model, optim.Adam(learning_rate=3e-3), batch_size=64).train(data["train"], epochs=2)

    # One example input fixes the shapes except the batch axis, which stays dynamic.
    example = mx.array(data["test"][0][:1])                     # [1, 64] flat pixels
    report = export(model, [example], "digits_cnn.onnx")         # dropout is off in the export
    print(f"ONNX: {report['bytes'] / 1024:.0f} KiB, max |ONNX - MLX| {report['max_abs_diff']:.1e}")

    # Run it like any ONNX model: the input is "input_0", any batch size.
    session = onnxruntime.InferenceSession("digits_cnn.onnx", providers=["CPUExecutionProvider"])
    x_test, y_test = data["test"]
    (logits,) = session.run(None, {"input_0": np.asarray(x_test, dtype=np.float32)})
    accuracy = float((logits.argmax(axis=1) == y_test).mean())
    print(f"onnxruntime test accuracy: {accuracy:.3f}")

    # MLX's own format reloads without the Python model class.
    export(model, [example], "digits_cnn.mlxfn")
    forward = mx.import_function("digits_cnn.mlxfn")
    (mlx_logits,) = forward(mx.array(x_test[:16]))
    print(f"mlxfn agrees with onnxruntime: {np.allclose(np.array(mlx_logits), logits[:16], atol=1e-4)}")
    return accuracy


if __name__ == "__main__":
    main()
