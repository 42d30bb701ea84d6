"""`mlx-train train` and `mlx-train finetune` speak one language: the same flags with the same meaning,
-c/--config, --set, bare --resume with the run's saved config.yaml, the start-up banner."""

from __future__ import annotations

import os
import re
import sys

import pytest
import yaml

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.cli.flags import build_config  # noqa: E402
from mlx_train.cli.main import build_parser, main  # noqa: E402
from mlx_train.config import FinetuneConfig  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ftcli")
    llm_tiny.write_model_dir(str(root / "base"), seed=5)
    llm_tiny.write_data(str(root / "data"), "completion", n_train=12, n_valid=4)
    return root


def _finetune(setup, run, *extra):
    return ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--num-layers", "1",
            "--run-dir", str(run), *extra]


def _config(command, *flags):
    from mlx_train.cli.finetune import resolve_config as finetune_config
    from mlx_train.cli.train import resolve_config as train_config

    args = build_parser(command).parse_args([command, *flags])
    return (train_config if command == "train" else finetune_config)(args, log=lambda message: None)


@pytest.mark.parametrize("flags,field,value", [
    (["--lr", "0.02"], "learning_rate", 0.02),
    (["--learning-rate", "0.02"], "learning_rate", 0.02),
    (["--max-steps", "7"], "max_steps", 7),
    (["--batch-size", "3"], "batch_size", 3),
    (["--epochs", "2"], "epochs", 2),
    (["--seed", "9"], "seed", 9),
    (["--set", "ema_decay=0.9"], "ema_decay", 0.9),
    (["--set", "weight_decay=0.2", "--set", "optimizer=adamw"], "weight_decay", 0.2),
    (["--precision", "bf16"], "precision", "bfloat16"),
])
def test_a_flag_means_the_same_in_train_and_finetune(tmp_path, flags, field, value):
    common = ["--run-dir", str(tmp_path / "r")]
    trained = _config("train", *common, *flags)
    tuned = _config("finetune", *common, "--model", "base", "--data", "data", *flags)
    assert getattr(trained, field) == getattr(tuned, field) == value


def test_config_files_and_set_on_both_commands(tmp_path):
    (tmp_path / "c.yaml").write_text("training:\n  seed: 4\noptimizer:\n  name: sgd\n  momentum: 0.5\n")
    for command, extra in (("train", []), ("finetune", ["--model", "b", "--data", "d"])):
        for spelling in ("-c", "--config"):
            config = _config(command, spelling, str(tmp_path / "c.yaml"), "--set", "momentum=0.25", *extra)
            assert (config.seed, config.optimizer, config.momentum) == (4, "sgd", 0.25)


def test_mlx_lm_flags_count_iterations_against_the_final_accumulation(tmp_path):
    (tmp_path / "lora.yaml").write_text("iters: 100\nsteps_per_eval: 20\n")
    config = _config("finetune", "-c", str(tmp_path / "lora.yaml"), "--grad-accumulation-steps", "4", "--model", "b",
                     "--data", "d")
    assert (config.max_steps, config.eval_every, config.epochs) == (25, "5 steps", None)
    config = _config("finetune", "--iters", "12", "--save-every", "6", "--grad-accumulation-steps", "3",
                     "--model", "b", "--data", "d")
    assert (config.max_steps, config.checkpoint_every) == (4, "2 steps")
    # --max-steps is counted in optimizer steps in both commands; --epochs with it bounds the run as in train
    config = _config("finetune", "--max-steps", "12", "--grad-accumulation-steps", "3", "--model", "b", "--data", "d")
    assert (config.max_steps, config.epochs) == (12, None)
    assert _config("finetune", "--epochs", "2", "--model", "b", "--data", "d").max_steps is None


# finetune's flags before train and finetune shared one language (mlx_lm.lora's and mlx-lm-lora's names, and ours)
FORMER_FLAGS = ("--model --data --fine-tune-type --optimizer --num-layers --batch-size --iters --epochs --val-batches "
                "--learning-rate --steps-per-report --steps-per-eval --grad-accumulation-steps --resume-adapter-file "
                "--adapter-path --save-every --test-batches --max-seq-length --seed --run-dir --resume --report-to "
                "--project-name --run-name --train-mode --beta --dpo-loss-type --dpo-cpo-loss-type --label-smoothing "
                "--reference-model-path --mask-prompt --test --grad-checkpoint --pack --quantized --overwrite "
                "--reference-free --precompute-ref-log-probs -c --config --fuse").split()


def test_finetune_keeps_every_flag_it_had_and_takes_trains():
    def flags(command):
        parser = build_parser(command)._subcommands[command]
        return {flag for action in parser._actions for flag in action.option_strings}

    finetune = flags("finetune")
    assert not [flag for flag in FORMER_FLAGS if flag not in finetune]
    assert not sorted(flags("train") - finetune - {"--optimize-memory"})  # a memory plan is train's alone


def test_finetune_help_comes_from_the_fields(capsys):
    assert main(["finetune", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    fields = FinetuneConfig.fields_help()
    for name in ("num_layers", "pack", "train_mode", "max_steps", "batch_size"):
        assert " ".join(fields[name].help.split())[:40] in out, name
    for flag in ("--iters", "--steps-per-report", "--grad-accumulation-steps", "--lr", "--set", "--resume",
                 "--overwrite", "--data", "-c"):
        assert flag in out


def test_finetune_run_dir_config_yaml_banner_and_bare_resume(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_finetune(setup, run, "--iters", "2", "--batch-size", "4", "--lr", "1e-3", "--set",
                          "ema_decay=0.9")) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("mlx-train ") and "| MLX " in out.splitlines()[0]  # train's banner
    assert "step 2 |" in out  # train's progress lines
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["llm"]["num_layers"] == 1 and saved["training"]["ema_decay"] == 0.9
    assert saved["training"]["max_steps"] == 2 and saved["model"]["name"] == str(setup / "base")
    from mlx_train.training.ema import checkpoint_ema_weights

    assert checkpoint_ema_weights(str(run / "checkpoints" / "step-00000002"))  # EMA, as in train
    # bare --resume: the saved configuration, changed only where a resume may change it
    assert main(["finetune", "--run-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "max_steps 2 -> 3 (--max-steps 3)" in out and "finetune: 3 steps" in out
    assert yaml.safe_load((run / "config.yaml").read_text())["training"]["max_steps"] == 3
    assert main(["finetune", "--run-dir", str(run), "--resume", "--num-layers", "2"]) == 2
    err = capsys.readouterr().err
    assert "num_layers cannot change on resume" in err and "Traceback" not in err
    # --max-steps below the checkpoint's step would train nothing: said, not done silently
    assert main(["finetune", "--run-dir", str(run), "--resume", "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "step-00000003 is at step 3, past max_steps 2: the resumed run would train nothing; give --max-steps " \
           "above 3" in err
    assert main(["finetune", "--run-dir", str(run), "--resume"]) == 0
    assert "is at step 3 = max_steps: nothing is left to train" in capsys.readouterr().out


def test_finetune_resume_without_a_run_is_one_line(tmp_path, capsys):
    assert main(["finetune", "--run-dir", str(tmp_path / "none"), "--resume"]) == 4
    assert "nothing to resume" in capsys.readouterr().err
    assert main(["finetune", "--resume"]) == 2
    assert "pass --run-dir" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_finetune_distributed_on_two_local_ranks(setup, tmp_path, capsys, monkeypatch):
    """`finetune --distributed -n 2` runs the finetune subcommand on 2 ranks under train's supervisor: 2 x 2 rows
    per step train as one process with 4 rows per step does."""
    import json

    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores
    common = ["--iters", "3", "--lr", "1e-2", "--steps-per-report", "1", "--set", "num_workers=0", "--max-restarts",
              "0", "--val-batches", "1"]
    code = main(_finetune(setup, tmp_path / "two", "--distributed", "-n", "2", "--batch-size", "2", *common))
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert "distributed run: 2 processes x batch 2 x accumulation 1 = global batch 4" in out.out
    assert sorted(p.name for p in (tmp_path / "two").glob("heartbeat-*.json")) == ["heartbeat-0.json",
                                                                                    "heartbeat-1.json"]
    assert (tmp_path / "two" / "adapters" / "adapters.safetensors").exists()
    assert main(_finetune(setup, tmp_path / "one", "--batch-size", "4", *common)) == 0

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(row["step"], row["loss"]) for row in rows if row["kind"] == "train"]

    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert [s for s, _ in two] == [s for s, _ in one] == [1, 2, 3]
    assert [loss for _, loss in two] == pytest.approx([loss for _, loss in one], rel=1e-4)


def _help_defaults(capsys, command: str) -> dict[str, str]:
    assert main([command, "--help"]) == 0
    options = " ".join(capsys.readouterr().out.split()).split("options:")[1]
    return {flag: re.search(re.escape(flag) + r" [A-Z_]+[ ,].*?\(default: ([^;)]*)", options)[1]
            for flag in ("--batch-size", "--lr", "--optimizer", "--max-steps")
            if re.search(re.escape(flag) + r" [A-Z_]+[ ,]", options)}


def test_finetune_help_shows_fine_tuning_defaults(capsys):
    # the defaults fine-tuning uses (mlx_lm.lora's), not train's batch 32, lr 1e-3, adamw
    assert _help_defaults(capsys, "finetune") == {"--batch-size": "4", "--lr": "1e-05", "--optimizer": "adam",
                                                  "--max-steps": "1000"}
    assert _help_defaults(capsys, "train") == {"--batch-size": "32", "--lr": "0.001", "--max-steps": "none"}


def test_a_fine_tuning_flag_given_to_train_says_where_it_goes(capsys):
    with pytest.raises(ConfigError, match=r"--set train_mode=dpo: train_mode is a fine-tuning setting: pass it to "
                                          r"FinetuneConfig / mlx-train finetune --train-mode"):
        build_config(build_parser("train").parse_args(["train", "--set", "train_mode=dpo"]))


def test_set_merges_into_the_config_file_s_mapping(tmp_path):
    from mlx_train.cli.finetune import resolve_config

    (tmp_path / "lora.yaml").write_text("model: base\ndata: data\nlora_parameters: {rank: 16, scale: 2.0}\n")
    args = build_parser("finetune").parse_args(["finetune", "-c", str(tmp_path / "lora.yaml"), "--set",
                                                 "lora_parameters.scale=10", "--set", "model_options.x=1"])
    config = resolve_config(args, log=lambda message: None)
    assert isinstance(config, FinetuneConfig)
    assert config.lora_parameters == {"rank": 16, "scale": 10} and config.model_options == {"x": 1}


@pytest.mark.parametrize("yaml_text,flags,said", [
    ("lora_parameters:\n  rank: eight\n", [], "lora.yaml:3: lora_parameters has rank 'eight' (str), which must be a "
     "whole number of at least 1"),
    ("lora_parameters: {rank: 8, dropout: high}\n", [], "lora.yaml:3: lora_parameters has dropout 'high' (str), "
     "which must be a number in [0, 1)"),
    ("lora_parameters: 8\n", [], "lora.yaml:3: lora_parameters must be a mapping {rank, scale, dropout, keys}"),
    ("lr_schedule: {name: cosine_decay, arguments: [1e-5, abc]}\n", [],
     "lora.yaml:3: lr_schedule_args has 'abc' (str) at position 0, which must be a number: cosine_decay's"),
    ("", ["--set", "lora_parameters.rank=abc"], "--set lora_parameters.rank=abc: FinetuneConfig.lora_parameters has "
     "rank 'abc' (str), which must be a whole number"),
    ("", ["--set", "lora_parameters.rnak=4"], "lora_parameters has unknown key 'rnak' (did you mean 'rank'?)"),
])
def test_a_value_of_the_wrong_type_is_a_sentence_naming_the_key(tmp_path, capsys, yaml_text, flags, said):
    (tmp_path / "lora.yaml").write_text(f"model: base\ndata: data\n{yaml_text}")
    assert main(["finetune", "-c", str(tmp_path / "lora.yaml"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "unexpected error" not in err, err
    assert FinetuneConfig(lora_parameters={"rank": "16", "scale": "2e-1"}).lora_parameters == {"rank": 16,
                                                                                                "scale": 0.2}


def test_iters_that_leave_iterations_without_an_update_are_said(capsys):
    """mlx_lm.lora updates every grad_accumulation_steps iterations, so --iters 3 with accumulation 2 is one update
    there as here: the iteration left over is said, not dropped silently."""
    with pytest.warns(UserWarning, match=r"--iters 3: iters 3 counts iterations; with gradient_accumulation 2 that "
                                         r"is 1 optimizer step \(2 iterations\): the last 1 iteration would make no "
                                         r"update .*give iters a multiple of 2"):
        config = _config("finetune", "--model", "base", "--data", "data", "--iters", "3",
                         "--grad-accumulation-steps", "2")
    assert config.max_steps == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a multiple: nothing to say
        assert _config("finetune", "--model", "base", "--data", "data", "--iters", "4",
                       "--grad-accumulation-steps", "2").max_steps == 2


def test_an_mlx_lm_file_whose_data_is_smaller_than_one_step_is_told_in_its_own_numbers(setup, tmp_path, capsys):
    """2 rows, batch_size 2, grad_accumulation_steps 2: mlx_lm.lora repeats its one batch within a step; here a
    step never takes a row twice, and the refusal says so with the file's numbers (not a global batch of 4)."""
    (tmp_path / "two").mkdir()
    lines = (setup / "data" / "train.jsonl").read_text().splitlines()
    (tmp_path / "two" / "train.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (tmp_path / "two.yaml").write_text(f"model: {setup / 'base'}\ndata: {tmp_path / 'two'}\niters: 8\nbatch_size: 2\n"
                                       "grad_accumulation_steps: 2\nnum_layers: 1\n")
    assert main(["finetune", "-c", str(tmp_path / "two.yaml"), "--run-dir", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert "the training set has 2 rows, fewer than one optimizer step of batch_size 2 x grad_accumulation_steps 2 " \
           "= 4 rows" in err and "use grad_accumulation_steps 1, or add rows" in err
    assert "batch_size 4" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run started: nothing written


def test_no_validation_is_said(setup, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text((setup / "data" / "train.jsonl").read_text())
    (tmp_path / "data" / "valid.jsonl").write_text("")
    assert main(["finetune", "--model", str(setup / "base"), "--data", str(tmp_path / "data"), "--num-layers", "1",
                 "--iters", "1", "--batch-size", "2", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "no validation: " in out and "valid.jsonl is missing or empty" in out


def test_resume_adapter_file_keeps_its_settings_and_refuses_a_conflicting_one(setup, tmp_path, capsys):
    """--resume-adapter-file continues the file's adapters as they are: an explicit --num-layers that differs is
    refused before the model loads; a default that differs is replaced, and the run says so."""
    first = str(tmp_path / "first")
    common = ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--iters", "1",
              "--batch-size", "2"]
    assert main([*common, "--num-layers", "1", "--set", "lora_parameters.rank=4", "--adapter-path", first]) == 0
    capsys.readouterr()
    assert main([*common, "--num-layers", "2", "--resume-adapter-file", first, "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"num_layers 2 differs from the adapters of --resume-adapter-file {first}, which have num_layers 1" in err
    assert "none" not in err.split("num_layers 2")[0]  # refused before the (missing) model is loaded
    assert main([*common, "--resume-adapter-file", first, "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"continuing the adapters of {first} with their own num_layers 1 (not the default 16), " \
           "lora_parameters.rank 4 (not the default 8)" in out
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["llm"]
    assert saved["num_layers"] == 1 and saved["lora_parameters"]["rank"] == 4  # what was trained


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_its_config(setup, tmp_path, capsys):
    """As `train --resume`: a finetune run killed before its first complete checkpoint (config.yaml, metrics, no
    checkpoint) goes on with --resume from its config.yaml, instead of 'nothing to resume' / 'use --resume'."""
    import shutil

    run = tmp_path / "run"
    assert main(_finetune(setup, run, "--iters", "2", "--batch-size", "2", "--lr", "1e-3")) == 0
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "adapters")  # what a kill before the first checkpoint leaves: config.yaml, logs
    capsys.readouterr()
    assert main(_finetune(setup, run, "--iters", "2")) == 2  # a new start is refused, as before
    assert "--resume" in capsys.readouterr().err
    assert main(["finetune", "--run-dir", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} with the configuration of {run / 'config.yaml'}" in out
    assert "starting from scratch" in out and "finetune: 2 steps" in out
    assert (run / "checkpoints" / "step-00000002").is_dir() and (run / "adapters" / "adapters.safetensors").is_file()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optimizer"]["learning_rate"] == 1e-3 and saved["llm"]["num_layers"] == 1  # the run's own


def test_fuse_writes_only_into_a_new_or_empty_directory_outside_the_base(setup, tmp_path):
    from mlx_train.llm.finetune import check_fuse_target, fuse_model

    (tmp_path / "models").mkdir()
    gguf = tmp_path / "models" / "base.gguf"
    gguf.write_bytes(b"GGUF")
    check_fuse_target(str(gguf), str(tmp_path / "models" / "tuned"))  # beside a .gguf file: a new directory
    (tmp_path / "empty").mkdir()
    check_fuse_target(str(setup / "base"), str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"--fuse .*base\.gguf is a file \(the base model\)"):
        check_fuse_target(str(gguf), str(gguf))
    with pytest.raises(ConfigError, match="is inside the base model's directory"):
        check_fuse_target(str(setup / "base"), str(setup / "base" / "fused"))
    with pytest.raises(ConfigError, match=r"--fuse .*models is not empty \(base\.gguf\): the fused model is written "
                                          "only into a new or empty directory"):
        check_fuse_target(str(setup / "base"), str(tmp_path / "models"))
    with pytest.raises(ConfigError, match="is not empty"):  # the Python API too, before loading anything
        fuse_model(str(setup / "base"), str(tmp_path / "no-adapters"), str(tmp_path / "models"))
