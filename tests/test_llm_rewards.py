"""GRPO reward functions: the built-ins on tricky completions, loading a user's functions (a file, an
mlx-lm-lora reward file, module:function, path:function), weights, scores and metrics, and the errors a
broken function gets before training."""

from __future__ import annotations

import functools
import re
import sys
import textwrap
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("mlx_lm")  # mlx_train.llm needs the llm extra

from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import rewards  # noqa: E402
from mlx_train.llm.rewards import (  # noqa: E402
    BUILTINS,
    DEFAULT_REWARDS,
    MLX_LM_LORA_DEFAULTS,
    RewardError,
    RewardSet,
    answer_match,
    answers_match,
    extract_answer,
    integer_answer,
    length_penalty,
    parse_number,
    think_answer_format,
)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


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


# --- loading ------------------------------------------------------------------------------------------------

def test_default_set_and_names_weights_as_strings_or_lists():
    default = RewardSet.load()
    assert default.names == list(DEFAULT_REWARDS) == ["answer_match", "think_answer_format"]
    assert default.weights == [1.0, 0.5]
    assert default.describe() == "answer_match x1 (built-in), think_answer_format x0.5 (built-in)"
    assert RewardSet.load(None, weights="2,1").weights == [2.0, 1.0]   # the default set, weighed
    named = RewardSet.load(" answer_match, integer_answer ,", weights="[1.0, -0.5]")
    assert named.names == ["answer_match", "integer_answer"] and named.weights == [1.0, -0.5]
    assert RewardSet.load(["answer_match", "length_penalty"]).weights == [1.0, 1.0]
    assert RewardSet.load(MLX_LM_LORA_DEFAULTS).names == list(MLX_LM_LORA_DEFAULTS)


def test_weights_must_be_one_finite_number_per_function():
    with pytest.raises(RewardError, match=r"3 reward weights for 2 reward functions \(answer_match, integer_answer\); "
                                          "give one weight per function"):
        RewardSet.load("answer_match,integer_answer", weights="1,2,3")
    with pytest.raises(RewardError, match="reward weight 'abc' is not a number"):
        RewardSet.load("answer_match", weights="abc")
    with pytest.raises(RewardError, match="reward weight 'inf' is not finite"):
        RewardSet.load("answer_match", weights="inf")
    with pytest.raises(RewardError, match="'answer_match' is named twice"):
        RewardSet.load("answer_match,answer_match")


def test_an_unknown_name_lists_what_there_is():
    with pytest.raises(RewardError, match=r"unknown reward function 'answer_mach' \(did you mean 'answer_match'\?\); "
                                          "built-ins: answer_match, think_answer_format"):
        RewardSet.load("answer_mach")
    assert issubclass(RewardError, ConfigError)   # the CLI prints it as one line, exit code 2


def test_a_reward_file_registers_functions_and_hides_builtins(tmp_path):
    file = write(tmp_path / "my_rewards.py", """
        from mlx_train.llm.rewards import register_reward_function

        @register_reward_function()
        def short(prompts, completions, answer, types=None):
            return [1.0 if len(c) < 5 else 0.0 for c in completions]

        @register_reward_function("answer_match")      # registered under a built-in's name: the file wins
        def exact(prompts, completions, answer, types=None):
            return [float(c == a) for c, a in zip(completions, answer)]

        def plain(completions, answer):                # not registered: usable by name
            return [0.25] * len(completions)
        """)
    registered = RewardSet.load(file=file)
    assert registered.names == ["short", "answer_match"]
    assert registered.rewards[0].where == f"{tmp_path / 'my_rewards.py'}:5"   # the def, past the decorator
    assert registered.score(["?"] * 2, ["4", "1,000 it is"], ["4", "1000"]).total.tolist() == [2.0, 0.0]
    named = RewardSet.load("plain,integer_answer", file=file)
    assert named.score(["?"], ["<answer>3</answer>"], ["3"]).total.tolist() == [1.25]
    with pytest.raises(RewardError, match=r"unknown reward function 'plian' \(did you mean 'plain'\?\); .*"
                                          r"my_rewards.py has: short, answer_match, exact, plain; built-ins: "):
        RewardSet.load("plian", file=file)


def test_an_mlx_lm_lora_reward_file_works_without_mlx_lm_lora(tmp_path):
    names = ("mlx_lm_lora", "mlx_lm_lora.trainer", "mlx_lm_lora.trainer.grpo_reward_functions")
    before = {name: sys.modules.get(name) for name in names}
    file = write(tmp_path / "lora_rewards.py", """
        import re
        from mlx_lm_lora.trainer.grpo_reward_functions import (
            r1_accuracy_reward_func, r1_extract_xml_answer, register_reward_function)

        @register_reward_function()
        def has_units(prompts: list, completions: list, answer: list, types: list | None = None) -> list[float]:
            return [0.5 if re.search(r"\\bkm\\b", r1_extract_xml_answer(c)) else 0.0 for c in completions]

        @register_reward_function("accuracy_twice")
        def accuracy_twice(prompts, completions, answer, types=None):
            return [2 * r for r in r1_accuracy_reward_func(prompts, completions, answer, types)]
        """)
    loaded = RewardSet.load("has_units,accuracy_twice,r1_soft_format_reward_func", file=file, weights="1.0,1.0,2.0")
    scores = loaded.score(["how far?"] * 2, ["<think>walk</think><answer>5 km</answer>", "<answer>5</answer>"],
                          ["5 km", "5 km"])
    assert scores.per_function["has_units"].tolist() == [0.5, 0.0]
    assert scores.per_function["accuracy_twice"].tolist() == [4.0, 0.0]
    assert scores.total.tolist() == [0.5 + 4.0 + 2.0 * 0.5, 0.0]
    # the stand-ins are gone again (or the real modules back), here and after the other tests' files
    assert {name: sys.modules.get(name) for name in names} == before
    assert [name for name in names if name in sys.modules and not hasattr(sys.modules[name], "__file__")] == []


def test_a_reward_file_importing_more_of_mlx_lm_lora_says_what_to_change(tmp_path):
    file = write(tmp_path / "lora_utils.py", """
        from mlx_lm_lora.trainer.grpo_reward_functions import register_reward_function
        from mlx_lm_lora.utils import something
        """)
    where = re.escape(f"{tmp_path}/lora_utils.py:3")
    with pytest.raises(RewardError, match=rf"reading reward functions file {where} failed: ModuleNotFoundError: "
                                          r".*mlx_lm_lora.utils.*; of mlx-lm-lora, a reward file can import only "
                                          r".*register_reward_function and r1_\* functions"):
        RewardSet.load("x", file=file)


def test_a_reward_file_that_does_not_load_names_its_line(tmp_path):
    with pytest.raises(RewardError, match=r"reward functions file 'missing.py' does not exist"):
        RewardSet.load(file="missing.py")
    broken = write(tmp_path / "broken.py", "def f(completions):\n    return [1.0 for c in completions\n")
    with pytest.raises(RewardError, match=r"broken.py:2 failed: SyntaxError"):
        RewardSet.load(file=broken)
    failing = write(tmp_path / "failing.py", "import math\nLIMIT = math.sqrt(-1)\n")
    with pytest.raises(RewardError, match=r"failing.py:2 failed: ValueError: math domain error; fix the file"):
        RewardSet.load(file=failing)
    empty = write(tmp_path / "empty.py", "def helper(completions):\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"empty.py registers no reward function: decorate them with "
                                          r"@register_reward_function\(\), or name them"):
        RewardSet.load(file=empty)


def test_path_and_module_colon_function(tmp_path, monkeypatch):
    write(tmp_path / "extra_rewards.py", """
        def brevity(completions, **kwargs):           # TRL's signature: the rest comes as keywords
            return [1.0 / (1 + len(c)) if kwargs["answer"] else None for c in completions]
        """)
    loaded = RewardSet.load([f"{tmp_path}/extra_rewards.py:brevity"])
    assert loaded.names == ["brevity"] and loaded.rewards[0].keywords == rewards.ARGUMENTS
    assert loaded.score(["?"] * 2, ["abc", ""], ["x", "y"]).total.tolist() == [0.25, 1.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert RewardSet.load("extra_rewards:brevity").names == ["brevity"]
    with pytest.raises(RewardError, match=r"extra_rewards.py has no function 'brevty' \(did you mean 'brevity'\?\); "
                                          "it has: brevity"):
        RewardSet.load(f"{tmp_path}/extra_rewards.py:brevty")
    with pytest.raises(RewardError, match=r"module extra_rewards \(.*extra_rewards.py\) has no function 'nope'"):
        RewardSet.load("extra_rewards:nope")
    with pytest.raises(RewardError, match=r"importing module 'no_such_module_here' failed: ModuleNotFoundError"):
        RewardSet.load("no_such_module_here:f")


def test_callables_and_signatures(tmp_path):
    def completions_and_answer(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]
    loaded = RewardSet.load([completions_and_answer, "answer_match"], weights=[0.5, 1.0])
    assert loaded.rewards[0].keywords == ("completions", "answer")
    assert loaded.score(["?"], ["7"], ["7"]).total.tolist() == [1.5]
    half = functools.partial(lambda completions, scale: [scale] * len(completions), scale=0.5)
    assert RewardSet.load([half]).score(["?"], ["7"], ["7"]).per_function["partial"].tolist() == [0.5]

    file = write(tmp_path / "signatures.py", """
        def plural(prompts, completions, answers, types=None):
            return [0.0] * len(completions)

        def no_completions(prompts, texts):
            return [0.0] * len(texts)
        """)
    where = re.escape(f"{tmp_path}/signatures.py:2")
    with pytest.raises(RewardError, match=rf"reward function 'plural' \({where}\) needs an argument 'answers' "
                                          r"that is not passed \(did you mean 'answer'\?\): "
                                          "a reward function is called with the keywords prompts, completions, "
                                          "answer, types"):
        RewardSet.load("plural", file=file)
    with pytest.raises(RewardError, match=r"'no_completions' \(.*signatures.py:5\) needs an argument 'texts'"):
        RewardSet.load("no_completions", file=file)


# --- scoring ------------------------------------------------------------------------------------------------

def test_scores_weigh_functions_and_report_metrics():
    loaded = RewardSet.load("answer_match,think_answer_format", weights="1.0,0.5")
    scores = loaded.score(["a", "a", "b", "b"], ["<think>x</think><answer>4</answer>", "4", "5", "<answer>5</answer>"],
                          ["4", "4", "4", "4"])
    assert scores.total.dtype == np.float64
    assert scores.total.tolist() == [1.5, 1.0, 0.0, 0.0]
    assert scores.per_function["think_answer_format"].tolist() == [1.0, 0.0, 0.0, 0.0]
    metrics = scores.metrics()
    assert metrics == pytest.approx({
        "reward_mean": 0.625, "reward_std": float(np.std([1.5, 1.0, 0.0, 0.0])),
        "reward_answer_match_mean": 0.5, "reward_answer_match_std": 0.5, "reward_answer_match_coverage": 1.0,
        "reward_think_answer_format_mean": 0.25, "reward_think_answer_format_std": float(np.std([1, 0, 0, 0])),
        "reward_think_answer_format_coverage": 1.0})
    assert all(type(value) is float for value in metrics.values())   # JSON-friendly


def test_none_and_nan_mean_not_applicable(tmp_path):
    file = write(tmp_path / "typed.py", """
        import math

        def math_only(prompts, completions, answer, types=None):
            return [1.0 if t == "math" else None for t in types]

        def code_only(prompts, completions, answer, types=None):
            return [0.5 if t == "code" else math.nan for t in types]

        def nothing(prompts, completions, answer, types=None):
            return None
        """)
    loaded = RewardSet.load("math_only,code_only,nothing", file=file)
    scores = loaded.score(["?"] * 3, ["a", "b", "c"], ["", "", ""], ["math", "code", "math"])
    assert scores.total.tolist() == [1.0, 0.5, 1.0]
    assert np.isnan(scores.per_function["math_only"]).tolist() == [False, True, False]
    metrics = scores.metrics()
    assert metrics["reward_math_only_mean"] == 1.0 and metrics["reward_math_only_std"] == 0.0
    assert metrics["reward_math_only_coverage"] == pytest.approx(2 / 3)
    assert metrics["reward_code_only_coverage"] == pytest.approx(1 / 3)
    assert (metrics["reward_nothing_mean"], metrics["reward_nothing_coverage"]) == (0.0, 0.0)
    with pytest.raises(RewardError, match=r"no reward function scored completion 1 \(type 'poetry'\): every one "
                                          r"returned None or NaN for it \(math_only, code_only, nothing\)"):
        loaded.score(["?"] * 2, ["a", "b"], ["", ""], ["math", "poetry"])


BAD_FUNCTIONS = """
    import math

    def raises(prompts, completions, answer, types=None):
        return [1.0 / len(c) for c in completions]

    def too_few(prompts, completions, answer, types=None):
        return [1.0]

    def text(prompts, completions, answer, types=None):
        return ["1.0" for _ in completions]

    def infinite(prompts, completions, answer, types=None):
        return [0.0, math.inf][:len(completions)]

    def scalar(prompts, completions, answer, types=None):
        return 1.0
    """


@pytest.mark.parametrize("name, line, problem", [
    ("raises", 4, r"raised ZeroDivisionError: float division by zero \(at .*bad.py:5\); fix it, or return None "),
    ("too_few", 7, r"returned 1 values for 2 completions; return one number per completion, in order"),
    ("text", 10, r"returned str '1.0' for completion 0; return numbers \(None where it does not apply\)"),
    ("infinite", 13, r"returned inf for completion 1; return finite numbers \(None or NaN where it does not apply\)"),
    ("scalar", 16, r"returned float 1.0; return a list of 2 numbers, one per completion"),
])
def test_a_broken_function_fails_with_its_name_file_and_line(tmp_path, name, line, problem):
    file = write(tmp_path / "bad.py", BAD_FUNCTIONS)
    loaded = RewardSet.load(name, file=file)
    where = re.escape(f"{tmp_path}/bad.py:{line}")
    with pytest.raises(RewardError, match=rf"^reward function '{name}' \({where}\) {problem}"):
        loaded.score(["?"] * 2, ["a", ""], ["1", "1"])
    with pytest.raises(RewardError, match=rf"^checking the reward functions before training on 6 sample completions: "
                                          rf"reward function '{name}' \({where}\) "):
        loaded.check(["2+2?", "3+3?"], None, ["4", "6"])   # the made-up completions include an empty one


def test_check_passes_good_functions_and_returns_their_scores():
    scores = RewardSet.load().check(["2+2?"], None, ["4"], ["math"])
    assert scores.total.tolist() == [1.5, 0.0, 0.0]   # the well-formed made-up completion, then "" and text
    scores = RewardSet.load("answer_match").check(["2+2?"], ["<answer>4</answer>"], ["4"])
    assert scores.total.tolist() == [1.0]


def test_score_takes_one_entry_per_completion_in_each_list():
    with pytest.raises(ValueError, match="one entry per completion in each list: 2 completions, 1 prompts, 2 answers, "
                                         "3 types"):
        RewardSet.load().score(["?"], ["a", "b"], ["1", "2"], [None, None, None])
    assert RewardSet.load().score([], [], []).metrics()["reward_mean"] == 0.0   # no NaN in the metrics
