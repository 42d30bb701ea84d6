"""What per-token loss masks cost in the fine-tuning data path, and what they train.

On N multi-turn chat records (the tiny tokenizer of tests/scripts with ChatML/Qwen-, Llama-3-, Gemma- and
SmolLM2-style templates, no download):

  (a) tokenising with --mask-prompt (mlx-lm's one offset, now a mask) and building every training row
      (what the loader does per step: ``SequenceDataset.__getitem__``) -- this checkout against another
      checkout's ``src`` (``--against /path/to/src``, e.g. the main branch), each in its own process; the rows'
      loss masks must be identical (a checksum), so the compiled step sees the same batches
  (b) tokenising with --assistant-only-loss: from {% generation %} markers and turn by turn, per template
  (c) assistant tokens: trained by --assistant-only-loss, and left out by --mask-prompt
  (e) with --speed STEPS: SFT tokens/s of a tiny llama with --mask-prompt on 1-3-turn chats (ChatML), this
      checkout against --against, each in its own process, alternating for --rounds rounds
  (d) with --train: a tiny llama fine-tuned both ways on multi-turn chats (Gemma-style template): the loss
      on the earlier assistant turns and on the last one, before and after; NaN anywhere is reported

    python bench/chat_masks.py                       # this checkout only
    python bench/chat_masks.py --against /work/main/src --records 2000 --train 30
    python bench/chat_masks.py --against /work/main/src --speed 40 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "tests", "scripts")


def records(n: int) -> list[dict]:
    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct

    base = [ct.CONVERSATIONS[k] for k in ("two_turns", "three_turns", "reasoning")]
    out = []
    for i in range(n):
        record = json.loads(json.dumps(base[i % len(base)]))
        record["messages"][-1]["content"] += f" ({i})"  # distinct records
        out.append(record)
    return out


def data_path(n: int) -> dict:
    """(a), in this process: seconds to tokenise with mask_prompt and to build every row, and a checksum."""
    import numpy as np

    sys.path.insert(0, SCRIPTS)
    import llm_tiny

    from mlx_train.llm.data import SequenceDataset, tokenize

    tokenizer = llm_tiny.make_tokenizer()  # plain ChatML, as every mlx-train version reads it
    data = records(n)
    start = time.perf_counter()
    docs = tokenize(data, tokenizer, mask_prompt=True)
    tokenized = time.perf_counter() - start
    rows = SequenceDataset(docs, max_seq_length=2048)
    start = time.perf_counter()
    built = [rows[i] for i in range(len(rows))]
    per_row = (time.perf_counter() - start) / len(rows)
    checksum = int(sum(int(np.dot(r["loss_mask"], np.arange(len(r["loss_mask"])) % 97)) for r in built))
    return {"tokenize_s": tokenized, "row_us": per_row * 1e6, "trained": int(sum(r["loss_mask"].sum() for r in built)),
            "checksum": checksum}


def speed(steps: int) -> dict:
    """(e), in this process: the SFT run's trained tokens/s (its mean report) with mask_prompt."""
    import tempfile

    sys.path.insert(0, SCRIPTS)
    import llm_tiny

    from mlx_train.llm.finetune import FineTuneConfig, finetune

    with tempfile.TemporaryDirectory() as tmp:
        llm_tiny.write_model_dir(os.path.join(tmp, "base"))
        os.makedirs(os.path.join(tmp, "data"))
        for split in ("train", "valid"):
            with open(os.path.join(tmp, "data", f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records(64))
        with contextlib.redirect_stdout(io.StringIO()):
            result = finetune(FineTuneConfig(model=os.path.join(tmp, "base"), data=os.path.join(tmp, "data"),
                                             iters=steps, batch_size=8, num_layers=2, steps_per_report=steps // 4,
                                             steps_per_eval=10 * steps, mask_prompt=True, seed=0,
                                             run_dir=os.path.join(tmp, "run")), log=lambda line: None)
    return {"tokens_per_second": result["tokens_per_second"], "trained": result["trained_tokens"]}


def run_with(src: str, n: int, steps: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, __file__, "--worker", "--records", str(n), "--speed", str(steps)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def templates(n: int) -> None:
    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct

    from mlx_train.llm.chat_masks import Supervision
    from mlx_train.llm.data import tokenize

    data = records(n)
    print(f"(b)/(c) {n} records, --assistant-only-loss")
    print(f"  {'template':9s} {'markers s':>10s} {'turns s':>8s} {'equal':>6s} {'assistant':>10s} "
          f"{'mask_prompt leaves out':>23s}")
    for name in ("qwen", "llama3", "gemma", "smollm2"):
        times, docs = [], []
        for template in (ct.TEMPLATES[name], ct.unmarked(ct.TEMPLATES[name])):
            tokenizer = ct.make_tokenizer(template)
            start = time.perf_counter()
            docs.append(tokenize(data, tokenizer, Supervision(assistant_only_loss=True)))
            times.append(time.perf_counter() - start)
        equal = all(a.tolist() == b.tolist() for a, b in zip(docs[0].masks or [], docs[1].masks or [], strict=True))
        last = tokenize(data, tokenizer, mask_prompt=True)
        print(f"  {name:9s} {times[0]:10.2f} {times[1]:8.2f} {str(equal):>6s} {docs[1].trained_tokens:10d} "
              f"{last.left_out:>14d} ({last.left_out / max(last.assistant_tokens, 1):.0%})")


def train_both_ways(steps: int) -> None:
    """(d): per-turn validation loss of a tiny llama before and after LoRA fine-tuning with each choice."""
    import math
    import tempfile

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct
    import llm_tiny

    from mlx_train.llm.chat_masks import Supervision
    from mlx_train.llm.data import tokenize
    from mlx_train.llm.finetune import FineTuneConfig, finetune
    from mlx_train.llm.models import save_model

    tokenizer = ct.make_tokenizer(ct.unmarked(ct.GEMMA))
    data = records(24)
    every = tokenize(data, tokenizer, Supervision(assistant_only_loss=True))
    last = tokenize(data, tokenizer, mask_prompt=True)

    def turn_losses(model: nn.Module) -> tuple[float, float]:
        earlier, final = [], []
        for tokens, all_turns, last_turn in zip(every.tokens, every.masks or [], last.masks or [], strict=True):
            logits = model(mx.array(tokens[None, :-1]))[0]
            ce = np.array(nn.losses.cross_entropy(logits, mx.array(tokens[1:])))
            earlier += ce[(all_turns[1:] & (1 - last_turn[1:])) == 1].tolist()
            final += ce[(all_turns[1:] & last_turn[1:]) == 1].tolist()
        return float(np.mean(earlier)), float(np.mean(final))

    with tempfile.TemporaryDirectory() as tmp:
        model, config = llm_tiny.make_model(len(tokenizer._tokenizer), seed=0)
        save_model(model, tokenizer, config, os.path.join(tmp, "base"))
        os.makedirs(os.path.join(tmp, "data"))
        for split in ("train", "valid"):
            with open(os.path.join(tmp, "data", f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in data)
        before = turn_losses(model)
        print(f"(d) tiny llama, Gemma-style template, {len(data)} chats, {steps} LoRA steps (loss: earlier turns / "
              f"last turn); before: {before[0]:.3f} / {before[1]:.3f}")
        for flag, docs in (("assistant_only_loss", every), ("mask_prompt", last)):
            with contextlib.redirect_stdout(io.StringIO()):  # the run's own report lines
                result = finetune(FineTuneConfig(model=os.path.join(tmp, "base"), data=os.path.join(tmp, "data"),
                                                 iters=steps, batch_size=8, learning_rate=2e-2, num_layers=2,
                                                 steps_per_report=steps, steps_per_eval=steps, val_batches=-1,
                                                 run_dir=os.path.join(tmp, flag), **{flag: True}),
                                  log=lambda line: None)
            after = turn_losses(result["model"])
            finite = all(math.isfinite(v) for v in [*result["history"]["train_loss"], result["val_loss"], *after])
            print(f"  {flag:20s} trained {result['trained_tokens']} tokens ({docs.trained_tokens} a pass over the "
                  f"data): {after[0]:.3f} / {after[1]:.3f}, all finite: {finite}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--against", help="another checkout's src directory to compare (a) with")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS", help="(d): fine-tune this many steps")
    parser.add_argument("--speed", type=int, default=0, metavar="STEPS", help="(e): SFT tokens/s over this many steps")
    parser.add_argument("--rounds", type=int, default=3, help="(e): alternating rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(speed(args.speed) if args.speed else data_path(args.records)))
        return
    if args.speed:
        sources = {"this checkout": os.path.join(HERE, "..", "src"), **({args.against: args.against} if args.against
                                                                       else {})}
        rates: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(args.rounds):
            for name, src in sources.items():
                result = run_with(src, args.records, args.speed)
                rates[name].append(result["tokens_per_second"])
        print(f"(e) SFT, tiny llama, --mask-prompt, {args.speed} steps of 8 chats: trained tokens/s, median of "
              f"{args.rounds} rounds ({result['trained']} tokens a run)")
        for name, values in rates.items():
            print(f"  {name}: {sorted(values)[len(values) // 2]:.0f}  (all: {', '.join(f'{v:.0f}' for v in values)})")
        return
    ours = run_with(os.path.join(HERE, "..", "src"), args.records)
    print(f"(a) {args.records} records, --mask-prompt: tokenise, build each row (per-step work), rows' masks")
    print(f"  this checkout: tokenise {ours['tokenize_s']:.2f} s, {ours['row_us']:.1f} us/row, "
          f"{ours['trained']} trained tokens, checksum {ours['checksum']}")
    if args.against:
        theirs = run_with(args.against, args.records)
        print(f"  {args.against}: tokenise {theirs['tokenize_s']:.2f} s, {theirs['row_us']:.1f} us/row, "
              f"{theirs['trained']} trained tokens, checksum {theirs['checksum']}")
        print(f"  identical rows: {ours['checksum'] == theirs['checksum'] and ours['trained'] == theirs['trained']}")
    templates(args.records)
    if args.train:
        train_both_ways(args.train)


if __name__ == "__main__":
    main()
