"""CheckpointManager: atomic, asynchronous checkpoint saves with keep-last-N plus best-K retention.

Example::

    manager = CheckpointManager("runs/a/checkpoints", keep_last=3, keep_best=1, monitor="val_loss")
    manager.save(300, {"model": dict(tree_flatten(model.parameters()))}, {"epoch": 2}, {"val_loss": 0.41})
    manager.wait()                      # only needed before reading what was just written
    arrays, state = load_checkpoint(manager.resolve("auto"))
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_train.checkpointing.format import (
    FORMAT,
    FORMAT_VERSION,
    STATE_FILE,
    STEP_DIR,
    TMP_DIR,
    CheckpointInfo,
    Torn,
    info_from,
    manifest_bytes,
    newest_complete,
    scan,
    step_name,
    survey,
    validate_checkpoint,
)
from mlx_train.checkpointing.storage import (
    MANIFEST,
    BucketMissing,
    FsspecStore,
    LocalStore,
    check_bucket,
    open_store,
    safetensors_bytes,
    split_location,
)
from mlx_train.checkpointing.storage import pause_point as _pause_point  # tests replace it here
from mlx_train.config import metric_direction
from mlx_train.errors import CheckpointError, ConfigError

GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (torn, corrupt, leftover) or old ones could not be deleted."""


@dataclass
class _Job:
    step: int
    tmp: str
    arrays: dict[str, dict[str, mx.array] | bytes]  # bytes: a group already serialised on the caller's thread
    state_json: bytes
    metrics: dict[str, Any]


def storage_error_hint(error: BaseException) -> str:
    """How to fix a storage back-end's error (a missing bucket, refused credentials), or "" when unknown.

    Example::

        storage_error_hint(FileNotFoundError("The specified bucket does not exist"))
        # "the bucket does not exist: create it first, or fix the bucket name in the URL"
    """
    text = f"{type(error).__name__}: {error}".lower()
    refused = ("accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden",
               "unauthorized", "credentials", "401", "403")
    if isinstance(error, PermissionError) or any(word in text for word in refused):
        return ("the storage service refused the credentials: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "(s3://) or GOOGLE_APPLICATION_CREDENTIALS (gs://) and that they may write to this bucket")
    if "bucket" in text and any(word in text for word in ("not exist", "not found", "nosuchbucket")):
        return "the bucket does not exist: create it first, or fix the bucket name in the URL"
    return ""


#: How long a save retries an object store's transient network errors (doubling waits from RETRY_FIRST_DELAY up to
#: RETRY_MAX_DELAY seconds) before it fails; the training thread goes on meanwhile.
RETRY_SECONDS = 60.0
RETRY_FIRST_DELAY = 0.5
RETRY_MAX_DELAY = 8.0
# Exception class names of the network errors that s3fs/botocore, gcsfs and aiohttp raise for a blip.
_TRANSIENT_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError",
                    "ConnectionError", "Timeout", "RetryError")
_TRANSIENT_TEXT = ("503", "slowdown", "slow down", "service unavailable", "connection refused", "connection reset",
                   "timed out", "temporarily unavailable")


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a network failure that may pass: a refused or reset
    connection, a timeout, an HTTP 503. Refused credentials and missing buckets are not.

    Example: ``is_transient(ConnectionRefusedError())  # True``
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        name, text = type(current).__name__, str(current).lower()
        if any(part in name for part in _TRANSIENT_NAMES) or any(word in text for word in _TRANSIENT_TEXT):
            return not storage_error_hint(current)  # a refusal or a missing bucket stays an error
        current = current.__cause__ or current.__context__
    return False


def _local_hint(error: BaseException, store: LocalStore) -> str:
    if isinstance(error, PermissionError):
        return f"{store.display} is not writable (any more): fix its permissions or choose another checkpoint_dir"
    return ""


def _exists(path: str) -> bool:
    parent, name = split_location(path)
    store = open_store(parent)
    return store.isdir(name) or store.size(name) is not None


def _uncommitted(store: LocalStore | FsspecStore) -> list[str]:
    """Step directories without a manifest: saves cut off before their commit, never checkpoints."""
    return [name for name in scan(store)[0] if store.size(f"{name}/{MANIFEST}") is None and store.isdir(name)]


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON-able Python (tuples -> lists, scalar arrays -> numbers), or CheckpointError."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the key {key!r} ({type(key).__name__}); JSON keys must be "
                                      "strings, and a silent conversion would change the key on resume: use str keys")
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (np.generic, np.ndarray, mx.array)) and value.size == 1 and value.ndim == 0:
        return value.item()
    raise CheckpointError(f"{where} is a {type(value).__name__}, which cannot be saved as JSON: keep numbers, "
                          "strings, lists and dicts in state and pass arrays in the arrays argument")


def _snapshot(arrays: Any) -> dict[str, dict[str, mx.array]]:
    """Check the groups and copy the dicts (not the arrays: mx arrays are immutable)."""
    if not isinstance(arrays, dict):
        raise CheckpointError(f"arrays must be a dict of group name -> {{name: mx.array}}, got "
                              f"{type(arrays).__name__}: e.g. {{'model': dict(tree_flatten(model.parameters()))}}")
    snapshot: dict[str, dict[str, mx.array]] = {}
    for group, flat in arrays.items():
        if not isinstance(group, str) or not GROUP_NAME.match(group):
            raise CheckpointError(f"array group name {group!r} cannot be a file name: use letters, digits, _ . -")
        if not isinstance(flat, dict):
            raise CheckpointError(f"arrays[{group!r}] must be a flat dict name -> mx.array, got "
                                  f"{type(flat).__name__}: flatten it with tree_flatten(tree, destination={{}})")
        snapshot[group] = {}
        for key, value in flat.items():
            if isinstance(value, (np.ndarray, np.generic)):
                value = mx.array(value)  # type: ignore[arg-type]  # mlx accepts numpy arrays and scalars
            if not isinstance(key, str) or not isinstance(value, mx.array):
                raise CheckpointError(f"arrays[{group!r}][{key!r}] is a {type(value).__name__}; each group must map "
                                      "str names to mx.array (plain numbers belong in state)")
            snapshot[group][key] = value
    try:
        mx.eval(snapshot)  # normally a no-op; guarantees the writer thread only copies finished buffers
    except RuntimeError as error:
        if "Stream" not in str(error):
            raise
        raise CheckpointError(f"save() got arrays that are not evaluated yet, on a thread without an MLX "
                              f"stream ({error}): call mx.eval on them first, or save from the thread that "
                              "computed them") from None
    return snapshot


def _writer_needs_host_bytes() -> bool:
    """True where a background thread must not read MLX arrays: on CUDA an array's buffer can move between
    device and host while the training thread runs, so a writer thread reading it can crash the process."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def _disk_full(directory: str, error: BaseException) -> str:
    """". The disk is full: 0.1 MiB free on ..." when the failure looks like a full disk, else ""."""
    if "://" in directory:
        return ""
    full = getattr(error, "errno", None) == 28  # ENOSPC
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ". The disk is full" if full else ""
    if full or free < 64 * 2**20:
        return f". The disk is full: {free / 2**20:.1f} MiB free on the device holding {directory}"
    return ""


class CheckpointManager:
    """Save, list, prune and find checkpoints in one directory (local path or fsspec URL).

    One process writes to a directory (rank 0 in distributed runs). ``keep_last=None`` keeps
    everything; the most recently saved complete checkpoint is never deleted. ``mode`` is
    ``"min"``, ``"max"`` or ``"auto"`` (``metric_direction`` decides from the monitor name).

    Example::

        manager = CheckpointManager("memory://run", keep_last=2, keep_best=1, monitor="val_loss")
        manager.save(10, {"model": {"w": mx.zeros((2,))}}, {"epoch": 0}, {"val_loss": 1.0})
        manager.wait()
        assert manager.latest().step == 10
    """

    def __init__(self, directory: str, keep_last: int | None = 3, keep_best: int = 0,
                 monitor: str = "val_loss", mode: str = "min", async_save: bool = True,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0):
            raise ConfigError(f"keep_last must be None (keep all) or an int >= 0, got {keep_last!r}")
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
            raise ConfigError(f"keep_best must be an int >= 0, got {keep_best!r}")
        self.directory = directory
        self.keep_last, self.keep_best, self.monitor = keep_last, keep_best, monitor
        self.mode = metric_direction(monitor, mode)
        self.async_save = async_save
        self.retry_seconds = retry_seconds
        self._host_bytes = _writer_needs_host_bytes()
        self._store = open_store(directory)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None
        self._pending_path = ""  # where the pending save goes
        self._inflight: str | None = None  # temporary directory of the save in flight: not a leftover
        self._lock = threading.Lock()  # directory scans never interleave with a commit or a deletion
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ saving
    def save(self, step: int, arrays: dict[str, dict[str, mx.array]], state: dict[str, Any],
             metrics: dict[str, Any] | None = None) -> str:
        """Save a checkpoint of ``step`` and return its path; returns before writing when async.

        Validation and the JSON encoding of ``state`` happen now, so later changes to the
        caller's dicts do not leak in. A failed earlier background save is re-raised here.
        """
        self.wait()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        snapshot = _snapshot(arrays)
        groups: dict[str, dict[str, mx.array] | bytes] = dict(snapshot)
        if self.async_save and self._host_bytes:  # serialised here: the writer thread only writes bytes
            groups = {group: safetensors_bytes(flat) for group, flat in snapshot.items()}
        job = _Job(step, f"{step_name(step)}.tmp-{uuid.uuid4().hex[:8]}", groups,
                   json.dumps(_plain(state, "state"), indent=1).encode(), _plain(dict(metrics or {}), "metrics"))
        self._inflight = job.tmp
        if not self.async_save:
            self._write(job)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlx-train-checkpoint")
            self._pending = self._executor.submit(self._write, job)
            self._pending_path = self._store.url(step_name(step))
        return self._store.url(step_name(step))

    def wait(self, raise_error: bool = True) -> None:
        """Block until the pending save is written; re-raise its error (a CheckpointError) if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None and (raise_error or pending.exception() is None):
            pending.result()

    def writing(self) -> str | None:
        """The checkpoint a background save is still writing (its path); None when no save is under way."""
        pending = self._pending
        return self._pending_path if pending is not None and not pending.done() else None

    def raise_failed_save(self) -> None:
        """Re-raise the error of a background save that has already failed (a cheap check, no waiting)."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self.wait()

    def has_step_directories(self) -> bool:
        """True when the directory holds a committed checkpoint directory (one with a manifest), intact or not.

        A step directory without its manifest was never committed (its save was interrupted): it
        counts as absent, so a run whose first save was cut off can start over.
        """
        uncommitted = set(_uncommitted(self._store))
        return any(name not in uncommitted for name in scan(self._store)[0])

    def close(self) -> None:
        """Wait for the pending save and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, job: _Job) -> None:
        store, final = self._store, step_name(job.step)
        waited, delay = 0.0, RETRY_FIRST_DELAY
        while True:
            try:
                self._write_files(job)
                break
            except Exception as error:
                self._discard(job.tmp)
                if isinstance(store, FsspecStore) and is_transient(error) and waited < self.retry_seconds:
                    # A network blip: the save starts over (the training thread goes on meanwhile).
                    warnings.warn(f"saving checkpoint {store.url(final)} met a network error ({type(error).__name__}: "
                                  f"{error}); retrying in {delay:.1f} s ({waited:.0f} of {self.retry_seconds:.0f} s "
                                  "of retries used)", CheckpointWarning, stacklevel=2)
                    time.sleep(delay)
                    waited, delay = waited + delay, min(delay * 2, RETRY_MAX_DELAY)
                    continue
                raise self._save_failed(final, error) from error
            except BaseException:
                self._discard(job.tmp)
                raise
        _pause_point("commit", store.url(final))
        try:
            with self._lock:
                self._apply_retention()
        except Exception as error:  # the new checkpoint is complete; failing to prune must not lose it
            warnings.warn(f"could not delete old checkpoints in {store.display} ({type(error).__name__}: "
                          f"{error}); they keep using space until removed", CheckpointWarning, stacklevel=2)

    def _write_files(self, job: _Job) -> None:
        """One attempt at the save: the files into ``job.tmp``, the manifest, then the commit into place."""
        store, final = self._store, step_name(job.step)
        store.makedirs(job.tmp)
        self._inflight = job.tmp
        records = {}
        for group, flat in job.arrays.items():
            records[f"{group}.safetensors"] = store.write_safetensors(f"{job.tmp}/{group}.safetensors", flat)
            _pause_point(f"{group}.safetensors", store.url(job.tmp))
        records[STATE_FILE] = store.write_bytes(f"{job.tmp}/{STATE_FILE}", job.state_json)
        _pause_point(STATE_FILE, store.url(job.tmp))
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": job.step,
                    "saved_at": time.time(), "metrics": job.metrics,
                    "mlx_version": mx.__version__,  # type: ignore[attr-defined]  # not in the stubs
                    "files": {name: {"size": r.size, "sha256": r.sha256} for name, r in records.items()}}
        store.write_bytes(f"{job.tmp}/{MANIFEST}", manifest_bytes(manifest))
        _pause_point(MANIFEST, store.url(job.tmp))
        with self._lock:
            store.commit(job.tmp, final, [*records, MANIFEST])
            self._inflight = None

    def _save_failed(self, final: str, error: Exception) -> CheckpointError:
        """The error a failed save raises: what failed, that earlier checkpoints are untouched, and the fix."""
        store = self._store
        if isinstance(store, FsspecStore) and isinstance(error, FileNotFoundError) and not isinstance(
                error, BucketMissing):
            try:  # a file "missing" in the middle of a save: is it the bucket that went?
                check_bucket(store.fs, store.root, vanished=True)
            except BucketMissing as missing:
                error = missing
            except Exception:  # noqa: BLE001  # the check is a better message only; the original error stands
                pass
        if isinstance(error, BucketMissing) and error.vanished:
            return CheckpointError(
                f"saving checkpoint {store.url(final)} failed: {error}; it was deleted during the run, and "
                f"every checkpoint saved in {store.display} went with it. mlx-train never creates buckets: "
                "re-create the bucket (or choose another checkpoint_dir) and train again")
        hint = (storage_error_hint(error) if isinstance(store, FsspecStore) else _local_hint(error, store)) \
            or "fix the cause (disk space, permissions, network)"
        return CheckpointError(
            f"saving checkpoint {store.url(final)} failed ({type(error).__name__}: {error}); earlier "
            f"checkpoints are untouched: {hint}, and resume{_disk_full(self.directory, error)}")

    def _discard(self, tmp: str) -> None:
        self._inflight = None
        try:
            self._store.remove_tree(tmp)
        except Exception:
            pass  # a leftover tmp directory is ignored when reading and removed by a later save

    def _apply_retention(self) -> None:
        store = self._store
        for name in scan(store)[1] + _uncommitted(store):  # from interrupted saves or deletions (one writer)
            store.remove_tree(name)
        if self.keep_last is None:
            return
        complete = [info_from(store, name, manifest) for name, manifest in survey(store)]
        scored = [info for info in complete if info.metric(self.monitor) is not None
                  # metric() was checked for None just before; a NaN is never "best"
                  and math.isfinite(info.metric(self.monitor))]  # type: ignore[arg-type]
        sign = 1.0 if self.mode == "min" else -1.0
        # ties: the older one (every metric in scored is a number)
        scored.sort(key=lambda info: (sign * info.metric(self.monitor), info.step))  # type: ignore[operator]
        last = complete[-self.keep_last:] if self.keep_last else []
        keep = {info.path for info in complete[-1:] + last + scored[: self.keep_best]}
        for info in complete:
            if info.path not in keep:
                store.remove_tree(split_location(info.path)[1])

    # ------------------------------------------------------------------ reading
    def checkpoints(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest save first (manifest present, every file of its recorded size)."""
        with self._lock:
            self._report_leftovers()
            return [info_from(self._store, name, manifest) for name, manifest in survey(self._store, self._report)]

    def latest(self) -> CheckpointInfo | None:
        """The most recently saved checkpoint that passes every check (sha256 of each file included).

        Torn or corrupt checkpoints are skipped and reported once each as a CheckpointWarning.
        """
        skipped: list[tuple[str, Torn]] = []
        with self._lock:
            self._report_leftovers()
            info = newest_complete(self._store, on_torn=lambda name, torn: skipped.append((name, torn)))
        for name, torn in skipped:
            self._report(name, torn, info)
        return info

    def resolve(self, resume: str | None) -> str | None:
        """Turn a ``resume`` argument into a checkpoint path: "auto" -> latest() or None; a path -> checked path.

        A path may be a checkpoint, a directory of checkpoints (its newest complete one is used)
        or a checkpoint name inside this manager's directory (``"step-00000200"``).
        """
        if resume is None or resume == "":
            return None
        if resume == "auto":
            info = self.latest()
            return info.path if info else None
        path = resume
        if not _exists(path) and _exists(self._store.url(path)):
            path = self._store.url(path)  # a name inside this directory, e.g. "step-00000200"
        parent, name = split_location(path)
        parent_store = open_store(parent)
        if not STEP_DIR.match(name) and not TMP_DIR.match(name) and parent_store.isdir(name) \
                and parent_store.size(f"{name}/{MANIFEST}") is None:
            info = CheckpointManager(path, keep_last=None, async_save=False).latest()
            if info is None:
                raise CheckpointError(f"there is no complete checkpoint in {path} to resume from: pass a "
                                      "checkpoint such as <dir>/step-00000300, or start without --resume")
            return info.path
        return validate_checkpoint(path, None if _exists(path) else self._store).path

    def _report_leftovers(self) -> None:
        for name in scan(self._store)[1]:
            if name != self._inflight:
                self._report(name, Torn("is a temporary directory left by an interrupted save "
                                        "(ignored; safe to delete)"), None, leftover=True)

    def _report(self, name: str, torn: Torn, using: CheckpointInfo | None = None, leftover: bool = False) -> None:
        if name in self._reported:
            return
        self._reported.add(name)
        if leftover:
            instead = ""
        elif using is not None:
            instead = f"; skipped it, using {using.path}"
        else:
            instead = "; skipped it"
        warnings.warn(f"checkpoint {self._store.url(name)} {torn.reason}{instead}", CheckpointWarning, stacklevel=3)
