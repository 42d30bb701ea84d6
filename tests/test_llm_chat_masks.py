"""What a chat record trains: per-token masks from the template's generation markers, or turn by turn
without them, equal to transformers' assistant masks; mlx_lm.lora's mask_prompt kept; tool calls and
reasoning trained or not; packing keeps masks aligned; records that train nothing are errors with
their line; a multi-turn run with assistant_only_loss trains every assistant token, never NaN."""

import json
import math
import os
import sys

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import chat_templates as ct  # noqa: E402
import llm_tiny  # noqa: E402

from mlx_train.config import FinetuneConfig  # noqa: E402
from mlx_train.errors import ConfigError, DataError  # noqa: E402
from mlx_train.llm import data  # noqa: E402
from mlx_train.llm.chat_masks import Supervision, encode_chat  # noqa: E402
from mlx_train.llm.data import SequenceDataset, describe_documents, encode_record, load_records, tokenize  # noqa: E402

EVERY_TURN = Supervision(assistant_only_loss=True)


@pytest.fixture(scope="module")
def tokenizers():
    """name -> (tokenizer with the marked template, tokenizer with the template unmarked)."""
    return {name: (ct.make_tokenizer(t), ct.make_tokenizer(ct.unmarked(t))) for name, t in ct.TEMPLATES.items()}


def transformers_mask(tokenizer, conversation):
    out = tokenizer._tokenizer.apply_chat_template(conversation["messages"], tools=conversation.get("tools"),
                                                   tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)


def decode_trained(tokenizer, tokens, mask):
    return tokenizer._tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])


@pytest.mark.parametrize("template", sorted(ct.TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(ct.CONVERSATIONS))
def test_masks_equal_transformers_assistant_masks_with_and_without_markers(tokenizers, template, conversation):
    marked, plain = tokenizers[template]
    record = ct.CONVERSATIONS[conversation]
    expected_tokens, expected = transformers_mask(marked, record)
    assert expected.sum() > 0
    for tokenizer in (marked, plain):  # markers: transformers' mask; none: rendered turn by turn
        tokens, mask = encode_chat(record["messages"], tokenizer, EVERY_TURN, record.get("tools"))
        assert tokens == expected_tokens
        assert mask.tolist() == expected.tolist()


def test_tool_calls_and_reasoning_are_chosen(tokenizers):
    for tokenizer in tokenizers["qwen"]:
        tools = ct.CONVERSATIONS["tools"]
        tokens, mask = encode_chat(tools["messages"], tokenizer,
                                   Supervision(assistant_only_loss=True, train_on_tool_calls=False), tools["tools"])
        assert decode_trained(tokenizer, tokens, mask) == "It is sunny in Paris today.<|im_end|>"
        reasoning = ct.CONVERSATIONS["reasoning"]["messages"]
        no_reasoning = Supervision(assistant_only_loss=True, train_on_reasoning=False)
        tokens, mask = encode_chat(reasoning, tokenizer, no_reasoning)
        assert decode_trained(tokenizer, tokens, mask) == "Two plus two is four.<|im_end|>Five.<|im_end|>"
        tokens, mask = encode_chat(reasoning, tokenizer, EVERY_TURN)
        assert decode_trained(tokenizer, tokens, mask) == (
            "<think>\nThe sum of two and two is four.\n</think>\n\nTwo plus two is four.<|im_end|>"
            "<think>\nfour plus one is five\n</think>\n\nFive.<|im_end|>")


@pytest.mark.parametrize("template", ["qwen", "llama3", "gemma", "smollm2"])
def test_mask_prompt_equals_mlx_lm_lora(tokenizers, template):
    from mlx_lm.tuner.datasets import ChatDataset

    tokenizer = tokenizers[template][1]
    records = list(ct.CONVERSATIONS.values())
    theirs = ChatDataset(records, tokenizer, mask_prompt=True)
    for i, record in enumerate(records):
        their_tokens, offset = theirs.process(theirs[i])
        assert encode_record(record, tokenizer, mask_prompt=True) == (list(their_tokens), offset)
    docs = tokenize(records, tokenizer, mask_prompt=True)
    for i in range(len(records)):
        their_tokens, offset = theirs.process(theirs[i])
        assert docs.masks[i].tolist() == [int(j >= offset) for j in range(len(their_tokens))]


@pytest.mark.parametrize("template", ["qwen", "llama3", "gemma", "smollm2"])
def test_mask_prompt_rows_train_the_targets_mlx_lm_lora_trains(tokenizers, template):
    """mlx_lm.lora's own batches and loss on the same records (iterate_batches, default_loss: its trained targets
    are where the loss has a gradient) train the targets of our rows; past a row's tokens mlx-lm's mask reaches at
    most the one padding target after its last token, which our rows leave out."""
    import mlx.core as mx
    from mlx_lm.tuner.datasets import CacheDataset, ChatDataset
    from mlx_lm.tuner.trainer import default_loss, iterate_batches

    tokenizer = tokenizers[template][1]
    records = list(ct.CONVERSATIONS.values())
    batch, lengths = next(iterate_batches(CacheDataset(ChatDataset(records, tokenizer, mask_prompt=True)),
                                          batch_size=len(records), max_seq_length=4096))
    logits = mx.zeros((*batch[:, 1:].shape, len(tokenizer._tokenizer)))
    gradient = mx.grad(lambda x: default_loss(lambda _: x, batch, lengths)[0])(logits)
    theirs = np.array(mx.abs(gradient).sum(axis=-1) > 0)
    rows = SequenceDataset(tokenize(records, tokenizer, mask_prompt=True))
    row_of = {tuple(rows[i]["inputs"].tolist() + rows[i]["targets"][-1:].tolist()): i for i in range(len(rows))}
    for j, length in enumerate(np.array(lengths[:, 1]).tolist()):  # the batch's own order: find each row's record
        row = rows[row_of[tuple(np.array(batch[j, :length]).tolist())]]
        ours, n = row["loss_mask"].astype(bool), length - 1
        assert 0 < ours.sum() < n and theirs[j, :n].tolist() == ours.tolist()
        assert not theirs[j, n + 1:].any()


def test_mask_prompt_on_a_template_whose_generation_prompt_is_no_prefix(tokenizers):
    """mlx-lm's offset counts the generation prompt's empty think block, which the conversation lacks: it starts
    inside the reply (past its end for a short reply: 0/0). Here the last reply trains from its first token."""
    from mlx_lm.tuner.datasets import ChatDataset

    tokenizer = tokenizers["qwen3"][1]
    record = {"messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."}]}
    their_tokens, their_offset = ChatDataset([record], tokenizer, mask_prompt=True).process(record)
    assert their_offset >= len(their_tokens)  # mlx_lm.lora would divide 0 by 0
    tokens, offset = encode_record(record, tokenizer, mask_prompt=True)
    assert tokens == list(their_tokens)
    assert tokenizer._tokenizer.decode(tokens[offset:]) == "Hi.<|im_end|>\n"


def test_mask_prompt_says_how_many_assistant_tokens_it_leaves_out(tokenizers, monkeypatch):
    tokenizer = tokenizers["qwen"][1]
    record = ct.CONVERSATIONS["two_turns"]
    docs = tokenize([record], tokenizer, mask_prompt=True)
    _, every = encode_chat(record["messages"], tokenizer, EVERY_TURN)
    first = tokenizer._tokenizer.encode("Two plus two is four.<|im_end|>")
    last = tokenizer._tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.<|im_end|>")
    assert docs.assistant_tokens == int(every.sum()) == len(first) + len(last) == 41
    assert docs.left_out == len(first) == 9
    line = describe_documents("train", docs)
    assert "--mask-prompt leaves 9 of the 41 assistant tokens of 1 multi-turn chat out of the loss" in line
    every_turn = tokenize([record], tokenizer, EVERY_TURN)
    assert every_turn.left_out == 0 and every_turn.trained_tokens == 41
    monkeypatch.setattr(data, "LEFT_OUT_SAMPLE", 2)  # counted on a sample: each is rendered turn by turn again
    three = tokenize([record, record, record, {"prompt": "hi", "completion": "yo"}], tokenizer, mask_prompt=True)
    assert (three.multi_turn, three.left_out, three.assistant_tokens) == (2, 18, 82)
    assert "leaves 18 of the 82 assistant tokens of the first 2 multi-turn chats" in describe_documents("t", three)


def test_packed_rows_keep_the_masks_aligned(tokenizers):
    tokenizer = tokenizers["gemma"][1]
    records = list(ct.CONVERSATIONS.values()) * 3
    docs = tokenize(records, tokenizer, EVERY_TURN)
    rows = SequenceDataset(docs, max_seq_length=256, pack=True)
    assert len(rows) < len(docs)
    for r in range(len(rows)):
        expected = np.concatenate([np.concatenate([docs.masks[i][1:], [0]]) for i in rows.rows[r]])[:-1]
        assert rows[r]["loss_mask"].tolist() == expected.tolist()
        assert rows[r]["targets"][rows[r]["loss_mask"] == 1].tolist() == [
            t for i in rows.rows[r] for t, m in zip(docs.tokens[i][1:], docs.masks[i][1:], strict=True) if m]
    assert sum(int(rows[r]["loss_mask"].sum()) for r in range(len(rows))) == rows.trained_tokens == docs.trained_tokens


def test_truncation_cuts_the_mask_with_the_tokens(tokenizers):
    tokenizer = tokenizers["qwen"][1]
    record = ct.CONVERSATIONS["three_turns"]
    whole = tokenize([record], tokenizer, EVERY_TURN)
    cut = tokenize([record], tokenizer, EVERY_TURN, max_seq_length=40)
    assert cut.truncated == 1 and len(cut.tokens[0]) == 40
    assert cut.masks[0].tolist() == whole.masks[0][:40].tolist() and 0 < cut.trained_tokens < whole.trained_tokens


def test_records_that_train_nothing_are_errors_with_their_line(tmp_path, tokenizers):
    tokenizer = tokenizers["qwen"][1]
    rows = [ct.CONVERSATIONS["two_turns"], {"messages": [{"role": "user", "content": "hi"}]},
            {"tools": ct.CONVERSATIONS["tools"]["tools"], "messages": ct.CONVERSATIONS["tools"]["messages"][:3]},
            {"text": "plain"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n"
                                          + json.dumps(rows[2]) + "\n" + json.dumps(rows[3]) + "\n")
    records = load_records(str(tmp_path))["train"]
    no_tool_calls = Supervision(assistant_only_loss=True, train_on_tool_calls=False)
    for index, message in ((1, r"train.jsonl:2: the conversation has no assistant message, so --assistant-only-loss"),
                           (2, r"train.jsonl:4: --assistant-only-loss trains no token of this record"),
                           (3, r"train.jsonl:5: --assistant-only-loss needs prompt/completion or chat records")):
        subset = type(records)([records[0], records[index]], records.source, [records.lines[0], records.lines[index]])
        with pytest.raises(DataError, match=message):
            tokenize(subset, tokenizer, no_tool_calls)
    ending_on_user = {"messages": [*rows[0]["messages"], {"role": "user", "content": "thanks"}]}
    assert tokenize([ending_on_user], tokenizer, EVERY_TURN).trained_tokens == 41  # every turn: fine
    with pytest.raises(DataError, match=r"^data record 1: the conversation ends on the 'user' turn, so mask_prompt"):
        tokenize([ending_on_user], tokenizer, mask_prompt=True)


def test_the_options_are_declared_and_checked(tmp_path):
    assert FinetuneConfig(assistant_only_loss=True, train_on_reasoning=False).train_on_reasoning is False
    (tmp_path / "lora.yaml").write_text("model: m\ndata: d\nassistant_only_loss: true\ntrain_on_tool_calls: false\n")
    from_yaml = FinetuneConfig.from_yaml(str(tmp_path / "lora.yaml"))  # an mlx_lm.lora-style file, TRL's key
    assert (from_yaml.assistant_only_loss, from_yaml.train_on_tool_calls, from_yaml.train_on_reasoning) == (
        True, False, True)
    with pytest.raises(ConfigError, match="assistant_only_loss.*and mask_prompt exclude each other"):
        FinetuneConfig(assistant_only_loss=True, mask_prompt=True)
    with pytest.raises(ConfigError, match="train_on_tool_calls.*applies with assistant_only_loss only"):
        FinetuneConfig(train_on_tool_calls=False)
    from mlx_train.cli.main import build_parser

    args = build_parser("finetune").parse_args(["finetune", "--assistant-only-loss", "--no-train-on-reasoning"])
    assert (args.assistant_only_loss, args.train_on_reasoning, args.train_on_tool_calls) == (True, False, None)


@pytest.mark.slow
def test_a_multi_turn_run_trains_every_assistant_token_and_is_never_nan(tmp_path):
    from mlx_train.llm.finetune import FineTuneConfig, finetune
    from mlx_train.llm.models import save_model

    tokenizer = ct.make_tokenizer(ct.unmarked(ct.GEMMA))
    model, config = llm_tiny.make_model(len(tokenizer._tokenizer), seed=0)
    save_model(model, tokenizer, config, str(tmp_path / "base"))
    records = [ct.CONVERSATIONS[name] for name in ("two_turns", "three_turns", "tools", "reasoning")]
    (tmp_path / "data").mkdir()
    for split in ("train", "valid"):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = tokenize(records, tokenizer, EVERY_TURN).trained_tokens
    result = finetune(FineTuneConfig(model=str(tmp_path / "base"), data=str(tmp_path / "data"),
                                     assistant_only_loss=True, batch_size=4, iters=6, learning_rate=1e-2,
                                     num_layers=2, steps_per_report=3, steps_per_eval=6, val_batches=-1,
                                     run_dir=str(tmp_path / "run")), log=lambda line: None)
    assert result["trained_tokens"] == 6 * expected  # every step: the whole set's assistant tokens
    losses = result["history"]["train_loss"]
    assert all(math.isfinite(v) for v in losses) and math.isfinite(result["val_loss"])
    assert result["val_loss"] < math.log(len(tokenizer._tokenizer))  # it learned something from the start
    facts = json.loads((tmp_path / "run" / "adapters" / "adapter_config.json").read_text())
    assert (facts["assistant_only_loss"], facts["train_on_tool_calls"], facts["train_on_reasoning"]) == (True,) * 3


def test_inspect_data_marks_the_trained_tokens_and_counts(tmp_path, capsys):
    from mlx_train.cli.main import main
    from mlx_train.llm.models import save_model

    tokenizer = ct.make_tokenizer(ct.unmarked(ct.QWEN))
    model, config = llm_tiny.make_model(len(tokenizer._tokenizer), seed=0)
    save_model(model, tokenizer, config, str(tmp_path / "base"))
    records = [ct.CONVERSATIONS[name] for name in ("two_turns", "three_turns", "tools", "reasoning")]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    docs = tokenize(records, tokenizer, EVERY_TURN)
    assert main(["inspect-data", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "-n", "1",
                 "--assistant-only-loss"]) == 0
    out = capsys.readouterr().out
    assert "train.jsonl:1: 113 tokens, 41 trained" in out
    assert ("<|im_start|>assistant\n[[Two plus two is four.<|im_end|>]]\n<|im_start|>user\nAnd the capital of France?"
            in out)
    assert "train.jsonl:2" not in out
    assert (f"train: 4 records, {int(docs.lengths.sum())} tokens, {docs.trained_tokens} trained" in out)
    assert main(["inspect-data", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "-n", "0",
                 "--mask-prompt"]) == 0
    assert "--mask-prompt leaves 121 of the 209 assistant tokens" in capsys.readouterr().out


def test_preference_replies_start_where_the_reply_does_on_a_no_prefix_template(tokenizers):
    from mlx_train.llm.preference import encode_pair

    row = {"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five."}
    chosen, rejected, start = encode_pair(row, tokenizers["qwen"][1])
    prompt = tokenizers["qwen"][1].apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    assert start == len(prompt)  # a prefix: the prompt's length, as before
    tokenizer = tokenizers["qwen3"][1]
    chosen, rejected, start = encode_pair(row, tokenizer)
    decode = tokenizer._tokenizer.decode
    assert (decode(chosen[start:]), decode(rejected[start:])) == ("Four.<|im_end|>\n", "Five.<|im_end|>\n")
    assert chosen[:start] == rejected[:start]
