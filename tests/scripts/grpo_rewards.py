"""Reward functions for the GRPO tests (mlx-lm-lora's signature)."""

from __future__ import annotations


def letter_share(prompts, completions, answer, types=None):
    """A dense reward: the share of the completion's characters that are the answer's first letter."""
    return [sum(ch == a[:1] for ch in c) / max(len(c), 1) for c, a in zip(completions, answer, strict=True)]


def text_length(prompts, completions, answer, types=None):
    """A reward that differs between almost any two completions: their length in characters, over 100."""
    return [len(c) / 100 for c in completions]


def says_answer(prompts, completions, answer, types=None):
    """1.0 when the completion contains the answer, else 0.0; None (does not apply) for rows of type "open"."""
    kinds = types or [None] * len(completions)
    return [None if k == "open" else float(a in c) for c, a, k in zip(completions, answer, kinds, strict=True)]
