"""The reward of bench/grpo.py, one file for both trainers: ``--reward-functions-file bench/grpo_rewards.py
--reward-functions char_fraction``.

mlx-lm-lora finds reward functions through its registration decorator; mlx-train takes the module's
functions by name. Both call them as ``f(prompts, completions, answer, types=None) -> list[float]``.
Outside mlx-lm-lora the decorator is a no-op, so the file imports anywhere.

    char_fraction(["Q"], ["abc!"], ["abc"])   # [0.75]: 3 of the 4 characters are in the answer's set
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from mlx_lm_lora.trainer.grpo_reward_functions import register_reward_function
except ImportError:  # mlx-train, or any process without mlx-lm-lora

    def register_reward_function(name: str | None = None) -> Callable:
        return lambda function: function


@register_reward_function()
def char_fraction(prompts: list, completions: list, answer: list, types: list | None = None) -> list[float]:
    """The fraction of each completion's characters that appear in its row's ``answer`` (a set of
    characters): a dense reward that a policy raises by writing more of them. Empty completions: 0."""
    return [sum(c in set(a) for c in text) / max(len(text), 1) for text, a in zip(completions, answer, strict=True)]
