"""Host files in the format ``mlx.launch --hostfile`` reads, with errors that say how to fix them.

Either a list of hosts or an object with a backend and environment settings::

    [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]
    {"backend": "ring", "envs": ["OMPI_MCA_btl_tcp_links=4"],
     "hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]}

One entry is one rank. ``mlx.launch`` runs a rank locally only when its ``ssh`` is exactly
``127.0.0.1``; any other name (``localhost`` included) goes through ssh.

Example::

    hosts = Hostfile.from_hosts(["127.0.0.1", "127.0.0.1"])
    hosts.write("cluster.json")
    Hostfile.read("cluster.json").hosts[1].ips      # ["127.0.0.1"]
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_train.config import BACKEND_CHOICES as CHOICES
from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.rundir import atomic_write

LOCAL = "127.0.0.1"
_HOST_KEYS = ("ssh", "ips", "rdma")
_TOP_KEYS = ("backend", "envs", "hosts", "python")
_EXAMPLE = '[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]'


def is_ip(text: str) -> bool:
    """True for an IPv4/IPv6 address such as ``10.0.0.2``."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


@dataclass
class Host:
    """One rank's host: the name to reach it by ssh, and the IPs the ring backend connects to."""

    ssh: str
    ips: list[str] = field(default_factory=list)
    rdma: list[str | None] | None = None  # one RDMA device (or null) per host, for JACCL

    @property
    def is_local(self) -> bool:
        """True when ``mlx.launch`` starts this rank on this machine (no ssh)."""
        return self.ssh == LOCAL

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"ssh": self.ssh, "ips": list(self.ips)}
        if self.rdma is not None:
            entry["rdma"] = list(self.rdma)
        return entry


@dataclass
class Hostfile:
    """The hosts of a cluster (one entry per rank), its backend and the settings sent to every rank.

    ``python`` is the interpreter the ranks run (the same path on every host); ``mlx.launch``
    ignores that key.
    """

    hosts: list[Host]
    backend: str = "auto"
    envs: list[str] = field(default_factory=list)
    python: str | None = None
    path: str | None = None

    # ------------------------------------------------------------------ building
    @classmethod
    def from_hosts(cls, names: Sequence[str], backend: str = "auto", repeat: int = 1,
                   envs: Sequence[str] = ()) -> Hostfile:
        """Hosts from names or IPs (``["10.0.0.1", "mac2"]``), each repeated ``repeat`` times.

        ``localhost`` becomes ``127.0.0.1`` (the only name ``mlx.launch`` starts without ssh); a
        name is resolved to its IP here, since the ring backend connects to IPs.
        """
        if not names:
            raise ConfigError("no hosts given: pass --hosts a,b,... (IPs or names) or --hostfile FILE")
        hosts: list[Host] = []
        for raw in names:
            name = raw.strip()
            if not name:
                raise ConfigError(f"empty host name in {','.join(names)!r}: remove the extra comma")
            if name in ("localhost", "::1"):
                name = LOCAL
            ips = [name] if is_ip(name) else [_resolve(name)]
            hosts.extend(Host(name, list(ips)) for _ in range(repeat))
        hostfile = cls(hosts, backend, list(envs))
        hostfile.validate()
        return hostfile

    @classmethod
    def local(cls, num_processes: int, backend: str = "auto") -> Hostfile:
        """``num_processes`` ranks on this machine (127.0.0.1)."""
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise ConfigError(f"the number of processes must be an integer >= 1, got {num_processes!r}")
        return cls([Host(LOCAL, [LOCAL]) for _ in range(num_processes)], backend)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Hostfile:
        """Read and validate a host file; errors name the file, the entry and the fix."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except FileNotFoundError:
            raise ConfigError(f"host file {path} does not exist; write one with 'mlx-train configure "
                              f"--distributed --hosts a,b,...' or by hand: {_EXAMPLE}") from None
        except OSError as error:
            raise ConfigError(f"cannot read host file {path}: {error.strerror or error}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"host file {path} is not valid JSON (line {error.lineno}, column {error.colno}: "
                              f"{error.msg}); expected a list of hosts like {_EXAMPLE}") from None
        return cls.from_json(data, path)

    @classmethod
    def from_json(cls, data: Any, path: str = "<host file>") -> Hostfile:
        """Build from parsed JSON (either layout), validating every entry."""
        backend: str = "auto"
        envs: object = []
        python: object = None
        if isinstance(data, dict):
            for key in data:
                if key not in _TOP_KEYS:
                    raise ConfigError(f"host file {path}: unknown key {key!r}{did_you_mean(key, _TOP_KEYS)}; "
                                      f"allowed: {', '.join(_TOP_KEYS)}")
            if "hosts" not in data:
                raise ConfigError(f"host file {path}: the object has no \"hosts\" list; add \"hosts\": {_EXAMPLE}")
            backend = data.get("backend") or "auto"
            envs = data.get("envs") or []
            python = data.get("python")
            entries = data["hosts"]
        else:
            entries = data
        if not isinstance(entries, list):
            raise ConfigError(f"host file {path}: expected a list of hosts like {_EXAMPLE}, "
                              f"got {type(entries).__name__}")
        hosts = [_host_entry(entry, i, path) for i, entry in enumerate(entries)]
        if not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
            raise ConfigError(f"host file {path}: \"envs\" must be a list of \"KEY=VALUE\" strings, got {envs!r}")
        if python is not None and not isinstance(python, str):
            raise ConfigError(f"host file {path}: \"python\" must be the interpreter path as a string, got {python!r}")
        hostfile = cls(hosts, backend, list(envs), python, path)
        hostfile.validate()
        return hostfile

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ConfigError`` for a problem ``mlx.launch`` would trip over later."""
        where = f"host file {self.path}" if self.path else "hosts"
        if not self.hosts:
            raise ConfigError(f"{where}: the list of hosts is empty; add one entry per rank, e.g. {_EXAMPLE}")
        if self.backend not in CHOICES:
            raise ConfigError(f"{where}: unknown backend {self.backend!r}{did_you_mean(str(self.backend), CHOICES)}; "
                              f"choose one of {', '.join(CHOICES)}")
        for item in self.envs:
            key, sep, _ = item.partition("=")
            if not sep or not key or not all(c.isalnum() or c == "_" for c in key):
                raise ConfigError(f"{where}: environment setting {item!r} must be KEY=VALUE with a name of "
                                  "letters, digits and _, e.g. OMPI_MCA_btl_tcp_links=4")
        if self.backend in ("auto", "ring"):
            for i, host in enumerate(self.hosts):
                if not host.ips:
                    raise ConfigError(
                        f"{where}, entry {i} (ssh {host.ssh!r}): the ring backend connects to IP addresses and "
                        f"this host has none; add \"ips\": [\"<IP of {host.ssh}>\"]"
                    )

    @property
    def has_rdma(self) -> bool:
        """True when every host lists RDMA devices (what JACCL needs)."""
        return all(host.rdma for host in self.hosts)

    @property
    def num_processes(self) -> int:
        return len(self.hosts)

    @property
    def is_local(self) -> bool:
        """True when every rank runs on this machine."""
        return all(host.is_local for host in self.hosts)

    # ------------------------------------------------------------------ writing
    def to_json(self, backend: str | None = None) -> dict[str, Any]:
        """The JSON ``mlx.launch --hostfile`` reads (``backend`` resolved when given)."""
        data: dict[str, Any] = {"backend": backend or self.backend, "envs": list(self.envs),
                                "hosts": [host.to_json() for host in self.hosts]}
        if data["backend"] == "auto":
            data["backend"] = ""  # mlx.launch picks its default
        if self.python:
            data["python"] = self.python
        return data

    def write(self, path: str | os.PathLike[str], backend: str | None = None) -> str:
        """Write atomically (temporary name, then rename); returns the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write(path, json.dumps(self.to_json(backend), indent=2) + "\n")
        self.path = path
        return path

    def describe(self) -> list[str]:
        """One line per rank: ``rank 0  127.0.0.1  ips 127.0.0.1  (this machine)``."""
        lines: list[str] = []
        for rank, host in enumerate(self.hosts):
            where = "this machine" if host.is_local else "over ssh"
            rdma = f"  rdma {host.rdma}" if host.rdma else ""
            lines.append(f"rank {rank}  {host.ssh}  ips {', '.join(host.ips) or '-'}{rdma}  ({where})")
        return lines


def _resolve(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError:
        raise ConfigError(
            f"cannot resolve host {name!r} to an IP address (the ring backend connects to IPs): check the "
            f"name, or give its IP instead (e.g. --hosts 10.0.0.1,10.0.0.2)"
        ) from None


def _host_entry(entry: Any, index: int, path: str) -> Host:
    where = f"host file {path}, entry {index}"
    if isinstance(entry, str):
        raise ConfigError(f"{where}: got the string {entry!r}; each entry must be an object like "
                          f"{{\"ssh\": {json.dumps(entry)}, \"ips\": [\"<IP>\"]}}")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object like {{\"ssh\": \"mac2\", \"ips\": [\"10.0.0.2\"]}}, "
                          f"got {entry!r}")
    for key in entry:
        if key not in _HOST_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(str(key), _HOST_KEYS)}; "
                              f"allowed: {', '.join(_HOST_KEYS)}")
    ssh = entry.get("ssh")
    if not isinstance(ssh, str) or not ssh.strip():
        raise ConfigError(f"{where}: missing \"ssh\" (the name or IP to reach the host by ssh; 127.0.0.1 for "
                          f"this machine); add it, e.g. {{\"ssh\": \"mac2\", \"ips\": [\"10.0.0.2\"]}}")
    ips = entry.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise ConfigError(f"{where} (ssh {ssh!r}): \"ips\" must be a list of IP strings like [\"10.0.0.2\"], "
                          f"got {ips!r}")
    for ip in ips:
        if not is_ip(ip):
            raise ConfigError(f"{where} (ssh {ssh!r}): {ip!r} in \"ips\" is not an IP address; the ring backend "
                              "connects to IPs: write e.g. \"10.0.0.2\" (find it with 'ipconfig getifaddr en0' "
                              "on macOS or 'hostname -I' on Linux)")
    rdma = entry.get("rdma")
    if rdma is not None and not isinstance(rdma, list):
        raise ConfigError(f"{where} (ssh {ssh!r}): \"rdma\" must be a list with one device (or null) per host")
    return Host(ssh.strip(), list(ips), rdma)
