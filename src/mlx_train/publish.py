"""Publish a trained model to a local directory or an fsspec URL (``gs://``, ``s3://``...).

:func:`publish` writes the weights (``model.safetensors``), a JSON description
(``model.json``: class, parameter shapes, your config) and, when asked, exports
(``model.onnx``, ``model.mlxfn``) to ``destination``, then ``publish.json`` last:
object stores have no atomic rename, so the manifest, with the size and sha256
of every file, is what marks a publication complete. :func:`download` checks it.

Checkpoints go to a URL directly: ``Trainer.train(checkpoint_dir="gs://bucket/run")``.
Credentials and endpoints come from the storage library's usual sources
(``AWS_*`` variables or ``~/.aws`` for s3fs, ``GOOGLE_APPLICATION_CREDENTIALS`` or
``gcloud`` for gcsfs) or from ``storage_options``.

Example::

    from mlx_train.publish import publish

    publish(model, "gs://my-bucket/models/digits-v1", example_inputs=[mx.zeros((1, 64))],
            formats=("safetensors", "onnx"), config={"hidden_dims": [256]})
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.checkpointing.manager import storage_error_hint
from mlx_train.checkpointing.storage import check_bucket
from mlx_train.errors import CheckpointError, ConfigError

__all__ = ["PUBLISH_MANIFEST", "publish", "download"]

PUBLISH_MANIFEST = "publish.json"
_FILES = {"safetensors": "model.safetensors", "onnx": "model.onnx", "mlxfn": "model.mlxfn"}


def _filesystem(destination: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec file system (untyped) and the root path inside it for ``destination``."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"publishing to {destination} needs fsspec: pip install 'mlx-train[cloud]' "
                          "(plus 'mlx-train[s3]' or 'mlx-train[gcs]')") from None
    try:
        fs, root = fsspec.core.url_to_fs(destination, **dict(storage_options or {}))
        return fs, root
    except ImportError as error:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(destination.split("://")[0], "cloud")
        raise ConfigError(f"publishing to {destination} needs a storage back-end that is not installed "
                          f"({error}): pip install 'mlx-train[{extra}]'") from None
    except Exception as error:  # the client reads its credentials when it is created
        raise CheckpointError(f"could not open {destination} ({type(error).__name__}: {error}): check the "
                              "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://, "
                              "GOOGLE_APPLICATION_CREDENTIALS for gs://) and the storage options") from error


def _failed(action: str, where: str, error: BaseException) -> CheckpointError:
    hint = storage_error_hint(error)
    return CheckpointError(f"{action} {where} failed ({type(error).__name__}: {error})"
                           + (f"; {hint}" if hint else ""))


def publish(model: nn.Module, destination: str, example_inputs: Sequence[mx.array] | None = None,
            formats: Sequence[str] = ("safetensors",), config: Mapping[str, Any] | None = None,
            storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``model`` to ``destination`` (a directory or URL) and return the manifest written last.

    ``formats``: any of ``"safetensors"`` (always useful: weights + ``model.json``),
    ``"onnx"``, ``"mlxfn"`` (these need ``example_inputs`` and are verified against
    MLX before upload). ``config`` is stored in ``model.json`` to rebuild the model.

    Example::

        manifest = publish(model, "s3://models/mlp", [mx.zeros((1, 64))], formats=("safetensors", "onnx"))
        manifest["files"]["model.onnx"]["sha256"]
    """
    from mlx_train.export import export, write_safetensors

    unknown = [f for f in formats if f not in _FILES]
    if unknown or not formats:
        raise ConfigError(f"unknown publish format(s) {unknown or list(formats)}; formats: {', '.join(_FILES)}")
    if example_inputs is None and any(f != "safetensors" for f in formats):
        raise ConfigError("publishing an onnx or mlxfn export needs example_inputs (e.g. [mx.zeros((1, 64))])")
    examples = list(example_inputs or [])
    fs, root = _filesystem(destination, storage_options)
    with tempfile.TemporaryDirectory(prefix="mlx-train-publish-") as staging:
        local = Path(staging)
        for fmt in formats:
            if fmt == "safetensors":
                write_safetensors(model, local / _FILES[fmt], examples, {"config": dict(config or {})})
            else:
                export(model, examples, local / _FILES[fmt])
        files = {}
        for path in sorted(local.iterdir()):
            data = path.read_bytes()
            files[path.name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {"format": "mlx-train published model", "published_at": time.time(),
                    "mlx_version": mx.__version__, "files": files}  # type: ignore[attr-defined]  # not in the stubs
        target = f"{root.rstrip('/')}/"
        try:
            check_bucket(fs, root)
            fs.makedirs(root, exist_ok=True)
            if fs.exists(target + PUBLISH_MANIFEST):
                fs.rm(target + PUBLISH_MANIFEST)  # un-publish the old version before replacing its files
            for name in files:
                fs.put_file(str(local / name), target + name)
            fs.pipe_file(target + PUBLISH_MANIFEST, json.dumps(manifest, indent=1).encode())
        except Exception as error:
            raise _failed("publishing to", destination, error) from error
    return manifest


def download(source: str, directory: str | Path, storage_options: Mapping[str, Any] | None = None) -> Path:
    """Copy a published model from ``source`` into ``directory``, checking every file against the manifest.

    Example::

        folder = download("gs://my-bucket/models/digits-v1", "models/digits")
        model.load_weights(str(folder / "model.safetensors"))
    """
    fs, root = _filesystem(source, storage_options)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    base = f"{root.rstrip('/')}/"
    try:
        raw = fs.cat_file(base + PUBLISH_MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(f"{source} holds no {PUBLISH_MANIFEST}: nothing was published there, or the "
                              "upload was interrupted before it finished; publish again") from None
    except Exception as error:
        raise _failed("reading", source, error) from error
    manifest = json.loads(raw)
    for name, record in manifest["files"].items():
        data = fs.cat_file(base + name)
        if len(data) != record["size"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise CheckpointError(f"{source}/{name} does not match {PUBLISH_MANIFEST} (changed or damaged "
                                  "after publishing); publish the model again")
        (target / name).write_bytes(data)
    return target
