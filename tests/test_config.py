"""TrainConfig: fields, YAML loading (seed schema), errors with file:line, round trips, cadences."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from mlx_train.config import (
    SECTIONS,
    Every,
    FieldHelp,
    FinetuneConfig,
    LaunchConfig,
    TrainConfig,
    metric_direction,
    parse_every,
)
from mlx_train.errors import ConfigError

# The two YAML blocks of shared/seeds/002_* ("Training Settings", "Optimization"), unchanged.
SEED_YAML = """\
training:
  batch_size: 32
  learning_rate: 2e-5
  num_epochs: 100
  early_stopping_patience: 5
  checkpoint_frequency: 10
  seed: 42
  mixed_precision: true
  gradient_accumulation_steps: 8

optimizer:
  name: "adamw"
  beta1: 0.9
  beta2: 0.999
  epsilon: 1e-8
  weight_decay: 0.01
"""

# The contract's field table: name -> (annotation, default).
SPEC_FIELDS = {
    "epochs": ("int | None", 10), "max_steps": ("int | None", None), "batch_size": ("int", 32),
    "gradient_accumulation": ("int", 1), "learning_rate": ("float", 1e-3),
    "lr_schedule": ("str | None", None), "lr_schedule_args": ("list", []), "warmup_steps": ("int", 0),
    "warmup_init": ("float", 0.0), "optimizer": ("str", "adamw"), "beta1": ("float", 0.9),
    "beta2": ("float", 0.999), "epsilon": ("float", 1e-8), "bias_correction": ("bool", False),
    "weight_decay": ("float", 0.01),
    "momentum": ("float", 0.0), "precision": ("str", "float32"), "loss_scale": ("float", 65536.0),
    "loss_scale_window": ("int", 1000), "max_grad_norm": ("float | None", None), "seed": ("int", 0),
    "compile": ("bool", True), "gradient_checkpointing": ("bool | str", False), "checkpoint_modules": ("list", []),
    "memory_limit": ("int | None", None), "oom_recovery": ("bool", True),
    "report_every": ("str", "10 steps"), "eval_every": ("str", "1 epoch"),
    "checkpoint_every": ("str", "1 epoch"), "keep_last": ("int", 3), "keep_best": ("int", 1),
    "monitor": ("str", "val_loss"), "monitor_mode": ("str", "auto"),
    "early_stopping_patience": ("int | None", None), "early_stopping_min_delta": ("float", 0.0),
    "nonfinite": ("str", "raise"), "val_batches": ("int | None", None),
    "num_workers": ("int", 2), "shuffle": ("bool", True), "drop_last": ("bool", True),
    "eval_batch_size": ("int | None", None),
    "distributed_backend": ("str", "auto"), "distributed_strategy": ("str", "data_parallel"),
    "max_restarts": ("int", 3), "collective_timeout": ("float", 300.0),
    "checksum_every": ("int | None", None), "checksum_action": ("str", "raise"), "run_dir": ("str | None", None),
    "checkpoint_dir": ("str | None", None), "model": ("str", "mlp"), "model_options": ("dict", {}),
    "dataset": ("str", "digits"), "dataset_options": ("dict", {}),
    "report_to": ("list", []), "project_name": ("str | None", None), "run_name": ("str | None", None),
    "ema_decay": ("float | None", None), "prune_sparsity": ("float | None", None), "prune_start": ("int", 0),
    "prune_end": ("int | None", None), "prune_frequency": ("int", 100), "prune_schedule": ("str", "polynomial"),
    "prune_scope": ("str", "global"),
    # llm: mlx-train finetune
    "fine_tune_type": ("str", "lora"), "num_layers": ("int", 16),
    "lora_parameters": ("dict", {"rank": 8, "scale": 20.0, "dropout": 0.0}), "max_seq_length": ("int", 2048),
    "mask_prompt": ("bool", False), "assistant_only_loss": ("bool", False), "train_on_tool_calls": ("bool", True),
    "train_on_reasoning": ("bool", True), "pack": ("bool | str", False), "loss_chunk": ("int | None", None),
    "adapter_path": ("str", "adapters"),
    "resume_adapter_file": ("str | None", None), "quantized": ("bool | None", None), "train_vision": ("bool", False),
    "test": ("bool", False),
    "test_batches": ("int | None", 500), "train_mode": ("str", "sft"), "beta": ("float", 0.1),
    "dpo_loss_type": ("str", "sigmoid"), "label_smoothing": ("float", 0.0), "reference_free": ("bool", False),
    "reference_model_path": ("str | None", None), "precompute_ref_log_probs": ("bool", False),
    "group_size": ("int", 4), "max_completion_length": ("int", 512), "temperature": ("float", 0.8),
    "top_p": ("float", 0.95), "top_k": ("int", 20), "clip_epsilon": ("float", 1e-4),
    "epsilon_high": ("float | None", None),
    "grpo_loss_type": ("str", "grpo"), "importance_sampling_level": ("str", "token"), "scale_rewards": ("str", "group"),
    "reward_functions": ("list | None", None), "reward_functions_file": ("str | None", None),
    "reward_weights": ("list | None", None), "num_iterations": ("int", 1),
}


def load(tmp_path, text: str, name: str = "custom.yaml") -> TrainConfig:
    path = tmp_path / name
    path.write_text(text)
    return TrainConfig.from_yaml(path)


def changed(config: TrainConfig) -> dict:
    defaults = type(config)().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != defaults[k]}


def test_fields_match_the_contract_and_all_have_help():
    # the Trainer's fields, and the llm section FinetuneConfig adds to them
    # the Trainer's fields, the launcher's that LaunchConfig adds and the llm section FinetuneConfig adds
    trainer = TrainConfig.fields_help()
    launcher = {name: h for name, h in LaunchConfig.fields_help().items() if name not in trainer}
    finetuning = {name: h for name, h in FinetuneConfig.fields_help().items() if name not in {**trainer, **launcher}}
    info = {**trainer, **launcher, **finetuning}
    assert {name: (h.type, h.default) for name, h in info.items()} == SPEC_FIELDS
    # declared section by section, in the order of the YAML layout
    sections = [h.section for h in trainer.values()]
    assert sections == sorted(sections, key=SECTIONS.index) and set(sections) == set(SECTIONS) - {"llm"}
    assert list(launcher) == ["max_restarts"] and launcher["max_restarts"].section == "distributed"
    assert {h.section for h in finetuning.values()} == {"llm"}
    assert all(isinstance(h, FieldHelp) and len(h.help) > 20 for h in info.values())
    assert info["precision"].choices == ("float32", "bfloat16", "float16")
    assert "adamw" in info["optimizer"].choices and "cosine_decay" in info["lr_schedule"].choices
    # fields_help hands out copies: mutating one must not change the defaults
    info["lr_schedule_args"].default.append(1)
    assert TrainConfig().lr_schedule_args == []


def test_seed_yaml_loads_unchanged(tmp_path):
    config = load(tmp_path, SEED_YAML)
    assert changed(config) == {
        "epochs": 100, "gradient_accumulation": 8, "learning_rate": 2e-5, "early_stopping_patience": 5,
        "checkpoint_every": "10 epochs", "seed": 42, "precision": "bfloat16"}
    assert isinstance(config.learning_rate, float) and isinstance(config.epsilon, float)
    assert config.epsilon == 1e-8 and config.optimizer == "adamw"


def test_aliases_add_no_defaults(tmp_path):
    assert load(tmp_path, "") == TrainConfig()
    assert load(tmp_path, "training:\n  num_epochs: 7\n") == TrainConfig(epochs=7)
    assert changed(load(tmp_path, "training:\n  mixed_precision: false\n")) == {}
    assert load(tmp_path, "training:\n  checkpoint_frequency: 500 steps\n").checkpoint_every == "500 steps"


def test_sections_options_and_flat_keys(tmp_path):
    config = load(tmp_path, "optimizer:\n  name: SGD\n  momentum: 0.9\n  lr_schedule: cosine_decay\n"
                            "  lr_schedule_args: [1000, 1e-5]\nmodel:\n  name: cnn\n  hidden: [64, 64]\n"
                            "data:\n  name: mnist\n  path: /data/mnist\n  batch_size: 16\nseed: 3\n")
    assert changed(config) == {
        "optimizer": "sgd", "momentum": 0.9, "lr_schedule": "cosine_decay", "lr_schedule_args": [1000, 1e-5],
        "model": "cnn", "model_options": {"hidden": [64, 64]}, "dataset": "mnist",
        "dataset_options": {"path": "/data/mnist"}, "batch_size": 16, "seed": 3}


def test_numbers_and_bools(tmp_path):
    config = load(tmp_path, "training:\n  learning_rate: 1\n  max_steps: 1e4\n  max_grad_norm: '1.5'\n")
    assert config.learning_rate == 1.0 and type(config.learning_rate) is float
    assert config.max_steps == 10000 and type(config.max_steps) is int
    assert config.max_grad_norm == 1.5
    with pytest.raises(ConfigError, match=r"custom.yaml:2: training.shuffle must be true or false, got 1 \(int\)"):
        load(tmp_path, "training:\n  shuffle: 1\n")
    with pytest.raises(ConfigError, match=r"training.compile must be true or false, got 'true' \(str\)"):
        load(tmp_path, "training:\n  compile: 'true'\n")
    with pytest.raises(ConfigError, match=r"custom.yaml:3: training.batch_size must be an integer, got 32.5"):
        load(tmp_path, "training:\n  seed: 1\n  batch_size: 32.5\n")
    with pytest.raises(ConfigError, match=r"optimizer.learning_rate must be a number, got 'fast' \(str\)"):
        load(tmp_path, "optimizer:\n  learning_rate: fast\n")
    with pytest.raises(ConfigError, match=r"custom.yaml:2: training.eval_batch_size must be an integer or null, "
                                          r"got \[1\] \(list\)"):
        load(tmp_path, "training:\n  eval_batch_size: [1]\n")


@pytest.mark.parametrize("text, message", [
    ("training:\n  batch_size: 32\n  batch_sise: 4\n",
     r"custom.yaml:3: unknown key 'batch_sise' in section 'training' \(did you mean 'batch_size'\?\)"),
    ("trainig:\n  batch_size: 3\n", r"custom.yaml:1: unknown top-level key 'trainig' \(did you mean 'training'\?\)"),
    ("optimizer:\n  nme: adam\n", r"custom.yaml:2: unknown key 'nme' in section 'optimizer' \(did you mean 'name'\?\)"),
    ("data:\n  shufle: false\n", r"custom.yaml:2: unknown key 'shufle' in section 'data' \(did you mean 'shuffle'\?\)"),
    ("optimizer:\n  name: adamm\n", r"custom.yaml:2: optimizer.name must be one of adam, .*got 'adamm' "
                                    r"\(did you mean 'adam'\?\)"),
    ("optimizer:\n  lr_schedule: cosine\n", r"custom.yaml:2: optimizer.lr_schedule must be one of .*"
                                            r"\(did you mean 'cosine_decay'\?\)"),
    ("training:\n  epochs: 0\n", r"custom.yaml:2: training.epochs must be at least 1, got 0"),
    ("training:\n  precision: fp8\n", r"training.precision must be one of float32, bfloat16, float16, got 'fp8'"),
    ("training:\n  eval_every: sometimes\n", r"custom.yaml:2: training.eval_every must be 'N steps' or 'N epochs'"),
    ("training:\n  batch_size: [1,\n  x: 2\n", r"custom.yaml:4: invalid YAML: .*expected ',' or ']'"),
    ("training:\n  seed: 1\n  seed: 2\n", r"custom.yaml:3: key 'training.seed' appears twice \(first at line 2\)"),
    ("training:\n  epochs: 3\n  num_epochs: 4\n",
     r"custom.yaml:3: training.num_epochs sets epochs, which training.epochs \(line 2\) already sets"),
    ("training:\n  batch_size: 3\ndata:\n  batch_size: 4\n", r"custom.yaml:4: data.batch_size sets batch_size"),
    ("optimizer:\n  lr_schedule_args: [10]\n",
     r"custom.yaml:2: optimizer.lr_schedule_args is set but lr_schedule is null"),
    ("training: 5\n", r"custom.yaml:1: section 'training' must be a mapping"),
    ("- a\n- b\n", r"custom.yaml: a config must be a mapping of sections"),
])
def test_yaml_errors_say_what_and_where(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"cannot read config file nope/custom.yaml"):
        TrainConfig.from_yaml("nope/custom.yaml")


def test_replace_checks_names_and_types():
    base = TrainConfig()
    new = base.replace(batch_size=64, learning_rate="3e-4", precision="bf16", report_every=50)
    assert (new.batch_size, new.learning_rate, new.precision, new.report_every) == (64, 3e-4, "bfloat16", "50 steps")
    assert base == TrainConfig()  # the original is untouched
    with pytest.raises(ConfigError, match=r"unknown TrainConfig option 'batchsize' \(did you mean 'batch_size'\?\)"):
        base.replace(batchsize=3)
    with pytest.raises(ConfigError, match=r"TrainConfig.compile must be true or false, got 'yes'"):
        base.replace(compile="yes")
    with pytest.raises(ConfigError, match=r"TrainConfig.beta2 must be in \[0, 1\), got 1.0"):
        TrainConfig(beta2=1.0)
    with pytest.raises(ConfigError, match=r"TrainConfig.batch_size must be at least 1, got -2"):
        TrainConfig(batch_size=-2)


def test_dict_and_yaml_round_trip(tmp_path):
    config = TrainConfig(epochs=3, max_steps=100, lr_schedule="cosine_decay", lr_schedule_args=[50, 1e-6],
                         warmup_steps=5, max_grad_norm=1.0, precision="float16", eval_every="2 epochs",
                         model_options={"hidden": [32, 32], "dropout": 0.1}, dataset_options={"n": 5},
                         run_dir="runs/a", compile=False, early_stopping_patience=2)
    as_json = json.loads(json.dumps(config.to_dict()))
    assert TrainConfig.from_dict(as_json) == config
    config.to_yaml(tmp_path / "out.yaml")
    assert TrainConfig.from_yaml(tmp_path / "out.yaml") == config
    assert TrainConfig.from_dict({"training": {"num_epochs": 2}, "optimizer": {"name": "sgd"}}) == \
        TrainConfig(epochs=2, optimizer="sgd")
    with pytest.raises(ConfigError, match=r"<dict>: unknown top-level key 'epoch' \(did you mean 'epochs'\?\)"):
        TrainConfig.from_dict({"epoch": 3})


def test_parse_every():
    assert parse_every("2 epochs") == Every(2, "epoch")
    assert parse_every("1 epoch") == Every(1, "epoch") == parse_every("epoch")
    assert parse_every(500) == parse_every("500") == parse_every("500 steps") == Every(500, "step")
    assert str(Every(1, "epoch")) == "1 epoch" and str(Every(10, "step")) == "10 steps"
    assert [Every(3, "step").due(n) for n in range(7)] == [False, False, False, True, False, False, True]
    for bad in ("0 steps", "1.5 epochs", "often", True, ""):
        with pytest.raises(ConfigError, match=r"cadence must be"):
            parse_every(bad)


def test_parse_value_for_cli_strings():
    assert TrainConfig.parse_value("lr_schedule_args", "[1000, 1e-5]") == [1000, 1e-5]
    assert TrainConfig.parse_value("learning_rate", "2e-5") == 2e-5
    assert TrainConfig.parse_value("max_grad_norm", "none") is None
    assert TrainConfig.parse_value("run_dir", "123") == "123"
    assert TrainConfig.parse_value("shuffle", "false") is False
    assert TrainConfig.parse_value("checkpoint_every", "3") == "3 steps"
    with pytest.raises(ConfigError, match=r"batch_size must be an integer, got 'x'"):
        TrainConfig.parse_value("batch_size", "x")
    with pytest.raises(ConfigError,
                       match=r"unknown TrainConfig option 'learning_rte' \(did you mean 'learning_rate'\?\)"):
        TrainConfig.parse_value("learning_rte", "1")


def test_monitor_direction():
    assert TrainConfig().monitor_direction() == "min"
    assert TrainConfig(monitor="val_accuracy").monitor_direction() == "max"
    assert TrainConfig(monitor="val_accuracy", monitor_mode="min").monitor_direction() == "min"
    assert TrainConfig(monitor="val_f1").monitor_direction() == "max"
    assert dataclasses.is_dataclass(TrainConfig)


# ----------------------------------------------------------------- sections, one declaration per field
def test_to_yaml_writes_the_sections_users_write(tmp_path):
    config = TrainConfig(epochs=3, optimizer="sgd", momentum=0.9, checkpoint_every="2 epochs", precision="bf16",
                         distributed_backend="ring", model_options={"hidden_dims": [8]},
                         dataset_options={"path": "/data"}, batch_size=16)
    config.to_yaml(tmp_path / "out.yaml")
    written = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert list(written) == [s for s in SECTIONS if s != "llm"]  # a train run: the llm section is all defaults
    assert written["optimizer"]["name"] == "sgd" and written["optimizer"]["momentum"] == 0.9
    assert "beta1" not in written["optimizer"]  # sgd does not use it
    assert written["checkpoint"]["checkpoint_every"] == "2 epochs" and written["memory"]["precision"] == "bfloat16"
    assert written["distributed"]["backend"] == "ring" and written["data"]["batch_size"] == 16
    assert written["model"] == {"name": "mlp", "hidden_dims": [8]} and written["data"]["path"] == "/data"
    assert TrainConfig.from_yaml(tmp_path / "out.yaml") == config
    tuned = FinetuneConfig(**config.to_dict()).replace(num_layers=4, pack=True)  # fine-tuning keys: FinetuneConfig
    tuned.to_yaml(tmp_path / "tuned.yaml")
    written = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert list(written) == list(SECTIONS) and written["llm"]["num_layers"] == 4 and written["llm"]["pack"] is True
    assert TrainConfig.from_yaml(tmp_path / "tuned.yaml", finetune=True) == tuned
    # an option whose name a field of its section already has stays whole, so it reads back
    clash = TrainConfig(model_options={"name": "x"}, dataset_options={"shufle": 1})
    clash.to_yaml(tmp_path / "clash.yaml")
    assert TrainConfig.from_yaml(tmp_path / "clash.yaml") == clash


def test_every_section_reads_its_own_keys(tmp_path):
    (tmp_path / "custom.yaml").write_text("checkpoint:\n  keep_last: 5\n  checkpoint_frequency: 2\nmemory:\n  "
                                          "mixed_precision: true\n  memory_limit: 8GB\ndistributed:\n  backend: ring\n"
                                          "  max_restarts: 0\n")
    config = LaunchConfig.from_yaml(tmp_path / "custom.yaml")  # max_restarts: the launcher's setting
    assert changed(config) == {"keep_last": 5, "checkpoint_every": "2 epochs", "precision": "bfloat16",
                               "memory_limit": 8_000_000_000, "distributed_backend": "ring", "max_restarts": 0}
    with pytest.raises(ConfigError, match=r"custom.yaml:3: unknown key 'batch_size' in section 'optimizer'; "
                                          r"batch_size belongs in section 'data' \(or 'training'\)"):
        load(tmp_path, "optimizer:\n  name: adam\n  batch_size: 3\n")
    with pytest.raises(ConfigError, match=r"custom.yaml:2: unknown key 'learning_rate' in section 'data'; "
                                          r"learning_rate belongs in section 'optimizer'"):
        load(tmp_path, "data:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"custom.yaml:2: unknown key 'bakend' in section 'distributed' "
                                          r"\(did you mean 'backend'\?\); valid keys: backend, strategy, max_restarts"):
        load(tmp_path, "distributed:\n  bakend: ring\n")


def test_distributed_and_device_configs_are_the_same_fields():
    from mlx_train.device import DeviceConfig
    from mlx_train.distributed.config import DistributedConfig

    def spec(cls, name):
        return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["option"]

    for theirs, ours in [("batch_size_per_device", "batch_size"), ("gradient_accumulation", "gradient_accumulation"),
                         ("backend", "distributed_backend"), ("max_restarts", "max_restarts"),
                         ("collective_timeout", "collective_timeout"), ("checksum_every", "checksum_every")]:
        owner = LaunchConfig if ours == "max_restarts" else TrainConfig  # the launcher's setting: LaunchConfig's
        assert spec(DistributedConfig, theirs) is spec(owner, ours)  # one declaration, not a copy
        assert getattr(DistributedConfig(), theirs) == getattr(owner(), ours)
    assert spec(DeviceConfig, "memory_limit") is spec(TrainConfig, "memory_limit")
    assert DeviceConfig(memory_limit="1GB").memory_limit == TrainConfig(memory_limit="1GB").memory_limit == 10**9
    overrides = DistributedConfig(batch_size_per_device=8, backend="ring", checksum_every=5).train_overrides()
    assert changed(TrainConfig().replace(**overrides)) == {"batch_size": 8, "distributed_backend": "ring",
                                                           "checksum_every": 5}
    with pytest.raises(ConfigError, match=r"DistributedConfig.batch_size_per_device: TrainConfig.batch_size must be "
                                          r"at least 1, got 0"):
        DistributedConfig(batch_size_per_device=0)


def test_config_imports_neither_optim_nor_the_distributed_package():
    code = ("import sys, mlx_train.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('mlx_train.optim', 'mlx_train.distributed', "
            "'mlx_train.device', 'mlx.core'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------- the errors of the bug report
def test_mixed_precision_must_be_true_or_false(tmp_path):
    with pytest.raises(ConfigError, match=r"custom.yaml:3: training.mixed_precision must be true or false "
                                          r"\(true: bfloat16 compute, false: float32\), got 'maybe' \(str\)"):
        load(tmp_path, "training:\n  seed: 1\n  mixed_precision: maybe\n")
    with pytest.raises(ConfigError, match=r"memory.mixed_precision must be true or false .*got 'bf16'"):
        load(tmp_path, "memory:\n  mixed_precision: bf16\n")


def test_hyper_parameters_the_optimizer_does_not_use_are_errors(tmp_path):
    seed_with_sgd = SEED_YAML.replace('name: "adamw"', 'name: "sgd"')
    with pytest.raises(ConfigError, match=r"custom.yaml:13: optimizer.beta1 is set to 0.9, but optimizer 'sgd' does "
                                          r"not use beta1 \(it uses momentum, weight_decay\); remove beta1, or choose "
                                          r"an optimizer that uses it: adam, adamw, adamax and lion"):
        load(tmp_path, seed_with_sgd)  # written in the file: an error even at its default value
    with pytest.raises(ConfigError, match=r"training.momentum is set to 0.9, but optimizer 'adamw' does not use "
                                          r"momentum"):
        load(tmp_path, "training:\n  momentum: 0.9\n")
    with pytest.raises(ConfigError, match=r"TrainConfig.epsilon is set to 1e-06, but optimizer 'lion' does not use "
                                          r"epsilon"):
        TrainConfig(optimizer="lion", epsilon=1e-6)
    with pytest.raises(ConfigError, match=r"TrainConfig.momentum is set to 0.9, but optimizer 'adamw'"):
        TrainConfig(optimizer="sgd", momentum=0.9).replace(optimizer="adamw")
    # a flat dict (to_dict()) holds every field: there only values that differ from the default count
    assert TrainConfig.from_dict(TrainConfig(optimizer="sgd").to_dict()).optimizer == "sgd"
    assert TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.0).momentum == 0.9


@pytest.mark.parametrize("value", ["0", "-1e-3"])
def test_learning_rate_must_be_positive(tmp_path, value):
    with pytest.raises(ConfigError, match=r"custom.yaml:2: optimizer.learning_rate must be above 0, got -?0.0*1?: "
                                          r"a rate of 0 never changes the weights"):
        load(tmp_path, f"optimizer:\n  learning_rate: {value}\n")
    with pytest.raises(ConfigError, match=r"TrainConfig.learning_rate must be above 0"):
        TrainConfig(learning_rate=float(value))
    with pytest.raises(ConfigError, match=r"learning_rate must be above 0"):
        TrainConfig.parse_value("learning_rate", value)


# ----------------------------------------------------------------- which way a metric improves
@pytest.mark.parametrize("name, direction", [
    ("val_loss", "min"), ("loss", "min"), ("val_perplexity", "min"), ("val_ppl", "min"), ("val_error_rate", "min"),
    ("val_mse", "min"), ("val_accuracy", "max"), ("val_acc", "max"), ("accuracy", "max"), ("val_f1", "max"),
    ("val_f1_macro", "max"), ("val_precision", "max"), ("val_recall", "max"), ("val_auc", "max"), ("val_top5", "max"),
    ("eval/bleu", "max"), ("val_reward", "max"), ("my_custom_metric", "min"), ("val_accuracy_loss", "min"),
])
def test_metric_direction(name, direction):
    assert metric_direction(name) == direction
    assert metric_direction(name, "max") == "max" and metric_direction(name, "min") == "min"  # explicit wins


def test_every_place_that_ranks_a_metric_uses_metric_direction(tmp_path):
    from mlx_train.checkpointing.manager import CheckpointManager
    from mlx_train.monitor.run import RunSnapshot
    from mlx_train.training.callbacks import EarlyStopping, ModelCheckpoint

    for name in ("val_f1", "val_perplexity", "val_recall", "custom"):
        expected = metric_direction(name)
        assert TrainConfig(monitor=name).monitor_direction() == expected
        assert EarlyStopping(monitor=name).mode == expected
        assert ModelCheckpoint(str(tmp_path / "best.safetensors"), monitor=name).mode == expected
        assert CheckpointManager(str(tmp_path / "ckpt"), monitor=name, mode="auto").mode == expected
        snapshot = RunSnapshot(str(tmp_path), {}, [], [{"step": 1, name: 0.5}, {"step": 2, name: 0.7}], [], [], [], [],
                               0.0)
        assert snapshot.best(name) == ((0.7, 2) if expected == "max" else (0.5, 1))
    assert TrainConfig(monitor="val_f1", monitor_mode="min").monitor_direction() == "min"
    with pytest.raises(ConfigError, match=r"mode must be 'min', 'max' or 'auto', got 'up'"):
        metric_direction("val_loss", "up")


def test_epochs_null_runs_as_many_passes_as_max_steps_needs():
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_train.training import Trainer

    with pytest.raises(ConfigError, match="epochs is null .* but max_steps is null too"):
        TrainConfig(epochs=None)
    x, y = mx.random.normal((20, 4)), mx.zeros((20,), dtype=mx.int32)
    trainer = Trainer(nn.Linear(4, 2), config=TrainConfig(epochs=None, max_steps=7, batch_size=4, num_workers=0,
                                                          report_every="100 steps"))
    trainer.train((x, y))
    assert trainer.step == 7 and trainer.epochs == 2  # 5 steps per epoch: the run goes on into the second


def test_an_exponent_without_a_dot_is_a_float_whatever_was_imported_before():
    # plain YAML 1.1 reads 1e-4 as a string; mlx_lm.lora, when imported, changes yaml.SafeLoader itself
    code = ("import yaml\n"
            "from mlx_train.config.files import load_yaml\n"
            "assert yaml.safe_load('x: 1e-4') == {'x': '1e-4'}, 'yaml.SafeLoader is pristine here'\n"
            "print(repr(load_yaml('lr: 1e-4\\nwd: -2E-3\\nname: 1e4abc\\nsteps: 10')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "{'lr': 0.0001, 'wd': -0.002, 'name': '1e4abc', 'steps': 10}"


# ---------------------------------------------------------------------- sections as types
def test_a_fine_tuning_setting_given_to_the_trainer_says_where_it_goes(tmp_path):
    from mlx_train.config import MisplacedSetting

    where = r"train_mode is a fine-tuning setting: pass it to FinetuneConfig / mlx-train finetune --train-mode"
    with pytest.raises(MisplacedSetting, match=where):
        TrainConfig(train_mode="dpo")
    with pytest.raises(MisplacedSetting, match=where):
        TrainConfig().replace(train_mode="dpo")
    with pytest.raises(MisplacedSetting, match="pack is a fine-tuning setting: pass it to FinetuneConfig / mlx-train "
                                               "finetune --pack"):
        TrainConfig(pack=True)
    with pytest.raises(MisplacedSetting, match=where):
        TrainConfig.parse_value("train_mode", "dpo")
    # a file for the Trainer: the file is named; with finetune=True the same file is a FinetuneConfig
    path = tmp_path / "tuned.yaml"
    path.write_text("training:\n  epochs: 2\nllm:\n  train_mode: dpo\n  beta: 0.5\n")
    with pytest.raises(MisplacedSetting, match=r"tuned.yaml: train_mode is a fine-tuning setting"):
        TrainConfig.from_yaml(path)
    tuned = TrainConfig.from_yaml(path, finetune=True)
    assert isinstance(tuned, FinetuneConfig) and (tuned.train_mode, tuned.beta, tuned.epochs) == ("dpo", 0.5, 2)
    assert FinetuneConfig.from_yaml(path) == tuned
    # what a former version wrote (every setting, the fine-tuning ones at their defaults) still reads
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "train_mode": "sft", "pack": False}) == TrainConfig()
    assert TrainConfig.from_saved(tuned.to_dict()) == tuned and TrainConfig.from_saved({}) == TrainConfig()
    # the launcher's setting: LaunchConfig's (train's command config); FinetuneConfig launches too
    with pytest.raises(MisplacedSetting, match="max_restarts is a launcher setting: pass it to LaunchConfig / "
                                               "mlx-train train --distributed --max-restarts"):
        TrainConfig(max_restarts=0)
    assert LaunchConfig(max_restarts=0).max_restarts == FinetuneConfig(max_restarts=0).max_restarts == 0
    with pytest.raises(MisplacedSetting, match="train_mode is a fine-tuning setting: pass it to FinetuneConfig .*, "
                                               r"not to LaunchConfig \(LaunchConfig does not hold it\)"):
        LaunchConfig(train_mode="dpo")
    # an unknown name is still an error with a suggestion, not a TypeError
    with pytest.raises(ConfigError, match=r"unknown TrainConfig option 'batch_sise' \(did you mean 'batch_size'\?\)"):
        TrainConfig(batch_sise=3)


def test_the_trainer_refuses_fine_tuning_settings():
    import mlx.nn as nn
    import mlx.optimizers as optim

    from mlx_train.config import MisplacedSetting
    from mlx_train.training import Trainer

    with pytest.raises(MisplacedSetting, match="train_mode is a fine-tuning setting: pass it to FinetuneConfig"):
        Trainer(nn.Linear(2, 2), optim.SGD(learning_rate=0.1), train_mode="dpo", beta=0.5, pack=True)


def test_fine_tuning_defaults_are_the_config_s_own():
    from mlx_train.config.mlx_lm import FINETUNE_DEFAULTS

    tuned = FinetuneConfig()
    assert (tuned.batch_size, tuned.learning_rate, tuned.optimizer) == (FINETUNE_DEFAULTS["batch_size"],
                                                                        FINETUNE_DEFAULTS["learning_rate"], "adam")
    assert tuned.max_steps == 1000 and tuned.epochs is None
    assert FinetuneConfig.fields_help()["batch_size"].default == 4
    assert TrainConfig.fields_help()["batch_size"].default == 32
    # a replace keeps what the config holds: the defaults apply only to what was never given
    assert FinetuneConfig(batch_size=8).replace(beta=0.2).batch_size == 8


def test_the_loss_chunk_help_says_the_loss_s_numbers():
    loss = pytest.importorskip("mlx_train.llm.loss")
    text = FinetuneConfig.fields_help()["loss_chunk"].help
    numbers = f"null: {loss.CHUNK_LOGITS >> 20}M logits a chunk, {loss.chunk_tokens(49152)} tokens of a 49,152-token"
    assert numbers in text
    assert (loss.CHUNK_LOGITS >> 20, loss.chunk_tokens(49152)) == (4, 64)
