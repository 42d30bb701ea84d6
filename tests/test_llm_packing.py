"""Packing for fine-tuning: best-fit rows keep every token of every document exactly once, batches by
length (no mask) hold every document once, and the loss of a packed epoch equals the loss of its
documents taken one at a time, on two tiny llama shapes."""

import os
import sys

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm.data import Documents, SequenceDataset, make_loader, pack_documents  # noqa: E402
from mlx_train.llm.loss import lm_loss  # noqa: E402

VOCAB = 97


def documents(seed: int, count: int = 40, longest: int = 60) -> Documents:
    """Random documents of 2..longest tokens (ids >= 1, so 0 is only padding), some with a prompt."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, longest + 1, count)
    tokens = [rng.integers(1, VOCAB, n).astype(np.int32) for n in lengths]
    offsets = [int(rng.integers(0, n - 1)) if i % 3 == 0 else 0 for i, n in enumerate(lengths)]
    return Documents(tokens, offsets, max_seq_length=longest)


def row_tokens(sample: dict) -> np.ndarray:
    return np.concatenate([sample["inputs"], sample["targets"][-1:]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_rows_hold_every_token_of_every_document_exactly_once(seed):
    docs = documents(seed, count=50)
    capacity = 96
    rows = SequenceDataset(docs, capacity, pack="best_fit")
    assert rows.packed and len(rows) < len(docs)
    seen: list[int] = []
    for r in range(len(rows)):
        sample, members = rows[r], rows.rows[r]
        tokens, segments = row_tokens(sample), np.append(sample["segments"], sample["segments"][-1])
        assert len(tokens) <= capacity
        for segment, i in enumerate(members, 1):
            np.testing.assert_array_equal(tokens[segments == segment], docs.tokens[i])
        assert set(np.unique(segments)) == set(range(1, len(members) + 1))
        seen += members
    assert sorted(seen) == list(range(len(docs)))
    # best fit, longest first, fills rows: no two rows could have been one
    totals = sorted(int(docs.lengths[r].sum()) for r in rows.rows)
    assert totals[0] + totals[1] > capacity
    assert pack_documents(np.array([6, 5, 4, 3, 2]), 10) == [[0, 2], [1, 3, 4]]


def test_batches_by_length_hold_every_document_once_without_a_mask():
    docs = documents(3, count=60)
    rows = SequenceDataset(docs, 64, pack="by_length")
    assert not rows.packed and len(rows) == len(docs)
    loader = make_loader(rows, batch_size=2, seed=5, num_workers=0)
    found, sizes = [], set()
    for batch in loader:
        assert "segments" not in batch
        assert batch["inputs"].size <= 2 * 64  # a budget of batch_size x max_seq_length tokens
        sizes.add(batch["inputs"].shape[0])
        inputs, targets = np.array(batch["inputs"]), np.array(batch["targets"])
        for x, y in zip(inputs, targets, strict=True):
            n = int((y != 0).sum())  # ids are >= 1: zeros are padding
            found.append(tuple(np.append(x[:n], y[n - 1]).tolist()))
    assert sorted(found) == sorted(tuple(t.tolist()) for t in docs.tokens)
    assert len(sizes) > 1  # short documents come more to a batch
    with pytest.raises(ConfigError, match="pack='by_lenght' is not a packing"):
        SequenceDataset(docs, 64, pack="by_lenght")
    with pytest.raises(ConfigError, match="needs max_seq_length"):
        SequenceDataset(docs, pack="by_length")


SHAPES = {
    "gqa-2-layers": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "mha-3-layers-untied": {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6,
                            "num_key_value_heads": 6, "intermediate_size": 96, "tie_word_embeddings": False},
}


def tiny_model(shape: str):
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(11)
    model = Model(ModelArgs.from_dict({**llm_tiny.model_config(VOCAB), **SHAPES[shape]}))
    mx.eval(model.parameters())
    return model


def per_document_loss(model, docs: Documents) -> tuple[float, int]:
    """Sum of the trained targets' cross-entropy, each document run alone (no padding, no neighbour)."""
    total, count = 0.0, 0
    for tokens, offset in zip(docs.tokens, docs.offsets, strict=True):
        logits = model(mx.array(tokens[None, :-1]))[0]
        losses = np.array(nn.losses.cross_entropy(logits, mx.array(tokens[1:])))
        first = max(offset, 1) - 1
        total += float(losses[first:].astype(np.float64).sum())
        count += len(tokens) - 1 - first
    return total, count


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pack", [False, "best_fit", "by_length"])
def test_the_loss_of_a_packed_epoch_is_the_loss_of_its_documents_alone(shape, pack):
    model = tiny_model(shape)
    docs = documents(7, count=24, longest=40)
    expected, expected_count = per_document_loss(model, docs)
    rows = SequenceDataset(docs, 64, pack=pack)
    total, count, batches = 0.0, 0, 0
    for batch in make_loader(rows, batch_size=2, seed=0, num_workers=0, drop_last=False):
        assert ("segments" in batch) == (pack == "best_fit")  # by length: documents apart with no mask
        loss, tokens = lm_loss(model, batch)
        total += loss.item() * tokens.item()
        count += int(tokens.item())
        batches += 1
    assert count == expected_count == rows.trained_tokens
    np.testing.assert_allclose(total, expected, rtol=2e-6)
    assert batches < len(docs) / 2 if pack else batches == len(docs) / 2
