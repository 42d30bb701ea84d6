"""Reward functions for GRPO fine-tuning: the built-ins, loading a user's own, and scoring completions.

A reward function scores a batch of completions: ``f(prompts, completions, answer, types=None)`` returns one
number per completion, in order (mlx-lm-lora's signature; each argument a list as long as ``completions``,
``answer`` the rows' ``"answer"`` column, ``types`` their ``"type"`` column or None). It is called with
those four keywords, so a function may take any of them (it must take ``completions``), and TRL's
``f(completions, **kwargs)`` works too (it gets the same four keywords, not TRL's ``completion_ids`` or
``trainer_state``, and completions as text, never as chat messages).

A value may be None (or NaN) where the reward does not apply to that row: it counts 0 in the total and
is left out of that function's mean and std (``reward_<name>_coverage`` says how many rows it scored).
An infinite value, a wrong count, a non-number or an exception is a :class:`RewardError` naming the
function, its file and line, and how to fix it. A completion that no function scores is an error too.

A reward file is a Python file; its functions are named in ``--reward-functions`` or, when none are
named, the ones it registers with ``@register_reward_function()`` are used (mlx-lm-lora uses its default
set then). mlx-lm-lora's reward files work unchanged: while one is read, ``from
mlx_lm_lora.trainer.grpo_reward_functions import register_reward_function`` (and its ``r1_*``
functions) gets this module's, whether mlx-lm-lora is installed or not.

Example::

    rewards = RewardSet.load("answer_match,think_answer_format", weights="1.0,0.5")
    scores = rewards.score(["2+2?"], ["<think>easy</think><answer>4</answer>"], ["4"])
    scores.total            # array([1.5])
    scores.metrics()        # {"reward_mean": 1.5, "reward_std": 0.0, "reward_answer_match_mean": 1.0, ...}
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import linecache
import math
import re
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from mlx_train.errors import ConfigError, did_you_mean

RewardFunction = Callable[..., Any]
_F = TypeVar("_F", bound=RewardFunction)
Floats = npt.NDArray[np.float64]

#: The keywords a reward function is called with (mlx-lm-lora's names).
ARGUMENTS = ("prompts", "completions", "answer", "types")


class RewardError(ConfigError):
    """A reward function cannot be found or loaded, or returned something that is not a reward."""


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


# --- Reward files ------------------------------------------------------------------------------------------

_registering: dict[str, RewardFunction] | None = None  # the registry of the reward file being read


@overload
def register_reward_function(name: _F) -> _F: ...
@overload
def register_reward_function(name: str | None = None) -> Callable[[_F], _F]: ...
def register_reward_function(name: str | _F | None = None) -> _F | Callable[[_F], _F]:
    """Mark a function of a reward file as a reward function, under ``name`` (default: its own name):
    mlx-lm-lora's decorator, which it stands for in a reward file that imports it from there.

    Example::

        from mlx_train.llm.rewards import register_reward_function

        @register_reward_function()
        def short_answer(prompts, completions, answer, types=None):
            return [1.0 if len(text) < 200 else 0.0 for text in completions]
    """
    def register(function: _F) -> _F:
        if _registering is not None:
            _registering[name if isinstance(name, str) else function.__name__] = function
        return function
    return register(name) if callable(name) else register


_MLX_LM_LORA_REWARDS = "mlx_lm_lora.trainer.grpo_reward_functions"


@contextmanager
def _mlx_lm_lora_stand_in() -> Iterator[None]:
    """While a reward file runs, ``mlx_lm_lora.trainer.grpo_reward_functions`` is a stand-in holding this
    module's decorator and ``r1_*`` functions, so that the file's registrations come here (whether or
    not mlx-lm-lora is installed); the modules that were there before are put back afterwards."""
    package, trainer, rewards = (types.ModuleType(name) for name in
                                 ("mlx_lm_lora", "mlx_lm_lora.trainer", _MLX_LM_LORA_REWARDS))
    for parent, child, attribute in ((package, trainer, "trainer"), (trainer, rewards, "grpo_reward_functions")):
        parent.__path__ = []  # a package, so that importing a submodule that is not stood in for fails cleanly
        setattr(parent, attribute, child)
    exported = dict(_MLX_LM_LORA_BUILTINS, register_reward_function=register_reward_function,
                    r1_extract_xml_answer=r1_extract_xml_answer, RewardFunctions=RewardFunction)
    vars(rewards).update(exported, __all__=list(exported))
    stand_ins = {module.__name__: module for module in (package, trainer, rewards)}
    before = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


@dataclass(frozen=True)
class _RewardFile:
    path: str
    registered: dict[str, RewardFunction]  # by decorator, in the order registered
    namespace: dict[str, Any]

    def find(self, name: str) -> RewardFunction | None:
        found = self.registered.get(name, self.namespace.get(name))
        return found if callable(found) and not isinstance(found, type) else None

    def functions(self) -> list[str]:
        """The names it registers, then the other functions it defines."""
        module = self.namespace.get("__name__")
        defined = [key for key, value in self.namespace.items() if inspect.isfunction(value)
                   and value.__module__ == module and not key.startswith("_")]
        return list(dict.fromkeys([*self.registered, *defined]))

    def get(self, name: str) -> RewardFunction:
        found = self.find(name)
        if found is None:
            known = self.functions()
            raise RewardError(f"reward functions file {self.path} has no function {name!r}"
                              f"{did_you_mean(name, known)}; it has: {', '.join(known) or 'none'}")
        return found


def _line_in(path: Path, error: BaseException) -> str:
    """``path:line`` of the deepest place in ``path`` that ``error`` went through (or just ``path``)."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f"{path}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == path]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def _read_file(file: str) -> _RewardFile:
    """Run a reward file as a module of its own and collect what it registers."""
    global _registering
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward functions file {file!r} does not exist ({path}); give the path of a Python file "
                          "that defines the reward functions")
    module_name = "_mlx_train_rewards_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has one
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that dataclasses and pickling inside the file find it
    registered: dict[str, RewardFunction] = {}
    _registering = registered
    try:
        with _mlx_lm_lora_stand_in():
            spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        hint = "fix the file"
        if isinstance(error, ImportError) and (error.name or "").startswith("mlx_lm_lora"):
            hint = (f"of mlx-lm-lora, a reward file can import only {_MLX_LM_LORA_REWARDS}'s register_reward_function"
                    f" and r1_* functions here (mlx-train stands in for them); import the rest from elsewhere")
        raise RewardError(f"reading reward functions file {_line_in(path, error)} failed: "
                          f"{type(error).__name__}: {error}; {hint}") from error
    finally:
        _registering = None
    return _RewardFile(file, registered, vars(module))


# --- Reward sets -------------------------------------------------------------------------------------------

def _where(function: RewardFunction) -> str:
    """``file:line`` of a function's ``def`` (past its decorators), ``"built-in"`` for this module's."""
    if any(function is builtin for builtin in BUILTINS.values()):
        return "built-in"
    plain = inspect.isfunction(function) or inspect.ismethod(function)
    code = getattr(function if plain else type(function).__call__, "__code__", None)
    if code is None:
        return getattr(function, "__module__", None) or "unknown place"
    line = code.co_firstlineno
    if linecache.getline(code.co_filename, line).lstrip().startswith("@"):
        line = next((line + i for i in range(1, 20) if linecache.getline(code.co_filename, line + i).lstrip()
                     .startswith(("def ", "async def "))), line)
    return f"{code.co_filename}:{line}"


def _keywords(name: str, function: RewardFunction) -> tuple[str, ...]:
    """Which of :data:`ARGUMENTS` ``function`` takes (all of them with ``**kwargs``); an error if it needs
    another argument or does not take ``completions``."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C function): it gets all four
        return ARGUMENTS
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return ARGUMENTS
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = [p.name for p in parameters if p.default is p.empty and p.kind is not p.VAR_POSITIONAL
               and p.name not in ARGUMENTS]
    if unknown or "completions" not in named:
        problem = (f"needs an argument {unknown[0]!r} that is not passed{did_you_mean(unknown[0], ARGUMENTS)}"
                   if unknown else "takes no 'completions' argument")
        raise RewardError(f"reward function {name!r} ({_where(function)}) {problem}: a reward function is called "
                          f"with the keywords {', '.join(ARGUMENTS)}, as f(prompts, completions, answer, types=None) "
                          "(mlx-lm-lora's signature; TRL's f(completions, **kwargs) works too)")
    return tuple(argument for argument in ARGUMENTS if argument in named)


@dataclass(frozen=True)
class Reward:
    """One function of a :class:`RewardSet`: its ``name`` (in metrics), the callable, its ``weight`` in the
    total, ``where`` it is defined (``file:line`` or ``"built-in"``) and the ``keywords`` it is called with."""

    name: str
    function: RewardFunction
    weight: float = 1.0
    where: str = "built-in"
    keywords: tuple[str, ...] = ARGUMENTS

    def problem(self, what: str, fix: str) -> RewardError:
        return RewardError(f"reward function {self.name!r} ({self.where}) {what}; {fix}")


def _name_of(function: RewardFunction) -> str:
    return getattr(function, "__name__", None) or type(function).__name__


def _names(names: Sequence[str | RewardFunction] | str | None) -> list[str | RewardFunction]:
    if isinstance(names, str):
        return [part.strip() for part in names.split(",") if part.strip()]
    return [name.strip() if isinstance(name, str) else name for name in names or ()]


def _weights(weights: Sequence[float] | str | None) -> list[float] | None:
    if weights is None:
        return None
    parts = weights.strip().strip("[]").split(",") if isinstance(weights, str) else list(weights)
    values = []
    for part in parts:
        try:
            value = float(part)
        except (TypeError, ValueError):
            raise RewardError(f"reward weight {part!r} is not a number; give one number per reward function, "
                              "e.g. --reward-weights 1.0,0.5") from None
        if not math.isfinite(value):
            raise RewardError(f"reward weight {part!r} is not finite; give finite numbers")
        values.append(value)
    return values


def _resolve(name: str, file: _RewardFile | None, files: dict[str, _RewardFile]) -> tuple[str, RewardFunction]:
    """The function called ``name``: ``module:function``, ``path.py:function``, one of the reward file's,
    or a built-in (in that order, so a file's function hides a built-in of the same name)."""
    source, colon, attribute = name.rpartition(":")
    if colon and source.endswith(".py"):
        if source not in files:
            files[source] = _read_file(source)
        return attribute, files[source].get(attribute)
    if colon:
        try:
            module = importlib.import_module(source)
        except Exception as error:
            raise RewardError(f"reward function {name!r}: importing module {source!r} failed: "
                              f"{type(error).__name__}: {error}; give module:function with an importable module, "
                              "or path/to/file.py:function") from error
        found = getattr(module, attribute, None)
        if not callable(found):
            raise RewardError(f"reward function {name!r}: module {source} ({getattr(module, '__file__', '?')}) has no "
                              f"function {attribute!r}{did_you_mean(attribute, dir(module))}")
        return attribute, found
    if file is not None and file.find(name) is not None:
        return name, file.get(name)
    if name not in BUILTINS:
        in_file = file.functions() if file else []
        where = f"{file.path} has: {', '.join(in_file) or 'none'}; " if file else ""
        raise RewardError(f"unknown reward function {name!r}{did_you_mean(name, [*BUILTINS, *in_file])}; "
                          f"{where}built-ins: {', '.join(BUILTINS)}; or give module:function or "
                          "path/to/file.py:function")
    return name, BUILTINS[name]


@dataclass(frozen=True)
class Scores:
    """The rewards of a batch of completions: ``total`` (the weighted sum, per completion) and
    ``per_function`` (each function's own values, NaN where it returned None or NaN: not applicable)."""

    total: Floats
    per_function: dict[str, Floats]

    def metrics(self) -> dict[str, float]:
        """``reward_mean`` and ``reward_std`` of the totals, and per function ``reward_<name>_mean``,
        ``reward_<name>_std`` (over the rows it scored; 0.0 when none) and ``reward_<name>_coverage``
        (the fraction of rows it scored). Population std, as mlx-lm-lora reports it.

        Example: ``RewardSet.load("answer_match").score(["?"] * 2, ["4", "5"], ["4"] * 2).metrics()``
        -> ``{"reward_mean": 0.5, "reward_std": 0.5, "reward_answer_match_mean": 0.5, ...}``.
        """
        some = self.total.size > 0
        metrics = {"reward_mean": float(self.total.mean()) if some else 0.0,
                   "reward_std": float(self.total.std()) if some else 0.0}
        for name, values in self.per_function.items():
            scored = values[~np.isnan(values)]
            metrics[f"reward_{name}_mean"] = float(scored.mean()) if scored.size else 0.0
            metrics[f"reward_{name}_std"] = float(scored.std()) if scored.size else 0.0
            metrics[f"reward_{name}_coverage"] = scored.size / max(values.size, 1)
        return metrics


class RewardSet:
    """The reward functions of a GRPO run with their weights: loads them, checks them, scores completions.

    Example::

        rewards = RewardSet.load("answer_match,my_reward", file="rewards.py", weights="1.0,0.5")
        rewards.check(prompts, None, answers)   # before training: a broken function fails here
        scores = rewards.score(prompts, completions, answers)
    """

    def __init__(self, rewards: Sequence[Reward]) -> None:
        if not rewards:
            raise RewardError("no reward functions: name at least one (built-ins: " + ", ".join(BUILTINS) + ")")
        names = [reward.name for reward in rewards]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise RewardError(f"reward function {twice[0]!r} is named twice; name each function once "
                              "(give it a larger weight to count it more)")
        self.rewards = tuple(rewards)

    @classmethod
    def load(cls, names: Sequence[str | RewardFunction] | str | None = None, file: str | None = None,
             weights: Sequence[float] | str | None = None) -> RewardSet:
        """The reward functions called ``names`` (a list or a comma-separated string; callables work too)
        with ``weights`` (a list or ``"1.0,0.5"``; default 1.0 each, one per function).

        A name is a built-in (:data:`BUILTINS`), a function of the reward ``file``, ``module:function`` or
        ``path/to/file.py:function``. With no names: the functions ``file`` registers with
        ``@register_reward_function()``, or without a file :data:`DEFAULT_REWARDS` (``answer_match`` with
        weight 1.0 and ``think_answer_format`` with 0.5). mlx-lm-lora's defaults are
        :data:`MLX_LM_LORA_DEFAULTS`.

        Example: ``RewardSet.load("r1_accuracy_reward_func,r1_soft_format_reward_func", weights=[1.0, 0.5])``.
        """
        files: dict[str, _RewardFile] = {}
        reward_file = files.setdefault(file, _read_file(file)) if file else None
        chosen, weight_list = _names(names), _weights(weights)
        if not chosen and reward_file:
            chosen = list(reward_file.registered)
            if not chosen:
                raise RewardError(f"reward functions file {file} registers no reward function: decorate them with "
                                  "@register_reward_function(), or name them with --reward-functions")
        elif not chosen:
            chosen = list(DEFAULT_REWARDS)
            weight_list = list(DEFAULT_REWARDS.values()) if weight_list is None else weight_list
        weight_list = [1.0] * len(chosen) if weight_list is None else weight_list
        if len(weight_list) != len(chosen):
            raise RewardError(f"{len(weight_list)} reward weights for {len(chosen)} reward functions "
                              f"({', '.join(n if isinstance(n, str) else _name_of(n) for n in chosen)}); "
                              "give one weight per function, in the same order")
        rewards = []
        for entry, weight in zip(chosen, weight_list, strict=True):
            name, function = _resolve(entry, reward_file, files) if isinstance(entry, str) else (_name_of(entry), entry)
            rewards.append(Reward(name, function, weight, _where(function), _keywords(name, function)))
        return cls(rewards)

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    @property
    def weights(self) -> list[float]:
        return [reward.weight for reward in self.rewards]

    def describe(self) -> str:
        """One line naming each function, its weight and where it is defined.

        Example: ``RewardSet.load().describe()``
        -> ``"answer_match x1 (built-in), think_answer_format x0.5 (built-in)"``.
        """
        return ", ".join(f"{reward.name} x{reward.weight:g} ({reward.where})" for reward in self.rewards)

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None],
              types: Sequence[str | None] | None = None) -> Scores:
        """Call every function once on the batch (one entry per completion in each list) and weigh them.

        None or NaN from a function means "does not apply": 0 in the total. A completion that no function
        scores, and anything that is not one finite number per completion, is a :class:`RewardError`.
        """
        count = len(completions)
        lengths = {"prompts": len(prompts), "answers": len(answers), "types": count if types is None else len(types)}
        if any(length != count for length in lengths.values()):
            raise ValueError(f"score() takes one entry per completion in each list: {count} completions, "
                             + ", ".join(f"{length} {what}" for what, length in lengths.items()))
        arguments = {"prompts": list(prompts), "completions": list(completions), "answer": list(answers),
                     "types": None if types is None else list(types)}
        per_function = {reward.name: self._call(reward, arguments, count) for reward in self.rewards}
        columns = np.stack(list(per_function.values()))
        unscored = np.flatnonzero(np.isnan(columns).all(axis=0))
        if unscored.size:
            row = int(unscored[0])
            kind = f" (type {types[row]!r})" if types is not None else ""
            raise RewardError(f"no reward function scored completion {row}{kind}: every one returned None or NaN "
                              f"for it ({', '.join(self.names)}); add a function that applies to it, or return 0.0 "
                              "rather than None")
        weights = np.asarray(self.weights, dtype=np.float64)[:, None]
        return Scores((np.nan_to_num(columns, nan=0.0) * weights).sum(axis=0), per_function)

    def check(self, prompts: Sequence[str], completions: Sequence[str] | None, answers: Sequence[str | None],
              types: Sequence[str | None] | None = None) -> Scores:
        """Score a few rows before training, so that a function that fails does so before the model trains.

        With ``completions`` None, each row gets three made-up ones: a well-formed correct answer, an empty
        completion (a model may stop at once) and text with no tags and no number.
        """
        if completions is None:
            made_up = [(f"<think>\nchecking\n</think>\n<answer>{answer or ''}</answer>", "", "I am not sure.")
                       for answer in answers]
            completions = [text for row in made_up for text in row]
            prompts, answers = [p for p in prompts for _ in range(3)], [a for a in answers for _ in range(3)]
            types = None if types is None else [t for t in types for _ in range(3)]
        try:
            return self.score(prompts, completions, answers, types)
        except RewardError as error:
            raise RewardError(f"checking the reward functions before training on {len(completions)} sample "
                              f"completions: {error}") from error

    @staticmethod
    def _call(reward: Reward, arguments: Mapping[str, Any], count: int) -> Floats:
        """One function's values on the batch, as float64 (NaN where it returned None or NaN)."""
        try:
            returned = reward.function(**{keyword: arguments[keyword] for keyword in reward.keywords})
        except Exception as error:
            place = traceback.extract_tb(error.__traceback__)[-1]
            raise reward.problem(f"raised {type(error).__name__}: {error} (at {place.filename}:{place.lineno})",
                                 "fix it, or return None for the rows it cannot score") from error
        if returned is None:
            return np.full(count, np.nan)
        if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Iterable):
            raise reward.problem(f"returned {type(returned).__name__} {returned!r:.80}",
                                 f"return a list of {count} numbers, one per completion")
        values = list(returned)
        if len(values) != count:
            raise reward.problem(f"returned {len(values)} values for {count} completions",
                                 "return one number per completion, in order (None where it does not apply)")
        column = np.empty(count)
        for position, value in enumerate(values):
            number = _number(value)
            if number is None:
                raise reward.problem(f"returned {type(value).__name__} {value!r:.80} for completion {position}",
                                     "return numbers (None where it does not apply)")
            if math.isinf(number):
                raise reward.problem(f"returned {value} for completion {position}",
                                     "return finite numbers (None or NaN where it does not apply)")
            column[position] = number
        return column


def _number(value: Any) -> float | None:
    """A returned value as a float (None -> NaN), or None when it is no number (text is not one)."""
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
