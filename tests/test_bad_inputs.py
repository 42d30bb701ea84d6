"""Bad inputs, one row each: every one gets a clear message (what, where, how to fix) and, from the
command line, an exit code and no traceback.

Three tables: command lines (``mlx-train ...`` run in-process: config files, flags, run directories,
checkpoints, host files), and the Python API (datasets and models handed to the Trainer). A row's
``files`` are written under the test's directory first; ``{tmp}`` in the arguments is that
directory, ``{run}`` a copy of a small finished run (its checkpoints at steps 2 and 4).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn
import numpy as np
import pytest

from mlx_train.checkpointing.format import manifest_bytes
from mlx_train.cli.main import main
from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError, DataError, MLXTrainError


@dataclass
class Cli:
    """One bad command line: ``argv``, the exit code, a regex its error must match."""

    argv: list[str]
    code: int
    match: str
    files: dict[str, str] = field(default_factory=dict)  # name under {tmp} -> text
    damage: Callable[[Path], None] | None = None  # applied to {run} first


def _rm(*names: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        for name in names:
            path = run / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return damage


def _write(name: str, text: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        (run / name).write_text(text)
    return damage


def _edit_state(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Change trainer_state.json of both checkpoints, keeping the manifest's sizes and hashes true (so
    that the error is about the content, not a torn file)."""
    def damage(run: Path) -> None:
        for step in (run / "checkpoints").glob("step-*"):
            state_path = step / "trainer_state.json"
            state = json.loads(state_path.read_text())
            change(state)
            state_path.write_text(json.dumps(state))
            manifest_path = step / "manifest.json"
            manifest = json.loads(manifest_path.read_text())
            data = state_path.read_bytes()
            manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            manifest_path.write_bytes(manifest_bytes(manifest))  # resealed: the manifest itself stays true
    return damage


def _both(*damages: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        for one in damages:
            one(run)
    return damage


def _all_checkpoints(text: bytes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        for step in (run / "checkpoints").glob("step-*"):
            (step / "model.safetensors").write_bytes(text)
    return damage


TRAIN = ["train", "--run-dir", "{tmp}/new"]
FINETUNE = ["finetune", "--model", "{tmp}/none", "--data", "{run}"]
HOSTS = ["train", "--distributed", "--run-dir", "{tmp}/new", "--hostfile", "{tmp}/hosts.json"]

CLI_ROWS: dict[str, Cli] = {
    # ---- config files (YAML) ----
    "yaml-missing-file": Cli([*TRAIN, "--config", "{tmp}/nope.yaml"], 2, r"cannot read config file .*nope\.yaml"),
    "yaml-syntax": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml:\d+: invalid YAML",
                       {"c.yaml": "training:\n  epochs: [1\n"}),
    "yaml-unknown-key": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2,
                            r"c\.yaml:2: unknown key 'batch_sise'.*did you mean 'batch_size'",
                            {"c.yaml": "training:\n  batch_sise: 3\n"}),
    "yaml-unknown-section": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml.*'trainig'.*did you mean 'training'",
                                {"c.yaml": "trainig:\n  epochs: 3\n"}),
    "yaml-wrong-type": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml:2:.*epochs must be an integer",
                           {"c.yaml": "training:\n  epochs: many\n"}),
    "yaml-negative-lr": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"learning_rate.*typical values are 1e-4 to 1e-2",
                            {"c.yaml": "optimizer:\n  learning_rate: -0.1\n"}),
    "yaml-unknown-optimizer": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml:2:.*'adamm'.*did you mean 'adam",
                                  {"c.yaml": "optimizer:\n  name: adamm\n"}),
    "yaml-list-at-top": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml.*(mapping|sections)",
                            {"c.yaml": "- epochs: 3\n"}),
    "yaml-momentum-with-adamw": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"does not use momentum.*sgd",
                                    {"c.yaml": "optimizer:\n  momentum: 0.9\n"}),
    "yaml-unknown-model": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"unknown model 'mpl'.*did you mean 'mlp'",
                              {"c.yaml": "model:\n  name: mpl\n"}),
    "yaml-bad-cadence": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml:2:.*(steps|epochs)",
                            {"c.yaml": "training:\n  eval_every: sometimes\n"}),
    "yaml-bad-memory-limit": Cli([*TRAIN, "--config", "{tmp}/c.yaml"], 2, r"c\.yaml:2:.*memory_limit",
                                 {"c.yaml": "memory:\n  memory_limit: lots\n"}),
    "yaml-is-a-directory": Cli([*TRAIN, "--config", "{tmp}"], 2, r"cannot read config file .*[Ii]s a directory"),
    # ---- command-line flags ----
    "flag-epochs-text": Cli([*TRAIN, "--epochs", "abc"], 2, r"argument --epochs: epochs must be an integer"),
    "flag-epochs-zero": Cli([*TRAIN, "--epochs", "0"], 2, r"epochs must be at least 1, got 0"),
    "flag-batch-negative": Cli([*TRAIN, "--batch-size", "-4"], 2, r"batch_size must be at least 1"),
    "flag-lr-zero": Cli([*TRAIN, "--lr", "0"], 2, r"learning_rate must be (above|greater than) 0"),
    "flag-precision": Cli([*TRAIN, "--precision", "fp64"], 2, r"precision must be one of float32, bfloat16, float16"),
    "flag-seed-negative": Cli([*TRAIN, "--seed", "-1"], 2, r"seed must be at least 0"),
    "flag-typo": Cli([*TRAIN, "--epochz", "3"], 2, r"unrecognized arguments: --epochz 3 \(did you mean '--epochs'\?\)"),
    "flag-underscore-lr": Cli([*TRAIN, "--learning_rate", "0.1"], 2, r"did you mean '--learning-rate'"),
    "flag-field-without-flag": Cli([*TRAIN, "--weight-decay", "0.1"], 2, r"did you mean '--set weight_decay=VALUE'"),
    "flag-set-unknown-field": Cli([*TRAIN, "--set", "lerning_rate=0.1"], 2,
                                  r"unknown TrainConfig field 'lerning_rate'.*'learning_rate'"),
    "flag-set-no-equals": Cli([*TRAIN, "--set", "epochs"], 2, r"--set epochs: expected KEY=VALUE"),
    "flag-set-bad-yaml": Cli([*TRAIN, "--set", "model_options.hidden_dims=[8"], 2, r"not valid YAML"),
    "flag-set-not-mapping": Cli([*TRAIN, "--set", "epochs.x=1"], 2, r"'epochs' is not a mapping"),
    "flag-set-model-option": Cli([*TRAIN, "--set", "model_options.hiden_dims=[8]"], 2,
                                 r"unknown option 'hiden_dims' for model 'mlp'.*'hidden_dims'"),
    "flag-set-dataset-option": Cli([*TRAIN, "--set", "dataset_options.block_size=-3", "--dataset", "text"], 2,
                                   r"block_size.*positive"),
    "flag-unknown-dataset": Cli([*TRAIN, "--dataset", "digit"], 2, r"unknown dataset 'digit'.*'digits'"),
    "flag-n-without-distributed": Cli([*TRAIN, "-n", "2"], 2,
                                      r"-n 2 only applies to a distributed run: add --distributed"),
    "flag-hostfile-without-distributed": Cli([*TRAIN, "--hostfile", "h.json"], 2, r"--hostfile h\.json only applies"),
    "flag-n-zero": Cli([*TRAIN, "--distributed", "-n", "0"], 2, r"-n must be at least 1"),
    "flag-no-command": Cli([], 2, r"required: COMMAND|arguments are required"),
    "flag-unknown-command": Cli(["fly"], 2, r"invalid choice: 'fly'"),
    "flag-evaluate-needs-checkpoint": Cli(["evaluate"], 2, r"required: --checkpoint"),
    "flag-evaluate-split": Cli(["evaluate", "--checkpoint", "{run}", "--dataset-split", "dev"], 2,
                               r"invalid choice: 'dev'"),
    "flag-plot-unknown-metric": Cli(["plot", "{run}", "--metrics", "los,val_los", "-o", "{tmp}/p.png"], 2,
                                    r"unknown metrics los, val_los.*has .*loss"),
    # ---- run directories ----
    "rundir-is-a-file": Cli(["train", "--run-dir", "{tmp}/f"], 2, r"run directory .*f is a file, not a directory",
                            {"f": "x"}),
    "rundir-under-a-file": Cli(["train", "--run-dir", "{tmp}/f/run"], 2, r"cannot create the run directory .*run: Not",
                               {"f": "x"}),
    "resume-change-seed": Cli(["train", "--run-dir", "{run}", "--resume", "--seed", "5"], 2,
                              r"--seed 5: seed cannot change on resume.*new --run-dir"),
    "resume-change-model": Cli(["train", "--run-dir", "{run}", "--resume", "--model", "cnn"], 2,
                               r"model cannot change on resume"),
    "resume-change-batch": Cli(["train", "--run-dir", "{run}", "--resume", "--batch-size", "7"], 2,
                               r"batch_size cannot change on resume"),
    "resume-change-optimizer": Cli(["train", "--run-dir", "{run}", "--resume", "--set", "optimizer=sgd"], 2,
                                   r"optimizer cannot change on resume"),
    "resume-with-optimize-memory": Cli(["train", "--run-dir", "{run}", "--resume", "--optimize-memory"], 2,
                                       r"--optimize-memory cannot go with --resume"),
    # config.yaml is read only when the run stopped before its first checkpoint (the checkpoint is the truth).
    "resume-saved-config-broken": Cli(["train", "--run-dir", "{run}", "--resume"], 2,
                                      r"config\.yaml:\d+: unknown key 'epochz'",
                                      damage=_both(_rm("checkpoints"),
                                                   _write("config.yaml", "training:\n  epochz: 3\n"))),
    "resume-no-config-anywhere": Cli(["train", "--run-dir", "{run}", "--resume"], 4,
                                     r"holds no training config and .*config\.yaml does not exist",
                                     damage=_both(_edit_state(lambda s: s.pop("config")), _rm("config.yaml"))),
    "resume-nothing-to-resume": Cli(["train", "--run-dir", "{tmp}/new", "--resume"], 4,
                                    r"nothing to resume in .*new: no checkpoint in .* and no config\.yaml"),
    "rundir-holds-a-run": Cli(["train", "--run-dir", "{run}", "--max-steps", "2"], 2,
                              r"run already holds a run \(metrics\.jsonl, config\.yaml, checkpoints\).*--resume"
                              r".*--overwrite.*run\.old-<date>-<time>.*Nothing was changed"),
    "rundir-overwrite-and-resume": Cli(["train", "--run-dir", "{run}", "--resume", "--overwrite"], 2,
                                       r"--overwrite starts the run over and --resume continues it"),
    # ---- finetune: checked before the model is loaded ({tmp}/none is no model: loading it would fail) ----
    "finetune-num-layers-zero": Cli([*FINETUNE, "--num-layers", "0"], 2,
                                    r"num_layers must be -1 \(all blocks, as in mlx_lm\.lora\) or at least 1, got 0"),
    "finetune-iters-zero": Cli([*FINETUNE, "--iters", "0"], 2, r"iters must be at least 1, got 0"),
    "finetune-learning-rate-zero": Cli([*FINETUNE, "--learning-rate", "0"], 2, r"learning_rate must be"),
    "finetune-epochs-zero": Cli([*FINETUNE, "--epochs", "0"], 2, r"epochs must be at least 1, got 0"),
    "finetune-grad-accumulation-zero": Cli([*FINETUNE, "--grad-accumulation-steps", "0"], 2,
                                           r"gradient_accumulation must be at least 1, got 0"),
    "finetune-test-without-test-split": Cli([*FINETUNE, "--test"], 2,
                                            r"--test evaluates on .*test\.jsonl, which does not exist"),
    "finetune-run-dir-is-a-file": Cli([*FINETUNE, "--run-dir", "{tmp}/f"], 2, r"run directory .*f is a file",
                                      {"f": "x"}),
    "finetune-into-a-run": Cli([*FINETUNE, "--run-dir", "{run}"], 2, r"already holds a run.*--overwrite"),
    "finetune-resume-nothing": Cli([*FINETUNE, "--run-dir", "{tmp}/new", "--resume", "auto"], 4,
                                   r"nothing to resume in .*new: no checkpoint in"),
    "finetune-resume-auto-without-run-dir": Cli([*FINETUNE, "--resume", "auto"], 2, r"pass --run-dir"),
    "finetune-fuse-into-the-base": Cli(["finetune", "--model", "{run}", "--data", "{run}", "--fuse", "{run}/fused"], 2,
                                       r"--fuse .*fused is inside the base model's directory"),
    # ---- export and optimize ----
    "export-format-disagrees-with-suffix": Cli(["export", "--checkpoint", "{run}", "--format", "onnx",
                                                "-o", "{tmp}/m.mlxfn"], 2,
                                               r"--format onnx disagrees with -o .*m\.mlxfn, whose suffix \.mlxfn"),
    "optimize-plan-does-not-fit": Cli(["optimize", "--model-size", "1e12", "--device-memory", "1GB"], 6,
                                      r"the plan above does not fit the device memory"),
    # ---- checkpoints ----
    "ckpt-missing-path": Cli(["evaluate", "--checkpoint", "{tmp}/none/step-00000009"], 4, r"there is no checkpoint at"),
    "ckpt-not-a-checkpoint": Cli(["evaluate", "--checkpoint", "{tmp}"], 4, r"neither a checkpoint"),
    "ckpt-missing-weights": Cli(["evaluate", "--checkpoint", "{run}/checkpoints/step-00000004"], 4,
                                r"model\.safetensors.*evaluate that one with --checkpoint .*step-00000002",
                                damage=_rm("checkpoints/step-00000004/model.safetensors")),
    "ckpt-corrupt-manifest": Cli(["evaluate", "--checkpoint", "{run}/checkpoints/step-00000004"], 4,
                                 r"manifest", damage=_write("checkpoints/step-00000004/manifest.json", "{not json")),
    "ckpt-corrupt-state-json": Cli(["evaluate", "--checkpoint", "{run}/checkpoints/step-00000004"], 4,
                                   r"trainer_state\.json",
                                   damage=_write("checkpoints/step-00000004/trainer_state.json", "{oops")),
    "ckpt-all-damaged-resume": Cli(["train", "--run-dir", "{run}", "--resume"], 4,
                                   r"every checkpoint in .* is incomplete or damaged", damage=_all_checkpoints(b"xx")),
    "ckpt-resume-path-missing": Cli(["train", "--run-dir", "{run}", "--resume", "{run}/checkpoints/step-00000099"], 4,
                                    r"step-00000099"),
    "ckpt-empty-run-dir": Cli(["evaluate", "--checkpoint", "{run}"], 4, r"neither a checkpoint|no complete checkpoint",
                              damage=_rm("checkpoints/step-00000002", "checkpoints/step-00000004")),
    "ckpt-wrong-model": Cli(["evaluate", "--checkpoint", "{run}/checkpoints/step-00000004"], 4,
                            r"do not fit model 'mlp'",
                            damage=_edit_state(lambda s: s["config"].update(model_options={"hidden_dims": [5]}))),
    "ckpt-no-config": Cli(["evaluate", "--checkpoint", "{run}/checkpoints/step-00000004"], 4,
                          r"holds no training config", damage=_edit_state(lambda s: s.pop("config"))),
    # ---- host files ----
    "hosts-missing": Cli(HOSTS, 2, r"host file .*hosts\.json does not exist; write one with 'mlx-train configure"),
    "hosts-not-json": Cli(HOSTS, 2, r"host file .* is not valid JSON \(line 1", {"hosts.json": "[{ssh: a}]"}),
    "hosts-empty-list": Cli(HOSTS, 2, r"the list of hosts is empty", {"hosts.json": "[]"}),
    "hosts-string-entry": Cli(HOSTS, 2, r"got the string 'mac1'", {"hosts.json": '["mac1"]'}),
    "hosts-unknown-key": Cli(HOSTS, 2, r"unknown key 'sh'.*did you mean 'ssh'", {"hosts.json": '[{"sh": "a"}]'}),
    "hosts-missing-ssh": Cli(HOSTS, 2, r"missing \"ssh\"", {"hosts.json": '[{"ips": ["10.0.0.1"]}]'}),
    "hosts-bad-backend": Cli(HOSTS, 2, r"unknown backend 'rong'.*'ring'",
                             {"hosts.json": '{"backend": "rong", "hosts": [{"ssh": "127.0.0.1"}]}'}),
    "hosts-no-hosts-key": Cli(HOSTS, 2, r"has no \"hosts\" list", {"hosts.json": '{"backend": "ring"}'}),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step MLP run with checkpoints at steps 2 and 4 and a metrics row per step."""
    run_dir = tmp_path_factory.mktemp("bad-inputs") / "run"
    argv = ["train", "--max-steps", "4", "--set", "model_options.hidden_dims=[16]", "--set", "report_every=1",
            "--set", "checkpoint_every=2", "--run-dir", str(run_dir)]
    assert main(argv) == 0
    return run_dir


@pytest.mark.parametrize("row", CLI_ROWS.values(), ids=CLI_ROWS.keys())
def test_bad_command_line(row: Cli, finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    if row.damage:
        row.damage(run)
    for name, text in row.files.items():
        (tmp_path / name).write_text(text)
    capsys.readouterr()
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for a in row.argv]
    code = main(argv)
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert "Traceback" not in output and "unexpected error" not in output, output
    assert code == row.code, output
    errors = [line for line in captured.err.splitlines() if ": error: " in line]
    assert errors, output
    assert re.search(row.match, captured.err), captured.err


# ---- the Python API: datasets and models handed to the Trainer ----
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = np.arange(16, dtype=np.int32) % 3


def _train(train: Any, val: Any = None, model: Any = None) -> Callable[[], Any]:
    def call() -> Any:
        from mlx_train.training import Trainer

        trainer = Trainer(model if model is not None else _mlp(), config=TrainConfig(
            epochs=1, batch_size=4, num_workers=0, compile=False))
        return trainer.train(train, val)
    return call


def _predict(data: Any) -> Callable[[], Any]:
    def call() -> Any:
        from mlx_train.training import Trainer

        return Trainer(_mlp(), config=TrainConfig(batch_size=4, num_workers=0, compile=False)).predict(data)
    return call


def _built_in(name: str, **options: Any) -> Callable[[], Any]:
    def call() -> Any:
        from mlx_train.builtin.datasets import load_dataset

        return load_dataset(name, **options)
    return call


def _model(name: str, info: dict, **options: Any) -> Callable[[], Any]:
    def call() -> Any:
        from mlx_train.builtin.models import build_model

        return build_model(name, info, **options)
    return call


DIGITS_INFO = {"task": "classification", "in_dims": 64, "num_classes": 10, "image_shape": (8, 8, 1)}

API_ROWS: dict[str, tuple[Callable[[], Any], type, str]] = {
    "data-x-y-lengths-differ": (_train((X, Y[:10])), DataError, r"16.*10|10.*16"),
    "data-string-labels": (_train((X, np.array(["a", "b"] * 8))), DataError, r"label|str|string|dtype"),
    "data-object-array": (_train((np.array([[1, "x"]] * 16, dtype=object), Y)), DataError, r"object|dtype"),
    "data-dict-of-splits": (_train({"train": (X, Y), "val": (X, Y)}), DataError, r"split|train.*val|dict"),
    "data-val-wrong-width": (_train((X, Y), (np.zeros((8, 5), np.float32), Y[:8])), DataError, r"5|width|features"),
    "data-empty": (_train((X[:0], Y[:0])), DataError, r"empty|no samples|0 samples"),
    "data-not-a-dataset": (_train(42), (DataError, ConfigError), r"int|dataset"),
    "data-ragged-samples": (_train([(np.zeros(4, np.float32), 0), (np.zeros(5, np.float32), 1)] * 4),
                            DataError, r"shape|4.*5|5.*4"),
    "predict-wrong-width": (_predict(np.zeros((8, 7), np.float32)), DataError, r"7|width|features"),
    "model-is-a-lambda": (_train((X, Y), model=lambda x: x), ConfigError, r"nn\.Module|lambda|function"),
    "builtin-text-missing-file": (_built_in("text", path="/nonexistent/corpus.txt"), DataError,
                                  r"cannot read the text file '/nonexistent/corpus\.txt'"),
    "builtin-digits-unknown-option": (_built_in("digits", as_image=True), ConfigError, r"as_image.*'as_images'"),
    "builtin-mlp-bad-dropout": (_model("mlp", DIGITS_INFO, dropout=1.5), ConfigError, r"dropout must be in \[0, 1\)"),
    "builtin-mlp-zero-width": (_model("mlp", DIGITS_INFO, hidden_dims=[0]), ConfigError, r"must be positive"),
}


@pytest.mark.parametrize("call, error, match", API_ROWS.values(), ids=API_ROWS.keys())
def test_bad_python_input(call, error, match):
    with pytest.raises(error, match=match) as raised:
        call()
    assert isinstance(raised.value, MLXTrainError)  # so the CLI shows it as one message, no traceback


def test_the_table_is_comprehensive():
    assert len(CLI_ROWS) + len(API_ROWS) >= 60


SUBPROCESS_ROWS = ["yaml-unknown-key", "rundir-is-a-file", "flag-n-without-distributed"]


@pytest.mark.parametrize("name", SUBPROCESS_ROWS)
def test_bad_command_line_in_a_fresh_process(name, tmp_path):
    """The real ``python -m mlx_train``: exit code and stderr as a user sees them."""
    import os
    import subprocess
    import sys

    import mlx_train

    row = CLI_ROWS[name]
    for file_name, text in row.files.items():
        (tmp_path / file_name).write_text(text)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in row.argv]
    src = str(Path(mlx_train.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "mlx_train", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == row.code, done.stderr
    assert "Traceback" not in done.stderr + done.stdout and re.search(row.match, done.stderr), done.stderr
