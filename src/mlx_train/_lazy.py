"""Package attributes loaded on first use (PEP 562), so that importing one part of a package is cheap.

A package ``__init__`` names what it exports and the module each name lives in; nothing is imported
until a name is used. ``mlx-train --help``, ``status``, ``monitor`` and the launcher's supervisor
import packages of the training stack for one small module each and must not load MLX through them.
The ``__init__`` also imports the same names under ``TYPE_CHECKING``, so type checkers see them.

Example::

    from mlx_train._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, {"Trainer": "mlx_train.training.trainer"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``table`` maps an exported name to its module.

    A name, once loaded, is stored in the package, so the next use costs nothing.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
