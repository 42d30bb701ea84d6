"""Reward functions for the GRPO tests (mlx-lm-lora's signature), and a minimal ``mlx_train.llm.rewards``
for a tree that does not have that module: ``install_rewards()`` puts it in place only where it is missing."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np


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


def install_rewards():
    """The project's reward module, or where the tree has none, a minimal one with its interface."""
    try:
        return importlib.import_module("mlx_train.llm.rewards")
    except ImportError:
        pass
    module = types.ModuleType("mlx_train.llm.rewards")

    class Scores:
        def __init__(self, total, per_function):
            self.total, self.per_function = total, per_function

    class RewardSet:
        def __init__(self, functions, weights):
            self.functions, self.weights = functions, weights
            self.names = [f.__name__ for f in functions]

        @classmethod
        def load(cls, names=None, file=None, weights=None):
            names = names.split(",") if isinstance(names, str) else list(names or ["grpo_rewards:letter_share"])
            functions = [getattr(importlib.import_module(n.split(":")[0]), n.split(":")[1]) for n in names]
            return cls(functions, [float(w) for w in (weights or [1.0] * len(functions))])

        def describe(self):
            return ", ".join(self.names)

        def score(self, prompts, completions, answers, types=None):
            per = {f.__name__: np.array([np.nan if v is None else float(v) for v in
                                         f(prompts=prompts, completions=completions, answer=answers, types=types)])
                   for f in self.functions}
            total = sum(np.nan_to_num(v) * w for v, w in zip(per.values(), self.weights, strict=True))
            return Scores(np.asarray(total, np.float64), per)

        def check(self, prompts, completions, answers, types=None):
            return self.score(prompts, completions or [""] * len(prompts), answers, types)

    module.RewardSet, module.Scores, module.RewardError = RewardSet, Scores, ValueError
    sys.modules["mlx_train.llm.rewards"] = module
    return module
