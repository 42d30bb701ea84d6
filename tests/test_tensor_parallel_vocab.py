"""The vocabulary split of tensor parallelism: the token embedding (and an untied ``lm_head``) keep their
rows of the vocabulary on each rank, a tied embedding stays tied, and the loss normalises over the ranks.
2 ranks launched for real on 127.0.0.1 compute the same losses and gradients as the whole model (chunked,
full logits, preference losses), train like one process (LoRA, the blocks, every parameter), resume, and
re-shard their checkpoint for one process; plus single-process checks of the split itself."""

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
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mlx_train.distributed.tensor import VocabParallelEmbedding, VocabParallelHead  # noqa: E402
from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402
from mlx_train.llm.loss import output_head  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(SCRIPTS), "..", "src"),
                                      os.environ.get("PYTHONPATH", "")])}


class _Rank:
    """A stand-in group of 2 (splitting communicates nothing; only running the split model does)."""

    def __init__(self, rank=1):
        self._rank = rank

    def size(self):
        return 2

    def rank(self):
        return self._rank


def _launcher():
    from test_tensor_parallel import _launcher as find

    return find()


# -- one process ------------------------------------------------------------------------------


def test_a_tied_embedding_is_split_by_rows_and_stays_the_head():
    model, _ = llm_tiny.make_model(96, seed=0, tie=True)
    whole = np.array(model.model.embed_tokens.weight)
    layout = llm_tensor_parallel.shard_language_model(model, _Rank(1))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, VocabParallelEmbedding) and "lm_head" not in model
    assert layout["model.embed_tokens.weight"] == 0
    assert embedding.vocab_offset == 48 and np.array_equal(np.array(embedding.weight), whole[48:])
    head, project = output_head(model)
    assert head is embedding and project == embedding.as_linear  # one matrix serves the input and the head


def test_an_untied_head_is_split_with_the_embedding_and_frozen_stays_frozen():
    model, _ = llm_tiny.make_model(96, seed=0, tie=False)
    whole = np.array(model.lm_head.weight)
    model.freeze()
    model.lm_head.unfreeze()
    layout = llm_tensor_parallel.shard_language_model(model, _Rank(0))
    assert isinstance(model.lm_head, VocabParallelHead) and layout["lm_head.weight"] == 0
    assert np.array_equal(np.array(model.lm_head.weight), whole[:48])
    assert layout["model.embed_tokens.weight"] == 0
    from mlx.utils import tree_flatten

    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert "lm_head.weight" in trainable and "model.embed_tokens.weight" not in trainable


def test_a_vocabulary_that_does_not_divide_stays_replicated():
    model, _ = llm_tiny.make_model(97, seed=0, tie=False)
    layout = llm_tensor_parallel.shard_language_model(model, _Rank())
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in layout)
    assert layout["model.layers.0.mlp.down_proj.weight"] == 1  # the blocks are split all the same


def test_an_already_split_model_gets_its_vocabulary_split_once():
    from mlx.nn.layers.distributed import shard_linear

    model, _ = llm_tiny.make_model(96, seed=0)
    group = _Rank()
    for layer in model.layers:  # a split of its own (the MLPs only), as for heads that do not divide
        layer.mlp.up_proj = shard_linear(layer.mlp.up_proj, "all-to-sharded", group=group)
        layer.mlp.gate_proj = shard_linear(layer.mlp.gate_proj, "all-to-sharded", group=group)
        layer.mlp.down_proj = shard_linear(layer.mlp.down_proj, "sharded-to-all", group=group)
    layout = llm_tensor_parallel.shard_language_model(model, group)
    assert layout["model.embed_tokens.weight"] == 0 and "model.layers.0.self_attn.q_proj.weight" not in layout
    embedding = model.model.embed_tokens
    assert llm_tensor_parallel.shard_language_model(model, group) == layout and model.model.embed_tokens is embedding


# -- two ranks --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_split_vocabulary_losses_and_gradients_equal_the_whole_model_s(tmp_path):
    """Each of 2 ranks computes, with its half of the vocabulary, what the whole model computes: the
    distributed logsumexp, lm_loss chunked and from the full logits, at gathered positions, without
    gradients, the logits of the model's call, ORPO/CPO/DPO; tied and untied, LoRA and every parameter."""
    subprocess.run([_launcher(), "-n", "2", "--", sys.executable, os.path.join(SCRIPTS, "tp_vocab_check.py"),
                    str(tmp_path)], check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        results = found["results"]
        assert len(results) == 2 + 2 * 2 * 14  # 2 + (tied, untied) x (lora, all) x 14 checks
        assert {k for k, v in results.items() if k.endswith(" keys") and v is not True} == set()
        errors = {k: v for k, v in results.items() if not k.endswith(" keys")}
        assert max(errors.values()) < 2e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        for name, layout in found["layouts"].items():
            assert layout["model.embed_tokens.weight"] == 0, name
            assert ("lm_head.weight" in layout) == name.startswith("False"), name


def _run(out, mode, *extra, ranks=1):
    command = [sys.executable, os.path.join(SCRIPTS, "tp_vocab_run.py"), str(out), mode, *extra]
    if ranks > 1:
        command = [_launcher(), "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    return json.loads((out / "losses.json").read_text())["loss"], mx.load(str(out / "trained.safetensors"))


def _assert_same_parameters(mine, theirs):
    assert sorted(mine) == sorted(theirs)
    for key, value in mine.items():
        assert value.shape == theirs[key].shape, key
        scale = float(mx.abs(value).max()) or 1.0
        assert float(mx.abs(value - theirs[key]).max()) / scale < 2e-3, key


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode,extra", [("lora", []), ("full", ["--untied"]), ("all", ["--full-logits"]),
                                        ("all", ["--untied"])])
def test_two_ranks_with_the_vocabulary_split_train_like_one_process(tmp_path, mode, extra):
    one, one_trained = _run(tmp_path / "one", mode, *extra)
    two, two_trained = _run(tmp_path / "two", mode, *extra, ranks=2)
    assert len(one) == len(two) == 12
    assert np.allclose(one, two, rtol=0, atol=2e-5), (one, two)
    _assert_same_parameters(one_trained, two_trained)
    for rank in (0, 1):
        found = json.loads((tmp_path / "two" / f"rank-{rank}.json").read_text())
        assert found["differing"] == []
        split = ["model.embed_tokens.weight"] + (["lm_head.weight"] if "--untied" in extra else [])
        for key in split:
            assert found["layout"][key] == 0 and found["shapes"][key] == [48, 32], key
            assert (key in found["trainable"]) == (mode == "all"), key


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_with_the_vocabulary_split_resumes_and_reshards_for_one_process(tmp_path):
    """Every parameter trained (the embedding and head with their Adam moments): stopped after step 7 and
    resumed from step 5 by 2 ranks, or by one process (the slices joined), the run goes on as uninterrupted."""
    flags = ["--untied"]
    whole, trained = _run(tmp_path / "whole", "all", *flags, ranks=2)
    ckpt = tmp_path / "ckpt"
    _run(tmp_path / "stopped", "all", *flags, "--checkpoint-dir", str(ckpt), "--max-steps", "7", ranks=2)
    checkpoint = ckpt / "step-00000005"
    record = json.loads((checkpoint / "trainer_state.json").read_text())["tensor_parallel"]
    assert record["world_size"] == 2 and record["layout"]["model.embed_tokens.weight"] == 0
    assert record["layout"]["lm_head.weight"] == 0
    shard = mx.load(str(ckpt / "tp-shards" / "step-00000005" / "rank-1.safetensors"))
    assert shard["model.lm_head.weight"].shape == (48, 32)
    assert {k for k in shard if k.startswith("optimizer.model.embed_tokens.weight")}  # its Adam moments, split
    resumed, resumed_trained = _run(tmp_path / "resumed", "all", *flags, "--resume", str(checkpoint), ranks=2)
    assert np.allclose(resumed, whole[5:], rtol=0, atol=2e-5), (resumed, whole[5:])
    _assert_same_parameters(trained, resumed_trained)
    one, one_trained = _run(tmp_path / "one", "all", *flags, "--resume", str(checkpoint))
    assert np.allclose(one, whole[5:], rtol=0, atol=2e-5), (one, whole[5:])
    _assert_same_parameters(trained, one_trained)


def test_the_planner_counts_the_vocabulary_only_over_the_ranks_it_divides_by():
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    from mlx_train.cli.optimize import measure_split
    from mlx_train.memory import MemoryModel

    config = {**llm_tiny.model_config(98), "num_key_value_heads": 4}  # heads split over 2 and 4, 98 rows over 2
    model = Model(ModelArgs.from_dict(config))
    split = measure_split(model)
    assert split.ranks == (2, 4)
    whole = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert whole - split.parameters == 98 * 32 + 5 * 32  # the embedding is counted whole: it does not split over 4
    model, _ = llm_tiny.make_model(96)
    assert sum(v.size for _, v in tree_flatten(model.parameters())) - measure_split(model).parameters == 5 * 32
    analytic = MemoryModel.analytic(1e9, "float32", "adamw", 512)  # a 32000-row vocabulary: split too
    assert analytic.parameter_count - analytic.split.parameters < 1e-3 * analytic.parameter_count


def test_a_vocabulary_left_whole_is_named_in_one_line():
    model, _ = llm_tiny.make_model(97, seed=0)
    llm_tensor_parallel.shard_language_model(model, _Rank())
    assert llm_tensor_parallel.replicated_vocabulary(model, _Rank()) == (
        "the vocabulary (97 rows) does not divide by 2 ranks: the token embedding and output head stay whole on "
        "every rank")
    model, _ = llm_tiny.make_model(96, seed=0)
    llm_tensor_parallel.shard_language_model(model, _Rank())
    assert llm_tensor_parallel.replicated_vocabulary(model, _Rank()) is None
