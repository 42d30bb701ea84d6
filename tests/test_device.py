"""DeviceConfig: what the installed MLX offers, clear errors for a device that is not there, limits."""

import sys

import mlx.core as mx
import pytest

from mlx_train import ConfigError, DeviceConfig, DeviceError
from mlx_train.device import available_backends, detect_devices, format_bytes, parse_bytes


def test_sizes_parse_with_units_and_reject_nonsense():
    assert parse_bytes("8GB") == 8_000_000_000
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5e3KB") == 1_500_000
    assert parse_bytes(1024) == 1024 and parse_bytes(None) is None
    with pytest.raises(ConfigError, match=r"memory_limit must be a number of bytes or a size like '8GB'"):
        parse_bytes("8 potatoes", "memory_limit")
    assert format_bytes(1.5e9) == "1.50 GB" and format_bytes(512) == "512 B"


def test_auto_picks_the_gpu_when_there_is_one_else_the_cpu():
    backends = available_backends()
    expected = "metal" if backends["metal"] else "cuda" if backends["cuda"] else "cpu"
    config = DeviceConfig()
    assert config.backend == expected
    assert config.resolve() == (mx.cpu if expected == "cpu" else mx.gpu)
    assert DeviceConfig(device="cpu").backend == "cpu"


def test_a_device_that_is_not_there_is_an_error_listing_what_is():
    backends = available_backends()
    missing = [name for name in ("metal", "cuda") if not backends[name]]
    assert missing  # no MLX build has both
    present = ", ".join(name for name, there in backends.items() if there)
    for name in missing + ([] if backends["metal"] or backends["cuda"] else ["gpu"]):
        with pytest.raises(DeviceError, match=rf"device='{name}' was requested .* \(available: {present}\)"):
            DeviceConfig(device=name)


def test_bad_names_and_limits_are_config_errors():
    with pytest.raises(ConfigError,
                       match=r"must be one of auto, gpu, cpu, metal, cuda, got 'gpus' \(did you mean 'gpu'\?\)"):
        DeviceConfig(device="gpus")
    with pytest.raises(ConfigError, match=r"cache_limit must be a number of bytes"):
        DeviceConfig(cache_limit="lots")
    with pytest.raises(ConfigError, match=r"DeviceConfig.memory_limit must be above 0, got 0"):
        DeviceConfig(memory_limit=0)
    with pytest.raises(ConfigError, match=r"DeviceConfig.wired_limit must be above 0, got -1"):
        DeviceConfig(wired_limit=-1)


def test_info_names_the_device_its_memory_and_the_blas_on_a_linux_cpu():
    devices = detect_devices()
    assert devices[-1].backend == "cpu" and {d.backend for d in devices} <= {"metal", "cuda", "cpu"}
    cpu = DeviceConfig(device="cpu").info()
    assert cpu.memory_total and cpu.memory_total > 2**20
    if sys.platform.startswith("linux"):
        from mlx_train import _blas

        assert cpu.blas == _blas.describe() and f"BLAS {cpu.blas}" in str(cpu)
        assert cpu.memory_available and cpu.memory_available <= cpu.memory_total
    assert str(cpu).startswith("cpu: ")


def test_device_memory_is_the_limit_when_set_else_what_the_device_has():
    assert DeviceConfig(memory_limit="3GB").device_memory() == 3_000_000_000
    assert DeviceConfig().device_memory() == DeviceConfig().info().memory > 0
    assert "memory limit 3.00 GB" in DeviceConfig(memory_limit="3GB").describe()


def test_apply_sets_the_default_device_and_the_limits():
    previous_limit, previous_cache = mx.get_memory_limit(), mx.set_cache_limit(mx.get_memory_limit())
    mx.set_cache_limit(previous_cache)
    try:
        DeviceConfig(device="cpu", memory_limit="2GB", cache_limit="64MB").apply()
        assert mx.get_memory_limit() == 2_000_000_000
        assert mx.set_cache_limit(previous_cache) == 64_000_000
        assert mx.default_device() == mx.Device(mx.cpu)
    finally:
        mx.set_memory_limit(previous_limit)
        mx.set_cache_limit(previous_cache)
        DeviceConfig().apply()
