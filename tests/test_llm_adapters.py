"""LoRA, DoRA and full fine-tuning through the API: adapters in mlx-lm's format give
mlx_lm.load the trained model's logits; continuing from adapters; fusing; generic models;
attention inside packed documents."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import (  # noqa: E402
    AdapterConfig,
    SequenceDataset,
    apply_adapters,
    document_attention_mask,
    fuse_adapters,
    lm_loss,
    load_adapters,
    make_loader,
    save_adapters,
    save_model,
    tokenize,
)
from mlx_train.llm.loss import model_logits  # noqa: E402
from mlx_train.training import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("base"))
    model, tokenizer, config = llm_tiny.write_model_dir(directory, seed=1)
    return directory, tokenizer


def _train(model, tokenizer, steps=3, pack=False):
    docs = tokenize(llm_tiny.records("completion", 8), tokenizer, mask_prompt=True)
    rows = SequenceDataset(docs, max_seq_length=160, pack=pack)
    trainer = Trainer(model, optim.Adam(learning_rate=1e-2), loss_fn=lm_loss, batch_size=4, max_steps=steps,
                      report_every="100 steps", num_workers=0)
    trainer.train(train_dataset=make_loader(rows, 4, num_workers=0), epochs=10)
    return trainer


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_adapters_load_in_mlx_lm_with_the_trained_logits(base, tmp_path, kind):
    import mlx_lm

    directory, tokenizer = base
    model, _ = mlx_lm.load(directory)
    before = dict(tree_flatten(model.parameters()))
    spec = AdapterConfig(kind, num_layers=1, rank=4, scale=10.0)
    mx.random.seed(0)
    apply_adapters(model, spec)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert trainable and all(".layers.1." in k for k in trainable)
    _train(model, tokenizer)
    after = dict(tree_flatten(model.trainable_parameters()))
    assert any(not mx.array_equal(after[k], trainable[k]) for k in after), "training changed nothing"
    frozen = {k: v for k, v in tree_flatten(model.parameters()) if k in before and k not in after}
    assert all(mx.array_equal(v, before[k]) for k, v in frozen.items()), "a frozen weight moved"
    save_adapters(model, spec, str(tmp_path / "adapters"))
    loaded, _ = mlx_lm.load(directory, adapter_path=str(tmp_path / "adapters"))
    model.eval()
    x = mx.array([tokenizer.encode("What is two plus two?")])
    np.testing.assert_allclose(np.array(loaded(x)), np.array(model(x)), atol=1e-6)


def test_continue_from_adapters_and_fuse(base, tmp_path):
    import mlx_lm

    directory, tokenizer = base
    model, _ = mlx_lm.load(directory)
    spec = AdapterConfig("lora", num_layers=2, rank=4, scale=10.0, keys=["self_attn.q_proj", "self_attn.v_proj"])
    apply_adapters(model, spec)
    assert {k.split(".")[-2] for k, _ in tree_flatten(model.trainable_parameters())} == {"q_proj", "v_proj"}
    _train(model, tokenizer, steps=2)
    save_adapters(model, spec, str(tmp_path / "a"))
    again, _ = mlx_lm.load(directory)
    assert load_adapters(again, str(tmp_path / "a")) == spec
    model.eval(), again.eval()
    x = mx.array([tokenizer.encode("Hello there")])
    assert mx.array_equal(again(x), model(x))
    trained = dict(tree_flatten(model.trainable_parameters()))
    assert dict(tree_flatten(again.trainable_parameters())).keys() == trained.keys()
    expected = model(x)
    fuse_adapters(again)
    assert not any("lora" in k for k, _ in tree_flatten(again.parameters()))
    np.testing.assert_allclose(np.array(again(x)), np.array(expected), atol=1e-5)
    save_model(again, tokenizer, llm_tiny.model_config(len(tokenizer._tokenizer)), str(tmp_path / "fused"))
    fused, _ = mlx_lm.load(str(tmp_path / "fused"))
    np.testing.assert_allclose(np.array(fused(x)), np.array(expected), atol=1e-5)


def test_adapters_for_a_model_that_is_not_from_mlx_lm():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def __call__(self, x):
            return x + self.down(nn.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block(), Block()]
            self.head = nn.Linear(8, 3)

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    net = Net()
    apply_adapters(net, AdapterConfig("lora", num_layers=2, rank=2, keys=["up"]))
    names = sorted(k for k, _ in tree_flatten(net.trainable_parameters()))
    assert names == ["layers.1.up.lora_a", "layers.1.up.lora_b", "layers.2.up.lora_a", "layers.2.up.lora_b"]
    x = mx.random.normal((5, 8))
    y = mx.array([0, 1, 2, 0, 1])
    trainer = Trainer(net, optim.SGD(learning_rate=0.1), batch_size=5, max_steps=2, num_workers=0)
    trainer.train(train_dataset=(np.array(x), np.array(y)), epochs=2)
    assert not mx.array_equal(net.layers[1].up.lora_b, mx.zeros_like(net.layers[1].up.lora_b))
    with pytest.raises(ConfigError, match="no nn.Linear/nn.QuantizedLinear module matches keys=\\['nope'\\]"):
        apply_adapters(Net(), AdapterConfig("lora", num_layers=1, keys=["nope"]))
    with pytest.raises(ConfigError, match="num_layers=5 but the model has 3 layers"):
        apply_adapters(Net(), AdapterConfig("full", num_layers=5))
    with pytest.raises(ConfigError, match="fine_tune_type is 'qlora'; choose one of lora, dora, full"):
        AdapterConfig("qlora")
    with pytest.raises(ConfigError, match="has 'alpha' but mlx-lm LoRA uses 'scale'"):
        AdapterConfig.from_mlx_lm({"lora_parameters": {"rank": 8, "alpha": 16}})


def test_document_mask_gives_each_document_its_own_logits(base):
    import mlx_lm

    directory, tokenizer = base
    model, _ = mlx_lm.load(directory)
    docs = tokenize(llm_tiny.records("text", 5), tokenizer)
    rows = SequenceDataset(docs, max_seq_length=120, pack=True)
    packed = [r for r in range(len(rows)) if len(rows.rows[r]) > 1]
    assert packed, "no row holds two documents"
    sample = rows[packed[0]]
    batch = {k: mx.array(v[None]) for k, v in sample.items()}
    logits = model_logits(model, batch)[0]
    start = 0
    for i in rows.rows[packed[0]]:
        tokens = docs.tokens[i]
        alone = model(mx.array(tokens[None, :-1]))[0]
        np.testing.assert_allclose(np.array(logits[start:start + len(tokens) - 1]), np.array(alone), atol=1e-4)
        start += len(tokens)
    # without the mask the second document sees the first: its logits differ
    plain = model(batch["inputs"])[0]
    first = len(docs.tokens[rows.rows[packed[0]][0]])
    assert not np.allclose(np.array(plain[first:first + 3]), np.array(logits[first:first + 3]), atol=1e-4)


def test_document_attention_mask_layout():
    mask = document_attention_mask(mx.array([[1, 1, 2, 0]]))
    assert mask.shape == (1, 1, 4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [False, False, True, False], [False, False, False, True]]


def test_lm_loss_counts_only_masked_targets(base):
    import mlx_lm

    directory, tokenizer = base
    model, _ = mlx_lm.load(directory)
    docs = tokenize(llm_tiny.records("completion", 2), tokenizer, mask_prompt=True)
    rows = SequenceDataset(docs)
    batch = {k: mx.array(v[None]) for k, v in rows[0].items()}
    loss, n = lm_loss(model, batch)
    logits = model(batch["inputs"])[0]
    mask = np.array(batch["loss_mask"][0]).astype(bool)
    ce = np.array(nn.losses.cross_entropy(logits, batch["targets"][0]))[mask]
    assert int(n.item()) == mask.sum() == len(docs.tokens[0]) - docs.offsets[0]
    np.testing.assert_allclose(loss.item(), ce.mean(), rtol=1e-5)


def test_qlora_keeps_a_quantized_base_quantized(tmp_path):
    import mlx_lm
    from mlx_lm.utils import quantize_model

    from mlx_train.llm import load_model
    from mlx_train.llm.models import is_quantized

    model, tokenizer, config = llm_tiny.write_model_dir(str(tmp_path / "float"), seed=6)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(model, tokenizer, config, str(tmp_path / "q4"))
    qmodel, tokenizer, _ = load_model(str(tmp_path / "q4"), quantized=True)
    assert is_quantized(qmodel)
    assert not is_quantized(load_model(str(tmp_path / "q4"), quantized=False)[0])
    spec = AdapterConfig("lora", num_layers=2, rank=4, scale=10.0)
    apply_adapters(qmodel, spec)
    _train(qmodel, tokenizer, steps=2)
    save_adapters(qmodel, spec, str(tmp_path / "adapters"))
    loaded, _ = mlx_lm.load(str(tmp_path / "q4"), adapter_path=str(tmp_path / "adapters"))
    qmodel.eval()
    x = mx.array([tokenizer.encode("All that glitters")])
    np.testing.assert_allclose(np.array(loaded(x)), np.array(qmodel(x)), atol=1e-5)
