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


def _backend_wheels(site, lib_bytes_by_package, on_disk):
    """Two installed backend wheels in ``site`` (dist-info folders with RECORDs naming mlx/lib/libmlx.so and
    its hash, as pip writes them), with ``on_disk``'s copy of the library the file that is there."""
    import base64
    import hashlib
    from importlib.metadata import PathDistribution

    library = site / "mlx" / "lib" / "libmlx.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(lib_bytes_by_package[on_disk])
    dists = []
    for name, content in lib_bytes_by_package.items():
        info = site / f"{name.replace('-', '_')}-0.32.4.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.32.4\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(f"mlx/lib/libmlx.so,sha256={digest},{len(content)}\n")
        dists.append(PathDistribution(info))
    return dists


@pytest.mark.parametrize("on_disk", ["mlx-cpu", "mlx-cuda-12"])
def test_which_backend_wheels_library_is_on_disk_is_read_from_the_records(tmp_path, on_disk):
    from mlx_train.device import backend_packages, gpu_install_advice, shadowed_gpu_library

    dists = _backend_wheels(tmp_path, {"mlx-cpu": b"cpu build", "mlx-cuda-12": b"cuda build"}, on_disk)
    packages = backend_packages(dists)
    assert packages == {"mlx-cpu": on_disk == "mlx-cpu", "mlx-cuda-12": on_disk == "mlx-cuda-12"}
    note = shadowed_gpu_library(packages)
    if on_disk == "mlx-cpu":  # the CPU copy overwrote the CUDA one: say so, with the command that fixes it
        assert note is not None and "mlx-cuda-12 is installed but mlx-cpu's copy" in note
        assert 'pip install --no-deps --force-reinstall "mlx-cuda-12==' in note
        assert gpu_install_advice(packages) == note
    else:
        assert note is None and "cuda12 or cuda13" in gpu_install_advice(packages)
    assert backend_packages(dists[:1]) == {"mlx-cpu": True}  # a lone backend wheel is the active one


def test_the_start_up_line_says_when_a_cuda_install_runs_on_the_cpu(monkeypatch):
    from mlx_train import device
    from mlx_train.cli.train import startup_line

    if mx.default_device() != mx.cpu:
        pytest.skip("the note is for a CUDA wheel whose library was overwritten, so MLX runs on the CPU")
    assert "\nnote:" not in startup_line()
    monkeypatch.setattr(device, "backend_packages", lambda: {"mlx-cpu": True, "mlx-cuda-13": False})
    line = startup_line()
    assert line.splitlines()[1].startswith("note: mlx-cuda-13 is installed but mlx-cpu's copy of mlx/lib/libmlx.so")
    with pytest.raises(DeviceError, match="force-reinstall"):
        DeviceConfig(device="gpu")  # refused when made, with the same advice


def test_the_documented_gpu_install_names_extras_the_package_has():
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    page = (root / "docs" / "getting-started.md").read_text()
    command = next(line for line in page.splitlines() if line.startswith('pip install -e ".[cuda'))
    extra = re.search(r'\.\[(\w+)\]', command).group(1)
    assert any(f"mlx[{extra}]" in requirement for requirement in extras.get(extra, [])), extras.get(extra)
    assert f"mlx-{extra[:4]}-{extra[4:]}==" in command  # the wheel that extra brings, reinstalled
