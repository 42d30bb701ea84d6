"""Tensor-parallel ranks load only their shard of an mlx-lm base: 2 ranks launched for real on 127.0.0.1 load a
llama directory lazily, split it and evaluate it, and each peaks below the whole model's weight bytes (loaded
eagerly, each holds the whole model first). The losses of a lazily loaded split run are checked against one
process in tests/test_finetune_tensor_parallel.py (the finetune path loads lazily)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
RANK = os.path.join(os.path.dirname(__file__), "scripts", "tp_load_peak.py")


def _write_base(directory: str) -> int:
    """A llama whose weights dominate (8 MB of matrices, none over 1 MB); returns its weight bytes."""
    from mlx_lm.models.llama import Model, ModelArgs

    from mlx_train.llm.models import save_model

    tokenizer = llm_tiny.make_tokenizer()
    config = llm_tiny.model_config(len(tokenizer._tokenizer), layers=4)
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(model, tokenizer, config, directory)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _peaks(base: str, mode: str, out: str) -> list[dict]:
    os.makedirs(out)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")]))
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    done = subprocess.run([launcher, "-n", "2", "--", sys.executable, RANK, base, mode, out], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"rank-{rank}.json"))) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_of_a_lazy_split_load_peaks_below_the_whole_model(tmp_path):
    whole = _write_base(str(tmp_path / "base"))
    lazy = _peaks(str(tmp_path / "base"), "lazy", str(tmp_path / "lazy"))
    eager = _peaks(str(tmp_path / "base"), "eager", str(tmp_path / "eager"))
    for rank in lazy + eager:
        assert rank["size"] == 2 and rank["held"] < 0.6 * whole  # each keeps about half
    for rank in lazy:
        assert rank["peak"] < 0.75 * whole, (rank, whole)  # its half, one whole tensor, the adapters
    for rank in eager:
        assert rank["peak"] >= whole, (rank, whole)  # the whole model, then its split


class _Group:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("model,rank,said", [("base.gguf", 0, True), ("base.gguf", 1, False), ("base", 0, False)])
def test_a_gguf_base_is_said_to_load_whole_on_every_rank(monkeypatch, capsys, model, rank, said):
    from mlx_train.cli.finetune import tensor_parallel_split
    from mlx_train.config import FinetuneConfig
    from mlx_train.distributed import topology

    monkeypatch.setattr(topology, "init_group", lambda backend: _Group(rank))
    split = tensor_parallel_split(FinetuneConfig(model=model, distributed_strategy="tensor_parallel"))
    assert split is not None and split.group.rank() == rank
    out = capsys.readouterr().out
    assert ("a GGUF base is dequantized as it loads, so every rank loads it whole" in out) is said
