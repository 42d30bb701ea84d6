"""Export: ONNX from MLX's traced graph (checked in onnxruntime), .mlxfn, safetensors, mlx-train export."""

import json

import mlx.core as mx
import numpy as np
import onnxruntime as ort
import pytest
from mlx import nn

from mlx_train.builtin.models import MLP, CharTransformerLM, SmallCNN
from mlx_train.cli.main import main
from mlx_train.export import ExportError, export, random_inputs
from mlx_train.export.graph import Primitive, Trace
from mlx_train.export.onnx import to_onnx


def llama():
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    return Model(args), mx.full((1, 8), 49, dtype=mx.int32)


class ManyOps(nn.Module):
    """Primitives the built-in models do not use: conv1d, take_along_axis, reductions, splits, logs..."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, kernel_size=3, stride=2, padding=1)
        self.norm = nn.RMSNorm(4)

    def __call__(self, x):
        h = self.norm(nn.silu(self.conv(x)))                        # [B, 4, 4]
        a, b = mx.split(h, 2, axis=-1)
        top = mx.take_along_axis(h, mx.argmax(h, axis=-1, keepdims=True), axis=-1)
        stats = mx.concatenate([mx.max(a, axis=-1, keepdims=True), mx.min(b, axis=-1, keepdims=True),
                                mx.logsumexp(h, axis=-1, keepdims=True), top,
                                mx.log1p(mx.abs(h)).mean(-1, keepdims=True),
                                mx.sqrt(mx.abs(h) + 1).sum(-1, keepdims=True)], axis=-1)
        gate = mx.where(h > 0, mx.tanh(h), mx.exp(h) - 1)
        return mx.concatenate([stats, gate.transpose(0, 2, 1)[:, :, ::-1]], axis=-1)


MODELS = {
    "mlp": lambda: (MLP(64, (32,), 10, dropout=0.2), mx.zeros((1, 64))),
    "cnn": lambda: (SmallCNN((8, 8, 1), 10, (4, 8), 16, dropout=0.2), mx.zeros((1, 8, 8, 1))),
    "transformer": lambda: (CharTransformerLM(20, 16, 2, 2, 8, dropout=0.1), mx.full((1, 8), 19, dtype=mx.int32)),
    "llama": llama,
    "many_ops": lambda: (ManyOps(), mx.zeros((1, 8, 3))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_onnx_matches_mlx_at_several_batch_sizes(name, tmp_path):
    mx.random.seed(0)
    model, example = MODELS[name]()
    model.train()  # export must switch dropout off and then restore the mode
    report = export(model, [example], tmp_path / f"{name}.onnx")
    assert model.training and report["format"] == "onnx" and report["max_abs_diff"] <= 1e-4
    model.eval()
    session = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "batch"
    for batch in (1, 3, 7):  # none of them the traced batch sizes (2 and 3 are; 1 and 7 are not)
        (x,) = random_inputs([example], batch, seed=batch)
        (got,) = session.run(None, {"input_0": np.array(x)})
        expected = np.array(model(x))
        assert got.shape == expected.shape
        assert np.max(np.abs(got - expected)) <= 1e-4


def test_fixed_batch_export_has_a_static_batch(tmp_path):
    model, example = MLP(8, (4,), 3), mx.ones((5, 8))
    report = export(model, example, tmp_path / "m.onnx", dynamic_batch=False)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [5, 8] and report["max_abs_diff"] <= 1e-4


def test_verify_catches_a_wrong_translation(tmp_path, monkeypatch):
    from mlx_train.export import onnx as translator

    monkeypatch.setitem(translator.HANDLERS, "Maximum", lambda op: op.emit("Min", op.x[:2]))  # relu -> min
    with pytest.raises(ExportError, match=r"output 0 differs from MLX by up to .* \(tolerance 0.0001\)"):
        export(MLP(8, (16,), 3), [mx.zeros((1, 8))], tmp_path / "bad.onnx")


def test_unsupported_primitive_names_it_where_and_what_is_supported(tmp_path):
    class Odd(nn.Module):
        def __call__(self, x):
            return mx.erfinv(mx.tanh(x))

    with pytest.raises(ExportError, match=r"cannot export the MLX primitive 'ErfInv': it is operation 2 of 2, "
                       r"with inputs from: Tanh \(operation 1\) \(2, 4\).*Supported primitives: Abs, Add"):
        export(Odd(), [mx.zeros((1, 4))], tmp_path / "odd.onnx")

    class Noisy(nn.Module):
        def __call__(self, x):
            return x + mx.random.normal(x.shape)

    with pytest.raises(ExportError, match=r"'RandomBits' \(random numbers: dropout or another random layer"):
        export(Noisy(), [mx.zeros((1, 4))], tmp_path / "noisy.onnx")


def test_a_batch_size_baked_into_the_graph_is_refused_for_a_dynamic_batch(tmp_path):
    class PerBatch(nn.Module):
        def __call__(self, x):
            return x.sum(axis=0) / x.shape[0]  # a Python number: a constant in the trace

    with pytest.raises(ExportError, match=r"a constant of shape \(\) changes with the batch size"):
        export(PerBatch(), [mx.ones((2, 3))], tmp_path / "p.onnx")
    report = export(PerBatch(), [mx.ones((2, 3))], tmp_path / "p.onnx", dynamic_batch=False)
    assert report["max_abs_diff"] <= 1e-6


def test_bad_arguments_say_what_and_how_to_fix(tmp_path):
    model = MLP(8, (4,), 3)
    with pytest.raises(ExportError, match=r"cannot tell the export format from '.*m.bin'"):
        export(model, [mx.zeros((1, 8))], tmp_path / "m.bin")
    with pytest.raises(ExportError, match=r"example_inputs must be an mx.array or a list of them"):
        export(model, [np.zeros((1, 8))], tmp_path / "m.onnx")
    with pytest.raises(ExportError, match=r"different batch sizes \[1, 2\] along axis 0"):
        export(model, [mx.zeros((1, 8)), mx.zeros((2, 8))], tmp_path / "m.onnx")


def _run_single(prim_name, inputs, constants, arguments, out_shape):
    """Translate a one-primitive trace (as a GPU trace would give it) and run it in onnxruntime."""
    values = [(name, tuple(array.shape), array.dtype) for name, array in inputs]
    consts = [(name, tuple(array.shape), array.dtype) for name, array in constants]
    trace = Trace(inputs=values, outputs=[("Y", out_shape, mx.float32)], constants=dict(constants),
                  primitives=[Primitive(prim_name, values + consts, [("Y", out_shape, mx.float32)], arguments)])
    session = ort.InferenceSession(to_onnx(trace, None, 0).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {f"input_{i}": np.array(a) for i, (_, a) in enumerate(inputs)})[0]


def test_fused_gpu_primitives_match_mx_fast():
    mx.random.seed(1)
    x, w, bias = mx.random.normal((2, 3, 16)), mx.random.normal((16,)), mx.random.normal((16,))
    got = _run_single("RMSNorm", [("X", x)], [("W", w)], [1e-5], x.shape)
    assert np.abs(got - np.array(mx.fast.rms_norm(x, w, 1e-5))).max() < 1e-4
    got = _run_single("LayerNorm", [("X", x)], [("W", w), ("B", bias)], [1e-5], x.shape)
    assert np.abs(got - np.array(mx.fast.layer_norm(x, w, bias, 1e-5))).max() < 1e-4

    q = mx.random.normal((2, 4, 6, 8))
    for traditional in (False, True):
        for dims in (8, 4):
            got = _run_single("RoPE", [("Q", q)], [("O", mx.array(3, dtype=mx.int32))],
                              [dims, traditional, 10000.0, 0.5, True], q.shape)
            expected = mx.fast.rope(q, dims, traditional=traditional, base=10000.0, scale=0.5, offset=3)
            assert np.abs(got - np.array(expected)).max() < 1e-4, (traditional, dims)

    k, v = mx.random.normal((2, 4, 9, 8)), mx.random.normal((2, 4, 9, 8))
    got = _run_single("ScaledDotProductAttention", [("Q", q), ("K", k), ("V", v)], [],
                      [0.35, True, False, False, False], q.shape)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask="causal")
    assert np.abs(got - np.array(expected)).max() < 1e-4
    mask = mx.random.bernoulli(0.7, (2, 1, 6, 9)) | mx.eye(6, 9, dtype=mx.bool_)
    got = _run_single("ScaledDotProductAttention", [("Q", q), ("K", k), ("V", v), ("M", mask)], [],
                      [0.35, False, False, False, False], q.shape)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
    assert np.abs(got - np.array(expected)).max() < 1e-4

    k, v = k[:, :2], v[:, :2]  # grouped KV heads: 4 query heads share 2 key/value heads
    for mask in ("causal", mx.random.normal((2, 4, 6, 9)), mx.random.normal((1, 1, 6, 9))):
        extra = [] if isinstance(mask, str) else [("M", mask)]
        got = _run_single("ScaledDotProductAttention", [("Q", q), ("K", k), ("V", v), *extra], [],
                          [0.35, isinstance(mask, str), False, False, False], q.shape)
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
        assert np.abs(got - np.array(expected)).max() < 1e-4, getattr(mask, "shape", mask)


def test_mlxfn_reloads_with_import_function(tmp_path):
    model, example = MODELS["transformer"]()
    report = export(model, [example], tmp_path / "t.mlxfn")
    reloaded = mx.import_function(str(tmp_path / "t.mlxfn"))
    model.eval()
    x = random_inputs([example], 4, seed=3)[0]
    (out,) = reloaded(x)
    assert report["max_abs_diff"] == 0.0 and mx.array_equal(out, model(x))


class MatmulMLP(nn.Module):
    """A two-layer perceptron written with ``@`` and ``+``, which MLX traces shapelessly (``addmm`` it does not)."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = mx.random.normal((64, 16)), mx.random.normal((16,))
        self.w2, self.b2 = mx.random.normal((16, 10)), mx.random.normal((10,))

    def __call__(self, x):
        return nn.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def test_mlxfn_of_a_shapeless_model_takes_any_batch_size(tmp_path):
    model = MatmulMLP()
    report = export(model, [mx.zeros((1, 64))], tmp_path / "s.mlxfn")
    reloaded = mx.import_function(str(tmp_path / "s.mlxfn"))
    assert report["batch_sizes"] == "any"
    for batch in (3, 359):  # 359: the rows of the digits test set
        x = random_inputs([mx.zeros((1, 64))], batch, seed=batch)[0]
        (out,) = reloaded(x)
        assert out.shape == (batch, 10) and mx.allclose(out, model(x), atol=1e-5)


def test_cli_says_which_batch_sizes_an_mlxfn_holds(tmp_path, capsys, monkeypatch):
    import mlx_train.cli.export as cli_export

    def fake_export_checkpoint(checkpoint, output, format, verify, ema=False):
        model = MLP(64, (8,), 10)  # reshape and addmm: MLX cannot trace it shapelessly
        return {**export(model, [mx.zeros((1, 64))], output, format=format, verify=verify), "checkpoint": checkpoint}

    monkeypatch.setattr(cli_export, "export_checkpoint", fake_export_checkpoint)
    assert main(["export", "--checkpoint", "runs/a", "-o", str(tmp_path / "m.mlxfn")]) == 0
    out = capsys.readouterr().out
    assert "holds batch sizes 1, 2, 4, 8, 16, 32, 64, 128 only" in out
    reloaded = mx.import_function(str(tmp_path / "m.mlxfn"))
    reloaded(mx.zeros((4, 64)))
    with pytest.raises(ValueError):
        reloaded(mx.zeros((3, 64)))


def test_safetensors_writes_weights_and_a_description(tmp_path):
    model = MLP(8, (4,), 3)
    export(model, [mx.zeros((1, 8))], tmp_path / "m.safetensors", description={"task": "digits"})
    fresh = MLP(8, (4,), 3)
    fresh.load_weights(str(tmp_path / "m.safetensors"))
    x = mx.ones((2, 8))
    assert mx.array_equal(fresh(x), model(x))
    info = json.loads((tmp_path / "m.json").read_text())
    assert info["class"] == "mlx_train.builtin.models.MLP" and info["task"] == "digits"
    assert info["parameters"]["layers.0.weight"] == {"shape": [4, 8], "dtype": "float32"}
    assert info["inputs"] == [{"shape": ["batch", 8], "dtype": "float32"}]


@pytest.mark.slow
def test_cli_exports_a_checkpoint_written_by_train(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run_dir), "--format", "onnx", "-o", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "step-00000039 to " in out and "verified against MLX: max |diff|" in out
    from mlx_train.cli.export import rebuild_model

    model, example, _ = rebuild_model(str(max((run_dir / "checkpoints").glob("step-*"))))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = random_inputs([example], 6)[0]
    assert np.abs(session.run(None, {"input_0": np.array(x)})[0] - np.array(model(x))).max() <= 1e-4

    assert main(["export", "--checkpoint", str(run_dir), "-o", str(tmp_path / "m.mlxfn")]) == 0
    for model, dataset in (("cnn", "digits"), ("transformer", "text")):
        other = tmp_path / model
        assert main(["train", "--model", model, "--dataset", dataset, "--max-steps", "2", "--run-dir", str(other),
                     "--set", "model_options.num_layers=1" if model == "transformer" else "seed=0"]) == 0
        assert main(["export", "--checkpoint", str(other), "-o", str(tmp_path / f"{model}.onnx")]) == 0
        assert "verified against MLX" in capsys.readouterr().out
    assert main(["export", "--checkpoint", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.onnx")]) == 4
    assert "there is no checkpoint at" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(run_dir), "-o", str(tmp_path / "x.bin")]) == 8
    assert "cannot tell the export format from" in capsys.readouterr().err
