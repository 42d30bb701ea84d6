"""Rows of a vision-language data set, in mlx-vlm's format, as training rows with their loss masks.

A row is ``{"images": ["images/cat.png", ...], "messages": [...]}`` (``image`` and ``conversations``
are read too; a row without images is a text row, and a data set may mix both). Image paths are relative
to the folder of the row's jsonl file. The prompt is built by mlx-vlm
(``mlx_vlm.prompt_utils.apply_chat_template``, which places the image markers in the user's message)
and turned into model inputs by ``mlx_vlm.utils.prepare_inputs``, which repeats each image marker once
per image token (``input_ids``, ``pixel_values``, ``image_grid_thw``).

The loss mask is ``mlx_train.llm.chat_masks``'s, as for text (every token; the last message with
``mask_prompt``; every assistant turn with ``assistant_only_loss``), computed on the conversation with
one marker per image and then stretched over the repeated markers, which are never trained. The two
token sequences must agree everywhere else, or the row is refused (the processor and the tokenizer's
chat template disagree).

A training row holds ``inputs``, ``targets``, ``loss_mask`` and ``attention_mask`` (as text rows, shifted
for next-token prediction) and, in a data set with images, its images' patches ``pixel_values``
(``[patches, features]``; none for a text row) and ``image_grid_thw`` (``[images, 3]``). The images are
read again each time a row is built (not kept in memory), so a data set of many pictures costs the
memory of one batch of them.

Example::

    rows = ImageChatRows(records, processor, config, Supervision(assistant_only_loss=True), 1024)
    rows[0]["pixel_values"].shape        # (16, 1176) for one 56x56 picture on Qwen2-VL
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_train.errors import DataError
from mlx_train.llm.chat_masks import Supervision
from mlx_train.llm.data import Record, Records, RowList, encode_masked

IMAGE_KEYS = ("images", "image")
MESSAGE_KEYS = ("messages", "conversations")
#: The processor's outputs that carry the images (the trained families' names: see models.TRAINED_FAMILIES).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


def images_of(record: Record) -> list[Any]:
    """The images of a row (``images`` or ``image``: one item or a list), [] for a text row."""
    value = next((record[key] for key in IMAGE_KEYS if record.get(key) is not None), None)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def refuse_image_rows(records: dict[str, Sequence[Record]], model: str) -> None:
    """Refuse rows with images for a text-only model (they would train on the text alone), naming the first
    one's file and line.

    Example: ``refuse_image_rows(load_records("data"), "SmolLM2-135M")`` raises DataError at data/train.jsonl:3.
    """
    for split in ("train", "valid", "test"):
        rows = records.get(split) or []
        for i, record in enumerate(rows):
            if isinstance(record, dict) and images_of(record):
                place = rows.place(i) if isinstance(rows, Records) else f"{split} record {i + 1}"
                raise DataError(f"{place}: this row has images, but {model} is a text-only model (its config.json "
                                "has no vision_config), so they would be ignored and only the text trained. Give "
                                "--model a vision-language model (e.g. Qwen2-VL, with the vlm extra installed: "
                                "pip install 'mlx-train[vlm]'), or drop \"images\" from the rows")


@dataclass
class ImageChat:
    """One encoded row: its tokens (image markers repeated), loss mask, prompt text and images."""

    tokens: np.ndarray
    mask: np.ndarray
    text: str
    images: list[Any]


def _resolve(image: Any, base: str | None, where: str) -> Any:
    """A path relative to the data folder made whole and checked; other images (PIL, URLs) as they are."""
    if not isinstance(image, str) or image.startswith(("http://", "https://", "data:")):
        return image
    path = image if os.path.isabs(image) or base is None else os.path.join(base, image)
    if not os.path.isfile(path):
        raise DataError(f"image {image} does not exist (looked for {path}); image paths are relative to the folder "
                        f"of {where}")
    return path


def _messages(record: Record) -> list[Record]:
    messages = next((record[key] for key in MESSAGE_KEYS if key in record), None)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"a row with keys {sorted(record)} has no conversation: a vision-language row is "
                        "{\"images\": [...], \"messages\": [{\"role\": \"user\", \"content\": ...}, ...]}")
    return messages


def stretch_mask(tokens: Sequence[int], mask: np.ndarray, expanded: Sequence[int],
                 markers: set[int]) -> np.ndarray:
    """``mask`` (one value per token of ``tokens``) over ``expanded``, the same tokens with each run of image
    markers repeated (``markers``: their ids); markers are never trained. DataError where the two differ
    otherwise."""
    out = np.zeros(len(expanded), dtype=np.uint8)
    i = j = 0
    while i < len(tokens):
        if j >= len(expanded) or expanded[j] != tokens[i]:
            raise DataError(f"the processor's tokens differ from the chat template's at token {i} ({tokens[i]} vs "
                            f"{expanded[j] if j < len(expanded) else 'the end'}): the processor and the tokenizer "
                            "render the conversation differently, so the loss mask cannot be placed")
        if tokens[i] in markers:
            while i < len(tokens) and tokens[i] in markers:
                i += 1
            while j < len(expanded) and expanded[j] in markers:
                j += 1
            continue
        out[j] = mask[i]
        i, j = i + 1, j + 1
    if j != len(expanded):
        raise DataError(f"the processor's tokens run {len(expanded) - j} past the chat template's: they render the "
                        "conversation differently, so the loss mask cannot be placed")
    return out


class Encoder:
    """Turns rows into :class:`ImageChat` and model inputs with mlx-vlm's prompt and processor functions."""

    def __init__(self, processor: Any, config: dict[str, Any], supervision: Supervision) -> None:
        from mlx_vlm.prompt_utils import apply_chat_template
        from mlx_vlm.utils import prepare_inputs

        self.processor, self.config, self.supervision = processor, config, supervision
        self.apply_chat_template: Callable[..., Any] = apply_chat_template
        self.prepare_inputs: Callable[..., Any] = prepare_inputs
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        # chat_masks takes an mlx-lm tokenizer (the Hugging Face one is its ``_tokenizer``)
        self.tokenizer = TokenizerWrapper(getattr(processor, "tokenizer", processor))
        self.markers = {int(config[k]) for k in ("image_token_id", "video_token_id", "image_token_index")
                        if isinstance(config.get(k), int)}

    def inputs(self, text: str, images: list[Any]) -> dict[str, Any]:
        """The processor's arrays for one prompt and its images (numpy)."""
        out = self.prepare_inputs(self.processor, images=images or None, prompts=text)
        return {k: np.asarray(v) for k, v in out.items() if v is not None and k in ("input_ids", *IMAGE_INPUTS)}

    def image_arrays(self, text: str, images: list[Any], features: tuple[int, ...] | None) -> dict[str, np.ndarray]:
        """A training row's image arrays (``pixel_values``, ``image_grid_thw``): its pictures read again (none
        for a text row of a data set with images; nothing at all when no row has one: ``features`` None)."""
        if features is None:
            return {}
        if not images:
            return {"pixel_values": np.zeros((0, *features), dtype=np.float32),
                    "image_grid_thw": np.zeros((0, 3), dtype=np.int32)}
        inputs = self.inputs(text, images)
        return {"pixel_values": inputs["pixel_values"].astype(np.float32),
                "image_grid_thw": inputs["image_grid_thw"].astype(np.int32)}

    def encode(self, record: Record, base: str | None, where: str) -> tuple[ImageChat, dict[str, Any]]:
        """The row encoded, and its model inputs."""
        messages = _messages(record)
        images = [_resolve(image, base, where) for image in images_of(record)]
        shaped = self.apply_chat_template(self.processor, self.config, messages, add_generation_prompt=False,
                                          num_images=len(images), return_messages=True)
        text = str(self.apply_chat_template(self.processor, self.config, messages, add_generation_prompt=False,
                                            num_images=len(images)))
        tokens, mask = encode_masked({"messages": shaped, "tools": record.get("tools")}, self.tokenizer,
                                     self.supervision)
        try:
            inputs = self.inputs(text, images)
        except Exception as error:  # noqa: BLE001 - image readers and processors raise anything
            raise DataError(f"the processor failed on this row: {type(error).__name__}: {error}") from None
        expanded = inputs["input_ids"].reshape(-1).astype(np.int32)
        mask = stretch_mask(list(tokens), np.asarray(mask), expanded.tolist(), self.markers)
        if images and "pixel_values" not in inputs:
            raise DataError("the processor returned no pixel_values for this row's images")
        return ImageChat(expanded, mask, text, images), inputs


class ImageChatRows(RowList):
    """Map-style training rows of a vision-language data set (see the module docstring); ``lengths`` are the
    rows' token lengths (for length bucketing). Rows longer than ``max_seq_length`` are cut when the cut
    leaves their images whole, and refused otherwise.

    Example: ``rows = ImageChatRows(records, processor, config, Supervision(), 1024); rows[0]["inputs"]``
    """

    def __init__(self, records: Sequence[Record], processor: Any, config: dict[str, Any], supervision: Supervision,
                 max_seq_length: int | None = None, where: str = "data") -> None:
        self.encoder = Encoder(processor, config, supervision)
        places = records if isinstance(records, Records) else Records(records, where)
        base = os.path.dirname(places.source) if os.path.isfile(places.source) else None
        self.rows: list[ImageChat] = []
        self.truncated = 0
        self.features: tuple[int, ...] | None = None
        for i, record in enumerate(records):
            try:
                row, inputs = self.encoder.encode(record, base, places.source)
                row = self._cut(row, max_seq_length)
                if supervision.masks and not row.mask[1:].any():
                    raise DataError(f"{supervision.flag} trains no token of this row")
            except DataError as error:
                raise DataError(f"{places.place(i)}: {error}") from None
            if "pixel_values" in inputs and self.features is None:
                self.features = inputs["pixel_values"].shape[1:]
            if len(row.tokens) >= 2 and row.mask[1:].any():
                self.rows.append(row)
        if not self.rows:
            raise DataError(f"{where}: no row has a token to train on ({len(records)} rows)")
        self.lengths = [len(row.tokens) for row in self.rows]

    def _cut(self, row: ImageChat, max_seq_length: int | None) -> ImageChat:
        if max_seq_length is None or len(row.tokens) <= max_seq_length:
            return row
        image_tokens = np.flatnonzero(np.isin(row.tokens, list(self.encoder.markers)))
        if len(image_tokens) and image_tokens[-1] >= max_seq_length:
            raise DataError(f"the row has {len(row.tokens)} tokens and its images run to token "
                            f"{image_tokens[-1] + 1}, past max_seq_length={max_seq_length}: cutting it would cut an "
                            "image; raise --max-seq-length, or make the images smaller (max_pixels in the model's "
                            "preprocessor_config.json)")
        self.truncated += 1
        return ImageChat(row.tokens[:max_seq_length], row.mask[:max_seq_length], row.text, row.images)

    @property
    def trained_tokens(self) -> int:
        """Targets that count in the loss over the whole data set."""
        return int(sum(int(row.mask[1:].sum()) for row in self.rows))

    @property
    def image_count(self) -> int:
        return sum(len(row.images) for row in self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = self.rows[index]
        tokens = row.tokens
        sample = {"inputs": tokens[:-1], "targets": tokens[1:], "loss_mask": row.mask[1:].astype(np.int32),
                  "attention_mask": np.ones(len(tokens) - 1, dtype=np.int32)}
        return {**sample, **self.encoder.image_arrays(row.text, row.images, self.features)}

    def describe(self, name: str) -> str:
        """One line about a split: rows, images, tokens, truncation."""
        with_images = sum(1 for row in self.rows if row.images)
        text = (f"{name}: {len(self)} rows ({with_images} with images, {self.image_count} images), "
                f"{sum(self.lengths)} tokens")
        if self.truncated:
            text += f"; {self.truncated} cut to max_seq_length (raise --max-seq-length to keep them whole)"
        return text


def build_splits(config: Any, processor: Any, model_config: dict[str, Any], records: dict[str, Any],
                 log: Any = print) -> dict[str, ImageChatRows]:
    """The training rows of each split (train, valid, test) that has records.

    Example: ``build_splits(cfg, processor, model_config, load_records(cfg.dataset))["train"]``
    """
    supervision = Supervision.from_finetune(config)
    splits: dict[str, ImageChatRows] = {}
    for name in ("train", "valid", "test"):
        if not records[name]:
            continue
        rows = ImageChatRows(records[name], processor, model_config, supervision, config.max_seq_length,
                             where=f"{config.dataset}/{name}.jsonl")
        log(rows.describe(name))
        splits[name] = rows
    if splits and all(rows.features is None for rows in splits.values()):
        log(f"{config.dataset}: no row has an image; the vision-language model trains on the text alone")
    return splits


def shared_prompt(record: Record) -> Record:
    """A preference row whose ``chosen`` and ``rejected`` are whole conversations (mlx-vlm's other layout: no
    ``prompt``) as one with a prompt: the messages before the last of each, which must be the same."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if any(k in record for k in ("prompt", "messages")) or not isinstance(chosen, list) or \
            not isinstance(rejected, list):
        return record
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
        raise DataError("the row has no \"prompt\", and its \"chosen\" and \"rejected\" conversations do not share "
                        "all their messages but the last (the replies): give the prompt as \"prompt\" and the replies "
                        "alone, or whole conversations that differ only in their last message")
    return {**record, "prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


@dataclass
class ImagePair:
    """One encoded preference pair: both sequences (image markers repeated; they share the prompt's
    ``prompt_length`` tokens), the prompt text and the images."""

    chosen: np.ndarray
    rejected: np.ndarray
    prompt_length: int
    text: str
    images: list[Any]


class ImagePairRows(RowList):
    """Preference pairs with images, for DPO, ORPO and CPO: mlx-vlm's preference rows,
    ``{"images": [...], "prompt": ..., "chosen": ..., "rejected": ...}`` (the prompt a string or messages,
    also under ``messages``; a reply a string, a message or messages: ``mlx_train.llm.preference``'s rows,
    with the images of the row shown with the prompt), or ``chosen`` and ``rejected`` whole conversations
    that differ in their last message only (``shared_prompt``). Both replies follow the same prompt and the same
    images; only the reply tokens are scored.

    A row holds ``chosen_inputs``/``chosen_targets``/``chosen_mask`` (1 on reply targets) and the same for
    ``rejected``, and the pair's images once (``pixel_values``, ``image_grid_thw``: the loss gives them to
    both sequences). ``lengths``: the longer sequence of each pair.

    Example: ``pairs = ImagePairRows(records, processor, config, 1024); pairs[0]["chosen_mask"]``
    """

    def __init__(self, records: Sequence[Record], processor: Any, config: dict[str, Any],
                 max_seq_length: int | None = None, where: str = "data") -> None:
        from mlx_train.llm.preference import pair_messages

        self.encoder = Encoder(processor, config, Supervision())
        places = records if isinstance(records, Records) else Records(records, where)
        base = os.path.dirname(places.source) if os.path.isfile(places.source) else None
        self.rows: list[ImagePair] = []
        self.features: tuple[int, ...] | None = None
        for i, record in enumerate(records):
            try:
                prompt, chosen, rejected = pair_messages(shared_prompt(record), places.place(i))
                images = [_resolve(image, base, places.source) for image in images_of(record)]
                pair, inputs = self._encode(prompt, chosen, rejected, images, max_seq_length)
            except DataError as error:
                message = str(error)
                raise DataError(message if message.startswith(places.place(i)) else
                                f"{places.place(i)}: {message}") from None
            if "pixel_values" in inputs and self.features is None:
                self.features = inputs["pixel_values"].shape[1:]
            self.rows.append(pair)
        if not self.rows:
            raise DataError(f"{where}: no preference pair to train on")
        self.lengths = [max(len(p.chosen), len(p.rejected)) for p in self.rows]

    def _render(self, messages: list[Record], images: list[Any], generation: bool) -> str:
        return str(self.encoder.apply_chat_template(self.encoder.processor, self.encoder.config, messages,
                                                    add_generation_prompt=generation, num_images=len(images)))

    def _encode(self, prompt: list[Record], chosen: list[Record], rejected: list[Record], images: list[Any],
                max_seq_length: int | None) -> tuple[ImagePair, dict[str, Any]]:
        try:
            start = self.encoder.inputs(self._render(prompt, images, True), images)
            texts = [self._render(prompt + reply, images, False) for reply in (chosen, rejected)]
            inputs = [self.encoder.inputs(text, images) for text in texts]
        except DataError:
            raise
        except Exception as error:  # noqa: BLE001 - image readers and processors raise anything
            raise DataError(f"the processor failed on this row: {type(error).__name__}: {error}") from None
        head = start["input_ids"].reshape(-1)
        sequences = [x["input_ids"].reshape(-1).astype(np.int32) for x in inputs]
        for side, tokens in zip(("chosen", "rejected"), sequences, strict=True):
            if len(tokens) <= len(head) or not np.array_equal(tokens[:len(head)], head):
                raise DataError(f"the chat template renders the prompt differently before the {side} reply (or the "
                                "reply is empty), so it cannot be scored after the prompt's tokens; use a template "
                                "that renders the prompt the same whatever follows it")
            if max_seq_length is not None and len(tokens) > max_seq_length:
                raise DataError(f"prompt and {side} reply are {len(tokens)} tokens (image tokens included), more than "
                                f"max_seq_length={max_seq_length}; raise --max-seq-length, or make the images "
                                "smaller (max_pixels in the model's preprocessor_config.json)")
        if images and "pixel_values" not in inputs[0]:
            raise DataError("the processor returned no pixel_values for this row's images")
        return ImagePair(sequences[0], sequences[1], len(head), texts[0], images), inputs[0]

    @property
    def trained_tokens(self) -> int:
        """Reply tokens scored over the whole data set (both replies of every pair)."""
        return int(sum(len(p.chosen) + len(p.rejected) - 2 * p.prompt_length for p in self.rows))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        pair = self.rows[index]
        row: dict[str, np.ndarray] = {}
        for side, tokens in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            mask = np.zeros(len(tokens) - 1, dtype=np.int32)
            mask[pair.prompt_length - 1:] = 1  # target j is token j + 1: the reply's tokens
            row[f"{side}_inputs"], row[f"{side}_targets"], row[f"{side}_mask"] = tokens[:-1], tokens[1:], mask
        return {**row, **self.encoder.image_arrays(pair.text, pair.images, self.features)}

    def describe(self, name: str) -> str:
        with_images = sum(1 for p in self.rows if p.images)
        return (f"{name}: {len(self)} preference pairs ({with_images} with images), {self.trained_tokens} reply "
                "tokens")


def build_pair_splits(config: Any, processor: Any, model_config: dict[str, Any], records: dict[str, Any],
                      log: Any = print) -> dict[str, ImagePairRows]:
    """The preference pairs of each split (train, valid, test) that has records.

    Example: ``build_pair_splits(cfg, processor, model_config, load_records(cfg.dataset))["train"]``
    """
    splits: dict[str, ImagePairRows] = {}
    for name in ("train", "valid", "test"):
        if not records[name]:
            continue
        pairs = ImagePairRows(records[name], processor, model_config, config.max_seq_length,
                              where=f"{config.dataset}/{name}.jsonl")
        log(pairs.describe(name))
        splits[name] = pairs
    return splits
