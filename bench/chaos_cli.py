"""Chaos benchmark through the command line: signals at random moments to ``mlx-train train``, then
``mlx-train train --run-dir R --resume`` until the run is done, compared bit for bit with a run that
was never interrupted.

Each trial starts ``mlx-train train --run-dir R`` (the built-in MLP on digits, a few epochs, a
checkpoint every few steps, a report every step) and sends it one signal (SIGKILL, SIGTERM or
SIGINT) at a moment drawn from one of three kinds:

- startup: 0-300 ms after the process started (imports, config, data, the lock);
- first save: when the first checkpoint save is half-way (the writer's test hook
  MLX_TRAIN_SAVE_PAUSE_AFTER announces it: after model.safetensors on a local disk, after the data
  files were moved but not the manifest on S3);
- random: uniform over the uninterrupted run's training, counted from its first reported step (a
  moment in start-up is the 'startup' kind's).

Then ``--resume`` attempts follow, the first ``--kills-per-trial - 1`` of them signalled at a random
moment of their training too, until one ends by itself. The trial's outcome:

- bit-exact: the last attempt exits 0 and the newest checkpoint holds the uninterrupted run's final
  step and parameters, bit for bit;
- clear refusal: an attempt that was not signalled exits with a usage/checkpoint code (2-5) and one
  ``mlx-train: error:`` line, no traceback (e.g. a run killed before it wrote config.yaml);
- FAILED: anything else (other parameters, a traceback, exit 1, a hang).

Steps lost per signal: the last step the attempt reported (``step N |`` lines, or "stopped by
SIGTERM at step N") minus the step the next attempt resumed from (0 when it started over).
With ``--s3`` the same trials run with ``--set checkpoint_dir=s3://...`` on moto's S3 server on
127.0.0.1 (needs ``moto[server]`` and s3fs).

    python bench/chaos_cli.py                          # 12 local trials
    python bench/chaos_cli.py --trials 8 --s3 --seed 1  # 8 local and 8 on S3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import CLEAN_EXIT, RESUMED, SIGNALS  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["--epochs", "6", "--seed", "42", "--set", "model_options.hidden_dims=[16]", "--set", "checkpoint_every=5",
         "--set", "keep_last=2", "--set", "report_every=1"]
STEP_LINE = re.compile(r"^step (\d+) \|", re.M)
STOPPED = re.compile(r"stopped by SIG\w+ at step (\d+)")
PAUSED = "mlx-train test hook: save paused after"
KINDS = ("startup", "first save", "random")
TIMEOUT_SECONDS = 300


@dataclass
class Attempt:
    """One ``mlx-train train`` process: its exit, output and the signal it got."""

    returncode: int
    output: str
    signal_name: str | None = None
    sent: bool = False
    training_seconds: float = 0.0  # from the first reported step to the last

    @property
    def landed(self) -> bool:
        return self.sent and self.returncode != 0

    @property
    def reached(self) -> int | None:
        stopped = STOPPED.search(self.output)
        steps = [int(s) for s in STEP_LINE.findall(self.output)]
        return int(stopped.group(1)) if stopped else max(steps, default=None)

    @property
    def resumed_from(self) -> int | None:
        match = RESUMED.search(self.output)
        if match:
            return int(match.group(2))
        return 0 if STEP_LINE.search(self.output) else None  # trained from step 0: started over

    @property
    def refused_clearly(self) -> bool:
        errors = [line for line in self.output.splitlines() if line.startswith("mlx-train: error:")]
        return 2 <= self.returncode <= 5 and len(errors) == 1 and "Traceback" not in self.output


@dataclass
class Trial:
    storage: str
    kind: str
    attempts: list[Attempt]
    outcome: str
    note: str = ""
    lost: list[tuple[str, int | None]] = field(default_factory=list)  # (signal, steps lost)


def run_attempt(run_dir: Path, log: Path, env: dict[str, str], resume: bool, signal_name: str | None = None,
                delay: float | None = None, at_first_save: bool = False, from_training: bool = False) -> Attempt:
    """Run ``mlx-train train`` once; send ``signal_name`` after ``delay`` s (counted from the first reported
    step with ``from_training``), or when the first save pauses."""
    command = [sys.executable, "-m", "mlx_train", "train", "--run-dir", str(run_dir)]
    command += ["--resume"] if resume else TRAIN
    if env.get("CHECKPOINT_URL") and not resume:
        command += ["--set", f"checkpoint_dir={env['CHECKPOINT_URL']}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    paused, training = threading.Event(), threading.Event()
    steps_seen: list[float] = []  # when each step line arrived

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith(PAUSED):
                paused.set()
            if STEP_LINE.match(line):
                steps_seen.append(time.perf_counter())
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = False
    started = time.perf_counter()
    try:
        if signal_name is not None:
            if at_first_save:
                while not paused.wait(0.01) and proc.poll() is None:
                    pass
            else:
                if from_training:  # the delay counts from the first reported step
                    while not training.wait(0.005) and proc.poll() is None:
                        pass
                    started = time.perf_counter()
                while proc.poll() is None and time.perf_counter() - started < (delay or 0.0):
                    time.sleep(0.002)
            if proc.poll() is None:
                proc.send_signal(SIGNALS[signal_name])
                sent = True
        proc.wait(timeout=TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        lines.append(f"\n[chaos_cli: killed after {TIMEOUT_SECONDS} s: a hang]\n")
    reader.join(timeout=10)
    output = "".join(lines)
    log.write_text(output)
    trained = steps_seen[-1] - steps_seen[0] if steps_seen else 0.0
    return Attempt(proc.returncode, output, signal_name, sent, trained)


def final_parameters(checkpoint_dir: str) -> tuple[int, dict[str, np.ndarray]]:
    """(step, model parameters) of the newest complete checkpoint in ``checkpoint_dir``."""
    from mlx_train.checkpointing import CheckpointManager, load_checkpoint

    info = CheckpointManager(checkpoint_dir, keep_last=None, async_save=False).latest()
    if info is None:
        raise FileNotFoundError(f"no complete checkpoint in {checkpoint_dir}")
    arrays, _ = load_checkpoint(info.path, groups=["model"])
    return info.step, {name: np.array(value) for name, value in arrays["model"].items()}


def run_trial(storage: str, kind: str, signals: list[str], reference: tuple[int, dict[str, np.ndarray]],
              window: float, env: dict[str, str], trial_dir: Path, rng: random.Random) -> Trial:
    """One run: signalled attempts (the first at a moment of ``kind``), then resumes until it ends by itself."""
    run_dir = trial_dir / "run"
    trial_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = env.get("CHECKPOINT_URL") or str(run_dir / "checkpoints")
    attempts: list[Attempt] = []
    pending = list(signals)
    while len(attempts) < len(signals) + 3:
        name = pending.pop(0) if pending else None
        first = not attempts
        attempt_env = dict(env)
        if name is not None and first and kind == "first save":
            attempt_env["MLX_TRAIN_SAVE_PAUSE_AFTER"] = "files moved" if storage == "s3" else "model.safetensors"
            attempt_env["MLX_TRAIN_SAVE_PAUSE_SECONDS"] = "0.5"
        in_startup = first and kind == "startup"
        delay = rng.uniform(0.0, 0.3) if in_startup else rng.uniform(0.0, window)
        attempt = run_attempt(run_dir, trial_dir / f"attempt-{len(attempts)}.log", attempt_env, resume=not first,
                              signal_name=name, delay=delay, at_first_save=first and kind == "first save",
                              from_training=not in_startup)
        attempts.append(attempt)
        if not attempt.sent and attempt.returncode != 0:
            break  # ended by itself with an error: a refusal or a failure, judged below
        if not attempt.sent and attempt.returncode == 0 and not pending:
            break
    trial = Trial(storage, kind, attempts, "FAILED")
    for i, attempt in enumerate(attempts):
        if attempt.sent:
            after = next((a.resumed_from for a in attempts[i + 1:] if a.resumed_from is not None), None)
            reached = attempt.reached if attempt.reached is not None else after
            trial.lost.append((attempt.signal_name or "?", None if reached is None or after is None
                               else reached - after))
            expected = (0, -SIGNALS[attempt.signal_name or "KILL"], CLEAN_EXIT[attempt.signal_name or "KILL"])
            if attempt.returncode not in expected or "Traceback" in attempt.output:
                trial.note += f"attempt {i} ({attempt.signal_name}) exited {attempt.returncode}"
                trial.note += " with a traceback; " if "Traceback" in attempt.output else "; "
    last = attempts[-1]
    if last.returncode != 0 and not last.sent:
        if last.refused_clearly:
            trial.outcome = "clear refusal"
        error = [line for line in last.output.splitlines() if "error" in line.lower()][-1:] or [last.output[-300:]]
        trial.note += f"last attempt exit {last.returncode}: {error[0].strip()[:300]}"
        return trial
    try:
        step, params = final_parameters(checkpoint_dir)
    except Exception as error:
        trial.note += f"final checkpoint unreadable: {type(error).__name__}: {error}"
        return trial
    ref_step, ref_params = reference
    differing = [name for name, value in ref_params.items()
                 if name not in params or not np.array_equal(params[name], value)]
    if step == ref_step and not differing:
        trial.outcome = "bit-exact"
    else:
        trial.note += f"final step {step} (uninterrupted: {ref_step}); parameters differ: {differing}"
    return trial


def _lost(steps: list[int | None]) -> str:
    known = [s for s in steps if s is not None]
    if not steps:
        return "-"
    return f"{np.mean(known):.1f}/{max(known)}" if known else "?"


def summarize(trials: list[Trial]) -> str:
    """The table: per storage and signal moment, trials, signals sent/landed, steps lost, outcomes."""
    header = (f"{'storage':8s} {'moment':11s} {'trials':>6s} {'sent/landed':>11s} {'lost: KILL':>14s} "
              f"{'TERM':>9s} {'INT':>9s} {'bit-exact':>9s} {'refusal':>7s} {'FAILED':>6s}")
    lines = [header, "-" * len(header)]
    groups = [(s, k) for s in sorted({t.storage for t in trials}) for k in KINDS] + [("all", "all")]
    for storage, kind in groups:
        chosen = [t for t in trials if storage in ("all", t.storage) and kind in ("all", t.kind)]
        if not chosen:
            continue
        attempts = [a for t in chosen for a in t.attempts]
        lost = collections.defaultdict(list)
        for t in chosen:
            for name, steps in t.lost:
                lost[name].append(steps)


        outcomes = collections.Counter(t.outcome for t in chosen)
        lines.append(f"{storage:8s} {kind:11s} {len(chosen):6d} "
                     f"{sum(a.sent for a in attempts):5d}/{sum(a.landed for a in attempts):<5d} "
                     f"{_lost(lost['KILL']):>14s} {_lost(lost['TERM']):>9s} {_lost(lost['INT']):>9s} "
                     f"{outcomes['bit-exact']:9d} {outcomes['clear refusal']:7d} {outcomes['FAILED']:6d}")
    lines.append("(lost: mean/max steps between the step an attempt reached and the step the next resumed from)")
    return "\n".join(lines)


def start_s3(env: dict[str, str]) -> tuple[object, dict[str, str]]:
    """Start moto's S3 server on 127.0.0.1 with a bucket; return it and the env that points s3fs at it."""
    import logging
    import socket

    import fsspec.config
    import moto.server as moto_server
    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"}}
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir("chaos")
    fsspec.config.conf["s3"] = options  # this process reads the final checkpoints too
    return server, {**env, "FSSPEC_S3": json.dumps(options)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12, help="trials per storage (local, and S3 with --s3)")
    parser.add_argument("--kills-per-trial", type=int, default=2)
    parser.add_argument("--signals", default="KILL,TERM,INT", help="each signal picks one of these at random")
    parser.add_argument("--s3", action="store_true", help="also run the trials with checkpoints on moto's S3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    names = [s.strip().upper().removeprefix("SIG") for s in args.signals.split(",") if s.strip()]
    if not names or any(n not in SIGNALS for n in names):
        parser.error(f"--signals: choose from {', '.join(SIGNALS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mlx-train-chaos-cli-"))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    sys.path.insert(0, str(ROOT / "src"))
    rng = random.Random(args.seed)

    started = time.perf_counter()
    ref_run = run_attempt(workdir / "reference" / "run", workdir / "reference.log", env, resume=False)
    elapsed = time.perf_counter() - started
    window = ref_run.training_seconds  # signals of the 'random' kind land within this much training
    if ref_run.returncode != 0:
        sys.exit(f"the uninterrupted run failed (exit {ref_run.returncode}):\n{ref_run.output[-2000:]}")
    reference = final_parameters(str(workdir / "reference" / "run" / "checkpoints"))
    print(f"uninterrupted run: {reference[0]} steps, {elapsed:.1f} s through the CLI, {window:.1f} s of them "
          "training", flush=True)

    storages = [("local", env)]
    server = None
    if args.s3:
        server, s3_env = start_s3(env)
        storages.append(("s3", s3_env))
    trials = []
    try:
        for storage, storage_env in storages:
            for i in range(args.trials):
                kind = KINDS[i % len(KINDS)]
                signals = [rng.choice(names) for _ in range(args.kills_per_trial)]
                trial_dir = workdir / f"{storage}-{i:03d}"
                trial_env = dict(storage_env)
                if storage == "s3":
                    trial_env["CHECKPOINT_URL"] = f"s3://chaos/{storage}-{i:03d}"
                trial = run_trial(storage, kind, signals, reference, window, trial_env, trial_dir, rng)
                trials.append(trial)
                shown = ", ".join(f"{a.signal_name}{'' if a.landed else ' (missed)'} exit {a.returncode}"
                                  for a in trial.attempts if a.sent)
                print(f"{storage:5s} trial {i:3d} {kind:10s} {trial.outcome:13s} {shown}; lost {trial.lost}"
                      + (f"\n      {trial.note}" if trial.note else ""), flush=True)
                if trial.outcome == "bit-exact":
                    shutil.rmtree(trial_dir, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
    print()
    print(summarize(trials))
    print(f"\nrun directories (failed and refused trials) under {workdir}")
    sys.exit(0 if all(t.outcome == "bit-exact" for t in trials) else 1)


if __name__ == "__main__":
    main()
