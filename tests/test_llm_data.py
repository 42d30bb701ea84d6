"""Fine-tuning data: the three jsonl formats, prompt masking token by token, truncation,
packing without loss across documents, padding and token-length bucketing."""

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.errors import ConfigError, DataError  # noqa: E402
from mlx_train.llm.data import (  # noqa: E402
    SequenceDataset,
    collate,
    encode_record,
    load_records,
    make_loader,
    pack_documents,
    tokenize,
)


@pytest.fixture(scope="module")
def tokenizer():
    return llm_tiny.make_tokenizer()


def test_text_record_gets_eos_and_trains_on_every_token(tokenizer):
    tokens, offset = encode_record({"text": "Hello there!"}, tokenizer, mask_prompt=False)
    assert tokens == tokenizer.encode("Hello there!") + [tokenizer.eos_token_id]
    assert offset == 0
    with pytest.raises(DataError, match="text.*no prompt to mask"):
        encode_record({"text": "x"}, tokenizer, mask_prompt=True)


def test_completion_masking_token_by_token(tokenizer):
    record = {"prompt": "What is two plus two?", "completion": "Two plus two is four."}
    tokens, offset = encode_record(record, tokenizer, mask_prompt=True)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": record["prompt"]}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered)
    assert tokens[:offset] == prompt_ids
    completion = tokenizer.decode(tokens[offset:])
    assert completion == "Two plus two is four.<|im_end|>\n"
    row = SequenceDataset(tokenize([record], tokenizer, mask_prompt=True))[0]
    # target j is tokens[j + 1]; it counts exactly when j + 1 >= offset
    expected = [1 if j + 1 >= offset else 0 for j in range(len(tokens) - 1)]
    assert row["loss_mask"].tolist() == expected
    assert row["targets"].tolist() == tokens[1:]
    assert row["inputs"].tolist() == tokens[:-1]
    unmasked = SequenceDataset(tokenize([record], tokenizer, mask_prompt=False))[0]
    assert unmasked["loss_mask"].tolist() == [1] * (len(tokens) - 1)


def test_chat_masking_keeps_only_the_last_assistant_turn(tokenizer):
    record = llm_tiny.records("chat", 1)[0]
    tokens, offset = encode_record(record, tokenizer, mask_prompt=True)
    assert tokens == list(tokenizer.apply_chat_template(record["messages"], tokenize=True))
    assert tokenizer.decode(tokens[offset:]) == record["messages"][-1]["content"] + "<|im_end|>\n"
    assert tokenizer.decode(tokens[:offset]).endswith("<|im_start|>assistant\n")


def test_records_without_a_known_format_or_template_are_rejected(tokenizer):
    with pytest.raises(DataError, match="^data record 2: record with keys \\['body'\\] is in no known format"):
        tokenize([{"text": "ok"}, {"body": "x"}], tokenizer)
    tokenizer._tokenizer.chat_template, saved = None, tokenizer._tokenizer.chat_template
    try:
        with pytest.raises(DataError, match="need a tokenizer with a chat template"):
            encode_record({"prompt": "a", "completion": "b"}, tokenizer, False)
    finally:
        tokenizer._tokenizer.chat_template = saved


def test_data_errors_name_the_file_and_its_1_based_line(tokenizer, tmp_path):
    from mlx_train.llm.data import load_records

    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\n\n{"text": 5}\n')
    records = load_records(str(tmp_path))["train"]
    with pytest.raises(DataError, match=rf"^{tmp_path}/train\.jsonl:3: \"text\" must be a string, got int '5'$"):
        tokenize(records, tokenizer)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "a", "completion": ["x"]}, r"\"completion\" must be a string, got list"),
    ({"messages": "hi"}, r"\"messages\" must be a list of messages, got str"),
    ({"messages": ["hi"]}, r"message 1 of \"messages\" is 'hi'; each message must be an object with a \"role\""),
    ({"messages": [{"role": "user", "content": 3}]}, r"message 1 \(user\) has \"content\" of type int"),
])
def test_fields_of_the_wrong_type_are_one_sentence(tokenizer, record, message):
    with pytest.raises(DataError, match=message):
        tokenize([record], tokenizer)


def test_mask_prompt_refuses_a_conversation_ending_on_the_user_turn(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}]
    with pytest.raises(DataError, match=r"^data record 1: the conversation ends on the 'user' turn, so mask_prompt"):
        tokenize([{"messages": messages}], tokenizer, mask_prompt=True)
    assert len(tokenize([{"messages": messages}], tokenizer).tokens) == 1  # without it, the whole chat trains


def test_truncation_is_counted(tokenizer):
    docs = tokenize(llm_tiny.records("text", 8), tokenizer, max_seq_length=12)
    lengths = [len(tokenizer.encode(r["text"])) + 1 for r in llm_tiny.records("text", 8)]
    assert docs.truncated == sum(n > 12 for n in lengths) > 0
    assert docs.lengths.max() == 12


def test_load_records_reads_splits_and_reports_bad_lines(tmp_path):
    llm_tiny.write_data(str(tmp_path / "d"), "completion", n_train=5, n_valid=2)
    splits = load_records(str(tmp_path / "d"))
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [5, 2, 2]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match="train.jsonl:2: not valid JSON"):
        load_records(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match="must be a directory holding train.jsonl"):
        load_records(str(tmp_path / "bad" / "train.jsonl"))


def test_pack_fills_rows_and_keeps_every_document_once():
    lengths = np.array([50, 30, 20, 70, 10, 64, 40])
    rows = pack_documents(lengths, 100)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= 100 for r in rows)
    assert len(rows) == 3  # 284 tokens need at least 3 rows of 100
    assert pack_documents(np.array([5, 3, 2]), 8) == [[0, 1], [2]]


def test_packed_rows_have_no_loss_across_documents(tokenizer):
    records = llm_tiny.records("completion", 6)
    docs = tokenize(records, tokenizer, mask_prompt=True)
    rows = SequenceDataset(docs, max_seq_length=200, pack=True)
    assert len(rows) < len(docs)
    seen = 0
    for r in range(len(rows)):
        sample, members = rows[r], rows.rows[r]
        row = np.concatenate([docs.tokens[i] for i in members])
        start = 0
        expected = np.zeros(len(row) - 1, dtype=np.int32)
        for segment, i in enumerate(members, 1):
            n, offset = len(docs.tokens[i]), docs.offsets[i]
            expected[start + offset - 1:start + n - 1] = 1
            assert (sample["segments"][start:start + n] == segment).all()
            if start > 0:  # the last token of the previous document does not predict this one's first
                assert sample["loss_mask"][start - 1] == 0
            start += n
            seen += 1
        assert sample["loss_mask"].tolist() == expected.tolist()
    assert seen == len(docs)
    assert sum(int(rows[i]["loss_mask"].sum()) for i in range(len(rows))) == rows.trained_tokens


def test_collate_pads_to_a_multiple_of_8_with_zero_weight(tokenizer):
    rows = SequenceDataset(tokenize(llm_tiny.records("text", 4), tokenizer))
    batch = collate([rows[0], rows[1]])
    longest = max(len(rows[0]["inputs"]), len(rows[1]["inputs"]))
    assert batch["inputs"].shape == (2, -(-longest // 8) * 8)
    assert batch["loss_mask"][0, len(rows[0]["inputs"]):].sum() == 0


def test_loader_buckets_by_token_length(tokenizer):
    records = [{"text": " ".join(llm_tiny.SENTENCES[: 1 + i % 5])} for i in range(40)]
    rows = SequenceDataset(tokenize(records, tokenizer))
    loader = make_loader(rows, batch_size=4, seed=0, num_workers=0)
    spreads = [int((b["loss_mask"].sum(axis=1).max() - b["loss_mask"].sum(axis=1).min()).item()) for b in loader]
    # rows of 5 distinct lengths in batches of 4: sorted windows give (nearly) uniform batches
    assert sum(s == 0 for s in spreads) >= len(spreads) - 2
    with pytest.raises(DataError, match="fewer than one batch of 64"):
        make_loader(rows, batch_size=64)


def test_jsonl_written_by_mlx_lm_docs_format(tmp_path, tokenizer):
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    docs = tokenize(load_records(str(tmp_path))["train"], tokenizer, mask_prompt=True)
    assert tokenizer.decode(docs.tokens[0][docs.offsets[0]:].tolist()) == "hello<|im_end|>\n"
