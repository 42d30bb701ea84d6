"""Data parallel equals one process: 2 ranks x batch 16 vs 1 rank x batch 32, launched for real
with MLX's own launcher on 127.0.0.1 (ring backend)."""

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "dp_run.py")


def _launcher():
    path = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    assert os.path.exists(path), "mlx.launch (installed with mlx) was not found"
    return path


def test_two_ranks_of_16_equal_one_rank_of_32(tmp_path):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    subprocess.run([sys.executable, SCRIPT, str(one)], check=True, env=env, timeout=300,
                   stdout=subprocess.DEVNULL)
    subprocess.run([_launcher(), "-n", "2", "--", sys.executable, SCRIPT, str(two)], check=True, env=env,
                   timeout=300, stdout=subprocess.DEVNULL)
    a, b = mx.load(str(one)), mx.load(str(two))
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = np.array(a[name]), np.array(b[name])
        assert np.abs(x - y).max() / np.abs(x).max() < 1e-5, name
