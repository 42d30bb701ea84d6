"""Reward functions for GRPO fine-tuning: the built-ins, and the helpers they read answers with.

A reward function scores a batch of completions: ``f(prompts, completions, answer, types=None)`` returns one
number per completion, in order (mlx-lm-lora's signature; each argument a list as long as ``completions``,
``answer`` the rows' ``"answer"`` column, ``types`` their ``"type"`` column or None), None where the reward
does not apply to that row.

Example::

    answer_match(["2+2?"], ["<think>easy</think><answer>4</answer>"], ["4"])    # [1.0]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

RewardFunction = Callable[..., Any]

# --- Reading answers ---------------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number in running text: "-3", "2.5", "1,000,000" (thousands groups of three), not the 2 of "x2".
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INTEGER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def extract_answer(completion: str) -> str:
    """The answer a completion gives: the text of its last ``<answer>...</answer>``, else its last number,
    else the whole completion (stripped).

    Example: ``extract_answer("<think>2+2</think><answer> 4 </answer>")`` -> ``"4"``;
    ``extract_answer("so the total is $1,250.")`` -> ``"1,250"``.
    """
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return str(tagged[-1]).strip()
    numbers = _NUMBER.findall(completion)
    return str(numbers[-1]) if numbers else completion.strip()


def _exact_number(text: str) -> Fraction | None:
    cleaned = text.strip().removeprefix("\\$").removeprefix("$").rstrip(".%").strip().replace(" ", "")
    if _THOUSANDS.fullmatch(cleaned):
        cleaned = cleaned.replace(",", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, else the last number in it, else None: ``"1,000"``, ``"1000.0"``,
    ``"$1000"`` and ``"1e3"`` all give 1000, ``"3/4"`` gives 3/4, ``"x = -5, so"`` gives -5.

    Example: ``parse_number("1,000") == parse_number("1000.0")`` -> True.
    """
    exact = _exact_number(text)
    if exact is not None:
        return exact
    numbers = _NUMBER.findall(text)
    return _exact_number(numbers[-1]) if numbers else None


def _normalised(text: str) -> str:
    return " ".join(text.split()).rstrip(".").casefold()


def answers_match(given: str, expected: str) -> bool:
    """Whether ``given`` states ``expected``: numerically when ``expected`` is a number (then the last number
    in ``given`` counts), else the same text ignoring case, spacing and a final full stop. An expected
    ``"... #### 72"`` (GSM8K's answer column) means ``"72"``.

    Example: ``answers_match("1,000", "1000.0")`` -> True; ``answers_match(" Paris.", "paris")`` -> True.
    """
    expected = expected.rpartition("####")[2]
    number = _exact_number(expected)
    if number is not None:
        return parse_number(given) == number
    return _normalised(given) == _normalised(expected)


# --- Built-in reward functions -----------------------------------------------------------------------------
# Each takes mlx-lm-lora's four arguments and returns one value per completion.

def answer_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | None],
                 types: Sequence[str | None] | None = None) -> list[float | None]:
    """1.0 where the completion's answer (:func:`extract_answer`) matches the ``answer`` column
    (:func:`answers_match`: numbers compared as numbers), else 0.0; None for a row without an answer.

    Example: ``answer_match(["?"] * 3, ["<answer>1,000</answer>", "so 999", "it is 1000.0"], ["1000"] * 3)``
    -> ``[1.0, 0.0, 1.0]``.
    """
    return [None if not expected else float(answers_match(extract_answer(text), expected))
            for text, expected in zip(completions, answer, strict=True)]


def think_answer_format(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | None],
                        types: Sequence[str | None] | None = None) -> list[float]:
    """1.0 where the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else
    (whitespace around and between allowed, both parts non-blank, no tag repeated), else 0.0.

    Example: ``think_answer_format(["?"] * 2, ["<think>2+2</think>\\n<answer>4</answer>", "<answer>4</answer>"],
    ["4"] * 2)`` -> ``[1.0, 0.0]``.
    """
    def follows(text: str) -> bool:
        match = _THINK_ANSWER.fullmatch(text)
        return match is not None and all(part.strip() and not any(tag in part for tag in _TAGS)
                                         for part in match.groups())
    return [float(follows(text)) for text in completions]


def integer_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | None],
                   types: Sequence[str | None] | None = None) -> list[float]:
    """1.0 where the completion's last ``<answer>...</answer>`` holds an integer (``"42"``, ``"-3"``,
    ``"1,000"``), else 0.0 (also without the tag). It does not look at the ``answer`` column.

    Example: ``integer_answer(["?"] * 3, ["<answer>42</answer>", "<answer>4.5</answer>", "42"], ["42"] * 3)``
    -> ``[1.0, 0.0, 0.0]``.
    """
    def holds_integer(text: str) -> bool:
        tagged = _ANSWER_TAG.findall(text)
        return bool(tagged) and _INTEGER.fullmatch(tagged[-1].strip()) is not None
    return [float(holds_integer(text)) for text in completions]


def length_penalty(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | None],
                   types: Sequence[str | None] | None = None) -> list[float]:
    """Kimi k1.5's length reward, between -0.5 and 0.5, among the completions of the same prompt.

    With ``L`` a completion's length in characters and ``shortest``, ``longest`` those of its group,
    ``lam = 0.5 - (L - shortest) / (longest - shortest)``: a correct answer (:func:`answer_match`) gets
    ``lam`` (the shortest +0.5, the longest -0.5), any other ``min(0, lam)`` (a long wrong answer is
    penalised, a short one not rewarded). A group whose completions are all as long gets 0.

    Example: ``length_penalty(["?"] * 3, ["4", "so 5.", "it was 4."], ["4"] * 3)`` -> ``[0.5, 0.0, -0.5]``.
    """
    correct = answer_match(prompts, completions, answer)
    lengths = [len(text) for text in completions]
    groups: dict[str, list[int]] = {}
    for position, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(position)
    scores = [0.0] * len(completions)
    for members in groups.values():
        shortest, longest = min(lengths[i] for i in members), max(lengths[i] for i in members)
        for i in members if longest > shortest else ():
            lam = 0.5 - (lengths[i] - shortest) / (longest - shortest)
            scores[i] = lam if correct[i] == 1.0 else min(0.0, lam)
    return scores


# mlx-lm-lora's built-ins, by their names and with their values, so that its runs mean the same here:
# the answer is the text after the last "<answer>" up to "</answer>" (the whole text without the tag).

def r1_extract_xml_answer(text: str) -> str:
    """mlx-lm-lora's answer extraction: ``"<answer> 4 </answer>"`` -> ``"4"``, ``"4 apples"`` -> ``"4 apples"``."""
    return text.rpartition("<answer>")[2].partition("</answer>")[0].strip()


def r1_accuracy_reward_func(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                            types: Sequence[str | None] | None = None) -> list[float]:
    """mlx-lm-lora's: 2.0 where :func:`r1_extract_xml_answer` equals the ``answer`` column exactly, else 0.0."""
    if not completions or not answer:
        return [0.0] * len(prompts)
    return [2.0 if given and given == expected else 0.0
            for given, expected in zip(map(r1_extract_xml_answer, completions), answer, strict=False)]


def r1_int_reward_func(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       types: Sequence[str | None] | None = None) -> list[float]:
    """mlx-lm-lora's: 0.5 where :func:`r1_extract_xml_answer` is all digits, else 0.0."""
    if not completions:
        return [0.0] * len(prompts)
    return [0.5 if r1_extract_xml_answer(text).isdigit() else 0.0 for text in completions]


def r1_soft_format_reward_func(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                               types: Sequence[str | None] | None = None) -> list[float]:
    """mlx-lm-lora's: 0.5 where the first ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` come in that
    order with non-blank text in both pairs, else 0.0."""
    if not completions:
        return [0.0] * len(prompts)

    def ordered(text: str) -> bool:
        starts = [text.find(tag) for tag in _TAGS]
        if -1 in starts or starts != sorted(set(starts)):
            return False
        thought, given = text[starts[0] + 7:starts[1]], text[starts[2] + 8:starts[3]]
        return bool(thought.strip() and given.strip())
    return [0.5 if ordered(text) else 0.0 for text in completions]


def r1_strict_format_reward_func(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                                 types: Sequence[str | None] | None = None) -> list[float]:
    """mlx-lm-lora's: 0.5 where a line holds ``<think> ... </think> <answer> ... </answer>`` with those single
    spaces, else 0.0."""
    if not completions:
        return [0.0] * len(prompts)
    pattern = re.compile(r"<think> .*? </think> <answer> .*? </answer>")
    return [0.5 if pattern.search(text) else 0.0 for text in completions]


def r1_count_xml(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                 types: Sequence[str | None] | None = None) -> list[float]:
    """mlx-lm-lora's: 0.125 for each of ``<think>\\n``, ``</think>``, ``<answer>``, ``</answer>`` found exactly
    once, less 0.001 per character after the last ``</answer>``, at least 0.0."""
    if not completions:
        return [0.0] * len(prompts)

    def count(text: str) -> float:
        found = sum(0.125 for tag in ("<think>\n", "</think>", "<answer>", "</answer>") if text.count(tag) == 1)
        return max(0.0, found - 0.001 * len(text.rpartition("</answer>")[2]))
    return [count(text) if text else 0.0 for text in completions]


_MLX_LM_LORA_BUILTINS: dict[str, RewardFunction] = {
    f.__name__: f for f in (r1_accuracy_reward_func, r1_int_reward_func, r1_strict_format_reward_func,
                            r1_soft_format_reward_func, r1_count_xml)}

#: Every built-in reward function by name: this module's, then mlx-lm-lora's (``r1_*``).
BUILTINS: dict[str, RewardFunction] = {
    "answer_match": answer_match, "think_answer_format": think_answer_format,
    "integer_answer": integer_answer, "length_penalty": length_penalty, **_MLX_LM_LORA_BUILTINS}

#: The reward functions used when none are named, with their weights (when no weights are given).
DEFAULT_REWARDS: dict[str, float] = {"answer_match": 1.0, "think_answer_format": 0.5}

#: mlx-lm-lora's default set (its ``--reward-functions`` default), for ``RewardSet.load(MLX_LM_LORA_DEFAULTS)``.
MLX_LM_LORA_DEFAULTS = tuple(_MLX_LM_LORA_BUILTINS)
