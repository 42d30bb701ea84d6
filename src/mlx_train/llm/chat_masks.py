"""Which tokens of a chat record the loss trains: per-token masks from the chat template.

Three choices (``Supervision``), each with the meaning of the tool it is named after:

- neither flag: every token is trained (mlx_lm.lora without ``mask_prompt``);
- ``mask_prompt``: mlx_lm.lora's -- everything before the **last** message is left out (one offset:
  the tokens of the other messages rendered with the generation prompt);
- ``assistant_only_loss``: TRL's -- **every** assistant turn is trained, and nothing else. Tool calls
  (``tool_calls`` of an assistant message) and reasoning (``reasoning_content`` or ``<think>`` blocks)
  are trained unless ``train_on_tool_calls`` / ``train_on_reasoning`` say otherwise.

The assistant tokens come from the template's ``{% generation %}`` markers when it has them (as
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` computes them); otherwise
the conversation is rendered turn by turn: an assistant turn is what rendering it adds to the
conversation before it with the generation prompt (from the first character where the two differ, so
a generation prompt that is not a prefix of the turn still works), without the whitespace that ends
it, found at its place in the whole rendering; where a template renders an earlier turn differently once
later turns follow (Qwen3 drops its think block), the turn's content is where two renderings of the whole
conversation with two stand-ins for it differ, followed by the end of its turn. A token is trained when its
characters overlap a trained span (transformers' rule).

Example::

    tokens, mask = encode_chat(messages, tokenizer, Supervision(assistant_only_loss=True))
    tokenizer.decode([t for t, m in zip(tokens, mask) if m])   # the assistant turns
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_train.errors import DataError

Message = dict[str, Any]
Span = tuple[int, int]

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class Supervision:
    """What the loss trains in a record (see the module docstring); ``assistant_only_loss`` and
    ``mask_prompt`` exclude each other, and the ``train_on_*`` choices refine ``assistant_only_loss``.

    Example: ``Supervision(assistant_only_loss=True, train_on_reasoning=False)``.
    """

    mask_prompt: bool = False
    assistant_only_loss: bool = False
    train_on_tool_calls: bool = True
    train_on_reasoning: bool = True

    @classmethod
    def from_finetune(cls, cfg: Any) -> Supervision:
        """The choice of a ``FinetuneConfig`` (its llm section)."""
        return cls(bool(cfg.mask_prompt), bool(cfg.assistant_only_loss), bool(cfg.train_on_tool_calls),
                   bool(cfg.train_on_reasoning))

    @property
    def masks(self) -> bool:
        """Whether some tokens of a record are left out of the loss."""
        return self.mask_prompt or self.assistant_only_loss

    @property
    def flag(self) -> str:
        return "--assistant-only-loss" if self.assistant_only_loss else "--mask-prompt"


def render(tokenizer: Any, messages: Sequence[Message], tools: Any = None, add_generation_prompt: bool = False) -> str:
    """The chat template's text of ``messages`` (a template error becomes a DataError)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat and prompt/completion records need a tokenizer with a chat template; "
                        "this tokenizer has none (set tokenizer.chat_template or use {\"text\": ...} records)")
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as error:  # noqa: BLE001 - jinja raises what the template raises (raise_exception, ...)
        raise DataError(f"the chat template failed on {len(messages)} messages: {type(error).__name__}: "
                        f"{error}") from None
    return str(text)


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the chat template marks the assistant's text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def token_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[Span]]:
    """``(tokens, character span of each token)`` of rendered chat text (no special tokens added, as
    ``apply_chat_template`` tokenizes). A slow tokenizer's spans come from encoding prefixes."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf, "is_fast", False):
        encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    ids = list(hf.encode(text, add_special_tokens=False))
    ends = [0] * len(ids)
    for cut in range(1, len(text) + 1):  # slow, but only for slow tokenizers
        n = len(hf.encode(text[:cut], add_special_tokens=False))
        if 0 < n <= len(ids) and not ends[n - 1]:
            ends[n - 1] = cut
    spans, start = [], 0
    for end in ends:
        end = max(end, start)
        spans.append((start, end))
        start = end
    return ids, spans


def spans_to_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> np.ndarray:
    """1 for each token whose characters overlap one of ``spans`` (sorted), else 0 (uint8)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans:
        return mask
    starts = np.array([a for a, _ in offsets])
    ends = np.array([b for _, b in offsets])
    for a, b in spans:
        mask[(starts < b) & (ends > a)] = 1
    return mask


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _header_end(tokenizer: Any, history: Sequence[Message], tools: Any) -> int:
    """Where an assistant turn's own text starts after ``history``: where two replies that differ from their
    first character part."""
    probes = [render(tokenizer, [*history, {"role": "assistant", "content": text}], tools) for text in ("A", "B")]
    return _common_prefix(*probes)


def assistant_spans(tokenizer: Any, messages: Sequence[Message], tools: Any, text: str) -> list[tuple[int, Span]]:
    """``(message index, character span in text)`` of each assistant turn of the rendered ``text``, found by
    rendering the conversation turn by turn (see the module docstring)."""
    found: list[tuple[int, Span]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        after = render(tokenizer, messages[: i + 1], tools)
        if i == 0:  # a conversation that opens with the assistant: no generation prompt to compare with
            start = _header_end(tokenizer, [], tools)
        else:
            before = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            start = _common_prefix(before, after)
            if start < len(before):  # the generation prompt is no prefix of the turn: the turn's header ends first
                start = min(start, _header_end(tokenizer, messages[:i], tools))
        turn = after[start:].rstrip()
        if not turn:
            continue  # an empty turn has nothing to train
        if text.startswith(after[:start + len(turn)]) and start >= cursor:
            where = start
        else:  # the template renders earlier turns differently once later ones follow: find the turn's text
            where = text.find(turn, cursor)
            if where < 0:
                span = _located(tokenizer, messages, tools, i, text, turn)
                if span is not None and span[0] >= cursor:
                    found.append((i, span))
                    cursor = span[1]
                    continue
                raise DataError(f"the chat template renders assistant message {i + 1} differently inside the whole "
                                "conversation than turn by turn, so its tokens cannot be found; add "
                                "{% generation %} ... {% endgeneration %} around the assistant's text in the "
                                "template, or train with --mask-prompt")
        found.append((i, (where, where + len(turn))))
        cursor = where + len(turn)
    return found


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _located(tokenizer: Any, messages: Sequence[Message], tools: Any, i: int, text: str, turn: str) -> Span | None:
    """Assistant message ``i``'s span in the whole rendering ``text`` when its turn, rendered on its own, is not
    there as it is (a template that drops the think block of earlier turns): its content is where two renderings
    of the whole conversation with two stand-ins for it differ, and the turn ends with the text that ends ``turn``
    and follows the content in ``text`` (its end-of-turn token). None when that finds nothing."""
    probes = [render(tokenizer, [*messages[:i], {**messages[i], "content": stand_in}, *messages[i + 1:]], tools)
              for stand_in in ("A", "B")]
    start, end = _common_prefix(*probes), len(text) - _common_suffix(*probes)
    if not 0 <= start <= end <= len(text) or text[:start] != probes[0][:start]:
        return None
    ending = next((k for k in range(len(turn), 0, -1) if text.startswith(turn[-k:], end)), 0)
    return (start, end + ending) if end + ending > start else None


def _marked(tokenizer: Any, messages: Sequence[Message],
            tools: Any) -> tuple[list[int], list[Span], list[tuple[int, Span]]]:
    """``(tokens, their character spans, assistant spans)`` from the template's generation markers (transformers'
    assistant mask, one rendering), each span given to its assistant message in order."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        out = hf.apply_chat_template(list(messages), tools=tools, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True,
                                     tokenizer_kwargs={"return_offsets_mapping": True})
    except Exception as error:  # noqa: BLE001 - jinja raises what the template raises (raise_exception, ...)
        raise DataError(f"the chat template failed on {len(messages)} messages: {type(error).__name__}: "
                        f"{error}") from None
    offsets = [(int(a), int(b)) for a, b in out["offset_mapping"]]
    marked = np.asarray(out["assistant_masks"], dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], marked, [0]])))
    runs = [(offsets[a][0], offsets[b - 1][1]) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    owners = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(runs) != len(owners):  # not one block a message: keep the spans, owned by no message
        return list(out["input_ids"]), offsets, [(-1, span) for span in runs]
    return list(out["input_ids"]), offsets, list(zip(owners, runs, strict=True))


def reasoning_spans(messages: Sequence[Message], text: str) -> list[Span]:
    """Character spans of the reasoning in ``text``: ``<think>`` blocks and each ``reasoning_content``."""
    spans = [(m.start(), m.end()) for m in THINK_BLOCK.finditer(text)]
    for message in messages:
        reasoning = message.get("reasoning_content")
        if message.get("role") == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            needle = reasoning.strip()
            spans += [(m.start(), m.end()) for m in re.finditer(re.escape(needle), text)]
    return sorted(spans)


def encode_chat(messages: Sequence[Message], tokenizer: Any, supervision: Supervision,
                tools: Any = None) -> tuple[list[int], np.ndarray]:
    """``(tokens, mask)`` of a conversation trained with ``assistant_only_loss``: ``mask[t]`` is 1 where
    token ``t`` is an assistant token the loss trains (see the module docstring).

    Example: ``encode_chat([{"role": "user", ...}, {"role": "assistant", ...}], tokenizer, Supervision(True))``.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError("the conversation has no assistant message, so --assistant-only-loss trains nothing in it; "
                        "add the assistant's reply or drop the record")
    if has_generation_markers(tokenizer) and getattr(getattr(tokenizer, "_tokenizer", tokenizer), "is_fast", False):
        tokens, offsets, spans = _marked(tokenizer, messages, tools)
    else:
        text = render(tokenizer, messages, tools)
        tokens, offsets = token_offsets(tokenizer, text)
        spans = assistant_spans(tokenizer, messages, tools, text)
    if not supervision.train_on_tool_calls:
        if any(owner < 0 for owner, _ in spans):
            raise DataError("the template's generation blocks do not map one to one onto the assistant messages, so "
                            "tool calls cannot be left out; train them (train_on_tool_calls: true)")
        spans = [(owner, span) for owner, span in spans if not messages[owner].get("tool_calls")]
    mask = spans_to_mask(offsets, [span for _, span in spans])
    if not supervision.train_on_reasoning:
        mask &= 1 - spans_to_mask(offsets, reasoning_spans(messages, render(tokenizer, messages, tools)))
    return tokens, mask


def reply_start(tokenizer: Any, messages: Sequence[Message], tools: Any = None, first: int = -1) -> int:
    """The first token of the assistant's reply from message ``first`` on (default: the last message), by turn
    alignment: ``mask_prompt``'s offset, and a preference reply's start, where the template's generation prompt
    is not a prefix of the conversation (an offset counted from the generation prompt is wrong there)."""
    first = first % len(messages)
    text = render(tokenizer, messages, tools)
    _, offsets = token_offsets(tokenizer, text)
    spans = [span for i, span in assistant_spans(tokenizer, messages, tools, text) if i >= first]
    trained = np.flatnonzero(spans_to_mask(offsets, spans[:1]))
    return int(trained[0]) if len(trained) else len(offsets)


def trained_segments(tokenizer: Any, tokens: Sequence[int], mask: np.ndarray) -> list[tuple[str, bool]]:
    """The text of ``tokens`` in runs of ``(text, trained)``; a document's first token is never trained (it
    is no target), whatever its mask says.

    Example: ``trained_segments(tokenizer, tokens, mask)`` -> ``[("<|im_start|>user\\nhi...", False), ("yo", True)]``.
    """
    trained = np.asarray(mask, dtype=bool).copy()
    trained[:1] = False
    edges = [0, *(np.flatnonzero(np.diff(trained.astype(np.int8))) + 1).tolist(), len(tokens)]
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return [(hf.decode(list(tokens[a:b])), bool(trained[a])) for a, b in zip(edges, edges[1:], strict=False) if b > a]
