"""The CLI starts without the training stack; the built-in catalog matches its registries."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

HEAVY = ("mlx_train.training", "mlx_train.data", "mlx_train.checkpointing", "mlx.core")


def _loaded_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the HEAVY modules it left in sys.modules."""
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["monitor", "--help"], ["status", "--help"],
                                  ["evaluate", "--help"], ["optimize", "--help"], ["reset-distributed", "--help"]])
def test_help_does_not_import_the_training_stack(argv):
    loaded = _loaded_after(f"""
        import contextlib, io
        from mlx_train.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main({argv!r}) == 0
        assert "usage: mlx-train" in out.getvalue()
    """)
    assert loaded == []


def test_the_parser_of_one_command_imports_only_that_command():
    loaded = _loaded_after("""
        import sys
        from mlx_train.cli.main import build_parser
        args = build_parser("monitor").parse_args(["monitor", "runs/a", "--once"])
        assert args.run_dir == "runs/a"
        assert "mlx_train.cli.monitor" in sys.modules and "mlx_train.cli.train" not in sys.modules
    """)
    assert loaded == []


def test_monitor_reads_a_run_without_the_training_stack(tmp_path):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 3, "epoch": 0, "loss": 1.25,
                                                   "time": time.time()}) + "\n")
    beat = {"rank": 0, "state": "running", "step": 3, "time": time.time(), "pid": os.getpid(), "host": "elsewhere"}
    (run / "heartbeat-0.json").write_text(json.dumps(beat))
    loaded = _loaded_after(f"""
        import contextlib, io
        from mlx_train.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["monitor", {str(run)!r}, "--once"]) == 0
        assert "1.25" in out.getvalue(), out.getvalue()
    """)
    assert loaded == []


def test_the_builtin_catalog_names_what_the_registries_hold():
    from mlx_train import builtin
    from mlx_train.builtin import datasets, models

    assert list(builtin.MODELS) == models.available_models()
    assert list(builtin.DATASETS) == datasets.available_datasets()


def test_status_does_not_import_the_training_stack(tmp_path):
    # `status` describes the devices (that needs MLX) and the runs: nothing of the training stack.
    loaded = _loaded_after(f"""
        import contextlib, io
        from mlx_train.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["status", "--runs", {str(tmp_path)!r}]) == 0
    """)
    assert [m for m in loaded if m != "mlx.core"] == []


def test_the_supervisor_imports_neither_the_training_stack_nor_mlx():
    loaded = _loaded_after("""
        from mlx_train.launch import RecoveryPolicy, Supervisor, supervise
        from mlx_train.launch.supervisor import Supervisor as same
        assert Supervisor is same and callable(supervise) and RecoveryPolicy
    """)
    assert loaded == []


LAZY_PACKAGES = ["mlx_train", "mlx_train.training", "mlx_train.data", "mlx_train.checkpointing", "mlx_train.config",
                 "mlx_train.memory", "mlx_train.monitor", "mlx_train.distributed", "mlx_train.launch"]


def test_packages_load_their_names_on_first_use():
    # Importing a package loads no module of it and not MLX; each exported name then resolves to the
    # object of the module it lives in.
    _loaded_after(f"""
        import importlib, sys
        packages = []
        for name in {LAZY_PACKAGES!r}:
            before = set(sys.modules)
            package = importlib.import_module(name)
            new = sorted(m for m in set(sys.modules) - before if m.startswith(name + "."))
            assert "mlx.core" not in sys.modules, name
            assert name == "mlx_train" or new == [], (name, new)
            assert set(package._LAZY) <= set(package.__all__) <= set(dir(package)), name
            packages.append(package)
        for package in packages:
            for name, module in package._LAZY.items():
                value = getattr(package, name)
                if module.count(".") > 1:
                    assert value is getattr(importlib.import_module(module), name), name
    """)


@pytest.mark.slow
def test_a_one_process_train_loads_neither_the_distributed_trainer_nor_the_supervisor(tmp_path):
    argv = ["train", "--epochs", "1", "--set", "max_steps=2", "--run-dir", str(tmp_path / "a")]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import contextlib, io, json, sys
            from mlx_train.cli.main import main
            with contextlib.redirect_stdout(io.StringIO()):
                assert main({argv!r}) == 0
            print(json.dumps(sorted(m for m in sys.modules if m.startswith("mlx_train"))))
        """)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "mlx_train.training.trainer" in loaded and "mlx_train.run_directory" in loaded
    unwanted = ("mlx_train.training.distributed", "mlx_train.distributed.rank", "mlx_train.launch.supervisor",
                "mlx_train.monitor", "mlx_train.llm", "mlx_train.testing", "mlx_train.memory", "mlx_train.export")
    assert [m for m in loaded if m.startswith(unwanted)] == []
