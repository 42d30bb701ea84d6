"""Memory: the plan's predicted peak against the peak of a real Trainer run, checkpointing, precision.

1. For each built-in model, ``MemoryOptimizer.measure`` calibrates on a few real steps at small
   micro-batches; ``suggest_config`` plans the largest micro-batch for a device budget; then the
   Trainer trains at the planned settings and MLX's peak-memory counter gives the measured peak
   (from before the model was built, so the weights and optimizer state count).
2. Peak memory and step time with and without gradient checkpointing (built-in transformer).
3. Peak memory and step time per precision.

    python bench/memory.py                 # everything (about a minute on 2 CPU cores)
    python bench/memory.py --part plan
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.device import format_bytes
from mlx_train.memory import HEADROOM, MemoryOptimizer
from mlx_train.memory.calibrate import measure_step, take_samples
from mlx_train.training import DataLoader, Trainer

# name: (dataset, model, model options, micro-batches to plan for)
MODELS = {
    "mlp": ("digits", "mlp", {}, (256, 1024)),
    "cnn": ("digits", "cnn", {}, (64, 256)),
    "transformer": ("text", "transformer", {}, (64, 256)),
    "transformer-4x256": ("text", "transformer", {"num_layers": 4, "dims": 256}, (32, 128)),
}


class _Peak:
    """Highest MLX peak over the steps after the first (the first one also compiles)."""

    def __init__(self) -> None:
        self.peak = 0

    def on_batch_end(self, trainer, step: int) -> None:
        if step > 1:
            self.peak = max(self.peak, mx.get_peak_memory())
        mx.reset_peak_memory()


def trainer_peak(data, info, name, options, plan, steps: int = 4) -> int:
    """Peak bytes of a real Trainer run with the plan's settings, counted from before the model exists (the
    arrays the DataLoader holds for MLX to gather batches from are data, not the step memory the plan
    predicts: they are made, at a first batch, before the count starts)."""
    train = data["train"]
    step_batch = plan.batch_size * plan.gradient_accumulation
    if isinstance(train, dict):
        train = {k: np.concatenate([v] * max(1, -(-step_batch * steps // len(v)))) for k, v in train.items()}
    else:
        train = tuple(np.concatenate([v] * max(1, -(-step_batch * steps // len(v)))) for v in train)
    loader = DataLoader(train, batch_size=plan.batch_size, num_workers=0)  # shuffled: each batch a gathered copy
    next(iter(loader))
    loader.set_epoch(0)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.random.seed(0)
    model = build_model(name, info, **options)
    probe = _Peak()
    trainer = Trainer(model, optim.AdamW(1e-3), max_steps=steps, report_every="1000 steps", **plan.to_config())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(loader, epochs=1, callbacks=[probe])
    return probe.peak - before


def plans() -> None:
    print("predicted (plan) vs measured (Trainer) peak per device, at the planned micro-batch")
    print(f"{'model':<18} {'budget':>10} {'plan':>16} {'predicted':>11} {'measured':>11} {'error':>7}")
    for label, (dataset, name, options, sizes) in MODELS.items():
        data = load_dataset(dataset, seed=0)
        mx.random.seed(0)
        model = build_model(name, data["info"], **options)
        profile = MemoryOptimizer.measure(model, data["train"], optimizer="adamw")
        del model
        for size in sizes:
            budget = profile.estimate(size).total
            plan = MemoryOptimizer.suggest_config(profile, 1, device_memory=int(budget / HEADROOM) + 1)
            measured = trainer_peak(data, data["info"], name, options, plan)
            predicted = plan.peak.total
            ckpt = " ckpt" if plan.gradient_checkpointing else ""
            setting = f"{plan.batch_size} x {plan.gradient_accumulation}{ckpt}"
            print(f"{label:<18} {format_bytes(plan.device_memory):>10} {setting:>16} {format_bytes(predicted):>11} "
                  f"{format_bytes(measured):>11} {100 * (predicted - measured) / measured:>+6.1f}%")
        # With a target the plan accumulates: the running gradient sum is part of the prediction.
        target = sizes[-1]
        budget = profile.estimate(sizes[0], accumulation=2).total
        plan = MemoryOptimizer.suggest_config(profile, 1, device_memory=int(budget / HEADROOM) + 1,
                                              target_batch_size=target)
        measured = trainer_peak(data, data["info"], name, options, plan)
        setting = f"{plan.batch_size} x {plan.gradient_accumulation}{' ckpt' if plan.gradient_checkpointing else ''}"
        print(f"{label:<18} {format_bytes(plan.device_memory):>10} {setting:>16} {format_bytes(plan.peak.total):>11} "
              f"{format_bytes(measured):>11} {100 * (plan.peak.total - measured) / measured:>+6.1f}%")


def checkpointing() -> None:
    print("\ngradient checkpointing: peak memory and step time (transformer, AdamW, float32)")
    print(f"{'model':<18} {'batch':>5} {'peak off':>11} {'peak on':>11} {'memory':>7} {'step off':>9} "
          f"{'step on':>9} {'time':>6}")
    data = load_dataset("text", seed=0)
    for label, options, batch in (("transformer", {}, 128), ("transformer-4x256", {"num_layers": 4, "dims": 256}, 64)):
        mx.random.seed(0)
        model = build_model("transformer", data["info"], **options)
        sample = take_samples({"tokens": mx.array(data["train"]["tokens"][:batch])}, batch)
        off = measure_step(model, sample)
        on = measure_step(model, sample, gradient_checkpointing=True)
        print(f"{label:<18} {batch:>5} {format_bytes(off.peak):>11} {format_bytes(on.peak):>11} "
              f"{on.peak / off.peak:>6.2f}x {1e3 * off.seconds:>7.1f}ms {1e3 * on.seconds:>7.1f}ms "
              f"{on.seconds / off.seconds:>5.2f}x")


def precisions() -> None:
    print("\nprecision: peak memory and step time (AdamW; weights stay float32; bfloat16/float16 matmuls are "
          "slow on the Linux CPU)")
    print(f"{'model':<18} {'batch':>5} {'precision':>10} {'peak':>11} {'vs fp32':>8} {'step':>9}")
    data = load_dataset("text", seed=0)
    mx.random.seed(0)
    model = build_model("transformer", data["info"])
    sample = {"tokens": mx.array(data["train"]["tokens"][:32])}
    base = None
    for precision in ("float32", "bfloat16", "float16"):
        result = measure_step(model, sample, precision=precision)
        base = base or result.peak
        print(f"{'transformer':<18} {32:>5} {precision:>10} {format_bytes(result.peak):>11} "
              f"{result.peak / base:>7.2f}x {1e3 * result.seconds:>7.1f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("plan", "checkpointing", "precision"), action="append")
    args = parser.parse_args()
    from mlx_train import _blas

    print(f"MLX {mx.__version__}, device {mx.default_device()}, BLAS: {_blas.describe()}\n")
    parts = args.part or ["plan", "checkpointing", "precision"]
    if "plan" in parts:
        plans()
    if "checkpointing" in parts:
        checkpointing()
    if "precision" in parts:
        precisions()


if __name__ == "__main__":
    main()
