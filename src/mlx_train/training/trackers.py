"""Experiment trackers: Weights & Biases and MLflow, beside TensorBoard (``report_to`` in TrainConfig).

Each tracker gets the config as parameters when training starts, every report, validation and
epoch summary as metrics against the optimizer step (the names of ``TensorBoardLogger``:
``train/loss``, ``val/loss``, ``epoch/train_loss``), and the final weights (``model.safetensors``:
the trainable parameters, i.e. the adapters of a LoRA fine-tune) as an artifact. Only the main
process reports. The tracker's run id is saved with each checkpoint, so a resumed run continues
the same tracker run; steps that tracker already holds (logged by the interrupted run after its
last checkpoint) are not logged again.

Example::

    trainer = Trainer(model, config=TrainConfig(report_to=["mlflow"], project_name="digits"))
    trainer.train(data, callbacks=[WandbLogger(project_name="digits")])   # or as a callback
"""

from __future__ import annotations

import glob
import importlib
import json
import netrc
import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_train import rundir
from mlx_train.errors import ConfigError, MLXTrainError, TrainingInterrupted
from mlx_train.rundir import METRICS_FILE
from mlx_train.training.callbacks import Callback
from mlx_train.training.state import saved_parameters
from mlx_train.training.tensorboard import SKIPPED, TensorBoardLogger

if TYPE_CHECKING:
    from mlx_train.config import TrainConfig
    from mlx_train.training.trainer import Trainer

MODEL_FILE = "model.safetensors"


def _require(package: str, tracker: str, extra: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ConfigError(f"{tracker} needs the {extra} package, which is not installed ({error}): "
                          f"pip install 'mlx-train[{extra}]'") from None


def metric_values(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """``{"prefix/name": value}`` for the numeric entries of ``values`` (step, epoch and counters left out).

    Example: ``metric_values("val", {"loss": 0.5, "step": 10})  # {"val/loss": 0.5}``
    """
    return {f"{prefix}/{name}": float(value) for name, value in values.items()
            if name not in SKIPPED and isinstance(value, (int, float)) and not isinstance(value, bool)}


class Tracker(Callback):
    """What W&B and MLflow share: when to open, log to and close a tracker run, and its id in checkpoints.

    A subclass implements ``open_run``, ``log_params``, ``log_metrics``, ``log_model`` and ``close_run``.
    """

    def __init__(self, project_name: str | None = None, run_name: str | None = None) -> None:
        self.project_name, self.run_name = project_name, run_name
        self.run_id: str | None = None
        #: Per metric, the last step the tracker run holds: a resumed run does not log those steps again.
        self.logged_until: dict[str, int] = {}
        self._open = False

    # -- what a tracker implements ----------------------------------------------------------------

    def open_run(self, trainer: Trainer, run_id: str | None) -> str:
        """Start a tracker run (or continue ``run_id``); returns its id."""
        raise NotImplementedError

    def log_params(self, params: dict[str, Any]) -> None:
        """Record the configuration."""
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at an optimizer step."""
        raise NotImplementedError

    def log_model(self, path: str) -> None:
        """Store the final weights file as an artifact."""
        raise NotImplementedError

    def close_run(self, status: str) -> None:
        """End the tracker run: ``status`` is ``finished``, ``failed`` or ``interrupted``."""
        raise NotImplementedError

    def advice(self, error: BaseException) -> str:
        """How to fix a failed start of the tracker run (the end of the error's sentence)."""
        return "check the tracker's settings, or leave it out of report_to"

    def close_orphan(self, run_id: str) -> None:
        """End the tracker run ``run_id`` that an earlier start in this run directory left open (killed before its
        first checkpoint recorded the id, so this start does not continue it). Nothing by default."""

    def replays_missing(self) -> bool:
        """Whether a resumed run sends the points up to its checkpoint that the tracker run does not hold (a kill
        can cut them off before the tracker stored them), read from the run directory's metrics.jsonl."""
        return True

    # -- events -----------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer) -> None:
        if not getattr(trainer, "is_main", True):
            return
        config = trainer.config
        self.project_name = self.project_name or config.project_name
        self.run_name = self.run_name or config.run_name or (os.path.basename(os.path.normpath(config.run_dir))
                                                              if config.run_dir else None)
        # A fresh start (step 0) never reuses a run; a resume continues the checkpoint's run.
        continued = self.run_id if trainer.step > 0 else None
        started = os.path.join(config.run_dir, TRACKER_RUNS_FILE) if config.run_dir else None
        try:
            if continued is None and started:
                self._close_orphan(started)
            self.run_id = self.open_run(trainer, continued)
            self._open = True
            if started:  # before any checkpoint holds the id: a start killed now can still be closed
                _record_run(started, type(self).__name__, self.run_id)
            self.log_params(config.to_dict())
        except MLXTrainError:
            raise
        except Exception as error:  # noqa: BLE001  # the tracker library's own errors: one sentence for all
            name = type(self).__name__
            raise ConfigError(f"{name} could not start its run ({type(error).__name__}: {_first_line(error)}); "
                              f"{self.advice(error)}") from error
        if continued and config.run_dir and self.replays_missing():
            self._replay(os.path.join(config.run_dir, METRICS_FILE), trainer.step)
        trainer.log(f"{type(self).__name__}: {'continuing' if continued else 'started'} run {self.run_id}")

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self._log(metric_values("train", logs), trainer.step)

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self._log(metric_values("val", {k.removeprefix("val_"): v for k, v in logs.items()}), trainer.step)

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        self._log(metric_values("epoch", logs), trainer.step)

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        if not self._open:
            return
        with tempfile.TemporaryDirectory(prefix="mlx-train-model-") as directory:
            path = os.path.join(directory, MODEL_FILE)
            mx.save_safetensors(path, saved_parameters(trainer.model))
            self.log_model(path)
        self._close("finished")

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        if self._open:
            self._close("interrupted" if isinstance(error, (TrainingInterrupted, KeyboardInterrupt)) else "failed")

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    # -- helpers ----------------------------------------------------------------------------------

    def _close_orphan(self, path: str) -> None:
        previous = rundir.read_json(path)
        run_id = previous.get(type(self).__name__) if isinstance(previous, dict) else None
        if isinstance(run_id, str):
            self.close_orphan(run_id)

    def _replay(self, path: str, until: int) -> None:
        """Log the rows of ``metrics.jsonl`` up to step ``until`` that the tracker run lacks (``logged_until``)."""
        if not os.path.exists(path):
            return
        with open(path) as file:
            for line in file:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill
                step, kind = row.get("step"), row.get("kind")
                if not isinstance(step, int) or step > until or kind not in ("train", "val", "epoch"):
                    continue
                values = {k: v for k, v in row.items() if k not in ("kind", "time")}
                if kind == "val":
                    values = {k.removeprefix("val_"): v for k, v in values.items()}
                self._log(metric_values(kind, values), step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        new = {k: v for k, v in metrics.items() if step > self.logged_until.get(k, -1)}
        if self._open and new:
            self.log_metrics(new, step)

    def _close(self, status: str) -> None:
        self._open = False
        self.close_run(status)


#: The run directory's record of the tracker runs its starts opened ({"MLflowLogger": run id, ...}).
TRACKER_RUNS_FILE = "tracker-runs.json"


def _record_run(path: str, tracker: str, run_id: str) -> None:
    record = rundir.read_json(path)
    record = record if isinstance(record, dict) else {}
    record[tracker] = run_id
    rundir.atomic_write_json(path, record)


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "no message"


def _writable_directory(directory: str, what: str, fix: str) -> None:
    """Make ``directory`` (with its parents) and check that files can be written there, or say how to fix it."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".mlx-train-check-"):
            pass
    except OSError as error:
        raise ConfigError(f"{what} {directory} cannot be written ({error.strerror or error}): {fix}") from None


def _reachable(url: str, timeout: float = 5.0) -> str | None:
    """None when a TCP connection to ``url``'s host and port opens within ``timeout`` seconds, else why not."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except OSError as error:
        return error.strerror or str(error)


class MLflowLogger(Tracker):
    """Reports to MLflow (``pip install 'mlx-train[mlflow]'``) at ``MLFLOW_TRACKING_URI`` (a server,
    or ``sqlite:///mlflow.db``, MLflow's default), in the experiment ``project_name``.

    Example::

        trainer.train(data, callbacks=[MLflowLogger(project_name="digits", run_name="lr-1e-3")])
    """

    def __init__(self, project_name: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None) -> None:
        self._mlflow = _require("mlflow", "MLflowLogger (report_to: mlflow)", "mlflow")
        super().__init__(project_name, run_name)
        self.tracking_uri = tracking_uri
        self._client: Any = None
        self._params: dict[str, str] = {}  # the parameters the run holds
        self._check_store()

    def _check_store(self) -> None:
        """Before training starts: MLflow's file store (refused by MLflow 3 unless allowed) and an unreachable
        server are found here, not after the model has loaded."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
        scheme = uri.split(":", 1)[0].lower() if "://" in uri or uri.startswith("file:") else ("file" if uri else "")
        if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
            raise ConfigError(f"MLflow tracking URI {uri!r} is a file store, which MLflow 3 no longer writes to: set "
                              "MLFLOW_TRACKING_URI=sqlite:///mlflow.db (a local database file) or the address of "
                              "an MLflow server, or MLFLOW_ALLOW_FILE_STORE=true to use the file store anyway")
        if scheme in ("http", "https"):
            problem = _reachable(uri)
            if problem is not None:
                raise ConfigError(f"the MLflow server at {uri} cannot be reached ({problem}): start it (mlflow "
                                  "server --host 127.0.0.1 --port 5000), correct MLFLOW_TRACKING_URI, or set it to "
                                  "sqlite:///mlflow.db to track into a local file")

    def advice(self, error: BaseException) -> str:
        uri = self._client.tracking_uri if self._client is not None else self.tracking_uri
        return (f"check that the tracking URI {uri or os.environ.get('MLFLOW_TRACKING_URI') or '(default)'} is an "
                "MLflow server that answers or a database such as sqlite:///mlflow.db, and that it is writable")

    def open_run(self, trainer: Trainer, run_id: str | None) -> str:
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(self.tracking_uri)
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except self._mlflow.exceptions.MlflowException as error:
                raise ConfigError(f"MLflow run {run_id} of the checkpoint is not at {client.tracking_uri} "
                                  f"({error}): resume with the MLFLOW_TRACKING_URI of the first run") from None
            client.update_run(run_id, status="RUNNING")
            self._params = run.data.params
            self.logged_until = {key: max(m.step for m in client.get_metric_history(run_id, key))
                                 for key in run.data.metrics}
            return run_id
        name = self.project_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        self._params, self.logged_until = {}, {}
        return str(client.create_run(experiment_id, run_name=self.run_name).info.run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow refuses to change a parameter: a resumed run keeps those of its start, and adds new ones.
        new = [Param(k, _param_text(v)) for k, v in params.items() if k not in self._params]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 parameters per batch
            self._client.log_batch(self.run_id, params=new[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_model(self, path: str) -> None:
        self._client.log_artifact(self.run_id, path, artifact_path="model")

    def close_run(self, status: str) -> None:
        mlflow_status = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}[status]
        self._client.set_terminated(self.run_id, mlflow_status)

    def close_orphan(self, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        try:
            run = client.get_run(run_id)
        except self._mlflow.exceptions.MlflowException:
            return  # another store, or deleted: nothing left open here
        if run.info.status == "RUNNING":
            client.set_terminated(run_id, "KILLED")


class WandbLogger(Tracker):
    """Reports to Weights & Biases (``pip install 'mlx-train[wandb]'``); ``WANDB_MODE=offline`` writes the
    run locally for ``wandb sync``. Its files go to ``WANDB_DIR``, else to the run directory.

    Online, W&B itself ignores steps below those a resumed run already holds. Offline, W&B cannot
    continue a run: a resumed run is a second offline run with the same id, which leaves out the steps
    the earlier offline runs of that id hold (read from their ``.wandb`` files).

    Example::

        trainer.train(data, callbacks=[WandbLogger(project_name="digits")])
    """

    def __init__(self, project_name: str | None = None, run_name: str | None = None) -> None:
        self._wandb = _require("wandb", "WandbLogger (report_to: wandb)", "wandb")
        super().__init__(project_name, run_name)
        self._run: Any = None
        self._check_settings()

    @staticmethod
    def _check_settings() -> None:
        """Before training starts: WANDB_DIR must be writable, and online W&B needs an API key (``wandb login``
        writes it to ~/.netrc)."""
        if os.environ.get("WANDB_DIR"):
            _writable_directory(os.environ["WANDB_DIR"], "W&B's directory (WANDB_DIR)",
                                "set WANDB_DIR to a folder you can write to")
        mode = os.environ.get("WANDB_MODE", "online").lower() or "online"
        if mode not in ("online", "run") or os.environ.get("WANDB_API_KEY"):
            return
        from urllib.parse import urlsplit

        host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
        try:
            found = netrc.netrc().authenticators(host)
        except (OSError, netrc.NetrcParseError):
            found = None
        if not found:
            raise ConfigError(f"W&B has no API key for {host} (no WANDB_API_KEY, no ~/.netrc entry): run `wandb "
                              "login`, set WANDB_API_KEY, or set WANDB_MODE=offline to write the run locally for "
                              "`wandb sync` later")

    def replays_missing(self) -> bool:
        # Online, W&B's server holds what reached it and refuses steps below its newest; offline, the run files
        # of a killed process end at W&B's last full block.
        return bool(self._run is not None and self._run.offline)

    def advice(self, error: BaseException) -> str:
        return ("run `wandb login` or set WANDB_API_KEY (or WANDB_MODE=offline to write the run locally), and check "
                "that WANDB_DIR, or the run directory, is a writable folder")

    def open_run(self, trainer: Trainer, run_id: str | None) -> str:
        # W&B reads its environment once per process: WANDB_DIR is passed on, so a later change counts.
        directory = os.environ.get("WANDB_DIR") or trainer.config.run_dir
        if directory:
            _writable_directory(directory, "W&B's directory (WANDB_DIR, else the run directory)",
                                "set WANDB_DIR to a folder you can write to")
        # The config goes with the run record (a config update just before a quick finish can be lost).
        self._run = self._wandb.init(project=self.project_name, name=self.run_name, id=run_id,
                                     resume="allow" if run_id else None, dir=directory, reinit="create_new",
                                     config=trainer.config.to_dict())
        self.logged_until = self._offline_steps() if run_id else {}
        return str(self._run.id)

    def _offline_steps(self) -> dict[str, int]:
        # The earlier offline parts of this run (W&B joins them only on sync): every offline run directory
        # of this id beside the new one.
        own = os.path.normpath(self._run.settings.sync_dir)
        parts = [path for path in glob.glob(os.path.join(os.path.dirname(own), f"offline-run-*-{self._run.id}"))
                 if os.path.normpath(path) != own]
        return wandb_logged_steps(parts, self._run.id)

    def log_params(self, params: dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_model(self, path: str) -> None:
        artifact = self._wandb.Artifact(f"model-{self._run.id}", type="model")
        artifact.add_file(path)  # copied to W&B's staging area now: the file may go afterwards
        self._run.log_artifact(artifact)

    def close_run(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "finished" else 1)
        self._run = None


def wandb_records(path: str) -> Iterator[Any]:
    """The complete records of a W&B run file (``run-ID.wandb``) as ``wandb_internal_pb2.Record``.

    The file is W&B's header, then LevelDB-style blocks of 32 KiB whose chunks (crc32, length, type:
    1 full, 2 first, 3 middle, 4 last) carry the records. W&B writes whole blocks while a run goes on,
    so a killed run's file ends at a block: a record cut there is left out.

    Example: ``[r.WhichOneof("record_type") for r in wandb_records("run-abc.wandb")]  # ["run", ...]``
    """
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as file:
        data = file.read()
    if data[:4] != b":W&B":
        raise ConfigError(f"{path} is not a W&B run file (it does not start with ':W&B'): remove it or "
                          "move it out of the W&B directory")
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # made by protobuf at import
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_logged_steps(run_dirs: list[str], run_id: str) -> dict[str, int]:
    """Per metric, the last step the ``run-ID.wandb`` files in ``run_dirs`` hold (W&B's ``_`` keys left out).

    Example: ``wandb_logged_steps(["wandb/offline-run-20250101_120000-abc"], "abc")  # {"train/loss": 9}``
    """
    until: dict[str, int] = {}
    for directory in run_dirs:
        path = os.path.join(directory, f"run-{run_id}.wandb")
        if not os.path.exists(path):
            continue
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    until[key] = max(step, until.get(key, -1))
    return until


def trackers_for(config: TrainConfig) -> list[Callback]:
    """The callbacks of ``config.report_to``, in its order.

    Example: ``trackers_for(TrainConfig(report_to=["mlflow"]))  # [MLflowLogger()]``
    """
    made: dict[str, Any] = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MLflowLogger}
    return [made[name]() for name in config.report_to]
