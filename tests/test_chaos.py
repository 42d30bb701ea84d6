"""Chaos trials on the built-in MLP: one trial per signal kind, two signals each at points drawn at
random (the end of a step, a validation, a background checkpoint save), every signal followed by
``resume="auto"``, then the run goes to the end.

The run is held at the chosen point (tests/scripts/chaos_run.py ``--hold``) and signalled there, so a
signal lands where it was meant to on a fast or a loaded machine alike. Each trial must end
bit-identical to an uninterrupted run, lose no step on SIGTERM/SIGINT (the checkpoint the next attempt
resumes from is the step the stopped attempt had reached), and leave no row of ``metrics.jsonl``
twice or missing. ``bench/chaos.py`` sends signals at random clock times instead, many more of them.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"
KILLS_PER_TRIAL = 2
VALIDATE_EVERY, SAVE_EVERY = 4, 5  # the cadences of chaos_run.py


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    module = _chaos()
    workdir = tmp_path_factory.mktemp("chaos")
    return module, module.reference("mlp", workdir, timings=1), workdir


def _hold_point(rng, done, total):
    """A (phase, step) after the checkpoint ``done`` the run resumes from, before its last step."""
    phase = rng.choice(["step", "validation", "save"])
    every = {"step": 1, "validation": VALIDATE_EVERY, "save": SAVE_EVERY}[phase]
    steps = [s for s in range(done + 1, total) if s % every == 0]
    return (phase, rng.choice(steps)) if steps else ("step", rng.randrange(done + 1, total))


def _held_attempt(module, run_dir, out, kind, hold, resume):
    """One attempt held at ``hold`` (phase, step) and sent the signal ``kind`` there; the progress
    file says when it is held. The deadline only ends a hung child: it decides nothing."""
    progress_path, go = out.with_suffix(".progress.json"), out.with_suffix(".go")
    command = [sys.executable, str(module.SCRIPT), "mlp", str(run_dir), str(out), str(progress_path),
               "--hold", f"{hold[0]}:{hold[1]}", "--go", str(go)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command + (["--resume"] if resume else []), stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and not module._read_json(progress_path).get("held"):
                assert time.monotonic() < deadline, f"the run never reached {hold}: {log_path}"
                time.sleep(0.005)
            at_signal = module._read_json(progress_path)
            assert proc.poll() is None, f"the run ended before it reached {hold}: {log_path.read_text()[-600:]}"
            proc.send_signal(module.SIGNALS[kind])
            go.touch()
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    attempt = module.Attempt(proc.returncode, log_path.read_text(), module._read_json(progress_path), at_signal)
    attempt.checkpoints = module.complete_checkpoints(run_dir / "checkpoints")
    return attempt


def _held_trial(module, ref, kinds, rng, trial_dir):
    """Signal the run once per entry of ``kinds`` at a held point, resuming each time, then finish it."""
    trial_dir.mkdir(parents=True)
    run_dir, attempts = trial_dir / "run", []
    for kind in kinds:
        done = max(module.complete_checkpoints(run_dir / "checkpoints"), default=0)
        hold = _hold_point(rng, done, ref.total_steps)
        out = trial_dir / f"attempt-{len(attempts)}.safetensors"
        attempts.append((kind, _held_attempt(module, run_dir, out, kind, hold, resume=bool(attempts))))
    last_out = trial_dir / f"attempt-{len(attempts)}.safetensors"
    last = module.run_attempt("mlp", run_dir, last_out, resume=True)
    attempts.append((None, last))
    kills = [module._account(kind, killed, next(a for _, a in attempts[i + 1:] if a.resumed_from is not None),
                             ref.total_steps)
             for i, (kind, killed) in enumerate(attempts[:-1])]
    return kills, last, last_out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["KILL", "TERM", "INT"])
def test_signals_at_random_points_then_resume_end_bit_exact(chaos, kind):
    module, ref, workdir = chaos
    seed = ["KILL", "TERM", "INT"].index(kind)
    kills, last, last_out = _held_trial(module, ref, [kind] * KILLS_PER_TRIAL, random.Random(seed), workdir / kind)

    report = f"run dir {workdir / kind}: {[(k.phase, k.step_at_signal, k.problems) for k in kills]}"
    assert last.returncode == 0, f"the last attempt exited {last.returncode}: {last.output[-600:]}"
    assert [k.phase for k in kills if k.phase in ("startup/restore", module.AFTER)] == [], report
    params = module.load_params(last_out)
    differing = sorted(n for n, v in ref.params.items() if n not in params or not np.array_equal(params[n], v))
    assert not differing, f"parameters differ from the uninterrupted run: {differing}; {report}"
    rows = module.row_keys(workdir / kind / "run")
    assert sorted(k for k, n in rows.items() if n > max(ref.rows[k], 1)) == [], f"metrics.jsonl rows twice; {report}"
    assert sorted((ref.rows - rows).elements()) == [], f"metrics.jsonl rows missing; {report}"
    assert sorted(k for k in rows if k not in ref.rows) == [], f"rows not in the uninterrupted run; {report}"
    for kill in kills:
        assert not kill.problems, report
        assert kill.resumed_from is not None and kill.reached is not None, report
        if kind != "KILL":
            assert kill.lost == 0, f"{kind} at {kill.phase} lost {kill.lost} steps; {report}"
        else:  # SIGKILL loses the steps since the newest complete checkpoint, which the resume starts from
            assert kill.resumed_from == kill.checkpoint_on_disk, report
    assert json.loads(last_out.with_suffix(".safetensors.json").read_text())["step"] == ref.total_steps
