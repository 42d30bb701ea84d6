"""Chaos trials (bench/chaos.py) on the built-in MLP: one trial per signal kind, two signals each
at random moments, every signal followed by ``resume="auto"``, then the run goes to the end.

Each trial must end bit-identical to an uninterrupted run, lose no step on SIGTERM/SIGINT (the
checkpoint the next attempt resumes from is the step the stopped attempt had reached), and leave
no row of ``metrics.jsonl`` twice or missing.
"""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"
KILLS_PER_TRIAL = 2


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
    return module, module.reference("mlp", workdir, timings=2), workdir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["KILL", "TERM", "INT"])
def test_random_signals_then_resume_end_bit_exact(chaos, kind):
    module, ref, workdir = chaos
    # Signals within the first half of each attempt's expected window, so that they land before the end.
    seed = ["KILL", "TERM", "INT"].index(kind)
    trial = module.run_trial("mlp", ref, [kind] * KILLS_PER_TRIAL, random.Random(seed), workdir / kind, spread=0.5)

    report = f"run dir {trial.run_dir}: {trial.problems}"
    # A signal that comes after the run has saved its last step ends the trial early; at least one lands.
    assert trial.kills, f"no signal landed before the run ended; {report}"
    in_training = [k for k in trial.kills if k.phase not in ("startup/restore", module.AFTER)]
    assert in_training, f"no signal landed while training: {[k.phase for k in trial.kills]}; {report}"
    assert trial.bit_exact, f"parameters differ from the uninterrupted run: {trial.differing}; {report}"
    assert not trial.duplicated, f"metrics.jsonl rows twice: {trial.duplicated}; {report}"
    assert not trial.missing, f"metrics.jsonl rows missing: {trial.missing}; {report}"
    assert not trial.problems, report
    for kill in trial.kills:
        assert kill.resumed_from is not None and kill.reached is not None, report
        if kind != "KILL":
            assert kill.lost == 0, f"{kind} at {kill.phase} lost {kill.lost} steps; {report}"
        else:  # SIGKILL loses the steps since the newest complete checkpoint, which the resume starts from
            assert kill.resumed_from == kill.checkpoint_on_disk, report
