"""Where a command writes a file a user named: checked before the work, with what is wrong and how to fix it.

Example::

    from mlx_train.paths import writable_file
    writable_file("out/model.onnx", "the export's output")   # makes out/, or raises ConfigError
"""

from __future__ import annotations

import os
import tempfile

from mlx_train.errors import ConfigError


def writable_file(path: str | os.PathLike[str], what: str) -> str:
    """Make the folders of ``path`` and check that a file can be written there; returns the path as a string.

    A directory, a folder that cannot be made, or one that refuses new files (read-only, immutable, a
    pseudo file system such as /proc) is a ``ConfigError`` naming ``what``, the path, the reason and the fix.
    """
    text = os.fspath(path)
    fix = "choose a file in a folder you can write to"
    if os.path.isdir(text):
        raise ConfigError(f"{what} {text} is a directory: give the name of a file to write, e.g. "
                          f"{os.path.join(text, 'NAME')}")
    folder = os.path.dirname(os.path.abspath(text))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{what} {text}: its folder {folder} cannot be made ({error.strerror or error}); "
                          f"{fix}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mlx-train-check-"):
            pass
    except OSError as error:
        raise ConfigError(f"{what} {text} cannot be written: its folder {folder} refuses new files "
                          f"({error.strerror or error}); {fix}") from None
    return text
