"""The supervisor: launch a group with ``mlx.launch``, watch it, restart it from the last checkpoint.

The group fails when a rank exits abnormally (``mlx.launch`` reports it, and then stops the
others), when a rank records an error in its heartbeat file, when a rank's heartbeat stops (a
frozen process, e.g. SIGSTOPped: its peers would only notice at their collective timeout), or
when ssh cannot reach a host (reported with ssh's own error, and not restarted). The supervisor
then stops the whole group within a bounded time (SIGTERM to the launcher's process group,
SIGKILL after ``stop_grace`` seconds, and SIGKILL to any local rank still alive) and, up to
``max_restarts`` times, launches it again with ``MLX_TRAIN_RESUME=auto`` (and ``restart_args``)
so that it continues from the newest complete checkpoint. Each restart is logged with its cause,
on stderr and ``supervisor.log`` (the ``mlx_train.supervisor`` logger) and in
``<run_dir>/distributed/restarts.jsonl``. A rank that fails with a configuration, data,
checkpoint, device or memory error is not restarted: it would fail the same way.

SIGTERM or SIGINT to the supervisor (preemption, Ctrl-C) is forwarded to the local ranks: they
agree on one step to stop at (the Trainer's stop vote), rank 0 saves a checkpoint there, and
they exit; the supervisor waits up to ``interrupt_timeout`` seconds for that (then kills them)
and raises ``TrainingInterrupted`` (exit code 128 + signal). A second signal stops at once. The ranks
watch the supervisor (``MLX_TRAIN_SUPERVISOR``, ``mlx_train.distributed.orphan``): killed with
SIGKILL, it cannot stop them, so they stop by themselves as on SIGTERM.

Example::

    run = supervise([sys.executable, "train.py"], num_processes=2, run_dir="runs/a",
                    checkpoint_dir="runs/a/checkpoints", max_restarts=3)
    run.restarts        # [Restart(attempt=1, cause="rank 1 was killed by SIGKILL", ...)]
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TextIO

from mlx_train import processes, rundir
from mlx_train.distributed import environment as rank_env
from mlx_train.distributed import registry
from mlx_train.distributed.backends import choose_backend, passthrough_env
from mlx_train.distributed.hostfile import Hostfile
from mlx_train.errors import ConfigError, DistributedError, TrainingInterrupted
from mlx_train.launch.launcher import free_port_base, launcher_path
from mlx_train.launch.network import check_host

# Errors that a restart would hit again: not worth restarting for.
FINAL_ERRORS = {"ConfigError", "UsageError", "DataError", "CheckpointError", "DeviceError", "OutOfMemoryError"}
FINAL_EXIT_CODES = {2, 3, 4, 5, 6}
# ssh's exit code when it cannot connect, and the shell's when ssh (or the remote command) is missing
SSH_FAILED = {255, 127}
_RANK_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
_RANK_KILLED = re.compile(r"Node with rank (\d+) was killed")
_LOG = logging.getLogger("mlx_train.supervisor")
_SIGNAL_NAME = re.compile(r"\bSIG[A-Z]+\b")
_ERROR_LINE = re.compile(r"^(mlx-train: error: |[\w.]*Error: )")  # the CLI's one-line errors, a traceback's last line


@dataclass
class RecoveryPolicy:
    """When to give up on a group and how many times to start it again.

    ``frozen_timeout``: seconds a rank's steady heartbeat (written every ``interval`` by the
    ``RankMonitor`` thread, also while the rank validates or saves a checkpoint) may stay
    unchanged before the rank counts as frozen: only a stopped or wedged process stops it;
    ``heartbeat_timeout``: the same for a heartbeat written between steps (a rank without a
    monitor thread), which a long step or validation delays (keep it above the ranks'
    ``collective_timeout`` so that their own, more precise error comes first);
    ``stop_grace``: seconds the launcher gets to stop the others itself before everything is
    killed; ``startup_timeout``: seconds for every rank to report once the first has;
    ``interrupt_timeout``: seconds the ranks get, after a SIGTERM/SIGINT forwarded to them, to
    finish their step, save a checkpoint and exit before they are killed.
    Heartbeat ages are measured on the supervisor's clock (how long a file's ``time`` has not
    changed), so clocks that differ between hosts do not matter.
    """

    max_restarts: int = 3
    heartbeat_timeout: float = 60.0
    stop_grace: float = 3.0
    startup_timeout: float = 120.0
    frozen_timeout: float = 30.0
    interrupt_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not self.frozen_timeout > 0:
            raise ConfigError(f"frozen_timeout must be > 0 seconds, got {self.frozen_timeout!r} "
                              "(--heartbeat-timeout of mlx-train train --distributed)")

    @classmethod
    def from_collective_timeout(cls, max_restarts: int, collective_timeout: float,
                                frozen_timeout: float = 30.0) -> RecoveryPolicy:
        """A policy whose hang detection backs up ranks that use ``collective_timeout``; a frozen
        rank (silent steady heartbeat) is caught after ``frozen_timeout`` seconds."""
        return cls(max_restarts=max_restarts, heartbeat_timeout=collective_timeout * 1.5 + 5.0,
                   startup_timeout=max(120.0, collective_timeout), frozen_timeout=frozen_timeout)


@dataclass(frozen=True)
class Cause:
    """Why an attempt failed. ``weight`` orders causes: 0 a root cause (a rank killed, hung or
    failing on its own), 1 an error a rank reported because of another (a lost peer, a timed-out
    collective), 2 what the launcher saw of such a consequence (exit code 7, SIGTERM)."""

    text: str
    weight: int = 0
    final: bool = False


@dataclass
class Restart:
    """One restart: its number, why, and the checkpoint it resumed from."""

    attempt: int
    cause: str
    resume_from: str | None
    time: float


@dataclass
class SupervisedRun:
    """What a supervised run did: attempts made, restarts (with causes), wall time."""

    run_dir: str
    attempts: int = 0
    restarts: list[Restart] = field(default_factory=list)
    seconds: float = 0.0


class Supervisor:
    """Runs ``command`` on every host of ``hostfile`` via ``mlx.launch`` and keeps the group alive.

    ``command`` is the full command of one rank (``[sys.executable, "train.py", ...]``);
    ``checkpoint_dir`` is only used to say which checkpoint a restart resumes from.
    """

    def __init__(self, command: Sequence[str], hostfile: Hostfile, run_dir: str | os.PathLike[str],
                 policy: RecoveryPolicy | None = None, checkpoint_dir: str | None = None,
                 restart_args: Sequence[str] = (), output: tuple[TextIO, TextIO] | None = None) -> None:
        if not command:
            raise ConfigError("the supervisor needs a command to run on every rank, e.g. [sys.executable, 'train.py']")
        self.command = list(command)
        self.hostfile = hostfile
        self.run_dir = Path(run_dir)
        self.state_dir = rundir.distributed_dir(self.run_dir)
        self.policy = policy or RecoveryPolicy()
        self.checkpoint_dir = checkpoint_dir
        self.restart_args = list(restart_args)
        self.out, self.err = output or (sys.stdout, sys.stderr)
        self.backend = choose_backend(hostfile.backend, hostfile.has_rdma)
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        # (attempt, rank, exit code; None: killed), as mlx.launch reports them
        self._events: queue.Queue[tuple[int, int, int | None]] = queue.Queue()
        self._last_error: str | None = None  # the last error line any rank of this attempt printed
        self._attempt_number, self._attempt_started = 0, 0.0
        # rank -> (its heartbeat's ``time``, supervisor monotonic time when that value was first read)
        self._beats: dict[int, tuple[float, float]] = {}
        # One local process runs without mlx.launch (whose one-host MLX_HOSTFILE is empty, which
        # mx.distributed.init() then fails to parse).
        self._direct = hostfile.num_processes == 1 and hostfile.is_local
        self._process: subprocess.Popen[bytes] | None = None  # the running attempt's launcher (or lone rank)
        # (signal, monotonic time, whether a rank was told) from the first stop signal on. The handler only
        # records it: the watch and the attempt loop act on it, so no signal lands between starting a
        # group and watching it (which left a restarted group running with no supervisor).
        self._interrupt: tuple[int, float, bool] | None = None

    # ------------------------------------------------------------------ running
    def run(self) -> SupervisedRun:
        """Launch, watch, restart; returns when the group finished, raises ``DistributedError`` when it
        cannot (restarts exhausted, or an error a restart would repeat)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        handlers = self._open_log()
        entry = registry.register("supervisor", run_id=self.run_id, run_dir=str(self.run_dir.resolve()),
                                  ranks=self.hostfile.num_processes, backend=self.backend.name,
                                  state_dir=str(self.state_dir.resolve()))
        result, start = SupervisedRun(str(self.run_dir)), time.monotonic()
        n = self.hostfile.num_processes
        where = "127.0.0.1" if self.hostfile.is_local else ", ".join(dict.fromkeys(h.ssh for h in self.hostfile.hosts))
        self.log(f"launching {n} rank{'s' if n != 1 else ''} on {where} with mlx.launch, backend {self.backend}")
        previous = self._forward_stop_signals()
        try:
            for attempt in range(self.policy.max_restarts + 1):
                if self._interrupt is not None:  # stopped between attempts: no new group
                    raise self._interrupted(self._interrupt[0])
                registry.update(entry, attempt=attempt, status="running")
                result.attempts = attempt + 1
                cause = self._attempt(attempt)
                if cause is None:
                    return result
                if self._interrupt is not None:
                    raise self._interrupted(self._interrupt[0])
                if cause.final:
                    raise DistributedError(f"{cause.text}; not restarting: a restart would fail the same way")
                if attempt == self.policy.max_restarts:
                    raise DistributedError(
                        f"the group failed {attempt + 1} time{'s' if attempt else ''} and max_restarts "
                        f"({self.policy.max_restarts}) is used up; last failure: {cause.text}{self._where_to_look()}"
                    )
                result.restarts.append(self._record_restart(attempt + 1, cause))
        finally:
            if self._process is not None and self._process.poll() is None:  # a second signal's SystemExit
                self._kill_leftovers(self._process)
            result.seconds = time.monotonic() - start
            registry.unregister(entry)
            for handler in handlers:
                _LOG.removeHandler(handler)
                handler.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return result

    # ------------------------------------------------------------------ stop signals
    def _forward_stop_signals(self) -> dict[int, Any]:
        """Handle SIGTERM and SIGINT by forwarding them to the ranks; returns the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_stop_signal) for signum in (signal.SIGTERM, signal.SIGINT)}

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        """The first signal goes to the ranks (they save and stop at one step); a second one, or one that
        finds no rank to tell, ends the supervisor, whose cleanup stops the group at once."""
        name = signal.Signals(signum).name
        if self._interrupt is not None:
            self.log(f"{name} again: stopping the group at once, without a new checkpoint")
            raise SystemExit(128 + signum)
        told = self._signal_ranks(signum)
        self._interrupt = (signum, time.monotonic(), bool(told))
        if not told:  # the watch stops the group; no attempt starts after this one
            self.log(f"{name} received before any rank was running: stopping the group")
            return
        self.log(f"{name} received: forwarded to rank{'s' if len(told) > 1 else ''} "
                 f"{', '.join(map(str, sorted(told)))}; the ranks finish their step, save a checkpoint and stop "
                 f"(waiting up to {self.policy.interrupt_timeout:g} s; {name} again stops at once)")

    def _signal_ranks(self, signum: int) -> list[int]:
        """Send ``signum`` to this attempt's local ranks; returns the ranks reached. One is enough: the
        ranks vote after every step, so all stop at the same one."""
        process = self._process
        if process is None or process.poll() is not None:
            return []
        targets = {0: process.pid} if self._direct else self._local_ranks()
        told = []
        for rank, pid in targets.items():
            try:
                os.kill(pid, signum)
                told.append(rank)
            except OSError:
                pass
        return told

    def _local_ranks(self) -> dict[int, int]:
        """``{rank: pid}`` of this attempt's live ranks on this host (found by their heartbeats)."""
        return {rank: info.pid for rank, info in rundir.read_heartbeats(self.run_dir).items()
                if info.host == socket.gethostname() and processes.alive(info.pid)
                and processes.environ(info.pid).get(rank_env.ENV_RUN_ID) == self.run_id}

    def _interrupted(self, signum: int) -> TrainingInterrupted:
        """The ``TrainingInterrupted`` of a group stopped by ``signum``, naming its newest checkpoint."""
        name = signal.Signals(signum).name
        path, step = self._latest_checkpoint() or (None, 0)
        where = f"the newest checkpoint is {path} (step {step})" if path else "no checkpoint was saved"
        message = f"distributed training stopped by {name}: {where}"
        self.log(message)
        return TrainingInterrupted(signum, step, path, message)

    def _where_to_look(self) -> str:
        """``. Rank logs: ...; restarts: ...`` for the files that exist (never a missing path)."""
        found = [f"{name}: {path}" for name, path in (("Rank logs", self.run_dir / rundir.LOGS_DIR),
                                                      ("restarts", self.state_dir / rundir.RESTARTS_FILE))
                 if path.exists()]
        return f". {'; '.join(found)}" if found else ""

    def _attempt(self, attempt: int) -> Cause | None:
        for stale in self.run_dir.glob(rundir.HEARTBEAT_GLOB):  # the last attempt's
            stale.unlink(missing_ok=True)
        self._beats, self._last_error = {}, None
        self._attempt_number, self._attempt_started = attempt, time.time()
        process = subprocess.Popen(self._argv(attempt), env=self._env(attempt), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._process = process
        readers = [threading.Thread(target=self._pump, args=(process.stdout, self.out, None), daemon=True),
                   threading.Thread(target=self._pump, args=(process.stderr, self.err, attempt), daemon=True)]
        for reader in readers:
            reader.start()
        causes: list[Cause] = []
        try:
            self._watch(process, causes)
        finally:
            self._kill_leftovers(process)
            for reader in readers:
                reader.join(timeout=5)
            if self._direct and process.returncode:
                self._events.put((attempt, 0, process.returncode))
            self._drain(causes, teardown=True)
            if not self._direct and process.returncode and not causes:
                # mlx.launch exits 0 even when ranks fail; anything else means it was itself stopped
                # (a signal from outside) before it could report on its ranks.
                _add(causes, _launcher_cause(process.returncode))
        return self._verdict(causes)

    def _watch(self, process: subprocess.Popen[bytes], causes: list[Cause]) -> None:
        policy, first_seen = self.policy, None
        stop_at: float | None = None
        while process.poll() is None:
            now = time.monotonic()
            if self._interrupt is not None:  # the ranks are saving and stopping: their exits are no failure
                if not self._interrupt[2]:  # none was running to tell
                    self._stop(process)
                    return
                if now - self._interrupt[1] > policy.interrupt_timeout:
                    self.log(f"the ranks did not stop within {policy.interrupt_timeout:g} s of the "
                             f"{signal.Signals(self._interrupt[0]).name}: killing them")
                    self._stop(process)
                    return
                time.sleep(0.1)
                continue
            self._drain(causes)
            ranks = rundir.read_heartbeats(self.run_dir)
            for rank, info in sorted(ranks.items()):
                frozen = self._frozen(rank, info, now)
                if frozen is not None:
                    _add(causes, frozen)
                    stop_at = now  # a frozen rank: nothing will end the group by itself
            if ranks and first_seen is None:
                first_seen = now
            if first_seen is not None and now - first_seen > policy.startup_timeout and self.hostfile.is_local:
                late = [r for r in range(self.hostfile.num_processes) if r not in ranks]
                if late:
                    _add(causes, Cause(f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not "
                                       f"start within {policy.startup_timeout:g} s of rank {min(ranks)}"))
                    stop_at = now
            if causes and stop_at is None:
                stop_at = now + policy.stop_grace  # the launcher stops the others itself; give it time
                self.log(f"{_best(causes).text}; stopping the group")
            if stop_at is not None and now >= stop_at:
                self._stop(process)
                return
            time.sleep(0.2)

    def _frozen(self, rank: int, info: rundir.HeartbeatRecord, now: float) -> Cause | None:
        """The cause when ``rank``'s heartbeat has not changed for longer than the staleness rule allows.

        The age is how long this supervisor has seen the same ``time`` in the file (its own
        monotonic clock), so a rank host's clock offset cannot make a live rank look frozen.
        """
        seen = self._beats.get(rank)
        if seen is None or seen[0] != info.time:
            self._beats[rank] = seen = (info.time, now)
        age = now - seen[1]
        steady = info.steady
        minimum = self.policy.frozen_timeout if steady else self.policy.heartbeat_timeout
        if not rundir.is_stale(info, float(info.time) + age, minimum):
            return None
        limit = rundir.stale_limit(info, minimum)
        why = (f"its monitor thread writes it every {info.interval:g} s, even during validation and checkpoints, "
               "so the process is stopped or wedged" if steady else "it is written between steps")
        return Cause(f"rank {rank} is frozen: no heartbeat for {age:.1f} s (limit {limit:g} s; {why}; pid {info.pid} "
                     f"on {info.host}, state {info.state}, {info.step} steps done)")

    def _stop(self, process: subprocess.Popen[bytes]) -> None:
        """Stop the launcher and every local rank: SIGTERM, then SIGKILL after ``stop_grace`` seconds."""
        processes.signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.policy.stop_grace)
        except subprocess.TimeoutExpired:
            pass
        processes.signal_group(process.pid, signal.SIGKILL)  # also ends a frozen (SIGSTOP) rank
        process.wait(timeout=10)

    def _kill_leftovers(self, process: subprocess.Popen[bytes]) -> None:
        """Make sure no local process of this attempt survives it (bounded: a few seconds)."""
        if process.poll() is None:
            self._stop(process)
        processes.signal_group(process.pid, signal.SIGKILL)  # members the launcher left behind, if any
        pids = [process.pid]
        for pid in self._local_ranks().values():
            pids.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (processes.group_alive(process.pid)
                                               or any(map(processes.alive, pids[1:]))):
            time.sleep(0.05)
        for entry in registry.entries():  # ranks killed before they could remove their entry
            if entry.get("run_id") == self.run_id and entry.get("kind") == "rank" and not entry["alive"]:
                registry.unregister(Path(entry["path"]))

    # ------------------------------------------------------------------ evidence
    def _pump(self, stream: IO[bytes], sink: TextIO, attempt: int | None) -> None:
        """Copy the launcher's ``stream`` to ``sink``; for the stderr of ``attempt`` (None: stdout), also read the
        error lines and mlx.launch's reports of its ranks' exits."""
        previous, repeats = None, 0
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if line == previous:  # the ring backend repeats each socket error a dozen times
                repeats += 1
                continue
            shown = f"  (previous line repeated {repeats} more times)\n{line}" if repeats else line
            previous, repeats = line, 0
            try:
                sink.write(shown)
                sink.flush()
            except (OSError, ValueError):
                pass
            if attempt is None:
                continue
            if _ERROR_LINE.search(line):
                self._last_error = line.strip()
            killed, exited = _RANK_KILLED.search(line), _RANK_EXIT.search(line)
            if killed:
                self._events.put((attempt, int(killed[1]), None))
            elif exited:
                self._events.put((attempt, int(exited[1]), int(exited[2])))
        if repeats:
            try:
                sink.write(f"  (previous line repeated {repeats} more times)\n")
            except (OSError, ValueError):
                pass
        stream.close()

    def _drain(self, causes: list[Cause], teardown: bool = False) -> None:
        while True:
            try:
                attempt, rank, code = self._events.get_nowait()
            except queue.Empty:
                break
            if attempt != self._attempt_number:
                continue  # a report of an attempt already over, read late
            cause = _exit_cause(rank, code, after_failure=bool(causes) or teardown)
            if code in SSH_FAILED and self._no_heartbeat_seen(rank):
                cause = self._ssh_cause(rank, code)
            elif code and code > 0:
                cause = self._with_error_line(rank, cause)
            _add(causes, cause)
        for rank, info in rundir.read_heartbeats(self.run_dir).items():
            if info.state == "failed":
                _add(causes, self._failed(rank, info))
            elif info.state == "interrupted" and info.error_type == "TrainingInterrupted":  # the rank the signal hit
                sent = _SIGNAL_NAME.search(info.error or "")
                _add(causes, Cause(f"rank {rank} got {sent[0] if sent else 'a stop signal'} from outside the "
                                   f"supervisor, and the other ranks stopped with it after step {info.step}"))

    def _with_error_line(self, rank: int, cause: Cause) -> Cause:
        """``cause`` with the error line ``rank`` printed last: from its own log (``logs/rank-<r>.log``, written
        in this attempt); else, with one rank, the group's last one; else the group's, said to be the group's
        (mlx.launch merges the ranks' output, so a line there may be another rank's)."""
        line, own = self._own_error_line(rank), True
        if line is None:
            line, own = self._last_error, self.hostfile.num_processes == 1
        if line is None:
            return cause
        final = cause.final or any(name in line for name in FINAL_ERRORS)
        text = f"{cause.text} after printing: {line}" if own else f"{cause.text} (the group's last error line: {line})"
        return Cause(text, cause.weight, final)

    def _own_error_line(self, rank: int) -> str | None:
        """The last error line in ``rank``'s log since this attempt started it (None without one)."""
        path = rundir.rank_log_path(self.run_dir, rank)
        try:
            if path.stat().st_mtime < self._attempt_started - 1.0:
                return None  # not written in this attempt
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        start = text.rfind(f"--- rank {rank}, pid ")
        header = text[start:text.find("\n", start)] if start >= 0 else ""
        if f", attempt {self._attempt_number}, " not in header:
            return None
        lines = [line.strip() for line in text[start:].splitlines() if _ERROR_LINE.search(line)]
        return lines[-1] if lines else None

    def _no_heartbeat_seen(self, rank: int) -> bool:
        """True when ``rank`` runs over ssh and no heartbeat of it was seen in this attempt (it never
        started, or its heartbeats are on its own host's disk)."""
        host = self.hostfile.hosts[rank] if 0 <= rank < len(self.hostfile.hosts) else None
        return host is not None and not host.is_local and rank not in self._beats \
            and not rundir.heartbeat_path(self.run_dir, rank).exists()

    def _ssh_cause(self, rank: int, code: int) -> Cause:
        """Why ssh to ``rank``'s host failed (``mlx.launch`` runs ssh with ``LogLevel=QUIET``, which
        hides ssh's error, so one ``ssh host true`` is tried here to get it). A host ssh cannot reach
        now would fail the restart the same way: final."""

        host = self.hostfile.hosts[rank]
        check = check_host(host, timeout=5.0)
        if check.ok:
            return Cause(f"rank {rank} on {host.ssh} exited with code {code} before a heartbeat of it was seen "
                         f"(ssh {host.ssh} works now)")
        return Cause(f"rank {rank} cannot run on {host.ssh}: {check.detail}", final=True)

    def _failed(self, rank: int, info: rundir.HeartbeatRecord) -> Cause:
        kind = info.error_type or "error"
        return Cause(f"rank {rank} failed after step {info.step}: {info.error or kind}",
                     weight=1 if kind == "DistributedError" else 0, final=kind in FINAL_ERRORS)

    def _verdict(self, causes: list[Cause]) -> Cause | None:
        if causes:
            return _best(causes)
        unfinished = [(r, info.state) for r, info in rundir.read_heartbeats(self.run_dir).items()
                      if info.live]
        if unfinished:
            rank, state = unfinished[0]
            return Cause(f"rank {rank} ended without finishing (its last heartbeat says {state})")
        return None

    # ------------------------------------------------------------------ restarts
    def _latest_checkpoint(self) -> tuple[str, int] | None:
        """(path, step) of the newest complete checkpoint in ``checkpoint_dir`` (None without one)."""
        if not self.checkpoint_dir:
            return None
        from mlx_train.run_directory import RunDirectory

        try:
            latest = RunDirectory(self.run_dir, self.checkpoint_dir).checkpoints.latest()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - only used for messages
            return None
        return (latest.path, latest.step) if latest else None

    def _record_restart(self, attempt: int, cause: Cause) -> Restart:
        latest = self._latest_checkpoint()
        resume_from = latest[0] if latest else None
        restart = Restart(attempt, cause.text, resume_from, time.time())
        source = f"checkpoint {resume_from}" if resume_from else (
            "the last complete checkpoint" if not self.checkpoint_dir else "scratch (no complete checkpoint yet)")
        self.log(f"restart {attempt} of {self.policy.max_restarts}: {cause.text}; resuming from {source}")
        with open(self.state_dir / rundir.RESTARTS_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps({"attempt": attempt, "cause": cause.text, "resume_from": resume_from,
                                   "time": restart.time, "run_id": self.run_id}) + "\n")
        return restart

    # ------------------------------------------------------------------ launching
    def _argv(self, attempt: int) -> list[str]:
        command = self.command + (self.restart_args if attempt > 0 else [])
        if self._direct:
            return command
        hostfile_path = self.state_dir / rundir.HOSTFILE_FILE
        self.hostfile.write(hostfile_path, backend=self.backend.name)
        ports = sum(max(1, len(h.ips)) for h in self.hostfile.hosts)
        argv = [launcher_path(), "--hostfile", str(hostfile_path), "--backend", self.backend.name,
                "--starting-port", str(free_port_base(ports) if self.hostfile.is_local else 32323 + 97 * attempt)]
        for item in passthrough_env() + [f"{k}={v}" for k, v in self._run_env(attempt).items()]:
            argv += ["--env", item]
        return argv + ["--"] + command

    def _run_env(self, attempt: int) -> dict[str, str]:
        env = {rank_env.ENV_RUN_ID: self.run_id, rank_env.ENV_STATE_DIR: str(self.state_dir.resolve()),
               rank_env.ENV_RUN_DIR: str(self.run_dir.resolve()), rank_env.ENV_ATTEMPT: str(attempt),
               rank_env.ENV_BACKEND: self.backend.name,
               rank_env.ENV_SUPERVISOR: f"{os.getpid()}@{socket.gethostname()}"}  # the ranks stop when it is gone
        if attempt > 0:
            env[rank_env.ENV_RESUME] = "auto"
        return env

    def _env(self, attempt: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != rank_env.ENV_RESUME}
        env.update(self._run_env(attempt))
        return env

    def _open_log(self) -> list[logging.Handler]:
        """Send this run's supervisor messages to stderr (``mlx-train: ...``) and to ``supervisor.log``."""
        console = logging.StreamHandler(self.err)
        console.setFormatter(logging.Formatter("mlx-train: %(message)s"))
        file = logging.FileHandler(self.state_dir / rundir.SUPERVISOR_LOG, encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        for handler in (console, file):
            _LOG.addHandler(handler)
        _LOG.setLevel(logging.INFO)
        _LOG.propagate = False  # these are the supervisor's own lines; a root handler would repeat them
        return [console, file]

    def log(self, message: str) -> None:
        """A supervisor message: on stderr and in ``<run_dir>/distributed/supervisor.log``."""
        _LOG.info(message)


def _exit_cause(rank: int, code: int | None, after_failure: bool) -> Cause:
    if code is None:
        return Cause(f"rank {rank} was stopped by the launcher", weight=2)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        # SIGTERM after another failure is the launcher stopping the group: a consequence.
        return Cause(f"rank {rank} was killed by {name}", weight=2 if after_failure and -code == signal.SIGTERM else 0)
    if code == DistributedError.exit_code:
        return Cause(f"rank {rank} exited with a DistributedError (exit code {code})", weight=2)
    if code - 128 in (signal.SIGTERM, signal.SIGINT):  # the ranks stop together: the signal reached it or another
        return Cause(f"rank {rank} exited with code {code} (stopped by {signal.Signals(code - 128).name}, sent to it "
                     "or to another rank)", weight=1)
    return Cause(f"rank {rank} exited with code {code}", final=code in FINAL_EXIT_CODES)


def _launcher_cause(code: int) -> Cause:
    """Why an attempt failed when ``mlx.launch`` itself ended abnormally (exit ``code``) without naming a rank."""
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return Cause(f"mlx.launch was killed by {name} before it reported on its ranks (stopped from outside?)")
    return Cause(f"mlx.launch exited with code {code} without naming a failed rank")


def _add(causes: list[Cause], cause: Cause) -> None:
    if cause.text not in {c.text for c in causes}:
        causes.append(cause)


def _best(causes: list[Cause]) -> Cause:
    """A final cause if there is one, else the first of the lowest weight."""
    finals = [c for c in causes if c.final]
    return finals[0] if finals else min(causes, key=lambda c: c.weight)


def supervise(command: Sequence[str], num_processes: int | None = None, hostfile: Hostfile | str | None = None,
              run_dir: str | os.PathLike[str] = "runs/distributed", policy: RecoveryPolicy | None = None,
              checkpoint_dir: str | None = None, output: tuple[TextIO, TextIO] | None = None) -> SupervisedRun:
    """Run ``command`` under a ``Supervisor``: on ``hostfile`` (a path or ``Hostfile``), or
    ``num_processes`` ranks on 127.0.0.1.

    Example: ``supervise([sys.executable, "train.py"], num_processes=2, run_dir="runs/a")``
    """
    if isinstance(hostfile, (str, os.PathLike)):
        hostfile = Hostfile.read(hostfile)
    if hostfile is None:
        hostfile = Hostfile.local(num_processes or 2)
    return Supervisor(command, hostfile, run_dir, policy, checkpoint_dir, output=output).run()

