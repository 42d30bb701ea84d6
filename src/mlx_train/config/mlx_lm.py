"""mlx_lm.lora's configuration in TrainConfig's terms: its YAML keys, its flags' counts, its defaults.

mlx_lm.lora (mlx-lm 0.32) counts ``iters``, ``steps_per_report``, ``steps_per_eval`` and
``save_every`` in *iterations*: one iteration is a micro-batch of ``batch_size`` rows, and one
optimizer update is made every ``grad_accumulation_steps`` iterations. TrainConfig counts
optimizer steps. So ``iters: 1000`` with ``grad_accumulation_steps: 4`` is ``max_steps: 250``
(the same 250 updates of 16 rows each); ``batch_size`` and ``learning_rate`` mean the same in both.
``optimizer_config: {adamw: {betas, eps, weight_decay, bias_correction}}`` becomes ``beta1``,
``beta2``, ``epsilon``, ``weight_decay``, ``bias_correction``; the ``lr_schedule`` mapping
``{name, arguments: [initial_rate, ...], warmup, warmup_init}`` becomes ``lr_schedule``,
``learning_rate``, ``lr_schedule_args``, ``warmup_steps``, ``warmup_init``. In a fine-tuning file
the top-level ``epsilon`` is mlx-lm-lora's: GRPO's clip width (``clip_epsilon``; refused in a file
that does not train GRPO). A key that cannot be honoured is an error, or a warning when training as
asked still makes sense; none is dropped silently.

Example::

    config = TrainConfig.from_yaml("lora_config.yaml", finetune=True)   # an mlx_lm.lora file, as it is
    config.max_steps                                                   # iters / grad_accumulation_steps
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_train.config.options import Deferred, number
from mlx_train.errors import ConfigError

#: mlx_lm.lora's keys counted in iterations -> the TrainConfig field they set (counted in optimizer steps).
ITERATION_KEYS = {"iters": "max_steps", "steps_per_report": "report_every", "steps_per_eval": "eval_every",
                  "save_every": "checkpoint_every"}

#: What mlx.optimizers' classes take by default for the hyper-parameters TrainConfig passes them
#: (mlx_lm.lora builds its optimizer with these unless optimizer_config says otherwise).
MLX_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "bias_correction": False},
    "adamw": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "bias_correction": False, "weight_decay": 0.01},
    "adamax": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "lion": {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0},
    "sgd": {"momentum": 0.0, "weight_decay": 0.0},
    "rmsprop": {"epsilon": 1e-8},
    "adagrad": {"epsilon": 1e-8},
    "adadelta": {"epsilon": 1e-6},
    "adafactor": {"weight_decay": 0.0},
    "muon": {"momentum": 0.95, "weight_decay": 0.01},
}

#: Keyword arguments of mlx.optimizers that TrainConfig does not pass: the value mlx-train always uses
#: (an optimizer_config entry with that value is honoured; another value is an error).
FIXED_KEYWORDS: dict[str, dict[str, Any]] = {
    "sgd": {"dampening": 0.0, "nesterov": False},
    "muon": {"nesterov": True, "ns_steps": 5},
    "rmsprop": {"alpha": 0.99},
    "adadelta": {"rho": 0.9},
    "adafactor": {"relative_step": False, "clip_threshold": 1.0, "decay_rate": -0.8, "beta_1": None,
                  "scale_parameter": True, "warmup_init": False, "eps": [1e-30, 1e-3]},
}

# optimizer_config's keys -> TrainConfig fields (betas is a pair)
_KEYWORD_FIELDS = {"eps": "epsilon", "weight_decay": "weight_decay", "momentum": "momentum",
                   "bias_correction": "bias_correction"}

#: mlx_lm.lora's defaults (lora.py CONFIG_DEFAULTS) for what it has in common with TrainConfig, in
#: TrainConfig's terms: ``mlx-train finetune`` starts from these. An empty model or dataset is "not given".
FINETUNE_DEFAULTS: dict[str, Any] = {
    "model": "", "dataset": "", "optimizer": "adam", "learning_rate": 1e-5, "batch_size": 4, "val_batches": 25,
    "num_workers": 1, "gradient_checkpointing": "auto",  # attention on long rows: see docs/guides/finetuning.md
}
#: mlx_lm.lora's defaults of its counts of iterations (``finetune_defaults`` makes them optimizer steps).
DEFAULT_ITERATIONS = {"iters": 1000, "steps_per_report": 10, "steps_per_eval": 200, "save_every": 100}


@dataclass(frozen=True)
class Iterations(Deferred):
    """A count of mlx_lm.lora iterations (micro-batches) for a field counted in optimizer steps.

    ``where`` names its origin (``lora.yaml:4``, ``--iters 100``); None for a default, which is
    converted without a warning.
    """

    n: int
    key: str
    where: str | None = None

    def value(self, values: Mapping[str, Any]) -> Any:
        accumulation = int(values["gradient_accumulation"])
        steps, rest = divmod(self.n, accumulation)
        origin = f"{self.where}: " if self.where else ""
        if ITERATION_KEYS[self.key] == "max_steps":
            if steps < 1:
                raise ConfigError(f"{origin}{self.key} {self.n} counts iterations (micro-batches of batch_size "
                                  f"rows), fewer than one optimizer step of gradient_accumulation {accumulation}: "
                                  f"nothing would be trained; give {self.key} at least {accumulation}")
            if rest and self.where:  # mlx_lm.lora also makes iters // grad_accumulation_steps updates
                warnings.warn(f"{origin}{self.key} {self.n} counts iterations; with gradient_accumulation "
                              f"{accumulation} that is {steps} optimizer step{'s' if steps > 1 else ''} "
                              f"({steps * accumulation} iterations): the last {rest} iteration{'s' if rest > 1 else ''}"
                              f" would make no update (mlx_lm.lora runs {'them' if rest > 1 else 'it'} and updates "
                              f"nothing either); give {self.key} a multiple of {accumulation}", stacklevel=2)
            return steps
        steps = max(steps, 1)
        if rest and self.where:
            warnings.warn(f"{origin}{self.key} {self.n} counts iterations; with gradient_accumulation "
                          f"{accumulation} mlx-train acts every {steps} optimizer steps ({steps * accumulation} "
                          "iterations), as it only reports, validates and saves between optimizer steps",
                          stacklevel=2)
        return f"{steps} steps"


def iterations(key: str, value: Any, where: str) -> Iterations:
    """``Iterations`` of mlx_lm.lora key (or flag) ``key``; ``ConfigError`` at ``where`` if not a count."""
    count = number(value)
    if count is None or count != int(count) or count < 1:
        raise ConfigError(f"{where}: {key} must be at least 1, got {value!r} (a whole number of iterations)")
    return Iterations(int(count), key, where)


def finetune_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """The values ``mlx-train finetune`` starts from, under the fields ``given`` (which win): mlx_lm.lora's
    defaults (1000 iterations, adam at 1e-5, batch_size 4, ...), and the chosen optimizer's own
    mlx.optimizers defaults for its hyper-parameters (sgd: weight_decay 0; muon: momentum 0.95).

    Example: ``finetune_defaults({"optimizer": "sgd"})["weight_decay"]`` -> ``0.0``.
    """
    base: dict[str, Any] = dict(FINETUNE_DEFAULTS)
    for key, count in DEFAULT_ITERATIONS.items():
        base[ITERATION_KEYS[key]] = Iterations(count, key)
    if "epochs" not in given:
        base["epochs"] = None  # as many passes as max_steps needs, as mlx_lm.lora loops over its data
        if "max_steps" in given:
            del base["max_steps"]
    elif "max_steps" not in given:
        base["max_steps"] = None
    optimizer = given.get("optimizer", base["optimizer"])
    base.update({name: value for name, value in MLX_OPTIMIZER_DEFAULTS.get(optimizer, {}).items()
                 if name not in given})
    return base


# ----- translating a file's keys -----
def translate(data: Mapping[str, Any], lines: dict[tuple[Any, ...], int], source: str,
              optimizer: str = "adamw", finetune: bool = False) -> dict[str, Any]:
    """``data`` with mlx_lm.lora's top-level keys rewritten into TrainConfig's (a ``files.Dialect``);
    ``optimizer`` is the one in force when ``data`` names none (its optimizer_config entry applies).
    ``finetune``: the file is read as an mlx_lm.lora file, whose adafactor takes relative steps.

    Example: ``translate({"iters": 100, "grad_checkpoint": True}, {}, "lora.yaml")`` ->
    ``{"max_steps": Iterations(100, "iters", "lora.yaml"), "epochs": None, "grad_checkpoint": True}``.
    """
    out: dict[str, Any] = {}
    clip = finetune and "epsilon" in data and "clip_epsilon" not in data  # mlx-lm-lora's epsilon: GRPO's clip width
    taken = set(data) - ({"epsilon"} if clip else set())

    def where(key: str) -> str:
        line = lines.get((key,))
        return f"{source}:{line}" if line else source

    def put(key: str, field: str, value: Any) -> None:
        if field in out or (field in taken and field != key):
            raise ConfigError(f"{where(key)}: {key} sets {field}, which {field} (or another key) already sets; "
                              "keep only one of them")
        out[field] = value
        lines.setdefault((field,), lines.get((key,), 0))

    named = data.get("optimizer", optimizer)
    chosen = str(named.get("name", optimizer) if isinstance(named, Mapping) else named).lower()
    for key, value in data.items():
        if key in ITERATION_KEYS:
            put(key, ITERATION_KEYS[key], iterations(key, value, where(key)))
            if key == "iters" and "epochs" not in data and "num_epochs" not in data:
                out["epochs"] = None  # mlx_lm.lora loops over the data until iters
        elif key == "optimizer_config":
            for field, field_value in _optimizer_config(value, chosen, where(key)).items():
                put(key, field, field_value)
        elif key == "lr_schedule" and isinstance(value, Mapping):
            for field, field_value in _lr_schedule(value, data, where(key), where("learning_rate")).items():
                if field == "learning_rate":
                    out.pop("learning_rate", None)
                    out[field] = field_value
                else:
                    put(key, field, field_value)
        elif key == "learning_rate" and isinstance(data.get("lr_schedule"), Mapping):
            continue  # the schedule's arguments[0] is the rate (see _lr_schedule)
        elif key == "epsilon" and clip:
            put(key, "clip_epsilon", _clip_epsilon(data, value, where(key)))
        elif key in _NO_EFFECT:
            _no_effect(key, value, where(key))
        elif key == "wandb":  # older mlx_lm.lora files: "wandb: PROJECT" reports to W&B
            if value:
                reports = data.get("report_to") or []
                reports = reports.split(",") if isinstance(reports, str) else list(reports)
                out["report_to"] = [*reports, "wandb"]
                out["project_name"] = data.get("project_name") or value
        elif key in ("report_to", "project_name") and data.get("wandb"):
            continue  # set with wandb above
        elif key == "report_to" and value is None:
            out[key] = []  # mlx_lm.lora's default: no tracker
        else:
            out[key] = value
    entry = data.get("optimizer_config") or {}
    relative = isinstance(entry, Mapping) and "relative_step" in (entry.get("adafactor") or {})
    if finetune and chosen == "adafactor" and not relative:
        warnings.warn(f"{where('optimizer') if 'optimizer' in data else source}: mlx_lm.lora's adafactor takes "
                      "relative steps and so ignores learning_rate; mlx-train's uses learning_rate (relative_step="
                      "false); say so with optimizer_config: {adafactor: {relative_step: false}}", stacklevel=3)
    return out


def _clip_epsilon(data: Mapping[str, Any], value: Any, where: str) -> Any:
    """A fine-tuning file's top-level ``epsilon``: mlx-lm-lora's GRPO clip width (``clip_epsilon``), never the
    optimizer's (mlx_lm.lora and mlx-lm-lora give that in ``optimizer_config``). A mapping that also has
    ``clip_epsilon`` uses mlx-train's field names (``to_dict()``) and does not come here. Outside a GRPO file
    the key is refused: it would mean the optimizer's epsilon in mlx-train's flat layout and nothing there."""
    llm = data.get("llm")
    mode = data.get("train_mode", llm.get("train_mode") if isinstance(llm, Mapping) else None)
    if str(mode).strip().lower() == "grpo":
        return value
    trains = f"trains train_mode {mode}" if mode is not None else "names no train_mode (sft by default)"
    named = data.get("optimizer", "adam")
    optimizer = str(named.get("name", "adam") if isinstance(named, Mapping) else named).lower()
    raise ConfigError(f"{where}: epsilon is ambiguous here: in mlx-lm-lora's files it is GRPO's clip width, but "
                      f"this file {trains}; for GRPO's clip width write train_mode: grpo beside it (or name it "
                      f"clip_epsilon: {value}); for the optimizer's epsilon write optimizer_config: {{{optimizer}: "
                      f"{{eps: {value}}}}} (mlx_lm.lora's) or optimizer: {{epsilon: {value}}}")


# key -> (the value that changes nothing, what the key does in mlx_lm.lora and why it has no effect here)
_NO_EFFECT: dict[str, tuple[Any, str]] = {
    "train": (True, "mlx-train finetune always trains (train: false is mlx_lm.lora's test-only run)"),
    "config": (None, "a config file does not name another config file"),
    "clear_cache_threshold": (0, "mlx-train does not clear MLX's allocator cache between steps"),
    "trust_remote_code": (False, "mlx-train loads models and tokenizers without remote code"),
}


def _no_effect(key: str, value: Any, where: str) -> None:
    harmless, why = _NO_EFFECT[key]
    if value == harmless or (key == "config" and value):
        if key == "config" and value:
            warnings.warn(f"{where}: config: {value!r} is ignored: {why}", stacklevel=3)
        return
    if key == "train":
        raise ConfigError(f"{where}: train: {value!r} cannot be honoured: {why}; remove the key (or set it to "
                          "true)")
    warnings.warn(f"{where}: {key}: {value!r} is ignored: {why}", stacklevel=3)


def _optimizer_config(value: Any, chosen: str, where: str) -> dict[str, Any]:
    """The fields of ``optimizer_config``'s entry for the chosen optimizer (mlx_lm.lora ignores the others)."""
    if not isinstance(value, Mapping) or not all(isinstance(v, (Mapping, type(None))) for v in value.values()):
        raise ConfigError(f"{where}: optimizer_config must map optimizer names to their keyword arguments, e.g. "
                          f"{{adamw: {{weight_decay: 0.01}}}}, got {value!r}")
    entry = {str(k).lower(): v for k, v in value.items()}.get(chosen) or {}
    uses = tuple(MLX_OPTIMIZER_DEFAULTS.get(chosen, {}))  # the hyper-parameters TrainConfig passes it
    fields: dict[str, Any] = {}
    for key, setting in entry.items():
        path = f"optimizer_config.{chosen}.{key}"
        fixed = FIXED_KEYWORDS.get(chosen, {})
        if key == "betas" and "beta1" in uses:
            pair = setting if isinstance(setting, (list, tuple)) else ()
            if len(pair) != 2:
                raise ConfigError(f"{where}: {path} must be a pair [beta1, beta2], got {setting!r}")
            fields.update(beta1=pair[0], beta2=pair[1])
        elif key in _KEYWORD_FIELDS and _KEYWORD_FIELDS[key] in uses:
            fields[_KEYWORD_FIELDS[key]] = setting
        elif key in fixed:
            wanted = fixed[key]
            same = list(setting) == wanted if isinstance(setting, (list, tuple)) else setting == wanted
            if not same:
                raise ConfigError(f"{where}: {path}: {setting!r} cannot be honoured: mlx-train always builds "
                                  f"{chosen} with {key}={wanted!r}; remove the key")
        else:
            known = sorted({"betas" if u in ("beta1", "beta2") else {"epsilon": "eps"}.get(u, u) for u in uses}
                           | set(fixed))
            raise ConfigError(f"{where}: {path} has no counterpart in mlx-train's {chosen} (its keys: "
                              f"{', '.join(known) or 'none'}); remove it")
    return fields


def _lr_schedule(value: Mapping[str, Any], data: Mapping[str, Any], where: str,
                 rate_where: str) -> dict[str, Any]:
    """mlx_lm.lora's schedule ``{name, arguments, warmup, warmup_init}`` as TrainConfig fields."""
    unknown = sorted(set(value) - {"name", "arguments", "warmup", "warmup_init"})
    if unknown or "name" not in value:
        raise ConfigError(f"{where}: lr_schedule {'has unknown key ' + repr(unknown[0]) if unknown else 'has no name'}"
                          "; mlx_lm.lora's schedule is {name, arguments: [initial_rate, ...], warmup, warmup_init}")
    arguments = value.get("arguments")
    if not isinstance(arguments, (list, tuple)) or not arguments or number(arguments[0]) is None:
        raise ConfigError(f"{where}: lr_schedule.arguments must be a list that starts with the initial learning "
                          f"rate, e.g. [1e-5, 1000, 1e-7] for cosine_decay, got {arguments!r}")
    rate = number(arguments[0])
    given = data.get("learning_rate")
    if given is not None and number(given) != rate:
        warnings.warn(f"{rate_where}: learning_rate {given} is not used: lr_schedule.arguments[0] {arguments[0]} is "
                      "the initial rate (as in mlx_lm.lora)", stacklevel=4)
    warmup = value.get("warmup", 0) or 0
    if warmup:
        warnings.warn(f"{where}: lr_schedule.warmup {warmup}: mlx_lm.lora holds the peak rate for one more step "
                      "after its warmup than mlx-train, so its schedule runs one step behind mlx-train's",
                      stacklevel=4)
    return {"lr_schedule": value["name"], "learning_rate": rate, "lr_schedule_args": list(arguments[1:]),
            "warmup_steps": warmup, "warmup_init": value.get("warmup_init", 0.0)}

