"""Show what fine-tuning trains: the first records of a data set rendered with the chat template, the
trained tokens marked (highlighted on a terminal, between [[ and ]] otherwise), and the counts of the
split (records, tokens, trained tokens) -- to check a template and the masking choice before a long run.

The choice is fine-tuning's: --mask-prompt (mlx_lm.lora's: the last message only), --assistant-only-loss
(every assistant turn; --no-train-on-tool-calls, --no-train-on-reasoning), or neither (every token).
Only the tokenizer is loaded.

Example::

    mlx-train inspect-data --model mlx-community/SmolLM2-135M-Instruct --data data --assistant-only-loss -n 2
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mlx_train.errors import ConfigError

#: The fine-tuning settings this command takes (flag -> FinetuneConfig field).
SETTINGS = {"--mask-prompt": "mask_prompt", "--assistant-only-loss": "assistant_only_loss",
            "--train-on-tool-calls": "train_on_tool_calls", "--train-on-reasoning": "train_on_reasoning",
            "--max-seq-length": "max_seq_length"}
MARKS = ("[[", "]]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``inspect-data`` flags."""
    from mlx_train.cli.flags import add_flags
    from mlx_train.config import FinetuneConfig

    parser.add_argument("--model", required=True, help="the model (directory, Hugging Face name or .gguf) whose "
                                                       "tokenizer and chat template render the records")
    parser.add_argument("--data", required=True, help="a directory of train/valid/test.jsonl, or a Hugging Face "
                                                      "dataset name (as for finetune)")
    parser.add_argument("--split", default="train", choices=("train", "valid", "test"),
                        help="the split to show (default: train)")
    parser.add_argument("-n", "--records", type=int, default=3, metavar="N",
                        help="how many records to show (default: 3; 0: only the counts)")
    add_flags(parser, SETTINGS, config=FinetuneConfig)


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model``: a local mlx-lm/Hugging Face directory's alone, else the model's (loaded)."""
    from mlx_train.llm import models

    models.require_mlx_lm()
    if os.path.isdir(model):
        from pathlib import Path

        from mlx_lm.utils import load_tokenizer as load

        return load(Path(model))
    return models.load_model(model)[1]


def inspect_data(args: argparse.Namespace, out: Any = None) -> dict[str, int]:
    """Print the first ``args.records`` records with their trained tokens marked and the split's counts;
    return the counts (``records``, ``documents``, ``tokens``, ``trained_tokens``).

    Example: ``inspect_data(build_parser("inspect-data").parse_args([...]))["trained_tokens"]``.
    """
    from rich.console import Console
    from rich.text import Text

    from mlx_train.config import FinetuneConfig
    from mlx_train.llm import data
    from mlx_train.llm.chat_masks import Supervision, trained_segments

    settings = {name: getattr(args, name) for name in SETTINGS.values() if getattr(args, name, None) is not None}
    config = FinetuneConfig(model=args.model, dataset=args.data, **settings)
    supervision = Supervision.from_finetune(config)
    records = data.load_records(args.data)[args.split]
    if not records:
        raise ConfigError(f"{args.data} has no {args.split} records; choose another --split")
    tokenizer = load_tokenizer(args.model)
    docs = data.tokenize(records, tokenizer, supervision, config.max_seq_length, where=f"{args.data}/{args.split}")
    console = Console(file=out or sys.stdout, highlight=False, soft_wrap=True)
    plain = not console.is_terminal
    for i, record in enumerate(records[: max(args.records, 0)]):
        tokens, mask = data.encode_masked(record, tokenizer, supervision)
        place = records.place(i) if isinstance(records, data.Records) else f"record {i + 1}"
        text = Text()
        for segment, trained in trained_segments(tokenizer, tokens[: config.max_seq_length],
                                                 mask[: config.max_seq_length]):
            if trained and plain:
                text.append(f"{MARKS[0]}{segment}{MARKS[1]}")
            else:
                text.append(segment, style="bold black on green" if trained else "dim")
        trained_count = int(mask[1: config.max_seq_length].sum())
        console.print(f"--- {place}: {len(tokens)} tokens, {trained_count} trained", style="bold")
        console.print(text)
    mode = ("every assistant turn (--assistant-only-loss)" if supervision.assistant_only_loss else
            "the last message (--mask-prompt, as mlx_lm.lora)" if supervision.mask_prompt else "every token")
    counts = {"records": len(records), "documents": len(docs), "tokens": int(docs.lengths.sum()),
              "trained_tokens": docs.trained_tokens}
    console.print(f"{args.split}: {counts['records']} records, {counts['tokens']} tokens, {counts['trained_tokens']} "
                  f"trained ({counts['trained_tokens'] / max(counts['tokens'], 1):.0%}) -- trains {mode}"
                  + (f"; {docs.truncated} cut to max_seq_length={config.max_seq_length}" if docs.truncated else ""))
    if docs.left_out:
        console.print(data.describe_documents(args.split, docs).split("; ", 1)[1])
    return counts


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train inspect-data``."""
    inspect_data(args)
    return 0
