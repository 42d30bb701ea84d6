"""Built-in models: shapes, one gradient step, causality, digits accuracy, errors."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import MLP, CharTransformerLM, SmallCNN, available_models, build_model
from mlx_train.errors import ConfigError, DataError

DIGITS_INFO = {"task": "classification", "in_dims": 64, "num_classes": 10, "image_shape": (8, 8, 1)}
TEXT_INFO = {"task": "language_modeling", "vocab_size": 50, "block_size": 16}


def _classification_loss(model, x, y):
    return nn.losses.cross_entropy(model(x), y).mean()


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()


def _one_step(model, loss_fn, *batch):
    """Loss before and after one SGD step on the same batch; checks every parameter has a gradient."""
    optimizer = optim.SGD(learning_rate=0.05)
    loss, grads = nn.value_and_grad(model, loss_fn)(model, *batch)
    for name, grad in tree_flatten(grads):
        assert mx.all(mx.isfinite(grad)).item(), name
        assert mx.any(grad != 0).item(), f"no gradient reaches {name}"
    optimizer.update(model, grads)
    mx.eval(model.parameters())
    return loss.item(), loss_fn(model, *batch).item()


def test_mlp_forward_shapes_and_step():
    mx.random.seed(0)
    model = MLP(in_dims=64, hidden_dims=(32, 16), num_classes=10)
    assert model(mx.zeros((5, 64))).shape == (5, 10)
    assert model(mx.zeros((5, 8, 8, 1))).shape == (5, 10)  # flattened
    assert [layer.weight.shape for layer in model.layers] == [(32, 64), (16, 32), (10, 16)]
    x, y = mx.random.normal((16, 64)), mx.random.randint(0, 10, (16,))
    before, after = _one_step(model, _classification_loss, x, y)
    assert after < before


def test_cnn_forward_shapes_and_step():
    mx.random.seed(0)
    model = SmallCNN(image_shape=(8, 8, 1), num_classes=10, channels=(4, 8), hidden_dims=16)
    assert model(mx.zeros((3, 8, 8, 1))).shape == (3, 10)
    assert model(mx.zeros((3, 64))).shape == (3, 10)  # flat pixels are reshaped to the image
    x, y = mx.random.uniform(shape=(16, 8, 8, 1)), mx.random.randint(0, 10, (16,))
    before, after = _one_step(model, _classification_loss, x, y)
    assert after < before


def test_transformer_forward_shapes_and_step():
    mx.random.seed(0)
    model = CharTransformerLM(vocab_size=50, dims=32, num_heads=4, num_layers=3, block_size=16)
    assert isinstance(model.layers, list) and len(model.layers) == 3
    assert model(mx.zeros((2, 16), dtype=mx.int32)).shape == (2, 16, 50)
    assert model(mx.zeros((2, 5), dtype=mx.int32)).shape == (2, 5, 50)
    tokens = mx.random.randint(0, 50, (4, 17))
    before, after = _one_step(model, _lm_loss, tokens)
    assert after < before


def test_transformer_is_causal():
    mx.random.seed(1)
    model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=2, block_size=8)
    tokens = mx.random.randint(0, 20, (1, 8))
    changed = mx.concatenate([tokens[:, :5], (tokens[:, 5:] + 1) % 20], axis=1)
    a, b = model(tokens), model(changed)
    assert mx.allclose(a[:, :5], b[:, :5], atol=1e-5).item()  # the past ignores the future
    assert not mx.allclose(a[:, 5:], b[:, 5:]).item()


def test_transformer_rejects_too_long_sequences():
    model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=1, block_size=8)
    with pytest.raises(DataError, match=r"block_size=8, got shape \(1, 9\)"):
        model(mx.zeros((1, 9), dtype=mx.int32))


def test_dropout_only_in_training_mode():
    mx.random.seed(0)
    model = MLP(in_dims=8, hidden_dims=(64,), num_classes=4, dropout=0.5)
    x = mx.ones((2, 8))
    assert not mx.array_equal(model(x), model(x)).item()
    model.eval()
    assert mx.array_equal(model(x), model(x)).item()


def test_mlp_learns_digits():
    """A hand-written MLX loop: the built-in MLP reaches >= 0.9 test accuracy on digits."""
    mx.random.seed(0)
    data = load_dataset("digits", seed=0)
    model = build_model("mlp", data["info"])
    optimizer = optim.AdamW(learning_rate=1e-3)
    step = nn.value_and_grad(model, _classification_loss)
    (x, y), rng = data["train"], np.random.default_rng(0)
    for _ in range(5):
        order = rng.permutation(len(x))
        for start in range(0, len(x) - 31, 32):
            batch = order[start : start + 32]
            _, grads = step(model, mx.array(x[batch]), mx.array(y[batch]))
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state)
    x_test, y_test = data["test"]
    accuracy = (mx.argmax(model(mx.array(x_test)), axis=1) == mx.array(y_test)).mean().item()
    assert accuracy >= 0.9


def test_build_model_sizes_from_info():
    assert available_models() == ["cnn", "mlp", "transformer"]
    mlp = build_model("mlp", DIGITS_INFO)
    assert mlp.layers[0].weight.shape == (256, 64)  # the registry's tuned default
    assert build_model("mlp", DIGITS_INFO, hidden_dims=[32]).layers[0].weight.shape == (32, 64)
    cnn = build_model("cnn", DIGITS_INFO, channels=[4])
    assert cnn(mx.zeros((2, 64))).shape == (2, 10)
    lm = build_model("transformer", TEXT_INFO, num_layers=1, dims=32)
    assert lm.block_size == 16 and len(lm.layers) == 1
    assert lm(mx.zeros((1, 16), dtype=mx.int32)).shape == (1, 16, 50)


def test_unknown_model_suggests_closest():
    with pytest.raises(ConfigError,
                       match=r"unknown model 'mpl' \(did you mean 'mlp'\?\); built-in models: cnn, mlp, transformer"):
        build_model("mpl", DIGITS_INFO)


def test_unknown_option_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown option 'hiden_dims' for model 'mlp' "
                                          r"\(did you mean 'hidden_dims'\?\); valid options: dropout, hidden_dims"):
        build_model("mlp", DIGITS_INFO, hiden_dims=[64])


def test_option_of_wrong_type():
    with pytest.raises(ConfigError, match=r"option 'hidden_dims' of model 'mlp' must be a list of integers.*got 'big'"):
        build_model("mlp", DIGITS_INFO, hidden_dims="big")
    with pytest.raises(ConfigError, match=r"option 'num_layers' of model 'transformer' must be an integer, got 2.5"):
        build_model("transformer", TEXT_INFO, num_layers=2.5)
    with pytest.raises(ConfigError, match=r"dims \(30\) must be a multiple of num_heads \(4\)"):
        build_model("transformer", TEXT_INFO, dims=30)
    with pytest.raises(ConfigError, match=r"dropout must be in \[0, 1\), got 1.5"):
        build_model("mlp", DIGITS_INFO, dropout=1.5)


def test_options_that_come_from_the_dataset_are_refused():
    with pytest.raises(ConfigError, match=r"option 'block_size' of model 'transformer' is set from the dataset "
                                          r"\(16 here\).*dataset_options"):
        build_model("transformer", TEXT_INFO, block_size=32)


def test_model_for_the_wrong_task():
    with pytest.raises(ConfigError, match=r"model 'transformer' is for language_modeling and needs vocab_size, "
                                          r"block_size.*'classification'.*models for this dataset: cnn, mlp"):
        build_model("transformer", DIGITS_INFO)
    with pytest.raises(ConfigError, match=r"model 'mlp' is for classification.*models for this dataset: transformer"):
        build_model("mlp", TEXT_INFO)
