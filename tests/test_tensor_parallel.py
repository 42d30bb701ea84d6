"""Tensor parallelism on MLX's sharded layers: 2 ranks launched for real on 127.0.0.1 (ring backend) train
a tiny mlx-lm llama (LoRA, DoRA, full) and the built-in transformer (through the CLI) with the same
per-step losses and, gathered, the same trained parameters as one process; plus single-process checks
of the sharding protocol, the layout and the sharded adapters."""

import json
import os
import shutil
import subprocess
import sys

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.builtin.models import MLP, CharTransformerLM
from mlx_train.distributed import tensor_parallel
from mlx_train.distributed.backends import check_strategy
from mlx_train.errors import ConfigError
from mlx_train.training.state import rng_key, set_rng_key

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(SCRIPTS), "..", "src"),
                                      os.environ.get("PYTHONPATH", "")])}


def _launcher():
    path = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    assert os.path.exists(path), "mlx.launch (installed with mlx) was not found"
    return path


class _Pair:
    """A stand-in group of 2 for the checks that run before any collective."""

    def size(self):
        return 2

    def rank(self):
        return 0


# -- one process ------------------------------------------------------------------------------


def test_the_tensor_parallel_strategy_is_accepted_on_ring():
    check_strategy("tensor_parallel", "ring", 2)
    with pytest.raises(ConfigError, match="strategy 'fsdp' cannot run on the ring backend"):
        check_strategy("fsdp", "ring", 2)


def test_a_model_without_shard_is_refused_with_the_protocol():
    with pytest.raises(ConfigError, match=r"MLP has no shard\(group\) method.*shard_linear"):
        tensor_parallel.shard_model(MLP(8, (16,), 4), _Pair())


def test_the_layout_names_every_split_parameter_and_its_axis():
    model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=1, block_size=8)
    group = mx.distributed.init()
    tensor_parallel.shard_model(model, group)  # a group of one: nothing to split
    assert tensor_parallel.shard_layout(model) == {}
    model.shard(group)  # the protocol itself splits even over one process
    layout = tensor_parallel.shard_layout(model)
    assert layout["layers.0.attention.query_proj.weight"] == 0
    assert layout["layers.0.attention.query_proj.bias"] == 0
    assert layout["layers.0.attention.out_proj.weight"] == 1
    assert "layers.0.attention.out_proj.bias" not in layout  # added after the sum: replicated
    assert layout["layers.0.mlp.layers.2.weight"] == 1
    assert not any(k.startswith(("token_embedding", "norm", "head")) for k in layout)


def test_take_shard_splits_on_the_recorded_axis():
    full = {"w": mx.arange(24).reshape(4, 6), "b": mx.arange(3)}
    mine = tensor_parallel.take_shard(full, {"w": 1}, rank=1, size=2)
    assert mine["w"].tolist() == full["w"][:, 3:].tolist()
    assert mine["b"] is full["b"]
    with pytest.raises(ConfigError, match="w has 6 entries on axis 1, which do not split into 4 equal slices"):
        tensor_parallel.take_shard(full, {"w": 1}, rank=0, size=4)


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_sharded_adapters_over_one_process_equal_mlx_lm_s(fine_tune_type):
    """The sharded LoRA/DoRA layers compute what mlx-lm's do, with the same random initial factors."""
    from mlx_train.llm.adapters import AdapterConfig, apply_adapters

    spec = AdapterConfig(fine_tune_type, num_layers=1, rank=4, scale=2.0)
    outputs, grads = [], []
    for split in (False, True):
        mx.random.seed(3)
        model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=1, block_size=8)
        if split:
            key = rng_key()
            model.shard(mx.distributed.init())  # (its new layers draw weights that it then replaces)
            set_rng_key(key)
        apply_adapters(model, spec)
        lora_b = {k: mx.random.normal(v.shape) for k, v in tree_flatten(model.trainable_parameters())
                  if k.endswith("lora_b")}  # non-zero B: the low-rank path counts
        model.load_weights(list(lora_b.items()), strict=False)
        tokens = mx.array(np.random.default_rng(0).integers(0, 20, size=(2, 8)))

        def loss(params, m=model, tokens=tokens):
            m.update(params)
            return nn.losses.cross_entropy(m(tokens), tokens).mean()

        value, grad = mx.value_and_grad(loss)(model.trainable_parameters())
        outputs.append(value)
        grads.append(dict(tree_flatten(grad)))
    assert abs(outputs[0].item() - outputs[1].item()) < 1e-5
    assert sorted(grads[0]) == sorted(grads[1])
    for key in grads[0]:
        assert np.allclose(np.array(grads[0][key]), np.array(grads[1][key]), atol=1e-5), key


# -- two processes ----------------------------------------------------------------------------


def _train(out, mode, *extra, ranks=1):
    command = [sys.executable, os.path.join(SCRIPTS, "tp_run.py"), str(out), mode, *extra]
    if ranks > 1:
        command = [_launcher(), "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    with open(out / "losses.json") as f:
        return json.load(f), mx.load(str(out / "trained.safetensors"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode,extra", [("lora", ["0.05"]), ("dora", []), ("full", [])])
def test_two_tensor_parallel_ranks_train_like_one_process(tmp_path, mode, extra):
    one, one_trained = _train(tmp_path / "one", mode, *extra)
    two, two_trained = _train(tmp_path / "two", mode, *extra, ranks=2)
    assert len(one["loss"]) == len(two["loss"]) == 20
    assert np.allclose(one["loss"], two["loss"], rtol=0, atol=2e-5), (one["loss"], two["loss"])
    if extra:  # clipping: the norm over the ranks' slices is the whole gradient's
        assert np.allclose(one["grad_norm"], two["grad_norm"], rtol=1e-4)
    assert sorted(one_trained) == sorted(two_trained)  # gathered: the names and shapes of one process
    for key, value in one_trained.items():
        theirs = two_trained[key]
        assert value.shape == theirs.shape, key
        scale = float(mx.abs(value).max()) or 1.0
        assert float(mx.abs(value - theirs).max()) / scale < 2e-3, key
    ranks = [json.loads((tmp_path / "two" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["differing"] == []  # the replicated parameters agree bit for bit
        for key, axis in rank["layout"].items():  # each rank trains its half of every split parameter
            if key in rank["shapes"]:
                assert rank["shapes"][key][axis] * 2 == list(one_trained[key].shape)[axis], key
                moments = [k for k in rank["optimizer_shapes"] if k.startswith(key + ".")]  # Adam's m and v
                assert moments and all(rank["optimizer_shapes"][k] == rank["shapes"][key] for k in moments), key
    assert any(key in ranks[0]["shapes"] for key in ranks[0]["layout"])


def _cli_losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and "step" in row and "val_loss" not in row]


@pytest.mark.slow
@pytest.mark.distributed
def test_train_cli_strategy_tensor_parallel_equals_one_process(tmp_path):
    common = ["--model", "transformer", "--dataset", "text", "--max-steps", "6", "--set", "report_every=1 steps",
              "--set", "model_options.dims=64"]
    cli = [sys.executable, "-m", "mlx_train", "train"]
    subprocess.run([*cli, *common, "--run-dir", str(tmp_path / "one")], check=True, env=ENV, timeout=300,
                   capture_output=True)
    two = subprocess.run([*cli, *common, "--run-dir", str(tmp_path / "two"), "--distributed", "-n", "2",
                          "--strategy", "tensor_parallel"], env=ENV, timeout=300, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "tensor parallel over 2 processes" in two.stdout
    one_losses, two_losses = _cli_losses(tmp_path / "one"), _cli_losses(tmp_path / "two")
    assert len(one_losses) == 6
    assert np.allclose(one_losses, two_losses, rtol=0, atol=1e-5)
