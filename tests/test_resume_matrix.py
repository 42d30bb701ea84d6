"""Exact resume over model shapes, gradient accumulation and kill points.

Every case runs tests/scripts/resume_matrix_run.py three ways: uninterrupted (shared by the
cases of one model and accumulation), SIGKILLed at a deterministic point, and resumed with
``resume="auto"`` to the end. The resumed run must end with bit-identical parameters, the same
history, and a ``metrics.jsonl`` with exactly the uninterrupted run's rows (none missing, none
twice).

The kill points (8 steps per epoch, a checkpoint every 3 steps, validation every 4, a report
every 5) are chosen so the resume starts from different places:

- ``step``: killed at the end of step 26, resumed from the checkpoint of step 24, an epoch's last
  step (saved before that epoch's end-of-epoch work ran);
- ``save``: killed while the step-15 checkpoint is being written, resumed from step 12 (mid-epoch,
  a torn temporary directory left behind);
- ``val``: killed while validating after step 20, resumed from step 18 (mid-epoch).
"""

import collections
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.training import Callback

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "resume_matrix_run.py")
MODELS = ["mlp", "cnn", "transformer", "lora", "parameterless"]
ACCUMULATIONS = [1, 2]
# kill point -> (MLX_TRAIN_TEST_KILL, the step of the checkpoint the resume must start from)
KILLS = {"step": ("step:26", 24), "save": ("save:15", 12), "val": ("val:20", 18)}
TOTAL_STEPS = 32


def _script(model, accumulation, run_dir, out, kill=None, resume=False):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    env.pop("MLX_TRAIN_TEST_KILL", None)
    if kill:
        env["MLX_TRAIN_TEST_KILL"] = kill
    command = [sys.executable, SCRIPT, model, str(accumulation), str(run_dir), str(out)]
    return subprocess.run(command + (["--resume"] if resume else []), env=env, capture_output=True,
                          text=True, timeout=300)


def _tail(proc, lines=12):
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


def _finished(proc, out):
    assert proc.returncode == 0, f"run failed (exit {proc.returncode}):\n{_tail(proc)}"
    with open(f"{out}.json") as f:
        return mx.load(str(out)), json.load(f)


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _row_keys(run_dir):
    return collections.Counter((r["kind"], r["step"], r["epoch"]) for r in _rows(run_dir))


def _complete_steps(checkpoint_dir):
    return sorted(int(name.split("-")[1]) for name in os.listdir(checkpoint_dir)
                  if name.startswith("step-") and ".tmp" not in name
                  and os.path.exists(os.path.join(checkpoint_dir, name, "manifest.json")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(model, accumulation) -> (params, info, run_dir) of a run that was never killed."""
    runs = {}

    def get(model, accumulation):
        if (model, accumulation) not in runs:
            d = tmp_path_factory.mktemp(f"full-{model}-{accumulation}")
            proc = _script(model, accumulation, d / "run", d / "final.safetensors")
            params, info = _finished(proc, d / "final.safetensors")
            assert info["step"] == TOTAL_STEPS and info["start_step"] == 0
            runs[model, accumulation] = params, info, d / "run"
        return runs[model, accumulation]

    return get


def _kill_and_resume(tmp_path, model, accumulation, kill):
    """SIGKILL a run at ``kill`` (a KILLS key), check where it stopped, resume it to the end."""
    env_kill, resume_from = KILLS[kill]
    run_dir = tmp_path / "run"
    killed = _script(model, accumulation, run_dir, tmp_path / "unused.safetensors", kill=env_kill)
    assert killed.returncode == -signal.SIGKILL, (
        f"expected the run to SIGKILL itself at {env_kill}, it exited {killed.returncode}:\n{_tail(killed)}")
    assert _complete_steps(run_dir / "checkpoints")[-1] == resume_from
    if kill == "save":  # the torn save of step 15 is still there, to be skipped
        assert any(n.startswith("step-00000015.tmp") for n in os.listdir(run_dir / "checkpoints"))
    resumed = _script(model, accumulation, run_dir, tmp_path / "resumed.safetensors", resume=True)
    params, info = _finished(resumed, tmp_path / "resumed.safetensors")
    assert info["start_step"] == resume_from, "the run did not resume from the newest complete checkpoint"
    return (params, info), run_dir


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(KILLS), ids=[f"kill_{k}" for k in KILLS])
@pytest.mark.parametrize("accumulation", ACCUMULATIONS, ids=[f"accum{a}" for a in ACCUMULATIONS])
@pytest.mark.parametrize("model", MODELS)
def test_sigkill_then_resume_is_bit_exact(tmp_path, uninterrupted, model, accumulation, kill):
    full_params, full_info, full_dir = uninterrupted(model, accumulation)
    (params, info), run_dir = _kill_and_resume(tmp_path, model, accumulation, kill)

    assert info["step"] == full_info["step"]
    assert info["history"] == full_info["history"]
    assert sorted(params) == sorted(full_params)
    differ = [name for name, value in full_params.items()
              if not np.array_equal(np.array(params[name]), np.array(value))]
    assert not differ, f"parameters differ after resume: {differ}"
    expected, got = _row_keys(full_dir), _row_keys(run_dir)
    assert got == expected, (f"metrics.jsonl rows (kind, step, epoch): twice or more {sorted(got - expected)}, "
                             f"missing {sorted(expected - got)}")


@pytest.mark.slow
def test_first_report_after_resume_covers_the_same_window(tmp_path, uninterrupted):
    """Resumed from step 12 with reports every 5 steps: the step-15 report averages steps 11-15
    (as in the uninterrupted run), not only 13-15, and ``trained_samples`` counts on from the
    samples trained before the kill."""
    _, _, full_dir = uninterrupted("mlp", 1)
    _, run_dir = _kill_and_resume(tmp_path, "mlp", 1, "save")
    resume_from = KILLS["save"][1]

    def reports(directory):
        return {r["step"]: r for r in _rows(directory) if r["kind"] == "train" and r["step"] > resume_from}

    full, resumed = reports(full_dir), reports(run_dir)
    assert sorted(resumed) == sorted(full)
    for step in sorted(full):
        assert resumed[step]["trained_samples"] == full[step]["trained_samples"], f"trained_samples at step {step}"
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-6), f"loss reported at step {step}"
        assert resumed[step]["learning_rate"] == full[step]["learning_rate"]


def _small_trainer(run_dir):
    import mlx.optimizers as optim

    from mlx_train.builtin.models import MLP
    from mlx_train.training import Trainer

    mx.random.seed(0)
    model = MLP(16, hidden_dims=(16,), num_classes=4, dropout=0.2)
    return Trainer(model, optim.AdamW(1e-2), batch_size=8, seed=0, num_workers=0, report_every="2 steps",
                   checkpoint_every="1 epoch", run_dir=str(run_dir))


class _Reports(Callback):
    """Records (step, loss) of every training report."""

    def __init__(self):
        self.logs = []

    def on_report(self, trainer, logs):
        self.logs.append((logs["step"], logs["loss"]))


def test_resume_on_a_trainer_that_already_trained(tmp_path):
    """train() for one epoch, then train(resume=checkpoint) on the same Trainer object: the
    result matches a fresh Trainer resumed from the same checkpoint, with finite losses."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 16)).astype(np.float32)
    data = (x, x[:, :4].argmax(axis=1).astype(np.int32))
    val = (x[:16], data[1][:16])

    trainer = _small_trainer(tmp_path / "same")
    trainer.train(data, val, epochs=1, checkpoint_dir=str(tmp_path / "same" / "checkpoints"))
    shutil.copytree(tmp_path / "same" / "checkpoints", tmp_path / "fresh-checkpoints")
    checkpoint = str(tmp_path / "same" / "checkpoints" / "step-00000006")
    assert os.path.exists(os.path.join(checkpoint, "manifest.json"))

    same_reports, fresh_reports = _Reports(), _Reports()
    same_history = trainer.train(data, val, epochs=2, checkpoint_dir=str(tmp_path / "same" / "checkpoints"),
                                 callbacks=[same_reports], resume=checkpoint)
    fresh = _small_trainer(tmp_path / "fresh")
    fresh_history = fresh.train(data, val, epochs=2, checkpoint_dir=str(tmp_path / "fresh-checkpoints"),
                                callbacks=[fresh_reports],
                                resume=str(tmp_path / "fresh-checkpoints" / "step-00000006"))

    losses = [loss for _, loss in same_reports.logs] + same_history["train_loss"] + same_history["val_loss"]
    assert losses and all(math.isfinite(v) for v in losses), f"non-finite losses after resume: {same_reports.logs}"
    assert same_reports.logs == fresh_reports.logs
    assert same_history == fresh_history
    same_params = dict(tree_flatten(trainer.model.parameters()))
    for name, value in tree_flatten(fresh.model.parameters()):
        assert np.array_equal(np.array(same_params[name]), np.array(value)), f"{name} differs"
