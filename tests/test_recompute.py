"""Gradient checkpointing per instance: same loss and gradients, less memory, other instances untouched."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import ConfigError
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import TransformerBlock, build_model
from mlx_train.memory.calibrate import measure_step
from mlx_train.training import Trainer
from mlx_train.training.recompute import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    find_blocks,
    is_checkpointed,
)

INFO = {"vocab_size": 50, "block_size": 32}


def _transformer(seed=0, **options):
    mx.random.seed(seed)
    return build_model("transformer", INFO, **options)


def _loss_and_grads(model, tokens):
    def loss(params):
        model.update(params)
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    value, grads = mx.value_and_grad(loss)(model.trainable_parameters())
    return value.item(), dict(tree_flatten(grads))


def test_only_this_instance_changes_and_the_class_stays_as_it_was():
    original_call = TransformerBlock.__call__
    model, other = _transformer(), _transformer()
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert enable_gradient_checkpointing(model) == ["layers.0", "layers.1"]
    assert all(is_checkpointed(block) and isinstance(block, TransformerBlock) for block in model.layers)
    assert type(model.layers[0]).__name__ == "TransformerBlock"
    assert TransformerBlock.__call__ is original_call
    assert all(type(block) is TransformerBlock for block in other.layers)
    assert not any(is_checkpointed(block) for block in other.layers)
    assert [k for k, _ in tree_flatten(model.parameters())] == names  # same parameter tree
    assert enable_gradient_checkpointing(model) == ["layers.0", "layers.1"]  # twice is harmless
    assert sorted(disable_gradient_checkpointing(model)) == ["layers.0", "layers.1"]
    assert all(type(block) is TransformerBlock for block in model.layers)


def test_same_loss_and_gradients_as_without():
    plain, checkpointed = _transformer(), _transformer()
    enable_gradient_checkpointing(checkpointed)
    tokens = mx.random.randint(0, 50, (4, 33))
    loss_a, grads_a = _loss_and_grads(plain, tokens)
    loss_b, grads_b = _loss_and_grads(checkpointed, tokens)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name, grad in grads_a.items():
        assert np.allclose(np.array(grad), np.array(grads_b[name]), rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_trainer_with_checkpointing_trains_the_same_and_uses_less_memory():
    data = load_dataset("text", seed=0)
    runs = {}
    for on in (False, True):
        mx.random.seed(0)
        model = build_model("transformer", data["info"])
        trainer = Trainer(model, optim.AdamW(1e-3), batch_size=8, max_steps=4, gradient_checkpointing=on,
                          report_every="1000 steps", num_workers=0)
        trainer.train(data["train"], epochs=1)
        assert all(is_checkpointed(block) == on for block in model.layers)
        runs[on] = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for name, value in runs[False].items():
        assert np.abs(value - runs[True][name]).max() <= 1e-5 * np.abs(value).max(), name

    mx.random.seed(0)
    model = build_model("transformer", data["info"])
    batch = {"tokens": mx.array(data["train"]["tokens"][:32])}
    plain = measure_step(model, batch)
    recomputed = measure_step(model, batch, gradient_checkpointing=True)
    assert recomputed.peak < 0.85 * plain.peak, (plain.peak, recomputed.peak)
    assert not any(is_checkpointed(block) for block in model.layers)  # measuring left the model alone


def test_named_modules_and_clear_errors():
    model = _transformer()
    assert [path for path, _ in find_blocks(model, ["layers.1"])] == ["layers.1"]
    assert [path for path, _ in find_blocks(model, ["layers.0.mlp.layers"])] == [
        "layers.0.mlp.layers.0", "layers.0.mlp.layers.1", "layers.0.mlp.layers.2"]
    enable_gradient_checkpointing(model, ["layers.1"])
    assert not is_checkpointed(model.layers[0]) and is_checkpointed(model.layers[1])
    with pytest.raises(ConfigError, match=r"has no module 'layerz' .*\(did you mean 'layers'\?\)"):
        find_blocks(model, ["layerz"])
    with pytest.raises(ConfigError, match=r"has no module 'layers.7' \(layers has no '7'; its children: 0, 1\)"):
        find_blocks(model, ["layers.7"])
    with pytest.raises(ConfigError, match=r"'block_size' of CharTransformerLM is of type int, not a module"):
        find_blocks(model, ["block_size"])
    cnn = build_model("cnn", {"image_shape": (8, 8, 1), "num_classes": 10})
    with pytest.raises(ConfigError, match=r"SmallCNN has no 'layers'; name its repeated blocks with "
                                          r"checkpoint_modules .* e\.g\. checkpoint_modules=\['convs'\]"):
        find_blocks(cnn)
    assert [path for path, _ in find_blocks(cnn, ["convs"])] == ["convs.0", "convs.1"]


def test_trainer_config_names_the_blocks():
    data = load_dataset("digits", seed=0, as_images=True)
    mx.random.seed(0)
    cnn = build_model("cnn", data["info"])
    with pytest.raises(ConfigError, match=r"SmallCNN has no 'layers'"):
        Trainer(cnn, optim.SGD(0.1), gradient_checkpointing=True, max_steps=1).train(data["train"], epochs=1)
    trainer = Trainer(cnn, optim.SGD(0.1), gradient_checkpointing=True, checkpoint_modules=["convs"],
                      max_steps=2, report_every="1000 steps", num_workers=0)
    trainer.train(data["train"], epochs=1)
    assert trainer.step == 2 and all(is_checkpointed(conv) for conv in cnn.convs)
