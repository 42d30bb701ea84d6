"""A tracker that cannot start says why and how to fix it, before training, and leaves the run directory empty."""

import os
import socket

import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.cli.main import main
from mlx_train.errors import ConfigError
from mlx_train.training import Trainer
from mlx_train.training.trackers import MLflowLogger, Tracker, WandbLogger


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed when the block ends: nothing listens there


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_online_without_login_is_refused_before_training(no_wandb_login):
    with pytest.raises(ConfigError, match=r"W&B has no API key for api\.wandb\.ai .*wandb login.*WANDB_MODE=offline"):
        WandbLogger(project_name="p")


def test_wandb_unwritable_directory(no_wandb_login, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("WANDB_DIR", str(blocker / "wandb"))
    with pytest.raises(ConfigError, match=r"W&B's directory \(WANDB_DIR\) .*a-file/wandb cannot be written.*"
                                          r"set WANDB_DIR"):
        WandbLogger()


def test_mlflow_file_store_is_refused_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    with pytest.raises(ConfigError, match=r"is a file store.*sqlite:///mlflow\.db.*MLFLOW_ALLOW_FILE_STORE=true"):
        MLflowLogger()


def test_mlflow_unreachable_server(monkeypatch):
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    with pytest.raises(ConfigError, match=rf"MLflow server at {url} cannot be reached .*mlflow server"):
        MLflowLogger()


class _Broken(Tracker):
    def open_run(self, trainer, run_id):
        raise RuntimeError("the service said no\nsecond line")


def test_any_failure_of_a_tracker_start_is_one_sentence(tmp_path):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8, run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^_Broken could not start its run \(RuntimeError: the service said no\); "
                                          r"check the tracker's settings"):
        trainer.train((x, y), epochs=1, callbacks=[_Broken()])


@pytest.mark.slow
def test_cli_tracker_error_writes_nothing_and_a_retry_works(no_wandb_login, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--epochs", "1", "--run-dir", "r", "--set", "report_to=[wandb]"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "W&B has no API key" in err and "unexpected error" not in err
    assert not os.path.exists("r/config.yaml") and not os.path.exists("r/checkpoints")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the fix: the same command now runs
    try:
        assert main(["train", "--epochs", "1", "--run-dir", "r", "--set", "report_to=[wandb]"]) == 0
    finally:
        import wandb

        wandb.teardown()  # W&B keeps its process-wide settings (this test's HOME, disabled mode) until then
