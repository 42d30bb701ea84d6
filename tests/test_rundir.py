"""The run directory protocol: heartbeat schema, the staleness rule, the atomic writer, logging."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from mlx_train import rundir
from mlx_train.errors import ConfigError
from mlx_train.rundir import HeartbeatRecord, HeartbeatWriter


def test_heartbeat_record_round_trips_through_its_file(tmp_path):
    record = HeartbeatRecord(rank=1, state="validating", step=40, time=1000.5, world_size=2, pid=4242, host="mac2",
                             started=900.0, interval=0.5, steady=True, epoch=2, epochs=5, total_steps=200,
                             run_id="20250101-120000-1", attempt=1, waiting={"what": "all-reduce", "since": 999.0},
                             error=None, extra={"loss": 0.25, "timing": {"step_time": 0.01}})
    path = rundir.heartbeat_path(tmp_path, 1)
    rundir.atomic_write_json(path, record.to_json())
    assert path == tmp_path / "heartbeat-1.json"
    on_disk = json.loads(path.read_text())
    assert on_disk["state"] == "validating" and on_disk["loss"] == 0.25  # flat: progress beside the schema
    assert HeartbeatRecord.from_json(on_disk) == record
    assert rundir.read_heartbeats(tmp_path) == {1: record}
    assert record.get("loss") == 0.25 and record.get("step") == 40 and record.get("error", "none") == "none"


def test_heartbeat_state_is_an_enum_and_bad_files_are_skipped(tmp_path):
    with pytest.raises(ConfigError, match="heartbeat state must be one of starting, running, validating, "
                                          "checkpointing, finished, failed, interrupted, got 'exited'"):
        HeartbeatRecord(rank=0, state="exited")
    with pytest.raises(ConfigError, match="not a heartbeat"):
        HeartbeatRecord.from_json({"state": "running"})
    (tmp_path / "heartbeat-0.json").write_text('{"rank": 0, "state": "runn')  # torn
    (tmp_path / "heartbeat-1.json").write_text('{"rank": 1, "state": "running", "step": 3}')
    assert list(rundir.read_heartbeats(tmp_path)) == [1]


def test_one_staleness_rule_with_an_injected_clock():
    beat = HeartbeatRecord(rank=0, state="running", time=1000.0, interval=2.0)
    assert not rundir.is_stale(beat, now=1059.0, minimum=60)
    assert rundir.is_stale(beat, now=1061.0, minimum=60)
    assert rundir.stale_limit(beat, 1.0) == 6.0  # three write intervals at least
    slow = HeartbeatRecord(rank=0, state="running", time=1000.0, interval=2.0, extra={"steps_per_second": 0.04})
    assert rundir.stale_limit(slow, 60) == pytest.approx(125.0) and not rundir.is_stale(slow, 1100.0, 60)
    validating = HeartbeatRecord(rank=0, state="running", time=1000.0, extra={"val_time": 80.0})
    assert rundir.stale_limit(validating, 60) == 160.0
    # A background thread writes steadily: slow steps do not excuse its silence.
    steady = HeartbeatRecord(rank=0, state="running", time=1000.0, interval=0.5, steady=True,
                             extra={"steps_per_second": 0.04, "val_time": 80.0})
    assert rundir.stale_limit(steady, 3.0) == 3.0 and rundir.is_stale(steady, 1003.5, 3.0)
    for state in ("finished", "failed", "interrupted"):
        assert not rundir.is_stale(HeartbeatRecord(rank=0, state=state, time=0.0), now=1e9, minimum=1)


def test_the_callback_and_the_rank_monitor_share_one_heartbeat_file(tmp_path):
    progress = HeartbeatWriter.of(tmp_path, 0)
    assert HeartbeatWriter.of(str(tmp_path), 0) is progress  # one writer per file in a process
    progress.update(state="running", step=5, loss=1.5)
    HeartbeatWriter.of(tmp_path, 0).update(waiting={"what": "gradient all-reduce", "since": 1.0}, steady=True)
    (record,) = rundir.read_heartbeats(tmp_path).values()
    assert (record.state, record.step, record.extra["loss"], record.waiting["what"], record.steady) == \
        ("running", 5, 1.5, "gradient all-reduce", True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heartbeat-0.json"]  # no temporary files left
    with pytest.raises(ConfigError, match="got 'done'"):
        progress.update(state="done")


def test_atomic_write_replaces_the_whole_file(tmp_path):
    path = tmp_path / "config.yaml"
    rundir.atomic_write(path, "old: 1\n")
    rundir.atomic_write(path, b"new: 2\n")
    assert path.read_text() == "new: 2\n" and os.listdir(tmp_path) == ["config.yaml"]


def test_a_failure_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "heartbeat-0.json"
    rundir.atomic_write_json(path, {"rank": 0, "step": 1})

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        rundir.atomic_write_json(path, {"rank": 0, "step": 2})
    assert json.loads(path.read_text()) == {"rank": 0, "step": 1}
    assert os.listdir(tmp_path) == ["heartbeat-0.json"]  # the temporary file was removed


def test_a_process_killed_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "metrics.csv"
    rundir.atomic_write(path, "old contents\n")
    # The child dies (no cleanup, like SIGKILL) after writing half of the new data, before the rename.
    script = textwrap.dedent(f"""
        import os
        from mlx_train import rundir
        os.fsync = lambda fd: os._exit(9)
        rundir.atomic_write({str(path)!r}, "new contents that never land\\n" * 1000)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 9, done.stderr
    assert path.read_text() == "old contents\n"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "metrics.csv"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".metrics.csv.") and leftovers[0].endswith(".tmp")


def test_a_config_write_killed_before_its_rename_leaves_nothing_for_the_next_one(tmp_path):
    """A kill between the temporary file and the rename leaves .config.yaml.*.tmp; the run's next config write
    (under the run lock, the file's only writer) removes it."""
    from mlx_train.config import TrainConfig

    script = textwrap.dedent(f"""
        import os
        from mlx_train import rundir
        from mlx_train.config import TrainConfig
        os.fsync = lambda fd: os._exit(9)
        rundir.write_config({str(tmp_path)!r}, TrainConfig())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 9, done.stderr
    assert [p.name for p in tmp_path.glob(".config.yaml.*.tmp")]  # the kill's leftover
    rundir.write_config(tmp_path, TrainConfig())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_log_message_goes_through_logging_to_the_console_and_the_run_log(tmp_path, capsys):
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    collect = Collect()
    logger = logging.getLogger("mlx_train")
    logger.addHandler(collect)
    try:
        rundir.log_message(tmp_path / "a", "resumed from step 200")
        rundir.log_message(tmp_path / "b", "a message of run b")
        rundir.log_message(None, "no run directory")
    finally:
        logger.removeHandler(collect)
    assert records == ["resumed from step 200", "a message of run b", "no run directory"]
    assert capsys.readouterr().out.splitlines() == records
    log_a, log_b = (tmp_path / "a" / "train.log").read_text(), (tmp_path / "b" / "train.log").read_text()
    assert log_a.endswith(" resumed from step 200\n") and "run b" not in log_a
    assert log_b.endswith(" a message of run b\n") and "no run directory" not in log_b


def test_choose_run_dir_and_run_dir_of(tmp_path):
    assert rundir.run_dir_of(tmp_path / "distributed") == tmp_path
    assert rundir.run_dir_of(tmp_path) == tmp_path
    assert rundir.rank_log_path(tmp_path, 3) == tmp_path / "logs" / "rank-3.log"


# ---- a new run into a directory that holds a run (the Python API) ----
def _trainer(**config):
    import mlx.nn as nn

    from mlx_train.config import TrainConfig
    from mlx_train.training import Trainer

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return Trainer(model, config=TrainConfig(epochs=1, batch_size=4, num_workers=0, compile=False, **config))


def _data():
    import numpy as np

    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    return x, np.arange(16, dtype=np.int32) % 3


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_train_into_another_runs_checkpoints_is_refused_unless_resume_or_overwrite(tmp_path):
    checkpoints = tmp_path / "ckpt"
    _trainer().train(_data(), checkpoint_dir=str(checkpoints))
    before = _files(checkpoints)
    with pytest.raises(ConfigError, match=r"ckpt already holds a run \(checkpoints\).*resume='auto'.*"
                                          r"overwrite=True.*ckpt\.old-<date>-<time>.*Nothing was changed"):
        _trainer().train(_data(), checkpoint_dir=str(checkpoints))
    assert _files(checkpoints) == before
    _trainer().train(_data(), checkpoint_dir=str(checkpoints), resume="auto")  # continuing it is fine
    _trainer().train(_data(), checkpoint_dir=str(checkpoints), overwrite=True)
    (moved,) = tmp_path.glob("ckpt.old-*")
    assert {name for name in _files(moved) if name.startswith("step-")} >= {n for n in before if n.startswith("step-")}
    with pytest.raises(ConfigError, match="overwrite=True starts over and resume='auto' continues"):
        _trainer().train(_data(), checkpoint_dir=str(checkpoints), resume="auto", overwrite=True)


def test_fit_into_a_run_dir_that_holds_a_run_is_refused(tmp_path):
    from mlx_train.data import DataLoader

    def fit(**options):
        loader = DataLoader(_data(), batch_size=4)  # a loader keeps its epoch: a new one per run
        _trainer(run_dir=str(run)).fit(loader, loader, save_best=True, **options)

    run = tmp_path / "run"
    fit()
    before = _files(run)
    with pytest.raises(ConfigError, match=r"run already holds a run \(metrics\.jsonl, config\.yaml\)"):
        fit()
    assert _files(run) == before
    fit(overwrite=True)
    (moved,) = tmp_path.glob("run.old-*")
    assert _files(moved) == before and (run / "best_model.safetensors").is_file()


def test_fit_save_best_without_run_dir_does_not_replace_a_file_of_before(tmp_path, monkeypatch):
    from mlx_train.data import DataLoader

    def fit(**options):
        loader = DataLoader(_data(), batch_size=4)
        _trainer().fit(loader, loader, save_best=True, **options)

    monkeypatch.chdir(tmp_path)
    fit()  # the place is free: written there, as documented
    (tmp_path / "best_model.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(ConfigError, match=r"would replace .*best_model\.safetensors, written before this run; "
                                          r"give the run a place \(Trainer\(\.\.\., run_dir=\.\.\.\)\)"):
        fit()
    assert (tmp_path / "best_model.safetensors").read_bytes() == b"someone else's weights"
    fit(overwrite=True)
    assert (tmp_path / "best_model.safetensors").read_bytes() != b"someone else's weights"


def test_move_aside_picks_a_free_name_and_keeps_everything(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("{}\n")
    first = rundir.move_aside(tmp_path / "a")
    (tmp_path / "a").mkdir()
    second = rundir.move_aside(tmp_path / "a")
    assert first != second and first.name.startswith("a.old-") and second.name.startswith("a.old-")
    assert (first / "metrics.jsonl").read_text() == "{}\n" and not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------- the run-directory policy
def test_checkpoints_go_to_checkpoint_dir_else_run_dir_checkpoints():
    from mlx_train.run_directory import RunDirectory

    assert rundir.checkpoints_path("runs/a") == os.path.join("runs/a", "checkpoints")
    assert rundir.checkpoints_path("runs/a", "elsewhere") == "elsewhere"
    assert rundir.checkpoints_path(None) is None
    assert RunDirectory.of("runs/a").checkpoint_dir == os.path.join("runs/a", "checkpoints")
    assert RunDirectory.of("runs/a", "s3://b/c").checkpoint_dir == "s3://b/c"
    assert RunDirectory("runs/a").checkpoint_dir is None and RunDirectory("runs/a").checkpoints is None


def test_the_policy_refuses_a_new_run_over_a_run_and_moves_it_aside_with_overwrite(tmp_path):
    from mlx_train.run_directory import RunDirectory

    run_dir = tmp_path / "a"
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / "manifest.json").write_text("{}")  # committed, damaged
    (run_dir / "metrics.jsonl").write_text("{}\n")
    run = RunDirectory.of(run_dir)
    assert run.previous_runs() == [(str(run_dir), ["metrics.jsonl", "checkpoints"])]
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, checkpoints\).*Nothing was changed"):
        run.make_room(overwrite=False, log=print)
    with pytest.raises(ConfigError, match="already holds a run"):
        run.refuse_fresh_start()
    assert (run_dir / "metrics.jsonl").is_file()
    said: list[str] = []
    RunDirectory.of(run_dir).make_room(overwrite=True, log=said.append)
    assert not run_dir.exists() and said and said[0].startswith(f"moved the previous run in {run_dir} aside to ")
    RunDirectory.of(run_dir).refuse_fresh_start()  # nothing there now


def test_the_policy_resolves_resumes(tmp_path):
    from mlx_train.errors import CheckpointError
    from mlx_train.run_directory import RunDirectory

    said: list[str] = []
    run = RunDirectory.of(tmp_path / "a")
    assert run.resume_candidates("auto", said.append) == [] and run.resolve("auto") is None
    assert said == [f"no checkpoint in {tmp_path / 'a' / 'checkpoints'} yet; starting from scratch"]
    assert run.resume_candidates(None, said.append) == []
    with pytest.raises(ConfigError, match="resume 'auto' looks in RUN_DIR/checkpoints: pass a run directory"):
        RunDirectory(None).resolve("auto")
    with pytest.raises(ConfigError, match="resume='auto' needs a checkpoint_dir"):
        RunDirectory(None).resume_candidates("auto", said.append)
    (tmp_path / "a" / "checkpoints" / "step-00000003").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "step-00000003" / "manifest.json").write_text("{}")  # committed, damaged
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="every checkpoint in .* is incomplete"):
        RunDirectory.of(tmp_path / "a").resume_candidates("auto", said.append)
    assert not RunDirectory.of(tmp_path / "b").has_checkpoint_or_config()
    assert RunDirectory.of(tmp_path / "a").has_checkpoint_or_config()


def test_one_run_per_directory(tmp_path):
    from mlx_train.errors import CheckpointError
    from mlx_train.run_directory import RunDirectory

    run = RunDirectory.of(tmp_path / "a")
    with run.locks(main=True):
        with pytest.raises(CheckpointError), RunDirectory.of(tmp_path / "a").locks(main=True):
            pass
        with RunDirectory.of(tmp_path / "a").locks(main=False):  # the other ranks take no lock
            pass
    with RunDirectory.of(tmp_path / "a").locks(main=True):
        pass
