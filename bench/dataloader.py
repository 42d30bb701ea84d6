"""DataLoader throughput next to what a training step consumes.

For three datasets (digits-sized arrays, a map-style dataset doing per-sample
Python work, padded variable-length token sequences) it prints loader
batches/s and samples/s for num_workers 0 and 2, the steps/s of a small
compiled MLX train step on the same batches, and their ratio (> 1: the loader
is faster than the step). It then times whole epochs of "loader + step"
against a hand-written loop (numpy permutation, ``mx.array(x[idx])``, step) for
arrays, and against the step alone on prebuilt batches for the map-style set.

Last, for a map-style dataset whose samples are tokenised in pure Python (the GIL-bound case),
batches/s with no workers, 2 threads and 2 worker processes (``worker_type="process"``), as
ratios to no workers: in epoch 0 (which includes starting the processes) and in later epochs
(the loader keeps its processes), and the CPU time the consuming (training) process itself spends
per batch: what the data leaves of its cores to the training step.

Run: ``PYTHONPATH=src python bench/dataloader.py [--quick] [--python-heavy-only]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_train.data import DataLoader, LengthBucketing


class PythonWorkDataset:
    """Map-style: each sample is normalized and jittered in Python (like real augmentation)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple:
        row = self.x[i]
        scale = 1.0 / (max(row.tolist()) + 1e-6)  # a little Python per sample
        return (row * np.float32(scale)).clip(0.0, 1.0), int(self.y[i])


class TokenizeText:
    """Map-style: each sample is a text tokenised in pure Python (lower-casing, word split, a vocabulary
    lookup with a character fallback), as a tokenizer written in Python would; a {"tokens", "label"} dict."""

    WORDS = ("the quick brown fox jumps over lazy dog while seven wizards quietly hex jovial kings and "
             "thou art the king of all that lies beneath heaven I shall not yield my sword").split()

    def __init__(self, n: int, words_per_text: int = 1500) -> None:
        self.n, self.words = n, words_per_text
        self.vocab = {w: i + 300 for i, w in enumerate(sorted(set(self.WORDS)))}

    def __len__(self) -> int:
        return self.n

    def text(self, i: int) -> str:
        words = self.WORDS
        return " ".join(words[(i * 31 + j * j * 7) % len(words)].upper() if j % 11 == 0 else
                        words[(i * 31 + j * j * 7) % len(words)] for j in range(self.words))

    def __getitem__(self, i: int) -> dict:
        ids = []
        for word in self.text(i).lower().split():
            token = self.vocab.get(word)
            if token is None:
                ids.extend(ord(c) for c in word)
            else:
                ids.append(token)
        return {"tokens": ids[:512], "label": i % 4}


def python_heavy(seconds: float, batch_size: int) -> None:
    """Batches/s of a pure-Python tokenising dataset: no workers, threads, processes (ratios to none)."""
    data = TokenizeText(3000)
    kinds = {"no workers": {"num_workers": 0}, "2 threads": {"num_workers": 2},
             "2 processes": {"num_workers": 2, "worker_type": "process"}}
    loaders = {name: DataLoader(data, batch_size, seed=0, **options) for name, options in kinds.items()}
    reference = [np.array(b["tokens"]) for b in DataLoader(data, batch_size, seed=0, num_workers=0)]
    first: dict[str, float] = {}
    for name, loader in loaders.items():  # epoch 0: the processes start here
        t0 = time.perf_counter()
        tokens = [np.array(b["tokens"]) for b in loader]
        first[name] = len(tokens) / (time.perf_counter() - t0)
        assert all(np.array_equal(a, b) for a, b in zip(tokens, reference, strict=True)), name
    later: dict[str, list[float]] = {name: [] for name in kinds}
    cpu: dict[str, list[float]] = {name: [] for name in kinds}  # this process's CPU time (all its threads)
    rounds = 2 if seconds < 1 else 4
    for _ in range(rounds):  # the next epochs, the kinds alternating
        for name, loader in loaders.items():
            t0, c0 = time.perf_counter(), time.process_time()
            count = sum(1 for _ in loader)
            later[name].append(count / (time.perf_counter() - t0))
            cpu[name].append((time.process_time() - c0) / count)
    for loader in loaders.values():
        loader.close()
    print(f"\n{'map-style, Python tokenising per sample':42s} {'epoch 0 b/s':>12s} {'ratio':>6s} "
          f"{'later b/s':>10s} {'ratio':>6s} {'consumer CPU ms/batch':>22s}")
    base = statistics.median(later["no workers"])
    for name in kinds:
        rate = statistics.median(later[name])
        print(f"{name:42s} {first[name]:>12.1f} {first[name] / first['no workers']:>6.2f} {rate:>10.1f} "
              f"{rate / base:>6.2f} {statistics.median(cpu[name]) * 1e3:>22.2f}")
    print(f"({len(reference)} batches of {batch_size} per epoch, {os.cpu_count()} CPUs; epoch 0 includes starting "
          f"the processes; later: median of {rounds} epochs, the kinds alternating; consumer CPU: the CPU time of "
          "the training process itself, worker threads included, per batch)")


class SeqModel(nn.Module):
    def __init__(self, vocab: int = 256, dims: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dims)
        self.out = nn.Linear(dims, classes)

    def __call__(self, tokens: mx.array, mask: mx.array) -> mx.array:
        m = mask.astype(mx.float32)[..., None]
        pooled = (self.embed(tokens) * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)
        return self.out(pooled)


def make_step(model: nn.Module, loss_fn):
    optimizer = optim.AdamW(1e-3)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, *batch)
        optimizer.update(model, grads)
        return loss

    def run(*batch):
        loss = step(*batch)
        mx.eval(state, loss)

    return run


def mlp_loss(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def seq_loss(model, tokens, mask, label):
    return nn.losses.cross_entropy(model(tokens, mask), label, reduction="mean")


def rate(fn, seconds: float) -> tuple[float, int]:
    """Best-of-3 (calls/s, calls) of fn() (fn returns the number of items it did)."""
    best = 0.0
    for _ in range(3):
        t0, done = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 3:
            done += fn()
        best = max(best, done / (time.perf_counter() - t0))
    return best, done


def loader_rate(loader: DataLoader, seconds: float) -> float:
    def epoch() -> int:
        n = 0
        for batch in loader:
            mx.eval(batch)  # a batch gathered from arrays MLX holds is computed when evaluated
            n += 1
        return n

    return rate(epoch, seconds)[0]


def step_rate(run, batches: list, seconds: float) -> float:
    for b in batches[:3]:
        run(*b)  # compile

    def some() -> int:
        for b in batches:
            run(*b)
        return len(batches)

    return rate(some, seconds)[0]


def as_args(batch) -> tuple:
    if isinstance(batch, dict):
        return batch["tokens"], batch["tokens_mask"], batch["label"]
    return tuple(batch)


def row(name: str, workers: int, batch_size: int, lps: float, sps: float, extra: str = "") -> None:
    numbers = f"{lps:>10.0f} {lps * batch_size:>11.0f} {sps:>9.0f} {lps / sps:>7.1f}"
    print(f"{name:34s} {workers:>3d} {numbers}  {extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--python-heavy-only", action="store_true", help="only the threads/processes table")
    args = parser.parse_args()
    secs = 0.6 if args.quick else 2.0
    bs = args.batch_size
    if args.python_heavy_only:
        python_heavy(secs, bs)
        return
    rng = np.random.default_rng(0)
    x = rng.random((1797, 64), dtype=np.float32)
    y = rng.integers(0, 10, 1797).astype(np.int32)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    mx.eval(mlp.parameters())
    mlp_step = make_step(mlp, mlp_loss)

    print(f"{'dataset':34s} {'nw':>3s} {'batches/s':>10s} {'samples/s':>11s} {'steps/s':>9s} {'ld/step':>7s}")
    # 1. digits-sized arrays
    sample_batches = [tuple(b) for b in DataLoader((x, y), batch_size=bs, num_workers=0)]
    mlp_sps = step_rate(mlp_step, sample_batches, secs)
    for nw in (0, 2):
        lps = loader_rate(DataLoader((x, y), bs, num_workers=nw), secs)
        row("arrays 1797x64 (digits-sized)", nw, bs, lps, mlp_sps)
    # 2. map-style with per-sample Python work
    work = PythonWorkDataset(x, y)
    for nw in (0, 2):
        lps = loader_rate(DataLoader(work, bs, num_workers=nw), secs)
        row("map-style, Python work/sample", nw, bs, lps, mlp_sps)
    # 3. variable-length sequences, padded (plain and length-bucketed)
    lengths = rng.integers(8, 256, 2000)
    rows = [{"tokens": rng.integers(1, 256, n).tolist(), "label": int(n % 4)} for n in lengths]
    seq = SeqModel()
    mx.eval(seq.parameters())
    seq_step = make_step(seq, seq_loss)
    strategies = (("token lists, padded", None), ("token lists, LengthBucketing", LengthBucketing("tokens")))
    for name, batching in strategies:
        loader = DataLoader(rows, bs, num_workers=0, batching=batching)
        batches = [as_args(b) for b in loader]
        waste = 1 - sum(int(b[1].sum().item()) for b in batches) / sum(b[1].size for b in batches)
        shapes = sorted({b[0].shape[1] for b in batches})
        sps = step_rate(seq_step, batches, secs)
        for nw in (0, 2):
            lps = loader_rate(DataLoader(rows, bs, num_workers=nw, batching=batching), secs)
            row(name, nw, bs, lps, sps, f"pad waste {waste:.0%}, {len(shapes)} lengths")

    # 4. whole epochs of loader + step, timed interleaved (best of N rounds: the box is noisy)
    def hand() -> None:
        perm = np.random.default_rng([0, 0]).permutation(len(x))
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            mlp_step(mx.array(x[idx]), mx.array(y[idx]))

    def loop(loader: DataLoader):
        def run() -> None:
            for xb, yb in loader:
                mlp_step(xb, yb)

        return run

    def prebuilt(batches: list):
        def run() -> None:
            for xb, yb in batches:
                mlp_step(xb, yb)

        return run

    work_batches = [tuple(b) for b in DataLoader(work, bs, num_workers=0)]
    contenders = {
        "arrays: hand-written loop": hand,
        "arrays: DataLoader nw=0 + step": loop(DataLoader((x, y), bs, num_workers=0)),
        "arrays: DataLoader nw=2 + step": loop(DataLoader((x, y), bs, num_workers=2)),
        "map-style: step on prebuilt batches": prebuilt(work_batches),
        "map-style: DataLoader nw=0 + step": loop(DataLoader(work, bs, num_workers=0)),
        "map-style: DataLoader nw=2 + step": loop(DataLoader(work, bs, num_workers=2)),
    }
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(4 if args.quick else 12):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"\n{'epoch loop (MLP step, same batches)':40s} {'ms/epoch':>9s} {'vs reference':>13s}")
    for name, seconds in best.items():
        reference = best["arrays: hand-written loop"] if name.startswith("arrays") else best[
            "map-style: step on prebuilt batches"]
        print(f"{name:40s} {seconds * 1e3:>9.2f} {reference / seconds:>13.3f}")
    python_heavy(secs, bs)


if __name__ == "__main__":
    main()
