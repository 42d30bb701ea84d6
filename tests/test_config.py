"""TrainConfig: fields, YAML loading (seed schema), errors with file:line, round trips, cadences."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mlx_train.config import Every, FieldHelp, TrainConfig, parse_every
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
    "epochs": ("int", 10), "max_steps": ("int | None", None), "batch_size": ("int", 32),
    "gradient_accumulation": ("int", 1), "learning_rate": ("float", 1e-3),
    "lr_schedule": ("str | None", None), "lr_schedule_args": ("list", []), "warmup_steps": ("int", 0),
    "warmup_init": ("float", 0.0), "optimizer": ("str", "adamw"), "beta1": ("float", 0.9),
    "beta2": ("float", 0.999), "epsilon": ("float", 1e-8), "weight_decay": ("float", 0.01),
    "momentum": ("float", 0.0), "precision": ("str", "float32"), "loss_scale": ("float", 65536.0),
    "loss_scale_window": ("int", 1000), "max_grad_norm": ("float | None", None), "seed": ("int", 0),
    "compile": ("bool", True), "gradient_checkpointing": ("bool", False), "checkpoint_modules": ("list", []),
    "memory_limit": ("int | None", None), "oom_recovery": ("bool", True),
    "report_every": ("str", "10 steps"), "eval_every": ("str", "1 epoch"),
    "checkpoint_every": ("str", "1 epoch"), "keep_last": ("int", 3), "keep_best": ("int", 1),
    "monitor": ("str", "val_loss"), "monitor_mode": ("str", "auto"),
    "early_stopping_patience": ("int | None", None), "early_stopping_min_delta": ("float", 0.0),
    "num_workers": ("int", 2), "shuffle": ("bool", True), "drop_last": ("bool", True),
    "eval_batch_size": ("int | None", None),
    "distributed_backend": ("str", "auto"), "max_restarts": ("int", 3), "collective_timeout": ("float", 300.0),
    "checksum_every": ("int | None", None), "checksum_action": ("str", "raise"), "run_dir": ("str | None", None),
    "checkpoint_dir": ("str | None", None), "model": ("str", "mlp"), "model_options": ("dict", {}),
    "dataset": ("str", "digits"), "dataset_options": ("dict", {}),
}


def load(tmp_path, text: str, name: str = "custom.yaml") -> TrainConfig:
    path = tmp_path / name
    path.write_text(text)
    return TrainConfig.from_yaml(path)


def changed(config: TrainConfig) -> dict:
    defaults = TrainConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != defaults[k]}


def test_fields_match_the_contract_and_all_have_help():
    info = TrainConfig.fields_help()
    assert {name: (h.type, h.default) for name, h in info.items()} == SPEC_FIELDS
    assert list(info) == list(SPEC_FIELDS)
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
    assert dataclasses.is_dataclass(TrainConfig)
