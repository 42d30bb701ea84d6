"""Built-in datasets: ``digits`` (classification) and ``text`` (character LM).

``load_dataset`` returns a dict with the splits ``"train"``, ``"val"`` and
``"test"``, each in the DataLoader's arrays form, and ``"info"``, which tells
:func:`mlx_train.builtin.models.build_model` how to size a model.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no
  download), pixels scaled to [0, 1], float32 ``x`` of shape ``[N, 64]`` (or
  ``[N, 8, 8, 1]`` with ``as_images=True``) and int32 labels ``y``; a seeded
  split, stratified by class, of 70/10/20 % train/val/test.
- ``text``: a character corpus that needs no download, the docstrings of a
  fixed list of standard-library modules read from their source files (same
  text for the same Python version), or any UTF-8 file given as ``path``.
  Contiguous 90/5/5 % split; samples are ``{"tokens": int32[N, block_size + 1]}``
  chunks starting every ``block_size`` characters.

Example::

    data = load_dataset("digits", seed=0)
    x_train, y_train = data["train"]
    data["info"]    # {"task": "classification", "in_dims": 64, "num_classes": 10, ...}
"""

from __future__ import annotations

import ast
import functools
import inspect
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mlx_train.builtin import check_options
from mlx_train.errors import ConfigError, DataError, did_you_mean

__all__ = ["load_dataset", "available_datasets", "stdlib_corpus", "STDLIB_MODULES"]

# Prose-heavy public modules: together ~450 KB of docstrings (~100 distinct characters) on CPython 3.11.
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "collections", "configparser", "contextlib", "dataclasses", "datetime",
    "difflib", "doctest", "email.message", "enum", "fractions", "functools", "http.client",
    "inspect", "ipaddress", "json", "logging", "pathlib", "re", "shutil", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "turtle", "typing",
    "unittest.case", "urllib.parse", "zipfile",
)
_MIN_CORPUS_CHARS = 100_000


def _stratified_split(labels: np.ndarray, fractions: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Split indices so that every class is spread over the parts in ``fractions``."""
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in fractions]
    bounds = np.cumsum(fractions)[:-1]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = np.round(bounds * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, cuts), strict=False):
            part.append(chunk)
    return [rng.permutation(np.concatenate(part)) for part in parts]


def _load_digits(seed: int, *, as_images: bool = False) -> dict[str, Any]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ConfigError(
            "the 'digits' dataset needs scikit-learn, which is not installed: "
            "pip install 'mlx-train[examples]'"
        ) from error
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    image_shape = (8, 8, 1)
    if as_images:
        x = x.reshape(-1, *image_shape)
    train, val, test = _stratified_split(y, (0.7, 0.1, 0.2), seed)
    info = {
        "name": "digits",
        "task": "classification",
        "in_dims": 64,
        "num_classes": 10,
        "image_shape": image_shape,
    }
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test]), "info": info}


def _module_source(stdlib: Path, module: str) -> Path | None:
    base = stdlib.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of a module and everything defined in it, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The docstrings of standard-library ``modules``, parsed from their sources.

    Parsing (rather than importing and reading ``__doc__``) has no side effects
    and still works under ``python -OO``.

    Example::

        text = stdlib_corpus()     # ~450 KB of English prose and code samples
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    for module in modules:
        source = _module_source(stdlib, module)
        if source is None:
            continue  # e.g. a trimmed-down installation; the size check below catches too few
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some modules' sources
            tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
        parts.extend(_docstrings(tree))
    text = "\n\n".join(parts)
    if len(text) < _MIN_CORPUS_CHARS:
        raise DataError(
            f"the 'text' dataset found only {len(text)} characters of docstrings in the Python "
            f"standard library sources under {stdlib} (this installation seems to lack the .py "
            f"files); give a text file instead: dataset_options path=FILE"
        )
    return text


def _chunks(ids: np.ndarray, block_size: int, split: str) -> np.ndarray:
    """Rows of ``block_size + 1`` tokens starting every ``block_size`` tokens."""
    count = (len(ids) - 1) // block_size
    if count < 1:
        raise DataError(
            f"the {split} split of the 'text' dataset has {len(ids)} characters, fewer than "
            f"block_size + 1 = {block_size + 1}: use a longer text or a smaller block_size"
        )
    starts = np.arange(count)[:, None] * block_size
    rows: np.ndarray = ids[starts + np.arange(block_size + 1)]
    return rows.astype(np.int32)


def _load_text(seed: int, *, block_size: int = 64, path: str | None = None) -> dict[str, Any]:
    del seed  # the split is contiguous, so there is nothing random to seed
    if block_size < 1:
        raise ConfigError(f"option 'block_size' of dataset 'text' must be positive, got {block_size}")
    if path is not None and not isinstance(path, (str, Path)):
        raise ConfigError(f"option 'path' of dataset 'text' must be a file path, got {path!r}")
    if path is None:
        text, source = stdlib_corpus(), "docstrings of Python standard-library modules"
    else:
        try:
            text, source = Path(path).read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"cannot read the text file {path!r} for dataset 'text': {error}") from error
    vocab = sorted(set(text))
    codes = np.fromiter(map(ord, text), dtype=np.int64, count=len(text))
    ids = np.searchsorted(np.array([ord(c) for c in vocab]), codes)
    n_train, n_val = int(len(ids) * 0.9), int(len(ids) * 0.05)
    splits = {
        "train": ids[:n_train],
        "val": ids[n_train : n_train + n_val],
        "test": ids[n_train + n_val :],
    }
    data: dict[str, Any] = {
        name: {"tokens": _chunks(part, block_size, name)} for name, part in splits.items()
    }
    data["info"] = {
        "name": "text",
        "task": "language_modeling",
        "vocab_size": len(vocab),
        "block_size": block_size,
        "vocab": "".join(vocab),
        "source": source,
    }
    return data


_DATASETS: dict[str, Callable[..., dict[str, Any]]] = {"digits": _load_digits, "text": _load_text}


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`, e.g. ``["digits", "text"]``."""
    return sorted(_DATASETS)


def load_dataset(name: str, seed: int = 0, **options: Any) -> dict[str, Any]:
    """Load the built-in dataset ``name`` as ``{"train", "val", "test", "info"}``.

    ``seed`` fixes the random split (digits). Options: ``digits`` takes
    ``as_images``; ``text`` takes ``block_size`` and ``path``.

    Example::

        data = load_dataset("text", block_size=128)
        data["train"]["tokens"].shape     # (N, 129)
        data["info"]["vocab_size"]        # < 200
    """
    loader = _DATASETS.get(name)
    if loader is None:
        raise ConfigError(
            f"unknown dataset '{name}'{did_you_mean(name, _DATASETS)}; "
            f"built-in datasets: {', '.join(available_datasets())}"
        )
    defaults = {
        p.name: p.default
        for p in inspect.signature(loader).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    check_options("dataset", name, options, defaults)
    return loader(seed, **options)
