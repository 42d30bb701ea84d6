"""A tiny random Qwen2-VL (or Qwen2.5-VL) made offline for the vision-language tests: mlx-vlm's own model
classes, a byte-level BPE tokenizer with the Qwen special tokens, a chat template that places the image
markers, and an image processor that makes every image 56x56 pixels (16 patches, 4 image tokens).
Plus a data set of coloured squares: ``{"images": [...], "messages": [...]}`` rows whose answer is the
square's colour, which only the image tells.

Needs mlx-vlm (and Pillow, which it installs). Nothing is downloaded: set HF_HUB_OFFLINE=1 to be sure.
"""

from __future__ import annotations

import json
import os

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
QUESTION = "What colour is the square?"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
SENTENCES = [QUESTION, *(f"The square is {c}." for c in COLOURS), "Describe the picture.", "Be brief.",
             "What is two plus two? Two plus two is four.", "Hello there! How are you today?"]
# Qwen2-VL's template, reduced: string content, or a list of {"type": "image"} / {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Model sizes: "tiny" (the tests': 56x56 pictures) and "small" (a few million parameters, 224x224 pictures:
#: 256 patches, 64 image tokens each), for the benchmark against mlx-vlm's trainer (bench/vlm.py).
SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "mrope_section": [2, 3, 3], "depth": 2, "embed_dim": 32, "vision_heads": 2,
             "mlp_ratio": 2, "side": 56},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
              "num_key_value_heads": 2, "mrope_section": [8, 12, 12], "depth": 4, "embed_dim": 128, "vision_heads": 4,
              "mlp_ratio": 4, "side": 224},
}


def make_tokenizer():
    """A transformers fast tokenizer (byte-level BPE) with the Qwen special tokens and CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def model_config(tokenizer, model_type: str = "qwen2_vl", size: str = "tiny") -> dict:
    """config.json of a 2-layer, width-64 language model with a 2-block vision tower (``size`` "tiny"), or
    of ``SIZES["small"]``."""
    dims = SIZES[size]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    vision = {"model_type": model_type, "depth": dims["depth"], "embed_dim": dims["embed_dim"],
              "hidden_size": dims["hidden_size"], "num_heads": dims["vision_heads"], "mlp_ratio": dims["mlp_ratio"],
              "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3}
    if model_type == "qwen2_5_vl":  # its vision blocks: an MLP of intermediate_size, windowed attention
        vision.update({"hidden_size": dims["embed_dim"], "out_hidden_size": dims["hidden_size"],
                       "intermediate_size": 2 * dims["embed_dim"], "window_size": 56,
                       "fullatt_block_indexes": [dims["depth"] - 1]})
    text = {k: dims[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads")}
    return {"model_type": model_type, "architectures": ["Qwen2VLForConditionalGeneration"], **text,
            "rms_norm_eps": 1e-6, "vocab_size": len(tokenizer), "rope_theta": 10000.0,
            "max_position_embeddings": 1024, "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": dims["mrope_section"]},  # sums to head_dim / 2
            "eos_token_id": tokenizer.eos_token_id, "vision_config": vision, **ids}


def write_model_dir(directory: str, seed: int = 0, model_type: str = "qwen2_vl", size: str = "tiny",
                    bits: int | None = None) -> str:
    """A random tiny (or ``size`` "small") model saved as an mlx-vlm / Hugging Face directory; returns the
    directory. Its processor makes every picture ``SIZES[size]["side"]`` pixels square. ``bits``: the
    language model quantized (``mlx.nn.quantize``, groups of 32), the vision tower left in float."""
    import importlib

    from mlx_vlm.utils import save_config, save_weights

    os.makedirs(directory, exist_ok=True)
    tokenizer = make_tokenizer()
    config = model_config(tokenizer, model_type, size)
    pixels = SIZES[size]["side"] ** 2
    module = importlib.import_module(f"mlx_vlm.models.{model_type}")
    mx.random.seed(seed)
    settings = module.ModelConfig.from_dict(dict(config))
    settings.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    settings.text_config = module.TextConfig.from_dict(settings.text_config)
    model = module.Model(settings)
    mx.eval(model.parameters())
    if bits is not None:
        import mlx.nn as nn

        nn.quantize(model.language_model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
    save_weights(directory, model)
    save_config(config, os.path.join(directory, "config.json"))
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    processor = "Qwen2_5_VLProcessor" if model_type == "qwen2_5_vl" else "Qwen2VLProcessor"
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
                    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                    "min_pixels": pixels, "max_pixels": pixels, "size": {"shortest_edge": pixels,
                                                                          "longest_edge": pixels},
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
                    "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f, indent=2)
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump({"processor_class": processor}, f, indent=2)
    return directory


def write_square(path: str, colour: str, size: int = 56) -> str:
    """A PNG of one colour (the whole picture is the square)."""
    from PIL import Image

    Image.new("RGB", (size, size), COLOURS[colour]).save(path)
    return path


def square_row(colour: str, image: str | None = "auto") -> dict:
    """One row: the picture of ``colour`` (``images/<colour>.png``), the question, and the answer."""
    row: dict = {"messages": [{"role": "user", "content": QUESTION},
                              {"role": "assistant", "content": f"The square is {colour}."}]}
    if image is not None:
        row["images"] = [f"images/{colour}.png" if image == "auto" else image]
    return row


def write_squares(directory: str, n_train: int = 16, n_valid: int = 4, text_rows: int = 2, side: int = 56) -> str:
    """The coloured-squares data set (train/valid/test.jsonl and images/ of ``side`` pixels), with ``text_rows``
    text-only rows in train (no image: mixed rows, as mlx-vlm's format allows)."""
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    names = list(COLOURS)
    for colour in names:
        write_square(os.path.join(directory, "images", f"{colour}.png"), colour, side)
    text = {"messages": [{"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "Two plus two is four."}]}
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        rows = [square_row(names[i % len(names)]) for i in range(n)]
        if split == "train":
            rows += [text] * text_rows
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return directory


def square_pair(colour: str, wrong: str) -> dict:
    """One preference row in mlx-vlm's format: the picture of ``colour``, the question, the right answer
    chosen and ``wrong``'s rejected."""
    return {"images": [f"images/{colour}.png"], "prompt": QUESTION, "chosen": f"The square is {colour}.",
            "rejected": f"The square is {wrong}."}


def write_square_pairs(directory: str, n_train: int = 8, n_valid: int = 4, side: int = 56) -> str:
    """Coloured-squares preference pairs (train/valid/test.jsonl and images/): each picture's colour chosen,
    the next colour rejected."""
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    names = list(COLOURS)
    for colour in names:
        write_square(os.path.join(directory, "images", f"{colour}.png"), colour, side)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        rows = [square_pair(names[i % 4], names[(i + 1) % 4]) for i in range(n)]
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return directory


if __name__ == "__main__":
    import sys

    write_model_dir(sys.argv[1], model_type=sys.argv[2] if len(sys.argv) > 2 else "qwen2_vl")
    if len(sys.argv) > 3:
        write_squares(sys.argv[3])
