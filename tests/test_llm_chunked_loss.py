"""The chunked output projection: ``lm_loss`` and the preference losses equal the plain full-logits
loss and its gradients (base weights, LoRA adapters, a trainable head) on a tied and an untied tiny
llama, with padding, prompt masking, packed documents and gathered positions; it never needs the
full logits; block gradient checkpointing of mlx-lm models recomputes the blocks and gives the
same gradients, also together with the chunked loss."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.llm import loss as llm_loss  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.loss import lm_loss, output_head, trained_positions  # noqa: E402
from mlx_train.llm.preference import PreferenceConfig, PreferenceLoss, sequence_logps  # noqa: E402
from mlx_train.training.recompute import enable_gradient_checkpointing, find_blocks  # noqa: E402

VOCAB = 97


def make(tie, train="lora", seed=0, layers=2):
    model, _ = llm_tiny.make_model(VOCAB, seed=seed, tie=tie, layers=layers)
    if train == "lora":
        apply_adapters(model, AdapterConfig("lora", num_layers=layers, rank=4))
        mx.random.seed(seed + 1)  # LoRA's B starts at 0: give it values so every gradient is non-trivial
        for _, layer in model.named_modules():
            if "lora_b" in layer:
                layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    elif train == "head_lora":
        from mlx_lm.tuner.lora import LoRALinear

        model.freeze()
        model.lm_head = LoRALinear.from_base(model.lm_head, r=4)
        model.lm_head.lora_b = mx.random.normal(model.lm_head.lora_b.shape) * 0.1
    mx.eval(model.parameters())
    return model


def batch(rows=3, length=21, seed=0, prompt=0, packed=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, size=(rows, length + 1)).astype(np.int32)
    lengths = [length, length - 7, length - 12][:rows]
    mask = np.zeros((rows, length), dtype=np.int32)
    for r, n in enumerate(lengths):
        mask[r, prompt:n] = 1
        tokens[r, n + 1:] = 0
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    if packed:
        segments = np.ones((rows, length), dtype=np.int32)
        segments[:, length // 2:] = 2
        out["segments"] = segments
        out["loss_mask"][:, length // 2 - 1] = 0  # the first token of the next document is not a target
    return {k: mx.array(v) for k, v in out.items()}


def plain_lm_loss(model, batch):
    """The loss as written before chunking: cross-entropy over the full logits."""
    logits = llm_loss.model_logits(model, batch)
    weights = batch["loss_mask"].astype(mx.float32)
    tokens = weights.sum()
    return (nn.losses.cross_entropy(logits, batch["targets"]) * weights).sum() / mx.maximum(tokens, 1.0), tokens


def loss_and_grads(model, fn, data, chunk):
    saved = llm_loss.CHUNK_LOGITS, llm_loss.MIN_CHUNK_TOKENS
    llm_loss.CHUNK_LOGITS, llm_loss.MIN_CHUNK_TOKENS = chunk * VOCAB, 1
    try:
        value_and_grad = nn.value_and_grad(model, lambda m, b: fn(m, b)[0])
        value, grads = value_and_grad(model, data)
        mx.eval(value, grads)
    finally:
        llm_loss.CHUNK_LOGITS, llm_loss.MIN_CHUNK_TOKENS = saved
    return value.item(), dict(tree_flatten(grads))


def assert_same(plain, chunked, rtol=2e-5):
    (loss_a, grads_a), (loss_b, grads_b) = plain, chunked
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        scale = float(mx.abs(grad).max().item())
        assert scale > 0, name
        error = float(mx.abs(grad - grads_b[name]).max().item())
        assert error <= rtol * scale + 1e-7, (name, error, scale)


def test_plain_llama_heads_are_recognised():
    assert output_head(make(tie=True))[0] is not None
    tied_head, project = output_head(make(tie=True))
    assert isinstance(tied_head, nn.Embedding)
    untied = make(tie=False)
    assert output_head(untied)[0] is untied.lm_head

    class Scaled(type(untied)):  # a Model whose __call__ is not the plain pattern: full logits
        def __call__(self, inputs, cache=None):
            return super().__call__(inputs, cache) * 0.5

    untied.__class__ = Scaled
    assert output_head(untied) is None


HEADS = [(True, "lora"), (True, "full"), (False, "lora"), (False, "full"), (False, "head_lora")]


@pytest.mark.parametrize(("tie", "train"), HEADS)
@pytest.mark.parametrize("layout", ["padded", "prompt", "packed", "positions"])
def test_lm_loss_and_gradients_equal_the_full_logits(tie, train, layout):
    model = make(tie, train)
    data = batch(prompt=5 if layout in ("prompt", "positions") else 0, packed=layout == "packed")
    plain = loss_and_grads(model, plain_lm_loss, data, chunk=0)
    assert_same(plain, loss_and_grads(model, lm_loss, data, chunk=0))
    if layout == "positions":
        data["positions"] = mx.array(trained_positions(np.array(data["loss_mask"]), multiple=8))
    assert_same(plain, loss_and_grads(model, lm_loss, data, chunk=8))  # 63 or fewer tokens: several chunks


def test_a_frozen_plain_head_gives_its_target_rows_and_others_take_the_one_hot():
    # The LoRA path's gradient W[t] - softmax @ W reads the rows of a plain Embedding or bias-free Linear
    # head; a quantized head or one with a bias is left to (onehot - softmax) @ W (both equal the full
    # logits' gradients: test_lm_loss_and_gradients_equal_the_full_logits, test_quantized_model_...).
    targets = mx.array([5, 0, 96, 5])
    for tie in (True, False):
        head = output_head(make(tie=tie))[0]
        rows = llm_loss.target_rows(head)
        assert rows is not None and mx.array_equal(rows(targets), head.weight[targets]).item()
    assert llm_loss.target_rows(nn.Linear(8, VOCAB, bias=True)) is None
    assert llm_loss.target_rows(nn.QuantizedEmbedding(VOCAB, 64, group_size=32, bits=4)) is None


def test_chunk_size_follows_the_vocabulary():
    assert llm_loss.chunk_tokens(49152) == 64 and llm_loss.chunk_tokens(151936) == 32  # 4M logits, at least 32
    assert llm_loss.chunk_tokens(32000) == 128


def test_trained_positions_are_row_wise_and_padded():
    got = trained_positions(np.array([[0, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]]), multiple=3)
    assert got.tolist() == [[1, 2, -1], [0, 3, -1], [-1, -1, -1]]


def pair_batch(seed=0, pairs=2, length=17, prompt=6):
    rng = np.random.default_rng(seed)
    out = {}
    for side in ("chosen", "rejected"):
        tokens = rng.integers(3, VOCAB, size=(pairs, length + 1)).astype(np.int32)
        mask = np.zeros((pairs, length), dtype=np.int32)
        for r in range(pairs):
            end = length - 4 * r
            mask[r, prompt - 1:end] = 1
            tokens[r, end + 1:] = 0
        out.update({f"{side}_inputs": tokens[:, :-1], f"{side}_targets": tokens[:, 1:], f"{side}_mask": mask})
    return {k: mx.array(v) for k, v in out.items()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("method", ["dpo", "orpo", "cpo"])
def test_preference_losses_equal_the_full_logits(tie, method):
    model = make(tie, "lora", seed=2)
    fn = PreferenceLoss(PreferenceConfig(method, beta=0.5))
    data = pair_batch()
    assert_same(loss_and_grads(model, fn, data, chunk=0), loss_and_grads(model, fn, data, chunk=8))


def test_sequence_logps_equal_a_hand_written_sum():
    model = make(False, "lora", seed=3)
    data = pair_batch(seed=3)
    logps, tokens = sequence_logps(model, data)
    inputs = mx.concatenate([data["chosen_inputs"], data["rejected_inputs"]])
    targets = mx.concatenate([data["chosen_targets"], data["rejected_targets"]])
    mask = mx.concatenate([data["chosen_mask"], data["rejected_mask"]]).astype(mx.float32)
    expected = (-nn.losses.cross_entropy(model(inputs), targets) * mask).sum(axis=-1)
    assert np.allclose(np.array(logps), np.array(expected), rtol=1e-5, atol=1e-5)
    assert np.array(tokens).tolist() == np.array(mask.sum(axis=-1)).tolist()


def test_mlx_lm_blocks_are_found_and_recomputed():
    model = make(tie=True, train="lora", layers=3)
    assert [path for path, _ in find_blocks(model)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    data = batch(prompt=2)
    plain = loss_and_grads(model, plain_lm_loss, data, chunk=0)
    calls = []
    original = type(model.model.layers[0]).__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    type(model.model.layers[0]).__call__ = counting
    try:
        enable_gradient_checkpointing(model)
        calls.clear()
        chunked = loss_and_grads(model, lm_loss, data, chunk=8)
    finally:
        type(model.model.layers[0]).__call__ = original
    assert len(calls) == 2 * 3  # each block's forward runs again in the backward pass
    assert_same(plain, chunked)
    packed = batch(packed=True)
    assert_same(loss_and_grads(make(tie=True, train="lora", layers=3), plain_lm_loss, packed, chunk=0),
                loss_and_grads(model, lm_loss, packed, chunk=8))


def test_quantized_model_with_lora_equals_the_full_logits():
    for tie in (True, False):
        model, _ = llm_tiny.make_model(VOCAB, seed=5, tie=tie)
        nn.quantize(model, group_size=32, bits=4)
        apply_adapters(model, AdapterConfig("lora", num_layers=2, rank=4))
        for _, layer in model.named_modules():
            if "lora_b" in layer:
                layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
        assert isinstance(output_head(model)[0], nn.QuantizedEmbedding if tie else nn.QuantizedLinear)
        data = batch(prompt=3)
        assert_same(loss_and_grads(model, plain_lm_loss, data, chunk=0), loss_and_grads(model, lm_loss, data, chunk=8))


def test_preference_positions_and_reference_passes_equal_the_full_logits():
    model = make(True, "lora", seed=6)
    data = pair_batch(seed=6)
    plain, _ = sequence_logps(model, data)
    saved = llm_loss.CHUNK_LOGITS
    llm_loss.CHUNK_LOGITS = 0
    try:
        full, _ = sequence_logps(model, data)
    finally:
        llm_loss.CHUNK_LOGITS = saved
    for side in ("chosen", "rejected"):
        data[f"{side}_positions"] = mx.array(trained_positions(np.array(data[f"{side}_mask"]), multiple=4))
    gathered, _ = sequence_logps(model, data)
    reference, _ = sequence_logps(model, data, grad=False)
    for got in (plain, gathered, reference):
        assert np.allclose(np.array(got), np.array(full), rtol=1e-5, atol=1e-5)
    fn = PreferenceLoss(PreferenceConfig("dpo", beta=0.5))
    assert_same(loss_and_grads(model, fn, pair_batch(seed=6), chunk=0), loss_and_grads(model, fn, data, chunk=4))
