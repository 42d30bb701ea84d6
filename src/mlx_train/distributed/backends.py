"""Which ``mlx.core.distributed`` backends this MLX has, which one to use, and what a strategy needs.

MLX has four backends: ``ring`` (TCP sockets, always built), ``mpi`` (needs ``libmpi`` at run
time), ``jaccl`` (RDMA over Thunderbolt 5, macOS 26.2+) and ``nccl`` (CUDA GPUs). ``auto`` picks
the best one the installed MLX can run and says why.

Example::

    choice = choose_backend("auto")
    choice.name, choice.reason     # ("ring", "TCP between the hosts; mpi, jaccl, nccl are not in this MLX build")
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlx_train.config import BACKEND_CHOICES as CHOICES
from mlx_train.config import BACKENDS
from mlx_train.errors import ConfigError, did_you_mean

STRATEGIES = ("data_parallel", "tensor_parallel", "fsdp")

_WHAT = {
    "ring": "TCP sockets between the hosts (Ethernet, Wi-Fi or Thunderbolt IP)",
    "mpi": "MPI (mpirun; OMPI_MCA_* settings are passed through)",
    "jaccl": "RDMA over Thunderbolt 5 (macOS 26.2+)",
    "nccl": "NCCL between CUDA GPUs",
}
_HOW_TO_GET = {
    "ring": "it is part of every MLX build; reinstall mlx",
    "mpi": "install Open MPI (apt-get install libopenmpi-dev, brew install open-mpi) and, on Linux, "
           "set MLX_MPI_LIBNAME to the libmpi to load",
    "jaccl": "it needs macOS 26.2+ on Apple silicon with Thunderbolt 5 and RDMA enabled",
    "nccl": "it needs the CUDA build of MLX (pip install 'mlx[cuda]') on NVIDIA GPUs",
}

# Environment variables passed through to every rank (remote ranks do not inherit ours).
PASSTHROUGH_PREFIXES = ("OMPI_MCA_", "NCCL_", "MLX_", "OPENBLAS_", "OMP_NUM_THREADS")
# ...except those the launcher sets per rank.
PER_RANK = {"MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES"}


def available_backends() -> dict[str, bool]:
    """``{"ring": True, "mpi": False, ...}`` for the installed MLX.

    Example: ``available_backends()["ring"]  # True``
    """
    import mlx.core as mx

    found = {}
    for name in BACKENDS:
        try:
            found[name] = bool(mx.distributed.is_available(name))
        except (RuntimeError, ValueError, TypeError):
            found[name] = False
    if found["nccl"]:
        cuda = getattr(mx, "cuda", None)
        found["nccl"] = bool(cuda is not None and cuda.is_available())
    return found


@dataclass(frozen=True)
class BackendChoice:
    """The backend to launch with and why it was chosen."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_backend(requested: str = "auto", has_rdma: bool = False,
                   available: Mapping[str, bool] | None = None) -> BackendChoice:
    """Resolve ``requested`` (``auto`` or a backend name) against what this MLX has.

    ``has_rdma`` says whether the host file lists RDMA devices (JACCL needs them). An explicit
    backend that is missing raises ``ConfigError`` naming what is available and how to get it.

    Example: ``choose_backend("auto").name  # "ring" on a Linux CPU build``
    """
    if requested not in CHOICES:
        raise ConfigError(f"unknown distributed backend '{requested}'{did_you_mean(requested, CHOICES)}; "
                          f"choose one of {', '.join(CHOICES)}")
    available = dict(available if available is not None else available_backends())
    have = [name for name in BACKENDS if available.get(name)]
    missing = [name for name in BACKENDS if not available.get(name)]
    if requested != "auto":
        if not available.get(requested):
            raise ConfigError(
                f"the {requested} backend is not available in this MLX build (available: "
                f"{', '.join(have) or 'none'}): {_HOW_TO_GET[requested]}; or use --backend auto"
            )
        return BackendChoice(requested, f"requested; {_WHAT[requested]}")
    absent = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in this MLX build" if missing else ""
    if available.get("nccl"):
        return BackendChoice("nccl", "CUDA GPUs are present: NCCL is the fastest between them")
    if available.get("jaccl") and has_rdma:
        return BackendChoice("jaccl", "the host file lists RDMA devices: RDMA over Thunderbolt 5")
    if available.get("ring"):
        why = "TCP between the hosts"
        if available.get("jaccl") and not has_rdma:
            why += "; jaccl needs RDMA devices in the host file"
        return BackendChoice("ring", f"{why}; {absent}" if absent else why)
    if available.get("mpi"):
        return BackendChoice("mpi", "the only backend this MLX build has")
    raise ConfigError("this MLX build has no distributed backend (ring, mpi, jaccl, nccl all unavailable); "
                      "reinstall mlx")


def describe_backends(available: Mapping[str, bool] | None = None) -> str:
    """One line: ``ring available; mpi, jaccl, nccl not in this MLX build``."""
    available = dict(available if available is not None else available_backends())
    have = [name for name in BACKENDS if available.get(name)]
    missing = [name for name in BACKENDS if not available.get(name)]
    parts = [f"{', '.join(have)} available"] if have else []
    if missing:
        parts.append(f"{', '.join(missing)} not in this MLX build")
    return "; ".join(parts)


def active_backend(environ: Mapping[str, str] | None = None, world_size: int = 1) -> str | None:
    """The backend a launched process runs on, read from what its launcher set; None alone.

    Example: inside ``mlx.launch -n 2`` on a CPU build: ``"ring"``.
    """
    env = os.environ if environ is None else environ
    if env.get("MLX_TRAIN_BACKEND") in BACKENDS:
        return env["MLX_TRAIN_BACKEND"]
    if env.get("NCCL_HOST_IP") or env.get("MLX_WORLD_SIZE"):
        return "nccl"
    if env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if env.get("MLX_HOSTFILE") and env.get("MLX_RANK"):
        return "ring"
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return "mpi"
    return "ring" if world_size > 1 else None


def check_strategy(strategy: str, backend: str | None, world_size: int) -> None:
    """Refuse a strategy/backend pair that cannot work, instead of letting it hang.

    MLX's FSDP reduce-scatters gradients with ``sum_scatter``, which the ring backend does not
    implement: it hangs rather than failing (ml-explore/mlx#4285).

    Example: ``check_strategy("fsdp", "ring", 2)`` raises ``ConfigError``.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown distributed strategy '{strategy}'{did_you_mean(strategy, STRATEGIES)}; "
                          f"available: {', '.join(STRATEGIES)}")
    if strategy == "fsdp" and world_size > 1 and backend in ("ring", "mpi"):
        raise ConfigError(
            f"strategy 'fsdp' cannot run on the {backend} backend: MLX's fully_shard reduce-scatters "
            f"gradients with sum_scatter, which {backend} does not implement (with ring it hangs instead of "
            "failing, ml-explore/mlx#4285). Use strategy='data_parallel' here, or launch with the nccl "
            "(CUDA GPUs) or jaccl (Thunderbolt 5 RDMA) backend"
        )


def passthrough_env(environ: Mapping[str, str] | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``KEY=VALUE`` settings to forward to every rank: ``OMPI_MCA_*``, ``NCCL_*``, ``MLX_*``, ...

    Local ranks inherit the environment anyway; remote ranks (over ssh) get only these. ``extra``
    (``KEY=VALUE`` strings, e.g. from the cluster configuration) comes first; the environment wins.

    Example: with ``OMPI_MCA_btl_tcp_links=4`` set: ``["OMPI_MCA_btl_tcp_links=4"]``.
    """
    env = os.environ if environ is None else environ
    merged: dict[str, str] = {}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"environment setting {item!r} must be KEY=VALUE, e.g. OMPI_MCA_btl_tcp_links=4")
        merged[key] = value
    for key, value in env.items():
        if key.startswith(PASSTHROUGH_PREFIXES) and key not in PER_RANK and not key.startswith("MLX_TRAIN_"):
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]
