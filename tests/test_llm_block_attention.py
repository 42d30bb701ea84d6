"""Causal attention in blocks of queries (``mlx_train.transforms``): the values and gradients of one
``mx.fast.scaled_dot_product_attention`` call to float rounding (MHA and GQA, lengths that are and are not
a multiple of the block), switched on instance by instance for attention modules that call mlx-lm's
function (a llama and a qwen2), composed with attention recomputation, and on in every model
``mlx-train finetune`` trains; other masks and a KV cache go to mlx-lm's function unchanged."""

import os
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from mlx_lm.models import base  # noqa: E402
from test_llm_chunked_loss import assert_same, batch, loss_and_grads  # noqa: E402
from test_llm_lean_swiglu import llama, qwen2, trained  # noqa: E402

from mlx_train import transforms as attention  # noqa: E402
from mlx_train.llm.loss import lm_loss  # noqa: E402
from mlx_train.training.recompute import enable_gradient_checkpointing, is_checkpointed  # noqa: E402
from mlx_train.transforms import block_size, causal_blocks, is_blocked, use_block_attention  # noqa: E402


@pytest.mark.parametrize(("heads", "kv_heads", "length"), [(4, 4, 256), (6, 2, 200), (3, 1, 65)])
def test_blocks_equal_one_call_in_values_and_gradients(heads, kv_heads, length):
    rng = np.random.default_rng(length)
    q, w = (mx.array(rng.normal(size=(2, heads, length, 16)).astype(np.float32)) for _ in range(2))
    k, v = (mx.array(rng.normal(size=(2, kv_heads, length, 16)).astype(np.float32)) for _ in range(2))
    assert -(-length // block_size(length)) > 1  # several blocks

    def total(fn):
        return mx.value_and_grad(lambda a, b, c: (fn(a, b, c) * w).sum(), argnums=(0, 1, 2))

    one = total(lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.25, mask="causal"))(q, k, v)
    blocks = total(lambda a, b, c: causal_blocks(a, b, c, 0.25))(q, k, v)
    assert blocks[0].item() == pytest.approx(one[0].item(), rel=1e-5, abs=1e-4)
    for got, want in zip(blocks[1], one[1], strict=True):
        assert float(mx.abs(got - want).max()) <= 1e-5 * float(mx.abs(want).max())


def test_block_size_bounds_the_number_of_blocks():
    assert [block_size(n) for n in (65, 256, 512, 2048, 4096)] == [64, 64, 64, 256, 512]
    assert all(-(-n // block_size(n)) <= attention.MAX_BLOCKS for n in range(65, 5000, 37))


def test_other_masks_a_cache_and_the_gpu_go_to_mlx_lms_function(monkeypatch):
    calls = []

    def original(queries, keys, values, cache=None, scale=1.0, mask=None, **options):
        calls.append((cache, mask if isinstance(mask, str) or mask is None else "array", options))
        return queries

    monkeypatch.setattr(attention, "causal_blocks", lambda *args: pytest.fail("blocks taken"))
    sdpa = attention.blocked_sdpa(original)
    q = mx.zeros((1, 2, 128, 8))
    sdpa(q, q, q, cache=None, scale=1.0, mask=mx.zeros((128, 128)))  # a document mask
    sdpa(q, q, q, cache="kv", scale=1.0, mask="causal")  # generation with a cache
    sdpa(q, q, q, cache=None, scale=1.0, mask="causal", sinks=mx.zeros((2,)))
    sdpa(q[:, :, :64], q[:, :, :64], q[:, :, :64], cache=None, scale=1.0, mask="causal")  # one block: as it is
    monkeypatch.setattr(attention.mx, "default_device", lambda: SimpleNamespace(type=mx.gpu))  # the fused kernel
    sdpa(q, q, q, cache=None, scale=1.0, mask="causal")
    monkeypatch.undo()
    assert [c[:2] for c in calls] == [(None, "array"), ("kv", "causal"), (None, "causal"), (None, "causal"),
                                      (None, "causal")]
    assert calls[2][2]["sinks"] is not None


@pytest.mark.parametrize("build", [llama, qwen2])
@pytest.mark.parametrize("train", ["lora", "full"])
def test_a_model_trains_as_before(build, train):
    plain, blocked = trained(build(), train), trained(build(), train)
    paths = use_block_attention(blocked)
    assert paths == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert use_block_attention(blocked) == []  # again: nothing more
    assert all(is_blocked(m) == (p in paths) for p, m in blocked.named_modules())
    assert not any(is_blocked(m) for _, m in plain.named_modules())  # the class itself is unchanged
    data = batch(rows=2, length=150)  # 150 tokens: 3 blocks of 64
    assert_same(loss_and_grads(plain, lm_loss, data, chunk=0), loss_and_grads(blocked, lm_loss, data, chunk=0))
    assert sorted(k for k, _ in blocked.parameters().items()) == sorted(k for k, _ in plain.parameters().items())


def test_recomputed_attention_recomputes_the_blocks():
    plain, blocked = trained(llama(), "lora"), trained(llama(), "lora")
    use_block_attention(blocked)
    assert enable_gradient_checkpointing(blocked, granularity="attention")
    module = blocked.model.layers[0].self_attn
    assert is_checkpointed(module) and is_blocked(module)
    data = batch(rows=2, length=150)
    assert_same(loss_and_grads(plain, lm_loss, data, chunk=0), loss_and_grads(blocked, lm_loss, data, chunk=0))


def test_a_module_calling_another_function_is_left_alone():
    model = llama()
    attn = model.model.layers[0].self_attn
    assert attn.__call__.__globals__["scaled_dot_product_attention"] is base.scaled_dot_product_attention

    class Own(type(attn)):
        def __call__(self, x, mask=None, cache=None):  # no mlx-lm attention function
            return x

    attn.__class__ = Own
    assert "model.layers.0.self_attn" not in use_block_attention(model)
