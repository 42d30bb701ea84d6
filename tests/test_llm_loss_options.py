"""The loss's chunk size as an option (``loss_chunk``: tokens per chunk, 0 the full logits) for the
next-token and the preference losses, and an evaluation (a model in eval mode) that skips the
gradient work of the chunks' forward pass but gives the same loss, and the same gradients if it is
differentiated all the same."""

import os
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from test_llm_chunked_loss import assert_same, batch, make, pair_batch, plain_lm_loss  # noqa: E402

from mlx_train.config import FinetuneConfig, TrainConfig  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import loss as llm_loss  # noqa: E402
from mlx_train.llm.finetune import _loss_for  # noqa: E402
from mlx_train.llm.loss import lm_loss  # noqa: E402


def grads_of(model, fn, data):
    value, grads = nn.value_and_grad(model, lambda m, b: fn(m, b)[0])(model, data)
    mx.eval(value, grads)
    from mlx.utils import tree_flatten

    return value.item(), dict(tree_flatten(grads))


class HeadCalls:
    """Counts the calls of an untied model's output projection."""

    def __init__(self, model):
        self.head, self.calls = model.lm_head, 0
        self.original = type(self.head).__call__

    def __enter__(self):
        def counting(module, *args, **kwargs):
            self.calls += module is self.head
            return self.original(module, *args, **kwargs)

        type(self.head).__call__ = counting
        return self

    def __exit__(self, *exc):
        type(self.head).__call__ = self.original


def test_the_option_sets_the_chunk_of_the_loss():
    model = make(tie=False)
    data = batch(prompt=2)  # 3 rows x 21 tokens
    plain = grads_of(model, plain_lm_loss, data)
    # 63 tokens: 8 chunks of 8, each projected in its forward pass and again for its gradient (a frozen
    # head); 0: the full logits, one projection; None: 8M logits a chunk, all 63 tokens in one
    for chunk, calls in ((8, 16), (0, 1), (None, 2)):
        fn = _loss_for(TrainConfig.for_finetune({"model": "m", "dataset": "d", "loss_chunk": chunk}))
        assert fn.__name__ == "lm_loss"
        with HeadCalls(model) as head:
            assert_same(plain, grads_of(model, fn, data))
        assert head.calls == calls, chunk
    with pytest.raises(ConfigError, match="loss_chunk.*at least 0"):
        FinetuneConfig(loss_chunk=-1)  # a fine-tuning setting: FinetuneConfig's


def test_preference_losses_take_the_chunk_too():
    model = make(tie=False, seed=2)
    data = pair_batch()
    cfg = {"model": "m", "dataset": "d", "train_mode": "dpo", "beta": 0.5}
    full = _loss_for(TrainConfig.for_finetune({**cfg, "loss_chunk": 0}))
    chunked = _loss_for(TrainConfig.for_finetune({**cfg, "loss_chunk": 4}))
    with HeadCalls(model) as head:
        reference = grads_of(model, full, data)
    assert head.calls == 2  # the reference pass and the policy pass, each the full logits
    with HeadCalls(model) as head:
        assert_same(reference, grads_of(model, chunked, data))
    assert head.calls == 17 + 2 * 17  # 4 rows x 17 tokens a pass: 17 chunks of 4 (the policy's: 2 calls each)


def test_evaluation_skips_the_gradient_work_and_keeps_the_loss(monkeypatch):
    model = make(tie=True)
    data = batch(prompt=2)
    built = []
    original = llm_loss._frozen_head_logprobs

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(llm_loss, "_frozen_head_logprobs", counting)
    training = grads_of(model, lambda m, b: lm_loss(m, b, chunk=8), data)
    assert len(built) == 1  # training: each chunk's gradient is formed in the forward pass
    model.eval()
    try:
        value, tokens = lm_loss(model, data, chunk=8)
        assert value.item() == pytest.approx(training[0], rel=1e-6) and tokens.item() == float(data["loss_mask"].sum())
        assert_same(training, grads_of(model, lambda m, b: lm_loss(m, b, chunk=8), data))  # still differentiable
    finally:
        model.train()
    assert len(built) == 1


def test_prompt_masked_batches_carry_their_trained_positions_and_train_the_same():
    import numpy as np

    from mlx_train.llm.data import Documents, SequenceDataset, collate

    rng = np.random.default_rng(0)
    docs = Documents([rng.integers(3, 97, size=n).astype(np.int32) for n in (80, 60, 90)], offsets=[50, 40, 70])
    rows = SequenceDataset(docs).samples()
    gathered, plain = collate(rows, positions=True), collate(rows)
    assert plain["inputs"].shape == (3, 96) and "positions" not in plain
    assert gathered["positions"].shape == (3, 32)  # at most 30 trained targets a row
    for row, mask in zip(gathered["positions"], gathered["loss_mask"], strict=True):
        assert row[row >= 0].tolist() == np.flatnonzero(mask).tolist()
    model = make(tie=False)
    with HeadCalls(model) as head:
        full = grads_of(model, lambda m, b: lm_loss(m, b, chunk=16), {k: mx.array(v) for k, v in plain.items()})
    assert head.calls == 2 * 18  # 3 rows x 96 padded tokens: 18 chunks of 16
    with HeadCalls(model) as head:
        assert_same(full, grads_of(model, lambda m, b: lm_loss(m, b, chunk=16),
                                   {k: mx.array(v) for k, v in gathered.items()}))
    assert head.calls == 2 * 6  # 3 rows x 32 positions: 6 chunks
