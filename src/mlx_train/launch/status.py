"""``describe_cluster()``: the distributed part of ``mlx-train status``.

Example::

    print(describe_cluster())
    # distributed
    #   MLX 0.32.4 backends: ring available; mpi, jaccl, nccl not in this MLX build
    #   cluster: /home/me/.mlx-train/cluster.json, 2 ranks, backend auto -> ring (...)
    #     rank 0  127.0.0.1  ips 127.0.0.1  (this machine)
    #   ...
    #   supervised runs in progress: none
"""

from __future__ import annotations

import time

from mlx_train import rundir
from mlx_train.distributed import registry
from mlx_train.distributed.backends import available_backends, choose_backend, describe_backends
from mlx_train.distributed.config import cluster_path
from mlx_train.distributed.hostfile import Hostfile
from mlx_train.errors import MLXTrainError
from mlx_train.launch.reset import find_leftovers


def describe_cluster() -> str:
    """Text for ``mlx-train status``: backends, the configured cluster, supervised runs, leftovers."""
    import mlx.core as mx


    available = available_backends()
    version = mx.__version__  # type: ignore[attr-defined]  # not in the stubs
    lines = ["distributed", f"  MLX {version} backends: {describe_backends(available)}"]
    path = cluster_path()
    if not path.exists():
        lines.append(f"  cluster: none configured ({path} does not exist); 'mlx-train train --distributed -n N' runs "
                     "N processes on 127.0.0.1, 'mlx-train configure --distributed --hosts a,b' sets up machines")
    else:
        try:
            cluster = Hostfile.read(path)
            choice = choose_backend(cluster.backend, cluster.has_rdma, available)
            lines.append(f"  cluster: {path}, {cluster.num_processes} rank{'s' if cluster.num_processes != 1 else ''}, "
                         f"backend {cluster.backend} -> {choice}")
            lines += [f"    {line}" for line in cluster.describe()]
            if cluster.envs:
                lines.append(f"    settings sent to every rank: {' '.join(cluster.envs)}")
        except MLXTrainError as error:
            lines.append(f"  cluster: INVALID: {error}. Fix the file, or clear it with "
                         "'mlx-train reset-distributed --clear-config'")
    lines += _runs()
    return "\n".join(lines)


def _runs() -> list[str]:
    entries = registry.entries()
    supervisors = [e for e in entries if e.get("kind") == "supervisor" and e["alive"]]
    lines = [f"  supervised runs in progress: {len(supervisors) or 'none'}"]
    now = time.time()
    for entry in supervisors:
        attempt = int(entry.get("attempt", 0))
        restarts = f", {attempt} restart{'s' if attempt != 1 else ''}" if attempt else ""
        lines.append(f"    {entry.get('run_dir')}: {entry.get('ranks')} ranks, backend {entry.get('backend')}, "
                     f"supervisor pid {entry['pid']}, up {now - float(entry.get('started_at', now)):.0f} s{restarts}")
        for rank, info in sorted(rundir.read_heartbeats(entry.get("run_dir")).items()):
            doing = f", waiting in the {info.waiting['what']}" if info.waiting else ""
            lines.append(f"      rank {rank}: {info.state}, {info.step} steps, pid {info.pid} "
                         f"on {info.host}, heartbeat {now - info.time:.1f} s ago{doing}")

    leftovers = find_leftovers()
    if leftovers:
        lines.append(f"  leftover processes of earlier runs: {len(leftovers)} (pids "
                     f"{', '.join(str(p.pid) for p in leftovers)}); 'mlx-train reset-distributed' stops them")
    stale = [e for e in entries if not e["alive"]]
    if stale:
        lines.append(f"  stale state: {len(stale)} record{'s' if len(stale) != 1 else ''} of processes that are gone "
                     f"('mlx-train reset-distributed' clears them)")
    return lines
