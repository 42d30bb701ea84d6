"""Load a base language model (mlx-lm / Hugging Face directory or llama GGUF file), write it
back as an mlx-lm directory, and fingerprint it for checkpoints.

Example::

    model, tokenizer, config = load_model("SmolLM2-135M-Instruct.Q4_1.gguf")
    save_model(model, tokenizer, config, "smollm2-mlx")     # mlx_lm.load("smollm2-mlx") works
    base_reference("smollm2-mlx")                            # {"path": ..., "sha256": ...}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.nn as nn

from mlx_train.errors import ConfigError

_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
_HASH_CHUNK = 1 << 22


def require_mlx_lm() -> None:
    """Raise a clear error when the ``llm`` extra is not installed."""
    try:
        import mlx_lm  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"language-model fine-tuning needs mlx-lm and tokenizers ({error}); "
            "install them with: pip install 'mlx-train[llm]'"
        ) from None


def load_model(path: str, quantized: bool = False, lazy: bool = False) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Load ``(model, tokenizer, config)`` from an mlx-lm/Hugging Face directory, a Hugging Face
    repo id (downloaded by mlx-lm) or a llama-family ``.gguf`` file.

    GGUF weights are dequantized to float32 unless ``quantized``; a directory's weights load as
    stored (a quantized mlx-lm model stays quantized; ``quantized=False`` dequantizes it).
    ``lazy`` leaves a directory's parameters unevaluated (each is read when first used: split the model,
    then evaluate, and only the slices are kept); a GGUF file always loads whole.

    Example: ``model, tokenizer, config = load_model("mlx-community/SmolLM2-135M-Instruct")``.
    """
    require_mlx_lm()
    if str(path).endswith(".gguf"):
        from mlx_train.llm.gguf import load_gguf

        return load_gguf(str(path), quantized=quantized)
    import mlx_lm

    if _looks_local(str(path)) and not os.path.exists(path):
        raise ConfigError(f"model {path} does not exist: give a local model directory (config.json, "
                          "model*.safetensors, tokenizer files), a .gguf file, or a Hugging Face repo id like "
                          "mlx-community/SmolLM2-135M-Instruct")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model directory {path} has no config.json; give an mlx-lm / Hugging Face model directory "
            "(config.json, model*.safetensors, tokenizer files) or a .gguf file"
        )
    try:
        # mlx_lm.load returns (model, tokenizer, config) with return_config=True; its annotation says two
        model, tokenizer, config = mlx_lm.load(str(path), lazy=lazy, return_config=True)  # type: ignore[misc]
    except Exception as error:
        hub = type(error).__module__.startswith("huggingface_hub")  # a repo id that is not one, offline, ...
        if not (hub or isinstance(error, OSError)):
            raise
        raise ConfigError(f"cannot load model {path}: {error}; give a local model directory, a .gguf "
                          "file or a Hugging Face repo id") from None
    if not quantized and "quantization" in config:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return model, tokenizer, config


def _looks_local(path: str) -> bool:
    """A path, not a Hugging Face repo id (``namespace/name``): absolute, relative to here or home, or deeper."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


def save_model(model: nn.Module, tokenizer: Any, config: dict[str, Any], directory: str) -> str:
    """Write ``model`` as an mlx-lm directory (``model.safetensors``, ``config.json``, tokenizer
    files) that ``mlx_lm.load(directory)`` reads. Returns the directory.

    Example: ``save_model(model, tokenizer, config, "fused")``.
    """
    from mlx_lm.utils import save_config
    from mlx_lm.utils import save_model as mlx_lm_save_model

    os.makedirs(directory, exist_ok=True)
    mlx_lm_save_model(directory, model)
    save_config(dict(config), os.path.join(directory, "config.json"))
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    hf_tokenizer.save_pretrained(directory)
    return directory


def _weight_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ConfigError(f"base model {path} is neither a file nor a directory; cannot fingerprint it")
    files = sorted(f for f in p.iterdir() if f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json")
    if not files:
        raise ConfigError(f"base model directory {path} has no weight files (*.safetensors) to fingerprint")
    return files


def _cache_file() -> Path:
    root = os.environ.get("MLX_TRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlx-train")
    return Path(root) / "model-hashes.json"


def _file_sha256(path: Path, cache: dict[str, Any]) -> str:
    stat = path.stat()
    key = str(path.resolve())
    entry = cache.get(key)
    if entry and entry["size"] == stat.st_size and entry["mtime_ns"] == stat.st_mtime_ns:
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    cache[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
    return str(cache[key]["sha256"])


def base_reference(path: str) -> dict[str, Any]:
    """``{"path", "sha256"}`` of a base model directory or file, for checkpoints that hold only
    trained parameters. The hash covers the weight files and config.json; each file's sha256 is
    cached by (path, size, mtime), so a second call costs a ``stat`` per file.

    Example: ``trainer.base_model = base_reference("SmolLM2-135M-Instruct.Q4_1.gguf")``.
    """
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    digest = hashlib.sha256()
    for f in _weight_files(path):
        digest.update(f.name.encode() + b"\0" + _file_sha256(f, cache).encode() + b"\n")
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_path)
    except OSError:
        pass  # a read-only cache only costs re-hashing next time
    return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}


def is_mlx_lm_model(model: nn.Module) -> bool:
    """True for models built from ``mlx_lm.models`` classes (they have ``layers`` and take ``cache``)."""
    return type(model).__module__.startswith("mlx_lm.models.") and hasattr(model, "layers")


def is_quantized(model: nn.Module) -> bool:
    """True when any layer of ``model`` holds quantized weights."""
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())

