"""GRPO on the Trainer: the loss and its gradient against a hand-written reference for each normalisation
and the sequence-level ratio, accumulation weighting, a gradient for every trained parameter, reproducible
rollouts whose shared prefill samples what one-sequence-at-a-time generation does, bad rows and settings,
the CLI end to end and exact resume after SIGKILL."""

import json
import os
import subprocess
import sys
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.checkpointing import load_checkpoint  # noqa: E402
from mlx_train.config import FinetuneConfig  # noqa: E402
from mlx_train.errors import CheckpointError, ConfigError, DataError  # noqa: E402
from mlx_train.llm import FineTuneConfig, finetune  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.data import collate  # noqa: E402
from mlx_train.llm.grpo import (  # noqa: E402
    GRPOConfig,
    GRPOLoss,
    Phases,
    PromptRows,
    advantages,
    rollout_batch,
    shared_layers,
)
from mlx_train.llm.rewards import RewardSet  # noqa: E402
from mlx_train.llm.rollouts import Completions, Sampling, generate_groups, rollout_key  # noqa: E402
from mlx_train.llm.tasks import task_for  # noqa: E402

REWARDS = "grpo_rewards:letter_share,grpo_rewards:says_answer"
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "llm_resume_run.py")


def prompt_rows(n, start=0):
    rows = []
    for i in range(start, start + n):
        row = {"prompt": llm_tiny.SENTENCES[i % len(llm_tiny.SENTENCES)], "answer": "e"}
        if i % 3 == 0:
            row["type"] = "open"
        if i % 4 == 1:
            row["system"] = "Be brief."
        rows.append(row)
    return rows


def write_prompts(directory, n_train=8, n_valid=4, rows=None):
    os.makedirs(directory, exist_ok=True)
    for split, n, start in (("train", n_train, 0), ("valid", n_valid, 100)):
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            for row in (rows if rows is not None and split == "train" else prompt_rows(n, start)):
                f.write(json.dumps(row) + "\n")
    return directory


def write_setup(root):
    """The tiny base (``root/base``) and prompt rows (``root/data``) of a GRPO run."""
    llm_tiny.write_model_dir(str(root / "base"), seed=3)
    write_prompts(str(root / "data"))
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_setup(tmp_path_factory.mktemp("grpo"))


@pytest.fixture(scope="module")
def tokenizer():
    return llm_tiny.make_tokenizer()


def _lora_model(tokenizer, seed=3, layers=2, adapted=2):
    """The tiny base with LoRA adapters on its last ``adapted`` layers whose lora_b is random (so every adapter
    matrix has a gradient)."""
    model, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=seed, layers=layers)
    apply_adapters(model, AdapterConfig("lora", num_layers=adapted, rank=4, scale=2.0))
    mx.random.seed(7)
    model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    return model


def _rollout(tokenizer, group_size=3, seed=0):
    """A rollout batch of made-up completions (some ending with EOS, of several lengths) of three prompts."""
    rng = np.random.default_rng(seed)
    prompts = [np.array(tokenizer.encode(s), np.int32) for s in llm_tiny.SENTENCES[:3]]
    rows = len(prompts) * group_size
    lengths = rng.integers(2, 9, size=rows).astype(np.int32)
    tokens = np.zeros((rows, 8), np.int32)
    ended = np.zeros(rows, bool)
    eos = next(iter(tokenizer.eos_token_ids))
    for r in range(rows):
        tokens[r, :lengths[r]] = rng.integers(3, 300, size=lengths[r])
        if r % 2:
            tokens[r, lengths[r] - 1], ended[r] = eos, True
    completions = Completions(tokens, lengths, ended)
    batch = rollout_batch(prompts, completions, group_size)
    batch["advantages"] = rng.normal(size=rows).astype(np.float32)
    batch["rewards"] = rng.random(rows).astype(np.float32)
    batch["function_rewards"] = np.zeros((rows, 0), np.float32)
    return prompts, completions, batch


def _hand_logps(model, prompt, completion):
    """log p(completion token j | prompt, completion[:j]), one sequence, no padding, token by token."""
    sequence = [int(t) for t in prompt] + completion
    logits = model(mx.array([sequence[:-1]]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.stack([logprobs[len(prompt) - 1 + j, t] for j, t in enumerate(completion)])


def _hand_loss(model, base, prompts, completions, batch, old, cfg):
    """The GRPO loss written out per completion and token (see mlx_train.llm.grpo's docstring)."""
    group = len(completions.lengths) // len(prompts)
    per_token = []
    for r in range(len(completions.lengths)):
        completion = completions.row(r)
        lp = _hand_logps(model, prompts[r // group], completion)
        ref = mx.stop_gradient(_hand_logps(base, prompts[r // group], completion))
        log_ratio = lp - mx.array(old[r, :len(completion)])
        if cfg.importance_sampling_level == "sequence":
            log_ratio = mx.broadcast_to(log_ratio.mean(), log_ratio.shape)
        ratio = mx.exp(log_ratio)
        a = float(batch["advantages"][r])
        clipped = mx.clip(ratio, 1 - cfg.epsilon, 1 + cfg.upper)
        kl = mx.exp(ref - lp) - (ref - lp) - 1
        per_token.append(-mx.minimum(ratio * a, clipped * a) + cfg.beta * kl)
    if cfg.loss_type == "grpo":
        return sum(t.mean() for t in per_token) / len(per_token)
    total = sum(t.sum() for t in per_token)
    if cfg.loss_type == "bnpo":
        return total / sum(t.size for t in per_token)
    return total / (len(per_token) * cfg.sampling.max_tokens)


@pytest.mark.parametrize("loss_type,level,layers", [("grpo", "token", 2), ("bnpo", "token", 2), ("dr_grpo", "token", 2),
                                                    ("grpo", "sequence", 2), ("bnpo", "sequence", 2),
                                                    ("grpo", "token", 4), ("bnpo", "sequence", 4)])
def test_loss_and_gradient_equal_a_hand_written_reference(tokenizer, loss_type, level, layers):
    """With 4 layers, adapters on the last 2: the reference pass starts from the policy's hidden state after
    the first 2, which both compute alike."""
    model = _lora_model(tokenizer, layers=layers, adapted=2)
    assert shared_layers(model) == layers - 2
    base, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3, layers=layers)
    prompts, completions, batch = _rollout(tokenizer)
    # old log-probabilities away from the policy's: ratios on both sides of the clipping range
    rng = np.random.default_rng(1)
    policy = np.zeros(batch["positions"].shape, np.float32)
    for r in range(len(completions.lengths)):
        policy[r, :completions.lengths[r]] = np.array(_hand_logps(model, prompts[r // 3], completions.row(r)))
    old = (policy + rng.normal(scale=0.3, size=policy.shape)).astype(np.float32)
    cfg = GRPOConfig(group_size=3, sampling=Sampling(max_tokens=8), beta=0.2, epsilon=0.1, epsilon_high=0.28,
                     loss_type=loss_type, importance_sampling_level=level)
    loss = GRPOLoss(cfg, None, [], tokenizer, [])
    arrays = {k: mx.array(v) for k, v in {**batch, "old_logps": old}.items()}

    def ours(params):
        model.update(params)
        value, items, metrics = loss(model, arrays)
        return value, (items, metrics)

    def hand(params):
        model.update(params)
        return _hand_loss(model, base, prompts, completions, batch, old, cfg)

    params = model.trainable_parameters()
    (value, (items, metrics)), grads = mx.value_and_grad(ours)(params)
    expected, expected_grads = mx.value_and_grad(hand)(params)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    flat, hand_flat = dict(tree_flatten(grads)), dict(tree_flatten(expected_grads))
    for name, g in hand_flat.items():
        assert np.allclose(np.array(flat[name]), np.array(g), rtol=1e-4, atol=1e-6), name
    tokens = int(completions.lengths.sum())
    assert items.item() == (tokens if loss_type == "bnpo" else len(completions.lengths))
    assert metrics["completion_length"].item() == pytest.approx(completions.lengths.mean())
    assert metrics["kl"].item() > 0
    if level == "token":  # both sides clip somewhere with these ratios
        assert metrics["clip_ratio_low"].item() > 0 and metrics["clip_ratio_high"].item() > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_micro_batches_weighted_by_their_items_give_the_whole_batch_loss(tokenizer, loss_type):
    """What gradient accumulation and the out-of-memory split do: the items-weighted mean of the parts' losses
    is the loss of the whole rollout batch, for every normalisation."""
    model = _lora_model(tokenizer)
    _, _, batch = _rollout(tokenizer, seed=2)
    loss = GRPOLoss(GRPOConfig(group_size=3, sampling=Sampling(max_tokens=8), beta=0.1, loss_type=loss_type),
                    None, [], tokenizer, [])
    arrays = {k: mx.array(v) for k, v in batch.items()}
    whole = loss(model, arrays)[0].item()
    parts = [loss(model, {k: v[a:b] for k, v in arrays.items()}) for a, b in ((0, 4), (4, 9))]
    combined = sum(p[0] * p[1] for p in parts) / sum(p[1] for p in parts)
    assert combined.item() == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("layers,beta", [(2, 0.1), (4, 0.1), (4, 0.0)])
def test_each_groups_prompt_run_once_scores_what_whole_rows_score(tokenizer, layers, beta):
    """The policy's and the reference's log-probabilities and the gradient are those of whole rows (prompt and
    completion in one sequence), for the whole rollout and for cuts that start and end inside groups."""
    model = _lora_model(tokenizer, layers=layers, adapted=2)
    _, _, batch = _rollout(tokenizer, seed=3)
    batch["old_logps"] = np.zeros(batch["positions"].shape, np.float32)  # ratios away from 1: a gradient
    loss = GRPOLoss(GRPOConfig(group_size=3, sampling=Sampling(max_tokens=8), beta=beta), None, [], tokenizer, [])
    arrays = {k: mx.array(v) for k, v in batch.items()}
    for a, b in ((0, 9), (1, 8), (2, 4), (4, 5)):
        part = {k: v[a:b] for k, v in arrays.items()}
        whole = {k: v for k, v in part.items() if k != "prompts"}  # no prompts column: whole rows

        def scored(params, rows=part):
            model.update(params)
            logps, ref = loss._shared_prompts(model, rows) if "prompts" in rows else loss._whole_rows(model, rows)
            return loss(model, rows)[0], (logps, ref)

        (value, (logps, ref)), grads = mx.value_and_grad(scored)(model.trainable_parameters())
        (expected, (logps_w, ref_w)), grads_w = mx.value_and_grad(partial(scored, rows=whole))(
            model.trainable_parameters())
        mask = np.array(part["positions"]) >= 0
        assert np.allclose(np.array(logps)[mask], np.array(logps_w)[mask], rtol=1e-5, atol=1e-5), (a, b)
        assert (ref is None) == (beta == 0) and (ref is None or np.allclose(
            np.array(ref)[mask], np.array(ref_w)[mask], rtol=1e-5, atol=1e-5)), (a, b)
        assert value.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
        flat, flat_w = dict(tree_flatten(grads)), dict(tree_flatten(grads_w))
        assert b - a < 3 or any(np.abs(np.array(g)).max() > 0 for g in flat.values())  # (a row may be clipped)
        for name, g in flat_w.items():
            assert np.allclose(np.array(flat[name]), np.array(g), rtol=1e-4, atol=1e-6), (a, b, name)


def test_grpo_recomputes_whole_blocks_unless_told_otherwise():
    from mlx_train.llm.finetune import recompute_setting
    from mlx_train.llm.tasks import task_for

    def settled(config):  # as finetune() settles it: the task's settings, then the model's
        return recompute_setting(task_for(config).settings(config, print), model, log=print).gradient_checkpointing

    model, _ = llm_tiny.make_model(300)
    grpo = FineTuneConfig(model="base", data="data", train_mode="grpo")
    assert grpo.gradient_checkpointing == "auto"
    assert settled(grpo) is True
    for setting in (False, "attention"):
        assert settled(grpo.replace(gradient_checkpointing=setting)) == setting
    sft = FineTuneConfig(model="base", data="data")
    assert settled(sft) == "auto"


def test_phases_split_the_steps_time_and_leave_out_evaluations():
    ticks = iter(range(0, 1000, 1))
    phases = Phases(clock=lambda: float(next(ticks)))
    phases.mark("update")  # the first rollout: no step before it
    phases.mark("generation"), phases.mark("rewards")  # 1 s each
    phases.mark("update")  # 1 s
    phases.mark("generation"), phases.mark("rewards")
    phases.forget()  # an evaluation: its rollouts and step belong to no phase
    phases.mark("generation", measured=False), phases.mark("rewards", measured=False), phases.forget()
    phases.mark("update")  # 1 s, measured after the evaluation: not counted
    assert phases.read() == {"time_generation": 1.0, "time_rewards": 1.0, "time_update": 0.5}
    assert phases.read() == {}


def test_advantages_are_normalised_within_each_group():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    out = advantages(rewards, 4)
    first = (rewards[:4] - 0.25) / (rewards[:4].std() + 1e-4)
    assert np.allclose(out[:4], first, rtol=1e-6) and np.all(out[4:] == 0)
    assert np.allclose(advantages(rewards, 4, "none"), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    batch = advantages(rewards, 4, "batch")
    assert np.allclose(batch[:4], (rewards[:4] - 0.25) / (rewards.std() + 1e-4), rtol=1e-6)


def _prompts(tokenizer, n=4):
    rows = prompt_rows(n)
    return PromptRows.from_records(rows, tokenizer, [f"train.jsonl:{i + 1}" for i in range(n)], limit=100)


def _loss_for(tokenizer, prompts, **settings):
    rewards = RewardSet.load(REWARDS + ",grpo_rewards:text_length")
    cfg = GRPOConfig(**{"group_size": 4, "sampling": Sampling(max_tokens=10), "seed": 5, **settings})
    return GRPOLoss(cfg, rewards, rewards.names, tokenizer, [prompts])


def test_every_trained_parameter_gets_a_gradient_on_the_first_step(tokenizer):
    model = _lora_model(tokenizer)
    prompts = _prompts(tokenizer)
    loss = _loss_for(tokenizer, prompts, beta=0.1)
    batch = loss.prepare(model, {k: mx.array(v) for k, v in collate(prompts.samples()).items()}, 0)
    assert np.abs(np.array(batch["advantages"])).max() > 0  # the rewards differ within some group
    grads = mx.grad(lambda p: (model.update(p), loss(model, batch)[0])[1])(model.trainable_parameters())
    flat = dict(tree_flatten(grads))
    zero = [k for k, g in flat.items() if not np.any(np.array(g))]
    assert len(flat) == 28 and not zero, f"no gradient for {zero}"  # 7 adapted layers x 2 blocks x (a, b)


def test_rollouts_are_reproducible_from_seed_step_and_rows(tokenizer):
    model = _lora_model(tokenizer)
    prompts = _prompts(tokenizer)
    loss = _loss_for(tokenizer, prompts)
    batch = {k: mx.array(v) for k, v in collate(prompts.samples()).items()}
    mx.random.seed(0)
    state = np.array(mx.random.state[0])
    first, again, later = (loss.prepare(model, batch, step) for step in (3, 3, 4))
    assert np.array_equal(np.array(mx.random.state[0]), state)  # the global random state is not used
    assert all(np.array_equal(np.array(first[k]), np.array(again[k]), equal_nan=True) for k in first)
    assert not np.array_equal(np.array(first["inputs"]), np.array(later["inputs"]))
    assert model.training  # sampled in evaluation mode, put back
    assert first["inputs"].shape[0] == 16 and first["inputs"].shape[1] % 8 == 0
    assert first["positions"].shape[1] == 10  # a multiple of 32, or max_tokens when less
    # another seed, other rows: other completions
    other = _loss_for(tokenizer, prompts, seed=6).prepare(model, batch, 3)
    assert not np.array_equal(np.array(first["inputs"]), np.array(other["inputs"]))
    assert not mx.array_equal(rollout_key(0, [1, 2], 3), rollout_key(0, [1, 3], 3))


def test_num_iterations_trains_each_rollout_batch_that_many_steps_against_its_sampling_weights(tokenizer):
    """num_iterations 3: the rollouts of step 3 are the batch of steps 3-5 (sampled with step 3's key and weights,
    their log-probabilities under those kept); step 6 samples anew; at the first step the objective is the one
    num_iterations 1 computes, later ones compare the moved policy with the kept log-probabilities. A run
    resumed at step 4 (its weights moved on) samples step 3's rollouts again from the weights in the checkpoint."""
    model = _lora_model(tokenizer)
    prompts = _prompts(tokenizer)
    batch = {k: mx.array(v) for k, v in collate(prompts.samples()).items()}
    loss = _loss_for(tokenizer, prompts, beta=0.1, num_iterations=3)
    trained = loss.prepare(model, batch, 3)
    once = _loss_for(tokenizer, prompts, beta=0.1).prepare(model, batch, 3)
    assert trained.keys() == once.keys()  # its first step: num_iterations 1's batch, the same rollouts
    assert all(np.array_equal(np.array(trained[k]), np.array(once[k]), equal_nan=True) for k in once)
    first = loss._pending[1]  # kept for the next steps, with the sampling policy's log-probabilities
    expected = loss(model, trained)
    got = loss(model, first)
    assert abs(float(got[0]) - float(expected[0])) < 1e-6
    saved = loss.anchor_state(4)  # a checkpoint after step 3 (4 steps taken)
    assert saved["step"] == 3 and loss.anchor_state(3) == {} and loss.anchor_state(6) == {}
    sampled_with = dict(tree_flatten(model.trainable_parameters()))
    model.update(tree_map(lambda p: p * 1.5, model.trainable_parameters()))  # the update of step 3
    second = loss.prepare(model, batch, 4)
    assert second is first
    moved = loss(model, second)
    assert abs(float(moved[0]) - float(got[0])) > 1e-4 and float(moved[2]["clip_ratio"]) > 0
    resumed = _loss_for(tokenizer, prompts, beta=0.1, num_iterations=3)
    resumed.load_anchor_state({"step": saved["step"], "weights": dict(saved["weights"])})
    current = dict(tree_flatten(model.trainable_parameters()))
    again = resumed.prepare(model, batch, 5)
    assert all(np.array_equal(np.array(first[k]), np.array(again[k]), equal_nan=True) for k in first)
    assert all(v is current[k] for k, v in tree_flatten(model.trainable_parameters()))  # put back
    assert not any(v is sampled_with[k] for k, v in current.items())
    later = loss.prepare(model, batch, 6)
    assert not np.array_equal(np.array(later["inputs"]), np.array(first["inputs"]))
    with pytest.raises(CheckpointError, match="holds no weights of step 3 .* num_iterations"):
        _loss_for(tokenizer, prompts, num_iterations=3).prepare(model, batch, 4)


def test_shared_prefill_samples_what_one_sequence_at_a_time_generation_does(tokenizer):
    """Greedy: each prompt's prefill computed once, left-padded beside the others and repeated for its group,
    gives the tokens mlx-lm's generate_step gives for that prompt alone; a completion stops at its EOS."""
    from mlx_lm.generate import generate_step

    model, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=1)
    mx.random.seed(5)  # weights large enough for greedy completions that differ between prompts
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5 if p.ndim > 1 else p, model.parameters()))
    model.eval()
    prompts = [np.array(tokenizer.encode(s), np.int32) for s in llm_tiny.SENTENCES[:3]]
    eos = {int(tokenizer.encode(llm_tiny.SENTENCES[0])[5])}  # a token some completion samples: an early stop
    out = generate_groups(model, prompts, 2, Sampling(temperature=0, max_tokens=12), rollout_key(0, [0], 0), eos)
    for i, prompt in enumerate(prompts):
        alone = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=12, sampler=lambda x: mx.argmax(x, -1)):
            alone.append(int(token))
            if int(token) in eos:
                break
        assert out.row(2 * i) == alone and out.row(2 * i + 1) == alone
        assert out.ended[2 * i] == (alone[-1] in eos)
    assert len(set(map(tuple, (out.row(i) for i in range(6))))) == 3


@pytest.mark.parametrize("top_p,top_k", [(0.95, 20), (0.5, 20), (1.0, 20), (0.9, 0), (0.3, 5), (0.999, 7)])
def test_sampling_keeps_the_tokens_and_odds_of_mlx_lms_filters(top_p, top_k):
    """Top-p then top-k as mlx-lm filters them (the same tokens, the same probabilities after the temperature),
    and draws over many keys come out at those probabilities."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    logits = mx.random.normal((4, 300), key=mx.random.key(3)) * mx.array([[1.0], [2.0], [4.0], [8.0]])
    sampling = Sampling(temperature=0.7, top_p=top_p, top_k=top_k)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    reference = apply_top_p(logprobs, top_p) if top_p < 1 else logprobs
    reference = apply_top_k(reference, top_k) if top_k else reference
    expected = np.array(mx.softmax(reference / 0.7, axis=-1))
    index, kept = sampling.candidates(logits)
    dense = kept if index is None else mx.put_along_axis(mx.full(logits.shape, -mx.inf), index, kept, axis=-1)
    assert np.allclose(np.array(mx.softmax(dense / 0.7, axis=-1)), expected, atol=1e-6)
    assert ((expected > 0).sum(axis=1) > 1).any()  # a choice to draw from
    draws = 4000
    tokens = np.array(sampling.sample(mx.repeat(logits, draws, axis=0), mx.random.key(11))).reshape(4, draws)
    seen = np.stack([np.bincount(row, minlength=logits.shape[1]) / draws for row in tokens])
    assert (seen[expected == 0] == 0).all()
    assert np.abs(seen - expected).max() < 0.035


def test_compiled_decoding_samples_what_recomputing_the_whole_sequence_samples(tokenizer):
    """Sampled (temperature, top-p, top-k), not greedy: each token drawn with its step's key from the logits of
    the whole sequence so far, recomputed without a cache, is the token the compiled step drew; a second
    rollout of another width (another trace) too."""
    model = _lora_model(tokenizer)
    model.eval()
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=30, max_tokens=9)
    for count, seed in ((2, 0), (3, 1)):
        prompts = [np.array(tokenizer.encode(s), np.int32) for s in llm_tiny.SENTENCES[seed:seed + count]]
        key = rollout_key(seed, list(range(count)), 0)
        out = generate_groups(model, prompts, 2, sampling, key, set())
        keys = mx.random.split(key, sampling.max_tokens)
        for r in range(2 * count):
            sequence = [int(t) for t in prompts[r // 2]]
            for t in range(sampling.max_tokens):
                logits = model(mx.array([sequence] * (2 * count)))[:, -1, :].astype(mx.float32)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                sequence.append(int(sampling.sample(logprobs, keys[t])[r]))
            assert out.row(r) == sequence[len(prompts[r // 2]):], r
        assert len({tuple(out.row(r)) for r in range(2 * count)}) > 1


def test_a_model_no_longer_sampled_from_is_not_kept_alive_by_its_compiled_step(tokenizer):
    import gc
    import weakref

    prompts = [np.array(tokenizer.encode(llm_tiny.SENTENCES[0]), np.int32)]
    sampling = Sampling(temperature=1.0, max_tokens=3)
    first = _lora_model(tokenizer)
    out = generate_groups(first, prompts, 2, sampling, rollout_key(0, [0], 0), set())
    gone = weakref.ref(first)
    del first
    second = _lora_model(tokenizer)  # the same weights: the same completions from its own compiled step
    again = generate_groups(second, prompts, 2, sampling, rollout_key(0, [0], 0), set())
    gc.collect()
    assert gone() is None
    assert np.array_equal(out.tokens, again.tokens)


@pytest.mark.parametrize("row,message", [
    ({"answer": "4"}, "train.jsonl:2: the row has no \"prompt\""),
    ({"prompt": "2+2?"}, "train.jsonl:2: the row has no \"answer\""),
    ({"prompt": 7, "answer": "4"}, "train.jsonl:2: \"prompt\" must be a string"),
    ({"prompt": "2+2?", "answer": ["4"]}, "train.jsonl:2: \"answer\" must be a string"),
    ({"prompt": "2+2?", "answer": "4", "system": 1}, "train.jsonl:2: \"system\" must be a string"),
    ({"prompt": "word " * 80, "answer": "4"}, "train.jsonl:2: the prompt is .* tokens with the chat template, more "
                                              "than max_seq_length - max_completion_length = 112"),
])
def test_bad_rows_name_the_file_line_and_fix(setup, tmp_path, row, message):
    data = write_prompts(str(tmp_path / "d"), rows=[prompt_rows(1)[0], row])
    cfg = FineTuneConfig(model=str(setup / "base"), data=data, train_mode="grpo", max_seq_length=128,
                         max_completion_length=16, reward_functions=REWARDS, run_dir=str(tmp_path / "r"), iters=1,
                         num_layers=2)
    with pytest.raises(DataError, match=message):
        finetune(cfg)


@pytest.mark.parametrize("settings,message", [
    ({"train_mode": "sft", "group_size": 8}, "--group-size 8 does not apply to --train-mode sft .*--train-mode grpo"),
    ({"train_mode": "dpo", "reward_functions": "a"}, "--reward-functions .* does not apply to --train-mode dpo"),
    ({"train_mode": "grpo", "mask_prompt": True}, "--mask-prompt True does not apply to --train-mode grpo .*sft"),
    ({"train_mode": "grpo", "dpo_loss_type": "ipo"}, "--dpo-loss-type 'ipo' does not apply to --train-mode grpo"),
    ({"train_mode": "grpo", "fine_tune_type": "full"}, "full and --beta 0.1: the KL penalty's reference"),
    ({"train_mode": "grpo", "max_completion_length": 2048}, "leaves no room for a prompt"),
    ({"train_mode": "sft", "num_iterations": 2}, "--num-iterations 2 does not apply to --train-mode sft"),
    ({"train_mode": "grpo", "group_size": 1}, "group_size must be at least 2"),
    ({"train_mode": "dpo", "beta": 0}, "beta must be above 0 for --train-mode dpo"),
])
def test_settings_that_do_not_apply_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        task_for(FinetuneConfig(model="base", dataset="data", **settings))


def test_grpo_with_no_kl_penalty_and_full_fine_tuning_is_accepted():
    task = task_for(FinetuneConfig(model="base", dataset="data", train_mode="grpo", fine_tune_type="full", beta=0,
                                   grpo_loss_type="bnpo"))
    assert task.unit == "completion tokens"


@pytest.mark.slow
def test_cli_grpo_end_to_end_metrics_card_and_mlx_lm_loads_the_adapters(setup, tmp_path, capsys):
    import mlx_lm

    from mlx_train.cli.main import main

    run = tmp_path / "run"
    code = main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--train-mode", "grpo",
                 "--iters", "4", "--batch-size", "2", "--num-generations", "3", "--max-completion-length", "12",
                 "--max-seq-length", "128", "--num-layers", "2", "--learning-rate", "5e-3", "--beta", "0.05",
                 "--epsilon", "0.1", "--epsilon-high", "0.28", "--reward-functions", REWARDS,
                 "--reward-weights", "1.0,0.5",
                 "--steps-per-report", "2", "--steps-per-eval", "4", "--val-batches", "1", "--run-dir", str(run)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "finetune grpo: 4 steps, 24 completions" in out and "validation: reward" in out
    reports = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in reports if "reward_mean" in r]
    assert len(trained) == 2 and {"reward_std", "reward_says_answer_mean", "reward_says_answer_coverage",
                                  "completion_length", "completion_length_max", "kl", "clip_ratio"} <= set(trained[0])
    for report in trained:  # where the steps' time went
        assert all(report[f"time_{p}"] > 0 for p in ("generation", "rewards", "update"))
    assert any("val_reward_mean" in r for r in reports)
    adapter_config = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert adapter_config["train_mode"] == "grpo" and adapter_config["group_size"] == 3
    assert adapter_config["reward_weights"] == [1.0, 0.5] and adapter_config["epsilon_high"] == 0.28
    assert adapter_config["clip_epsilon"] == 0.1
    assert "| group_size | `3` |" in (run / "adapters" / "README.md").read_text()
    model, tokenizer = mlx_lm.load(str(setup / "base"), adapter_path=str(run / "adapters"))
    assert isinstance(model, nn.Module) and tokenizer is not None


def test_num_iterations_cannot_change_on_resume(setup, tmp_path, capsys):
    """The loader's order repeats each batch num_iterations times, so a resume keeps the run's own: another one
    is refused from Python and from the command line, before anything is loaded or changed."""
    from mlx_train.cli.main import main

    run = tmp_path / "run"
    cfg = FineTuneConfig(model=str(setup / "base"), data=str(setup / "data"), train_mode="grpo", max_seq_length=128,
                         max_completion_length=6, group_size=2, reward_functions=REWARDS, run_dir=str(run), iters=2,
                         num_layers=2, num_iterations=2, save_every=2)
    finetune(cfg, log=lambda line: None)
    with pytest.raises(ConfigError, match=r"num_iterations 2 -> 3: cannot change on resume .*repeated "
                                          r"num_iterations times"):
        finetune(cfg.replace(num_iterations=3, max_steps=4), resume="auto", log=lambda line: None)
    capsys.readouterr()
    assert main(["finetune", "--run-dir", str(run), "--resume", "--num-iterations", "3", "--iters", "4"]) == 2
    err = capsys.readouterr().err
    assert "num_iterations cannot change on resume" in err and "Traceback" not in err


def _resume_run(base, data, run_dir, out, *extra, check=True):
    proc = subprocess.run([sys.executable, SCRIPT, base, data, str(run_dir), str(out), "--train-mode", "grpo", *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 3])
def test_sigkill_then_resume_is_bit_exact(setup, tmp_path, iterations):
    """Rollouts sampled with LoRA dropout on in the step, gradient accumulation and a KL penalty: a run killed
    after step 5 and resumed from its step-4 checkpoint ends with the adapters and optimizer state of the
    uninterrupted run, bit for bit (the completions are drawn from the step, not from a saved random state).
    With num_iterations 3 that checkpoint falls inside the rollout batch of steps 3-5, sampled again on resume
    from the weights the checkpoint keeps."""
    base, data = str(setup / "base"), str(setup / "data")
    flags = ("--num-iterations", str(iterations))
    _resume_run(base, data, tmp_path / "full", tmp_path / "full.safetensors", *flags)
    killed = _resume_run(base, data, tmp_path / "cut", tmp_path / "unused.safetensors", "--kill-at", "5", *flags,
                         check=False)
    assert killed.returncode == -9, killed.stdout[-3000:]
    if iterations > 1:
        saved = load_checkpoint(str(tmp_path / "cut" / "checkpoints" / "step-00000004"))[0]
        assert any(k.startswith("RolloutAnchor/") for k in saved["callbacks"]), sorted(saved)
    resumed = _resume_run(base, data, tmp_path / "cut", tmp_path / "resumed.safetensors", *flags)
    assert "resumed from" in resumed.stdout
    full, again = mx.load(str(tmp_path / "full.safetensors")), mx.load(str(tmp_path / "resumed.safetensors"))
    assert full.keys() == again.keys() and any(k.startswith("optimizer.") for k in full)
    different = [k for k in full if not mx.array_equal(full[k], again[k])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"
    full_info = json.loads((tmp_path / "full.safetensors.json").read_text())
    assert json.loads((tmp_path / "resumed.safetensors.json").read_text()) == full_info
