"""`mlx-train finetune --distributed --strategy tensor_parallel`: 2 ranks launched for real on 127.0.0.1
fine-tune a tiny mlx-lm llama with the same per-step losses as one process, and write whole adapters that
mlx_lm.load reads; what a split model cannot do is refused before the ranks start. Also `--pack KIND`."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mlx_train.cli.main import build_parser, main  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fttp")
    llm_tiny.write_model_dir(str(root / "base"), seed=5)
    llm_tiny.write_data(str(root / "data"), "completion", n_train=12, n_valid=4)
    return root


def _finetune(setup, run, *extra):
    return ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--num-layers", "2",
            "--run-dir", str(run), *extra]


def _losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if row["kind"] == "train"]


# -- one process ------------------------------------------------------------------------------


def test_finetune_takes_trains_strategy_flag(capsys):
    def strategy_action(command):
        parser = build_parser(command)._subcommands[command]
        return next(a for a in parser._actions if "--strategy" in a.option_strings)

    ours, trains = strategy_action("finetune"), strategy_action("train")
    assert (ours.choices, ours.help, ours.dest) == (trains.choices, trains.help, trains.dest)
    assert main(["finetune", "--model", "b", "--data", "d", "--strategy", "tensor_parallel"]) == 2
    assert "--strategy tensor_parallel only applies to a distributed run: add --distributed" in capsys.readouterr().err


@pytest.mark.parametrize("flags,refused", [
    (["--fuse", "out"], "--fuse cannot go with --distributed"),
    (["--resume-adapter-file", "old"], "--resume-adapter-file cannot go with --strategy tensor_parallel"),
    (["--train-mode", "dpo"], "the DPO reference is the model with its adapters off, which a split model cannot do"),
])
def test_what_a_split_model_cannot_do_is_refused_before_launching(setup, tmp_path, capsys, monkeypatch, flags,
                                                                   refused):
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    code = main(_finetune(setup, tmp_path / "run", "--distributed", "-n", "2", "--strategy", "tensor_parallel",
                          *flags))
    err = capsys.readouterr().err
    assert code == 2 and refused in err and "Traceback" not in err
    assert not (tmp_path / "run" / "distributed").exists()  # no rank was started


@pytest.mark.parametrize("processes,why,fits", [
    (4, "its 3 key/value heads cannot go to 4 processes: each needs one", "launch -n 2,"),
    (3, "its MLP's 64 hidden units do not divide by 3", "launch -n 2,"),
])
def test_a_number_of_processes_the_heads_cannot_split_over_is_refused_before_launching(
        tmp_path, capsys, monkeypatch, processes, why, fits):
    """9 attention heads in 3 key/value groups and an MLP of 64: 2 ranks split it (by whole groups), 3 or 4 cannot;
    config.json says so before any rank loads the model."""
    import tp_uneven_run

    from mlx_train.llm.models import save_model

    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    tokenizer = llm_tiny.make_tokenizer()
    model, config = tp_uneven_run.make_model(len(tokenizer._tokenizer))
    save_model(model, tokenizer, config, str(tmp_path / "base"))
    llm_tiny.write_data(str(tmp_path / "data"), "completion", n_train=4, n_valid=2)
    code = main(["finetune", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--run-dir",
                 str(tmp_path / "run"), "--distributed", "-n", str(processes), "--strategy", "tensor_parallel"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"-n {processes} cannot split {tmp_path / 'base'} by tensor parallelism: {why} ({tmp_path / 'base'}/" \
           "config.json: num_attention_heads 9, num_key_value_heads 3, intermediate_size 64); " + fits in err, err
    assert "Nothing was launched" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "distributed").exists()  # no rank was started


def test_dpo_with_a_reference_model_or_reference_free_is_not_refused():
    from mlx_train.config import FinetuneConfig
    from mlx_train.llm.finetune import check_tensor_parallel

    split = {"distributed_strategy": "tensor_parallel", "train_mode": "dpo"}
    check_tensor_parallel(FinetuneConfig(**split, reference_free=True))
    check_tensor_parallel(FinetuneConfig(**split, reference_model_path="base"))
    check_tensor_parallel(FinetuneConfig(train_mode="dpo"))  # data parallel: the adapters can be switched off


class _Split(nn.Module):
    """A layer that declares its weight split on axis 0 (as the sharded adapters do)."""

    sharded_axes = {"weight": 0}

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = mx.zeros((rows, 3))
        self.norm = mx.zeros((3,))


class _Two:
    def size(self):
        return 2

    def rank(self):
        return 0


def test_checkpoint_adapters_join_rank_0_s_slices_with_the_other_ranks_files(tmp_path):
    """At a checkpoint only rank 0 runs the callbacks: it joins its slices with those rank 1 wrote beside it."""
    from mlx_train.distributed.tensor import write_shard
    from mlx_train.llm.tensor_parallel import TensorParallelAdapters

    model = _Split(2)
    model.weight, model.norm = mx.arange(6, dtype=mx.float32).reshape(2, 3), mx.ones((3,))
    write_shard(str(tmp_path), 4, 1, {"weight": mx.full((2, 3), 9.0), "norm": mx.ones((3,))}, {})
    whole = TensorParallelAdapters(_Two()).whole_at_checkpoint(model, str(tmp_path / "step-00000004"), 4)
    assert whole["weight"].tolist() == [[0, 1, 2], [3, 4, 5], [9, 9, 9], [9, 9, 9]]
    assert whole["norm"].tolist() == [1, 1, 1]  # replicated: rank 0's


@pytest.mark.parametrize("flags,packing", [([], None), (["--pack"], "best_fit"), (["--pack", "best_fit"], "best_fit"),
                                           (["--pack", "by_length"], "by_length"), (["--set", "pack=false"], None)])
def test_pack_kind_reaches_the_training_set(setup, flags, packing):
    from mlx_train.cli.finetune import resolve_config
    from mlx_train.llm.finetune import prepare

    args = build_parser("finetune").parse_args(_finetune(setup, setup / "unused", "--max-seq-length", "64", *flags))
    splits = prepare(resolve_config(args, log=lambda m: None), log=lambda m: None)["splits"]
    assert splits["train"].packing == packing
    assert splits["valid"].packing is None  # validation rows are never packed


def test_a_pack_kind_that_does_not_exist_is_one_line(capsys):
    assert main(["finetune", "--model", "b", "--data", "d", "--pack", "bylength"]) == 2
    err = capsys.readouterr().err
    assert "pack must be true, false or one of best_fit, by_length, got 'bylength' (did you mean 'by_length'?)" in err


# -- two ranks --------------------------------------------------------------------------------


def _logits(base, adapters):
    from mlx_lm import load

    model, _ = load(str(base), adapter_path=str(adapters))
    return np.array(model(mx.array([[1, 5, 9, 12, 7, 3]])))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_tensor_parallel_ranks_finetune_like_one_process(setup, tmp_path, capsys, monkeypatch):
    """2 ranks each hold half of every split layer and train on the whole batch (packed): the per-step losses and
    the gathered adapters are one process's; mlx_lm.load reads the adapters."""
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")]))
    common = ["--iters", "4", "--lr", "1e-3", "--steps-per-report", "1", "--batch-size", "2", "--save-every", "2",
              "--set", "num_workers=0", "--val-batches", "1", "--pack", "--max-seq-length", "160"]
    code = main(_finetune(setup, tmp_path / "two", "--distributed", "-n", "2", "--strategy", "tensor_parallel",
                          "--max-restarts", "0", *common))
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert "tensor parallel over 2 processes" in out.out and "global batch 2" in out.out
    assert main(_finetune(setup, tmp_path / "one", *common)) == 0
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert [s for s, _ in two] == [s for s, _ in one] == [1, 2, 3, 4]
    assert np.allclose([loss for _, loss in two], [loss for _, loss in one], rtol=0, atol=1e-5)
    mine, theirs = (mx.load(str(tmp_path / run / "adapters" / "adapters.safetensors")) for run in ("one", "two"))
    assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 7 * 2  # 2 blocks x 7 layers x (a, b), whole
    for key in mine:
        assert mine[key].shape == theirs[key].shape, key
        assert np.allclose(np.array(mine[key]), np.array(theirs[key]), rtol=0, atol=2e-5), key
    config = json.loads((tmp_path / "two" / "adapters" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["pack"] is True
    two_logits, one_logits = _logits(setup / "base", tmp_path / "two" / "adapters"), \
        _logits(setup / "base", tmp_path / "one" / "adapters")
    assert np.allclose(two_logits, one_logits, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_finetune_resumes_like_one_process(setup, tmp_path, capsys, monkeypatch):
    """Stopped after 4 steps and resumed to 6 with --resume on 2 ranks: the losses and adapters of one process's
    6 steps (each rank restores its slices from the checkpoint)."""
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")]))
    common = ["--lr", "1e-3", "--steps-per-report", "1", "--batch-size", "2", "--save-every", "2", "--set",
              "num_workers=0", "--val-batches", "1"]
    split = ["--distributed", "-n", "2", "--strategy", "tensor_parallel", "--max-restarts", "0"]
    assert main(_finetune(setup, tmp_path / "two", "--iters", "4", *split, *common)) == 0
    code = main(["finetune", "--run-dir", str(tmp_path / "two"), "--resume", "--max-steps", "6", *split])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert main(_finetune(setup, tmp_path / "one", "--iters", "6", *common)) == 0
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert [s for s, _ in two] == [s for s, _ in one] == [1, 2, 3, 4, 5, 6]
    assert np.allclose([loss for _, loss in two], [loss for _, loss in one], rtol=0, atol=1e-5)
    mine, theirs = (mx.load(str(tmp_path / run / "adapters" / "adapters.safetensors")) for run in ("one", "two"))
    assert all(np.allclose(np.array(mine[k]), np.array(theirs[k]), rtol=0, atol=2e-5) for k in mine)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_finetune_resumes_on_one_plain_process_as_on_one_rank(setup, tmp_path, monkeypatch):
    """A checkpoint of 2 tensor-parallel ranks resumed by a plain `finetune --resume` (no --distributed): the
    slices are joined into one model's adapters and optimizer state, exactly as `--distributed -n 1` joins them."""
    import shutil
    import subprocess

    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")]))
    common = ["--lr", "1e-3", "--steps-per-report", "1", "--batch-size", "2", "--save-every", "2", "--set",
              "num_workers=0", "--val-batches", "1"]
    assert main(_finetune(setup, tmp_path / "plain", "--iters", "4", "--distributed", "-n", "2", "--strategy",
                          "tensor_parallel", "--max-restarts", "0", *common)) == 0
    shutil.copytree(tmp_path / "plain", tmp_path / "rank")
    # A process of its own, as the rank is (this one's BLAS may use other threads: other float rounding).
    plain = subprocess.run([sys.executable, "-m", "mlx_train", "finetune", "--run-dir", str(tmp_path / "plain"),
                            "--resume", "--max-steps", "6"], capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "differently sized" not in plain.stderr
    assert f"resumed from {tmp_path / 'plain' / 'checkpoints' / 'step-00000004'} (step 4" in plain.stdout, plain.stdout
    assert main(["finetune", "--run-dir", str(tmp_path / "rank"), "--resume", "--max-steps", "6", "--distributed",
                 "-n", "1", "--max-restarts", "0"]) == 0
    assert _losses(tmp_path / "plain") == _losses(tmp_path / "rank")  # steps 5 and 6 too, bit for bit
    for name in ("adapters/adapters.safetensors", "checkpoints/step-00000006/optimizer.safetensors"):
        plain, rank = (mx.load(str(tmp_path / run / name)) for run in ("plain", "rank"))
        assert sorted(plain) == sorted(rank), name
        assert all(np.array_equal(np.array(plain[k]), np.array(rank[k])) for k in plain), name
