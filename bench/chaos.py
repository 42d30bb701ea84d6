"""Chaos benchmark: does a run survive SIGKILL, SIGTERM and SIGINT sent at random moments?

Each trial trains one built-in model (tests/scripts/chaos_run.py: dropout, shuffling, gradient
accumulation 2, validation every 4 steps, a checkpoint every 5) and sends it several signals, each
at a uniformly random time in the attempt's training window (restore, steps, validation and
background checkpoint saves included); after every signal the run is resumed with
``resume="auto"``, and after the last one it runs to the end. Then it compares with one
uninterrupted run of the same configuration:

- bit-exact: final parameters ``np.array_equal`` to the uninterrupted run's;
- steps lost per signal: the step the attempt had reached when it ended (its last
  ``on_batch_end``; for SIGKILL the step at the signal, for SIGTERM/SIGINT it includes the step
  the Trainer finishes) minus the step of the checkpoint the next attempt resumes from (its
  "resumed from ... (step N" line), which must be the newest complete checkpoint on disk.
  SIGTERM/SIGINT must lose none and exit 143/130; SIGKILL loses the steps since the last complete
  checkpoint;
- rows of RUN_DIR/metrics.jsonl keyed by (kind, step, epoch): none twice, none missing.

A signal's time is uniform from the moment the script calls ``train()`` over the shortest
uninterrupted window seen (process end), scaled to the steps still to run. Its phase, read from
the script's progress file right before sending: startup/restore (before the first
``on_fit_start``), step, validation, save (the background checkpoint writer is busy), or after
training (train() has returned or put the previous signal handlers back: the default action
applies, and nothing is lost since the last step is saved).

    python bench/chaos.py                        # 30 trials over mlp, cnn, transformer
    python bench/chaos.py --trials 6 --models mlp --kills-per-trial 4 --signals TERM,KILL --seed 1
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "chaos_run.py"
MODELS = ("mlp", "cnn", "transformer")
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
# Exit status of an attempt stopped cleanly by the Trainer (TrainingInterrupted).
CLEAN_EXIT = {"TERM": 143, "INT": 130, "KILL": -signal.SIGKILL}
RESUMED = re.compile(r"resumed from (\S+) \(step (\d+),")
POLL_SECONDS = 0.002
AFTER = "after training"  # the phase of a signal that came after the last step and the final save


@dataclass
class Attempt:
    """One process of a trial: how it ended and where it was when the signal was sent."""

    returncode: int
    output: str
    progress: dict  # PROGRESS.json when the process ended
    at_signal: dict | None = None  # PROGRESS.json read right before the signal (None: no signal sent)
    delay: float | None = None  # seconds after the training window opened
    window: float = 0.0  # seconds from the training window opening to the end of the process
    checkpoints: list[int] = field(default_factory=list)  # complete checkpoints on disk when it ended

    @property
    def resumed_from(self) -> int | None:
        """The step this attempt resumed from, by its own log; 0 for a fresh start, None when unknown."""
        match = RESUMED.search(self.output)
        if match:
            return int(match.group(2))
        return 0 if self.progress.get("start_step") == 0 else None


@dataclass
class Kill:
    """One signal of a trial and what it cost."""

    kind: str
    phase: str
    delay: float
    returncode: int
    step_at_signal: int | None
    reached: int | None
    resumed_from: int | None
    checkpoint_on_disk: int
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int | None:
        if self.reached is None or self.resumed_from is None:
            return None
        return self.reached - self.resumed_from


@dataclass
class Trial:
    model: str
    run_dir: Path
    kills: list[Kill]
    bit_exact: bool
    differing: list[str]
    duplicated: list
    missing: list
    problems: list[str]
    planned: int = 0  # signals planned; fewer are sent when the run ends before one is due

    @property
    def ok(self) -> bool:
        return self.bit_exact and not self.duplicated and not self.missing and not self.problems


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _phase(progress: dict) -> str:
    if progress.get("finished"):
        return AFTER
    if progress.get("start_step") is None:
        return "startup/restore"
    if progress.get("saving"):
        return "save+validation" if progress.get("validating") else "save"
    return "validation" if progress.get("validating") else "step"


def run_attempt(model: str, run_dir: Path, out: Path, signal_name: str | None = None,
                delay: float | None = None, resume: bool = False) -> Attempt:
    """Run one attempt of chaos_run.py; send ``signal_name`` ``delay`` s after its training window opens.

    Example: ``run_attempt("mlp", Path("t/run"), Path("t/a.safetensors"), "TERM", 0.4, resume=True)``
    """
    progress_path = out.with_suffix(".progress.json")
    progress_path.unlink(missing_ok=True)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(SCRIPT), model, str(run_dir), str(out), str(progress_path)]
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command + (["--resume"] if resume else []), stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        at_signal = None
        try:
            while not progress_path.exists() and proc.poll() is None:  # the window opens at train()
                time.sleep(POLL_SECONDS)
            opened = time.perf_counter()
            if signal_name is not None:
                while proc.poll() is None and time.perf_counter() - opened < delay:
                    time.sleep(min(POLL_SECONDS, max(0.0, delay - (time.perf_counter() - opened))))
                if proc.poll() is None:
                    at_signal = _read_json(progress_path)
                    proc.send_signal(SIGNALS[signal_name])
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    window = time.perf_counter() - opened
    return Attempt(proc.returncode, log_path.read_text(), _read_json(progress_path), at_signal, delay, window=window)


def resume_from_checkpoint(attempt: Attempt) -> bool:
    return bool(RESUMED.search(attempt.output))


def complete_checkpoints(checkpoint_dir: Path) -> list[int]:
    """Steps of the checkpoints in ``checkpoint_dir`` that have a manifest (complete saves)."""
    if not checkpoint_dir.exists():
        return []
    return sorted(int(p.name.split("-")[1]) for p in checkpoint_dir.iterdir()
                  if p.name.startswith("step-") and ".tmp" not in p.name and (p / "manifest.json").exists())


def row_keys(run_dir: Path) -> collections.Counter:
    """(kind, step, epoch) of every row of RUN_DIR/metrics.jsonl, counted."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return collections.Counter()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return collections.Counter((r["kind"], r["step"], r["epoch"]) for r in rows)


def load_params(path: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {name: np.array(value) for name, value in mx.load(str(path)).items()}


@dataclass
class Reference:
    """The uninterrupted run of a model: what every trial is compared with."""

    params: dict[str, np.ndarray]
    rows: collections.Counter
    total_steps: int
    window: float  # seconds from the training window opening to the end of the process


def reference(model: str, workdir: Path, timings: int = 3) -> Reference:
    """Run ``model`` without signals ``timings`` times: the first run is the reference, the shortest
    training window of all sets the range of the signal times (so that signals land before the end)."""
    directory = workdir / f"reference-{model}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    runs = [run_attempt(model, directory / f"run-{i}", directory / f"final-{i}.safetensors") for i in range(timings)]
    for attempt in runs:
        if attempt.returncode != 0:
            raise RuntimeError(f"uninterrupted {model} run failed (exit {attempt.returncode}):\n"
                               f"{attempt.output[-2000:]}")
    total = json.loads((directory / "final-0.safetensors.json").read_text())["step"]
    return Reference(load_params(directory / "final-0.safetensors"), row_keys(directory / "run-0"), total,
                     min(attempt.window for attempt in runs))


def run_trial(model: str, ref: Reference, kinds: list[str], rng: random.Random, trial_dir: Path,
              spread: float = 1.0) -> Trial:
    """Kill-and-resume one run once per entry of ``kinds`` ("KILL", "TERM", "INT"), then finish it.

    Each signal is sent at a uniform time within ``spread`` times the attempt's expected window
    (below 1 to make sure the signals land before the run ends).

    Example: ``run_trial("mlp", reference("mlp", work), ["TERM", "KILL"], random.Random(0), work / "t0")``
    """
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    run_dir, problems = trial_dir / "run", []
    attempts: list[tuple[str | None, Attempt]] = []
    planned = list(kinds)
    while True:
        # Signals while the run is incomplete; then one attempt that runs to the end (a complete run
        # only restores and exits: a signal then would test nothing).
        complete = bool(attempts) and ref.total_steps in attempts[-1][1].checkpoints
        kind = planned.pop(0) if planned and not complete else None
        # Uniform over this attempt's expected window: a restore plus the steps still to run.
        done = max(complete_checkpoints(run_dir / "checkpoints"), default=0)
        expected = ref.window * (0.15 + 0.85 * (ref.total_steps - done) / ref.total_steps)
        delay = rng.uniform(0.0, spread * expected) if kind else None
        out = trial_dir / f"attempt-{len(attempts)}.safetensors"
        attempt = run_attempt(model, run_dir, out, kind, delay, resume=bool(attempts))
        attempt.checkpoints = complete_checkpoints(run_dir / "checkpoints")
        attempts.append((kind, attempt))
        if kind is None or attempt.at_signal is None:  # finished (or the signal came too late)
            if kind is not None and not resume_from_checkpoint(attempt) and attempt.returncode == 0:
                # The whole run was shorter than the window the signal times are drawn from: shrink it.
                ref.window = min(ref.window, attempt.window)
            break
    kills = []
    for i, (kind, killed) in enumerate(attempts):
        if kind is not None and killed.at_signal is not None:
            # An attempt stopped before it logged where it resumed from saved nothing: ask the next one.
            resumed = next((a for _, a in attempts[i + 1:] if a.resumed_from is not None), attempts[-1])
            kills.append(_account(kind, killed, resumed, ref.total_steps))
    last = attempts[-1][1]
    if last.returncode != 0:
        problems.append(f"the last attempt (after {len(kills)} signals) exited {last.returncode}: "
                        f"{last.output[-600:]}")
        return Trial(model, run_dir, kills, False, [], [], [], problems, len(kinds))
    params = load_params(trial_dir / f"attempt-{len(attempts) - 1}.safetensors")
    differing = sorted(name for name, value in ref.params.items()
                       if name not in params or not np.array_equal(params[name], value))
    got = row_keys(run_dir)
    duplicated = sorted(key for key, count in got.items() if count > max(ref.rows[key], 1))
    missing = sorted((ref.rows - got).elements())
    extra = sorted(key for key in got if key not in ref.rows)
    if extra:
        problems.append(f"rows not in the uninterrupted run: {extra}")
    problems += [f"{k.kind} at {k.phase}: {p}" for k in kills for p in k.problems]
    return Trial(model, run_dir, kills, not differing, differing, duplicated, missing, problems, len(kinds))


def _account(kind: str, killed: Attempt, resumed: Attempt, total_steps: int) -> Kill:
    """What the signal sent to ``killed`` cost, seen from the attempt that resumed after it."""
    on_disk = max(killed.checkpoints, default=0)
    at = killed.at_signal or {}
    phase = _phase(at)
    if killed.returncode == -SIGNALS[kind] and at.get("step") == total_steps and total_steps in killed.checkpoints:
        # Killed by the default action with the last step saved: the signal came after train() put
        # the previous handlers back, before the script marked itself finished.
        phase = AFTER
    kill = Kill(kind, phase, killed.delay or 0.0, killed.returncode, at.get("step"),
                killed.progress.get("step"), resumed.resumed_from, on_disk)
    if kill.reached is None:  # stopped before its first step: it reached where it started from
        kill.reached = kill.resumed_from
    if kind != "KILL" and kill.phase not in ("startup/restore", AFTER) and killed.returncode != CLEAN_EXIT[kind]:
        kill.problems.append(f"exit {killed.returncode}, expected {CLEAN_EXIT[kind]}: {killed.output[-400:]}")
    if kill.resumed_from is None:
        kill.problems.append("the next attempt did not say where it resumed from")
    elif kill.resumed_from != on_disk:
        kill.problems.append(f"resumed from step {kill.resumed_from}, not from the newest complete checkpoint "
                             f"(step {on_disk})")
    elif kind != "KILL" and kill.lost:
        kill.problems.append(f"lost {kill.lost} steps (reached {kill.reached}, resumed from {kill.resumed_from})")
    return kill


def summarize(trials: list[Trial]) -> str:
    """The summary table: trials and bit-exact resumes per model, steps lost and phases per signal."""
    lines = [f"{'model':12s} {'trials':>6s} {'bit-exact':>9s} {'dup rows':>8s} {'miss rows':>9s} "
             f"{'signals sent/planned':>20s}"]
    for model in sorted({t.model for t in trials}) + ["all"]:
        chosen = [t for t in trials if model in ("all", t.model)]
        lines.append(f"{model:12s} {len(chosen):6d} {sum(t.bit_exact for t in chosen):9d} "
                     f"{sum(len(t.duplicated) for t in chosen):8d} {sum(len(t.missing) for t in chosen):9d} "
                     f"{sum(len(t.kills) for t in chosen):13d}/{sum(t.planned for t in chosen):<6d}")
    kills = [k for t in trials for k in t.kills]
    lines += ["", f"{'signal':7s} {'sent':>5s} {'lost total':>10s} {'lost max':>8s} {'lost mean':>9s}  phases"]
    for kind in SIGNALS:
        chosen = [k for k in kills if k.kind == kind]
        lost = [k.lost for k in chosen if k.lost is not None]
        phases = collections.Counter(k.phase for k in chosen)
        lines.append(f"{kind:7s} {len(chosen):5d} {sum(lost):10d} {max(lost, default=0):8d} "
                     f"{(sum(lost) / len(lost) if lost else 0.0):9.2f}  "
                     + ", ".join(f"{p} {n}" for p, n in sorted(phases.items())))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="trials in all, spread over the models in turn")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp, cnn, transformer")
    parser.add_argument("--kills-per-trial", type=int, default=3)
    parser.add_argument("--signals", default="KILL,TERM,INT", help="each kill picks one of these at random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories of passing trials too")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    kinds = [s.strip().upper().removeprefix("SIG") for s in args.signals.split(",") if s.strip()]
    for name, given, allowed in (("--models", models, MODELS), ("--signals", kinds, tuple(SIGNALS))):
        unknown = [x for x in given if x not in allowed]
        if unknown or not given:
            parser.error(f"{name}: unknown or empty {unknown}; choose from {', '.join(allowed)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mlx-train-chaos-"))
    rng = random.Random(args.seed)
    refs = {model: reference(model, workdir) for model in models}
    for model, ref in refs.items():
        print(f"reference {model}: {ref.total_steps} steps, training window {ref.window:.2f} s", flush=True)
    trials = []
    for i in range(args.trials):
        model = models[i % len(models)]
        plan = [rng.choice(kinds) for _ in range(args.kills_per_trial)]
        trial = run_trial(model, refs[model], plan, rng, workdir / f"trial-{i:03d}-{model}")
        trials.append(trial)
        shown = " ".join(f"{k.kind}@{k.phase}(step {k.step_at_signal}, +{k.delay:.2f}s, exit {k.returncode}, "
                         f"lost {k.lost})" for k in trial.kills)
        print(f"trial {i:3d} {model:11s} {'ok ' if trial.ok else 'BAD'} {shown}", flush=True)
        if not trial.ok:
            print(f"    run dir {trial.run_dir}; params differ: {trial.differing}; duplicated rows "
                  f"{trial.duplicated}; missing rows {trial.missing}; {trial.problems}", flush=True)
        elif not args.keep:
            shutil.rmtree(workdir / f"trial-{i:03d}-{model}", ignore_errors=True)
    print()
    print(summarize(trials))
    print(f"\nrun directories under {workdir}")
    sys.exit(0 if all(t.ok for t in trials) else 1)


if __name__ == "__main__":
    main()
