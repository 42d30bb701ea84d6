"""The mlx-train command line: flags, overlays, errors, train -> evaluate end to end."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_train
from mlx_train.cli import train as train_command
from mlx_train.cli.evaluate import evaluate_checkpoint
from mlx_train.cli.main import build_parser, main
from mlx_train.cli.train import FLAGS, build_config, run
from mlx_train.config import LaunchConfig, TrainConfig
from mlx_train.errors import DataError
from mlx_train.rundir import choose_run_dir as resolve_run_dir

SRC = str(Path(mlx_train.__file__).resolve().parents[1])


def _squeeze(text: str) -> str:
    return "".join(text.split())  # argparse re-wraps help text


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One run with every TrainConfig default (mlp on digits, 10 epochs)."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    return run(TrainConfig(run_dir=str(run_dir)), log=lambda message: None)


@pytest.mark.slow
def test_defaults_reach_95_percent_on_digits(default_run):
    assert default_run["test"]["accuracy"] >= 0.95
    assert len(default_run["history"]["train_loss"]) == 10
    saved = TrainConfig.from_yaml(default_run["run_dir"] / "config.yaml")
    assert saved == default_run["config"]
    assert saved.checkpoint_dir == str(default_run["run_dir"] / "checkpoints")


@pytest.mark.slow
def test_evaluate_reproduces_the_final_test_metrics(default_run, capsys):
    metrics = evaluate_checkpoint(str(default_run["run_dir"]))  # a run dir: its newest checkpoint
    assert metrics["accuracy"] == pytest.approx(default_run["test"]["accuracy"])
    assert metrics["loss"] == pytest.approx(default_run["test"]["loss"], rel=1e-5)
    newest = sorted((default_run["run_dir"] / "checkpoints").glob("step-*"))[-1]
    assert main(["evaluate", "--checkpoint", str(newest), "--dataset-split", "val"]) == 0
    out = capsys.readouterr().out
    assert "BLAS" in out and "val: loss " in out and "| accuracy 0.9" in out


def test_help_explains_every_flag_with_the_config_help(capsys):
    assert main(["train", "--help"]) == 0
    out = _squeeze(capsys.readouterr().out)
    fields = LaunchConfig.fields_help()  # train's config: the Trainer's and the launcher's (--max-restarts)
    for flag, name in FLAGS.items():
        assert flag in out and _squeeze(fields[name].help) in out, flag
    for flag in ("--config", "--resume", "--set", "--debug"):
        assert flag in out
    assert "built-in:cnn,mlp,transformer" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mlx-train {mlx_train.__version__}"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--epochs", "abc"], "mlx-train train: error: argument --epochs: epochs must be an integer"),
        (["train", "--epochs", "0"], "argument --epochs: epochs must be at least 1, got 0"),
        (["train", "--precision", "fp64"], "argument --precision: precision must be one of float32, bfloat16, float16"),
        (["train", "--epochz", "3"], "unrecognized arguments: --epochz 3 (did you mean '--epochs'?)"),
        (["train", "--set", "lerning_rate=0.1"],
         "unknown TrainConfig field 'lerning_rate' (did you mean 'learning_rate'?)"),
        (["train", "--set", "batch_size=big"], "--set batch_size=big: batch_size must be an integer"),
        (["train", "--set", "epochs"], "--set epochs: expected KEY=VALUE"),
        (["train", "--model", "mpl"], "unknown model 'mpl' (did you mean 'mlp'?)"),
        (["train", "--dataset", "digit"], "unknown dataset 'digit' (did you mean 'digits'?)"),
        (["train", "--set", "model_options.hiden_dims=[8]"],
         "unknown option 'hiden_dims' for model 'mlp' (did you mean 'hidden_dims'?)"),
        (["evaluate"], "the following arguments are required: --checkpoint"),
        (["fly"], "invalid choice: 'fly'"),
    ],
)
def test_bad_command_lines_give_one_message_and_exit_2(argv, expected, tmp_path, capsys):
    assert main([*argv, "--run-dir", str(tmp_path / "run")] if argv[0] == "train" else argv) == 2
    captured = capsys.readouterr()
    assert expected in captured.err
    assert "Traceback" not in captured.err and "BLAS" not in captured.out
    assert not (tmp_path / "run").exists()  # nothing was written for a bad command line


def test_config_file_then_set_then_flags(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text(
        "training:\n  num_epochs: 3\n  batch_size: 16\n  seed: 7\n"
        "optimizer:\n  learning_rate: 2e-5\n"
        "model:\n  name: mlp\n  hidden_dims: [64]\n"
    )
    args = build_parser().parse_args([
        "train", "--config", str(path), "--set", "epochs=4", "--set", "seed=9",
        "--set", "model_options.dropout=0.1", "--seed", "11",
    ])
    config = build_config(args)
    assert (config.epochs, config.batch_size, config.learning_rate, config.seed) == (4, 16, 2e-5, 11)
    assert config.model_options == {"hidden_dims": [64], "dropout": 0.1}
    assert config.weight_decay == TrainConfig().weight_decay


def test_evaluate_nonexistent_checkpoint(tmp_path, capsys):
    missing = tmp_path / "runs" / "step-00000100"
    assert main(["evaluate", "--checkpoint", str(missing)]) == 4
    captured = capsys.readouterr()
    assert f"there is no checkpoint at {missing}: no such file or directory" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert main(["evaluate", "--checkpoint", str(tmp_path)]) == 4
    assert "is neither a checkpoint (no manifest.json) nor a directory of step-*" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluate_torn_checkpoint(default_run, tmp_path, capsys):
    run_dir = tmp_path / "copy"
    shutil.copytree(default_run["run_dir"], run_dir)
    *older, newest = sorted((run_dir / "checkpoints").glob("step-*"))
    (newest / "model.safetensors").unlink()
    assert main(["evaluate", "--checkpoint", str(newest)]) == 4
    err = capsys.readouterr().err
    assert "model.safetensors" in err and older[-1].name in err and "Traceback" not in err
    with pytest.warns(UserWarning, match="skipped it"):
        assert main(["evaluate", "--checkpoint", str(run_dir)]) == 0  # falls back to the previous one
    assert "test: loss " in capsys.readouterr().out


@pytest.mark.slow
def test_train_resume_and_other_models(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mlx-train {mlx_train.__version__} | MLX ")
    assert "test: loss " in out and "| accuracy " in out
    assert main(["train", "--epochs", "2", "--run-dir", str(run_dir), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out

    cnn_dir = tmp_path / "cnn"
    assert main(["train", "--model", "cnn", "--max-steps", "3", "--run-dir", str(cnn_dir)]) == 0
    lm_dir = tmp_path / "lm"
    argv = ["train", "--model", "transformer", "--dataset", "text", "--max-steps", "3",
            "--set", "model_options={dims: 32, num_layers: 1}", "--run-dir", str(lm_dir)]
    assert main(argv) == 0
    assert "test: loss " in capsys.readouterr().out
    metrics = evaluate_checkpoint(str(lm_dir / "checkpoints"))
    assert 2.0 < metrics["loss"] < 6.0  # vocab ~100: ln(100) = 4.6 untrained


def test_resolve_run_dir(tmp_path):
    runs = tmp_path / "runs"
    for stamp in ("20250101-000000", "20250102-000000"):
        (runs / f"mlp-digits-{stamp}" / "checkpoints").mkdir(parents=True)
    (runs / "mlp-digits-20250103-000000").mkdir()  # no checkpoints: not resumable
    config = TrainConfig()
    assert resolve_run_dir(config, "auto", str(runs)) == runs / "mlp-digits-20250102-000000"
    fresh = resolve_run_dir(config, None, str(runs))
    assert fresh.name.startswith("mlp-digits-") and not fresh.exists()
    step = runs / "x" / "checkpoints" / "step-00000010"
    assert resolve_run_dir(config, str(step), str(runs)) == runs / "x"
    assert resolve_run_dir(config.replace(run_dir="mine"), "auto", str(runs)) == Path("mine")


@pytest.mark.parametrize(
    "raised, code, expected",
    [
        (DataError("sample 3 has 5 features, expected 4"), 3, "mlx-train: error: sample 3 has 5 features"),
        (RuntimeError("boom"), 1,
         "mlx-train: unexpected error: RuntimeError: boom\nrun with --debug for the traceback"),
        (KeyboardInterrupt(), 130, "mlx-train: interrupted"),
    ],
)
def test_errors_become_one_message_and_exit_code(raised, code, expected, monkeypatch, tmp_path, capsys):
    def fail(config, resume=None, log=print):
        raise raised

    monkeypatch.setattr(train_command, "run", fail)
    assert main(["train", "--run-dir", str(tmp_path)]) == code
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert main(["--debug", "train", "--run-dir", str(tmp_path)]) == code
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "mlx_train", "train", "--epochs", "2", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "| MLX " in done.stdout and "| BLAS " in done.stdout and "test: loss " in done.stdout
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert any((tmp_path / "run" / "checkpoints").glob("step-*"))


def _bash_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        if current is None and line.strip() == "```bash":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_set_up_works_on_a_fresh_debian_and_matches_ci(tmp_path):
    """The set-up updates apt before installing, makes a virtual environment (Debian's Python refuses a
    system-wide pip install), and its test command is the one .ci/run runs."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    set_up = readme[readme.index("## Set-up"):readme.index("\n## ", readme.index("## Set-up") + 1)]
    blocks = _bash_blocks(set_up)
    assert any("apt-get update &&" in b and "libopenblas0-pthread" in b and "python3-venv" in b for b in blocks)
    assert any("python3 -m venv .venv" in b and ". .venv/bin/activate" in b for b in blocks)
    assert 'pip install -e ".[examples]" && mlx-train train' in blocks
    assert 'pip install -e ".[dev]" && python -m pytest -q' in blocks
    ci = (root / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[dev]"' in ci and "\npython -m pytest -q\n" in ci
    yaml_block = readme[readme.index("```yaml", readme.index("## Configuration")):]
    yaml_block = yaml_block[len("```yaml\n"):yaml_block.index("\n```", 7)]
    sample = tmp_path / "sample.yaml"
    sample.write_text(yaml_block)
    assert TrainConfig.from_yaml(sample).precision == "float32"  # bfloat16 crawls on the Linux CPU


CONSOLE_SCRIPT = "import sys\nfrom mlx_train.cli.main import main\nsys.exit(main())\n"  # what pip writes for mlx-train


@pytest.mark.parametrize("point", ["start", "imports"])
@pytest.mark.parametrize("entry", ["python -m mlx_train", "mlx-train"])
def test_ctrl_c_from_the_very_start_is_one_line_and_exit_code_130(tmp_path, entry, point):
    """SIGINT where the command holds (its test hook reports it on stderr): as mlx_train starts to import, and
    after the CLI's imports, right before main() catches KeyboardInterrupt. One line, 130, nothing written."""
    import signal

    script = tmp_path / "mlx-train"
    script.write_text(CONSOLE_SCRIPT)
    command = [sys.executable, "-m", "mlx_train"] if entry.startswith("python") else [sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MLX_TRAIN_HOLD_AT_START": point}
    run_dir = tmp_path / "run"
    child = subprocess.Popen([*command, "train", "--run-dir", str(run_dir), "--max-steps", "1"], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C's default
    try:
        assert child.stderr.readline() == f"mlx-train test hook: held at {point}\n"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert (child.returncode, out, err) == (130, "", "mlx-train: interrupted\n")
    assert not run_dir.exists()  # nothing that would stand in the way of a fresh start


@pytest.mark.parametrize("entry", ["python -m mlx_train", "mlx-train"])
def test_ctrl_c_caught_by_the_command_exits_130_even_when_it_landed_in_exec_d_code(tmp_path, entry):
    """A KeyboardInterrupt raised inside exec'd code (dataclasses and namedtuple build methods so: a Ctrl-C during
    imports often lands there) makes Python end a ``python -m`` process by SIGINT after main() returned 130; the
    command exits 130 itself. The interrupt is planted by a sitecustomize module, before the command starts."""
    (tmp_path / "sitecustomize.py").write_text(
        "import mlx_train.cli.train as train\ntrain.run = lambda *args, **kwargs: exec('raise KeyboardInterrupt')\n")
    script = tmp_path / "mlx-train"
    script.write_text(CONSOLE_SCRIPT)
    command = [sys.executable, "-m", "mlx_train"] if entry.startswith("python") else [sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*command, "train", "--run-dir", str(tmp_path / "run")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == "mlx-train: interrupted" and "Traceback" not in done.stderr
