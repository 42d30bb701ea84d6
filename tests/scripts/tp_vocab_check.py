"""Run on 2 ranks (``mlx.launch -n 2 -- python tp_vocab_check.py OUT``): every rank builds a tiny llama
whole and a copy split by tensor parallelism (its vocabulary too), and compares, on the same batch, what
the split copy computes with what the whole one does: the distributed logsumexp against ``log_softmax``,
``target_logprobs`` (chunked with a frozen or a trainable head, not differentiated, the full gathered
logits), ``lm_loss`` and the preference losses, and their gradients (gathered). Writes OUT/rank-<r>.json:
``{check name: largest relative difference}``, and the layout."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.distributed import tensor  # noqa: E402
from mlx_train.llm import loss as llm_loss  # noqa: E402
from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.preference import PreferenceConfig, PreferenceLoss  # noqa: E402

VOCAB = 96


def largest(a, b):
    """The largest difference between ``a`` (the whole model's) and ``b``, relative to ``a``'s largest value
    (when above 1)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a - b)).item()) / max(1.0, float(mx.max(mx.abs(a)).item()))


def make(tie, train, split, group):
    model, _ = llm_tiny.make_model(VOCAB, seed=0, tie=tie)
    if split:
        llm_tensor_parallel.shard_language_model(model, group)
    if train == "lora":
        apply_adapters(model, AdapterConfig("lora", num_layers=2, rank=4))
        mx.random.seed(7)  # LoRA's B starts at 0: give it values (whole, then this rank's slice)
        for _, layer in model.named_modules():
            if "lora_b" in layer:
                whole = mx.random.normal((layer.lora_b.shape[0], 64)) * 0.02  # wider than any slice
                cols = getattr(layer, "sharded_axes", {}).get("lora_b") == 1
                n = layer.lora_b.shape[1]
                start = group.rank() * n if (split and cols) else 0
                layer.lora_b = whole[:, start:start + n]
    mx.eval(model.parameters())
    return model


def batch(rows=3, length=21):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, size=(rows, length + 1)).astype(np.int32)
    mask = np.ones((rows, length), dtype=np.int32)
    mask[1, 15:] = 0
    mask[2, :4] = 0
    return {"inputs": mx.array(tokens[:, :-1]), "targets": mx.array(tokens[:, 1:]), "loss_mask": mx.array(mask)}


def grads_of(model, fn):
    def loss(params):
        model.update(params)
        return fn(model)

    value, grads = mx.value_and_grad(loss)(model.trainable_parameters())
    return value, dict(tree_flatten(grads))


def compare(results, name, group, layout, whole_model, split_model, fn):
    value_w, grads_w = grads_of(whole_model, fn)
    value_s, grads_s = grads_of(split_model, fn)
    mx.eval(value_s, grads_s)
    gathered = tensor.gather_parameters(grads_s, layout, group)
    results[name] = max([largest(value_w, value_s)] + [largest(grads_w[k], gathered[k]) for k in grads_w])
    results[name + " keys"] = sorted(grads_w) == sorted(gathered)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    group = mx.distributed.init()
    results = {}
    # the distributed logsumexp: each rank holds its half of the columns
    logits = mx.random.normal((5, VOCAB), key=mx.random.key(3)) * 4
    targets = mx.array([0, 47, 48, 95, 60])
    rows = VOCAB // group.size()
    mine = logits[:, group.rank() * rows:(group.rank() + 1) * rows]
    score, norm = llm_loss.split_target_and_norm(mine, targets, group.rank() * rows, group)
    plain = nn.log_softmax(logits, axis=-1)
    results["logsumexp"] = largest(score - norm, mx.take_along_axis(plain, targets[:, None], axis=-1).squeeze(-1))

    def split_logp(local):
        s, n = llm_loss.split_target_and_norm(local, targets, group.rank() * rows, group)
        return (s - n).sum()

    d_local = mx.grad(split_logp)(mine)
    d_whole = mx.grad(lambda x: mx.take_along_axis(nn.log_softmax(x, axis=-1), targets[:, None], axis=-1).sum())(
        logits)
    results["logsumexp grad"] = largest(d_local, d_whole[:, group.rank() * rows:(group.rank() + 1) * rows])

    data = batch()
    positions = mx.array(llm_loss.trained_positions(np.array(data["loss_mask"]), multiple=8))
    llm_loss.MIN_CHUNK_TOKENS = 8  # several chunks of a few tokens
    layouts = {}
    for tie in (True, False):
        for train in ("lora", "all"):
            whole, split = make(tie, train, False, group), make(tie, train, True, group)
            if train == "all":
                whole.unfreeze()
                split.unfreeze()
            layout = tensor.shard_layout(split)
            layouts[f"{tie} {train}"] = layout
            tag = f"{'tied' if tie else 'untied'} {train}"
            for chunk in (16, 0):
                compare(results, f"{tag} lm_loss chunk={chunk}", group, layout, whole, split,
                        lambda m, c=chunk: _lm_loss(m, data, c))
            compare(results, f"{tag} positions", group, layout, whole, split,
                    lambda m: llm_loss.target_logprobs(m, {**data, "positions": positions}, chunk=16)[0].sum())
            no_grad = [llm_loss.target_logprobs(m, data, chunk=16, grad=False)[0] for m in (whole, split)]
            results[f"{tag} grad=False"] = largest(*no_grad)
            results[f"{tag} logits"] = largest(whole(data["inputs"]), split(data["inputs"]))
            for method in ("orpo", "cpo", "dpo"):
                pref = PreferenceLoss(PreferenceConfig(method=method, beta=0.5, reference_free=True))
                chosen, rejected = data, {k: v[::-1] for k, v in data.items()}
                pref_batch = _preference_batch(chosen, rejected)
                compare(results, f"{tag} {method}", group, layout, whole, split,
                        lambda m, p=pref, b=pref_batch: p(m, b)[0])
    with open(os.path.join(args.out, f"rank-{group.rank()}.json"), "w") as f:
        json.dump({"results": results, "layouts": layouts}, f)


def _lm_loss(model, data, chunk):
    saved = llm_loss.CHUNK_LOGITS
    llm_loss.CHUNK_LOGITS = VOCAB * chunk
    try:
        return llm_loss.lm_loss(model, data)[0]
    finally:
        llm_loss.CHUNK_LOGITS = saved


def _preference_batch(chosen, rejected):
    return {**{f"chosen_{k}": chosen[n] for k, n in (("inputs", "inputs"), ("targets", "targets"),
                                                    ("mask", "loss_mask"))},
            **{f"rejected_{k}": rejected[n] for k, n in (("inputs", "inputs"), ("targets", "targets"),
                                                        ("mask", "loss_mask"))}}


if __name__ == "__main__":
    main()
