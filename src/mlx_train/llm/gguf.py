"""Load a llama-family GGUF file (as llama.cpp writes it) as an mlx-lm model and tokenizer.

``mx.load`` already reads GGUF tensors (Q4_0/Q4_1/Q8_0 come back as MLX affine-quantized
triples ``X.weight``/``X.scales``/``X.biases`` with group size 32). What is left is llama.cpp's
naming, its permutation of the q/k rows for its RoPE, the model config from the metadata and the
tokenizer, which GGUF stores as a token list plus BPE merges.

Example::

    model, tokenizer, config = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = model(mx.array([tokenizer.encode("The capital of France is")]))
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.errors import ConfigError

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks hold 32 values
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SPECIAL_TOKEN_TYPE = 3  # llama.cpp's "control" tokens: <|im_start|>, <|endoftext|>, ...


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def gguf_config(metadata: dict[str, Any], has_output: bool) -> dict[str, Any]:
    """An mlx-lm llama ``config.json`` dict from GGUF metadata.

    Example: ``gguf_config(metadata, has_output=False)["tie_word_embeddings"] -> True``.
    """
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ConfigError(
            f"GGUF architecture is {arch!r}; only llama-family GGUF files (llama, SmolLM, TinyLlama, "
            "Mistral-style) can be loaded; convert other models to an mlx-lm directory with mlx_lm.convert"
        )

    def need(key: str) -> Any:
        value = _scalar(metadata, f"llama.{key}")
        if value is None:
            raise ConfigError(f"GGUF metadata has no llama.{key}; the file is incomplete or not a llama model")
        return value

    heads = int(need("attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "rope_traditional": False,  # q/k are un-permuted back to the Hugging Face layout
    }
    vocab = _scalar(metadata, "llama.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    config["vocab_size"] = int(vocab)
    for name in ("bos", "eos"):
        token_id = _scalar(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def unpermute(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's row permutation of a q or k projection (rows = heads * head_dim).

    Works on float weights and on the rows of quantized weights, scales and biases alike.
    Example: ``unpermute(permute(w, 4), 4)`` equals ``w``.
    """
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute(weight: mx.array, heads: int) -> mx.array:
    """llama.cpp's q/k row permutation (what ``convert_hf_to_gguf.py`` applies); the inverse of
    :func:`unpermute`. Example: ``permute(w, heads)`` before writing a GGUF."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _rename(name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)", name)
    if match:
        layer, part, leaf = match.groups()
        if part not in _LAYER_NAMES:
            raise ConfigError(f"GGUF tensor {name}: unknown llama layer part '{part}'")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"
    stem, _, leaf = name.rpartition(".")
    if stem not in _TOP_NAMES:
        raise ConfigError(f"GGUF tensor {name} has no llama counterpart; is this a llama-family model?")
    return f"{_TOP_NAMES[stem]}.{leaf}"


def gguf_weights(tensors: dict[str, mx.array], config: dict[str, Any],
                 quantized: bool) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """mlx-lm llama weights from GGUF tensors: renamed, q/k un-permuted, dequantized to float32
    unless ``quantized``. Returns ``(weights, quantization)`` where ``quantization`` is mlx-lm's
    per-layer ``{"group_size", "bits", path: {...}}`` config (empty when dequantized)."""
    weights: dict[str, mx.array] = {}
    bits_of: dict[str, int] = {}
    for name, value in tensors.items():
        new = _rename(name)
        if ".attn_q." in name or ".attn_k." in name:
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            value = unpermute(value, heads)
        weights[new] = value
    for name in [n for n in weights if n.endswith(".scales")]:
        stem = name[: -len(".scales")]
        weight, scales, biases = weights[f"{stem}.weight"], weights[name], weights[f"{stem}.biases"]
        bits = weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
        if quantized:
            bits_of[stem] = bits
            continue
        dense = mx.dequantize(weight, scales, biases, group_size=GROUP_SIZE, bits=bits)
        weights[f"{stem}.weight"] = dense.astype(mx.float32)
        del weights[name], weights[f"{stem}.biases"]
    def widened(key: str, value: mx.array) -> mx.array:
        keep = not mx.issubdtype(value.dtype, mx.floating) or key.endswith((".scales", ".biases"))
        return value if keep else value.astype(mx.float32)

    weights = {k: widened(k, v) for k, v in weights.items()}
    if not bits_of:
        return weights, {}
    common = max(set(bits_of.values()), key=list(bits_of.values()).count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    quantization.update({stem: {"group_size": GROUP_SIZE, "bits": b} for stem, b in bits_of.items() if b != common})
    return weights, quantization


def gguf_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    """A Hugging Face fast tokenizer built from GGUF's ``tokenizer.ggml.*`` metadata (gpt2-style BPE).

    Pre-tokenizer: single digits, then byte-level without a prefix space (as SmolLM2/llama-3 use).
    Example: ``gguf_tokenizer(metadata).encode("Hello")``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ConfigError(
            f"GGUF tokenizer model is {model_kind!r}; only byte-level BPE ('gpt2') tokenizers can be "
            "rebuilt from GGUF metadata; use a model directory with tokenizer.json instead"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        special = [tokens[i] for i, t in enumerate(types.tolist()) if t == _SPECIAL_TOKEN_TYPE]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str) -> str | None:
        index = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        tokenizer_object=tokenizer, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding") or token("eos"),
        chat_template=metadata.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False,
    )


GGUF_MAGIC = b"GGUF"


def check_gguf_header(path: str) -> None:
    """Refuse a file that is not GGUF (its first four bytes are not ``GGUF``) before MLX parses it."""
    with open(path, "rb") as file:
        head = file.read(4)
    if head != GGUF_MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}): give a .gguf "
                          "model file, or the folder (or Hugging Face id) of an mlx-lm or transformers model")


def load_gguf(path: str, quantized: bool = False) -> tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """Load a llama-family GGUF file as ``(mlx-lm model, TokenizerWrapper, config)``.

    Quantized tensors are dequantized to float32 (quantized matmuls are slow on CPUs) unless
    ``quantized=True``, which keeps them as ``nn.QuantizedLinear``/``QuantizedEmbedding`` (QLoRA).

    Example::

        model, tokenizer, config = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    """
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file {path} does not exist; give the path of a .gguf file")
    check_gguf_header(path)
    try:  # return_metadata=True: the (tensors, metadata) pair; the stubs give one union for every form.
        tensors, metadata = cast("tuple[dict[str, mx.array], dict[str, Any]]", mx.load(path, return_metadata=True))
    except (RuntimeError, ValueError) as error:
        size = os.path.getsize(path)
        raise ConfigError(f"GGUF file {path} ({size:,} bytes) cannot be read ({error}): the file is truncated or "
                          "damaged (an interrupted download?): download it again") from None
    config = gguf_config(metadata, has_output="output.weight" in tensors)
    weights, quantization = gguf_weights(tensors, config, quantized)
    model = Model(ModelArgs.from_dict(config))
    if quantization:
        config["quantization"] = quantization

        def predicate(module_path: str, module: nn.Module) -> bool | dict[str, Any]:
            if f"{module_path}.scales" not in weights:
                return False
            spec: dict[str, Any] = quantization.get(module_path, {"group_size": GROUP_SIZE,
                                                                  "bits": quantization["bits"]})
            return spec

        nn.quantize(model, group_size=GROUP_SIZE, bits=quantization["bits"], class_predicate=predicate)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    eos = config.get("eos_token_id")
    tokenizer = TokenizerWrapper(gguf_tokenizer(metadata), eos_token_ids=None if eos is None else [eos])
    config["torch_dtype"] = "float32"
    return model, tokenizer, config


def parameter_count(model: nn.Module) -> int:
    """Number of parameter values in ``model`` (quantized weights counted as stored)."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))
