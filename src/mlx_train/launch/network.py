"""``mlx-train check-network``: can every host be reached, and how fast are the links between ranks?

First each host is checked the way ``mlx.launch`` will reach it (this machine, or passwordless
ssh). Then a probe runs on every rank through ``mlx.launch`` itself, on the backend the training
would use: for each pair of neighbouring ranks in the ring it times a ping-pong of small messages
(latency) and of large ones (bandwidth) with ``send``/``recv``, and it times ``all_sum`` over
the whole group. Each link gets a verdict: ``good``, ``ok``, ``slow`` (with the likely reason)
or ``failed``.

Example::

    report = check_network(Hostfile.local(2))
    print(report.table())
    report.ok      # True when every host answered and no link failed
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_train.distributed.backends import choose_backend
from mlx_train.distributed.hostfile import HostCheck, Hostfile, check_hosts
from mlx_train.errors import DistributedError

GOOD_LATENCY, OK_LATENCY = 1e-3, 10e-3      # seconds, one way
GOOD_BANDWIDTH, OK_BANDWIDTH = 1e9, 100e6   # bytes per second


@dataclass
class Link:
    """One measured link (or the whole group's all-reduce)."""

    name: str
    connection: str
    latency_s: float | None = None
    bandwidth: float | None = None
    verdict: str = "failed"


@dataclass
class NetworkReport:
    """Host checks, link measurements and whether everything is usable."""

    backend: str
    hosts: list[HostCheck]
    links: list[Link] = field(default_factory=list)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and all(h.ok for h in self.hosts) and all(
            not link.verdict.startswith("failed") for link in self.links)

    def table(self) -> str:
        """The report as text: one line per host, then one line per link."""
        lines = ["hosts"]
        for check in self.hosts:
            lines.append(f"  {check.host.ssh:<24} {'reachable' if check.ok else 'UNREACHABLE':<12} {check.detail}")
        lines.append(f"links (backend {self.backend})")
        header = f"  {'link':<44} {'connection':<11} {'latency':>10} {'bandwidth':>12}  verdict"
        lines.append(header)
        for link in self.links:
            latency = "-" if link.latency_s is None else f"{link.latency_s * 1e3:.3f} ms"
            bandwidth = "-" if link.bandwidth is None else _rate(link.bandwidth)
            lines.append(f"  {link.name:<44} {link.connection:<11} {latency:>10} {bandwidth:>12}  {link.verdict}")
        if not self.links:
            lines.append("  (none measured)")
        if self.problem:
            lines.append(f"problem: {self.problem}")
        return "\n".join(lines)


def _rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.1f} MB/s"


def verdict(latency_s: float, bandwidth: float, local: bool = False) -> str:
    """``good``, ``ok`` or ``slow: ...`` for a link's one-way latency and bandwidth.

    Example: ``verdict(5e-5, 3e9)  # "good"``
    """
    reasons = []
    if latency_s > OK_LATENCY:
        reasons.append(f"latency above {OK_LATENCY * 1e3:.0f} ms")
    if bandwidth < OK_BANDWIDTH:
        reasons.append(f"bandwidth below {_rate(OK_BANDWIDTH)}")
    if reasons:
        hint = ("the ranks share this machine's CPU cores: busy cores slow the transfers" if local
                else "Wi-Fi or a hostname route? use Ethernet or Thunderbolt IPs")
        return f"slow: {' and '.join(reasons)} ({hint})"
    if latency_s <= GOOD_LATENCY and bandwidth >= GOOD_BANDWIDTH:
        return "good"
    return "ok"


def check_network(hostfile: Hostfile, timeout: float = 60.0, message_bytes: int = 8 * 2**20) -> NetworkReport:
    """Check every host of ``hostfile``, then measure its links with a probe launched by ``mlx.launch``."""
    from mlx_train.distributed.launch import free_port_base, launcher_path

    backend = choose_backend(hostfile.backend, hostfile.has_rdma).name
    report = NetworkReport(backend, check_hosts(hostfile))
    if not all(check.ok for check in report.hosts):
        bad = [c for c in report.hosts if not c.ok]
        report.problem = (f"{len(bad)} host{'s' if len(bad) > 1 else ''} cannot be reached, so no link was measured: "
                          + "; ".join(f"{c.host.ssh}: {c.detail}" for c in bad))
        return report
    if hostfile.num_processes == 1:
        report.problem = None
        return report
    with tempfile.TemporaryDirectory(prefix="mlx-train-network-") as tmp:
        out = Path(tmp) / "probe.json"
        hostfile_path = Path(tmp) / "hostfile.json"
        hostfile.write(hostfile_path, backend=backend)
        port = free_port_base(hostfile.num_processes) if hostfile.is_local else 32323
        python = hostfile.python or sys.executable
        argv = [launcher_path(), "--hostfile", str(hostfile_path), "--backend", backend, "--starting-port", str(port),
                "--", python, "-m", "mlx_train.distributed.network", str(out), str(message_bytes)]
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, text=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            report.links = [Link("all ranks", "no answer", verdict=f"failed: no result within {timeout:g} s")]
            report.problem = (f"the probe did not finish within {timeout:g} s: the ranks could not connect (a firewall "
                              f"blocking the ports from {port}, or IPs that do not route between the hosts?)")
            return report
        if not out.exists():
            last = " | ".join(line for line in output.strip().splitlines()[-3:])
            report.links = [Link("all ranks", "failed", verdict="failed: the probe could not run")]
            report.problem = f"the probe failed on the {backend} backend: {last or 'no output'}"
            return report
        report.links = _links(json.loads(out.read_text()), hostfile)
    return report


def _links(result: dict, hostfile: Hostfile) -> list[Link]:
    links = []
    for entry in result["links"]:
        a, b = entry["ranks"]
        name = f"rank {a} ({hostfile.hosts[a].ssh}) <-> rank {b} ({hostfile.hosts[b].ssh})"
        local = hostfile.hosts[a].is_local and hostfile.hosts[b].is_local
        links.append(Link(name, "ok", entry["latency_s"], entry["bandwidth"],
                          verdict(entry["latency_s"], entry["bandwidth"], local)))
    reduce = result["all_reduce"]
    links.append(Link(f"all-reduce over {result['world_size']} ranks", "ok", reduce["latency_s"], reduce["bandwidth"],
                      verdict(reduce["latency_s"], reduce["bandwidth"], hostfile.is_local)))
    return links


# ---------------------------------------------------------------------- the probe (runs on every rank)
def _ping_pong(group, a: int, b: int, x, repeats: int) -> float:
    """Median one-way time of ``x`` between ranks ``a`` and ``b`` (meaningful on rank ``a``)."""
    import mlx.core as mx

    rank, times = group.rank(), []
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == a:
            mx.eval(mx.distributed.send(x, b, group=group))
            mx.eval(mx.distributed.recv_like(x, b, group=group))
        elif rank == b:
            y = mx.distributed.recv_like(x, a, group=group)
            mx.eval(y)
            mx.eval(mx.distributed.send(y, a, group=group))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def probe(out: str, message_bytes: int) -> None:
    """Measure every neighbouring pair and the all-reduce; rank 0 writes the results to ``out``."""
    import mlx_train  # noqa: F401  (the optimized BLAS first)
    import mlx.core as mx

    from mlx_train.distributed.comm import time_all_sum

    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    pairs = [(i, (i + 1) % world) for i in range(world if world > 2 else 1)]
    small = mx.ones((1,), dtype=mx.float32)
    big = mx.ones((max(1, message_bytes // 4),), dtype=mx.float32)
    table = mx.zeros((len(pairs), 2), dtype=mx.float32)
    for k, (a, b) in enumerate(pairs):
        _ping_pong(group, a, b, small, 3)  # connect and warm up
        latency = _ping_pong(group, a, b, small, 30)
        seconds = _ping_pong(group, a, b, big, 5)
        if rank == a:
            table[k] = mx.array([latency, big.nbytes / max(seconds - latency, 1e-9)])
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))  # barrier before the next pair
    table = mx.distributed.all_sum(table, group=group, stream=mx.cpu)
    mx.eval(table)  # on every rank, before the next collective
    timing = time_all_sum(group, nbytes=message_bytes)
    if rank == 0:
        rows = table.tolist()
        result = {"world_size": world,
                  "links": [{"ranks": list(pair), "latency_s": row[0], "bandwidth": row[1]} for pair, row in zip(pairs, rows)],
                  "all_reduce": {"latency_s": timing.latency_s, "bandwidth": timing.bandwidth}}
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    probe(sys.argv[1], int(sys.argv[2]))
