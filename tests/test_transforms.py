"""Model transforms (``mlx_train.transforms``) on every architecture they are declared for: a tiny random model
of each, built from mlx-lm's own classes, gets each declared transform, trains with the values and gradients
of the untransformed model, and is put back to its exact classes by undoing the stack. Outside the validated
mlx-lm releases nothing is switched and the reason is reported; the stack restores exact classes whatever
the order of applying and removing."""

import dataclasses
import importlib
import os
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from mlx.utils import tree_flatten  # noqa: E402
from test_llm_chunked_loss import VOCAB, assert_same, batch, loss_and_grads  # noqa: E402

from mlx_train import transforms  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm.loss import lm_loss, output_head  # noqa: E402
from mlx_train.training.recompute import disable_gradient_checkpointing, enable_gradient_checkpointing  # noqa: E402
from mlx_train.transforms import causal_blocks  # noqa: E402

# One small configuration for every architecture; each takes the keys its ModelArgs has.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5,
        "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 512,
        "rope_traditional": False, "attention_bias": False, "mlp_bias": False, "bias": False, "use_bias": False,
        "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 512,
        "query_pre_attn_scalar": 8, "sliding_window": 512, "sliding_window_pattern": 2, "logits_scaling": 1.0,
        "attention_multiplier": 1.0, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
        "no_rope_layers": [1, 1], "kv_channels": 8, "use_qk_norm": False, "use_sliding_window": False,
        "max_window_layers": 2, "hidden_act": "silu", "qk_layernorm": False}
# what some architectures need besides (phimoe before mlx-lm 0.32: its RoPE scaling)
EXTRA = {"phimoe": {"rope_scaling": {"short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "short_mscale": 1.0,
                                     "long_mscale": 1.0}},
         "stablelm": {"use_qkv_bias": False}, "minicpm": {"scale_emb": 1.0, "dim_model_base": 32, "scale_depth": 1.0},
         "olmo3": {"layer_types": ["sliding_attention", "full_attention"]},
         "exaone4": {"rope_scaling": None, "sliding_window": None, "sliding_window_pattern": None},
         "ministral3": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.0,
                                            "original_max_position_embeddings": 512}}}
# mlx-lm loads mistral checkpoints as llama: a llama with mistral's model_type
ARCHITECTURES = [*transforms.ARCHITECTURES, "mistral"]


def tiny(name, seed=0):
    module = importlib.import_module(f"mlx_lm.models.{'llama' if name == 'mistral' else name}")
    fields = {f.name for f in dataclasses.fields(module.ModelArgs)}
    args = module.ModelArgs.from_dict({"model_type": name, **{k: v for k, v in TINY.items() if k in fields},
                                       **EXTRA.get(name, {})})
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def classes(model):
    return {path: type(module) for path, module in model.named_modules()}


def declared(name, role):
    architecture = transforms.ARCHITECTURES["llama" if name in ("mistral", "smollm3") else name]
    return getattr(architecture, role)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_transform_applies_and_trains_as_the_untransformed_model(name, monkeypatch):
    if transforms._version_reason("llama" if name == "mistral" else name) is not None:
        # (only when these tests run on an mlx-lm release that is not declared for this architecture)
        done = transforms.apply(tiny(name), "block_attention")
        assert not done.paths and "is outside the releases" in done.describe()
        return
    blocks = []
    monkeypatch.setattr(transforms, "causal_blocks", lambda *args: blocks.append(1) or causal_blocks(*args))
    plain, model = tiny(name), tiny(name)
    before = classes(model)
    data = batch(rows=2, length=150)  # 150 tokens: three blocks of 64 queries
    expected = loss_and_grads(plain, lm_loss, data, chunk=0)

    stack = transforms.TransformStack(model)
    for transform, role in (("block_attention", "attention"), ("lean_swiglu", "mlp")):
        done = stack.apply(transform)
        cls = getattr(importlib.import_module(f"mlx_lm.models.{'llama' if name in ('mistral', 'smollm3') else name}"),
                      declared(name, role) or "-", None)
        instances = [path for path, module in model.named_modules() if cls is not None and before[path] is cls]
        assert sorted(done.paths) == sorted(instances) and (cls is None or instances), (transform, done.describe())
        assert not done.skipped, done.skipped
    checkpointed = enable_gradient_checkpointing(model, granularity="attention")
    assert checkpointed == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert transforms.transforms_of(model.model.layers[0].self_attn)[-1] == "recompute"
    assert_same(expected, loss_and_grads(model, lm_loss, data, chunk=0))
    assert blocks  # the attention was computed in blocks
    assert [k for k, _ in tree_flatten(model.parameters())] == [k for k, _ in tree_flatten(plain.parameters())]

    if transforms.ARCHITECTURES["llama" if name == "mistral" else name].head:
        assert output_head(model) is not None  # the loss projects the logits in chunks: the same numbers
        assert_same(expected, loss_and_grads(model, lm_loss, data, chunk=8))
    else:
        assert output_head(model) is None

    assert sorted(disable_gradient_checkpointing(model)) == checkpointed
    stack.undo()
    after = classes(model)
    assert all(after[path] is cls for path, cls in before.items())
    assert not any(transforms.transforms_of(module) for _, module in model.named_modules())


@pytest.mark.parametrize("version", [(0, 28, 4), (0, 33, 0)])
def test_outside_the_validated_releases_nothing_is_switched_and_the_log_says_why(monkeypatch, version):
    monkeypatch.setattr(transforms, "_mlx_lm_version", lambda: version)
    model = tiny("llama")
    before = classes(model)
    said = []
    stack = transforms.apply_fast_paths(model, said.append)
    assert classes(model) == before and not any(done.paths for done in stack.applied)
    shown = ".".join(map(str, version))
    assert len(said) == 3 and all(f"mlx-lm {shown} is outside the releases" in line for line in said)
    assert said[0].startswith("model transform block_attention (") and "not applied" in said[0]
    assert output_head(model) is None  # the full logits then


def test_the_start_up_log_names_what_was_applied_and_what_was_not():
    said = []
    transforms.apply_fast_paths(tiny("llama"), said.append)
    assert said == ["model transform block_attention (causal attention in blocks of queries on the CPU): 2 modules "
                    "(llama.Attention)",
                    "model transform lean_swiglu (a SwiGLU whose backward pass keeps only its inputs): 2 modules "
                    "(llama.MLP)",
                    "loss: the output projection in chunks (llama.Model)"]
    said.clear()
    transforms.apply_fast_paths(tiny("gemma"), said.append)  # gemma's MLP is a GELU: not one of the declared
    assert said[1].startswith("model transform lean_swiglu (") and "gemma.Model has no module of the classes" in said[1]
    assert said[2].startswith("loss: mlx_lm.models.gemma.Model is not among")

    class Mine(nn.Module):
        def __call__(self, x):
            return x

    done = transforms.apply(Mine(), "block_attention")
    assert done.paths == [] and "Mine has no module of the classes it was validated on" in done.describe()


def test_the_stack_restores_the_exact_classes_in_any_order():
    model = tiny("llama")
    attention = model.model.layers[0].self_attn
    original = type(attention)
    recomputed = transforms.apply(model, "recompute", [("model.layers.0.self_attn", attention)])
    blocked = transforms.apply(model, "block_attention")  # goes below the recomputation, which wraps it
    assert transforms.transforms_of(attention) == ["block_attention", "recompute"]
    both = type(attention)
    removed = transforms.remove(model, "block_attention")  # from the middle of the stack
    assert transforms.transforms_of(attention) == ["recompute"] and type(attention).__bases__ == (original,)
    removed.undo()
    assert type(attention) is both  # the very class it had
    blocked.undo()
    assert transforms.transforms_of(attention) == ["recompute"]
    recomputed.undo()
    assert type(attention) is original and type(model.model.layers[1].self_attn) is original
    with pytest.raises(ConfigError, match="unknown model transform 'lean_swigl' .*lean_swiglu"):
        transforms.apply(model, "lean_swigl")


def test_measuring_with_recomputation_leaves_the_models_transforms_as_they_were():
    from mlx_train.memory.calibrate import measure_step

    model = tiny("llama")
    transforms.apply_fast_paths(model, log=lambda message: None)
    enable_gradient_checkpointing(model, granularity="attention")
    before = classes(model)
    # recomputing whole blocks takes the attention's recomputation off while it measures
    measure_step(model, batch(rows=2, length=21), loss_fn=lm_loss, gradient_checkpointing=True)
    assert classes(model) == before
    assert transforms.transforms_of(model.model.layers[0].self_attn) == ["block_attention", "recompute"]


def test_finetune_logs_the_transforms_at_start_up(tmp_path):
    import llm_tiny

    from mlx_train.llm.finetune import FineTuneConfig, finetune

    llm_tiny.write_model_dir(str(tmp_path / "base"))
    llm_tiny.write_data(str(tmp_path / "data"), "text")
    said = []
    config = FineTuneConfig(model=str(tmp_path / "base"), data=str(tmp_path / "data"), iters=1, batch_size=2,
                            num_layers=-1, run_dir=str(tmp_path / "run"), steps_per_eval=1000)
    finetune(config, log=said.append)
    lines = [line for line in said if line.startswith(("model transform ", "loss: "))]
    assert lines == ["model transform block_attention (causal attention in blocks of queries on the CPU): 2 modules "
                     "(llama.Attention)",
                     "model transform lean_swiglu (a SwiGLU whose backward pass keeps only its inputs): 2 modules "
                     "(llama.MLP)",
                     "loss: the output projection in chunks (llama.Model)"]
