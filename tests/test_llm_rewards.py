"""GRPO reward functions: the built-ins on tricky completions, and mlx-lm-lora's built-ins with its values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("mlx_lm")  # mlx_train.llm needs the llm extra

from mlx_train.llm.rewards import (  # noqa: E402
    BUILTINS,
    MLX_LM_LORA_DEFAULTS,
    answer_match,
    answers_match,
    extract_answer,
    integer_answer,
    length_penalty,
    parse_number,
    think_answer_format,
)

# --- the built-ins ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, expected", [
    ("<think>2+2</think><answer> 4 </answer>", "4"),
    ("<answer>put it here</answer> ... <answer>\n7\n</answer>", "7"),   # the last tag, multi-line
    ("<think>maybe 3</think><answer>12", "12"),                        # unclosed tag: the last number
    ("the total is $1,250.", "1,250"),
    ("from 5-3 we get -2, so x = -7", "-7"),
    ("v2 of step3 gives 2.5 apples", "2.5"),                           # "2" of "v2" is no number
    ("lists 1,2,3", "3"),
    ("1,000, 2,000", "2,000"),
    ("  Paris  ", "Paris"),                                            # no tag, no number: the text
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("text, number", [
    ("1,000", 1000), ("1000.0", 1000), ("$1,000", 1000), ("\\$5", 5), ("1e3", 1000), ("3/4", Fraction(3, 4)),
    ("0.75", Fraction(3, 4)), ("-12", -12), ("50%", 50), ("42.", 42), ("x = -5, so", -5), ("abc", None),
    ("1,0000", 0),  # not thousands: the last number is "0000"
])
def test_parse_number(text, number):
    assert parse_number(text) == number


@pytest.mark.parametrize("given, expected, match", [
    ("1,000", "1000.0", True), ("1000", "1,000", True), ("999.99", "1000", False), ("0.5", "1/2", True),
    ("The answer: 72", "Janet sells 16 - 3 - 4 = 9 eggs ... #### 72", True),   # GSM8K's answer column
    (" Paris.", "paris", True), ("Paris, France", "Paris", False), ("no number", "5", False),
])
def test_answers_match(given, expected, match):
    assert answers_match(given, expected) is match


def test_answer_match_scores_numbers_numerically_and_skips_rows_without_an_answer():
    completions = ["<think>..</think><answer>1,000</answer>", "so 999", "it is 1000.0", "<answer>1000</answer>"]
    assert answer_match(["?"] * 4, completions, ["1000", "1000", "1000", ""]) == [1.0, 0.0, 1.0, None]
    # the tag wins over a later number outside it
    assert answer_match(["?"], ["<answer>5</answer> (checked with 6)"], ["5"]) == [1.0]


@pytest.mark.parametrize("completion, score", [
    ("<think>2+2</think><answer>4</answer>", 1.0),
    ("\n<think>\nsum\n</think>\n\n<answer> 4 </answer>\n", 1.0),
    ("<answer>4</answer>", 0.0),                                           # no thinking
    ("<think> </think><answer>4</answer>", 0.0),                           # blank thinking
    ("<think>a</think><answer>4</answer> and more", 0.0),                  # text after
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),         # two answers
    ("<think>a<think>b</think><answer>4</answer>", 0.0),                   # a repeated tag
    ("<answer>4</answer><think>a</think>", 0.0),                           # wrong order
])
def test_think_answer_format(completion, score):
    assert think_answer_format(["?"], [completion], ["4"]) == [score]


def test_integer_answer_looks_only_inside_the_tag():
    completions = ["<answer>42</answer>", "<answer>-3</answer>", "<answer>1,000</answer>", "<answer>4.5</answer>",
                   "<answer>42 apples</answer>", "42"]
    assert integer_answer(["?"] * 6, completions, [""] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_length_penalty_ranks_lengths_within_each_prompts_group():
    prompts = ["a", "a", "a", "b", "b", "c"]
    completions = ["4", "so 5.", "it was 4.", "4", "5", "4"]   # group a: lengths 1, 5, 9
    answers = ["4", "4", "4", "4", "4", "4"]
    # a: shortest correct +0.5, middle wrong lam 0 -> 0, longest correct -0.5; b, c: equal lengths -> 0
    assert length_penalty(prompts, completions, answers) == [0.5, 0.0, -0.5, 0.0, 0.0, 0.0]
    # a wrong answer is never rewarded for being short: min(0, lam)
    assert length_penalty(["a", "a"], ["5", "it was 4."], ["4", "4"]) == [0.0, -0.5]


def test_mlx_lm_lora_builtins_have_its_values():
    prompts, answers = ["?"] * 4, ["4"] * 4
    completions = ["<think>\nok\n</think>\n<answer>4</answer>", "<think> ok </think> <answer> 4 </answer>",
                   "4", "<answer>4.0</answer>tail"]
    assert BUILTINS["r1_accuracy_reward_func"](prompts, completions, answers) == [2.0, 2.0, 2.0, 0.0]
    assert BUILTINS["r1_int_reward_func"](prompts, completions, answers) == [0.5, 0.5, 0.5, 0.0]
    assert BUILTINS["r1_strict_format_reward_func"](prompts, completions, answers) == [0.0, 0.5, 0.0, 0.0]
    assert BUILTINS["r1_soft_format_reward_func"](prompts, completions, answers) == [0.5, 0.5, 0.0, 0.0]
    assert BUILTINS["r1_count_xml"](prompts, completions, answers) == [0.5, 0.375, 0.0, 0.246]
    assert BUILTINS["r1_accuracy_reward_func"](["?", "?"], ["4", "4"], []) == [0.0, 0.0]


def test_mlx_lm_lora_builtins_agree_with_mlx_lm_lora():
    theirs = pytest.importorskip("mlx_lm_lora.trainer.grpo_reward_functions")
    tags = ["<think>", "</think>", "<answer>", "</answer>"]
    fills = ["", " ", "\n", " 4 ", "x", "42", "<answer>", "\n\n", "  b c "]
    rng = np.random.default_rng(0)
    completions = ["".join(fills[rng.integers(len(fills))] + tag for tag in rng.permutation(tags)
                           if rng.random() < 0.9) for _ in range(3000)]
    answers = [["4", "42", "x", ""][rng.integers(4)] for _ in completions]
    for name in MLX_LM_LORA_DEFAULTS:
        prompts = ["?"] * len(completions)
        assert BUILTINS[name](prompts, completions, answers) == getattr(theirs, name)(prompts, completions, answers)
