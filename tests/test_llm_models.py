"""Base models: a GGUF file (written here with llama.cpp's q/k permutation and tokenizer
metadata) loads with the same logits and tokens as its source; mlx-lm directories round-trip;
base-model fingerprints."""

import json
import os
import re
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import base_reference, load_model, save_model  # noqa: E402
from mlx_train.llm.gguf import gguf_weights, permute, unpermute  # noqa: E402

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model, config, raw_tokenizer):
    """Write ``model`` as llama.cpp would: GGUF names, permuted q/k, metadata, BPE tokenizer."""
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = value
        elif name == "lm_head.weight":
            tensors["output.weight"] = value
        else:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            if module == "self_attn.q_proj":
                value = permute(value, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                value = permute(value, config["num_key_value_heads"])
            tensors[f"blk.{layer}.{_GGUF_NAMES[module]}.{leaf}"] = value
    spec = json.loads(raw_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {t["content"] for t in spec["added_tokens"]}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]), "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(512), "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(tokens.index("<|im_start|>")),
        "tokenizer.ggml.eos_token_id": u32(tokens.index("<|im_end|>")),
        "tokenizer.chat_template": llm_tiny.CHAT_TEMPLATE,
    }
    mx.save_gguf(path, tensors, metadata)


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_loads_with_the_source_logits_and_tokens(tmp_path, tie):
    raw = llm_tiny.raw_tokenizer()
    source, config = llm_tiny.make_model(raw.get_vocab_size(), seed=3, tie=tie)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, source, config, raw)
    model, tokenizer, loaded_config = load_model(path)
    assert loaded_config["tie_word_embeddings"] is tie
    assert loaded_config["num_key_value_heads"] == 2 and loaded_config["rope_theta"] == 10000.0
    text = "The capital of France is Paris, 1234 miles away."
    ids = tokenizer.encode(text)
    assert ids == raw.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == raw.token_to_id("<|im_end|>")
    x = mx.array([ids])
    np.testing.assert_allclose(np.array(model(x)), np.array(source(x)), atol=1e-5)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_converted_gguf_is_an_mlx_lm_directory(tmp_path):
    import mlx_lm

    raw = llm_tiny.raw_tokenizer()
    source, config = llm_tiny.make_model(raw.get_vocab_size(), seed=4)
    write_gguf(str(tmp_path / "tiny.gguf"), source, config, raw)
    model, tokenizer, loaded_config = load_model(str(tmp_path / "tiny.gguf"))
    save_model(model, tokenizer, loaded_config, str(tmp_path / "dir"))
    again, again_tokenizer = mlx_lm.load(str(tmp_path / "dir"))
    x = mx.array([again_tokenizer.encode("She sells sea shells")])
    np.testing.assert_allclose(np.array(again(x)), np.array(source(x)), atol=1e-5)


def test_unpermute_inverts_permute_on_quantized_rows():
    w = mx.random.normal((24, 64))
    assert mx.array_equal(unpermute(permute(w, 3), 3), w)
    q, scales, biases = mx.quantize(w, group_size=32, bits=4)
    tensors = {"blk.0.attn_q.weight": permute(q, 3), "blk.0.attn_q.scales": permute(scales, 3),
               "blk.0.attn_q.biases": permute(biases, 3)}
    config = {"num_attention_heads": 3, "num_key_value_heads": 1}
    weights, quantization = gguf_weights(tensors, config, quantized=False)
    expected = mx.dequantize(q, scales, biases, group_size=32, bits=4)
    assert quantization == {}
    assert mx.array_equal(weights["model.layers.0.self_attn.q_proj.weight"], expected)
    kept, quantization = gguf_weights(tensors, config, quantized=True)
    assert quantization == {"group_size": 32, "bits": 4}
    assert mx.array_equal(kept["model.layers.0.self_attn.q_proj.weight"], q)


def test_bad_gguf_and_directories_get_clear_errors(tmp_path):
    mx.save_gguf(str(tmp_path / "gpt.gguf"), {"x": mx.zeros(2)}, {"general.architecture": "gpt2"})
    with pytest.raises(ConfigError, match="architecture is 'gpt2'; only llama-family"):
        load_model(str(tmp_path / "gpt.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))


def test_truncated_or_foreign_gguf_is_one_sentence(tmp_path):
    whole = tmp_path / "whole.gguf"
    mx.save_gguf(str(whole), {"x": mx.zeros(4096)}, {"general.architecture": "llama"})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:200])  # an interrupted download
    with pytest.raises(ConfigError, match=r"GGUF file .*cut\.gguf \(200 bytes\) cannot be read \(.*\): the file is "
                                          r"truncated or damaged .*download it again"):
        load_model(str(cut))
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ConfigError, match=r"notes\.gguf is not a GGUF file \(it starts with b'hell', not b'GGUF'\)"):
        load_model(str(text))


def test_base_reference_hashes_weights_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRAIN_CACHE", str(tmp_path / "cache"))
    llm_tiny.write_model_dir(str(tmp_path / "m"))
    first = base_reference(str(tmp_path / "m"))
    assert first["path"] == str(tmp_path / "m") and len(first["sha256"]) == 64
    assert json.loads((tmp_path / "cache" / "model-hashes.json").read_text())
    assert base_reference(str(tmp_path / "m")) == first
    weights = mx.load(str(tmp_path / "m" / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    mx.save_safetensors(str(tmp_path / "m" / "model.safetensors"), weights)
    assert base_reference(str(tmp_path / "m"))["sha256"] != first["sha256"]


@pytest.mark.parametrize("base_kind", ["gguf", "directory"])
def test_the_model_card_usage_snippet_runs_as_written(tmp_path, monkeypatch, base_kind):
    """The card's Python snippet loads the base with something that reads it: mlx_lm.load reads a model
    directory, not a .gguf file (mlx_train.llm.load_model does)."""
    import re

    from mlx_train.llm import AdapterConfig, apply_adapters, save_adapters
    from mlx_train.llm.card import model_card

    raw = llm_tiny.raw_tokenizer()
    source, config = llm_tiny.make_model(raw.get_vocab_size(), seed=6)
    base = str(tmp_path / "tiny.gguf")
    write_gguf(base, source, config, raw)
    if base_kind == "directory":
        save_model(*load_model(base), str(tmp_path / "dir"))
        base = str(tmp_path / "dir")
    model, _, _ = load_model(base)
    spec = AdapterConfig("lora", num_layers=1, rank=2)
    apply_adapters(model, spec)
    save_adapters(model, spec, str(tmp_path / "adapters"))
    facts = {"base_model": base, "data": "data", "method": "lora", "train_mode": "sft", "hyperparameters": {},
             "metrics": {}}
    card = model_card(facts)
    code = re.search(r"```python\n(.*?)```", card, re.DOTALL)[1].replace("path/to/this/directory",
                                                                           str(tmp_path / "adapters"))
    assert ("load_model" in code) is (base_kind == "gguf")
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "generate", lambda model, tokenizer, prompt, **kw: tokenizer.encode(prompt))
    namespace: dict = {}
    exec(compile(code, "model card", "exec"), namespace)
    assert namespace["model"] is not None and namespace["tokenizer"].encode("Hello")


def test_fuse_beside_a_gguf_base_as_the_guide_does(tmp_path, capsys):
    """The fine-tuning guide's `--fuse smol-tuned` with `--model SmolLM2...gguf`: the fused directory sits beside
    the .gguf file, which is not a model directory to protect; the result is a directory mlx_lm.load reads."""
    import mlx_lm

    from mlx_train.cli.main import main

    raw = llm_tiny.raw_tokenizer()
    source, config = llm_tiny.make_model(raw.get_vocab_size(), seed=7)
    write_gguf(str(tmp_path / "tiny.gguf"), source, config, raw)
    llm_tiny.write_data(str(tmp_path / "data"), "completion", n_train=8, n_valid=4)
    code = main(["finetune", "--model", str(tmp_path / "tiny.gguf"), "--data", str(tmp_path / "data"), "--iters", "1",
                 "--num-layers", "1", "--batch-size", "2", "--run-dir", str(tmp_path / "run"), "--fuse",
                 str(tmp_path / "tiny-tuned")])
    assert code == 0, capsys.readouterr().err
    assert f"fused model: {tmp_path / 'tiny-tuned'}" in capsys.readouterr().out
    mlx_lm.load(str(tmp_path / "tiny-tuned"))
    # the same directory again: not empty, refused before anything trains
    assert main(["finetune", "--model", str(tmp_path / "tiny.gguf"), "--data", str(tmp_path / "data"), "--iters",
                 "1", "--num-layers", "1", "--batch-size", "2", "--run-dir", str(tmp_path / "run2"), "--fuse",
                 str(tmp_path / "tiny-tuned")]) == 2
    err = capsys.readouterr().err
    assert f"--fuse {tmp_path / 'tiny-tuned'} is not empty (" in err and "new or empty directory" in err
    assert not (tmp_path / "run2").exists()


@pytest.mark.parametrize("name", ["{tmp}/nowhere", "./nowhere", "no/such/folder", "not-a-repo-id"])
def test_a_model_that_is_neither_a_folder_nor_a_repo_id_is_one_sentence(tmp_path, monkeypatch, name):
    from mlx_train.errors import ConfigError
    from mlx_train.llm.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a repo id is looked up in the local cache only
    monkeypatch.chdir(tmp_path)
    path = name.replace("{tmp}", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"(?s)(model {re.escape(path)} does not exist|cannot load model {path}): .*"
                                          r"Hugging Face repo id"):
        load_model(path)
