"""The ``mlx.launch`` wrapper: where the launcher is, and free ports for its ranks.

Example::

    argv = [launcher_path(), "--hostfile", "hosts.json", "--starting-port", str(free_port_base(2)), "--", ...]
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys

from mlx_train.errors import DistributedError


def launcher_path() -> str:
    """The ``mlx.launch`` console script installed with mlx."""
    beside = os.path.join(os.path.dirname(sys.executable), "mlx.launch")  # skips version-manager shims
    path = beside if os.path.exists(beside) else shutil.which("mlx.launch")
    if not path:
        raise DistributedError("mlx.launch was not found (it is installed with mlx): reinstall mlx "
                               "(pip install mlx) in this environment")
    return path


def free_port_base(count: int, host: str = "127.0.0.1") -> int:
    """A port P such that P .. P+count-1 can be bound on ``host`` now."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    return 32323
