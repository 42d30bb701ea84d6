"""Make MLX's Linux CPU wheel use an optimized BLAS (OpenBLAS) instead of its bundled reference BLAS.

The ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS, which makes float32 matmuls ~50x slower
than NumPy. ``libmlx.so`` imports ``cblas_sgemm`` & co. as unversioned symbols, so a BLAS loaded into
the *global* symbol scope before ``mlx.core`` is imported wins the lookup (same as ``LD_PRELOAD``).
Results are unchanged; bfloat16/float16 matmuls do not use BLAS and stay slow.

This module uses the standard library only and never imports ``mlx.core`` (it must run before it).
It can be imported standalone (tests load it by file path).

Environment variable ``MLX_TRAIN_BLAS``: unset/``1``/``on``/``auto`` = find Debian's OpenBLAS
(``apt-get install libopenblas0-pthread``); ``0``/``off``/``false``/``no`` = keep MLX's bundled BLAS;
anything else = path (or loader name) of the BLAS library to load.

Example::

    from mlx_train import _blas
    _blas.preload()               # before anything imports mlx.core
    import mlx.core as mx
    print(_blas.describe())       # "OpenBLAS 0.3.21 (SkylakeX, 2 threads): /usr/lib/..."
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import sysconfig
import warnings
from typing import Any, cast

ENV_VAR = "MLX_TRAIN_BLAS"
_DISABLED = {"0", "off", "false", "no", "none"}
_AUTO = {"", "1", "on", "true", "yes", "auto"}
REFERENCE = "MLX's bundled reference BLAS"

# What preload() did: the library it loaded (or None) and, when it loaded none, why. Only the
# first call acts, so the "imported too late" warning is given once.
_state: dict[str, Any] = {"attempted": False, "loaded": None, "handle": None, "reason": None}


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def candidates() -> list[str]:
    """Paths tried, in order, when ``MLX_TRAIN_BLAS`` does not name a library (Debian/Ubuntu layout)."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    paths = [f"{root}/{arch}/{flavour}/libopenblas.so.0"
             for root in ("/usr/lib", "/lib")
             for flavour in ("openblas-pthread", "openblas-openmp", "openblas-serial")]
    return paths + ["libopenblas.so.0"]  # last: whatever the dynamic loader finds


def _setting() -> str:
    return os.environ.get(ENV_VAR, "").strip()


def _fix_hint() -> str:
    path = next((p for p in candidates()[:-1] if os.path.exists(p)), candidates()[0])
    return f"import mlx_train before mlx.core, or start Python with LD_PRELOAD={path}"


def preload() -> None:
    """Load an optimized BLAS with global symbol scope so MLX uses it; never raises.

    Call before ``mlx.core`` is imported (``mlx_train/__init__.py`` does it first thing). Does
    nothing off Linux, when ``MLX_TRAIN_BLAS=0``, or when no OpenBLAS is installed; calling it again
    is a no-op. If ``mlx.core`` is already imported without an optimized BLAS it warns once.
    """
    if _state["attempted"] or not sys.platform.startswith("linux"):
        return
    _state["attempted"] = True
    setting = _setting()
    if setting.lower() in _DISABLED:
        _state["reason"] = f"disabled by {ENV_VAR}={setting}"
        return
    if "mlx.core" in sys.modules:
        # Its BLAS symbols are already bound: loading now would change nothing but the report.
        if _global_provider() is None:
            _state["reason"] = f"mlx.core was imported before mlx_train; to fix: {_fix_hint()}"
            warnings.warn(f"mlx.core was imported before mlx_train, so MLX uses {REFERENCE} "
                          f"(float32 matmuls ~50x slower on the Linux CPU). To fix: {_fix_hint()}.",
                          RuntimeWarning, stacklevel=2)
        return
    explicit = setting.lower() not in _AUTO
    errors = []
    for path in [setting] if explicit else candidates():
        if "/" in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            _state["handle"] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            errors.append(str(error))
            continue
        _state["loaded"] = os.path.realpath(_library_path(path) or path)
        return
    if explicit:
        _state["reason"] = f"could not load {ENV_VAR}={setting} ({'; '.join(errors)})"
        warnings.warn(f"{_state['reason']}; MLX falls back to {REFERENCE}. Set {ENV_VAR} to the "
                      f"path of a CBLAS library (e.g. {candidates()[0]}) or unset it.",
                      RuntimeWarning, stacklevel=2)
    else:
        _state["reason"] = ("no OpenBLAS found; install it with "
                            "'apt-get install libopenblas0-pthread'")


def _global_provider() -> str | None:
    """The library that provides ``cblas_sgemm`` in the global scope (what libmlx binds to), if any."""
    try:
        process = ctypes.CDLL(None)
        function = process.cblas_sgemm
    except (OSError, AttributeError):
        return None
    return _library_path(None, function) or "unknown library"


def _library_path(name: str | None, function: Any = None) -> str | None:
    """File that defines ``function`` (or ``cblas_sgemm`` of library ``name``), via dladdr."""
    try:
        if function is None:
            function = ctypes.CDLL(name).cblas_sgemm
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if libc.dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            return cast(str, os.path.realpath(info.dli_fname.decode()))
    except (OSError, AttributeError):
        pass
    return None


def mapped_blas_libraries(maps_text: str | None = None) -> list[str]:
    """BLAS libraries mapped into this process per ``/proc/self/maps`` (first-seen order).

    Pass ``maps_text`` to parse given text instead (for tests).
    """
    if maps_text is None:
        try:
            with open("/proc/self/maps") as maps:
                maps_text = maps.read()
        except OSError:
            return []
    found: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        name = os.path.basename(path).lower()
        if path.startswith("/") and ("blas" in name or "mkl_rt" in name) and path not in found:
            found.append(path)
    return found


def _is_optimized(path: str) -> bool:
    # NumPy/SciPy wheels map their own OpenBLAS with renamed 64-bit symbols (scipy_openblas64_,
    # libopenblas64_): those can never serve MLX, so they do not count.
    name = os.path.basename(path).lower()
    return (name.startswith("libopenblas") or "mkl_rt" in name or "blis" in name) and "64_" not in name


def _openblas_details(path: str) -> tuple[str | None, str | None, int | None]:
    """(build string, CPU kernel name, thread count) of an OpenBLAS; Nones for other libraries."""
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return (lib.openblas_get_config().decode(), lib.openblas_get_corename().decode(),
                int(lib.openblas_get_num_threads()))
    except (OSError, AttributeError):
        return None, None, None


def blas_info() -> dict[str, Any]:
    """Which BLAS MLX's float32 matmuls use in this process, as a JSON-able dict.

    Keys: ``optimized`` (bool), ``library`` (path or None), ``name`` (e.g. "OpenBLAS 0.3.21"),
    ``config`` (OpenBLAS build string), ``core`` (its CPU kernels), ``threads``, ``loaded_by``
    ("mlx_train", "LD_PRELOAD or another library", or None), ``reason`` (why no optimized BLAS),
    ``mapped`` (BLAS files in ``/proc/self/maps``).
    """
    mapped = mapped_blas_libraries()
    info: dict[str, Any] = {"optimized": False, "library": None, "name": REFERENCE, "config": None, "core": None,
                  "threads": None, "loaded_by": None, "reason": _state["reason"], "mapped": mapped}
    if sys.platform == "darwin":
        info.update(optimized=True, name="Apple Accelerate", reason=None)
        return info
    provider = _global_provider()
    if provider is None or not _is_optimized(provider):
        if provider is not None:
            info["reason"] = f"cblas_sgemm comes from {provider}"
        elif info["reason"] is None:
            info["reason"] = "preload() was not called before mlx.core was imported"
        return info
    config, core, threads = _openblas_details(provider)
    name = os.path.basename(provider)
    if config and config.startswith("OpenBLAS"):
        name = " ".join(config.split()[:2])
    loaded_by = "mlx_train" if _state["loaded"] == provider else "LD_PRELOAD or another library"
    info.update(optimized=True, library=provider, name=name, config=config, core=core, threads=threads,
                loaded_by=loaded_by, reason=None)
    return info


def describe() -> str:
    """One line for the CLI startup banner saying which BLAS is in use and, if slow, how to fix it."""
    info = blas_info()
    if info["optimized"] and info["library"]:
        arch = f"{info['core']}, " if info["core"] else ""
        threads = f"{info['threads']} threads" if info["threads"] else "threads unknown"
        return f"{info['name']} ({arch}{threads}): {info['library']}"
    if info["optimized"]:
        return cast(str, info["name"])
    return f"{REFERENCE} (slow float32 matmuls: {info['reason']})"
