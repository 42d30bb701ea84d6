"""A model card (``README.md`` with Hugging Face front matter) for fine-tuned adapters and fused models.

The front matter says ``library_name: mlx``, the ``base_model`` and tags (mlx, the method, the
training mode); the body gives the base model, the method, the data, the hyper-parameters, the
final metrics and how to load the result with mlx-lm.

Example::

    write_model_card("runs/a/adapters", card_facts(cfg, result))
"""

from __future__ import annotations

import math
import os
from typing import Any

import yaml

from mlx_train import rundir
from mlx_train.llm.tasks import task_for

CARD_FILE = "README.md"
FACTS_FILE = "model_card.json"  # the card's facts, so a fused model's card can be written from the adapters'
_HYPER = ("fine_tune_type", "num_layers", "lora_parameters", "learning_rate", "optimizer", "batch_size",
          "gradient_accumulation", "max_steps", "epochs", "max_seq_length", "mask_prompt", "pack", "seed")


def card_facts(cfg: Any, result: dict[str, Any], task: Any = None) -> dict[str, Any]:
    """What a card says about a finished :func:`~mlx_train.llm.finetune.finetune` run (``cfg``: its
    FinetuneConfig; ``task``: its task, by default the one ``result`` names, which adds its own facts).

    Example: ``card_facts(cfg, finetune(cfg))["metrics"]["val_loss"]``.
    """
    task = task or result.get("task") or task_for(cfg)
    hyper = {"train_mode": task.name, **{k: getattr(cfg, k) for k in _HYPER}}
    if cfg.fine_tune_type == "full":
        hyper.pop("lora_parameters")
    hyper.update(task.card_hyperparameters())
    metrics = {"steps": result["trainer"].step}
    for key, value in result.get("val_metrics", {}).items():
        if isinstance(value, float) and math.isfinite(value):
            metrics[f"val_{key}"] = round(value, 6)
    if "val_perplexity" in result:
        metrics["val_perplexity"] = round(result["val_perplexity"], 6)
    return {"base_model": cfg.model, "data": cfg.dataset, "method": cfg.fine_tune_type, "train_mode": task.name,
            "library": task.library, "hyperparameters": hyper, "metrics": metrics}


def _base_model_id(path: str) -> str:
    """A Hugging Face repo id stays as it is; a local directory or file is named by its base name."""
    return os.path.basename(os.path.normpath(path)) if os.path.exists(path) else path


def model_card(facts: dict[str, Any], fused: bool = False) -> str:
    """The card's text (see :func:`card_facts` for ``facts``)."""
    base, mode, method = facts["base_model"], facts["train_mode"], facts["method"]
    front = {"library_name": "mlx", "base_model": _base_model_id(base), "pipeline_tag": "text-generation",
             "tags": ["mlx", "mlx-train", method, mode] + (["fused"] if fused else [])}
    what = f"{method.upper() if method != 'full' else 'full'} fine-tuning, {mode.upper()}"
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {_base_model_id(base)} ({mode}, {method})", "",
             f"- **Base model:** `{base}`", f"- **Method:** {what}", f"- **Data:** `{facts['data']}`", "",
             "## Hyper-parameters", "", "| name | value |", "| --- | --- |"]
    lines += [f"| {k} | `{v}` |" for k, v in facts["hyperparameters"].items()]
    lines += ["", "## Final metrics", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in facts["metrics"].items()]
    usage = _vision_usage(base, fused) if facts.get("library") == "mlx-vlm" else _usage(base, fused)
    lines += ["", "## Use", "", *usage]
    return "\n".join(lines)


def _usage(base: str, fused: bool) -> list[str]:
    """How to load the result: mlx_lm.load reads a model directory (the fused model, or a base given as a
    directory or repo id) but not a ``.gguf`` file, which mlx_train.llm.load_model reads."""
    code = ["```python"]
    if fused:
        code += ["from mlx_lm import generate, load", "", 'model, tokenizer = load("path/to/this/directory")']
    elif str(base).endswith(".gguf"):
        code += ["from mlx_lm import generate", "from mlx_train.llm import load_adapters, load_model", "",
                 "# mlx_lm.load does not read .gguf files: mlx_train.llm.load_model does",
                 f'model, tokenizer, _ = load_model("{base}")',
                 'load_adapters(model, "path/to/this/directory")']
    else:
        code += ["from mlx_lm import generate, load", "",
                 f'model, tokenizer = load("{base}", adapter_path="path/to/this/directory")']
    code += ['print(generate(model, tokenizer, prompt="Hello"))', "```", ""]
    if str(base).endswith(".gguf") and not fused:
        code += ["For `mlx_lm.generate` on the command line, fuse the adapters into a model directory first "
                 "(`mlx-train finetune ... --fuse DIR`), or write the base as one with "
                 "`mlx_train.llm.save_model(*load_model(BASE), DIR)`.", ""]
    return code


def _vision_usage(base: str, fused: bool) -> list[str]:
    """How to load a vision-language model's adapters (or the model fused from them): mlx_vlm.load reads them."""
    load = 'load("path/to/this/directory")' if fused else f'load("{base}", adapter_path="path/to/this/directory")'
    return ["```python", "from mlx_vlm import generate, load", "", f"model, processor = {load}",
            'print(generate(model, processor, "Describe the picture.", image=["picture.png"]))', "```", ""]


def write_model_card(directory: str, facts: dict[str, Any], fused: bool = False) -> str:
    """Write ``directory/README.md`` and its facts as ``model_card.json`` (atomically); returns the
    card's path.

    Example: ``write_model_card("fused-model", facts, fused=True)``.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CARD_FILE)
    rundir.atomic_write(path, model_card(facts, fused))
    rundir.atomic_write_json(os.path.join(directory, FACTS_FILE), facts)
    return path


def write_fused_card(adapter_path: str, fused_path: str) -> str | None:
    """The card of the adapters in ``adapter_path``, written for the model fused from them (None when
    the adapters have no card).

    Example: ``write_fused_card("runs/a/adapters", "fused-model")``.
    """
    facts = rundir.read_json(os.path.join(adapter_path, FACTS_FILE))
    return write_model_card(fused_path, facts, fused=True) if isinstance(facts, dict) else None
