"""Magnitude pruning: quality at 50 / 80 / 90% sparsity against the dense run, and the step-time cost.

Quality: the same model, data, seed and recipe trained dense and with ``Pruning`` (Zhu & Gupta
polynomial schedule, global magnitude threshold over Linear weights), then scored on the test split:
accuracy for the digits MLP, loss for the char transformer. Step time: dense and pruned runs
(masks active from the first step) alternate in this process, round after round, and the median
steps/s of each side is compared; the mask updates at the schedule's steps (outside the step) are
timed separately.

    python bench/pruning.py                          # both workloads
    python bench/pruning.py --workload mlp --seeds 5 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.training import Callback, Pruning, Trainer

SPARSITIES = (0.0, 0.5, 0.8, 0.9)
WORKLOADS = {
    # name: dataset, dataset options, model, model options, batch size, quality recipe, timing steps per round
    "mlp": ("digits", {}, "mlp", {"hidden_dims": [256]}, 32,
            {"epochs": 60, "learning_rate": 1e-3, "start": 80, "end": 1600, "frequency": 40, "seeds": 3}, 2000),
    "transformer": ("text", {"block_size": 32}, "transformer", {"dims": 64, "num_heads": 4, "num_layers": 2}, 32,
                    {"max_steps": 500, "learning_rate": 3e-3, "start": 50, "end": 350, "frequency": 25, "seeds": 1},
                    60),
}


class _Timer(Callback):
    """Steps per second from step ``skip`` (compilation done) to the last step."""

    def __init__(self, skip: int = 10) -> None:
        self.skip, self.start, self.steps = skip, None, 0

    def on_batch_end(self, trainer, step):
        self.steps = step
        if step == self.skip:
            self.start = time.perf_counter()

    def rate(self) -> float:
        return (self.steps - self.skip) / (time.perf_counter() - self.start)


class _MaskUpdateTimer(Pruning):
    """Pruning that also times its mask updates (outside the compiled step)."""

    seconds: list[float]

    def _maybe_update(self, trainer, step):
        if self.sparsity_at(step) is None or step == self.last_update:
            return super()._maybe_update(trainer, step)
        start = time.perf_counter()
        super()._maybe_update(trainer, step)
        self.seconds = [*getattr(self, "seconds", []), time.perf_counter() - start]


def _train(workload, data, sparsity, seed, steps=None, callbacks=(), one_shot=False, zero_moments="update"):
    dataset, _, name, options, batch_size, recipe, _ = WORKLOADS[workload]
    mx.random.seed(seed)
    model = build_model(name, data["info"], **options)
    callbacks = list(callbacks)
    pruning = None
    if sparsity:
        if one_shot:
            pruning = _MaskUpdateTimer(sparsity, schedule="one_shot", start_step=1, zero_moments=zero_moments)
        else:
            pruning = _MaskUpdateTimer(sparsity, start_step=recipe["start"], end_step=recipe["end"],
                                       frequency=recipe["frequency"])
        callbacks.insert(0, pruning)
    limits = {"max_steps": steps} if steps else {k: recipe[k] for k in ("epochs", "max_steps") if k in recipe}
    trainer = Trainer(model, optim.Adam(recipe["learning_rate"]), batch_size=batch_size, seed=seed,
                      report_every="100000 steps", **limits)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(data["train"], epochs=limits.get("epochs", 1000), callbacks=callbacks)
    return model, trainer, pruning


def _test_score(workload, model, trainer, data):
    metrics = trainer.evaluate(data["test"])
    return metrics["accuracy"] if workload == "mlp" else metrics["loss"]


def _measured_sparsity(model, pruning):
    if pruning is None:
        return 0.0
    params = dict(tree_flatten(model.parameters()))
    names = list(pruning.step_state["masks"])
    return sum(int((np.array(params[n]) == 0).sum()) for n in names) / sum(params[n].size for n in names)


def quality(workload, data, seeds):
    rows = []
    for sparsity in SPARSITIES:
        scores, measured, updates = [], [], []
        for seed in seeds:
            model, trainer, pruning = _train(workload, data, sparsity, seed)
            scores.append(_test_score(workload, model, trainer, data))
            measured.append(_measured_sparsity(model, pruning))
            updates += getattr(pruning, "seconds", [])
        rows.append((sparsity, statistics.mean(measured), statistics.mean(scores), scores,
                     statistics.median(updates) if updates else None))
    return rows


def _batches(workload, data, count, seed=0):
    batch_size = WORKLOADS[workload][4]
    split = data["train"]
    arrays = split if isinstance(split, tuple) else (split["tokens"],)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(arrays[0]), batch_size, replace=False) for _ in range(count)]
    if isinstance(split, tuple):
        return [tuple(mx.array(a[i]) for a in arrays) for i in picks]
    return [{"tokens": mx.array(arrays[0][i])} for i in picks]


def step_cost(workload, data, rounds, sides=((0.0, "update"), (0.9, "update"))):
    """Median over rounds of (step time of side 1) / (step time of side 0): the two Trainers' steps
    alternate one by one (order swapped every step), so machine load hits both alike."""
    steps = WORKLOADS[workload][6]
    runs = []
    for sparsity, zero_moments in sides:  # set up (and compile) each side with two real steps, masks active
        model, trainer, pruning = _train(workload, data, sparsity, seed=0, steps=2, one_shot=True,
                                         zero_moments=zero_moments)
        runs.append((trainer, pruning, [0.0]))
    batches = _batches(workload, data, steps)
    ratios = []
    for _ in range(rounds):
        for run in runs:
            run[2][0] = 0.0
        for i, batch in enumerate(batches):
            for trainer, pruning, spent in (runs if i % 2 else runs[::-1]):
                start = time.perf_counter()
                trainer.state.running = trainer.memory_guard(trainer.state, batch)
                trainer.state.step += 1
                if pruning is not None:
                    pruning.on_batch_end(trainer, trainer.state.step)
                spent[0] += time.perf_counter() - start
        ratios.append(runs[1][2][0] / runs[0][2][0])
    per_step = [run[2][0] / steps * 1000 for run in runs]
    return statistics.median(ratios), per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--seeds", type=int, help="training seeds averaged for the quality table "
                        "(default: 3 for the MLP, 1 for the transformer)")
    parser.add_argument("--rounds", type=int, help="alternating timing rounds, median (default: 7 MLP, 3 transformer)")
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    from mlx_train import _blas

    print(f"MLX {mx.__version__}, device {mx.default_device()}, BLAS: {_blas.describe()}")
    for workload in args.workload or ["mlp", "transformer"]:
        dataset, dataset_options, *_ = WORKLOADS[workload]
        data = load_dataset(dataset, seed=0, **dataset_options)
        metric = "test accuracy" if workload == "mlp" else "test loss"
        seeds = args.seeds or WORKLOADS[workload][5]["seeds"]
        rounds = args.rounds or (7 if workload == "mlp" else 3)
        if not args.skip_quality:
            rows = quality(workload, data, list(range(seeds)))
            dense = rows[0][2]
            print(f"\n{workload}: {metric}, mean of {seeds} seed(s)")
            print(f"| target | measured sparsity | {metric} | vs dense | per seed | mask update ms |")
            print("|---|---|---|---|---|---|")
            for target, measured, score, scores, update in rows:
                delta = (score - dense) * (100 if workload == "mlp" else 1)
                shown = f"{score:.4f}" if workload != "mlp" else f"{100 * score:.2f}%"
                per_seed = " ".join(f"{100 * s:.1f}" if workload == "mlp" else f"{s:.3f}" for s in scores)
                unit = " pt" if workload == "mlp" else ""
                ms = f"{1000 * update:.1f}" if update is not None else "-"
                print(f"| {target:.0%} | {measured:.4f} | {shown} | {delta:+.2f}{unit} | {per_seed} | {ms} |")
        control, _ = step_cost(workload, data, rounds, sides=((0.0, "update"), (0.0, "update")))
        print(f"\n{workload}: step time, steps of two runs alternating one by one, median of {rounds} rounds "
              f"of {WORKLOADS[workload][6]} steps, masks at 90% active")
        print(f"dense / dense (noise control): {control:.3f}")
        for zero_moments in ("update", "step"):
            ratio, (dense_ms, pruned_ms) = step_cost(workload, data, rounds,
                                                     sides=((0.0, "update"), (0.9, zero_moments)))
            print(f"pruned (zero_moments={zero_moments!r}) / dense: {ratio:.3f} (cost {100 * (ratio - 1):+.1f}%; "
                  f"last round {dense_ms:.3f} vs {pruned_ms:.3f} ms per step)")

if __name__ == "__main__":
    main()
