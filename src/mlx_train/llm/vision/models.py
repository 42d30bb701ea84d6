"""Vision-language models: recognised before anything loads, loaded with mlx-vlm, and the few facts of
mlx-vlm's models that fine-tuning depends on.

A model is a vision-language model when its ``config.json`` has a ``vision_config`` or its
``model_type`` is one of ``VISION_MODEL_TYPES``. mlx-lm would load only its language part (and
train on the text of image rows as if the images were not there), so fine-tuning one goes through
mlx-vlm (the ``vlm`` extra) and the vision task (``mlx_train.llm.tasks.VisionSFT``).

Two facts of mlx-vlm's Qwen2-VL family (0.7) shape the training step, each handled in one place here:

- the forward pass reads values to Python (the image token positions, for the 3-D rotary positions),
  which ``mx.compile`` cannot trace: the step runs uncompiled (``trainer_settings``);
- the language model keeps the rotary positions of its last call (``_position_ids``,
  ``_rope_deltas``, for generation) and reuses them when the next call has no image: a text row after
  an image row would get the image row's positions. ``reset_position_caches`` clears them before
  every forward pass, and after it: kept, they are arrays in the model's state that come and go with
  each call, and the Trainer's out-of-memory recovery can undo a step only when the state holds the
  same arrays as when the run started.

Example::

    vision_model_type("Qwen2-VL-2B-Instruct")      # "qwen2_vl" (None for a text-only model)
    model, processor, config = load("Qwen2-VL-2B-Instruct")
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.nn as nn

from mlx_train.config import FinetuneConfig
from mlx_train.errors import ConfigError

#: model_type values of vision-language models (most also have a ``vision_config`` in config.json).
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "llava_next", "llava_qwen2",
                      "idefics2", "idefics3", "smolvlm", "paligemma", "mllama", "pixtral", "mistral3", "gemma3",
                      "gemma3n", "glm4v", "internvl_chat", "kimi_vl", "phi3_v", "florence2", "deepseek_vl_v2",
                      "aya_vision", "molmo", "llama4", "fastvlm")
#: The families the vision task trains, checked against mlx-vlm: their images arrive as rows of patches
#: (``pixel_values``) and ``image_grid_thw`` (one row per image), and the model call takes both.
TRAINED_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
#: The language model's cached rotary positions, cleared before each forward pass (module docstring).
POSITION_CACHES = ("_position_ids", "_rope_deltas")
INSTALL = "pip install 'mlx-train[vlm]'"


def read_config(path: str) -> dict[str, Any] | None:
    """The ``config.json`` of a model directory, or of a Hugging Face repo id already in the local cache
    (nothing is downloaded); None when there is none to read."""
    file: Any = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if file is None and not os.path.exists(path) and path.count("/") == 1:
        try:
            from huggingface_hub import try_to_load_from_cache

            file = try_to_load_from_cache(path, "config.json")
        except Exception:  # noqa: BLE001 - no hub library, or a name it refuses: nothing cached to read
            file = None
    if not isinstance(file, str) or not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it
    return config if isinstance(config, dict) else None


def vision_model_type(path: str) -> str | None:
    """The ``model_type`` of ``path`` when it is a vision-language model (see the module docstring), else None.

    Example: ``vision_model_type("runs/tiny-qwen2-vl")`` -> ``"qwen2_vl"``.
    """
    config = read_config(path)
    if config is None:
        return None
    model_type = str(config.get("model_type") or "")
    if "vision_config" in config or model_type in VISION_MODEL_TYPES:
        return model_type or "unknown"
    return None


def require_mlx_vlm(path: str, model_type: str) -> None:
    """Raise a ConfigError that says to install the ``vlm`` extra when mlx-vlm is missing."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"{path} is a vision-language model ({model_type}); fine-tuning it needs mlx-vlm, which is "
                          f"not installed ({error}). Install the vlm extra: {INSTALL} (mlx-lm would load only its "
                          "language part and train on the text of the rows without their images)") from None


def check_family(path: str, model_type: str) -> None:
    """Refuse a vision-language family the vision task does not train (yet)."""
    if model_type not in TRAINED_FAMILIES:
        raise ConfigError(f"{path} is a vision-language model of type {model_type!r}, which mlx-train does not "
                          f"fine-tune yet (it trains {', '.join(TRAINED_FAMILIES)}); use mlx-vlm's own trainer "
                          "(python -m mlx_vlm.train) for it")


def load(path: str, quantized: bool, log: Any = print) -> tuple[nn.Module, Any, dict[str, Any]]:
    """``(model, processor, config)`` of a vision-language model, loaded by ``mlx_vlm.load``. A quantized
    model is dequantized unless ``quantized`` (as ``mlx_train.llm.models.load_model`` does).

    Example: ``model, processor, config = load("Qwen2-VL-2B-Instruct", quantized=False)``.
    """
    from mlx_vlm.utils import load as load_vlm  # mlx_vlm.load

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        log(f"{path} has no preprocessor_config.json: the image processor's defaults apply (Qwen2-VL: up to about "
            "1M pixels, 1,300 image tokens, per image); add one with max_pixels to make images smaller")
    try:
        model, processor = load_vlm(path)
    except Exception as error:  # noqa: BLE001 - the processor's loaders raise anything; say what it was
        raise ConfigError(f"mlx-vlm cannot load the vision-language model {path}: {type(error).__name__}: {error}. "
                          "Give a local model directory (config.json, *.safetensors, tokenizer and processor files) "
                          "or a Hugging Face repo id; set HF_HUB_OFFLINE=1 to keep a local load off the network"
                          ) from None
    config = read_config(path) or dict(vars(model.config))
    if not quantized and "quantization" in config:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return model, processor, config


def reset_position_caches(model: nn.Module) -> None:
    """Clear the language model's cached rotary positions (``POSITION_CACHES``), before and after a forward
    pass (module docstring)."""
    language = getattr(model, "language_model", None)
    for name in POSITION_CACHES:
        if language is not None and hasattr(language, name):  # (an array is kept in the module, None beside it)
            setattr(language, name, None)


def adapter_keys(model: nn.Module) -> list[str]:
    """The full names of the layers that carry LoRA/DoRA adapters: ``lora_parameters.keys`` of an
    ``adapter_config.json`` that ``mlx_vlm.load(..., adapter_path=...)`` reads (it adds adapters there)."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    return [name for name, module in model.named_modules() if isinstance(module, (LoRALinear, DoRALinear))]


def check_settings(config: FinetuneConfig, path: str) -> None:
    """Refuse what the vision task does not do (yet), before the model loads."""
    refused = {
        "pack": (config.pack, "rows with images are not packed; drop --pack"),
        "loss_chunk": (config.loss_chunk is not None, "the vision task projects the whole logits; drop --loss-chunk"),
        "quantized": (config.fine_tune_type == "full" and config.quantized is True,
                      "full fine-tuning trains float weights (the base is dequantized, as mlx-vlm's full training "
                      "does, and mlx-vlm loads the result so); drop --quantized, or use --fine-tune-type lora"),
        "resume_adapter_file": (config.resume_adapter_file,
                                "continuing from adapter files is not supported yet for vision-language models; "
                                "continue a run with --resume"),
        "distributed_strategy": (config.distributed_strategy == "tensor_parallel",
                                 "tensor parallelism is not supported for vision-language models; use "
                                 "--strategy data_parallel"),
    }
    for name, (given, why) in refused.items():
        if given:
            raise ConfigError(f"{path} is a vision-language model: {name} {getattr(config, name)!r}: {why}")


#: The modules ``train_vision`` unfreezes (mlx-vlm's ``--train-vision`` list): the vision tower and projector.
VISION_MODULES = ("vision_model", "vision_tower", "mm_projector", "multi_modal_projector", "aligner", "connector",
                  "vision_resampler")


def unfreeze_vision(model: nn.Module, path: str) -> list[str]:
    """Make every weight of the vision tower and projector (``VISION_MODULES``) trainable; their names.

    Example: ``unfreeze_vision(model, "Qwen2-VL-2B-Instruct")`` -> ``["vision_tower"]``.
    """
    names = [name for name in VISION_MODULES if isinstance(getattr(model, name, None), nn.Module)]
    if not names:
        raise ConfigError(f"--train-vision: {path} has none of the vision modules it trains "
                          f"({', '.join(VISION_MODULES)}); leave it out")
    for name in names:
        getattr(model, name).unfreeze()
    return names


#: The blocks ``gradient_checkpointing: true`` recomputes in a vision-language model: the language model's.
LANGUAGE_BLOCKS = "language_model.model.layers"


def trainer_settings(config: FinetuneConfig, model_type: str, log: Any = print) -> FinetuneConfig:
    """``config`` as the Trainer runs a vision-language model: the step uncompiled (its forward pass reads
    values to Python, which ``mx.compile`` cannot trace), said in the log when it was on; and
    ``gradient_checkpointing: true`` without ``checkpoint_modules`` recomputes the language model's blocks."""
    if config.gradient_checkpointing is True and not config.checkpoint_modules:
        config = config.replace(checkpoint_modules=[LANGUAGE_BLOCKS])
    if not config.compile:
        return config
    log(f"compile: off for this {model_type} model: its forward pass reads the image token positions to Python, "
        "which mx.compile cannot trace, so each step runs uncompiled")
    return config.replace(compile=False)


#: Files of a model directory that hold its weights: the fused model writes its own.
WEIGHT_FILES = (".safetensors", "model.safetensors.index.json")


def fuse(path: str, adapter_path: str, save_path: str, dequantize: bool = False) -> str:
    """Fold the LoRA/DoRA adapters of ``adapter_path`` into the base ``path`` and write a model directory
    that ``mlx_vlm.load`` loads and generates from: the base's files (config, tokenizer, processor, chat
    template) with the fused weights. A quantized base stays quantized unless ``dequantize`` (its config
    then loses ``quantization``). The weights of a full fine-tuning (``fine_tune_type: full``: every weight,
    in float) are written as they are, and the config loses ``quantization``. ``save_path`` is checked by the
    caller (a new or empty directory).

    Example: ``fuse("Qwen2-VL-2B-Instruct", "runs/a/adapters", "qwen2-vl-tuned")``.
    """
    import shutil

    from mlx.utils import tree_unflatten
    from mlx_vlm.trainer.peft.dora_layers import DoRALinear
    from mlx_vlm.trainer.peft.lora_layers import LoRALinear
    from mlx_vlm.utils import get_model_path, save_config, save_weights
    from mlx_vlm.utils import load as load_vlm

    from mlx_train.llm.adapters import read_adapter_config

    full = read_adapter_config(adapter_path).fine_tune_type == "full"
    dequantize = dequantize or full  # mlx-vlm loads a full fine-tuning's weights into the dequantized base
    model, _ = load_vlm(path, adapter_path=adapter_path)  # the adapters (or full weights) as mlx-vlm adds them
    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if isinstance(module, (LoRALinear, DoRALinear))]
    if not fused and not full:
        raise ConfigError(f"{adapter_path} adds no LoRA or DoRA layer to {path}: nothing to fuse")
    if fused:
        model.update_modules(tree_unflatten(fused))
    source = str(get_model_path(path))
    os.makedirs(save_path, exist_ok=True)
    for name in os.listdir(source):
        if os.path.isfile(os.path.join(source, name)) and not name.endswith(WEIGHT_FILES):
            shutil.copy(os.path.join(source, name), os.path.join(save_path, name))
    save_weights(save_path, model)
    config = read_config(source) or {}
    if dequantize and ("quantization" in config or "quantization_config" in config):
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
        save_config(config, os.path.join(save_path, "config.json"))
    return save_path
