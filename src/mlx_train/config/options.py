"""Declaring a config field once: its default, help, constraint, YAML section and YAML aliases.

A field is ``name: type = option(default, help, section=..., <constraint>...)``; the type comes
from the annotation (``int``, ``float``, ``bool``, ``str``, ``list``, ``dict``, ``X | None``).
``check_fields`` converts and checks every such field of a dataclass, so a config class needs
no rule table of its own.

Example::

    @dataclass
    class Run:
        steps: int = option(10, "Optimizer steps.", section="training", minimum=1)
        def __post_init__(self) -> None:
            check_fields(self)

    Run(steps="20").steps      # 20
    Run(steps=0)               # ConfigError: Run.steps must be at least 1, got 0
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from mlx_train.errors import ConfigError, did_you_mean


class Invalid(Exception):
    """A value problem without its location; callers add where the value came from."""


@dataclass(frozen=True)
class Option:
    """Everything a field declares besides its type and default (``option()`` builds one).

    ``choices`` are matched case-insensitively; ``minimum`` (``>=``), ``above`` (``>``) and
    ``below`` (``<``) bound a number; ``parse`` turns other spellings into the field's type
    first (``"8GB"`` -> bytes) and raises ``Invalid``; ``check(value, values)`` returns what
    is wrong with setting the field given the other values (``values``), or None. ``key`` is
    the field's name inside its YAML section when that differs from the field name, and
    ``aliases`` maps other YAML names to a converter of their value (None: the same value).
    ``hint`` is added to a message about a number out of its bounds. A dict field with
    ``other_keys`` receives the keys of its section that are not fields
    (``model: {name: mlp, hidden_dims: [64]}`` -> ``model_options={"hidden_dims": [64]}``).
    ``shared_name``: under such a section, the field's name is an option like any other
    (``model: {num_layers: 4}`` is the built-in transformer's depth, not the llm field).
    """

    help: str
    section: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    above: float | None = None
    below: float | None = None
    parse: Callable[[Any], Any] | None = None
    check: Callable[[Any, Mapping[str, Any]], str | None] | None = None
    key: str | None = None
    aliases: Mapping[str, Callable[[Any], Any] | None] = field(default_factory=dict)
    other_keys: bool = False
    hint: str | None = None
    shared_name: bool = False


def option(default: Any, help: str, *, section: str, **constraint: Any) -> Any:
    """A dataclass field carrying an ``Option``; lists and dicts are copied per instance.

    Example: ``epochs: int = option(10, "Passes over the data.", section="training", minimum=1)``
    """
    metadata = {"option": Option(help, section, **constraint)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def same_as(owner: type, name: str) -> Any:
    """A field of another config class that *is* field ``name`` of dataclass ``owner``: the same
    default, help and constraint, declared once.

    Its error messages name the source too, so a user sees which knob it is.
    Example: ``backend: str = same_as(TrainConfig, "distributed_backend")``
    """
    source = options(owner)[name]
    metadata = {"option": source.metadata["option"], "same_as": (owner.__name__, name)}
    if source.default_factory is not dataclasses.MISSING:
        return field(default_factory=source.default_factory, metadata=metadata)
    return field(default=source.default, metadata=metadata)


def options(cls_or_obj: Any) -> dict[str, dataclasses.Field[Any]]:
    """The fields of a dataclass that carry an ``Option``, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(cls_or_obj) if "option" in f.metadata}


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A fresh copy of the default of ``f``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[operator]  # a field has one or the other


def kind_of(f: dataclasses.Field[Any]) -> tuple[str, bool]:
    """``("int", True)`` for ``int | None``: the base type name and whether None is allowed."""
    text = str(f.type)
    return text.split("|")[0].strip(), "None" in text


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "list": "a list", "dict": "a mapping"}
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def number(value: Any) -> float | None:
    """An int/float, or a numeric string (PyYAML reads ``2e-5`` as a string), as float; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return None


def convert(f: dataclasses.Field[Any], value: Any) -> Any:
    """Check and normalise one value of field ``f``; raises ``Invalid`` saying what is wrong."""
    spec: Option = f.metadata["option"]
    kind, optional = kind_of(f)
    if value is None:
        if optional:
            return None
        raise Invalid(f"must be {_EXPECTED[kind]}, got null")
    if spec.parse is not None:
        value = spec.parse(value)
        if value is None and optional:  # a spelling of "none" (mlx_lm.lora's -1 batches: all of them)
            return None
    if type(value).__name__ not in [name.strip() for name in str(f.type).split("|")[1:]]:  # (bool | str: either)
        value = _of_kind(kind, optional, value)
    if spec.choices is not None:
        if value.lower() not in spec.choices:
            raise Invalid(f"must be one of {', '.join(spec.choices)}, got {value!r}"
                          f"{did_you_mean(value, spec.choices)}")
        value = value.lower()
    if spec.minimum is not None and spec.below is not None and not spec.minimum <= value < spec.below:
        raise Invalid(f"must be in [{_plain(spec.minimum)}, {_plain(spec.below)}), got {value!r}{_hint(spec)}")
    bounds = ((spec.minimum, value < spec.minimum if spec.minimum is not None else False, "at least"),
              (spec.above, value <= spec.above if spec.above is not None else False, "above"),
              (spec.below, value >= spec.below if spec.below is not None else False, "below"))
    if any(broken for _, broken, _ in bounds):
        limits = " and ".join(f"{word} {_plain(limit)}" for limit, _, word in bounds if limit is not None)
        raise Invalid(f"must be {limits}, got {value!r}{_hint(spec)}")
    return value


def _hint(spec: Option) -> str:
    return f": {spec.hint}" if spec.hint else ""


def _plain(limit: float) -> str:
    return str(int(limit)) if float(limit).is_integer() else str(limit)


def _of_kind(kind: str, optional: bool, value: Any) -> Any:
    got = f"got {value!r} ({type(value).__name__})"
    expected = _EXPECTED[kind] + (" or null" if optional else "")
    if kind == "bool" and not isinstance(value, bool):
        raise Invalid(f"must be {expected}, {got}")
    if kind in ("int", "float"):
        as_number = number(value)
        if as_number is None or not math.isfinite(as_number) or (kind == "int" and as_number != int(as_number)):
            raise Invalid(f"must be {expected}, {got}")
        return int(as_number) if kind == "int" else as_number
    if kind == "str" and not isinstance(value, str):
        raise Invalid(f"must be {expected}, {got}")
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise Invalid(f"must be {expected}, {got}")
        return [number(v) if isinstance(v, str) and number(v) is not None else v for v in value]
    if kind == "dict":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise Invalid(f"must be {expected} with string keys, {got}")
        return dict(value)
    return value


def is_set(f: dataclasses.Field[Any], value: Any) -> bool:
    """Whether ``value`` differs from the default of ``f`` (set on purpose, as far as a dataclass knows)."""
    return cast(bool, value != default_of(f))


def first_problem(fields: Mapping[str, dataclasses.Field[Any]], values: Mapping[str, Any],
                  explicit: set[str] | frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """``(field, problem)`` from the first ``check`` that fails, else None.

    A field's check runs when the field is set: named in ``explicit`` (written in a file) or
    different from its default.
    """
    for name, f in fields.items():
        spec: Option = f.metadata["option"]
        if spec.check is not None and (name in explicit or is_set(f, values[name])):
            problem = spec.check(values[name], values)
            if problem:
                return name, problem
    return None


def check_fields(obj: Any) -> None:
    """Convert and check every ``option`` field of dataclass ``obj`` in place; ``ConfigError`` if wrong.

    Messages read ``TrainConfig.batch_size must be at least 1, got 0``; a ``same_as`` field also
    names its source: ``DistributedConfig.backend: TrainConfig.distributed_backend must be one of ...``.
    """
    owner = type(obj).__name__
    fields = options(obj)

    def where(name: str) -> str:
        source, source_name = fields[name].metadata.get("same_as", (owner, name))
        return f"{owner}.{name}" if source_name == name else f"{owner}.{name}: {source}.{source_name}"

    for name, f in fields.items():
        try:
            setattr(obj, name, convert(f, getattr(obj, name)))
        except Invalid as error:
            raise ConfigError(f"{where(name)} {error}") from None
    problem = first_problem(fields, vars(obj))
    if problem:
        raise ConfigError(f"{where(problem[0])} {problem[1]}")


class Deferred:
    """A field value that needs the final values of other fields (mlx_lm.lora's ``iters`` counts
    micro-batches, so its optimizer steps depend on ``gradient_accumulation``). ``resolve`` turns
    every one of them into the field's value once all layers (file, flags) are known."""

    def value(self, values: Mapping[str, Any]) -> Any:
        """The field's value, given the other fields' values; raises ``ConfigError`` naming its origin."""
        raise NotImplementedError


def resolve(values: Mapping[str, Any], fields: Mapping[str, dataclasses.Field[Any]]) -> dict[str, Any]:
    """``values`` with each ``Deferred`` value replaced by its value, computed from the other values
    (the defaults of ``fields`` where ``values`` has none) and converted.

    Example: ``resolve({"max_steps": Iterations(100, ...), "gradient_accumulation": 4}, fields)``
    -> ``{"max_steps": 25, "gradient_accumulation": 4}``.
    """
    plain = {name: value for name, value in values.items() if not isinstance(value, Deferred)}
    complete = {name: plain.get(name, default_of(f)) for name, f in fields.items()}
    out = dict(values)
    for name, value in values.items():
        if isinstance(value, Deferred):
            try:
                out[name] = convert(fields[name], value.value(complete))
            except Invalid as error:
                raise ConfigError(f"{name} {error}") from None
    return out


# ----- value types shared by several configs -----
@dataclass(frozen=True)
class Every:
    """A cadence: every ``n`` optimizer steps (``unit="step"``) or epochs (``unit="epoch"``)."""

    n: int
    unit: str

    def due(self, count: int) -> bool:
        """True when ``count`` completed steps (or epochs) is a multiple of ``n``."""
        return count > 0 and count % self.n == 0

    def __str__(self) -> str:
        return f"{self.n} {self.unit}{'' if self.n == 1 else 's'}"


_EVERY = re.compile(r"(\d+)?\s*(steps?|epochs?)?")


def cadence(value: Any) -> Every:
    """``parse`` of a cadence field: ``"2 epochs"``, ``500`` or ``"500 steps"``; raises ``Invalid``."""
    if isinstance(value, Every):
        return value
    match = _EVERY.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        n, unit = value, "step"
    elif match and any(match.groups()):
        n, unit = int(match[1] or 1), match[2] or "step"
    else:
        raise Invalid(f"must be 'N steps' or 'N epochs' (a bare number means steps), got {value!r}")
    if n < 1:
        raise Invalid(f"must be at least 1 step or epoch, got {value!r}")
    return Every(n, unit.rstrip("s"))


def parse_every(value: str | int | Every) -> Every:
    """Parse a cadence: ``"2 epochs" -> Every(2, "epoch")``, ``500`` or ``"500" -> Every(500, "step")``."""
    try:
        return cadence(value)
    except Invalid as error:
        raise ConfigError(f"cadence {error}") from None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_count(value: Any) -> int | None:
    """``parse`` of a byte-count field: ``"8GB" -> 8_000_000_000``; None and numbers pass; raises ``Invalid``."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match[2].lower() not in _UNITS:
        raise Invalid(f"must be a number of bytes or a size like '8GB' or '512MiB', got {value!r}")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def parse_bytes(value: int | float | str | None, name: str = "memory") -> int | None:
    """``"8GB" -> 8_000_000_000``, ``"512MiB" -> 536_870_912``; ints pass through; None stays None."""
    try:
        return byte_count(value)
    except Invalid as error:
        raise ConfigError(f"{name} {error}") from None
