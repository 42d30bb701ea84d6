"""Attention recomputation (``gradient_checkpointing: attention``) on mlx-lm models: it recomputes each
block's attention module in the backward pass and nothing else, gives the same losses and gradients
as no recomputation (LoRA, DoRA, full fine-tuning, a quantized base, packed rows, the preference
losses with their reference pass), gives way to whole blocks, and the config and flag name it.
``auto`` (finetune's default) does the same on rows of at least ``AUTO_MIN_TOKENS`` tokens only."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from test_llm_chunked_loss import VOCAB, assert_same, batch, loss_and_grads, pair_batch  # noqa: E402

from mlx_train import transforms as recompute  # noqa: E402  (AUTO_MIN_TOKENS is read there)
from mlx_train.config import TrainConfig  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.loss import lm_loss  # noqa: E402
from mlx_train.llm.preference import PreferenceConfig, PreferenceLoss  # noqa: E402
from mlx_train.training.recompute import (  # noqa: E402
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_checkpointed,
)


def make(train="lora", layers=3, seed=0, quantized=False):
    model, _ = llm_tiny.make_model(VOCAB, seed=seed, tie=False, layers=layers)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    if train in ("lora", "dora"):
        apply_adapters(model, AdapterConfig(train, num_layers=2, rank=4))  # the last 2 of 3 blocks train
        mx.random.seed(seed + 1)  # LoRA's B starts at 0: give it values so every gradient is non-trivial
        for _, layer in model.named_modules():
            if "lora_b" in layer:
                layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    mx.eval(model.parameters())
    return model


class Counting:
    """Counts the calls of some modules (by patching their classes' ``__call__``; the modules are
    projections, whose classes gradient checkpointing does not replace)."""

    def __init__(self, modules):
        self.ids, self.calls = {id(m) for m in modules}, 0
        self.originals = {cls: cls.__call__ for cls in {type(m) for m in modules}}

    def __enter__(self):
        for cls, original in self.originals.items():
            def counting(module, *args, _original=original, **kwargs):
                self.calls += id(module) in self.ids
                return _original(module, *args, **kwargs)

            cls.__call__ = counting
        return self

    def __exit__(self, *exc):
        for cls, original in self.originals.items():
            cls.__call__ = original


def queries(model):
    """Each block's query projection: called once per forward of its attention module."""
    return [block.self_attn.q_proj for block in model.model.layers]


def gates(model):
    """Each block's MLP gate projection: called once per forward of its MLP."""
    return [block.mlp.gate_proj for block in model.model.layers]


def test_attention_is_recomputed_and_nothing_else():
    model = make()
    data = batch(prompt=2)
    with Counting(queries(model)) as attention, Counting(gates(model)) as mlp:
        plain = loss_and_grads(model, lm_loss, data, chunk=8)
        assert (attention.calls, mlp.calls) == (3, 3)
        paths = enable_gradient_checkpointing(model, granularity="attention")
        assert paths == [f"model.layers.{i}.self_attn" for i in range(3)]
        attention.calls = mlp.calls = 0
        recomputed = loss_and_grads(model, lm_loss, data, chunk=8)
        # the 3 forwards, and again in the backward pass for the 2 blocks gradients flow through
        # (block 0 has nothing trainable and nothing trainable before it: no backward pass there)
        assert (attention.calls, mlp.calls) == (3 + 2, 3)
    assert not any(is_checkpointed(block) for block in model.model.layers)
    assert_same(plain, recomputed)


@pytest.mark.parametrize("train", ["lora", "dora", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_attention_recomputation_keeps_losses_and_gradients(train, layout):
    data = batch(prompt=3, packed=layout == "packed")
    plain = loss_and_grads(make(train), lm_loss, data, chunk=8)
    model = make(train)
    enable_gradient_checkpointing(model, granularity="attention")
    assert_same(plain, loss_and_grads(model, lm_loss, data, chunk=8))


def test_attention_recomputation_on_a_quantized_base():
    data = batch(prompt=3)
    plain = loss_and_grads(make(quantized=True), lm_loss, data, chunk=8)
    model = make(quantized=True)
    enable_gradient_checkpointing(model, granularity="attention")
    assert_same(plain, loss_and_grads(model, lm_loss, data, chunk=8))


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_attention_recomputation_keeps_preference_losses(method):
    fn = PreferenceLoss(PreferenceConfig(method, beta=0.5))  # DPO: the reference is the model, adapters off
    data = pair_batch()
    plain = loss_and_grads(make(seed=2), fn, data, chunk=8)
    model = make(seed=2)
    enable_gradient_checkpointing(model, granularity="attention")
    calls = []
    original = llama.scaled_dot_product_attention  # what each attention forward calls once (adapters or not)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    llama.scaled_dot_product_attention = counting
    try:
        assert_same(plain, loss_and_grads(model, fn, data, chunk=8))
    finally:
        llama.scaled_dot_product_attention = original
    forwards = 3 * (2 if method == "dpo" else 1)  # DPO: the reference pass (adapters off) and the policy pass
    assert len(calls) == forwards + 2  # the reference pass has no backward pass: nothing recomputed there


def test_blocks_after_attention_recompute_each_block_once():
    model = make()
    enable_gradient_checkpointing(model, granularity="attention")
    assert enable_gradient_checkpointing(model) == [f"model.layers.{i}" for i in range(3)]
    assert all(is_checkpointed(b) and not is_checkpointed(b.self_attn) for b in model.model.layers)
    # attention after blocks keeps the blocks
    assert enable_gradient_checkpointing(model, granularity="attention") == [f"model.layers.{i}" for i in range(3)]
    assert not any(is_checkpointed(b.self_attn) for b in model.model.layers)
    assert len(disable_gradient_checkpointing(model)) == 3


def test_a_block_without_attention_is_refused_with_advice():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(4, 4)

        def __call__(self, x):
            return self.mix(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block()]

    with pytest.raises(ConfigError, match=r"'layers.0' \(Block\) and the other blocks have none \(its children: "
                                          r"mix\).*true"):
        enable_gradient_checkpointing(Net(), granularity="attention")
    with pytest.raises(ConfigError, match="one of blocks, attention"):
        enable_gradient_checkpointing(Net(), granularity="heads")


def test_a_hybrid_model_recomputes_the_attention_it_has():
    model = make()
    del model.model.layers[1]["self_attn"]  # as a hybrid model's recurrent block: no attention module
    assert enable_gradient_checkpointing(model, granularity="attention") == ["model.layers.0.self_attn",
                                                                             "model.layers.2.self_attn"]


def test_finetune_turns_the_default_off_for_a_model_without_attention():
    from mlx_train.llm.finetune import FineTuneConfig, recompute_setting

    config = FineTuneConfig(model="base", data="data")
    assert config.gradient_checkpointing == "auto"  # finetune's default
    assert FineTuneConfig(model="base", data="data", grad_checkpoint=False).gradient_checkpointing is False
    model = make()
    assert recompute_setting(config, model, log=print) is config
    for block in model.model.layers:
        del block["self_attn"]
    said = []
    assert recompute_setting(config, model, log=said.append).gradient_checkpointing is False
    assert "finds no attention module" in said[0]


def test_the_option_names_what_is_recomputed():
    assert TrainConfig(gradient_checkpointing="attention").gradient_checkpointing == "attention"
    assert TrainConfig(gradient_checkpointing="Auto").gradient_checkpointing == "auto"
    assert TrainConfig(gradient_checkpointing="blocks").gradient_checkpointing is True
    assert TrainConfig(gradient_checkpointing="off").gradient_checkpointing is False
    assert TrainConfig.from_dict({"grad_checkpoint": True}, finetune=True).gradient_checkpointing is True
    with pytest.raises(ConfigError, match="true .*, false, blocks, attention or auto, got 'atention'.*attention"):
        TrainConfig(gradient_checkpointing="atention")


def test_the_trainer_recomputes_what_the_config_says():
    import mlx.optimizers as optim

    from mlx_train.training import Trainer

    data = batch(prompt=2)
    for setting, attention, blocks in (("attention", True, False), ("auto", True, False), (True, False, True),
                                       (False, False, False)):
        model = make()
        trainer = Trainer(model, optim.Adam(learning_rate=1e-3), loss_fn=lm_loss, gradient_checkpointing=setting,
                          max_steps=1, report_every="1 steps", eval_every="1000 epochs")
        trainer.fit([data], epochs=1, save_best=False)
        layers = model.model.layers
        assert all(is_checkpointed(b.self_attn) == attention and is_checkpointed(b) == blocks for b in layers)


@pytest.mark.parametrize(("flags", "value"), [
    (["--grad-checkpoint"], True), (["--grad-checkpoint", "blocks"], True),
    (["--grad-checkpoint", "attention"], "attention"), (["--grad-checkpoint", "auto"], "auto"),
    (["--grad-checkpoint", "off"], False)])
def test_the_flag_alone_recomputes_blocks_and_can_name_attention(tmp_path, flags, value):
    from mlx_train.cli.finetune import resolve_config
    from mlx_train.cli.main import build_parser

    args = build_parser("finetune").parse_args(["finetune", "--model", "base", "--data", "data", "--run-dir",
                                                 str(tmp_path / "r"), *flags])
    assert resolve_config(args, log=lambda message: None).gradient_checkpointing == value


def test_auto_recomputes_attention_on_long_rows_only(monkeypatch):
    monkeypatch.setattr(recompute, "AUTO_MIN_TOKENS", 16)
    model = make()
    short, long = batch(length=15, prompt=2), batch(length=21, prompt=2)
    with Counting(queries(model)) as attention, Counting(gates(model)) as mlp:
        plain = {name: loss_and_grads(model, lm_loss, data, chunk=8) for name, data in (("short", short),
                                                                                       ("long", long))}
        assert enable_gradient_checkpointing(model, granularity="auto") == [f"model.layers.{i}.self_attn"
                                                                             for i in range(3)]
        assert all(is_checkpointed(b.self_attn) for b in model.model.layers)
        for name, data, recomputed in (("short", short, 0), ("long", long, 2)):
            attention.calls = mlp.calls = 0
            assert_same(plain[name], loss_and_grads(model, lm_loss, data, chunk=8))
            # 15 tokens: the 3 forwards alone; 21: again in the backward pass of the 2 blocks that train
            assert (attention.calls, mlp.calls) == (3 + recomputed, 3), name


def test_auto_and_attention_replace_each_other_and_give_way_to_blocks(monkeypatch):
    monkeypatch.setattr(recompute, "AUTO_MIN_TOKENS", 1000)
    model = make()
    data = batch(length=21, prompt=2)
    with Counting(queries(model)) as attention:
        enable_gradient_checkpointing(model, granularity="auto")
        loss_and_grads(model, lm_loss, data, chunk=8)
        assert attention.calls == 3  # 21 tokens < 1000: nothing recomputed
        enable_gradient_checkpointing(model, granularity="attention")
        attention.calls = 0
        loss_and_grads(model, lm_loss, data, chunk=8)
        assert attention.calls == 3 + 2  # every row now
        enable_gradient_checkpointing(model, granularity="auto")
        attention.calls = 0
        loss_and_grads(model, lm_loss, data, chunk=8)
        assert attention.calls == 3
    assert enable_gradient_checkpointing(model) == [f"model.layers.{i}" for i in range(3)]
    assert all(is_checkpointed(b) and not is_checkpointed(b.self_attn) for b in model.model.layers)
    assert enable_gradient_checkpointing(model, granularity="auto") == [f"model.layers.{i}" for i in range(3)]
    assert len(disable_gradient_checkpointing(model)) == 3
    assert not any(is_checkpointed(m) for _, m in model.named_modules())


def test_a_compiled_step_decides_per_batch_shape_and_trains_as_without_recomputation(monkeypatch):
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mlx_train.training import Trainer

    monkeypatch.setattr(recompute, "AUTO_MIN_TOKENS", 16)
    data = [batch(length=15, prompt=2), batch(length=21, prompt=2, seed=1), batch(length=15, prompt=2, seed=2)]
    trained = {}
    for setting in ("auto", False):
        model = make()
        trainer = Trainer(model, optim.Adam(learning_rate=1e-2), loss_fn=lm_loss, gradient_checkpointing=setting,
                          max_steps=3, report_every="1 steps", eval_every="1000 epochs", compile=True)
        with Counting(queries(model)) as attention:
            trainer.fit(data, epochs=1, save_best=False)
        trained[setting] = (attention.calls, dict(tree_flatten(model.trainable_parameters())))
    # Python runs only while a step is traced: the 15-token shape once (3 forwards), the 21-token shape once
    # (3 forwards and the 2 trained blocks' attention again); the third batch reuses the first trace
    assert trained["auto"][0] == 3 + 3 + 2 and trained[False][0] == 3 + 3
    for name, value in trained[False][1].items():
        assert mx.allclose(value, trained["auto"][1][name], rtol=1e-5, atol=1e-6).item(), name
