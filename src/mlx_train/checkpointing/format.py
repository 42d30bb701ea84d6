"""The layout of one checkpoint directory, and reading it back with validation.

A checkpoint ``step-00000300/`` holds one safetensors file per array group
(``model.safetensors``, ``optimizer.safetensors``...), ``trainer_state.json`` and,
written last, ``manifest.json``: format version, step, metrics and the size and
sha256 of every other file. No manifest, a missing file, a wrong size or a wrong
checksum means the checkpoint is torn or corrupt.

The per-epoch history grows with the run, so a checkpoint does not rewrite it: whole chunks of it
live beside the checkpoints, in ``history/<sha256>.json``, each written once and naming the chunk
before it; ``trainer_state.json`` names the newest chunk and holds only the entries after it.

Example::

    arrays, state = load_checkpoint("runs/a/step-00000300")
    model.update(tree_unflatten(list(arrays["model"].items())))
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_train.checkpointing.storage import MANIFEST, FsspecStore, LocalStore, open_store, split_location
from mlx_train.errors import CheckpointError

_Store = LocalStore | FsspecStore  # what open_store returns

FORMAT = "mlx-train-checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
HISTORY_DIR = "history"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-\d+\.tmp-")


def step_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``step_name(300) == "step-00000300"``."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint: its step, path (or URL), saved metrics and save time (Unix seconds)."""

    step: int
    path: str
    metrics: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0

    def metric(self, name: str) -> float | None:
        """``metrics[name]`` as a finite float, or None when absent or NaN."""
        value = self.metrics.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        return float(value)


class Torn(Exception):
    """Why a checkpoint is unusable; ``reason`` reads after "checkpoint <path> ..."."""

    def __init__(self, reason: str, file: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.file = file


def _manifest_problem(manifest: object) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"it is not an {FORMAT} manifest"
    if not isinstance(manifest.get("format_version"), int) or not isinstance(manifest.get("step"), int):
        return "format_version and step must be integers"
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE_FILE not in files:
        return f"its file list is missing or lacks {STATE_FILE}"
    for name, record in files.items():
        if not isinstance(record, dict) or not isinstance(record.get("size"), int) \
                or not isinstance(record.get("sha256"), str):
            return f"the entry of {name} needs an integer size and a sha256 string"
    return None


#: The manifest's own checksum: sha256 of its other keys as canonical JSON, so that damage to the manifest is
#: told apart from damage to a file it describes (manifests written before it have none and are read as before).
SEAL = "manifest_sha256"


def _seal_of(manifest: dict[str, Any]) -> str:
    content = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for ``manifest``, sealed with its own checksum (``SEAL``)."""
    return json.dumps({**manifest, SEAL: _seal_of(manifest)}, indent=1).encode()


def read_manifest(store: _Store, name: str) -> dict[str, Any]:
    """Read and check ``name/manifest.json``; raise Torn saying what is wrong."""
    if TMP_DIR.match(name):
        raise Torn("is a temporary directory left by an interrupted save, not a checkpoint (safe to delete)")
    rel = f"{name}/{MANIFEST}"
    if store.size(rel) is None:
        if store.isdir(name):
            raise Torn(f"is missing {MANIFEST} (written by an interrupted save?)", MANIFEST)
        if store.size(name) is not None:
            raise Torn("is a file, not a checkpoint directory")
        raise Torn("does not exist")
    try:
        manifest: dict[str, Any] = json.loads(store.read_bytes(rel))
    except ValueError as error:
        raise Torn(f"has an unreadable {MANIFEST} ({error}; damaged file?)", MANIFEST) from None
    if isinstance(manifest, dict) and SEAL in manifest and manifest[SEAL] != _seal_of(manifest):
        raise Torn(f"has a damaged {MANIFEST} (its own checksum, {SEAL}, does not match its content: damaged on "
                   "disk or in a copy?); the files it describes were not blamed", MANIFEST)
    problem = _manifest_problem(manifest)
    if problem:
        raise Torn(f"has an invalid {MANIFEST} ({problem})", MANIFEST)
    if manifest["format_version"] > FORMAT_VERSION:
        raise Torn(f"was written by a newer mlx-train (checkpoint format {manifest['format_version']}, "
                   f"this version reads up to {FORMAT_VERSION}): upgrade mlx-train")
    return manifest


def check_files(store: _Store, name: str, manifest: dict[str, Any], files: Iterable[str] | None = None,
                verify_hashes: bool = True) -> None:
    """Check that the files listed in the manifest exist with their recorded size (and sha256)."""
    records = manifest["files"]
    names = list(records) if files is None else list(files)
    for fname in names:
        expected, size = records[fname]["size"], store.size(f"{name}/{fname}")
        if size is None:
            raise Torn(f"is missing {fname} (written by an interrupted save?)", fname)
        if size < expected:
            raise Torn(f"has a truncated {fname} ({size} of {expected} bytes: "
                       "interrupted copy or full disk?)", fname)
        if size > expected:
            raise Torn(f"has a {fname} of {size} bytes where {MANIFEST} says {expected} "
                       "(modified after saving?)", fname)
    for fname in names if verify_hashes else ():
        if store.sha256(f"{name}/{fname}") != records[fname]["sha256"]:
            raise Torn(_corrupt(fname), fname)


def _corrupt(fname: str) -> str:
    return f"has a corrupt {fname} (its sha256 does not match {MANIFEST}: damaged on disk or in a copy?)"


def info_from(store: _Store, name: str, manifest: dict[str, Any]) -> CheckpointInfo:
    match = STEP_DIR.match(name)
    return CheckpointInfo(int(match.group(1)) if match else int(manifest["step"]), store.url(name),
                          dict(manifest.get("metrics") or {}), float(manifest.get("saved_at", 0.0)))


def scan(store: _Store) -> tuple[list[str], list[str]]:
    """Return (checkpoint directory names, leftover temporary directory names)."""
    entries = store.listdir()
    return [n for n in entries if STEP_DIR.match(n)], [n for n in entries if TMP_DIR.match(n)]


OnTorn = Callable[[str, Torn], None]


def survey(store: _Store, on_torn: OnTorn | None = None,
           exclude: Iterable[str] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(name, manifest) of checkpoints whose manifest reads and whose files have the right sizes.

    Ordered by save time, then step: after resuming from an older checkpoint, the new run's
    saves are newer than the abandoned run's higher steps, so they are the ones kept and resumed.
    """
    found = []
    for name in scan(store)[0]:
        if name in exclude:
            continue
        try:
            manifest = read_manifest(store, name)
            check_files(store, name, manifest, verify_hashes=False)
            found.append((name, manifest))
        except Torn as torn:
            if on_torn:
                on_torn(name, torn)
    return sorted(found, key=lambda item: (float(item[1].get("saved_at", 0.0)), item[1]["step"]))


def newest_complete(store: _Store, exclude: Iterable[str] = (), on_torn: OnTorn | None = None) -> CheckpointInfo | None:
    """The most recently saved checkpoint that passes every check, sha256 included."""
    for name, manifest in reversed(survey(store, on_torn, exclude)):
        try:
            check_files(store, name, manifest)
            return info_from(store, name, manifest)
        except Torn as torn:
            if on_torn:
                on_torn(name, torn)
    return None


def explain(store: _Store, name: str, reason: str, fallback_store: _Store | None = None) -> str:
    """The full error message: what is wrong with which checkpoint, and which one to resume from."""
    fallback_store = fallback_store or store
    message = f"checkpoint {store.url(name)} {reason}"
    try:
        good = newest_complete(fallback_store, exclude=[name] if fallback_store is store else [])
    except Exception:  # the message must not fail because the directory is unreadable too
        good = None
    if good is not None:
        return f"{message}; the last complete checkpoint is {good.path}: resume with --resume {good.path}"
    return f"{message}; there is no complete checkpoint in {fallback_store.display}: start without --resume"


def validate_checkpoint(path: str, fallback_store: _Store | None = None) -> CheckpointInfo:
    """Fully check the checkpoint at ``path`` (sha256 included); raise CheckpointError if it is unusable.

    ``fallback_store`` is where the error message looks for a complete checkpoint to suggest
    (default: the directory holding ``path``).
    """
    parent, name = split_location(path)
    store = open_store(parent)
    try:
        manifest = read_manifest(store, name)
        check_files(store, name, manifest)
    except Torn as torn:
        raise CheckpointError(explain(store, name, torn.reason, fallback_store)) from None
    return info_from(store, name, manifest)


def load_checkpoint(path: str,
                    groups: Iterable[str] | None = None) -> tuple[dict[str, dict[str, mx.array]], dict[str, Any]]:
    """Load ``(arrays by group, state)`` from a checkpoint directory or URL, checking every checksum.

    ``groups`` limits which array groups are read (e.g. ``["model"]`` for evaluation).
    Raises CheckpointError naming the bad file and the last complete checkpoint.

    Example::

        arrays, state = load_checkpoint("runs/a/step-00000300")
        arrays["optimizer"]["state.step"], state["epoch"]
    """
    parent, name = split_location(path)
    store = open_store(parent)
    try:
        manifest = read_manifest(store, name)
        available = [f[: -len(".safetensors")] for f in manifest["files"] if f.endswith(".safetensors")]
        wanted = available if groups is None else list(groups)
        missing = [g for g in wanted if g not in available]
        if missing:
            raise CheckpointError(f"checkpoint {store.url(name)} has no array group {missing[0]!r} "
                                  f"(it has: {', '.join(available) or 'none'}): pass one of those")
        files = [f"{g}.safetensors" for g in wanted] + [STATE_FILE]
        check_files(store, name, manifest, files, verify_hashes=False)  # sizes now, hashes while reading
        arrays = {}
        for group, fname in zip(wanted, files, strict=False):
            try:
                arrays[group] = store.read_safetensors(f"{name}/{fname}", manifest["files"][fname]["sha256"])
            except ValueError:
                raise Torn(_corrupt(fname), fname) from None
            except RuntimeError as error:
                raise Torn(f"has an unreadable {fname} ({error})", fname) from None
        check_files(store, name, manifest, [STATE_FILE])
        try:
            state = json.loads(store.read_bytes(f"{name}/{STATE_FILE}"))
        except ValueError as error:
            raise Torn(f"has an unreadable {STATE_FILE} ({error})", STATE_FILE) from None
    except Torn as torn:
        raise CheckpointError(explain(store, name, torn.reason)) from None
    return arrays, state


def _json_scalar(value: Any) -> Any:
    """A NumPy or MLX scalar as a Python number (json.dumps calls this for what it cannot write)."""
    if getattr(value, "size", None) == 1 and getattr(value, "ndim", None) == 0:
        return value.item()
    raise TypeError(f"a {type(value).__name__} cannot be saved as JSON in the history: log numbers or strings")


def write_history_chunk(location: str, previous: str | None, entries: dict[str, list[Any]]) -> str:
    """Store a chunk of per-epoch history beside the checkpoints in ``location``; return its name.

    The name is the sha256 of the content, which names the ``previous`` chunk: a chunk never
    changes once written, and runs that branched off (a resume from an older checkpoint) keep theirs.

    Example::

        head = write_history_chunk("runs/a/checkpoints", None, {"epoch": [0, 1], "train_loss": [0.9, 0.7]})
        read_history("runs/a/checkpoints", head)     # {"epoch": [0, 1], "train_loss": [0.9, 0.7]}
    """
    data = json.dumps({"previous": previous, "history": entries}, default=_json_scalar).encode()
    name = hashlib.sha256(data).hexdigest()
    store, rel = open_store(location), f"{HISTORY_DIR}/{name}.json"
    if store.size(rel) != len(data):  # the same content may be there already (an earlier attempt)
        store.makedirs(HISTORY_DIR)
        store.write_bytes(rel, data)
    return name


def read_history(location: str, head: str | None, checkpoint: str = "") -> dict[str, list[Any]]:
    """The history stored in the chunks ending at ``head`` (oldest entries first); {} for no chunk.

    Raises CheckpointError naming ``checkpoint`` when a chunk is missing or damaged.
    """
    history, problem = salvage_history(location, head)
    if problem is None:
        return history
    fix = (f"a checkpoint directory copied without the {HISTORY_DIR}/ folder beside it? Copy that folder too, or "
           "start without --resume") if problem.endswith("missing") else (
        "restore it from a copy, or resume from a checkpoint of another run directory")
    raise CheckpointError(f"checkpoint {checkpoint} needs {problem}: {fix}")


def salvage_history(location: str, head: str | None) -> tuple[dict[str, list[Any]], str | None]:
    """The history of the chunks ending at ``head`` that can be read, and which file is wrong (None if none).

    A missing or damaged chunk ends the chain there: the newer chunks before it are returned, and the
    problem reads "the history file URL, which is missing" (or "... damaged (...)").
    """
    store, chunks, problem = open_store(location), [], None
    while head is not None:
        rel = f"{HISTORY_DIR}/{head}.json"
        try:
            data = store.read_bytes(rel)
        except (FileNotFoundError, OSError):
            problem = f"the history file {store.url(rel)}, which is missing"
            break
        if hashlib.sha256(data).hexdigest() != head:
            problem = f"the history file {store.url(rel)}, which is damaged (its sha256 does not match its name)"
            break
        chunk = json.loads(data)
        chunks.append(chunk["history"])
        head = chunk["previous"]
    history: dict[str, list[Any]] = {}
    for chunk in reversed(chunks):
        for key, values in chunk.items():
            history.setdefault(key, []).extend(values)
    return history, problem
