"""Fine-tuning data: mlx-lm's jsonl formats, prompt masking, truncation, packing, batches.

Records are ``{"text": ...}``, ``{"prompt": ..., "completion": ...}`` or chat
``{"messages": [...]}`` (rendered with the tokenizer's chat template), read from a directory of
``train.jsonl``/``valid.jsonl``/``test.jsonl`` or a Hugging Face ``datasets`` dataset.

A document is its tokens plus its loss mask: which tokens are trained on (all, those after the
prompt with ``mask_prompt``, the assistant turns with ``assistant_only_loss``: ``mlx_train.llm.chat_masks``).
A :class:`SequenceDataset` row holds one document, or several when packed (up to ``max_seq_length``
tokens). A row is a dict of numpy arrays, already shifted for next-token
prediction: ``inputs``, ``targets``, ``loss_mask`` (1 where the target is trained on: never the
prompt, never the first token of the next document) and, when packed, ``segments`` (1, 2, ...
per document, 0 for padding) so attention can stay inside a document.

Two ways to fill a step with ``batch_size x max_seq_length`` tokens (``pack=``):

- ``"best_fit"`` (or ``True``): several documents per row (best fit, longest first); attention
  stays inside a document through a block-diagonal ``[L, L]`` mask per row, so a row still pays
  for attention across its whole length.
- ``"by_length"``: every document is its own row, and :func:`make_loader` makes batches of rows of
  similar length, as many as fit in ``batch_size x max_seq_length`` padded tokens
  (:class:`~mlx_train.data.TokenBudget`). No mask is needed (plain causal attention), and little
  is padded because the rows of a batch have nearly the same length.

Neither is the default: on the Linux CPU, bench/packing.py measured both below plain length
bucketing in real tokens/s (SmolLM2-135M, LoRA), which already pads little.

Rows are built once from the data (deterministically), so the DataLoader's arithmetic resume
applies unchanged; :func:`make_loader` buckets them by token length and pads to a multiple of 8.

Example::

    train = SequenceDataset(tokenize(records, tokenizer, mask_prompt=True), max_seq_length=512, pack=True)
    loader = make_loader(train, batch_size=4, seed=0)
"""

from __future__ import annotations

import bisect
import copy
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlx_train.errors import ConfigError, DataError
from mlx_train.llm.chat_masks import Supervision, encode_chat, reply_start

PAD_MULTIPLE = 8
#: Trained positions per row are padded to a multiple of this (few distinct shapes to compile).
POSITION_MULTIPLE = 32
SPLITS = ("train", "valid", "test")
#: Multi-turn chats whose assistant tokens left out by mask_prompt are counted (each is rendered turn by turn again).
LEFT_OUT_SAMPLE = 1000
PACKINGS = ("best_fit", "by_length")

#: One jsonl record (``{"text": ...}``, ``{"prompt": ..., "completion": ...}``, ``{"messages": [...]}``) or one row.
Record = dict[str, Any]


class Records(list[Record]):
    """The records of one split, with where each came from: ``place(i)`` is ``"data/train.jsonl:7"`` (the 1-based
    line) for a jsonl file, ``"data record 7"`` (1-based) otherwise.

    Example: ``Records([{"text": "hi"}], source="data/train.jsonl", lines=[3]).place(0)  # "data/train.jsonl:3"``
    """

    def __init__(self, records: Sequence[Record] = (), source: str = "data", lines: Sequence[int] | None = None):
        super().__init__(records)
        self.source = source
        self.lines = list(lines) if lines is not None else None

    def place(self, index: int) -> str:
        if self.lines is not None and index < len(self.lines):
            return f"{self.source}:{self.lines[index]}"
        return f"{self.source} record {index + 1}"


def load_records(data: str) -> dict[str, list[Record]]:
    """Records of each split (``train``, ``valid``, ``test``) from a jsonl directory or a Hugging
    Face dataset name; a missing split is an empty list.

    Example: ``load_records("data/")["train"][0] -> {"text": ...}``.
    """
    if os.path.isdir(data):
        splits: dict[str, list[Record]] = {}
        for split in SPLITS:
            path = os.path.join(data, f"{split}.jsonl")
            numbered = read_jsonl_lines(path) if os.path.isfile(path) else []
            splits[split] = Records([r for _, r in numbered], path, [n for n, _ in numbered])
        if not splits["train"] and not splits["valid"] and not splits["test"]:
            raise ConfigError(f"data directory {data} has no train.jsonl, valid.jsonl or test.jsonl")
        return splits
    if os.path.exists(data) or data.endswith(".jsonl"):
        raise ConfigError(f"--data {data} must be a directory holding train.jsonl/valid.jsonl/test.jsonl "
                          "(or a Hugging Face dataset name)")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{data} is not a local directory; to load it as a Hugging Face dataset install "
                          "the datasets extra: pip install 'mlx-train[datasets]'") from None
    loaded = datasets.load_dataset(data)
    names = {"valid": ("valid", "validation"), "train": ("train",), "test": ("test",)}
    return {split: Records(next((list(loaded[n]) for n in names[split] if n in loaded), []), f"{data} {split}")
            for split in SPLITS}


def read_jsonl_lines(path: str) -> list[tuple[int, Record]]:
    """``(line number, record)`` of each non-blank line of a jsonl file, for errors that name the line.

    Example: ``read_jsonl_lines("data/train.jsonl")[0] -> (1, {"prompt": ..., "chosen": ..., "rejected": ...})``.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not valid JSON ({error.msg}); each line must be one "
                                "JSON object like {\"text\": ...}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            records.append((number, record))
    return records


def record_format(record: Record) -> str:
    """``"completion"``, ``"chat"`` or ``"text"``: which mlx-lm format a record is in."""
    if "prompt" in record and "completion" in record:
        return "completion"
    if "messages" in record:
        return "chat"
    if "text" in record:
        return "text"
    raise DataError(f"record with keys {sorted(record)} is in no known format; use {{\"text\": ...}}, "
                    "{\"prompt\": ..., \"completion\": ...} or {\"messages\": [{\"role\": ..., \"content\": ...}]}")


def _check_types(record: Record, kind: str) -> None:
    """A record's fields hold what its format needs: strings, and a list of message objects."""
    fields = {"text": ("text",), "completion": ("prompt", "completion"), "chat": ()}[kind]
    for name in fields:
        if not isinstance(record[name], str):
            raise DataError(f"\"{name}\" must be a string, got {type(record[name]).__name__} "
                            f"{str(record[name])[:40]!r}")
    if kind != "chat":
        return
    messages = record["messages"]
    if not isinstance(messages, list):
        raise DataError(f"\"messages\" must be a list of messages, got {type(messages).__name__}; write it like "
                        "[{\"role\": \"user\", \"content\": ...}, {\"role\": \"assistant\", \"content\": ...}]")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"message {number} of \"messages\" is {str(message)[:40]!r}; each message must be an "
                            "object with a \"role\" string and its \"content\"")
        content = message.get("content")
        if not (isinstance(content, (str, list)) or (content is None and message.get("tool_calls"))):
            raise DataError(f"message {number} ({message['role']}) has \"content\" of type "
                            f"{type(content).__name__}; it must be a string (or null beside \"tool_calls\")")


def _chat(tokenizer: Any, messages: list[Record], tools: Any = None, add_generation_prompt: bool = False) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat and prompt/completion records need a tokenizer with a chat template; "
                        "this tokenizer has none (set tokenizer.chat_template or use {\"text\": ...} records)")
    tokens = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           tokenize=True, return_dict=False)
    return list(tokens)


def _messages(record: Record, kind: str) -> list[Record]:
    """The conversation of a chat or prompt/completion record."""
    if kind == "completion":
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    if not record["messages"]:
        raise DataError("a chat record has an empty messages list")
    return list(record["messages"])


def encode_record(record: Record, tokenizer: Any, mask_prompt: bool) -> tuple[list[int], int]:
    """``(tokens, offset)`` of one record: ``offset`` is the first token that is trained on.

    Text gets the EOS token appended; chat and prompt/completion are rendered with the chat
    template, and with ``mask_prompt`` everything before the last message is left out of the loss.
    Example: ``encode_record({"prompt": "2+2?", "completion": "4"}, tokenizer, True)``.
    """
    kind = record_format(record)
    _check_types(record, kind)
    if kind == "text":
        if mask_prompt:
            raise DataError("mask_prompt needs prompt/completion or chat records; {\"text\": ...} records "
                            "have no prompt to mask")
        tokens = list(tokenizer.encode(record["text"]))
        eos = tokenizer.eos_token_id
        if eos is not None and (not tokens or tokens[-1] != eos):
            tokens.append(eos)
        return tokens, 0
    messages = _messages(record, kind)
    tools = record.get("tools")
    tokens = _chat(tokenizer, messages, tools)
    if not mask_prompt:
        return tokens, 0
    if messages[-1].get("role") != "assistant":
        raise DataError(f"the conversation ends on the {messages[-1].get('role')!r} turn, so mask_prompt (which trains "
                        "only the last message, as mlx_lm.lora does) would train that message; end the conversation "
                        "with the assistant's reply, or train without --mask-prompt")
    prompt = _chat(tokenizer, messages[:-1], tools, add_generation_prompt=messages[-1].get("role") == "assistant")
    if tokens[:len(prompt)] != prompt:  # a generation prompt that is no prefix: mlx-lm's offset would be wrong
        return tokens, reply_start(tokenizer, messages, tools)
    return tokens, len(prompt)


def encode_masked(record: Record, tokenizer: Any, supervision: Supervision) -> tuple[list[int], np.ndarray]:
    """``(tokens, mask)`` of one record: ``mask[t]`` (uint8) is 1 where token ``t`` is trained (as a target), as
    ``supervision`` chooses (``mlx_train.llm.chat_masks``); ``mask_prompt`` keeps mlx_lm.lora's one offset.

    Example: ``encode_masked({"messages": [...]}, tokenizer, Supervision(assistant_only_loss=True))``.
    """
    if not supervision.assistant_only_loss:
        tokens, offset = encode_record(record, tokenizer, supervision.mask_prompt)
        mask = np.zeros(len(tokens), dtype=np.uint8)
        mask[offset:] = 1
        return tokens, mask
    kind = record_format(record)
    _check_types(record, kind)
    if kind == "text":
        raise DataError("--assistant-only-loss needs prompt/completion or chat records; {\"text\": ...} records "
                        "have no assistant turn")
    return encode_chat(_messages(record, kind), tokenizer, supervision, record.get("tools"))


def left_out_by_mask_prompt(record: Record, tokenizer: Any, mask: np.ndarray) -> tuple[int, int]:
    """``(assistant tokens, of them left out)`` of a chat record with several assistant turns trained with
    mlx-lm's ``mask_prompt`` (only the last one); ``(0, 0)`` for other records."""
    messages = record.get("messages")
    if not isinstance(messages, list) or sum(m.get("role") == "assistant" for m in messages) < 2:
        return 0, 0
    _, every = encode_chat(messages, tokenizer, Supervision(assistant_only_loss=True), record.get("tools"))
    if len(every) != len(mask):
        return 0, 0
    assistant = int(every[1:].sum())
    return assistant, int((every[1:] & (1 - mask[1:])).sum())


@dataclass
class Documents:
    """Tokenized documents: ``tokens[i]`` (int32) and ``masks[i]`` (uint8, 1 where the token is trained as a
    target; given, or built from ``offsets[i]``, the first trained token); ``truncated`` counts the documents cut
    to ``max_seq_length``; ``assistant_tokens``/``left_out`` count, for the first ``multi_turn`` multi-turn chats
    trained with ``mask_prompt`` (at most ``LEFT_OUT_SAMPLE``), their assistant tokens and those the loss leaves out.

    Example: ``Documents([np.arange(5, dtype=np.int32)], offsets=[2]).masks[0]`` -> ``[0 0 1 1 1]``.
    """

    tokens: list[np.ndarray]
    offsets: list[int] | None = None
    truncated: int = 0
    max_seq_length: int | None = None
    masks: list[np.ndarray] | None = None
    assistant_tokens: int = 0
    left_out: int = 0
    multi_turn: int = 0
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        if self.masks is None:
            offsets = self.offsets or [0] * len(self.tokens)
            self.masks = [(np.arange(len(t)) >= o).astype(np.uint8) for t, o in zip(self.tokens, offsets, strict=True)]
        if self.offsets is None:
            self.offsets = [int(np.argmax(m)) if m.any() else len(m) for m in self.masks]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def trained_tokens(self) -> int:
        """Targets the loss trains over all documents (a document's first token is never a target)."""
        return int(sum(int(m[1:].sum()) for m in self.masks or ()))


def tokenize(records: Sequence[Record], tokenizer: Any, mask_prompt: bool | Supervision = False,
             max_seq_length: int | None = None, where: str = "data") -> Documents:
    """Tokenize ``records`` with their loss masks (``mask_prompt``: a bool, mlx_lm.lora's flag, or a
    :class:`~mlx_train.llm.chat_masks.Supervision`); documents longer than ``max_seq_length`` tokens are cut to
    it and counted in ``Documents.truncated``. A chat record whose mask trains nothing is an error.

    Example: ``docs = tokenize(records, tokenizer, Supervision(assistant_only_loss=True), max_seq_length=2048)``.
    """
    supervision = mask_prompt if isinstance(mask_prompt, Supervision) else Supervision(mask_prompt=bool(mask_prompt))
    tokens, masks, truncated, assistant, left_out, counted = [], [], 0, 0, 0, 0
    places = records if isinstance(records, Records) else Records(records, where)
    for i, record in enumerate(records):
        try:
            ids, mask = encode_masked(record, tokenizer, supervision)
            if supervision.masks and len(ids) >= 2 and not mask[1:].any():
                raise DataError(f"{supervision.flag} trains no token of this record (the chat template leaves "
                                "nothing of the assistant's reply); check it with mlx-train inspect-data")
            if supervision.mask_prompt and counted < LEFT_OUT_SAMPLE:  # a sample: it renders every turn again
                counts = left_out_by_mask_prompt(record, tokenizer, mask)
                assistant, left_out, counted = assistant + counts[0], left_out + counts[1], counted + (counts[0] > 0)
        except DataError as error:
            raise DataError(f"{places.place(i)}: {error}") from None
        if max_seq_length is not None and len(ids) > max_seq_length:
            ids, mask, truncated = ids[:max_seq_length], mask[:max_seq_length], truncated + 1
        if len(ids) < 2 or not mask[1:].any():
            continue  # nothing to predict (an empty text, or a prompt that fills the whole window)
        tokens.append(np.asarray(ids, dtype=np.int32))
        masks.append(mask)
    if not tokens:
        raise DataError(f"{where}: no record has a token to train on ({len(records)} records)")
    return Documents(tokens, None, truncated, max_seq_length, masks, assistant, left_out, counted)


def pack_documents(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Group documents into rows of at most ``capacity`` tokens (best fit, longest first).

    Deterministic: a function of the lengths only. Each row lists its documents in index order.
    Example: ``pack_documents(np.array([5, 3, 2]), 8) -> [[0, 1], [2]]``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row index), kept sorted
    for i in order:
        need = int(lengths[i])
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            room, row = free.pop(k)
            rows[row].append(i)
            bisect.insort(free, (room - need, row))
        else:
            rows.append([i])
            bisect.insort(free, (capacity - need, len(rows) - 1))
    return [sorted(r) for r in rows]


def _packing(pack: bool | str) -> str | None:
    if pack is False or pack is None:
        return None
    if pack is True:
        return "best_fit"
    if pack in PACKINGS:
        return str(pack)
    raise ConfigError(f"pack={pack!r} is not a packing; use False, True (= 'best_fit') or one of {PACKINGS}")


class RowList:
    """What the map-style sets of training rows share: ``rows`` and their token ``lengths`` (subclasses fill
    both, and build a row in ``__getitem__``)."""

    rows: list[Any]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def head(self, count: int) -> Any:
        """The first ``count`` rows (all when ``count`` < 0), e.g. to validate on a few batches."""
        if count < 0 or count >= len(self.rows):
            return self
        first = copy.copy(self)
        first.rows, first.lengths = self.rows[:count], self.lengths[:count]
        return first

    def samples(self) -> list[dict[str, np.ndarray]]:
        """Every row, built now, as a list (what DataLoader and Trainer take; see make_loader)."""
        return [self[i] for i in range(len(self))]


class SequenceDataset(RowList):
    """Map-style dataset of training rows (one document each, or packed documents).

    ``lengths`` are the rows' token lengths (for :class:`~mlx_train.data.LengthBucketing`).
    ``segments`` are emitted for packed rows when ``document_mask`` is true. ``pack`` is
    ``False``, ``True``/``"best_fit"`` or ``"by_length"`` (see the module docstring).

    Example::

        rows = SequenceDataset(docs, max_seq_length=256, pack=True)
        rows[0]["inputs"].shape, rows.real_tokens
    """

    def __init__(self, documents: Documents, max_seq_length: int | None = None, pack: bool | str = False,
                 document_mask: bool = True) -> None:
        self.documents = documents
        self.packing = _packing(pack)
        self.max_seq_length = max_seq_length
        if self.packing is not None and max_seq_length is None:
            raise ConfigError(f"pack={pack!r} needs max_seq_length (the tokens per row)")
        self.packed = self.packing == "best_fit"  # several documents per row
        if self.packed:
            self.rows = pack_documents(documents.lengths, max_seq_length)  # type: ignore[arg-type]  # checked above
        else:
            self.rows = [[i] for i in range(len(documents))]
        self.document_mask = bool(document_mask) and self.packed
        self.lengths = [int(documents.lengths[r].sum()) for r in self.rows]

    @property
    def trained_tokens(self) -> int:
        """Targets that count in the loss over the whole dataset."""
        return self.documents.trained_tokens

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        docs = self.documents
        parts = [docs.tokens[i] for i in self.rows[index]]
        row = np.concatenate(parts) if len(parts) > 1 else parts[0]
        n = len(row) - 1
        loss_mask = np.zeros(n, dtype=np.int32)
        segments = np.zeros(n, dtype=np.int32)
        start = 0
        masks: list[np.ndarray] = docs.masks  # type: ignore[assignment]  # built in Documents.__post_init__
        for segment, i in enumerate(self.rows[index], 1):
            length = len(docs.tokens[i])
            # input position start+j predicts token j+1 of this document (j+1 < length)
            loss_mask[start:start + length - 1] = masks[i][1:]
            segments[start:start + length] = segment  # the slice stops at n by itself
            start += length
        sample = {"inputs": row[:-1], "targets": row[1:], "loss_mask": loss_mask}
        if self.document_mask:
            sample["segments"] = segments
        return sample


def collate(samples: Sequence[Record], multiple: int = PAD_MULTIPLE, positions: bool = False) -> dict[str, np.ndarray]:
    """Pad rows to the longest sequence rounded up to ``multiple`` and stack them (padding: token 0,
    loss_mask 0, segment 0); 0-d values (a preference pair's reference log-probabilities) are stacked;
    arrays of two or more axes (the patches of a row's images) are padded with zeros along their first axis
    to the batch's longest and stacked, in their own dtype.
    ``positions``: add the trained positions of each row (``mlx_train.llm.loss.trained_positions``,
    padded with -1 to a multiple of ``POSITION_MULTIPLE``), so that the loss projects only those
    tokens onto the vocabulary (not the masked prompts, nor the padding).

    Example: ``collate([ds[0], ds[1]])["inputs"].shape -> (2, 64)``.
    """
    longest = max(len(v) for s in samples for v in s.values() if np.ndim(v) == 1)
    width = -(-longest // multiple) * multiple
    batch: dict[str, np.ndarray] = {}
    for key in samples[0]:
        if np.ndim(samples[0][key]) == 0:
            batch[key] = np.array([s[key] for s in samples], dtype=np.float32)
            continue
        if np.ndim(samples[0][key]) > 1:
            batch[key] = _stack_padded([np.asarray(s[key]) for s in samples])
            continue
        out = np.zeros((len(samples), width), dtype=np.int32)
        for j, s in enumerate(samples):
            out[j, : len(s[key])] = s[key]
        batch[key] = out
    if positions and "loss_mask" in batch:
        from mlx_train.llm.loss import trained_positions

        batch["positions"] = trained_positions(batch["loss_mask"], POSITION_MULTIPLE)
    return batch


def _stack_padded(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` (equal but for their first axis) stacked, each padded with zeros to the longest first axis."""
    out = np.zeros((len(arrays), max(len(a) for a in arrays), *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    for j, a in enumerate(arrays):
        out[j, : len(a)] = a
    return out


def make_loader(dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True,
                num_workers: int = 1, multiple: int = PAD_MULTIPLE, drop_last: bool = True,
                positions: bool = False, repeat: int = 1) -> Any:
    """A DataLoader over ``dataset`` (a :class:`SequenceDataset`, or preference pairs): batches of rows
    of similar token length, padded to ``multiple``. A dataset built with ``pack="by_length"`` gets
    batches of as many rows as fit in ``batch_size x max_seq_length`` padded tokens instead.
    ``positions``: batches carry the trained positions (see :func:`collate`; for prompt-masked rows);
    ``repeat``: each batch handed out that many times in a row (GRPO's ``num_iterations``).

    Example: ``loader = make_loader(train_rows, batch_size=4, seed=0)``.
    """
    from functools import partial

    from mlx_train.data import DataLoader, LengthBucketing, RepeatedBatches, TokenBudget

    if len(dataset) < batch_size and drop_last:
        raise DataError(f"the training set has {len(dataset)} rows, fewer than one batch of {batch_size}; "
                        "lower --batch-size or add data")
    batching: Any = LengthBucketing(lengths=dataset.lengths)
    if getattr(dataset, "packing", None) == "by_length":
        budget = batch_size * -(-dataset.max_seq_length // multiple) * multiple
        batching = TokenBudget(max_tokens=budget, lengths=dataset.lengths, multiple=multiple)
    if repeat > 1:
        batching = RepeatedBatches(batching, repeat)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, drop_last=drop_last,
                      seed=seed, collate_fn=partial(collate, multiple=multiple, positions=positions),
                      batching=batching)


def describe_documents(name: str, documents: Documents, rows: SequenceDataset | None = None) -> str:
    """One line about a split: documents, tokens, truncation, packing."""
    text = f"{name}: {len(documents)} documents, {int(documents.lengths.sum())} tokens"
    if documents.left_out:
        n = documents.multi_turn
        chats = f"{'the first ' if n == LEFT_OUT_SAMPLE else ''}{n} multi-turn chat{'s' if n != 1 else ''}"
        text += (f"; --mask-prompt leaves {documents.left_out} of the {documents.assistant_tokens} assistant tokens of "
                 f"{chats} out of the loss (mlx_lm.lora's meaning: only the last message trains; "
                 "--assistant-only-loss trains every assistant turn)")
    if documents.truncated:
        text += (f"; {documents.truncated} truncated to max_seq_length={documents.max_seq_length} tokens "
                 "(raise --max-seq-length or split long documents to keep them whole)")
    if rows is not None and rows.packed:
        fill = documents.lengths.sum() / max(len(rows) * (documents.max_seq_length or 1), 1)
        text += f"; packed into {len(rows)} rows ({fill:.0%} full)"
    elif rows is not None and rows.packing == "by_length":
        text += f"; batched by length up to batch_size x {rows.max_seq_length} tokens (no attention mask)"
    return text

