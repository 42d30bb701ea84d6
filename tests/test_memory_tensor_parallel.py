"""The memory planner for a tensor-parallel split: what a model's shard() splits (found without launching
anything), per-rank weights, gradients and optimizer state that divide by the ranks while the replicated
parameters do not, and how many ranks a model needs to fit a budget."""

from __future__ import annotations

import os
import sys

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_train.builtin.models import MLP, CharTransformerLM
from mlx_train.cli.main import main
from mlx_train.cli.optimize import measure_split
from mlx_train.errors import ConfigError
from mlx_train.memory import MemoryModel, MemoryOptimizer, for_strategy, plan_memory
from mlx_train.memory.model import Curve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))


def _transformer(dims=256, heads=8, layers=4):
    mx.random.seed(0)
    model = CharTransformerLM(vocab_size=64, dims=dims, num_heads=heads, num_layers=layers, block_size=32)
    mx.eval(model.parameters())
    return model


def test_the_split_of_a_tiny_llama_is_its_attention_and_mlp_matrices_and_its_vocabulary():
    pytest.importorskip("mlx_lm")
    import llm_tiny

    model, config = llm_tiny.make_model(96, seed=0)  # hidden 32, 4 heads (2 kv heads), MLP 64, 2 blocks, tied
    before = {k: v.shape for k, v in tree_flatten(model.parameters())}
    split = measure_split(model)
    hidden, mlp, kv = 32, 64, 32 * 2 // 4
    per_block = 2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * mlp  # q, o; k, v; gate, up, down
    embedding = 96 * hidden  # split by vocabulary rows
    assert split.parameters == split.trainable == 2 * per_block + embedding
    assert split.parameter_bytes == 4 * split.parameters
    assert split.ranks == (2,)  # 2 key/value heads: not over 4
    whole = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert whole - split.parameters == (2 * 2 + 1) * hidden  # the norms stay whole
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == before  # the model is left whole
    assert measure_split(MLP(8, [16], 4)) is None  # no shard(): nothing known to split


def test_per_rank_weights_gradients_and_state_divide_by_the_ranks_and_replicated_ones_do_not():
    model = _transformer()
    split = measure_split(model)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    replicated = params - split.parameters
    assert split.parameters > 0.9 * params and split.ranks == (2, 4, 8)  # weights in the blocks dominate
    state = 2 * 4 * params  # adamw: two float32 moments
    whole = MemoryModel(params, "float32", "adamw", state,
                        {False: Curve(4 * params * 4 + 1e6, 2e5, 4 * params * 6)}, split=split)
    totals = []
    for ranks in (1, 2, 4, 8):
        peak = whole.over_ranks(ranks).estimate(batch_size=4)
        mine = replicated + split.parameters / ranks
        assert peak.parameters == pytest.approx(4 * mine, abs=2)
        assert peak.gradients == pytest.approx(4 * mine, abs=2)
        assert peak.optimizer_state == pytest.approx(8 * mine, abs=2)
        totals.append(peak.total)
    assert totals == sorted(totals, reverse=True) and totals[-1] < 0.3 * totals[0]
    with pytest.raises(ConfigError, match="does not split over 16 ranks"):
        whole.over_ranks(16)


def test_a_plan_says_how_many_ranks_fit_and_plans_per_rank():
    model = MemoryModel.analytic(1e9, "bfloat16", "adamw", 512)
    one = model.estimate(1, 1, True).total
    memory = int(0.75 * one / 0.9)  # the budget holds 3/4 of a whole-model step
    plan = plan_memory(model, 1, device_memory=memory, target_batch_size=1)
    assert not plan.fits and plan.ranks_needed == 2
    assert "needs 2 ranks of tensor parallelism to fit in" in str(plan)
    split, devices = for_strategy(model, 2, "tensor_parallel")
    assert devices == 1  # every rank trains on the whole batch
    per_rank = plan_memory(split, devices, device_memory=memory, target_batch_size=1)
    assert per_rank.fits and "on 2 tensor-parallel ranks" in str(per_rank)
    assert MemoryOptimizer.suggest_config(1e9, 2, device_memory=memory, precision="bfloat16", sequence_length=512,
                                          target_batch_size=1, strategy="tensor_parallel").peak == per_rank.peak
    with pytest.raises(ConfigError, match="does not model strategy 'fsdp'"):
        for_strategy(model, 2, "fsdp")


@pytest.fixture
def measured_once(monkeypatch):
    """``MemoryOptimizer.measure`` measures a model once per architecture: the commands of a test that plan
    the same model on the same data share its measurement (tests/test_memory.py checks the measurement)."""
    measure, profiles = MemoryOptimizer.measure, {}

    def once(model, sample, **options):
        shapes = tuple((name, v.shape) for name, v in tree_flatten(model.parameters()))
        key = (type(model).__name__, shapes, options.get("precision"), type(options.get("optimizer")).__name__)
        if key not in profiles:
            profiles[key] = measure(model, sample, **options)
        return profiles[key]

    monkeypatch.setattr(MemoryOptimizer, "measure", staticmethod(once))
    return profiles


def test_optimize_cli_plans_per_tensor_parallel_rank(capsys, measured_once):
    common = ["optimize", "--model", "transformer", "--dataset", "text", "--batch-size", "4", "--set",
              "model_options.dims=32", "--set", "model_options.num_layers=1", "--device-memory", "8GB"]
    assert main([*common, "--strategy", "tensor_parallel", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 tensor-parallel ranks" in out and "needs 1 rank of tensor parallelism" in out
    assert "--distributed -n 2 --strategy tensor_parallel" in out
    split_weights = next(line for line in out.splitlines() if line.strip().startswith("parameters"))
    assert main(common) == 0
    whole_weights = next(line for line in capsys.readouterr().out.splitlines()
                         if line.strip().startswith("parameters"))
    assert split_weights != whole_weights
    assert main([*common, "--strategy", "tensor_parallel", "-n", "3"]) == 2
    assert "does not split over 3 ranks" in capsys.readouterr().err
    assert len(measured_once) == 1  # the three commands planned the same model
