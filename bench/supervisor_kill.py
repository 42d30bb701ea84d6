"""Kill trials of the distributed supervisor: ``mlx-train train --distributed -n 2`` on 127.0.0.1 gets SIGKILL
at a random moment of its training, then ``--resume`` runs the rest, compared bit for bit with a distributed
run that was never interrupted.

A trial's outcome:

- stopped and bit-exact: after the supervisor's death both ranks stopped by themselves at one step with a
  checkpoint there (their heartbeats say "interrupted"), and the resumed run ended with the uninterrupted
  run's final step and parameters, bit for bit;
- FAILED: anything else (a rank still running after the timeout, ranks at different steps, a resume that
  fails, other parameters).

    python bench/supervisor_kill.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_cli import STEP_LINE, TRAIN, final_parameters  # noqa: E402  (bench/ is not a package)

from mlx_train import processes, rundir  # noqa: E402

TIMEOUT_SECONDS = 300
EPOCHS = ["--epochs", "30"]  # ~570 steps: a kill lands in training, not after it


def train(run_dir: Path, env: dict[str, str], resume: bool = False,
          kill_after: float | None = None) -> tuple[str, float]:
    """``mlx-train train --distributed -n 2``; SIGKILL the supervisor ``kill_after`` s after its first step.
    Returns its output and the seconds from its first step to its end."""
    command = [sys.executable, "-m", "mlx_train", "train", "--distributed", "-n", "2", "--run-dir", str(run_dir)]
    command += ["--resume"] if resume else TRAIN + EPOCHS
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if STEP_LINE.match(line):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_after is not None:
        while not training.wait(0.01) and proc.poll() is None:
            pass
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    training.wait(TIMEOUT_SECONDS)
    first_step = time.perf_counter()
    proc.wait(timeout=TIMEOUT_SECONDS)
    reader.join(timeout=10)
    return "".join(lines), time.perf_counter() - first_step


def trial(work: Path, env: dict[str, str], delay: float, reference: tuple[int, dict[str, np.ndarray]]) -> str:
    run_dir = work / "run"
    train(run_dir, env, kill_after=delay)
    pids = {rank: beat.pid for rank, beat in rundir.read_heartbeats(run_dir).items()}
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while any(processes.alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(pids) < 2 or any(processes.alive(pid) for pid in pids.values()):
        for pid in pids.values():
            if processes.alive(pid):
                os.kill(pid, signal.SIGKILL)
        return f"FAILED: ranks {pids} did not stop within {TIMEOUT_SECONDS} s of the supervisor's death"
    beats = rundir.read_heartbeats(run_dir).values()
    states, steps = {b.state for b in beats}, {b.step for b in beats}
    if states == {"finished"}:
        return "not counted: the kill came after the training had ended"
    if states != {"interrupted"} or len(steps) != 1:
        return f"FAILED: ranks ended in {states} at steps {steps}"
    (stopped_at,) = steps
    output, _ = train(run_dir, env, resume=True)
    step, params = final_parameters(str(run_dir / "checkpoints"))
    ref_step, ref_params = reference
    if step != ref_step or any(not np.array_equal(params[k], ref_params[k]) for k in ref_params):
        return f"FAILED: resumed run ended at step {step} (uninterrupted {ref_step}) or with other parameters\n{output}"
    return f"stopped at step {stopped_at} and bit-exact"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env["MLX_TRAIN_HOME"] = str(work / "home")
        _, window = train(work / "reference", env)
        reference = final_parameters(str(work / "reference" / "checkpoints"))
        outcomes = []
        for i in range(args.trials):
            delay = rng.uniform(0.0, 0.8 * window)
            outcome = trial(work / f"trial-{i}", env, delay, reference)
            outcomes.append(outcome)
            print(f"trial {i + 1}: SIGKILL to the supervisor {delay:.1f} s after its first step: {outcome}",
                  flush=True)
    counted = [o for o in outcomes if not o.startswith("not counted")]
    good = sum(not o.startswith("FAILED") for o in counted)
    print(f"\n{good}/{len(counted)} trials: ranks stopped by themselves, resumed bit-exact "
          f"(uninterrupted run: step {reference[0]})")


if __name__ == "__main__":
    main()
