"""mlx_train._blas in fresh interpreters: OpenBLAS preloaded before mlx.core, opt-out, warnings, same results.

Each case runs a new Python that loads ``_blas.py`` by file path (not the ``mlx_train`` package), so
the order of imports is exactly the one under test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BLAS_FILE = Path(__file__).resolve().parents[1] / "src" / "mlx_train" / "_blas.py"

SCRIPT = r"""
import importlib.util, json, sys, warnings
spec = importlib.util.spec_from_file_location("standalone_blas", sys.argv[1])
blas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if sys.argv[2] == "mlx-first":
        import mlx.core
    blas.preload()
    blas.preload()  # a second call is a no-op
    imported_by_preload = sys.argv[2] != "mlx-first" and "mlx.core" in sys.modules
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(1234)
a = rng.standard_normal((256, 256)).astype(np.float32)
b = rng.standard_normal((256, 256)).astype(np.float32)
np.save(sys.argv[3], np.array(mx.matmul(mx.array(a), mx.array(b))))
maps = [line.split()[-1] for line in open("/proc/self/maps") if "/libopenblas" in line]
print(json.dumps({"warnings": [str(w.message) for w in caught], "describe": blas.describe(),
                  "info": blas.blas_info(), "openblas_mapped": sorted(set(maps)),
                  "imported_by_preload": imported_by_preload}))
"""


def _load_module():
    spec = importlib.util.spec_from_file_location("blas_under_test", BLAS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


blas = _load_module()
INSTALLED = next((p for p in blas.candidates()[:-1] if os.path.exists(p)), None)


def run(tmp_path: Path, mode: str = "normal", **env: str) -> tuple[dict, np.ndarray]:
    """Run SCRIPT in a fresh interpreter with exactly these BLAS settings; (report, matmul result)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MLX_TRAIN_BLAS", "LD_PRELOAD")}
    out = tmp_path / f"{mode}-{len(list(tmp_path.iterdir()))}.npy"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BLAS_FILE), mode, str(out)],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), np.load(out)


@pytest.fixture(scope="module")
def default_and_disabled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blas")
    return run(tmp), run(tmp, MLX_TRAIN_BLAS="0")


def test_preload_loads_openblas_before_mlx(default_and_disabled):
    (report, _), _ = default_and_disabled
    assert report["imported_by_preload"] is False  # _blas never imports mlx.core itself
    assert report["warnings"] == []
    if INSTALLED:
        assert report["openblas_mapped"], "OpenBLAS is installed but was not mapped"
        assert report["describe"].startswith("OpenBLAS ") and "/libopenblas" in report["describe"]
        assert report["info"]["optimized"] is True and report["info"]["loaded_by"] == "mlx_train"
        assert report["info"]["library"] in report["openblas_mapped"]
    else:  # without the Debian package: a clear hint, no failure
        assert "apt-get install libopenblas0-pthread" in report["describe"]


def test_opt_out_keeps_the_reference_blas(default_and_disabled):
    _, (report, _) = default_and_disabled
    assert report["openblas_mapped"] == []
    assert report["describe"] == ("MLX's bundled reference BLAS (slow float32 matmuls: "
                                  "disabled by MLX_TRAIN_BLAS=0)")
    assert report["info"]["optimized"] is False and report["info"]["library"] is None


def test_results_agree_with_and_without_openblas(default_and_disabled):
    (_, fast), (_, reference) = default_and_disabled
    rng = np.random.default_rng(1234)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.allclose(fast, reference, rtol=1e-4, atol=1e-4)
    assert np.allclose(fast, exact, rtol=1e-4, atol=1e-4)
    assert np.allclose(reference, exact, rtol=1e-4, atol=1e-4)


def test_mlx_imported_first_warns_once(tmp_path):
    report, _ = run(tmp_path, "mlx-first")
    assert len(report["warnings"]) == 1
    message = report["warnings"][0]
    assert message.startswith("mlx.core was imported before mlx_train, so MLX uses MLX's bundled "
                              "reference BLAS (float32 matmuls ~50x slower on the Linux CPU). "
                              "To fix: import mlx_train before mlx.core, or start Python with LD_PRELOAD=")
    assert report["openblas_mapped"] == []  # loading it now would not help, so it is not loaded
    assert report["describe"].startswith("MLX's bundled reference BLAS (slow float32 matmuls: "
                                         "mlx.core was imported before mlx_train; to fix:")


def test_bad_explicit_path_falls_back_with_a_warning(tmp_path):
    report, _ = run(tmp_path, MLX_TRAIN_BLAS="/nonexistent/libcblas.so")
    assert report["warnings"] == [
        "could not load MLX_TRAIN_BLAS=/nonexistent/libcblas.so (/nonexistent/libcblas.so: no such file); "
        "MLX falls back to MLX's bundled reference BLAS. Set MLX_TRAIN_BLAS to the path of a CBLAS "
        f"library (e.g. {blas.candidates()[0]}) or unset it."]
    assert report["describe"].startswith("MLX's bundled reference BLAS (slow float32 matmuls: could not load")


def test_explicit_path_and_ld_preload_are_recognised(tmp_path):
    library = INSTALLED or "libopenblas.so.0"
    report, _ = run(tmp_path, MLX_TRAIN_BLAS=library)
    assert report["info"]["optimized"] is bool(INSTALLED)
    # Loaded outside mlx_train (LD_PRELOAD) with mlx_train's own loading turned off: still detected.
    if INSTALLED:
        report, _ = run(tmp_path, MLX_TRAIN_BLAS="off", LD_PRELOAD=INSTALLED)
        assert report["describe"].startswith("OpenBLAS ")
        assert report["info"]["loaded_by"] == "LD_PRELOAD or another library"


def test_maps_parsing_ignores_numpys_renamed_openblas():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n"
        "7f10-7f20 r--p 00000000 08:01 2 /site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so\n"
        "7f20-7f30 r-xp 00000000 08:01 3 /site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n")
    mapped = blas.mapped_blas_libraries(maps)
    assert mapped == ["/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so",
                      "/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so",
                      "/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"]
    assert [blas._is_optimized(path) for path in mapped] == [True, False, False]
