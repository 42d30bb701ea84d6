"""Which settings are whose: the Trainer's config (``TrainConfig``, the root) and the configs that extend it
with settings the Trainer never reads (``LaunchConfig``: the launcher's; ``FinetuneConfig``: fine-tuning's).

A config that extends the root registers with ``@extends(kind, command)``; then a setting of it given to
a config that does not hold it (``TrainConfig(train_mode="dpo")``, ``Trainer(model, opt, pack=True)``,
``.replace(...)``) is a ``MisplacedSetting`` that says where it goes, and a YAML file is read with the
fields of every config (``all_fields``) and split by owner (``own_values``).

Example::

    @extends("launcher", "mlx-train train --distributed")
    @dataclass
    class LaunchConfig(TrainConfig):
        max_restarts: int = option(3, "...", section="distributed", minimum=0)

    TrainConfig(max_restarts=0)   # MisplacedSetting: max_restarts is a launcher setting: pass it to LaunchConfig ...
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from mlx_train.config import mlx_lm
from mlx_train.config.options import Deferred, default_of, options, resolve
from mlx_train.errors import ConfigError, did_you_mean

T = TypeVar("T", bound=type)


class MisplacedSetting(ConfigError):
    """A setting given to a config that does not hold it (``TrainConfig(train_mode="dpo")``); says where it goes."""


class Section(NamedTuple):
    """A config that extends the root with settings the Trainer never reads: its class, what its settings are
    called, and how a user passes them."""

    config: Any
    kind: str
    command: str


_ROOT: list[Any] = []
_EXTENSIONS: list[Section] = []


def root(cls: T) -> T:
    """Make ``cls`` (``TrainConfig``) the root config: the one the Trainer takes; its constructor is guarded."""
    _ROOT[:] = [cls]
    return guarded(cls)


def extends(kind: str, command: str) -> Callable[[T], T]:
    """Class decorator of a config that extends the root with its own settings: one of them given to a config
    that does not hold it is an error that names this class and ``command``. The class may say where its
    fields stand in the YAML layout (``placed_after``) and that missing values take fine-tuning's defaults
    (``finetune_defaults``).

    Example: ``@extends("fine-tuning", "mlx-train finetune")`` over ``class FinetuneConfig(LaunchConfig)``.
    """

    def register(cls: T) -> T:
        _EXTENSIONS.append(Section(cls, kind, command))
        return guarded(cls)

    return register


def extensions() -> list[Any]:
    """The configs that extend the root, in the order they registered."""
    return [section.config for section in _EXTENSIONS]


def all_fields() -> dict[str, dataclasses.Field[Any]]:
    """The fields of every config (the root's and those that extend it), by name, in the order of the YAML
    layout (a field of an extension that names a ``placed_after`` field follows it)."""
    names = list(options(_ROOT[0]))
    every = dict(options(_ROOT[0]))
    for section in _EXTENSIONS:
        for name, f in options(section.config).items():
            if name not in every:
                after = section.config.placed_after.get(name)
                names.insert(names.index(after) + 1 if after else len(names), name)
                every[name] = f
    return {name: every[name] for name in names}


def section_class(cls: Any, finetune: bool) -> Any:
    """``cls``, or with ``finetune`` the config of fine-tuning runs (the one with ``finetune_defaults``)."""
    if not finetune or cls.finetune_defaults:
        return cls
    for config in extensions():
        if config.finetune_defaults:
            return config
    raise ConfigError("the fine-tuning config is not loaded (a module imported mlx_train.config.train alone): "
                      "use FinetuneConfig from mlx_train.config")


def where_it_goes(name: str) -> str | None:
    """Where setting ``name`` goes when the root config does not hold it (None: no config holds it)."""
    for section in _EXTENSIONS:
        if name in options(section.config):
            flag = f" --{name.replace('_', '-')}"
            return (f"{name} is a {section.kind} setting: pass it to {section.config.__name__} / "
                    f"{section.command}{flag}")
    return None


def check_names(cls: Any, given: Mapping[str, Any], source: str | None = None) -> None:
    """Raise ``ConfigError`` for a name in ``given`` that config ``cls`` does not hold: ``MisplacedSetting``
    saying where it goes when another config holds it, else an unknown-option error with a suggestion."""
    fields = options(cls)
    origin = f"{source}: " if source else ""
    for name in given:
        if name in fields:
            continue
        goes = where_it_goes(name)
        if goes:
            holder = "the Trainer does not read it" if cls is _ROOT[0] else f"{cls.__name__} does not hold it"
            raise MisplacedSetting(f"{origin}{goes}, not to {cls.__name__} ({holder})")
        raise ConfigError(f"{origin}unknown {cls.__name__} option '{name}'{did_you_mean(name, fields)}")


def own_values(cls: Any, values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values`` that config ``cls`` holds; another config's setting at its default says nothing and is left
    out (dicts that former versions wrote hold every setting), any other value of one is an error."""
    fields, every = options(cls), all_fields()
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name in fields:
            out[name] = value
        elif not (name in every and not isinstance(value, Deferred) and value == default_of(every[name])):
            check_names(cls, {name: value}, source)
    return out


def guarded(cls: T) -> T:
    """``cls`` (a config dataclass) whose constructor refuses, with ``check_names``'s message, a keyword that
    belongs to another config, instead of a bare ``TypeError``; with ``finetune_defaults`` the values not
    given take ``mlx-train finetune``'s defaults (mlx_lm.lora's)."""
    init = getattr(cls, "__init__")  # noqa: B009 - the class's own, generated by dataclass
    finetune = getattr(cls, "finetune_defaults", False)

    @functools.wraps(init)
    def __init__(self: Any, **values: Any) -> None:  # noqa: N807 - the constructor it wraps
        check_names(cls, values)
        if finetune:
            values = resolve({**mlx_lm.finetune_defaults(values), **values}, options(cls))
        init(self, **values)

    setattr(cls, "__init__", __init__)  # noqa: B010 - mypy refuses an assignment to a method
    return cls
