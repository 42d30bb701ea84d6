"""The next-token loss of a vision-language model on a batch of rows with images.

A batch is what ``mlx_train.llm.data.collate`` makes of ``ImageChatRows``: the token arrays padded on the
right, and each row's image patches padded to the batch's most (``pixel_values``: ``[rows, patches,
features]``; ``image_grid_thw``: ``[rows, images, 3]``, zeros for padding), so that a batch splits into
micro-batches by rows like any other. The loss takes the padding off again (each row's patch count is
the product of its images' ``t x h x w``), hands the model the patches of all images in row order, and
averages the cross-entropy over the trained targets (``loss_mask``). Right padding leaves the rows'
tokens, positions and logits as they are alone; the attention mask keeps the padding out of the rotary
positions.

Example::

    loss, tokens = vision_lm_loss(model, batch)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_train.llm.preference import PreferenceLoss, both_sequences
from mlx_train.llm.vision.models import reset_position_caches


def image_inputs(batch: dict[str, Any]) -> dict[str, mx.array]:
    """The model's image arguments for ``batch``: the patches of every image, row after row, and one
    ``image_grid_thw`` row per image; {} for a batch without images."""
    pixels = batch.get("pixel_values")
    if pixels is None or pixels.shape[1] == 0:
        return {}
    grid = np.array(batch["image_grid_thw"])  # read to Python: the model reads these too
    patches = grid.prod(axis=-1)  # [rows, images], 0 for padding
    parts = [pixels[i, : int(n)] for i, n in enumerate(patches.sum(axis=-1)) if n > 0]
    if not parts:
        return {}
    return {"pixel_values": mx.concatenate(parts), "image_grid_thw": mx.array(grid[patches > 0])}


def vision_lm_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy over the targets where ``loss_mask`` is 1, and how many there are (an mlx-lm style
    loss: the Trainer weights gradient accumulation by the count).

    Example: ``loss, tokens = vision_lm_loss(model, batch)``.
    """
    images = image_inputs(batch)
    reset_position_caches(model)
    output = model(batch["inputs"], images.pop("pixel_values", None), mask=batch["attention_mask"], **images)
    reset_position_caches(model)  # the model's state keeps no array of this call (models.reset_position_caches)
    logits = getattr(output, "logits", output).astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, batch["targets"], reduction="none")
    weights = batch["loss_mask"].astype(mx.float32)
    tokens = weights.sum()
    return (losses * weights).sum() / mx.maximum(tokens, 1.0), tokens


def pair_logps(model: nn.Module, batch: dict[str, Any], after: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Summed reply log-probabilities and reply token counts of a batch of preference pairs with images
    (``mlx_train.llm.vision.data.ImagePairRows``), chosen rows then rejected rows (``[2 * pairs]`` each), from
    one forward pass over both; each pair's pictures are shown to both of its sequences. The pass starts once
    ``after`` is computed (see ``mlx_train.llm.preference.sequence_logps``).

    Example: ``logps, tokens = pair_logps(model, batch); chosen = logps[:len(logps) // 2]``.
    """
    inputs, targets, mask = both_sequences(batch, after)
    # right padding: a row's tokens run to its last scored target (the reply ends the sequence)
    attention = (mx.cumsum(mask[:, ::-1], axis=1)[:, ::-1] > 0).astype(mx.int32)
    images = image_inputs(batch)
    pixels = images.get("pixel_values")
    if pixels is not None:
        pixels = mx.concatenate([pixels, pixels])
        images = {"image_grid_thw": mx.concatenate([images["image_grid_thw"], images["image_grid_thw"]])}
    reset_position_caches(model)
    output = model(inputs, pixels, mask=attention, **images)
    reset_position_caches(model)
    logits = getattr(output, "logits", output).astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)
    return (picked * mask).sum(axis=-1), mask.sum(axis=-1)


class VisionPreferenceLoss(PreferenceLoss):
    """DPO, ORPO or CPO (``mlx_train.llm.preference.PreferenceLoss``: the same losses, rewards and metrics) on
    preference pairs with images: the log-probabilities come from :func:`pair_logps`.

    Example: ``loss, pairs, metrics = VisionPreferenceLoss(PreferenceConfig("dpo"))(model, batch)``.
    """

    def sequence_logps(self, model: nn.Module, batch: dict[str, Any], after: mx.array | None = None,
                       grad: bool = True) -> tuple[mx.array, mx.array]:
        return pair_logps(model, batch, after)
