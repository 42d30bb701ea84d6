"""``TrainConfig``: every training knob, its default and its help text, in one flat dataclass.

YAML files and CLI flags only overlay it; no default is written anywhere else.

Example::

    config = TrainConfig.from_yaml("custom_config.yaml")      # training:/optimizer:/model:/data:
    config = config.replace(batch_size=64, learning_rate="3e-4")
    config.to_yaml("runs/a/config.yaml")
    parse_every(config.eval_every)                             # Every(n=1, unit='epoch')

YAML layout (every part optional; a flat file of field names also works)::

    training:      # any field name, plus the aliases num_epochs, gradient_accumulation_steps,
                   # checkpoint_frequency (N -> "N epochs") and mixed_precision (true -> bfloat16)
    optimizer:     # name (-> optimizer), learning_rate, lr_schedule, lr_schedule_args, warmup_steps,
                   # warmup_init, beta1, beta2, epsilon, weight_decay, momentum, max_grad_norm
    model:         # name (-> model); other keys -> model_options
    data:          # name (-> dataset), batch_size, eval_batch_size, num_workers, shuffle,
                   # drop_last; other keys -> dataset_options
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import yaml

from mlx_train.distributed.backends import CHOICES as BACKEND_CHOICES
from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.optim import OPTIMIZERS, SCHEDULES


@dataclass(frozen=True)
class Every:
    """A cadence: every ``n`` optimizer steps (``unit="step"``) or epochs (``unit="epoch"``)."""

    n: int
    unit: str

    def due(self, count: int) -> bool:
        """True when ``count`` completed steps (or epochs) is a multiple of ``n``."""
        return count > 0 and count % self.n == 0

    def __str__(self) -> str:
        return f"{self.n} {self.unit}{'' if self.n == 1 else 's'}"


_EVERY = re.compile(r"(\d+)?\s*(steps?|epochs?)?")


class _Invalid(Exception):
    """A value problem without its location; callers add where it came from."""


def _parse_every(value: Any) -> Every:
    if isinstance(value, Every):
        return value
    match = _EVERY.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if isinstance(value, bool) or not (isinstance(value, int) or (match and any(match.groups()))):
        raise _Invalid(f"must be 'N steps' or 'N epochs' (a bare number means steps), got {value!r}")
    n, unit = (value, "step") if isinstance(value, int) else (int(match[1] or 1), match[2] or "step")
    if n < 1:
        raise _Invalid(f"must be at least 1 step or epoch, got {value!r}")
    return Every(n, unit.rstrip("s"))


def parse_every(value: str | int | Every) -> Every:
    """Parse a cadence: ``"2 epochs" -> Every(2, "epoch")``, ``500`` or ``"500" -> Every(500, "step")``."""
    try:
        return _parse_every(value)
    except _Invalid as error:
        raise ConfigError(f"cadence {error}") from None


def _field(default: Any, help: str, **metadata: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class TrainConfig:
    """All training options. Construct directly, from YAML, or from a dict; values are checked.

    Example::

        config = TrainConfig(epochs=3, batch_size=64, precision="bf16")   # -> "bfloat16"
        config.replace(optimizer="sgd", momentum=0.9)
    """

    epochs: int = _field(10, "Passes over the training data (YAML: training.num_epochs).")
    max_steps: int | None = _field(None, "Stop after this many optimizer steps, even mid-epoch "
                                         "(null: run all epochs).")
    batch_size: int = _field(32, "Samples per micro-batch on each device; one optimizer step uses "
                                 "batch_size x gradient_accumulation x devices samples.")
    gradient_accumulation: int = _field(1, "Micro-batches whose gradients are averaged into one optimizer "
                                           "step (YAML: training.gradient_accumulation_steps).")
    learning_rate: float = _field(1e-3, "Peak learning rate: the end of the warmup and the start of "
                                        "lr_schedule.")
    lr_schedule: str | None = _field(None, "Learning-rate schedule from mlx.optimizers after the warmup "
                                           "(null: constant learning_rate).", choices=tuple(SCHEDULES))
    lr_schedule_args: list = _field([], "Arguments of lr_schedule after the initial rate, e.g. "
                                        "[10000, 1e-5] for cosine_decay (decay_steps, end).")
    warmup_steps: int = _field(0, "Optimizer steps of linear warmup from warmup_init to learning_rate "
                                  "(0: no warmup).")
    warmup_init: float = _field(0.0, "Learning rate of the first warmup step.")
    optimizer: str = _field("adamw", "Optimizer from mlx.optimizers (YAML: optimizer.name).",
                            choices=tuple(OPTIMIZERS))
    beta1: float = _field(0.9, "First-moment decay: betas[0] of adam, adamw, adamax and lion.")
    beta2: float = _field(0.999, "Second-moment decay: betas[1] of adam, adamw, adamax and lion "
                                 "(Lion's authors use 0.99).")
    epsilon: float = _field(1e-8, "Added to denominators for numerical stability "
                                  "(adam, adamw, adamax, rmsprop, adagrad, adadelta).")
    weight_decay: float = _field(0.01, "Weight decay of adamw, lion, sgd, adafactor and muon (0: none).")
    momentum: float = _field(0.0, "Momentum of sgd and muon (muon is usually run with 0.95).")
    precision: str = _field("float32", "Compute dtype; weights stay float32. bfloat16/float16 matmuls are "
                                       "slow on the Linux CPU (YAML: training.mixed_precision: true = "
                                       "bfloat16).",
                            choices=("float32", "bfloat16", "float16"))
    loss_scale: float = _field(65536.0, "Initial dynamic loss scale (float16 only): halved when gradients "
                                        "overflow, doubled after loss_scale_window good steps.")
    loss_scale_window: int = _field(1000, "Optimizer steps without overflow before the float16 loss scale "
                                          "doubles.")
    max_grad_norm: float | None = _field(None, "Clip gradients to this global L2 norm (null: no clipping).")
    seed: int = _field(0, "Seed of parameter initialisation, dropout and data order.")
    compile: bool = _field(True, "Compile the training step with mx.compile (false: easier debugging).")
    gradient_checkpointing: bool = _field(False, "Recompute the activations of repeated blocks in the backward "
                                                 "pass (mx.checkpoint): less memory, about a third more "
                                                 "compute; which blocks: checkpoint_modules.")
    checkpoint_modules: list = _field([], "Blocks gradient_checkpointing recomputes: dotted paths to a module "
                                          "or a list of modules, e.g. ['encoder.layers'] (empty: model.layers).")
    memory_limit: int | None = _field(None, "Memory budget per device, bytes or a size like '8GB': a step whose "
                                            "peak memory goes over it counts as out of memory (null: no budget; "
                                            "DeviceConfig(memory_limit=...) also sets one).")
    oom_recovery: bool = _field(True, "On out of memory, retry the step with half the micro-batch and twice "
                                      "the accumulation (same effective batch), then with gradient "
                                      "checkpointing, before failing with advice.")
    report_every: str = _field("10 steps", "How often to log training metrics: 'N steps' or 'N epochs' "
                                           "(a bare number means steps).")
    eval_every: str = _field("1 epoch", "How often to run validation: 'N steps' or 'N epochs'.")
    checkpoint_every: str = _field("1 epoch", "How often to save a checkpoint: 'N steps' or 'N epochs' "
                                              "(YAML: training.checkpoint_frequency: N = N epochs).")
    keep_last: int = _field(3, "Newest checkpoints to keep (the newest complete one is never deleted).")
    keep_best: int = _field(1, "Best checkpoints by monitor to keep as well.")
    monitor: str = _field("val_loss", "Metric that picks the best checkpoint and drives early stopping, "
                                      "e.g. val_loss or val_accuracy.")
    monitor_mode: str = _field("auto", "Whether monitor should go down (min) or up (max); auto: max for "
                                       "metrics whose name contains 'acc', min otherwise.",
                               choices=("auto", "min", "max"))
    early_stopping_patience: int | None = _field(None, "Stop after this many evaluations without improvement "
                                                       "of monitor (null: never stop early).")
    nonfinite: str = _field("raise", "What a NaN/Inf loss or gradient does: 'raise' (stop with an error naming the "
                                     "step and batch), 'skip' (the update is undone and training goes on) or "
                                     "'stop' (stop, keeping the last finite checkpoint).",
                            choices=("raise", "skip", "stop"))
    early_stopping_min_delta: float = _field(0.0, "Smallest change of monitor that counts as an "
                                                  "improvement.")
    num_workers: int = _field(2, "Background threads that prefetch batches (0: load in the training "
                                 "thread).")
    shuffle: bool = _field(True, "Shuffle the training data each epoch (the order follows seed and "
                                 "epoch).")
    drop_last: bool = _field(True, "Drop the last incomplete training batch of each epoch "
                                   "(keeps one batch shape for the compiled step).")
    eval_batch_size: int | None = _field(None, "Batch size for validation and evaluation "
                                               "(null: batch_size).")
    distributed_backend: str = _field("auto", "Backend of a multi-process run (mlx.core.distributed): ring "
                                              "(TCP, every MLX build), mpi, jaccl (Thunderbolt 5 RDMA), nccl "
                                              "(CUDA); auto picks the best the installed MLX has.",
                                      choices=BACKEND_CHOICES)
    max_restarts: int = _field(3, "Times the supervisor of a distributed run restarts the whole group from "
                                  "the last complete checkpoint after a rank dies or hangs (0: never).")
    collective_timeout: float = _field(300.0, "Seconds a rank may wait in a collective (gradient all-reduce, "
                                              "metric reduction) before the run ends with DistributedError "
                                              "naming the missing rank.")
    checksum_every: int | None = _field(None, "Every N optimizer steps the ranks of a distributed run compare "
                                              "a checksum of their parameters (null: never).")
    checksum_action: str = _field("raise", "What a parameter-checksum mismatch does: raise (DistributedError "
                                           "naming the ranks), warn, or broadcast (copy rank 0's parameters "
                                           "and optimizer state to every rank and go on).",
                                  choices=("raise", "warn", "broadcast"))
    run_dir: str | None = _field(None, "Directory for this run's metrics.jsonl and logs (null: the Trainer "
                                       "writes none).")
    checkpoint_dir: str | None = _field(None, "Directory or fsspec URL (s3://, gs://) for checkpoints (null: "
                                              "no checkpoints unless a directory is given to train()).")
    model: str = _field("mlp", "Built-in model the CLI trains (YAML: model.name).")
    model_options: dict = _field({}, "Keyword arguments of the built-in model (YAML: the other keys of "
                                     "model:).")
    dataset: str = _field("digits", "Built-in dataset the CLI trains on (YAML: data.name).")
    dataset_options: dict = _field({}, "Options of the built-in dataset (YAML: the other keys of data:).")

    def __post_init__(self) -> None:
        for name in _FIELDS:
            try:
                setattr(self, name, _convert(name, getattr(self, name)))
            except _Invalid as error:
                raise ConfigError(f"TrainConfig.{name} {error}") from None
        problem = _cross_check(vars(self))
        if problem:
            raise ConfigError(f"TrainConfig.{problem[0]} {problem[1]}")

    # ----- building -----
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> TrainConfig:
        """Load a YAML file (see the module docstring for its layout); an empty file gives the defaults.

        Errors name the file and line: ``custom.yaml:5: unknown key 'batch_sise' in section
        'training' (did you mean 'batch_size'?)``.
        """
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise ConfigError(f"cannot read config file {source}: {error.strerror or error}") from None
        data, lines = _read_yaml(text, source)
        return _build(data, source, lines)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> TrainConfig:
        """Build from a dict shaped like the YAML (sections and/or flat field names), e.g. ``to_dict()``."""
        return _build(data, source, {})

    def replace(self, **overrides: Any) -> TrainConfig:
        """A copy with some fields changed; unknown names and wrong types raise ``ConfigError``."""
        for name in overrides:
            if name not in _FIELDS:
                raise ConfigError(f"unknown TrainConfig option '{name}'{did_you_mean(name, _FIELDS)}")
        return dataclasses.replace(self, **overrides)

    # ----- exporting -----
    def to_dict(self) -> dict[str, Any]:
        """All fields as a flat JSON-able dict; ``TrainConfig.from_dict(c.to_dict()) == c``."""
        return {name: copy.deepcopy(getattr(self, name)) for name in _FIELDS}

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write all fields as a flat YAML file that ``from_yaml`` reads back to an equal config."""
        with open(path, "w", encoding="utf-8") as file:
            file.write("# mlx-train configuration (TrainConfig); every field, flat.\n")
            yaml.safe_dump(self.to_dict(), file, sort_keys=False)

    # ----- helpers for the CLI and the trainer -----
    @classmethod
    def fields_help(cls) -> dict[str, FieldHelp]:
        """Per field: ``FieldHelp(type, default, help, choices)``, in declaration order.

        ``type`` is the annotation as text (``"int | None"``); ``default`` a fresh copy; ``choices``
        a tuple of allowed strings or None. The CLI builds its flags and ``--help`` from this.
        """
        return {f.name: FieldHelp(str(f.type), _default(f), f.metadata["help"], f.metadata.get("choices"))
                for f in dataclasses.fields(cls)}

    @classmethod
    def parse_value(cls, name: str, text: str) -> Any:
        """Convert a command-line string to field ``name``'s type, e.g. ``("lr_schedule_args",
        "[1000, 1e-5]") -> [1000, 1e-05]``; ``none``/``null`` mean None for optional fields."""
        if name not in _FIELDS:
            raise ConfigError(f"unknown TrainConfig option '{name}'{did_you_mean(name, _FIELDS)}")
        kind, optional = _FIELDS[name]
        if optional and text.strip().lower() in ("none", "null", "~"):
            value: Any = None
        elif kind == "str":
            value = text
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
        try:
            return _convert(name, value)
        except _Invalid as error:
            raise ConfigError(f"{name} {error}") from None

    def monitor_direction(self) -> str:
        """``"min"`` or ``"max"``: ``monitor_mode`` with ``auto`` resolved from the metric name."""
        if self.monitor_mode != "auto":
            return self.monitor_mode
        return "max" if "acc" in self.monitor.lower() else "min"


class FieldHelp(NamedTuple):
    """What ``TrainConfig.fields_help()`` says about one field."""

    type: str
    default: Any
    help: str
    choices: tuple[str, ...] | None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# name -> (kind, optional), from the annotations ("int | None" -> ("int", True)).
_FIELDS: dict[str, tuple[str, bool]] = {f.name: (str(f.type).split("|")[0].strip(), "None" in str(f.type))
                                         for f in dataclasses.fields(TrainConfig)}
_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "list": "a list", "dict": "a mapping"}
_CADENCES = {"report_every", "eval_every", "checkpoint_every"}
_SIZES = {"memory_limit"}  # bytes, or a size like "8GB"
_PRECISIONS = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
               "f16": "float16", "half": "float16"}
_CHOICES = {name: choices for name, (_, _, _, choices) in TrainConfig.fields_help().items() if choices}
_AT_LEAST_1 = {"epochs", "max_steps", "batch_size", "gradient_accumulation", "loss_scale_window",
               "eval_batch_size", "checksum_every", "memory_limit"}
_AT_LEAST_0 = {"warmup_steps", "keep_last", "keep_best", "early_stopping_patience", "num_workers", "seed",
               "learning_rate", "warmup_init", "epsilon", "weight_decay", "early_stopping_min_delta",
               "max_restarts"}
_ABOVE_0 = {"loss_scale", "max_grad_norm", "collective_timeout"}
_BELOW_1 = {"beta1", "beta2", "momentum"}  # and >= 0
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _number(value: Any) -> float | None:
    """An int/float, or a numeric string (PyYAML reads ``2e-5`` as a string), as float; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return None


def _size(value: Any) -> int:
    from mlx_train.device import parse_bytes

    try:
        return parse_bytes(value)
    except ConfigError:
        raise _Invalid(f"must be a number of bytes or a size like '8GB' or '512MiB', got {value!r}") from None


def _convert(name: str, value: Any) -> Any:
    """Check and normalise one field value; raises ``_Invalid`` saying what is wrong."""
    kind, optional = _FIELDS[name]
    if value is None:
        if optional:
            return None
        raise _Invalid(f"must be {_EXPECTED[kind]}, got null")
    got = f"got {value!r} ({type(value).__name__})"
    expected = _EXPECTED[kind] + (" or null" if optional else "")
    if name in _CADENCES:
        return str(_parse_every(value))
    if name in _SIZES:
        value = _size(value)
    if kind == "bool" and not isinstance(value, bool):
        raise _Invalid(f"must be {expected}, {got}")
    if kind in ("int", "float"):
        number = _number(value)
        if number is None or not math.isfinite(number) or (kind == "int" and number != int(number)):
            raise _Invalid(f"must be {expected}, {got}")
        value = int(number) if kind == "int" else number
    if kind == "str" and not isinstance(value, str):
        raise _Invalid(f"must be {expected}, {got}")
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise _Invalid(f"must be {expected}, {got}")
        value = [_number(v) if isinstance(v, str) and _number(v) is not None else v for v in value]
    if kind == "dict":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _Invalid(f"must be {expected} with string keys, {got}")
        value = dict(value)
    if name in _CHOICES:
        value = _PRECISIONS.get(value.lower(), value.lower()) if name == "precision" else value
        value = value.lower() if name in ("optimizer", "monitor_mode") else value
        if value not in _CHOICES[name]:
            raise _Invalid(f"must be one of {', '.join(_CHOICES[name])}, got {value!r}"
                           f"{did_you_mean(value, _CHOICES[name])}")
    if ((name in _AT_LEAST_1 and value < 1) or (name in _AT_LEAST_0 and value < 0)
            or (name in _ABOVE_0 and value <= 0) or (name in _BELOW_1 and not 0 <= value < 1)):
        limit = ("at least 1" if name in _AT_LEAST_1 else "at least 0" if name in _AT_LEAST_0
                 else "above 0" if name in _ABOVE_0 else "in [0, 1)")
        raise _Invalid(f"must be {limit}, got {value!r}")
    return value


def _cross_check(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, problem) for a combination of values that cannot work, else None."""
    if values.get("lr_schedule_args") and values.get("lr_schedule") is None:
        return ("lr_schedule_args", "is set but lr_schedule is null: also set lr_schedule "
                                    f"(one of {', '.join(SCHEDULES)}) or remove lr_schedule_args")
    return None


# ----- YAML / dict layout -----
SECTIONS = ("training", "optimizer", "model", "data")
#: YAML names (training section) -> field; the value conversions live in _alias_value.
YAML_ALIASES = {"num_epochs": "epochs", "gradient_accumulation_steps": "gradient_accumulation",
                "checkpoint_frequency": "checkpoint_every", "mixed_precision": "precision"}
_SECTION_KEYS: dict[str, dict[str, str]] = {
    "training": {**{name: name for name in _FIELDS}, **YAML_ALIASES},
    "optimizer": {"name": "optimizer", **{name: name for name in (
        "learning_rate", "lr_schedule", "lr_schedule_args", "warmup_steps", "warmup_init", "beta1",
        "beta2", "epsilon", "weight_decay", "momentum", "max_grad_norm")}},
    "model": {"name": "model"},
    "data": {"name": "dataset", **{name: name for name in (
        "batch_size", "eval_batch_size", "num_workers", "shuffle", "drop_last")}},
}
_OPTIONS = {"model": "model_options", "data": "dataset_options"}  # where a section's other keys go


def _alias_value(key: str, value: Any) -> Any:
    if key == "checkpoint_frequency" and isinstance(value, int) and not isinstance(value, bool):
        return f"{value} epochs"  # the seed schema counts checkpoint_frequency in epochs
    if key == "mixed_precision" and isinstance(value, bool):
        return "bfloat16" if value else "float32"
    return value


def _where(source: str, line: int | None) -> str:
    return f"{source}:{line}" if line else source


def _read_yaml(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML keeping the line of each top-level and section key (from the composed nodes)."""
    lines: dict[tuple, int] = {}
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}, lines

        def mapping(node: yaml.MappingNode, prefix: tuple) -> dict:
            loader.flatten_mapping(node)  # resolve "<<:" merge keys
            result: dict = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    raise ConfigError(f"{_where(source, line)}: keys must be strings, got {key!r}")
                if key in result:
                    raise ConfigError(f"{_where(source, line)}: key '{'.'.join(prefix + (key,))}' appears "
                                      f"twice (first at line {lines[prefix + (key,)]}); keep one")
                lines[prefix + (key,)] = line
                if not prefix and key in SECTIONS and isinstance(value_node, yaml.MappingNode):
                    result[key] = mapping(value_node, (key,))
                else:
                    result[key] = loader.construct_object(value_node, deep=True)
            return result

        if isinstance(root, yaml.MappingNode):
            return mapping(root, ()), lines
        return loader.construct_object(root, deep=True), lines
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        problem = " ".join(filter(None, [getattr(error, "context", None), getattr(error, "problem", None)]))
        problem = problem or str(error)
        where = _where(source, mark.line + 1 if mark else None)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    finally:
        loader.dispose()


def _build(data: Any, source: str, lines: dict[tuple, int]) -> TrainConfig:
    """Map sections/aliases onto fields, check every value with its location, build the config."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a config must be a mapping of sections ({', '.join(SECTIONS)}) "
                          f"or field names, got {type(data).__name__}")
    values: dict[str, Any] = {}
    origins: dict[str, tuple[str, int | None]] = {}  # field -> (path, line) that set it whole
    option_origins: dict[str, tuple[str, int | None]] = {}  # options field -> first key that added to it

    def put(name: str, value: Any, path: str, line: int | None, option: str | None = None) -> None:
        clash = origins.get(name) or (None if option else option_origins.get(name))
        if clash:
            at = f" (line {clash[1]})" if clash[1] else ""
            raise ConfigError(f"{_where(source, line)}: {path} sets {name}, which {clash[0]}{at} "
                              "already sets; keep only one of them")
        if option:
            option_origins.setdefault(name, (path, line))
            values.setdefault(name, {})[option] = value
        else:
            origins[name] = (path, line)
            values[name] = value

    for key, value in data.items():
        line = lines.get((key,))
        # "optimizer" and "model" are both sections (a mapping) and fields (a name).
        if key in SECTIONS and (isinstance(value, Mapping) or value is None or key not in _FIELDS):
            if not isinstance(value, (Mapping, type(None))):
                raise ConfigError(f"{_where(source, line)}: section '{key}' must be a mapping of keys to "
                                  f"values, got {value!r}")
            for sub, sub_value in (value or {}).items():
                _section_key(put, key, sub, sub_value, source, lines.get((key, sub)))
        elif isinstance(key, str) and key in _FIELDS:
            put(key, value, key, line)
        else:
            raise ConfigError(f"{_where(source, line)}: unknown top-level key {key!r}"
                              f"{did_you_mean(str(key), SECTIONS + tuple(_FIELDS))}; expected a section "
                              f"({', '.join(SECTIONS)}) or a TrainConfig field (mlx-train train --help)")
    for name, value in values.items():
        path, line = origins.get(name) or option_origins[name]
        try:
            values[name] = _convert(name, value)
        except _Invalid as error:
            raise ConfigError(f"{_where(source, line)}: {path} {error}") from None
    problem = _cross_check(values)
    if problem:
        path, line = origins[problem[0]]
        raise ConfigError(f"{_where(source, line)}: {path} {problem[1]}")
    return TrainConfig(**values)


def _section_key(put, section: str, key: Any, value: Any, source: str, line: int | None) -> None:
    keys = _SECTION_KEYS[section]
    path = f"{section}.{key}"
    if isinstance(key, str) and key in keys:
        put(keys[key], _alias_value(key, value), path, line)
        return
    option_field = _OPTIONS.get(section)
    # Keys of data:/model: that are not fields are options, unless they look like a typo of a field.
    close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.8)
    if option_field and isinstance(key, str) and not close:
        put(option_field, value, path, line, option=key)
        return
    listed = (f"TrainConfig fields (mlx-train train --help) and {', '.join(YAML_ALIASES)}"
              if section == "training" else ", ".join(keys))
    raise ConfigError(f"{_where(source, line)}: unknown key {key!r} in section '{section}'"
                      f"{did_you_mean(str(key), keys)}; valid keys: {listed}")
