"""Where checkpoint bytes go: a local directory or an fsspec URL.

A store is rooted at the checkpoint directory and takes paths relative to it
(``"step-00000300/model.safetensors"``). Local stores write with fsync and commit
a checkpoint with one atomic ``os.rename``; fsspec stores (``memory://``,
``s3://``, ``gs://``...) move the data files first and the manifest last, so
the manifest is the commit marker where the store has no atomic rename.

Example::

    store = open_store("memory://runs/a")
    store.write_bytes("notes.txt", b"hello")
    assert store.read_bytes("notes.txt") == b"hello"
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from mlx_train.errors import CheckpointError
from mlx_train.rundir import atomic_write

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """Size and sha256 of one written file, as recorded in the manifest."""

    size: int
    sha256: str


def open_store(location: str) -> LocalStore | FsspecStore:
    """Return the store for a local path or an fsspec URL (fsspec is imported only for URLs)."""
    if not location.endswith("://"):
        location = location.rstrip("/") or "/"
    if "://" not in location:
        return LocalStore(location, os.path.expanduser(location))
    scheme = location.split("://", 1)[0]
    if scheme == "file":
        # file:// is a local disk: keep fsync + atomic rename instead of fsspec's copy.
        return LocalStore(location, location[len("file://"):] or "/")
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(
            f"checkpoint directory {location} is a {scheme}:// URL, which needs fsspec: "
            "pip install 'mlx-train[cloud]' (plus 'mlx-train[s3]' or 'mlx-train[gcs]' for S3/GCS)"
        ) from None
    try:
        fs, root = fsspec.core.url_to_fs(location)
    except ValueError as error:
        raise CheckpointError(
            f"checkpoint directory {location} uses an unknown storage scheme '{scheme}://' ({error}): "
            "use a local path, file://, memory://, s3:// or gs://"
        ) from None
    except ImportError as error:
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme, "cloud")
        raise CheckpointError(
            f"checkpoint directory {location} needs a storage back-end that is not installed "
            f"({error}): pip install 'mlx-train[{extra}]'"
        ) from None
    return FsspecStore(location, fs, root)


def pause_point(point: str, where: str) -> None:
    """Test hook, not a feature: sleep at ``point`` of a save so that a test can SIGKILL it there.

    MLX_TRAIN_SAVE_PAUSE_AFTER=<file name, "files moved" or "commit"> makes the writer announce itself
    on stderr and sleep right after writing that file, after an object store's commit moved the data
    files but not yet the manifest, or after the final rename. MLX_TRAIN_SAVE_PAUSE_SECONDS: how long;
    MLX_TRAIN_SAVE_PAUSE_UNTIL=<file>: until that file exists instead (at most that long).
    """
    if os.environ.get("MLX_TRAIN_SAVE_PAUSE_AFTER") != point:
        return
    print(f"mlx-train test hook: save paused after {point} in {where}", file=sys.stderr, flush=True)
    until, deadline = os.environ.get("MLX_TRAIN_SAVE_PAUSE_UNTIL"), \
        time.monotonic() + float(os.environ.get("MLX_TRAIN_SAVE_PAUSE_SECONDS", "3600"))
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def split_location(path: str) -> tuple[str, str]:
    """Split a checkpoint path or URL into (parent directory, checkpoint name)."""
    prefix, rest = ("", path) if "://" not in path else (path.split("://", 1)[0] + "://", path.split("://", 1)[1])
    rest = rest.rstrip("/")
    if "/" not in rest:
        return prefix or ".", rest
    parent, name = rest.rsplit("/", 1)
    return prefix + (parent or "/"), name


def _join(display: str, rel: str) -> str:
    if not rel:
        return display
    if display == ".":
        return rel
    return display + rel if display.endswith("/") else f"{display}/{rel}"


def _fsync_dir(path: str) -> None:
    # Makes a rename durable; some platforms cannot open directories, which is fine.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safetensors_bytes(arrays: dict[str, mx.array]) -> bytes:
    """``arrays`` as the bytes of a safetensors file, written by MLX in memory."""
    buffer = io.BytesIO()
    mx.save_safetensors(buffer, arrays)
    return buffer.getvalue()


class LocalStore:
    """A directory on local disk: fsync'ed writes, atomic rename commits."""

    def __init__(self, display: str, local_root: str) -> None:
        self.display = display
        self.local_root = local_root

    def url(self, rel: str) -> str:
        """The user-facing path of ``rel`` (as the directory was given)."""
        return _join(self.display, rel)

    def local(self, rel: str) -> str:
        return os.path.join(self.local_root, rel)

    def listdir(self) -> list[str]:
        try:
            return sorted(os.listdir(self.local_root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def isdir(self, rel: str) -> bool:
        return os.path.isdir(self.local(rel))

    def size(self, rel: str) -> int | None:
        try:
            return os.path.getsize(self.local(rel))
        except OSError:
            return None

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.local(rel), exist_ok=True)

    def read_bytes(self, rel: str) -> bytes:
        with open(self.local(rel), "rb") as f:
            return f.read()

    def sha256(self, rel: str) -> str:
        digest = hashlib.sha256()
        with open(self.local(rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def write_bytes(self, rel: str, data: bytes) -> FileRecord:
        atomic_write(self.local(rel), data)  # the run directory's one local writer: temp, fsync, rename
        return FileRecord(len(data), hashlib.sha256(data).hexdigest())

    def write_safetensors(self, rel: str, arrays: dict[str, mx.array] | bytes) -> FileRecord:
        """Write ``arrays``, or a safetensors file already serialised (bytes)."""
        if isinstance(arrays, bytes):
            return self.write_bytes(rel, arrays)
        # MLX writes straight to disk (no second copy in memory); hash what landed there.
        path = self.local(rel)
        mx.save_safetensors(path, arrays)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        return FileRecord(os.path.getsize(path), self.sha256(rel))

    def read_safetensors(self, rel: str, sha256: str) -> dict[str, mx.array]:
        """Load arrays after checking the file's sha256 (ValueError when it differs)."""
        if self.sha256(rel) != sha256:
            raise ValueError("sha256 mismatch")
        arrays = cast("dict[str, mx.array]", mx.load(self.local(rel), format="safetensors"))
        mx.eval(arrays)  # read now: a later retention pass may delete the file
        return arrays

    def commit(self, tmp: str, final: str, files: list[str]) -> None:
        """Atomically turn directory ``tmp`` into ``final`` (replacing an older ``final``)."""
        _fsync_dir(self.local(tmp))
        old = None
        if os.path.exists(self.local(final)):
            old = f"{final}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.rename(self.local(final), self.local(old))
        os.rename(self.local(tmp), self.local(final))
        _fsync_dir(self.local_root)
        if old:
            shutil.rmtree(self.local(old), ignore_errors=True)

    def remove_tree(self, rel: str) -> None:
        # Rename first so a kill during rmtree leaves a tmp-named leftover, never a half checkpoint.
        doomed = rel if ".tmp-" in rel else f"{rel}.tmp-del-{uuid.uuid4().hex[:8]}"
        if doomed != rel:
            os.rename(self.local(rel), self.local(doomed))
        shutil.rmtree(self.local(doomed), ignore_errors=True)


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}


class BucketMissing(FileNotFoundError):
    """The bucket of an object-store checkpoint directory does not exist (``vanished``: it did earlier)."""

    def __init__(self, bucket: str, vanished: bool = False) -> None:
        what = "no longer exists (it did when this run first wrote there)" if vanished else "does not exist"
        super().__init__(f"the bucket '{bucket}' {what}")
        self.bucket, self.vanished = bucket, vanished


def check_bucket(fs: Any, root: str, vanished: bool = False) -> None:
    """Raise BucketMissing when ``root`` is on an object store whose bucket does not exist.

    s3fs and gcsfs create a missing bucket on ``makedirs``: a misspelt bucket name would
    silently become a new bucket instead of an error. One request (a HEAD or GET of the bucket).

    Example::

        check_bucket(fsspec.filesystem("s3"), "my-bucket/runs/a")   # BucketMissing if there is no my-bucket
    """
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    bucket = root.strip("/").split("/", 1)[0]
    if not (protocols & _OBJECT_STORES and bucket):
        return
    fs.invalidate_cache(bucket)  # a cached listing would answer for a bucket deleted since
    try:
        fs.info(bucket)  # unlike fs.exists, lets a refusal (bad credentials) through as itself
    except FileNotFoundError:
        raise BucketMissing(bucket, vanished) from None


def check_location(location: str) -> None:
    """Raise when checkpoints cannot go to ``location`` at all (a URL whose bucket is missing): before training.

    Example::

        check_location("s3://no-such-bucket/runs/a")   # BucketMissing: the bucket 'no-such-bucket' does not exist
    """
    store = open_store(location)
    if isinstance(store, FsspecStore):
        check_bucket(store.fs, store.root)


class FsspecStore:
    """A directory behind an fsspec URL; the manifest, written last, marks a checkpoint complete."""

    def __init__(self, display: str, fs: Any, root: str) -> None:
        self.display = display
        self.fs = fs
        self.root = root.rstrip("/")
        self._bucket_seen = False

    def url(self, rel: str) -> str:
        return _join(self.display, rel)

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def listdir(self) -> list[str]:
        self.fs.invalidate_cache(self.root)  # another process may have written since the last listing
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def isdir(self, rel: str) -> bool:
        return cast(bool, self.fs.isdir(self._p(rel)))

    def size(self, rel: str) -> int | None:
        try:
            return int(self.fs.size(self._p(rel)))
        except (FileNotFoundError, OSError):
            return None

    def makedirs(self, rel: str) -> None:
        # Before every save: the back-end would silently re-create a bucket deleted during the run.
        check_bucket(self.fs, self.root, vanished=self._bucket_seen)
        self._bucket_seen = True
        self.fs.makedirs(self._p(rel), exist_ok=True)

    def read_bytes(self, rel: str) -> bytes:
        return cast(bytes, self.fs.cat_file(self._p(rel)))

    def sha256(self, rel: str) -> str:
        return hashlib.sha256(self.read_bytes(rel)).hexdigest()

    def write_bytes(self, rel: str, data: bytes) -> FileRecord:
        self.fs.pipe_file(self._p(rel), data)
        return FileRecord(len(data), hashlib.sha256(data).hexdigest())

    def write_safetensors(self, rel: str, arrays: dict[str, mx.array] | bytes) -> FileRecord:
        """Write ``arrays``, or a safetensors file already serialised (bytes)."""
        return self.write_bytes(rel, arrays if isinstance(arrays, bytes) else safetensors_bytes(arrays))

    def read_safetensors(self, rel: str, sha256: str) -> dict[str, mx.array]:
        """Load arrays after checking the file's sha256 (ValueError when it differs)."""
        data = self.read_bytes(rel)  # one download, hashed and parsed
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError("sha256 mismatch")
        arrays = cast("dict[str, mx.array]", mx.load(io.BytesIO(data), format="safetensors"))
        mx.eval(arrays)
        return arrays

    def commit(self, tmp: str, final: str, files: list[str]) -> None:
        """Move ``files`` from ``tmp`` into ``final``, the manifest last (the commit marker)."""
        if self.fs.exists(self._p(f"{final}/{MANIFEST}")):
            self.fs.rm(self._p(f"{final}/{MANIFEST}"))  # un-commit the old one before overwriting it
        for name in sorted(files, key=lambda n: n == MANIFEST):
            if name == MANIFEST:
                pause_point("files moved", self.url(final))
            # copy + delete, which is what a move is on an object store: gcsfs's mv first tries GCS's
            # objects.moveTo call and, where that is refused, retries it for half a minute per file.
            self.fs.copy(self._p(f"{tmp}/{name}"), self._p(f"{final}/{name}"))
            self.fs.rm(self._p(f"{tmp}/{name}"))
        if self.fs.exists(self._p(tmp)):
            self.fs.rm(self._p(tmp), recursive=True)

    def remove_tree(self, rel: str) -> None:
        if self.fs.exists(self._p(f"{rel}/{MANIFEST}")):
            self.fs.rm(self._p(f"{rel}/{MANIFEST}"))  # un-commit first: a partial delete reads as torn
        if self.fs.exists(self._p(rel)):
            self.fs.rm(self._p(rel), recursive=True)
