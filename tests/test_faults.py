"""What real runs meet: preemption, NaN/Inf, a failed first step, out of memory in evaluation, a second
process on one run, failed and damaged checkpoints. Each test fails without the behaviour it names."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.checkpointing import CheckpointManager, CheckpointWarning
from mlx_train.checkpointing.lock import LOCK_FILE, RunLock
from mlx_train.errors import CheckpointError, DataError, NonFiniteError, OutOfMemoryError, TrainingInterrupted
from mlx_train.training import Callback, EarlyStopping, ModelCheckpoint, Trainer
from mlx_train.training.oom import CPU_MESSAGE

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "signal_run.py")


def _script(run_dir, out, *extra):
    return subprocess.run([sys.executable, SCRIPT, str(run_dir), str(out), *extra], capture_output=True, text=True,
                          timeout=300)


def _params(path):
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def _rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    done = _script(d / "run", d / "final.safetensors")
    assert done.returncode == 0, done.stderr
    return _params(d / "final.safetensors"), json.load(open(d / "final.safetensors.json")), _rows(d / "run")


# -- preemption -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sig, code, at", [("TERM", 143, 7), ("INT", 130, 12)])
def test_a_signal_saves_the_current_step_and_resume_is_bit_exact(tmp_path, uninterrupted, sig, code, at):
    full, full_info, full_rows = uninterrupted
    run = tmp_path / "run"
    stopped = _script(run, tmp_path / "x.safetensors", "--signal-at", str(at), "--signal", sig)
    assert stopped.returncode == code, stopped.stderr
    assert f"training stopped by SIG{sig} at step {at}: saved" in stopped.stdout
    steps = sorted(n for n in os.listdir(run / "checkpoints") if n.startswith("step-"))
    assert steps[-1] == f"step-{at:08d}"  # 0 steps lost: the signal's step was saved
    beat = json.load(open(next(run.glob("heartbeat-*.json"))))
    assert beat["state"] != "running"

    resumed = _script(run, tmp_path / "resumed.safetensors", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    params, info = _params(tmp_path / "resumed.safetensors"), json.load(open(tmp_path / "resumed.safetensors.json"))
    assert info == full_info
    assert params.keys() == full.keys() and all(np.array_equal(params[k], full[k]) for k in full)
    key = lambda r: (r.get("kind"), r.get("step"), r.get("epoch"))  # noqa: E731
    assert sorted(map(key, _rows(run))) == sorted(map(key, full_rows))  # no duplicated or missing rows


@pytest.mark.slow
def test_a_second_signal_stops_at_once(tmp_path):
    run = tmp_path / "run"
    stopped = _script(run, tmp_path / "x.safetensors", "--signal-at", "7", "--signal", "TERM", "--twice")
    assert stopped.returncode == 143
    assert "SIGTERM again: stopped at once at step 7" in stopped.stdout + stopped.stderr


def test_a_stop_at_once_lets_the_checkpoint_being_written_finish_and_says_so(tmp_path, monkeypatch, capsys):
    """Two SIGTERMs while the step-2 checkpoint is still being written (its writer held until the run has stopped):
    the run says it waits for that checkpoint, which is then complete, and stops with "stopped at once"."""
    from mlx_train.checkpointing import manager as manager_module

    release, paused = threading.Event(), threading.Event()

    def held(point, where):
        if point == "model.safetensors" and "step-00000002" in where:
            paused.set()
            release.wait(120)

    class StopTwice(Callback):
        def on_batch_end(self, trainer, step):
            if step == 3:
                assert paused.wait(120)
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)

        def on_exception(self, trainer, error):  # after the run has said it waits
            release.set()

    monkeypatch.setattr(manager_module, "_pause_point", held)
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, checkpoint_every="2 steps")
    with pytest.raises(TrainingInterrupted, match="SIGTERM again: stopped at once at step 3"):
        trainer.train(_nan_data(bad=()), epochs=1, checkpoint_dir=str(tmp_path), callbacks=[StopTwice()])
    out = capsys.readouterr().out
    assert f"waiting for the checkpoint being written, {tmp_path / 'step-00000002'}, to be complete" in out, out
    assert [info.step for info in CheckpointManager(str(tmp_path)).checkpoints()] == [2]


# -- NaN / Inf ------------------------------------------------------------------------------

def _nan_data(n=64, bad=(37,)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    x[list(bad)] = np.nan
    return x, rng.integers(0, 2, n).astype(np.int32)


def _mlp(seed=0):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_nan_in_the_inputs_raises_naming_step_batch_and_sample(tmp_path):
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, shuffle=False, num_workers=0, checkpoint_every="2 steps")
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient at step 5 \(epoch 1, batch 5 of 8\); the "
                                             r"batch's samples at positions 5 hold NaN/Inf"):
        trainer.train(_nan_data(), epochs=1, checkpoint_dir=str(tmp_path))
    saved = sorted(n for n in os.listdir(tmp_path) if n.startswith("step-"))
    assert saved[-1] == "step-00000004"  # nothing saved after the poisoned step


def test_nan_with_skip_keeps_training_on_finite_weights():
    model = _mlp()
    trainer = Trainer(model, optim.Adam(1e-2), batch_size=8, shuffle=False, num_workers=0, nonfinite="skip")
    history = trainer.train(_nan_data(), epochs=2)
    assert all(np.isfinite(np.array(v)).all() for _, v in tree_flatten(model.parameters()))
    assert all(np.isfinite(history["train_loss"]))


def test_nan_with_stop_stops_and_never_saves_or_prefers_non_finite(tmp_path):
    model = _mlp()
    best = tmp_path / "best.safetensors"
    stopper = EarlyStopping(monitor="val_loss", patience=1)
    trainer = Trainer(model, optim.SGD(0.1), batch_size=8, shuffle=False, num_workers=0, nonfinite="stop",
                      checkpoint_every="1 steps", keep_last=2)
    x, y = _nan_data(bad=(60,))
    trainer.train((x, y), (x[:8], y[:8]), epochs=3, checkpoint_dir=str(tmp_path / "ck"),
                  callbacks=[stopper, ModelCheckpoint(str(best), save_best_only=True)])
    assert trainer.step == 8 and trainer.stop_training
    saved = sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step-"))
    assert saved[-1] == "step-00000007"
    weights = CheckpointManager(str(tmp_path / "ck")).latest()
    assert weights.step == 7


def test_early_stopping_with_only_nan_metrics_does_not_crash():
    class Logs(Callback):
        pass

    stopper = EarlyStopping(monitor="val_loss", patience=1)
    trainer = type("T", (), {"stop_training": False, "log": lambda self, m: None, "model": _mlp()})()
    for epoch in range(3):
        stopper.on_epoch_end(trainer, epoch, {"val_loss": float("nan")})
    assert trainer.stop_training and stopper.best_epoch is None


# -- one failure does not poison the process --------------------------------------------------

@pytest.mark.parametrize("compile", [True, False])
def test_a_failed_first_step_leaves_the_process_usable(compile):
    x = np.zeros((16, 5), np.float32)  # the model expects 4 features
    with pytest.raises(DataError):
        Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, compile=compile).train(
            (x, np.zeros(16, np.int32)), epochs=1)
    mx.random.normal((2,)).tolist()  # MLX's random state is readable again
    model = _mlp()
    history = Trainer(model, optim.SGD(0.1), batch_size=8, num_workers=0, compile=compile).train(
        (np.zeros((16, 4), np.float32), np.zeros(16, np.int32)), epochs=1)
    assert np.isfinite(history["train_loss"][0])


def test_a_wrong_width_in_evaluation_is_a_data_error_and_the_model_stays_usable():
    model = _mlp()
    trainer = Trainer(model, optim.SGD(0.1), batch_size=8, num_workers=0)
    with pytest.raises(DataError):
        trainer.evaluate((np.zeros((8, 5), np.float32), np.zeros(8, np.int32)))
    assert [np.array(v).shape for _, v in tree_flatten(model.parameters())]
    assert np.isfinite(trainer.evaluate((np.zeros((8, 4), np.float32), np.zeros(8, np.int32)))["loss"])


# -- out of memory in evaluation --------------------------------------------------------------

class Hungry(nn.Module):
    """Runs out of memory in evaluation for batches larger than ``fits``."""

    def __init__(self, fits):
        super().__init__()
        self.fits = fits
        self.layer = nn.Linear(4, 2)

    def __call__(self, x):
        if not self.training and x.shape[0] > self.fits:
            raise RuntimeError(CPU_MESSAGE)
        return self.layer(x)


@pytest.mark.parametrize("compile", [True, False])
def test_evaluation_recovers_from_out_of_memory_with_the_same_result(compile, capsys):
    x, y = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32), np.arange(64) % 2
    reference = Trainer(Hungry(64), optim.SGD(0.1), eval_batch_size=32, compile=compile).evaluate((x, y))
    model = Hungry(8)
    model.update(reference and Hungry(64).parameters())
    mx.random.seed(0)
    a, b = Hungry(64), Hungry(8)
    b.update(a.parameters())
    expected = Trainer(a, optim.SGD(0.1), eval_batch_size=32, compile=compile).evaluate((x, y))
    trainer = Trainer(b, optim.SGD(0.1), eval_batch_size=32, compile=compile)
    got = trainer.evaluate((x, y))
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6) and got["accuracy"] == expected["accuracy"]
    assert "splitting each batch into 4 parts" in capsys.readouterr().out
    preds = trainer.predict(x)
    assert preds.shape == (64, 2)


def test_evaluation_that_never_fits_leaves_the_model_usable():
    model = Hungry(0)
    with pytest.raises(OutOfMemoryError, match="even with each batch split down to one sample.*usable"):
        Trainer(model, optim.SGD(0.1), eval_batch_size=4).evaluate((np.zeros((8, 4), np.float32), np.zeros(8)))
    assert np.array(model.layer.weight).shape == (2, 4)


# -- one process per run ----------------------------------------------------------------------

def test_a_second_process_on_the_run_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_path = tmp_path / "ck" / LOCK_FILE
        lock_path.parent.mkdir()
        import socket

        lock_path.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": 0}))
        trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0)
        with pytest.raises(CheckpointError, match=rf"is in use by another run: pid {holder.pid} on host"):
            trainer.train((np.zeros((16, 4), np.float32), np.zeros(16, np.int32)), epochs=1,
                          checkpoint_dir=str(tmp_path / "ck"))
        assert not any(n.startswith("step-") for n in os.listdir(tmp_path / "ck"))
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is taken over with a warning, and released at the end
    with pytest.warns(UserWarning, match="no longer running; taking the lock over"):
        Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0).train(
            (np.zeros((16, 4), np.float32), np.zeros(16, np.int32)), epochs=1, checkpoint_dir=str(tmp_path / "ck"))
    assert not (tmp_path / "ck" / LOCK_FILE).exists()


def test_a_read_only_or_file_directory_is_refused_before_training(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory|cannot be created"):
        RunLock(str(target)).acquire()
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="is not writable"):
            RunLock(str(ro)).acquire()


@pytest.fixture
def freeze(tmp_path):
    """A function that makes a directory refuse new and removed entries, also for root (who ignores chmod:
    ``chattr +i`` instead); undone after the test."""
    frozen = []
    root = os.geteuid() == 0
    if root:
        probe = tmp_path / "probe"
        probe.mkdir()
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
            pytest.skip("root ignores permissions and chattr +i is unavailable here: no unwritable directory")
        subprocess.run(["chattr", "-i", str(probe)], check=True)

    def make_unwritable(path):
        if root:
            subprocess.run(["chattr", "+i", str(path)], check=True)
        else:
            os.chmod(path, 0o500)
        frozen.append(path)

    def make_writable(path):
        if root:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            os.chmod(path, 0o700)
        frozen.remove(path)

    make_unwritable.undo = make_writable
    yield make_unwritable
    for path in list(frozen):
        make_writable(path)


class _FreezeAt(Callback):
    def __init__(self, freeze, path, step=None):
        self.freeze, self.path, self.step = freeze, path, step

    def on_batch_end(self, trainer, step):
        if step == self.step:
            self.freeze(self.path)

    def on_fit_end(self, trainer, history):
        if self.step is None:
            self.freeze(self.path)


def test_a_checkpoint_directory_that_becomes_unwritable_reports_the_save_error(tmp_path, freeze):
    checkpoints = tmp_path / "ck"
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, checkpoint_every="4 steps")
    with pytest.warns(UserWarning, match=r"could not remove the lock .*ck/\.mlx-train\.lock"):
        with pytest.raises(CheckpointError, match=r"saving checkpoint .*ck/step-00000004 failed \(PermissionError: "
                           r".*\); earlier checkpoints are untouched: .*ck is not writable \(any more\): fix its "
                           r"permissions"):
            trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1,
                          checkpoint_dir=str(checkpoints), callbacks=[_FreezeAt(freeze, checkpoints, step=2)])


def test_a_run_directory_that_becomes_unwritable_only_warns_at_the_end(tmp_path, freeze):
    run = tmp_path / "run"
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, run_dir=str(run))
    data = (np.zeros((64, 4), np.float32), np.zeros(64, np.int32))
    with pytest.warns(UserWarning, match=r"could not remove the lock .*run/\.mlx-train\.lock"):
        history = trainer.train(data, epochs=1, checkpoint_dir=str(tmp_path / "ck"),
                                callbacks=[_FreezeAt(freeze, run)])
    assert len(history["train_loss"]) == 1 and "loss" in trainer.evaluate(data)  # the run's result stands


class _FreezeRunAt(Callback):
    """Makes the run directory and every file in it unwritable after step ``step``; with ``thaw_at``, writable
    again after that step."""

    def __init__(self, freeze, run_dir, step, thaw_at=None):
        self.freeze, self.run_dir, self.step, self.thaw_at = freeze, run_dir, step, thaw_at

    def on_batch_end(self, trainer, step):
        paths = [self.run_dir / name for name in os.listdir(self.run_dir)] + [self.run_dir]
        if step == self.step:
            for path in paths:
                self.freeze(path)
        if step == self.thaw_at:
            for path in paths:
                self.freeze.undo(path)


def _run_file_warnings(caught):
    from mlx_train.rundir import RunFileWarning

    return [str(w.message) for w in caught if issubclass(w.category, RunFileWarning)]


def test_a_run_directory_that_becomes_unwritable_mid_run_warns_once_and_training_goes_on(tmp_path, freeze):
    run, checkpoints = tmp_path / "run", tmp_path / "ck"
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, run_dir=str(run), report_every="1 steps",
                      checkpoint_every="2 steps", keep_last=100)
    data = (np.zeros((64, 4), np.float32), np.zeros(64, np.int32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(data, data, epochs=2, checkpoint_dir=str(checkpoints),
                      callbacks=[_FreezeRunAt(freeze, run, step=3)])
        trainer.log("a message for train.log")
    assert trainer.step == 16  # the last step
    assert {f"step-{n:08d}" for n in (4, 8, 12, 16)} <= set(os.listdir(checkpoints))
    assert "loss" in trainer.evaluate(data)
    [message] = _run_file_warnings(caught)  # one warning, not one per step or per file
    assert re.fullmatch(rf"cannot write {run}/metrics\.jsonl \(PermissionError: .+\); training goes on, but {run}'s "
                        rf"metrics, train\.log and heartbeat are not updated while this lasts .*: fix the permissions "
                        rf"of {run}, or make room on its disk\. Reported once per run\.", message)
    assert [r["step"] for r in _rows(run) if r["kind"] == "train"] == [1, 2]  # frozen before the report of step 3


def test_metrics_files_come_back_whole_once_the_run_directory_is_writable_again(tmp_path, freeze):
    run = tmp_path / "run"
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, run_dir=str(run), report_every="1 steps")
    with pytest.warns(UserWarning, match="cannot write"):
        trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1,
                      callbacks=[_FreezeRunAt(freeze, run, step=2, thaw_at=5)])
    assert [r["step"] for r in _rows(run) if r["kind"] == "train"] == list(range(1, 9))
    import csv

    assert [row["step"] for row in csv.DictReader(open(run / "metrics.csv"))] == [str(n) for n in range(1, 9)] + ["8"]


_FREEZING_CLI = """
import os, subprocess, sys
from mlx_train.cli.main import main
from mlx_train.training import Callback, Trainer

run, train = sys.argv[1], Trainer.train

class FreezeRun(Callback):  # the run directory and its files become unwritable after step 2
    def on_batch_end(self, trainer, step):
        if step == 2:
            for path in [os.path.join(run, name) for name in os.listdir(run)] + [run]:
                subprocess.run(["chattr", "+i", path], check=True) if os.geteuid() == 0 else os.chmod(path, 0o500)

def train_and_freeze(self, *args, callbacks=(), **kwargs):
    return train(self, *args, callbacks=[*callbacks, FreezeRun()], **kwargs)

Trainer.train = train_and_freeze
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_the_cli_finishes_and_evaluates_when_its_run_directory_becomes_unwritable(tmp_path, freeze):
    run, checkpoints = tmp_path / "run", tmp_path / "ck"
    try:
        done = subprocess.run([sys.executable, "-c", _FREEZING_CLI, str(run), "train", "--run-dir", str(run),
                               "--set", f"checkpoint_dir={checkpoints}", "--max-steps", "6",
                               "--set", "model_options.hidden_dims=[16]", "--set", "report_every=1",
                               "--set", "checkpoint_every=2", "--set", "keep_last=10"],
                              capture_output=True, text=True, timeout=300)
    finally:  # the child froze them: writable again for the cleanup of tmp_path
        for path in [run, *run.iterdir()] if run.exists() else []:
            if os.geteuid() == 0:
                subprocess.run(["chattr", "-i", str(path)], check=True)
            else:
                os.chmod(path, 0o700)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "unexpected error" not in done.stderr
    assert "step 6 |" in done.stdout and re.search(r"^test: loss \d+\.\d+ \| accuracy", done.stdout, re.MULTILINE)
    assert {"step-00000004", "step-00000006"} <= set(os.listdir(checkpoints))
    assert done.stderr.count("mlx-train: warning: cannot write") == 1
    assert f"mlx-train: warning: cannot write {run}/metrics.jsonl (PermissionError: " in done.stderr


# -- failed and damaged checkpoints -----------------------------------------------------------

def test_a_failed_background_save_stops_training_at_once(tmp_path, monkeypatch):
    from mlx_train.checkpointing import storage as storage_module

    real = storage_module.LocalStore.write_safetensors
    state = {"calls": 0}

    def fail_once(self, rel, arrays):
        if "step-00000002" in rel:
            raise OSError(28, "No space left on device")
        return real(self, rel, arrays)

    class Count(Callback):
        def on_batch_end(self, trainer, step):
            state["calls"] = step

    monkeypatch.setattr(storage_module.LocalStore, "write_safetensors", fail_once)
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=4, num_workers=0, checkpoint_every="2 steps")
    with pytest.raises(CheckpointError, match="step-00000002 failed .*No space left on device.*The disk is full"):
        trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1,
                      checkpoint_dir=str(tmp_path), callbacks=[Count()])
    assert state["calls"] <= 4  # reported within the next steps, not at the next save or the end


def _trained_checkpoints(tmp_path, steps=4):
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, checkpoint_every="1 steps", keep_last=100,
                      max_steps=steps)
    trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1, checkpoint_dir=str(tmp_path))
    return sorted(p for p in os.listdir(tmp_path) if p.startswith("step-"))


def test_a_checkpoint_that_passes_its_checks_but_cannot_load_falls_back(tmp_path):
    names = _trained_checkpoints(tmp_path)
    newest = tmp_path / names[-1]
    # damage the newest: drop a tensor, then rewrite its manifest so every size and hash matches
    weights = mx.load(str(newest / "model.safetensors"))
    weights.pop(sorted(weights)[0])
    mx.save_safetensors(str(newest / "model.safetensors"), weights)
    manifest = json.load(open(newest / "manifest.json"))
    import hashlib

    data = (newest / "model.safetensors").read_bytes()
    manifest["files"]["model.safetensors"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    from mlx_train.checkpointing.format import manifest_bytes

    (newest / "manifest.json").write_bytes(manifest_bytes(manifest))  # resealed: the manifest itself stays true
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1, checkpoint_dir=str(tmp_path),
                      resume="auto")
    assert any("cannot be restored" in str(w.message) and "trying the previous one" in str(w.message) for w in caught)
    assert trainer.step == 4


def test_resume_refuses_when_every_checkpoint_is_damaged(tmp_path):
    names = _trained_checkpoints(tmp_path, steps=2)
    for name in names:
        os.remove(tmp_path / name / "optimizer.safetensors")
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError,
                           match="every checkpoint in .* is incomplete or damaged.*nothing was deleted"):
            trainer.train((np.zeros((64, 4), np.float32), np.zeros(64, np.int32)), epochs=1,
                          checkpoint_dir=str(tmp_path), resume="auto")
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == names


def test_resume_starts_over_when_no_checkpoint_was_ever_committed(tmp_path):
    names = _trained_checkpoints(tmp_path, steps=2)
    for name in names:
        os.remove(tmp_path / name / "manifest.json")  # what a kill during the first uploads leaves
    data = (np.zeros((64, 4), np.float32), np.zeros(64, np.int32))
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, max_steps=3)
    with pytest.warns(CheckpointWarning, match="is missing manifest.json"):
        trainer.train(data, epochs=1, checkpoint_dir=str(tmp_path), resume="auto")
    fresh = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, max_steps=3)
    fresh.train(data, epochs=1)
    for (name, a), (_, b) in zip(tree_flatten(trainer.model.parameters()), tree_flatten(fresh.model.parameters()),
                                 strict=True):
        assert mx.array_equal(a, b), name
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-00000003"]


# -- class labels ------------------------------------------------------------------------------

class MapDataset:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


_X = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
_LABEL_CASES = [  # (id, labels, message for an array dataset, message for a map-style dataset)
    ("one-based", np.arange(64) % 3 + 1,
     r"class label 3 \(sample 2 of the dataset\) is outside \[0, 3\): the model has 3 outputs.*shift 1-based",
     r"class label 3 \(row \d+ in this batch\) is outside \[0, 3\): the model has 3 outputs"),
    ("negative", np.arange(64) % 3 - 1, r"class label -1 \(sample 0 of the dataset\) is outside \[0, 3\)",
     r"class label -1 \(row \d+ in this batch\) is outside \[0, 3\)"),
    ("strings", np.array(["cat", "dog"] * 32), r"got text values \(dtype <U3, e.g. np.str_\('cat'\)\).*np.unique",
     r"field 1 of dataset sample \d+ holds str_ values, not numbers"),
]


@pytest.mark.parametrize("kind", ["arrays", "map"])
@pytest.mark.parametrize("labels, array_message, map_message", [c[1:] for c in _LABEL_CASES],
                         ids=[c[0] for c in _LABEL_CASES])
def test_labels_outside_the_classes_are_a_data_error_before_any_step(labels, array_message, map_message, kind):
    data, message = ((_X, labels), array_message) if kind == "arrays" else (MapDataset(_X, labels), map_message)
    model = nn.Linear(4, 3)
    before = np.array(model.weight)
    trainer = Trainer(model, optim.SGD(0.1), batch_size=8, num_workers=0)
    with pytest.raises(DataError, match=message):
        trainer.train(data, epochs=1)
    assert trainer.step == 0 and np.array_equal(np.array(model.weight), before)
    with pytest.raises(DataError, match=message):
        trainer.evaluate(data)


def test_the_label_check_does_not_change_training():
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    y = np.arange(64) % 3

    def run(loss_fn):
        mx.random.seed(0)
        model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3))
        Trainer(model, optim.SGD(0.1), loss_fn=loss_fn, batch_size=8, num_workers=0).train((x, y), epochs=2)
        return np.array(model.layers[1].weight)

    # the explicit cross-entropy skips the check (a user loss); the default runs it: same weights, same dropout
    assert np.array_equal(run(None), run(lambda p, t: nn.losses.cross_entropy(p, t)))


def test_a_torn_last_metrics_line_does_not_stop_a_resume(tmp_path):
    x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.int32)
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, run_dir=str(run_dir), max_steps=4,
            checkpoint_every="2 steps", report_every="1 steps").train((x, y), epochs=1, checkpoint_dir=str(ck))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a kill in the middle of a write
    trainer = Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0, run_dir=str(run_dir), max_steps=6,
                      report_every="1 steps")
    trainer.train((x, y), epochs=1, checkpoint_dir=str(ck), resume="auto")
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_the_lock_of_an_ended_but_unreaped_holder_is_taken_over(tmp_path):
    import socket
    import time as _time

    from mlx_train import processes

    holder = subprocess.Popen([sys.executable, "-c", "pass"])  # ends at once; not reaped until wait()
    try:
        deadline = _time.monotonic() + 30
        while processes.alive(holder.pid) and _time.monotonic() < deadline:
            _time.sleep(0.05)  # until it has exited (a zombie: its pid still exists)
        assert os.path.exists(f"/proc/{holder.pid}") or sys.platform != "linux"
        (tmp_path / "ck").mkdir()
        (tmp_path / "ck" / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                             "started": 0}))
        with pytest.warns(UserWarning, match="no longer running; taking the lock over"):
            Trainer(_mlp(), optim.SGD(0.1), batch_size=8, num_workers=0).train(
                (np.zeros((16, 4), np.float32), np.zeros(16, np.int32)), epochs=1, checkpoint_dir=str(tmp_path / "ck"))
    finally:
        holder.wait()
