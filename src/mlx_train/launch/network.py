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
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_train.distributed.backends import choose_backend
from mlx_train.distributed.hostfile import Host, Hostfile

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


@dataclass
class HostCheck:
    """Whether one host can be reached, and what went wrong if not."""

    host: Host
    ok: bool
    detail: str


def check_host(host: Host, timeout: float = 5.0) -> HostCheck:
    """Check that ``mlx.launch`` can start a rank on ``host``: local, or passwordless ssh works.

    Example: ``check_host(Host("127.0.0.1", ["127.0.0.1"])).ok  # True``
    """
    if host.is_local:
        return HostCheck(host, True, "this machine")
    command = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", host.ssh, "true"]
    hint = " (only 127.0.0.1 runs without ssh: use 127.0.0.1 for this machine)" if host.ssh == "localhost" else ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 5)
    except FileNotFoundError:
        return HostCheck(host, False, "ssh is not installed on this machine; install an ssh client")
    except subprocess.TimeoutExpired:
        return HostCheck(host, False, f"ssh {host.ssh} did not answer within {timeout:.0f} s{hint}")
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return HostCheck(host, False, f"ssh {host.ssh} failed: {reason}; set up passwordless ssh "
                                      f"(ssh-copy-id {host.ssh}) and check the name{hint}")
    return HostCheck(host, True, "ssh ok")


def check_hosts(hostfile: Hostfile, timeout: float = 5.0) -> list[HostCheck]:
    """``check_host`` for each distinct host (in rank order)."""
    seen: dict[str, HostCheck] = {}
    for host in hostfile.hosts:
        if host.ssh not in seen:
            seen[host.ssh] = check_host(host, timeout)
    return list(seen.values())


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
    from mlx_train.launch.launcher import free_port_base, launcher_path

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
                "--", python, "-m", "mlx_train.distributed.probe", str(out), str(message_bytes)]
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


def _links(result: dict[str, Any], hostfile: Hostfile) -> list[Link]:
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
