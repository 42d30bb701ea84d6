"""mlx_lm.lora's YAML files load into TrainConfig and train as mlx_lm.lora would: the same number of
optimizer updates of the same number of rows, the same optimizer, or an error/warning naming each
key that cannot be honoured."""

from __future__ import annotations

import inspect
import warnings

import mlx.core as mx
import mlx.optimizers as optim
import pytest

from mlx_train.config import OPTIMIZERS, TrainConfig
from mlx_train.config.mlx_lm import FIXED_KEYWORDS, MLX_OPTIMIZER_DEFAULTS
from mlx_train.errors import ConfigError
from mlx_train.optim import build_optimizer
from mlx_train.optim import build_schedule as mlx_train_schedule

# A file as mlx_lm.lora's users write them: flat keys, its names, counts in iterations.
LORA_YAML = """\
model: "mlx-community/Some-Model-4bit"
train: true
fine_tune_type: lora
optimizer: adamw
optimizer_config:
  adamw:
    betas: [0.85, 0.95]
    eps: 1e-6
    weight_decay: 0.05
    bias_correction: true
data: "data/"
seed: 7
num_layers: 8
batch_size: 2
iters: 600
val_batches: -1
learning_rate: 2e-4
steps_per_report: 20
steps_per_eval: 100
grad_accumulation_steps: 4
resume_adapter_file: null
adapter_path: "my_adapters"
save_every: 200
test: false
test_batches: 100
max_seq_length: 1024
grad_checkpoint: true
mask_prompt: true
lora_parameters:
  keys: ["self_attn.q_proj", "self_attn.v_proj"]
  rank: 16
  scale: 10.0
  dropout: 0.05
"""


def load(tmp_path, text: str, finetune: bool = True) -> TrainConfig:
    path = tmp_path / "lora.yaml"
    path.write_text(text)
    return TrainConfig.from_yaml(path, finetune=finetune)


def mlx_lm_updates(iters: int, accumulation: int) -> int:
    """mlx_lm.lora's trainer makes an update at every iteration ``it`` (1-based) with it % accumulation == 0."""
    return sum(1 for it in range(1, iters + 1) if it % accumulation == 0)


def test_an_mlx_lm_file_gives_its_updates_rows_and_settings(tmp_path):
    config = load(tmp_path, LORA_YAML)
    assert config.max_steps == mlx_lm_updates(600, 4) == 150 and config.epochs is None  # loops over the data
    assert (config.batch_size, config.gradient_accumulation) == (2, 4)  # 8 rows per update, as mlx_lm.lora
    assert (config.report_every, config.eval_every, config.checkpoint_every) == ("5 steps", "25 steps", "50 steps")
    assert (config.beta1, config.beta2, config.epsilon, config.weight_decay, config.bias_correction) == \
        (0.85, 0.95, 1e-6, 0.05, True)
    assert (config.optimizer, config.learning_rate, config.seed) == ("adamw", 2e-4, 7)
    assert (config.model, config.dataset, config.num_layers, config.max_seq_length) == \
        ("mlx-community/Some-Model-4bit", "data/", 8, 1024)
    assert config.val_batches is None and config.test_batches == 100 and config.gradient_checkpointing
    assert config.lora_parameters["keys"] == ["self_attn.q_proj", "self_attn.v_proj"] and config.mask_prompt
    assert config.adapter_path == "my_adapters"
    # the run's config.yaml reads back to the same config, by TrainConfig's names
    config.to_yaml(tmp_path / "config.yaml")
    assert TrainConfig.from_yaml(tmp_path / "config.yaml", finetune=True) == config


@pytest.mark.parametrize("iters,accumulation", [(10, 1), (10, 3), (7, 7), (1000, 4)])
def test_iters_count_iterations_of_batch_size_rows(tmp_path, iters, accumulation):
    config = load(tmp_path, f"iters: {iters}\ngrad_accumulation_steps: {accumulation}\nbatch_size: 3\n")
    assert config.max_steps == mlx_lm_updates(iters, accumulation)
    assert config.batch_size * config.gradient_accumulation == 3 * accumulation


def test_mlx_lm_defaults_are_finetunes_defaults(tmp_path):
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS

    text = yaml.safe_dump({**CONFIG_DEFAULTS, "train": True, "model": "base", "data": "data"})
    # all but one: finetune recomputes attention on long rows unless told not to, as the file's
    # grad_checkpoint: false does
    finetune = TrainConfig.for_finetune({"model": "base", "dataset": "data"})
    assert CONFIG_DEFAULTS["grad_checkpoint"] is False and finetune.gradient_checkpointing == "auto"
    assert load(tmp_path, text) == finetune.replace(gradient_checkpointing=False)
    assert TrainConfig.for_finetune({}).max_steps == 1000 and TrainConfig.for_finetune({}).optimizer == "adam"


def test_the_optimizer_defaults_are_mlx_optimizers_own():
    """finetune builds each optimizer as mlx_lm.lora does, with the class's defaults (sgd: no weight decay,
    muon: momentum 0.95); the table matches mlx.optimizers' signatures and TrainConfig's hyper-parameters."""
    names = {"beta1": "betas", "beta2": "betas", "epsilon": "eps"}
    for name, defaults in MLX_OPTIMIZER_DEFAULTS.items():
        assert set(defaults) == set(OPTIMIZERS[name][1])
        signature = inspect.signature(getattr(optim, OPTIMIZERS[name][0]).__init__).parameters
        for field, value in defaults.items():
            default = signature[names.get(field, field)].default
            expected = default[{"beta1": 0, "beta2": 1}[field]] if field in ("beta1", "beta2") else default
            assert value == expected, (name, field)
        for keyword, value in FIXED_KEYWORDS.get(name, {}).items():
            default = signature[keyword].default
            assert (list(default) if isinstance(default, tuple) else default) == value or keyword == "relative_step"
    assert TrainConfig.for_finetune({"optimizer": "sgd"}).weight_decay == 0.0
    assert TrainConfig.for_finetune({"optimizer": "muon"}).momentum == 0.95


def _first_updates(optimizer: optim.Optimizer, steps: int = 3) -> list[mx.array]:
    params = {"w": mx.array([[0.5, -1.0], [2.0, 0.25]]), "b": mx.array([0.1, -0.2])}
    out = []
    for step in range(steps):
        grads = {"w": mx.array([[0.3, -0.1], [0.2, 0.4]]) * (step + 1), "b": mx.array([0.05, -0.3])}
        params = optimizer.apply_gradients(grads, params)
        out.append(params["w"])
    return out


@pytest.mark.parametrize("text,by_hand", [
    (LORA_YAML, lambda: optim.AdamW(learning_rate=2e-4, betas=[0.85, 0.95], eps=1e-6, weight_decay=0.05,
                                    bias_correction=True)),
    ("optimizer: sgd\nlearning_rate: 0.1\noptimizer_config:\n  sgd: {momentum: 0.9}\n",
     lambda: optim.SGD(learning_rate=0.1, momentum=0.9)),
    ("optimizer: muon\n", lambda: optim.Muon(learning_rate=1e-5)),
    ("learning_rate: 3e-4\n", lambda: optim.Adam(learning_rate=3e-4)),
    ("optimizer: adam\nlr_schedule:\n  name: cosine_decay\n  arguments: [1e-3, 100, 1e-5]\n",
     lambda: optim.Adam(learning_rate=optim.cosine_decay(1e-3, 100, 1e-5))),
])
def test_the_optimizer_is_the_one_mlx_lm_builds(tmp_path, text, by_hand):
    """The same first updates as the mlx.optimizers object mlx_lm.lora builds from the same file."""
    ours = _first_updates(build_optimizer(load(tmp_path, text)))
    theirs = _first_updates(by_hand())
    for a, b in zip(ours, theirs, strict=True):
        assert mx.array_equal(a, b), (a, b)


def test_the_lr_schedule_mapping_is_mlx_lms(tmp_path):
    from mlx_lm.tuner.utils import build_schedule

    schedule = {"name": "linear_schedule", "arguments": [1e-3, 1e-4, 50]}
    config = load(tmp_path, "lr_schedule:\n  name: linear_schedule\n  arguments: [1e-3, 1e-4, 50]\n"
                            "learning_rate: 1e-3\n")
    assert (config.lr_schedule, config.learning_rate, config.lr_schedule_args) == ("linear_schedule", 1e-3, [1e-4, 50])
    ours, theirs = mlx_train_schedule(config), build_schedule(schedule)
    for step in (0, 1, 25, 49, 50, 80):
        assert ours(mx.array(step)).item() == theirs(mx.array(step)).item()


# ----- keys that cannot be honoured: each one is named, never dropped silently -----
@pytest.mark.parametrize("text,message", [
    ("model: m\ntrain: false\n", r"lora.yaml:2: train: False cannot be honoured.*always trains"),
    ("optimizer: adamw\noptimizer_config:\n  adamw: {amsgrad: true}\n",
     r"lora.yaml:2: optimizer_config.adamw.amsgrad has no counterpart in mlx-train's adamw"),
    ("optimizer: sgd\noptimizer_config:\n  sgd: {nesterov: true}\n",
     r"optimizer_config.sgd.nesterov: True cannot be honoured: mlx-train always builds sgd with nesterov=False"),
    ("optimizer: adafactor\noptimizer_config:\n  adafactor: {relative_step: true}\n",
     r"relative_step: True cannot be honoured"),
    ("optimizer: sgd\noptimizer_config:\n  sgd: {betas: [0.9, 0.99]}\n",
     r"optimizer_config.sgd.betas has no counterpart"),
    ("lr_schedule:\n  name: cosine_decay\n  arguments: [1e-5, 100]\n  warmup_steps: 10\n",
     r"lora.yaml:1: lr_schedule has unknown key 'warmup_steps'"),
    ("lr_schedule:\n  name: cosine_decay\n", r"lr_schedule.arguments must be a list"),
    ("iters: 3\ngrad_accumulation_steps: 4\n", r"iters 3 counts iterations.*give iters at least 4"),
    ("iters: 100\nmax_steps: 10\n", r"iters sets max_steps, which max_steps .* already sets"),
    ("hf_dataset:\n  name: x\n", r"unknown top-level key 'hf_dataset'"),
    ("report_to: swanlab\n", r"lora.yaml:1: report_to names an unknown tracker 'swanlab'"),
    ("num_layers: 0\n", r"lora.yaml:1: num_layers must be -1 \(all blocks"),
])
def test_a_key_that_cannot_be_honoured_is_an_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


@pytest.mark.parametrize("text,message", [
    ("clear_cache_threshold: 1000000\n", r"lora.yaml:1: clear_cache_threshold: 1000000 is ignored"),
    ("trust_remote_code: true\n", r"trust_remote_code: True is ignored"),
    ("config: other.yaml\n", r"config: 'other.yaml' is ignored"),
    ("learning_rate: 1e-4\nlr_schedule:\n  name: cosine_decay\n  arguments: [1e-5, 100]\n",
     r"lora.yaml:1: learning_rate 0.0001 is not used: lr_schedule.arguments\[0\] 1e-05 is the initial rate"),
    ("lr_schedule:\n  name: cosine_decay\n  arguments: [1e-5, 100]\n  warmup: 10\n",
     r"lr_schedule.warmup 10: mlx_lm.lora holds the peak rate for one more step"),
    ("steps_per_report: 10\ngrad_accumulation_steps: 4\n",
     r"steps_per_report 10 counts iterations; with gradient_accumulation 4 mlx-train acts every 2 optimizer steps"),
    ("optimizer: adafactor\n", r"mlx_lm.lora's adafactor takes relative steps"),
])
def test_a_key_honoured_only_in_part_is_a_warning(tmp_path, text, message):
    with pytest.warns(UserWarning, match=message):
        load(tmp_path, text)


def test_keys_that_change_nothing_load_quietly(tmp_path):
    text = ("train: true\nclear_cache_threshold: 0\ntrust_remote_code: false\nconfig: null\nreport_to: null\n"
            "optimizer: adafactor\noptimizer_config:\n  adam: {betas: [0.1, 0.2]}\n"
            "  adafactor: {relative_step: false}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load(tmp_path, text)
    assert config.optimizer == "adafactor" and config.report_to == []


def test_train_reads_mlx_lm_names_too(tmp_path):
    """One vocabulary: train's YAML takes mlx_lm.lora's keys, on train's defaults."""
    config = load(tmp_path, "iters: 40\ngrad_accumulation_steps: 2\nsteps_per_eval: 10\ndata: digits\n",
                  finetune=False)
    assert (config.max_steps, config.epochs, config.eval_every, config.dataset) == (20, None, "5 steps", "digits")
    assert config.optimizer == "adamw" and config.batch_size == 32


# A GRPO file as mlx-lm-lora's users write them (its train.py's keys): epsilon is its clip width.
GRPO_YAML = """\
model: base
data: data/
train_mode: grpo
train_type: dora
optimizer: adamw
optimizer_config:
  adamw: {eps: 1e-6}
epsilon: 0.2
epsilon_high: 0.28
group_size: 8
max_completion_length: 64
beta: 0.04
"""


def test_an_mlx_lm_lora_grpo_file_means_what_it_means_there(tmp_path):
    """mlx-lm-lora's top-level epsilon is GRPO's clip width and train_type the fine-tuning method; the
    optimizer's epsilon stays in optimizer_config (also when the config is built from the command line)."""
    from mlx_train.cli.flags import build_config
    from mlx_train.cli.main import build_parser

    config = load(tmp_path, GRPO_YAML)
    assert (config.clip_epsilon, config.epsilon_high, config.group_size, config.max_completion_length) == \
        (0.2, 0.28, 8, 64)
    assert (config.epsilon, config.beta, config.fine_tune_type) == (1e-6, 0.04, "dora")
    args = build_parser("finetune").parse_args(["finetune", "-c", str(tmp_path / "lora.yaml"), "--train-type",
                                                "lora"])
    built = build_config(args, finetune=True)
    assert (built.clip_epsilon, built.epsilon, built.fine_tune_type) == (0.2, 1e-6, "lora")
    assert type(config).from_dict(config.to_dict()) == config  # mlx-train's own names: epsilon is the optimizer's


@pytest.mark.parametrize("text,trains", [("epsilon: 1e-6\n", "names no train_mode"),
                                         ("train_mode: dpo\nepsilon: 1e-6\n", "trains train_mode dpo")])
def test_epsilon_outside_a_grpo_file_is_refused_with_both_ways_to_say_it(tmp_path, text, trains):
    with pytest.raises(ConfigError, match=rf"lora.yaml:\d: epsilon is ambiguous here: in mlx-lm-lora's files it is "
                                          rf"GRPO's clip width, but this file {trains}.*train_mode: grpo.*"
                                          r"optimizer_config: \{adam: \{eps: 1e-06\}\}"):
        load(tmp_path, text)
    assert load(tmp_path, "epsilon: 1e-6\n", finetune=False).epsilon == 1e-6  # train's files: the optimizer's
