"""Fine-tuning vision-language models (mlx-vlm's Qwen2-VL family) on rows with images.

Needs the ``vlm`` extra (``pip install 'mlx-train[vlm]'``: mlx-vlm) to train; recognising a
vision-language model (``vision_model_type``) and refusing image rows for a text-only model
(``refuse_image_rows``) need nothing more than the ``llm`` extra. ``mlx-train finetune`` picks the
vision task (``mlx_train.llm.tasks.VisionSFT``) by itself when ``--model`` is a vision-language model.

Example::

    from mlx_train.llm.vision import vision_model_type
    vision_model_type("Qwen2-VL-2B-Instruct")      # "qwen2_vl"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.llm.vision.data import ImageChatRows, build_splits, refuse_image_rows
    from mlx_train.llm.vision.loss import vision_lm_loss
    from mlx_train.llm.vision.models import load, vision_model_type

__all__ = ["ImageChatRows", "build_splits", "load", "refuse_image_rows", "vision_lm_loss", "vision_model_type"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "ImageChatRows": "mlx_train.llm.vision.data", "build_splits": "mlx_train.llm.vision.data",
    "refuse_image_rows": "mlx_train.llm.vision.data", "vision_lm_loss": "mlx_train.llm.vision.loss",
    "load": "mlx_train.llm.vision.models", "vision_model_type": "mlx_train.llm.vision.models",
})
