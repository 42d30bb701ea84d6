"""Which device MLX trains on, and its memory limits.

Example::

    from mlx_train import DeviceConfig
    hw_config = DeviceConfig(device="auto", memory_limit="8GB")
    trainer = Trainer(model, optimizer, device_config=hw_config)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from mlx_train.errors import ConfigError, DeviceError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None, name: str = "memory") -> int | None:
    """``"8GB" -> 8_000_000_000``, ``"512MiB" -> 536_870_912``; ints pass through; None stays None."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match[2].lower() not in _UNITS:
        raise ConfigError(f"{name} must be a number of bytes or a size like '8GB' or '512MiB', got {value!r}")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def available_backends() -> dict[str, bool]:
    """What the installed MLX can run on: ``{"metal": ..., "cuda": ..., "cpu": True}``."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return {
        "metal": bool(mx.metal.is_available()),
        "cuda": bool(cuda is not None and cuda.is_available()),
        "cpu": True,
    }


def system_memory() -> int | None:
    """Physical memory in bytes (None when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class DeviceConfig:
    """The device to train on and the memory limits to set there.

    ``device`` is ``"auto"`` (the GPU when the installed MLX has one, else the CPU), ``"gpu"`` or
    ``"cpu"``. ``memory_limit`` and ``cache_limit`` take bytes or sizes like ``"8GB"``.
    """

    device: str = "auto"
    memory_limit: int | str | None = None
    cache_limit: int | str | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"DeviceConfig device must be 'auto', 'gpu' or 'cpu', got {self.device!r}")
        self.memory_limit = parse_bytes(self.memory_limit, "memory_limit")
        self.cache_limit = parse_bytes(self.cache_limit, "cache_limit")

    def resolve(self) -> Any:
        """The ``mx.Device`` this config selects; DeviceError when it is not available."""
        import mlx.core as mx

        backends = available_backends()
        has_gpu = backends["metal"] or backends["cuda"]
        if self.device == "gpu" and not has_gpu:
            raise DeviceError(
                "device='gpu' was requested but this MLX build has no GPU backend (available: cpu). "
                "On Apple silicon install 'mlx'; on Linux with NVIDIA GPUs install 'mlx[cuda]'; "
                "or use DeviceConfig(device='cpu')"
            )
        return mx.gpu if (self.device == "gpu" or (self.device == "auto" and has_gpu)) else mx.cpu

    def apply(self) -> None:
        """Make the device the default and set the memory and cache limits."""
        import mlx.core as mx

        mx.set_default_device(self.resolve())
        if self.memory_limit is not None:
            mx.set_memory_limit(self.memory_limit)
        if self.cache_limit is not None:
            mx.set_cache_limit(self.cache_limit)

    def describe(self) -> str:
        """One line: the device, its name, and the limits in force."""
        import mlx.core as mx

        device = self.resolve()
        info = mx.device_info() if hasattr(mx, "device_info") else {}
        name = info.get("device_name", "")
        limit = self.memory_limit or mx.get_memory_limit()
        return f"{device} {name} (memory limit {limit / 1e9:.1f} GB)".replace("  ", " ")
