"""Fine-tuning vision-language models (mlx-vlm's Qwen2-VL family) on rows with images.

Needs the ``vlm`` extra (``pip install 'mlx-train[vlm]'``: mlx-vlm) to train; recognising a
vision-language model (``vision_model_type``) and refusing image rows for a text-only model
(``refuse_image_rows``) need nothing more than the ``llm`` extra. ``mlx-train finetune`` picks the
vision tasks (``mlx_train.llm.tasks.VisionSFT``; ``VisionPreference`` for ``--train-mode dpo``, ``orpo`` or
``cpo``) by itself when ``--model`` is a vision-language model.

Example::

    from mlx_train.llm.vision import vision_model_type
    vision_model_type("Qwen2-VL-2B-Instruct")      # "qwen2_vl"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.llm.vision.data import ImageChatRows, ImagePairRows, build_splits, refuse_image_rows
    from mlx_train.llm.vision.loss import VisionPreferenceLoss, pair_logps, vision_lm_loss
    from mlx_train.llm.vision.models import fuse, load, vision_model_type

__all__ = ["ImageChatRows", "ImagePairRows", "VisionPreferenceLoss", "build_splits", "fuse", "load", "pair_logps",
           "refuse_image_rows", "vision_lm_loss", "vision_model_type"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "ImageChatRows": "mlx_train.llm.vision.data", "ImagePairRows": "mlx_train.llm.vision.data",
    "build_splits": "mlx_train.llm.vision.data", "refuse_image_rows": "mlx_train.llm.vision.data",
    "vision_lm_loss": "mlx_train.llm.vision.loss", "pair_logps": "mlx_train.llm.vision.loss",
    "VisionPreferenceLoss": "mlx_train.llm.vision.loss", "fuse": "mlx_train.llm.vision.models",
    "load": "mlx_train.llm.vision.models", "vision_model_type": "mlx_train.llm.vision.models",
})
