"""A tiny llama (mlx-lm's own classes) and a tiny byte-level BPE tokenizer, made offline, for the
language-model tests; plus small jsonl data sets in mlx-lm's three formats."""

from __future__ import annotations

import json
import os

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of 1000 miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "What is two plus two? Two plus two is four.",
    "She sells sea shells by the sea shore in 2024.",
    "Hello there! How are you today? I am fine, thank you.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def raw_tokenizer(vocab_size: int = 320):
    """A `tokenizers` byte-level BPE (digits split, no prefix space) trained on SENTENCES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


def make_tokenizer():
    """mlx-lm's TokenizerWrapper around a fast tokenizer with a ChatML template."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                 clean_up_tokenization_spaces=False)
    return TokenizerWrapper(hf, eos_token_ids=[hf.eos_token_id])


def model_config(vocab_size: int, tie: bool = True, layers: int = 2) -> dict:
    return {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": layers, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab_size,
            "rope_theta": 10000.0, "tie_word_embeddings": tie, "max_position_embeddings": 512}


def make_model(vocab_size: int, seed: int = 0, tie: bool = True, layers: int = 2):
    """A random tiny llama and its config dict."""
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    config = model_config(vocab_size, tie, layers)
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def write_model_dir(directory: str, seed: int = 0, tie: bool = True):
    """A tiny model saved as an mlx-lm directory; returns (model, tokenizer, config)."""
    from mlx_train.llm.models import save_model

    tokenizer = make_tokenizer()
    model, config = make_model(len(tokenizer._tokenizer), seed, tie)
    save_model(model, tokenizer, config, directory)
    return model, tokenizer, config


def records(kind: str, n: int = 16) -> list[dict]:
    """n records in one of mlx-lm's formats: text, completion or chat."""
    out = []
    for i in range(n):
        a, b = SENTENCES[i % len(SENTENCES)], SENTENCES[(i * 3 + 1) % len(SENTENCES)]
        if kind == "text":
            out.append({"text": (a + " " + b) if i % 2 else a})
        elif kind == "completion":
            out.append({"prompt": a, "completion": b})
        else:
            out.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": a},
                                     {"role": "assistant", "content": b}]})
    return out


def write_data(directory: str, kind: str = "text", n_train: int = 16, n_valid: int = 8) -> str:
    os.makedirs(directory, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            for record in records(kind, n):
                f.write(json.dumps(record) + "\n")
    return directory
