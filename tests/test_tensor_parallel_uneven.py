"""Attention split unevenly by key/value groups: a tiny llama with 9 query heads in 3 key/value groups
over 2 ranks (2 groups + 1). 2 ranks launched for real on 127.0.0.1 train like one process (full, LoRA,
DoRA),
gather the same parameters and adapters, and their checkpoint (which records the unequal slices)
re-shards for one process, as a one-process checkpoint does for 2 ranks; plus single-process checks of
the split, the layout entries and the checkpoint record."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import tp_uneven_run  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_train.distributed import tensor  # noqa: E402
from mlx_train.distributed.tensor import Split  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(SCRIPTS), "..", "src"),
                                      os.environ.get("PYTHONPATH", "")])}
ATTENTION = "model.layers.0.self_attn"


from test_tensor_parallel_vocab import _launcher, _Rank  # noqa: E402

# -- one process ------------------------------------------------------------------------------


def test_the_lower_ranks_keep_one_group_more():
    assert tensor.group_counts(3, 2) == [2, 1]
    assert tensor.group_counts(5, 3) == [2, 2, 1]
    assert tensor.group_counts(4, 2) == [2, 2]


@pytest.mark.parametrize("rank", [0, 1])
def test_attention_that_does_not_divide_is_split_by_whole_key_value_groups(rank):
    model, config = tp_uneven_run.make_model(96, seed=0)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    whole = {name: np.array(getattr(model.model.layers[0].self_attn, name).weight)
             for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    layout = llm_tensor_parallel.shard_language_model(model, _Rank(rank))
    attention = model.model.layers[0].self_attn
    groups = [2, 1][rank]  # of 3 groups: 2 on rank 0, 1 on rank 1; each 3 query heads of size 8
    assert (attention.n_heads, attention.n_kv_heads) == (3 * groups, groups)
    q_rows, kv_rows = slice(0, 48) if rank == 0 else slice(48, 72), slice(0, 16) if rank == 0 else slice(16, 24)
    assert np.array_equal(np.array(attention.q_proj.weight), whole["q_proj"][q_rows])
    assert np.array_equal(np.array(attention.k_proj.weight), whole["k_proj"][kv_rows])
    assert np.array_equal(np.array(attention.v_proj.weight), whole["v_proj"][kv_rows])
    assert np.array_equal(np.array(attention.o_proj.weight), whole["o_proj"][:, q_rows])
    q, o = layout[f"{ATTENTION}.q_proj.weight"], layout[f"{ATTENTION}.o_proj.weight"]
    assert (q.axis, q.sizes) == (0, (48, 24)) and (o.axis, o.sizes) == (1, (48, 24))
    assert layout[f"{ATTENTION}.k_proj.weight"].sizes == (16, 8)
    up = layout["model.layers.0.mlp.up_proj.weight"]  # the MLP divides: equal slices, a plain axis
    assert up == 0 and not isinstance(up, Split)


def test_fewer_key_value_groups_than_ranks_are_still_refused():
    model, _ = tp_uneven_run.make_model(96, seed=0)  # 3 groups

    class Four(_Rank):
        def size(self):
            return 4

    with pytest.raises(ConfigError, match=r"self_attn cannot be split over 4 processes: its 3 key/value heads cannot "
                                          r"go to 4 processes: each needs one; this attention splits over 2 or 3 "
                                          r"processes: launch that many"):
        llm_tensor_parallel.shard_language_model(model, Four(0))
    assert not tensor.is_sharded(model)


def test_unequal_slices_are_cut_recorded_and_read_back():
    full = {"w": mx.arange(24).reshape(6, 4), "b": mx.arange(3)}
    layout = {"w": Split(0, (4, 2))}
    assert tensor.take_shard(full, layout, 0, 2)["w"].tolist() == full["w"][:4].tolist()
    assert tensor.take_shard(full, layout, 1, 2)["w"].tolist() == full["w"][4:].tolist()
    record = tensor.layout_record({**layout, "v": 1})
    assert json.loads(json.dumps(record)) == {"layout": {"w": 0, "v": 1}, "sizes": {"w": [4, 2]}}
    back = tensor.layout_from_record(record)
    assert back["w"].sizes == (4, 2) and back["v"] == 1 and not isinstance(back["v"], Split)
    assert tensor.layout_from_record({"world_size": 2, "layout": {"w": 0}}) == {"w": 0}  # older
    with pytest.raises(ConfigError, match=r"w has 6 entries on axis 0, but its recorded slices \[4, 1\] add up"):
        tensor.take_shard(full, {"w": Split(0, (4, 1))}, 0, 2)
    with pytest.raises(ConfigError, match=r"w is split unevenly in 2 slices \[4, 2\]; it cannot be cut into 3"):
        tensor.take_shard(full, layout, 0, 3)


def test_reshard_joins_unequal_slices_of_two_ranks(tmp_path):
    whole = {"model": {"w": mx.arange(12.0).reshape(2, 6)},
             "optimizer": {"w.m": mx.arange(12.0).reshape(2, 6) * 10, "step": mx.array(3)}}
    layout = {"w": Split(1, (4, 2))}
    parts = [{g: tensor.take_shard(whole[g], tensor.optimizer_layout(whole[g], layout)
                                            if g == "optimizer" else layout, r, 2) for g in whole} for r in (0, 1)]
    directory = tmp_path / "ckpt"
    tensor.write_shard(str(directory), 3, 1, parts[1]["model"], parts[1]["optimizer"])
    saved = {"step": 3, "tensor_parallel": {"world_size": 2, **tensor.layout_record(layout)}}
    checkpoint = str(directory / "step-00000003")
    joined = tensor.reshard(checkpoint, parts[0], saved, {}, rank=0, size=1)
    for group in whole:
        assert all(mx.array_equal(joined[group][k], v) for k, v in whole[group].items()), group
    mine = tensor.reshard(checkpoint, parts[0], saved, layout, rank=1, size=2)  # the same layout
    assert mine["model"]["w"].tolist() == whole["model"]["w"][:, 4:].tolist()
    cut = tensor.reshard(checkpoint, whole, {"step": 3}, layout, rank=1, size=2)  # a whole checkpoint
    assert cut["optimizer"]["w.m"].tolist() == (whole["optimizer"]["w.m"][:, 4:]).tolist()


# -- two processes ----------------------------------------------------------------------------


def _train(out, mode, *extra, ranks=1):
    command = [sys.executable, os.path.join(SCRIPTS, "tp_uneven_run.py"), str(out), mode, *extra]
    if ranks > 1:
        command = [_launcher(), "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    with open(out / "losses.json") as f:
        return json.load(f)["loss"], mx.load(str(out / "trained.safetensors"))


def _close(a, b, tolerance):
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert value.shape == b[key].shape, key
        assert float(mx.abs(value - b[key]).max()) <= tolerance * max(float(mx.abs(value).max()), 1.0), key


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "lora", "dora"])
def test_two_ranks_with_uneven_attention_train_like_one_process(tmp_path, mode):
    one, one_trained = _train(tmp_path / "one", mode)
    two, two_trained = _train(tmp_path / "two", mode, ranks=2)
    assert len(one) == len(two) == tp_uneven_run.tp_run.STEPS
    assert np.allclose(one, two, rtol=0, atol=1e-5), (one, two)
    _close(one_trained, two_trained, 1e-4)  # gathered: the names and shapes of one process
    ranks = [json.loads((tmp_path / "two" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank, groups in zip(ranks, (2, 1), strict=True):
        assert rank["differing"] == []  # the replicated parameters agree bit for bit
        shapes = rank["shapes"]
        for key in shapes:
            if ".self_attn." in key and key.endswith(("q_proj.weight", "q_proj.lora_b")):  # 3 query heads a group
                assert shapes[key][0 if key.endswith("weight") else 1] == 24 * groups, key
            if key.endswith("o_proj.weight"):
                assert shapes[key][1] == 24 * groups, key
            moments = [k for k in rank["optimizer_shapes"] if k.startswith(key + ".")]
            assert all(rank["optimizer_shapes"][k] == shapes[key] for k in moments), key
    assert any(".self_attn." in k for k in ranks[1]["shapes"])  # adapters of the split attention, or its weights
    one_adapters = mx.load(str(tmp_path / "one" / "adapters" / "adapters.safetensors"))
    two_adapters = mx.load(str(tmp_path / "two" / "adapters" / "adapters.safetensors"))
    _close(one_adapters, two_adapters, 1e-4)  # written whole, gathered from unequal slices


@pytest.mark.slow
@pytest.mark.distributed
def test_an_uneven_checkpoint_reshards_two_to_one_and_one_to_two(tmp_path):
    two, two_trained = _train(tmp_path / "two", "full", "--checkpoint-dir", str(tmp_path / "two" / "ckpt"), ranks=2)
    checkpoint = tmp_path / "two" / "ckpt" / "step-00000015"
    record = json.loads((checkpoint / "trainer_state.json").read_text())["tensor_parallel"]
    assert record["layout"][f"{ATTENTION}.q_proj.weight"] == 0 and record["sizes"][f"{ATTENTION}.q_proj.weight"] == \
        [48, 24]
    shard = mx.load(str(tmp_path / "two" / "ckpt" / "tp-shards" / "step-00000015" / "rank-1.safetensors"))
    assert shard[f"model.{ATTENTION}.q_proj.weight"].shape == (24, 72)
    assert shard[f"optimizer.{ATTENTION}.o_proj.weight.v"].shape == (72, 24)
    # 2 -> 1: one process resumes the 2 ranks' checkpoint (their slices joined) and goes on as they did
    resumed, resumed_trained = _train(tmp_path / "resumed", "full", "--resume", str(checkpoint))
    assert np.allclose(resumed, two[15:], rtol=0, atol=1e-5), (resumed, two[15:])
    _close(two_trained, resumed_trained, 1e-4)
    # 1 -> 2: 2 ranks resume one process's checkpoint (cut into unequal slices)
    one, one_trained = _train(tmp_path / "one", "full", "--checkpoint-dir", str(tmp_path / "one" / "ckpt"))
    again, again_trained = _train(tmp_path / "again", "full", "--resume",
                                  str(tmp_path / "one" / "ckpt" / "step-00000015"), ranks=2)
    assert np.allclose(again, one[15:], rtol=0, atol=1e-5), (again, one[15:])
    _close(one_trained, again_trained, 1e-4)
