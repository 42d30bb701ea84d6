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
from mlx_train.distributed import tensor
from mlx_train.distributed.backends import check_strategy
from mlx_train.errors import CheckpointError, ConfigError
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


def test_strategy_flag_needs_distributed_and_names_the_choices(tmp_path, capsys):
    from mlx_train.cli.main import main

    assert main(["train", "--strategy", "tensor_parallel", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--strategy tensor_parallel only applies to a distributed run: add --distributed" in \
        capsys.readouterr().err
    assert main(["train", "--distributed", "--strategy", "tensor"]) == 2
    assert "invalid choice: 'tensor' (choose from 'data_parallel', 'tensor_parallel', 'fsdp')" in \
        capsys.readouterr().err


def test_strategy_is_a_key_of_the_yaml_distributed_section(tmp_path):
    from mlx_train.config import TrainConfig
    from mlx_train.distributed.config import DistributedConfig

    path = tmp_path / "run.yaml"
    path.write_text("distributed:\n  strategy: tensor_parallel\n")
    assert TrainConfig.from_yaml(str(path)).distributed_strategy == "tensor_parallel"
    config = DistributedConfig(num_devices=2, batch_size_per_device=8, strategy="tensor_parallel")
    assert config.global_batch_size == 8  # the ranks share each batch
    assert config.describe() == "tensor parallel over 2: batch 8 x accumulation 1 = global batch 8; backend auto"
    assert config.train_overrides()["distributed_strategy"] == "tensor_parallel"


def test_a_model_without_shard_is_refused_with_the_protocol():
    with pytest.raises(ConfigError, match=r"MLP has no shard\(group\) method.*shard_linear"):
        tensor.shard_model(MLP(8, (16,), 4), _Pair())


def test_heads_that_do_not_split_over_the_ranks_are_refused_before_sharding():
    sys.path.insert(0, SCRIPTS)
    import llm_tiny

    model, _ = llm_tiny.make_model(96)  # 4 heads, 2 KV heads

    class Four(_Pair):
        def size(self):
            return 4

    with pytest.raises(ConfigError, match=r"model\.layers\.\d\.self_attn cannot be split over 4 processes: its 2 "
                                          r"key/value heads cannot go to 4 processes: each needs one; this attention "
                                          r"splits over 2 processes: launch that many"):
        tensor.shard_model(model, Four())
    assert not tensor.is_sharded(model)


def test_the_split_rule_names_the_numbers_of_processes_that_work():
    from mlx_train.distributed.tensor.layers import describe_counts, process_counts, split_problem

    assert split_problem(4, 9, 3) == "its 3 key/value heads cannot go to 4 processes: each needs one"
    assert split_problem(2, 9, 3) is None  # by whole key/value groups: 2 + 1
    assert split_problem(2, 9, 3, uneven=False).startswith("its 9 attention heads in 3 key/value groups do not divide")
    assert split_problem(3, 9, 3, [64]) == "its MLP's 64 hidden units do not divide by 3"
    assert process_counts(8, 9, 3) == [2, 3] and process_counts(8, 9, 3, [64]) == [2]
    assert process_counts(32, 32, 8, [11008]) == [2, 4, 8]
    assert process_counts(8, 4, 2, uneven=False) == [2] and process_counts(8, 1, 1) == []
    assert (describe_counts([2]), describe_counts([2, 4, 8]), describe_counts([])) == ("2", "2, 4 or 8", "")


def test_the_layout_names_every_split_parameter_and_its_axis():
    model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=1, block_size=8)
    group = mx.distributed.init()
    tensor.shard_model(model, group)  # a group of one: nothing to split
    assert tensor.shard_layout(model) == {}
    model.shard(group)  # the protocol itself splits even over one process
    layout = tensor.shard_layout(model)
    assert layout["layers.0.attention.query_proj.weight"] == 0
    assert layout["layers.0.attention.query_proj.bias"] == 0
    assert layout["layers.0.attention.out_proj.weight"] == 1
    assert "layers.0.attention.out_proj.bias" not in layout  # added after the sum: replicated
    assert layout["layers.0.mlp.layers.2.weight"] == 1
    assert not any(k.startswith(("token_embedding", "norm", "head")) for k in layout)


def test_take_shard_splits_on_the_recorded_axis():
    full = {"w": mx.arange(24).reshape(4, 6), "b": mx.arange(3)}
    mine = tensor.take_shard(full, {"w": 1}, rank=1, size=2)
    assert mine["w"].tolist() == full["w"][:, 3:].tolist()
    assert mine["b"] is full["b"]
    with pytest.raises(ConfigError, match="w has 6 entries on axis 1, which do not split into 4 equal slices"):
        tensor.take_shard(full, {"w": 1}, rank=0, size=4)


def test_reshard_joins_the_slices_of_two_ranks_and_cuts_a_whole_checkpoint(tmp_path):
    whole = {"model": {"w": mx.arange(8.0).reshape(2, 4), "b": mx.ones(3)},
             "optimizer": {"w.m": mx.arange(8.0).reshape(2, 4) * 10, "b.m": mx.zeros(3), "step": mx.array(5)},
             "trainer": {"scale": mx.array(1.0)}}
    layout = {"w": 1}
    mine = [tensor.take_shard(whole[g], tensor.optimizer_layout(whole[g], layout)
                                       if g == "optimizer" else layout, 0, 2) for g in ("model", "optimizer")]
    rank1 = [tensor.take_shard(whole[g], tensor.optimizer_layout(whole[g], layout)
                                        if g == "optimizer" else layout, 1, 2) for g in ("model", "optimizer")]
    directory = tmp_path / "ckpt"
    tensor.write_shard(str(directory), 4, 1, *rank1)
    checkpoint = str(directory / "step-00000004")
    saved = {"step": 4, "tensor_parallel": {"world_size": 2, "layout": layout}}
    rank0_arrays = {"model": mine[0], "optimizer": mine[1], "trainer": whole["trainer"]}
    # the same two ranks: each its own slices, the other groups from rank 0's checkpoint
    again = tensor.reshard(checkpoint, rank0_arrays, saved, layout, rank=1, size=2)
    assert again["model"]["w"].tolist() == [[2.0, 3.0], [6.0, 7.0]] and "trainer" in again
    # one process: the slices joined
    joined = tensor.reshard(checkpoint, rank0_arrays, saved, {}, rank=0, size=1)
    for group in ("model", "optimizer"):
        assert all(mx.array_equal(joined[group][k], v) for k, v in whole[group].items()), group
    # a whole checkpoint (no record) cut for rank 1 of 2
    cut = tensor.reshard(checkpoint, whole, {"step": 4}, layout, rank=1, size=2)
    assert cut["optimizer"]["w.m"].tolist() == [[20.0, 30.0], [60.0, 70.0]]
    with pytest.raises(CheckpointError, match="rank 2's slices .* are missing"):
        tensor.reshard(checkpoint, rank0_arrays, {**saved, "tensor_parallel": {"world_size": 3,
                                                                                         "layout": layout}},
                                {}, rank=0, size=1)


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
@pytest.mark.parametrize("mode,extra", [("lora", ["--max-grad-norm", "0.05"]), ("dora", ["--accumulation", "2"]),
                                        ("full", [])])
def test_two_tensor_parallel_ranks_train_like_one_process(tmp_path, mode, extra):
    one, one_trained = _train(tmp_path / "one", mode, *extra)
    two, two_trained = _train(tmp_path / "two", mode, *extra, ranks=2)
    assert len(one["loss"]) == len(two["loss"]) == 20
    assert np.allclose(one["loss"], two["loss"], rtol=0, atol=2e-5), (one["loss"], two["loss"])
    if "--max-grad-norm" in extra:  # clipping: the norm over the ranks' slices is the whole gradient's
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


def _logits_with_adapters(tmp_path, adapters):
    """The tiny llama loaded by ``mlx_lm.load`` with ``adapters``: its logits on fixed tokens."""
    sys.path.insert(0, SCRIPTS)
    import llm_tiny
    from mlx_lm import load

    from mlx_train.llm.models import save_model

    base = tmp_path / "base"
    if not base.exists():
        model, config = llm_tiny.make_model(96, seed=0)
        save_model(model, llm_tiny.make_tokenizer(), config, str(base))
    model, _ = load(str(base), adapter_path=None if adapters is None else str(adapters))
    tokens = mx.array(np.random.default_rng(1).integers(0, 96, size=(2, 12)))
    return np.array(model(tokens))


@pytest.mark.slow
@pytest.mark.distributed
def test_gathered_adapters_load_with_mlx_lm_like_one_process_s(tmp_path):
    _train(tmp_path / "one", "lora")
    _train(tmp_path / "two", "lora", ranks=2)
    config = json.loads((tmp_path / "two" / "adapters" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 4
    one = _logits_with_adapters(tmp_path, tmp_path / "one" / "adapters")
    two = _logits_with_adapters(tmp_path, tmp_path / "two" / "adapters")
    assert np.allclose(one, two, atol=1e-4)
    assert not np.allclose(one, _logits_with_adapters(tmp_path, None), atol=1e-3)  # the adapters count


def _supervised(run_dir, *extra):
    from mlx_train.launch.supervisor import RecoveryPolicy, supervise

    run_dir.mkdir(parents=True)
    command = [sys.executable, os.path.join(SCRIPTS, "tp_run.py"), str(run_dir), "lora", "--checkpoint-dir",
               str(run_dir / "ckpt"), *extra]
    with open(run_dir / "output.txt", "w") as out:
        return supervise(command, num_processes=2, run_dir=run_dir, checkpoint_dir=str(run_dir / "ckpt"),
                         policy=RecoveryPolicy.from_collective_timeout(2, 60), output=(out, out))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_tensor_parallel_rank_resumes_bit_for_bit_and_the_checkpoint_reshards(tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    clean = _supervised(tmp_path / "clean")
    killed = _supervised(tmp_path / "killed", "--kill-rank", "1", "--kill-step", "12")
    assert clean.restarts == [] and [r.cause for r in killed.restarts] == ["rank 1 was killed by SIGKILL"]
    assert killed.restarts[0].resume_from == str(tmp_path / "killed" / "ckpt" / "step-00000010")
    losses = json.loads((tmp_path / "clean" / "losses.json").read_text())["loss"]
    assert json.loads((tmp_path / "killed" / "losses.json").read_text())["loss"] == losses[10:]  # steps 11..20
    a, b = mx.load(str(tmp_path / "clean" / "trained.safetensors")), mx.load(str(tmp_path / "killed" /
                                                                               "trained.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    # the checkpoint: rank 0's slices and the layout in step-N, rank 1's beside it
    checkpoint = tmp_path / "clean" / "ckpt" / "step-00000015"
    record = json.loads((checkpoint / "trainer_state.json").read_text())["tensor_parallel"]
    assert record["world_size"] == 2 and record["layout"]["model.layers.0.self_attn.q_proj.lora_b"] == 1
    shard = mx.load(str(tmp_path / "clean" / "ckpt" / "tp-shards" / "step-00000015" / "rank-1.safetensors"))
    assert shard["model.model.layers.0.self_attn.q_proj.lora_b"].shape == (4, 16)
    # ... resumed by one process (its slices joined): the run goes on as the two ranks did
    one = tmp_path / "one"
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "tp_run.py"), str(one), "lora", "--resume",
                    str(checkpoint)], check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    assert np.allclose(json.loads((one / "losses.json").read_text())["loss"], losses[15:], rtol=0, atol=1e-5)
    resumed = mx.load(str(one / "trained.safetensors"))
    assert all(float(mx.abs(resumed[k] - a[k]).max()) < 1e-5 for k in a)


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
