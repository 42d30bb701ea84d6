"""Which device MLX trains on, what it offers, and its memory limits.

Example::

    from mlx_train import DeviceConfig
    hw_config = DeviceConfig(device="auto", memory_limit="8GB")
    trainer = Trainer(model, optimizer, device_config=hw_config)
    print(hw_config.info())     # "cpu: Intel Xeon, 25.3 GB (22.1 GB available); BLAS OpenBLAS 0.3.21 ..."
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mlx_train import _blas
from mlx_train.config import TrainConfig, option, parse_bytes, same_as
from mlx_train.config.options import byte_count, check_fields
from mlx_train.errors import DeviceError

__all__ = ["DEVICES", "DeviceConfig", "DeviceInfo", "available_backends", "available_memory", "backend_packages",
           "detect_devices", "device_info", "format_bytes", "gpu_install_advice", "parse_bytes",
           "shadowed_gpu_library", "system_memory"]

#: What ``DeviceConfig(device=...)`` accepts: ``gpu`` is whichever GPU backend the MLX build has.
DEVICES = ("auto", "gpu", "cpu", "metal", "cuda")


def format_bytes(count: float | None) -> str:
    """``1.5e9 -> "1.50 GB"``, ``2.5e6 -> "2.50 MB"`` (decimal units, like MLX's reports)."""
    if count is None:
        return "unknown"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def available_backends() -> dict[str, bool]:
    """What the installed MLX can run on: ``{"metal": ..., "cuda": ..., "cpu": True}``."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return {
        "metal": bool(mx.metal.is_available()),
        "cuda": bool(cuda is not None and cuda.is_available()),
        "cpu": True,
    }


#: The Linux wheels that carry MLX's compiled library, ``mlx/lib/libmlx.so``: each ships its own copy of
#: that one file, so with two installed the one pip wrote last is the one that runs.
BACKEND_PACKAGES = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
_LIBRARY = "mlx/lib/libmlx.so"


def backend_packages(distributions: Iterable[Any] | None = None) -> dict[str, bool]:
    """The installed MLX backend wheels (``BACKEND_PACKAGES``), each with whether the ``libmlx.so`` on
    disk is its own (its RECORD's hash matches the file): ``{"mlx-cpu": False, "mlx-cuda-12": True}``.

    ``distributions`` defaults to the installed ones (``importlib.metadata``). A lone backend wheel is
    the active one (nothing is read from disk then). An empty dict on macOS, where MLX's library is in the
    ``mlx`` and ``mlx-metal`` wheels.
    """
    import importlib.metadata

    installed: dict[str, Any] = {}
    for dist in importlib.metadata.distributions() if distributions is None else distributions:
        name = str(dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in BACKEND_PACKAGES:
            installed.setdefault(name, dist)
    if len(installed) < 2:
        return {name: True for name in installed}
    return {name: _owns_library(dist) for name, dist in installed.items()}


def _owns_library(dist: Any) -> bool:
    """Whether the ``libmlx.so`` on disk is the one ``dist`` installed (the hash in its RECORD)."""
    entry = next((f for f in dist.files or () if str(f).replace(os.sep, "/") == _LIBRARY), None)
    if entry is None or entry.hash is None:
        return False
    digest = hashlib.new(entry.hash.mode)
    try:
        with open(dist.locate_file(entry), "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return False
    return bool(base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() == entry.hash.value)


def gpu_install_advice(packages: dict[str, bool] | None = None) -> str:
    """What to install for a GPU, given ``backend_packages()``: on Linux with a CUDA wheel installed whose
    ``libmlx.so`` was overwritten by another backend's, the command that puts the CUDA one back."""
    shadowed = shadowed_gpu_library(packages)
    if shadowed is not None:
        return shadowed
    return ("On Apple silicon install 'mlx'; on Linux with an NVIDIA GPU install mlx-train with the cuda12 or cuda13 "
            "extra, then force MLX's CUDA library in (Getting started, 'Install for an NVIDIA GPU')")


def shadowed_gpu_library(packages: dict[str, bool] | None = None) -> str | None:
    """None, or when an MLX CUDA wheel is installed but another backend's ``libmlx.so`` is the one on disk
    (so MLX runs on the CPU), a sentence saying so and the command that puts the CUDA library back."""
    packages = backend_packages() if packages is None else packages
    shadowed = [name for name, active in packages.items() if name.startswith("mlx-cuda") and not active]
    if shadowed and any(packages.values()):
        active = next(name for name, is_active in packages.items() if is_active)
        return (f"{shadowed[0]} is installed but {active}'s copy of {_LIBRARY} is the one on disk (both wheels ship "
                f"that file and pip wrote {active}'s last): run pip install --no-deps --force-reinstall "
                f"\"{shadowed[0]}==$(pip show mlx | sed -n 's/^Version: //p')\"")
    return None


def system_memory() -> int | None:
    """Physical memory in bytes (None when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """Memory the system could give this process now (Linux ``MemAvailable``; None elsewhere)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class DeviceInfo:
    """What one device offers: its backend, name, memory, and (Linux CPU) the BLAS in use."""

    backend: str  #: "metal", "cuda" or "cpu"
    name: str
    memory_total: int | None  #: physical memory the device can use, bytes
    memory_available: int | None  #: free now (CUDA, Linux CPU) or the recommended working set (Metal)
    blas: str | None = None  #: Linux CPU: which BLAS MLX's float32 matmuls use

    @property
    def memory(self) -> int | None:
        """The memory to plan with: what is available, else the total."""
        return self.memory_available or self.memory_total

    def __str__(self) -> str:
        memory = format_bytes(self.memory_total)
        if self.memory_available and self.memory_available != self.memory_total:
            label = "recommended working set" if self.backend == "metal" else "available"
            memory += f" ({format_bytes(self.memory_available)} {label})"
        blas = f"; BLAS {self.blas}" if self.blas else ""
        return f"{self.backend}: {self.name or 'unnamed device'}, {memory}{blas}"


def device_info(backend: str, blas: bool = True) -> DeviceInfo:
    """Describe the ``"metal"``, ``"cuda"`` or ``"cpu"`` device of this MLX build (``blas=False``: skip
    finding out which BLAS a Linux CPU uses)."""
    import mlx.core as mx

    if backend != "cpu" and not available_backends().get(backend):
        raise DeviceError(f"this MLX build has no {backend} backend (available: {', '.join(_available())})")
    device = mx.cpu if backend == "cpu" else mx.gpu
    try:
        info: dict[str, Any] = dict(mx.device_info(device))
    except (TypeError, RuntimeError, AttributeError):  # older MLX: no device argument
        info = dict(mx.device_info()) if hasattr(mx, "device_info") else {}
    name = str(info.get("device_name", "")).strip()
    if backend == "cpu":
        total, free = system_memory(), available_memory()
        library = None
        if blas and sys.platform.startswith("linux"):
            library = _blas.describe()
        return DeviceInfo("cpu", name, total, free, library)
    if backend == "metal":
        total = info.get("memory_size")
        working_set = info.get("max_recommended_working_set_size")
        return DeviceInfo("metal", name, _int(total), _int(working_set))
    return DeviceInfo("cuda", name, _int(info.get("total_memory") or info.get("memory_size")),
                      _int(info.get("free_memory")))


def detect_devices() -> list[DeviceInfo]:
    """Every device this MLX build can train on, GPU first.

    Example::

        for device in detect_devices():
            print(device)       # "cuda: NVIDIA H100 80GB HBM3, 85.05 GB (84.50 GB available)"
    """
    return [device_info(name) for name in _available()]


def _available() -> list[str]:
    return [name for name, present in available_backends().items() if present]


def _int(value: Any) -> int | None:
    try:
        return int(value) if value else None
    except (TypeError, ValueError):
        return None


@dataclass
class DeviceConfig:
    """The device to train on and the memory limits to set there.

    ``device`` is ``"auto"`` (the GPU when the installed MLX has one, else the CPU), ``"gpu"``,
    ``"cpu"``, or a GPU backend by name (``"metal"``, ``"cuda"``). ``memory_limit``,
    ``cache_limit`` and ``wired_limit`` take bytes or sizes like ``"8GB"``: ``memory_limit`` is
    MLX's allocation limit and, unless ``TrainConfig.memory_limit`` says otherwise, the Trainer's
    memory budget; ``cache_limit`` caps MLX's buffer cache (which ``peak memory`` does not show);
    ``wired_limit`` (macOS) keeps that much GPU memory resident.

    Example::

        DeviceConfig(device="gpu")          # DeviceError on a machine without one, listing what there is
        DeviceConfig(memory_limit="8GB", cache_limit="1GB").apply()
    """

    device: str = option("auto", "Device to train on: auto (the GPU when there is one, else the CPU), gpu, cpu, "
                                 "metal or cuda.", section="device", choices=DEVICES)
    # The Trainer's memory budget and MLX's allocation limit: TrainConfig.memory_limit, the same field.
    memory_limit: int | str | None = same_as(TrainConfig, "memory_limit")
    cache_limit: int | str | None = option(None, "Cap on MLX's buffer cache, bytes or a size like '1GB' "
                                                 "(null: MLX's default).", section="device", parse=byte_count,
                                           above=0)
    wired_limit: int | str | None = option(None, "Memory kept resident for the GPU (macOS), bytes or a size "
                                                 "like '8GB' (null: MLX's default).", section="device",
                                           parse=byte_count, above=0)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.device not in ("auto", "cpu"):
            self.backend  # noqa: B018 - fail now, listing what there is, not at the first step

    @property
    def backend(self) -> str:
        """The backend this config selects: ``"metal"``, ``"cuda"`` or ``"cpu"``; DeviceError if absent."""
        backends = available_backends()
        gpu = "metal" if backends["metal"] else "cuda" if backends["cuda"] else None
        if self.device == "cpu" or (self.device == "auto" and gpu is None):
            return "cpu"
        if self.device == "auto":
            return gpu  # type: ignore[return-value]  # not None: the branch above returned
        wanted = gpu if self.device == "gpu" else self.device
        if wanted is None or not backends.get(wanted):
            raise DeviceError(
                f"device={self.device!r} was requested but this MLX build has no "
                f"{'GPU' if self.device == 'gpu' else self.device} backend (available: {', '.join(_available())}). "
                f"{gpu_install_advice()}; or use DeviceConfig(device={'cpu' if gpu is None else 'gpu'!r})"
            )
        return wanted

    def resolve(self) -> Any:
        """The ``mx.Device`` this config selects; DeviceError when it is not available."""
        import mlx.core as mx

        return mx.cpu if self.backend == "cpu" else mx.gpu

    def info(self) -> DeviceInfo:
        """What the selected device offers (name, memory, BLAS on a Linux CPU)."""
        return device_info(self.backend)

    def device_memory(self) -> int | None:
        """Bytes to plan a run with: ``memory_limit`` when set, else what the device has available."""
        # memory_limit is a byte count once check_fields has converted it.
        return self.memory_limit or device_info(self.backend, blas=False).memory  # type: ignore[return-value]

    def apply(self) -> None:
        """Make the device the default and set the memory, cache and wired limits."""
        import mlx.core as mx

        mx.set_default_device(self.resolve())
        if self.memory_limit is not None:
            mx.set_memory_limit(self.memory_limit)  # type: ignore[arg-type]  # bytes after check_fields
        if self.cache_limit is not None:
            mx.set_cache_limit(self.cache_limit)  # type: ignore[arg-type]  # bytes after check_fields
        if self.wired_limit is not None and self.backend == "metal":
            mx.set_wired_limit(self.wired_limit)  # type: ignore[arg-type]  # bytes after check_fields

    def describe(self) -> str:
        """One line: the device, its name and memory, and the limit in force."""
        import mlx.core as mx

        info = self.info()
        limit = self.memory_limit or mx.get_memory_limit()
        parts = [info.name, format_bytes(info.memory_total) if info.memory_total else "",
                 f"memory limit {format_bytes(limit)}"]  # type: ignore[arg-type]  # bytes after check_fields
        return f"{info.backend} ({', '.join(p for p in parts if p)})"
