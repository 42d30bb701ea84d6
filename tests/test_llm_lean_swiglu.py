"""The lean SwiGLU (``mlx_train.transforms``): the same values and gradients as mlx-lm's ``swiglu`` with a
smaller backward pass, switched on instance by instance for plain gated MLPs only (a llama and a qwen2 of
other sizes), left off elsewhere, and on in every model ``mlx-train finetune`` trains."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import activations  # noqa: E402
from test_llm_chunked_loss import VOCAB, assert_same, batch, loss_and_grads  # noqa: E402

from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.loss import lm_loss  # noqa: E402
from mlx_train.transforms import is_lean, swiglu, use_lean_swiglu  # noqa: E402


def qwen2(layers=2, seed=0):
    from mlx_lm.models.qwen2 import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict({
        "model_type": "qwen2", "hidden_size": 48, "num_hidden_layers": layers, "intermediate_size": 80,
        "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": False}))
    mx.eval(model.parameters())
    return model


def llama(layers=2, seed=0):
    return llm_tiny.make_model(VOCAB, seed=seed, tie=True, layers=layers)[0]


def trained(model, train):
    if train == "lora":
        apply_adapters(model, AdapterConfig("lora", num_layers=1, rank=4))  # the last block trains
        mx.random.seed(7)
        for _, layer in model.named_modules():
            if "lora_b" in layer:
                layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    mx.eval(model.parameters())
    return model


def test_values_and_gradients_equal_mlx_lms_swiglu():
    rng = np.random.default_rng(0)
    gate, up, weight = (mx.array(rng.normal(size=(3, 7, 40)).astype(np.float32) * 3) for _ in range(3))

    def total(fn):
        return lambda g, u: (fn(g, u) * weight).sum()

    assert mx.array_equal(swiglu(gate, up), activations.swiglu(gate, up)).item()  # the same fused forward
    ours = mx.grad(total(swiglu), argnums=(0, 1))(gate, up)
    theirs = mx.grad(total(activations.swiglu), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, theirs, strict=True):
        assert float(mx.abs(b).max().item()) > 0
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("build", [llama, qwen2])
@pytest.mark.parametrize("train", ["lora", "full"])
def test_a_model_trains_as_before(build, train):
    data = batch(prompt=2)
    plain = loss_and_grads(trained(build(), train), lm_loss, data, chunk=8)
    model = trained(build(), train)
    names = dict(tree_flatten(model.parameters())).keys()
    assert use_lean_swiglu(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert use_lean_swiglu(model) == []  # once is enough
    assert dict(tree_flatten(model.parameters())).keys() == names  # checkpoints see the same model
    assert_same(plain, loss_and_grads(model, lm_loss, data, chunk=8))


def test_only_the_given_instance_and_plain_mlps_change():
    model, other = llama(), llama()
    use_lean_swiglu(model)
    assert all(is_lean(b.mlp) for b in model.model.layers)
    assert not any(is_lean(b.mlp) for b in other.model.layers)  # the same class, another instance
    assert type(model.model.layers[0].mlp).__bases__[0] is type(other.model.layers[0].mlp)

    class Gelu(nn.Module):  # a gated MLP of another shape: left alone
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)

        def __call__(self, x):
            return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    net = Gelu()
    assert use_lean_swiglu(net) == [] and not is_lean(net)


def test_the_backward_pass_holds_less():
    """Peak memory of one gradient with large MLP activations: the lean MLPs keep two arrays fewer a block."""
    def peak(lean):
        model = trained(llama(layers=2), "full")
        if lean:
            use_lean_swiglu(model)
        for block in model.model.layers:  # a wide MLP, so its activations dominate the peak
            block.mlp.gate_proj, block.mlp.up_proj = nn.Linear(32, 2048, bias=False), nn.Linear(32, 2048, bias=False)
            block.mlp.down_proj = nn.Linear(2048, 32, bias=False)
        mx.eval(model.parameters())
        data = batch(rows=3, length=255)
        grad = nn.value_and_grad(model, lambda m, b: lm_loss(m, b)[0])
        mx.eval(grad(model, data))  # once, so that what stays allocated afterwards is in place
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        mx.eval(grad(model, data))
        return mx.get_peak_memory() - start

    plain, lean = peak(False), peak(True)
    # each block keeps sigmoid(gate) and silu(gate) less: 2 x 3 x 255 x 2048 floats = 12.5 MB a block
    assert lean < plain - 8e6, (plain, lean)


def test_finetune_trains_with_the_lean_swiglu(tmp_path):
    from mlx_train.llm.finetune import FineTuneConfig, finetune
    from mlx_train.training import Callback

    seen = []

    class Look(Callback):
        def on_fit_start(self, trainer):
            seen.extend(block.mlp for block in trainer.model.model.layers)

    llm_tiny.write_model_dir(str(tmp_path / "base"))
    llm_tiny.write_data(str(tmp_path / "data"), "text")
    config = FineTuneConfig(model=str(tmp_path / "base"), data=str(tmp_path / "data"), iters=2, batch_size=2,
                            num_layers=-1, run_dir=str(tmp_path / "run"), steps_per_eval=1000)
    finetune(config, callbacks=[Look()], log=lambda message: None)
    assert len(seen) == 2 and all(is_lean(mlp) for mlp in seen)
