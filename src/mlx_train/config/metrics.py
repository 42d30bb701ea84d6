"""Which way a metric improves, from its name: the one rule in mlx-train (checkpoints, early stopping,
the monitor).

Example: ``metric_direction("val_loss"), metric_direction("val_f1")`` -> ``("min", "max")``.
"""

from __future__ import annotations

import re
import warnings

from mlx_train.errors import ConfigError

# Metric-name words that say which way is better; a word is a run of letters and digits.
_HIGHER = re.compile(r"acc\w*|f\d*|f1\w*|precision|recall|auc\w*|ap|map|ndcg\w*|bleu\w*|rouge\w*|iou|miou|"
                     r"dice|r2|top\d+|score|reward\w*|return|psnr|ssim|correct|hits?")
_LOWER = re.compile(r"loss\w*|errors?|err|perplexity|ppl|mse|mae|rmse|mape|nll|wer|cer|kl|fid|time|seconds|"
                    r"latency|distance")


def metric_direction(name: str, mode: str = "auto") -> str:
    """``"min"`` or ``"max"``: which way metric ``name`` improves. The one rule in mlx-train.

    An explicit ``mode`` (``"min"``/``"max"``) wins. With ``"auto"``, a name with a loss-like
    word (loss, error, perplexity, mse, ...) goes down; one with a score-like word (accuracy,
    f1, precision, recall, auc, bleu, ...) goes up; any other name is taken to go down, like a
    loss, with a warning (set ``mode`` for such metrics).

    Example::

        metric_direction("val_loss"), metric_direction("val_f1")        # ("min", "max")
        metric_direction("val_reward", mode="max")                      # "max"
    """
    if mode not in ("auto", "min", "max"):
        raise ConfigError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
    if mode != "auto":
        return mode
    words = re.findall(r"[a-z0-9]+", name.lower())
    if any(_LOWER.fullmatch(word) for word in words):
        return "min"
    if any(_HIGHER.fullmatch(word) for word in words):
        return "max"
    warnings.warn(f"mode='auto' cannot tell which way metric '{name}' improves: taking lower as better; "
                  "pass mode='max' or mode='min'", stacklevel=2)
    return "min"
