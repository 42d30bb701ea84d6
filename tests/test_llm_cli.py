"""`mlx-train finetune`: mlx_lm.lora flags and YAML, a run directory, adapters mlx-lm loads,
perplexity in the summary, --fuse, and clear errors."""

import json
import os
import sys

import mlx.core as mx
import numpy as np
import pytest
import yaml

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    llm_tiny.write_model_dir(str(root / "base"), seed=5)
    llm_tiny.write_data(str(root / "data"), "completion", n_train=12, n_valid=4)
    return root


def test_finetune_with_an_mlx_lm_yaml_writes_adapters_mlx_lm_loads(setup, tmp_path, capsys):
    import mlx_lm

    config = {"model": str(setup / "base"), "train": True, "data": str(setup / "data"), "fine_tune_type": "lora",
              "num_layers": 2, "batch_size": 4, "iters": 4, "val_batches": -1, "learning_rate": 1e-3,
              "steps_per_report": 2, "steps_per_eval": 2, "save_every": 2, "adapter_path": "adapters",
              "max_seq_length": 256, "lora_parameters": {"rank": 4, "dropout": 0.0, "scale": 10.0},
              "report_to": None, "optimizer": "adam"}
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    code = main(["finetune", "-c", str(tmp_path / "lora.yaml"), "--run-dir", str(run), "--mask-prompt",
                 "--pack", "--fuse", str(tmp_path / "fused")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "validation: loss" in out and "perplexity" in out
    assert "finetune: 4 steps" in out
    adapter_config = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert adapter_config["fine_tune_type"] == "lora" and adapter_config["num_layers"] == 2
    assert adapter_config["lora_parameters"] == {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": None}
    assert os.listdir(run / "checkpoints") and (run / "metrics.jsonl").exists()
    adapted, tokenizer = mlx_lm.load(str(setup / "base"), adapter_path=str(run / "adapters"))
    fused, _ = mlx_lm.load(str(tmp_path / "fused"))
    x = mx.array([tokenizer.encode("To be or not to be")])
    np.testing.assert_allclose(np.array(fused(x)), np.array(adapted(x)), atol=1e-5)
    base, _ = mlx_lm.load(str(setup / "base"))
    assert not np.allclose(np.array(base(x)), np.array(adapted(x)), atol=1e-4), "the adapters changed nothing"


def test_finetune_full_from_flags(setup, tmp_path, capsys):
    code = main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--iters", "2",
                 "--fine-tune-type", "full", "--num-layers", "1", "--batch-size", "4", "--learning-rate", "1e-3",
                 "--adapter-path", str(tmp_path / "full")])
    out = capsys.readouterr().out
    assert code == 0, out
    weights = mx.load(str(tmp_path / "full" / "adapters.safetensors"))
    assert weights and all(k.startswith("model.layers.1.") for k in weights)
    assert json.loads((tmp_path / "full" / "adapter_config.json").read_text())["lora_parameters"] is None


def test_finetune_errors_are_one_clear_line(setup, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("model: x\nlora_rank: 8\n")
    assert main(["finetune", "-c", str(tmp_path / "bad.yaml")]) == 2
    assert "unknown top-level key 'lora_rank'" in capsys.readouterr().err
    assert main(["finetune", "--data", str(setup / "data")]) == 2
    assert "needs a base model and data" in capsys.readouterr().err
    assert main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"),
                 "--num-layers", "9", "--iters", "1"]) == 2
    assert "num_layers=9 but the model has 2 layers" in capsys.readouterr().err
    assert main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--iters", "x"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_checkpoints_hold_the_adapters_and_a_checked_base_reference(setup, tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--iters", "2",
             "--num-layers", "1", "--batch-size", "4", "--learning-rate", "1e-3", "--run-dir", str(run)]
    assert main(flags) == 0, capsys.readouterr().out
    step = sorted(p for p in os.listdir(run / "checkpoints") if p.startswith("step-"))[-1]
    saved = mx.load(str(run / "checkpoints" / step / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the frozen base is not in the checkpoint
    state = json.loads((run / "checkpoints" / step / "trainer_state.json").read_text())
    assert state["model_scope"] == "trainable" and len(state["base_model"]["sha256"]) == 64
    base_bytes = sum(os.path.getsize(setup / "base" / f) for f in os.listdir(setup / "base")
                     if f.endswith(".safetensors"))
    assert os.path.getsize(run / "checkpoints" / step / "model.safetensors") < base_bytes / 4

    # the same run on another base: the command line refuses the change (the run's config names its base) ...
    other = tmp_path / "other"
    llm_tiny.write_model_dir(str(other), seed=9)
    code = main(["finetune", "--model", str(other), "--data", str(setup / "data"), "--iters", "3", "--num-layers", "1",
                 "--batch-size", "4", "--learning-rate", "1e-3", "--run-dir", str(run), "--resume", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and "model cannot change on resume" in err
    # ... and so does the checkpoint, naming both, when the base is swapped under the same path
    from mlx_train.errors import CheckpointError
    from mlx_train.llm import FineTuneConfig, finetune

    config = FineTuneConfig(model=str(other), data=str(setup / "data"), iters=3, num_layers=1, learning_rate=1e-3,
                            run_dir=str(run))
    with pytest.raises(CheckpointError, match="was trained on base model.*needs the same base"):
        finetune(config, resume="auto")


def _flags(setup, run, *extra):
    return ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--iters", "2",
            "--num-layers", "1", "--batch-size", "4", "--learning-rate", "1e-3", "--save-every", "1",
            "--run-dir", str(run), *extra]


def _snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_finetune_into_a_run_is_refused_and_overwrite_moves_it_aside(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_flags(setup, run)) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_flags(setup, run, "--learning-rate", "1e-2")) == 2
    err = capsys.readouterr().err
    assert f"{run} already holds a run" in err and "--overwrite" in err and "Traceback" not in err
    assert _snapshot(run) == before
    assert main(_flags(setup, run, "--overwrite", "--iters", "1")) == 0
    (moved,) = tmp_path.glob("run.old-*")
    assert _snapshot(moved) == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]


def test_finetune_resume_refuses_another_batch_size(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_flags(setup, run)) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert main([*_flags(setup, run, "--resume", "auto"), "--batch-size", "2", "--iters", "4"]) == 2
    err = capsys.readouterr().err
    assert "rows per step 4 -> 2: cannot change on resume" in err and "step-00000002" in err
    assert _snapshot(run) == before


def test_fuse_never_writes_into_the_base_model_directory(setup, tmp_path, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(setup / "base", base)
    before = _snapshot(base)
    for fuse in (base, base / "fused"):
        flags = _flags(setup, tmp_path / f"run-{fuse.name}", "--fuse", str(fuse))
        flags[flags.index("--model") + 1] = str(base)
        assert main(flags) == 2
        assert "is inside the base model's directory" in capsys.readouterr().err
        assert _snapshot(base) == before and not (tmp_path / f"run-{fuse.name}").exists()


def test_a_run_shorter_than_steps_per_report_still_reports(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_flags(setup, run, "--steps-per-report", "10")) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reports = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in reports] == [2] and reports[0]["trained_tokens"] > 0
    assert f"finetune: 2 steps, {int(reports[0]['trained_tokens']):,} trained tokens" in out
    assert "finished at step 2" in (run / "train.log").read_text()


@pytest.mark.parametrize("steps_per_eval, validated_at", [(3, [3, 6]), (4, [4, 6])])
def test_the_final_validation_is_in_metrics_jsonl_once(setup, tmp_path, capsys, steps_per_eval, validated_at):
    """As mlx_lm.lora validates at its last iteration: the summary's validation is the last val row."""
    run = tmp_path / "run"
    flags = _flags(setup, run, "--steps-per-eval", str(steps_per_eval))
    flags[flags.index("--iters") + 1] = "6"
    assert main(flags) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  validation: loss"))
    vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    assert [row["step"] for row in vals] == validated_at
    assert f"loss {vals[-1]['val_loss']:.4f}," in summary
    assert "val_loss" in (run / "metrics.csv").read_text().splitlines()[0]


@pytest.mark.parametrize("iters,batch_size,accumulation", [(6, 2, 2), (7, 3, 2), (5, 4, 1)])
def test_an_mlx_lm_yaml_makes_the_updates_mlx_lm_makes(setup, tmp_path, iters, batch_size, accumulation):
    """The same YAML through mlx_lm.lora's own training loop and through finetune: as many optimizer
    updates, each of as many rows."""
    from pathlib import Path
    from types import SimpleNamespace

    import mlx.optimizers as optim
    import mlx_lm
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches, train

    from mlx_train.config import TrainConfig
    from mlx_train.llm import finetune

    text = (f"model: {setup / 'base'}\ndata: {setup / 'data'}\ntrain: true\nnum_layers: 1\niters: {iters}\n"
            f"batch_size: {batch_size}\ngrad_accumulation_steps: {accumulation}\nlearning_rate: 1e-3\n"
            "steps_per_eval: 1000\nsteps_per_report: 1000\nsave_every: 1000\nmax_seq_length: 256\n")
    (tmp_path / "lora.yaml").write_text(text)
    from mlx_lm.lora import yaml_loader

    mlx_yaml = yaml.load(text, yaml_loader)  # as mlx_lm.lora reads it

    model, tokenizer = mlx_lm.load(str(setup / "base"))
    train_set = load_local_dataset(Path(mlx_yaml["data"]), tokenizer, SimpleNamespace(mask_prompt=False))[0]
    rows: list[int] = []

    def counting(**kwargs):
        for batch in iterate_batches(**kwargs):
            rows.append(batch[0].shape[0])
            yield batch

    optimizer = optim.Adam(learning_rate=mlx_yaml["learning_rate"])
    args = TrainingArgs(batch_size=batch_size, iters=iters, grad_accumulation_steps=accumulation, steps_per_eval=1000,
                        steps_per_report=1000, steps_per_save=1000, adapter_file=str(tmp_path / "theirs.safetensors"))
    train(model, optimizer, CacheDataset(train_set), args=args, iterate_batches=counting)
    their_updates = optimizer.step.item()
    their_rows_per_update = sum(rows[:their_updates * accumulation]) // their_updates

    result = finetune(TrainConfig.from_yaml(tmp_path / "lora.yaml", finetune=True).replace(
        run_dir=str(tmp_path / "run")))
    trainer = result["trainer"]
    assert trainer.optimizer.step.item() == trainer.step == their_updates
    assert trainer.config.batch_size * trainer.config.gradient_accumulation == their_rows_per_update
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["training"]["max_steps"] == their_updates


def test_train_commands_on_a_finetune_run_say_what_to_run_instead(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_flags(setup, run)) == 0
    capsys.readouterr()
    for command in (["evaluate", "--checkpoint", str(run)], ["export", "--checkpoint", str(run), "-o",
                                                              str(tmp_path / "m.onnx")],
                    ["train", "--run-dir", str(run), "--resume"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "is from a fine-tuning run (mlx-train finetune of" in err, err
        assert f"continue it with `mlx-train finetune --run-dir {run} --resume`" in err and "--adapter-path" in err
        assert "unknown dataset" not in err
    assert main(["finetune", "--run-dir", str(run), "--resume", "--iters", "3"]) == 0  # the advice works
