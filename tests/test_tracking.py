"""Experiment tracking (report_to): MLflow read back from a SQLite store and from a real server,
W&B read back from its offline run files, a resumed run continuing the same tracker run with each
step once, and the train / finetune command lines reaching the trackers."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError, TrainingInterrupted
from mlx_train.training import Callback, MLflowLogger, Trainer, WandbLogger
from mlx_train.training.trackers import wandb_records

mlflow = pytest.importorskip("mlflow")  # extras, in dev
wandb = pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402


class Grab(Callback):
    def __init__(self):
        self.train, self.val, self.epochs = [], [], []

    def on_report(self, trainer, logs):
        self.train.append(dict(logs))

    def on_validation_end(self, trainer, logs):
        self.val.append(dict(logs))

    def on_epoch_end(self, trainer, epoch, logs):
        self.epochs.append((trainer.step, dict(logs)))


class StopAt(Callback):
    """Ends a run at ``step``: with an exception (a crash), SIGTERM (the interrupt path) or SIGKILL."""

    def __init__(self, step, how):
        self.step, self.how = step, how

    def on_batch_end(self, trainer, step):
        if step == self.step:
            if self.how == "crash":
                raise RuntimeError("crash")
            os.kill(os.getpid(), signal.SIGKILL if self.how == "sigkill" else signal.SIGTERM)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _train(run_dir, callbacks=(), resume=None, epochs=3, **options):
    """8 steps per epoch, reports every 3 steps, validation every 4, a checkpoint every 6."""
    mx.random.seed(0)
    options = {"report_to": ["mlflow"], "project_name": "tests", "run_dir": str(run_dir),
               "checkpoint_dir": str(run_dir / "ckpt"), "checkpoint_every": "6 steps", "keep_last": 5,
               "report_every": "3 steps", "eval_every": "4 steps", "max_steps": 18, **options}
    trainer = Trainer(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)), optim.Adam(1e-2),
                      batch_size=16, config=TrainConfig(**options))
    x, y = _data()
    trainer.train((x, y), (x[:32], y[:32]), epochs=epochs, callbacks=list(callbacks), resume=resume)
    return trainer


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An MLflow SQLite store with its tables made (seconds of work, done once and copied)."""
    path = tmp_path_factory.mktemp("mlflow") / "empty.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(tmp_path, monkeypatch, empty_store):
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts go to ./mlruns
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return MlflowClient()


def _runs(client, experiment="tests"):
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return client.search_runs([experiment_id])


def _history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_mlflow_gets_params_every_metric_by_step_and_the_final_weights(tmp_path, mlflow_db):
    grab = Grab()
    trainer = _train(tmp_path / "a", [grab], run_name="first")
    (run,) = _runs(mlflow_db)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["report_to"] == '["mlflow"]'
    assert run.data.params["batch_size"] == "16"
    run_id = run.info.run_id
    assert _history(mlflow_db, run_id, "train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in grab.train]
    assert [s for s, _ in _history(mlflow_db, run_id, "train/loss")] == [3, 6, 8, 9, 12, 15, 16, 18]
    assert _history(mlflow_db, run_id, "val/loss") == [(r["step"], pytest.approx(r["val_loss"])) for r in grab.val]
    assert _history(mlflow_db, run_id, "val/accuracy")[-1][1] == pytest.approx(grab.val[-1]["val_accuracy"])
    assert _history(mlflow_db, run_id, "epoch/train_loss") == [(s, pytest.approx(logs["train_loss"]))
                                                               for s, logs in grab.epochs]
    assert "train/step" not in run.data.metrics and "train/epoch" not in run.data.metrics
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="model/model.safetensors",
                                                dst_path=str(tmp_path / "download"))
    weights = mx.load(local)
    assert weights["layers.0.weight"].tolist() == trainer.model.layers[0].weight.tolist()


@pytest.mark.parametrize("how", ["crash", "sigterm"])
def test_a_resumed_run_continues_the_mlflow_run_with_each_step_once(tmp_path, mlflow_db, how):
    whole = Grab()
    _train(tmp_path / "whole", [whole], project_name="whole")
    (expected,) = _runs(mlflow_db, "whole")
    # Stopped at step 10: the checkpoint of step 6 is the newest; steps 8 and 9 were logged after it.
    with pytest.raises(TrainingInterrupted if how == "sigterm" else RuntimeError):
        _train(tmp_path / "b", [StopAt(10, how)])
    (stopped,) = _runs(mlflow_db)
    assert stopped.info.status == ("KILLED" if how == "sigterm" else "FAILED")
    _train(tmp_path / "b", resume="auto" if how == "sigterm" else str(tmp_path / "b" / "ckpt" / "step-00000006"))
    (run,) = _runs(mlflow_db)  # the same run, continued
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    _assert_same_metrics(mlflow_db, run.info.run_id, expected.info.run_id)


def _assert_same_metrics(client, run_id, expected_id):
    for key in ("train/loss", "train/learning_rate", "val/loss", "val/accuracy", "epoch/train_loss"):
        got, want = _history(client, run_id, key), _history(client, expected_id, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # each step once
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key


@pytest.mark.slow
def test_a_sigkilled_run_resumes_into_the_same_mlflow_run_with_each_step_once(tmp_path, mlflow_db):
    _train(tmp_path / "whole", project_name="whole")
    (expected,) = _runs(mlflow_db, "whole")
    script = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); import test_tracking as t; "
              "t._train(pathlib.Path(sys.argv[2]), [t.StopAt(10, 'sigkill')])")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (killed,) = _runs(mlflow_db)
    assert killed.info.status == "RUNNING"  # nobody could close it
    assert [s for s, _ in _history(mlflow_db, killed.info.run_id, "train/loss")] == [3, 6, 8, 9]  # 8, 9: after step 6
    _train(tmp_path / "b", resume="auto")
    (run,) = _runs(mlflow_db)
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    _assert_same_metrics(mlflow_db, run.info.run_id, expected.info.run_id)


@pytest.mark.slow
def test_a_start_killed_before_its_first_checkpoint_leaves_no_mlflow_run_running(tmp_path, mlflow_db):
    """Killed at step 4, before the checkpoint of step 6 recorded the MLflow run: the next start in the run
    directory (a fresh run, as nothing was saved) ends that run as KILLED and opens its own."""
    script = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); import test_tracking as t; "
              "t._train(pathlib.Path(sys.argv[2]), [t.StopAt(4, 'sigkill')])")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (killed,) = _runs(mlflow_db)
    assert killed.info.status == "RUNNING" and not _complete_checkpoints(tmp_path / "b" / "ckpt")
    _train(tmp_path / "b", resume="auto")
    runs = {run.info.run_id: run.info.status for run in _runs(mlflow_db)}
    assert runs.pop(killed.info.run_id) == "KILLED"
    assert list(runs.values()) == ["FINISHED"]


def test_resuming_a_run_the_mlflow_store_does_not_hold_says_which_uri(tmp_path, mlflow_db, monkeypatch, empty_store):
    with pytest.raises(TrainingInterrupted):
        _train(tmp_path / "b", [StopAt(7, "sigterm")])
    shutil.copy(empty_store, tmp_path / "other.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other.db")
    with pytest.raises(ConfigError, match=r"MLflow run \w+ of the checkpoint is not at sqlite:///.*other.db.*"
                                          "resume with the MLFLOW_TRACKING_URI of the first run"):
        _train(tmp_path / "b", resume="auto")


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_main_process_reports(tmp_path, mlflow_db, rank):
    class Group:  # the process group of a distributed run, as seen by one rank
        def rank(self):
            return rank

        def size(self):
            return 1

    mx.random.seed(0)
    trainer = Trainer(nn.Linear(6, 2), optim.Adam(1e-2), batch_size=16,
                      config=TrainConfig(report_to=["mlflow"], project_name="tests", report_every="3 steps"))
    trainer.group = Group()
    x, y = _data()
    trainer.train((x, y), epochs=1, callbacks=[MLflowLogger(project_name="explicit")])
    for experiment in ("tests", "explicit"):  # from report_to, and passed as a callback
        found = mlflow_db.get_experiment_by_name(experiment)
        runs = mlflow_db.search_runs([found.experiment_id]) if found else []
        assert len(runs) == (1 if rank == 0 else 0), experiment


# ----- W&B, offline: its run files read back -------------------------------------------------


def _wandb_runs(root):
    """Per offline run directory under ``root``: (run id, config, {step: {key: value}}, artifact names)."""
    runs = []
    for directory in sorted(d for d in os.listdir(root / "wandb") if d.startswith("offline-run-")):
        (name,) = [f for f in os.listdir(root / "wandb" / directory) if f.endswith(".wandb")]
        run_id, config, steps, artifacts = None, {}, {}, []
        for record in wandb_records(str(root / "wandb" / directory / name)):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                steps[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "artifact":
                artifacts.append(record.artifact.name)
        runs.append((run_id, config, steps, artifacts))
    return runs


def _finished_wandb_runs(root):
    wandb.teardown()  # waits for W&B's service: run.finish() may return before the last block is written
    return _wandb_runs(root)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    def directory(name):
        path = tmp_path / name
        path.mkdir()
        monkeypatch.setenv("WANDB_DIR", str(path))
        return path

    return directory


def test_wandb_offline_run_holds_config_metrics_and_the_model(tmp_path, wandb_offline):
    root = wandb_offline("wandb-a")
    grab = Grab()
    _train(tmp_path / "a", [grab], report_to=["wandb"])
    ((run_id, config, steps, artifacts),) = _finished_wandb_runs(root)
    assert config["learning_rate"] == 0.001 and config["report_to"] == ["wandb"] and config["batch_size"] == 16
    assert {s: v["train/loss"] for s, v in steps.items() if "train/loss" in v} == \
        {r["step"]: pytest.approx(r["loss"]) for r in grab.train}
    assert {s: v["val/loss"] for s, v in steps.items() if "val/loss" in v} == \
        {r["step"]: pytest.approx(r["val_loss"]) for r in grab.val}
    assert {s: v["epoch/train_loss"] for s, v in steps.items() if "epoch/train_loss" in v} == \
        {s: pytest.approx(logs["train_loss"]) for s, logs in grab.epochs}
    assert artifacts == [f"model-{run_id}"]


def test_a_resumed_run_continues_the_wandb_run_with_each_step_once(tmp_path, wandb_offline):
    whole = wandb_offline("wandb-whole")
    _train(tmp_path / "whole", report_to=["wandb"])
    ((_, _, expected, _),) = _finished_wandb_runs(whole)
    root = wandb_offline("wandb-b")
    with pytest.raises(TrainingInterrupted):
        _train(tmp_path / "b", [StopAt(10, "sigterm")], report_to=["wandb"])
    _train(tmp_path / "b", resume="auto", report_to=["wandb"])
    first, resumed = _finished_wandb_runs(root)  # offline, W&B writes the continued run as a second file
    assert first[0] == resumed[0]  # the same run id
    assert not set(first[2]) & set(resumed[2])  # no step twice
    merged = {**first[2], **resumed[2]}
    assert sorted(merged) == sorted(expected)
    for step, values in expected.items():
        for key in ("train/loss", "train/learning_rate", "val/loss", "epoch/train_loss"):
            if key in values:
                assert merged[step][key] == pytest.approx(values[key], rel=1e-6), (step, key)


class PauseOnDisk(Callback):
    """Writes ``ready`` and waits to be killed once the newest checkpoint is written and the W&B file under
    WANDB_DIR holds a step logged after it (W&B writes its run file in blocks of 32 KiB, not at each log)."""

    def __init__(self, ready):
        self.ready, self.checkpoint = ready, None

    def on_checkpoint(self, trainer, path):
        self.checkpoint = (trainer.step, path)  # saved in the background: complete once renamed to path

    def on_report(self, trainer, logs):
        ((_, _, steps, _),) = _wandb_runs(pathlib.Path(os.environ["WANDB_DIR"]))
        if self.checkpoint and os.path.isdir(self.checkpoint[1]) and max(steps, default=0) > self.checkpoint[0]:
            pathlib.Path(self.ready).touch()
            while True:
                signal.pause()


class PauseBeforeFlush(Callback):
    """Writes ``ready`` and waits to be killed once a checkpoint is complete on disk while W&B's file under
    WANDB_DIR still ends before that checkpoint's step: the points in between reached metrics.jsonl only."""

    def __init__(self, ready):
        self.ready, self.checkpoint = ready, None

    def on_checkpoint(self, trainer, path):
        self.checkpoint = (trainer.step, path)

    def on_report(self, trainer, logs):
        if not (self.checkpoint and os.path.isdir(self.checkpoint[1])):
            return
        ((run_id, _, steps, _),) = _wandb_runs(pathlib.Path(os.environ["WANDB_DIR"]))
        if run_id is not None and max(steps, default=0) < self.checkpoint[0]:  # the run's id is on disk
            pathlib.Path(self.ready).touch()
            while True:
                signal.pause()


def _complete_checkpoints(directory):
    return [int(name[5:]) for name in os.listdir(directory) if name[5:].isdigit()]  # step-N, not step-N.tmp


def _children(pid):
    return [int(child) for task in os.listdir(f"/proc/{pid}/task")
            for child in open(f"/proc/{pid}/task/{task}/children").read().split()]


@pytest.mark.slow
@pytest.mark.parametrize("pause", ["after_flush", "before_flush"])
def test_a_sigkilled_run_resumes_into_the_same_wandb_run_with_each_step_once(tmp_path, wandb_offline, pause):
    """Killed once its W&B file holds steps after the newest checkpoint, or while it still ends before that
    checkpoint (the resumed run sends the points in between from metrics.jsonl); across the offline files of
    the run id, each (step, metric) of an uninterrupted run appears once, with its value."""
    long = {"report_to": ["wandb"], "report_every": "1 steps", "eval_every": "10 steps",
            "checkpoint_every": "20 steps", "max_steps": 400, "epochs": 50}
    whole = wandb_offline("wandb-whole")
    _train(tmp_path / "whole", **long)
    ((_, _, expected, _),) = _finished_wandb_runs(whole)
    root = wandb_offline("wandb-b")
    pauser = "PauseOnDisk" if pause == "after_flush" else "PauseBeforeFlush"
    script = ("import sys, pathlib, json, mlx_train; sys.path.insert(0, sys.argv[1]); import test_tracking as t; "
              f"t._train(pathlib.Path(sys.argv[2]), [t.{pauser}(sys.argv[3])], **json.loads(sys.argv[4]))")
    ready, log = tmp_path / "ready", tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own W&B service, as a new command
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(__file__), str(tmp_path / "b"),
                                 str(ready), json.dumps(long)], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    while not ready.exists():
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.1)
    service = _children(proc.pid)  # W&B's writer, which must be gone before the resume reads its file
    proc.kill()
    proc.wait()
    while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
              for pid in service):
        time.sleep(0.1)
    ((killed_id, _, killed, _),) = _wandb_runs(root)
    newest = max(_complete_checkpoints(tmp_path / "b" / "ckpt"))
    if pause == "after_flush":
        assert max(killed) > newest  # logged after the resume's start
    else:
        assert max(killed, default=0) < newest  # the file lacks points before the resume's start
    _train(tmp_path / "b", resume="auto", **long)
    runs = _finished_wandb_runs(root)
    assert len(runs) == 2 and {run[0] for run in runs} == {killed_id}
    logged = [(step, key, value) for run in runs for step, values in run[2].items() for key, value in values.items()]
    assert sorted((step, key) for step, key, _ in logged) == sorted(
        (step, key) for step, values in expected.items() for key in values)  # each once, none missing
    for step, key, value in logged:
        if key in ("train/loss", "train/learning_rate", "val/loss", "val/accuracy", "epoch/train_loss"):
            assert value == pytest.approx(expected[step][key], rel=1e-6), (step, key)


# ----- errors and configuration ----------------------------------------------------------------


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_the_pip_command(tracker, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)
    trainer = Trainer(nn.Linear(6, 2), optim.Adam(1e-2), batch_size=16, config=TrainConfig(report_to=[tracker]))
    x, y = _data()
    with pytest.raises(ConfigError, match=rf"needs the {tracker} package.*pip install 'mlx-train\[{tracker}\]'"):
        trainer.train((x, y), epochs=1)
    logger = {"wandb": WandbLogger, "mlflow": MLflowLogger}[tracker]
    with pytest.raises(ConfigError, match=rf"pip install 'mlx-train\[{tracker}\]'"):
        logger()


def test_the_train_command_names_the_pip_command_of_a_missing_tracker(tmp_path, monkeypatch, capsys):
    from mlx_train.cli.main import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(["train", "--max-steps", "2", "--run-dir", str(tmp_path / "run"), "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'mlx-train[wandb]'" in err


def test_report_to_tensorboard_writes_event_files_in_the_run_directory(tmp_path):
    _train(tmp_path / "a", report_to=["tensorboard"], max_steps=3)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "a" / "tensorboard"))


def test_report_to_from_yaml_and_flags(tmp_path):
    from mlx_train.cli.main import build_parser

    (tmp_path / "c.yaml").write_text("tracking:\n  report_to: [mlflow, wandb]\n  project_name: p\n")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml").report_to == ["mlflow", "wandb"]
    args = build_parser().parse_args(["train", "--report-to", "tensorboard,wandb", "--project-name", "p",
                                      "--run-name", "r"])
    assert (args.report_to, args.project_name, args.run_name) == (["tensorboard", "wandb"], "p", "r")
    assert TrainConfig(report_to="none").report_to == []
    with pytest.raises(ConfigError, match="unknown tracker 'swanlab'.*tensorboard, wandb, mlflow"):
        TrainConfig(report_to="wandb,swanlab")


def test_finetune_reads_mlx_lm_tracking_keys():
    from mlx_train.cli.main import build_parser
    from mlx_train.config import TrainConfig

    old = TrainConfig.from_dict({"wandb": "proj"}, finetune=True)
    assert (old.report_to, old.project_name) == (["wandb"], "proj")
    cfg = TrainConfig.from_dict({"report_to": "mlflow", "project_name": "p", "run_name": "r"}, finetune=True)
    assert (cfg.report_to, cfg.project_name, cfg.run_name) == (["mlflow"], "p", "r")
    args = build_parser("finetune").parse_args(["finetune", "--report-to", "wandb", "--project-name", "p",
                                                "--run-name", "r"])
    assert (args.report_to, args.project_name, args.run_name) == (["wandb"], "p", "r")


# ----- the command lines and a real MLflow server ------------------------------------------------


def test_train_command_reports_to_mlflow(tmp_path, mlflow_db, capsys):
    from mlx_train.cli.main import main

    code = main(["train", "--max-steps", "4", "--run-dir", str(tmp_path / "run"), "--report-to", "mlflow",
                 "--project-name", "cli", "--run-name", "digits-mlp", "--lr", "0.01", "--set", "report_every=2"])
    assert code == 0, capsys.readouterr().out
    (run,) = _runs(mlflow_db, "cli")
    assert run.info.run_name == "digits-mlp" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.01" and run.data.params["model"] == "mlp"
    assert "train/loss" in run.data.metrics


@pytest.mark.slow
def test_finetune_command_reports_to_mlflow(tmp_path, mlflow_db, capsys):
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    import llm_tiny

    from mlx_train.cli.main import main

    llm_tiny.write_model_dir(str(tmp_path / "base"), seed=5)
    llm_tiny.write_data(str(tmp_path / "data"), "completion", n_train=12, n_valid=4)
    code = main(["finetune", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--iters", "2",
                 "--num-layers", "1", "--batch-size", "4", "--learning-rate", "1e-3", "--steps-per-report", "1",
                 "--run-dir", str(tmp_path / "run"), "--report-to", "mlflow", "--project-name", "ft"])
    assert code == 0, capsys.readouterr().out
    (run,) = _runs(mlflow_db, "ft")
    assert run.info.run_name == "run" and run.data.params["learning_rate"] == "0.001"
    assert [s for s, _ in _history(mlflow_db, run.info.run_id, "train/loss")] == [1, 2]
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="model/model.safetensors",
                                                dst_path=str(tmp_path / "download"))
    adapters = mx.load(str(tmp_path / "run" / "adapters" / "adapters.safetensors"))
    assert sorted(mx.load(local)) == sorted(adapters)


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "server"
    root.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{root}/db", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited with code {server.returncode}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        yield MlflowClient(url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.mark.slow
def test_mlflow_server_gets_the_run(tmp_path, mlflow_server):
    grab = Grab()
    _train(tmp_path / "a", [grab], max_steps=8)
    (run,) = _runs(mlflow_server)
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "8"
    assert _history(mlflow_server, run.info.run_id, "train/loss") == [(r["step"], pytest.approx(r["loss"]))
                                                                      for r in grab.train]
    assert [f.path for f in mlflow_server.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
