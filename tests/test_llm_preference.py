"""Preference tuning (DPO, IPO, hinge, ORPO) on the Trainer: the loss and its gradient against a
hand-written reference, a gradient for every trained parameter, learning an obvious preference,
metrics in reports, accumulation by pairs, out-of-memory splitting, bad rows, exact resume, the
CLI and the model card."""

import json
import math
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

from mlx_train.errors import ConfigError, DataError  # noqa: E402
from mlx_train.llm import FineTuneConfig, finetune  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.llm.data import collate, make_loader  # noqa: E402
from mlx_train.llm.preference import (  # noqa: E402
    PairDataset,
    PreferenceConfig,
    PreferenceLoss,
    encode_pair,
    reference_logps,
    sequence_logps,
)
from mlx_train.testing import SimulatedOutOfMemory  # noqa: E402
from mlx_train.training import Trainer  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "llm_resume_run.py")
WORDS = ["cat", "dog", "sea", "sun", "tree", "rain", "gold", "road"]


def pair_rows(n, start=0):
    """Prompts from SENTENCES; the chosen reply always starts "Yes," and the rejected one "No,"."""
    rows = []
    for i in range(start, start + n):
        word = WORDS[i % len(WORDS)]
        row = {"prompt": llm_tiny.SENTENCES[i % len(llm_tiny.SENTENCES)], "chosen": f"Yes, the {word}.",
               "rejected": f"No, the {word}."}
        if i % 3 == 0:
            row["system"] = "Be brief."
        rows.append(row)
    return rows


def write_pairs(directory, n_train=8, n_valid=4, rows=None):
    os.makedirs(directory, exist_ok=True)
    for split, n, start in (("train", n_train, 0), ("valid", n_valid, 100)):
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            for row in (rows if rows is not None and split == "train" else pair_rows(n, start)):
                f.write(json.dumps(row) + "\n")
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    llm_tiny.write_model_dir(str(root / "base"), seed=3)
    write_pairs(str(root / "data"))
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return llm_tiny.make_tokenizer()


def _lora_model(tokenizer, kind="lora", seed=3):
    """The tiny base with adapters whose lora_b is random (so the adapters change the output, and
    every adapter matrix has a gradient)."""
    model, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=seed)
    apply_adapters(model, AdapterConfig(kind, num_layers=2, rank=4, scale=2.0))
    mx.random.seed(7)
    model.update({k: v for k, v in _nested_random(model).items()})
    return model


def _nested_random(model):
    from mlx.utils import tree_unflatten

    flat = [(k, 0.1 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.trainable_parameters())
            if k.endswith("lora_b")]
    return tree_unflatten(flat)


def _batch(rows):
    return {k: mx.array(v) for k, v in collate(rows).items()}


def _reply_logp(model, tokens, prompt_length):
    """log p(reply | prompt): one sequence, no padding, written out token by token."""
    logits = model(mx.array([tokens[:-1]]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logprobs[j, tokens[j + 1]] for j in range(prompt_length - 1, len(tokens) - 1))


def _hand_dpo(model, base, encoded, beta, loss_type, smoothing):
    losses = []
    for chosen, rejected, n in encoded:
        pc, pr = _reply_logp(model, chosen, n), _reply_logp(model, rejected, n)
        rc, rr = mx.stop_gradient(_reply_logp(base, chosen, n)), mx.stop_gradient(_reply_logp(base, rejected, n))
        if loss_type == "ipo":  # IPO compares per-token means
            lc, lr = len(chosen) - n, len(rejected) - n
            pc, pr, rc, rr = pc / lc, pr / lr, rc / lc, rr / lr
        h = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses.append(-(1 - smoothing) * mx.log(mx.sigmoid(beta * h)) - smoothing * mx.log(mx.sigmoid(-beta * h)))
        elif loss_type == "hinge":
            losses.append(mx.maximum(1 - beta * h, 0.0))
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("compiled", [False, True])
def test_reply_log_probabilities_and_their_gradient_equal_cross_entropy_bit_for_bit(compiled):
    # sequence_logps has its own backward pass (one logits-sized array); it must give exactly what
    # autodiff of nn.losses.cross_entropy gives, compiled or not, with and without an `after` array
    mx.random.seed(0)
    model = nn.Linear(8, 11)
    hidden = mx.random.normal((4, 5, 8)) * 3
    targets = mx.random.randint(0, 11, (4, 5))
    mask = (mx.arange(5) >= mx.array([[1], [2], [0], [4]])).astype(mx.int32)
    batch = {"chosen_inputs": hidden[:2], "rejected_inputs": hidden[2:], "chosen_targets": targets[:2],
             "rejected_targets": targets[2:], "chosen_mask": mask[:2], "rejected_mask": mask[2:]}
    weights = mx.array([1.0, -2.0, 0.5, 3.0])
    mx.eval(model, hidden, targets, mask)

    def ours(linear):
        logps, _ = sequence_logps(linear, batch, after=mx.ones(2))
        return (logps * weights).sum()

    def autodiff(linear):
        token = -nn.losses.cross_entropy(linear(hidden), targets) * mask.astype(mx.float32)
        return (token.sum(axis=-1) * weights).sum()

    params = model.parameters()

    def value_and_grads(fn):
        def loss(p):
            model.update(p)
            return fn(model)

        value_and_grad = mx.value_and_grad(loss)
        value, grads = (mx.compile(value_and_grad) if compiled else value_and_grad)(params)
        mx.eval(value, grads)
        return value, dict(tree_flatten(grads))

    (v_ours, g_ours), (v_auto, g_auto) = value_and_grads(ours), value_and_grads(autodiff)
    assert v_ours.item() == v_auto.item()
    for name in g_auto:
        assert mx.array_equal(g_ours[name], g_auto[name]).item(), name


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)])
def test_dpo_loss_and_gradient_equal_a_hand_written_reference(tokenizer, loss_type, smoothing):
    model = _lora_model(tokenizer)
    base, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)  # the same weights, no adapters
    rows = pair_rows(3)
    encoded = [encode_pair(r, tokenizer) for r in rows]
    pairs = PairDataset.from_records(rows, tokenizer, 128, [f"row {i}" for i in range(3)])
    batch = _batch(pairs.samples())
    loss = PreferenceLoss(PreferenceConfig("dpo", beta=0.7, loss_type=loss_type, label_smoothing=smoothing))

    value, grads = nn.value_and_grad(model, lambda m: loss(m, batch)[0])(model)
    expected, expected_grads = nn.value_and_grad(
        model, lambda m: _hand_dpo(m, base, encoded, 0.7, loss_type, smoothing))(model)
    assert loss(model, batch)[1].item() == 3  # items are pairs
    np.testing.assert_allclose(value.item(), expected.item(), rtol=1e-5)
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(expected_grads))
    assert got.keys() == want.keys() and len(got) == 2 * 2 * 7
    for key in got:
        np.testing.assert_allclose(np.array(got[key]), np.array(want[key]), rtol=2e-4, atol=1e-6, err_msg=key)
    assert max(float(mx.abs(g).max()) for g in got.values()) > 1e-4


def test_metrics_are_rewards_of_the_reply_log_probabilities(tokenizer):
    model = _lora_model(tokenizer)
    base, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)
    rows = pair_rows(2)
    pairs = PairDataset.from_records(rows, tokenizer, 128, ["a", "b"])
    _, _, metrics = PreferenceLoss(PreferenceConfig("dpo", beta=0.5))(model, _batch(pairs.samples()))
    rewards = []
    for chosen, rejected, n in (encode_pair(r, tokenizer) for r in rows):
        rewards.append([0.5 * (_reply_logp(model, t, n) - _reply_logp(base, t, n)).item() for t in (chosen, rejected)])
    rewards = np.array(rewards)
    np.testing.assert_allclose(metrics["rewards_chosen"].item(), rewards[:, 0].mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["rewards_rejected"].item(), rewards[:, 1].mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["reward_margin"].item(), (rewards[:, 0] - rewards[:, 1]).mean(), rtol=1e-4,
                               atol=1e-6)
    assert metrics["reward_accuracy"].item() == (rewards[:, 0] > rewards[:, 1]).mean()


def test_the_reference_uses_no_second_copy_and_the_stored_reference_matches_it(tokenizer):
    model = _lora_model(tokenizer)
    base, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)
    pairs = PairDataset.from_records(pair_rows(4), tokenizer, 128, list("abcd"))
    stored = pairs.with_reference(reference_logps(base, pairs, batch_size=3))
    loss = PreferenceLoss(PreferenceConfig("dpo"))
    swapped = loss(model, _batch(pairs.samples()))
    from_data = loss(model, _batch(stored.samples()))
    np.testing.assert_allclose(swapped[0].item(), from_data[0].item(), rtol=1e-5)
    # the adapters are back after the reference pass
    assert all("lora_a" in k or "lora_b" in k for k, _ in tree_flatten(model.trainable_parameters()))
    free = PreferenceLoss(PreferenceConfig("dpo", reference_free=True))(model, _batch(pairs.samples()))
    assert abs(free[0].item() - swapped[0].item()) > 1e-3


def _one_step_changes(model, loss, pairs):
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    trainer = Trainer(model, optim.Adam(1e-3), loss_fn=loss, batch_size=4, max_steps=1, num_workers=0,
                      report_every="1000 steps")
    trainer.train(train_dataset=make_loader(pairs, 4, seed=0, num_workers=0))
    after = dict(tree_flatten(model.trainable_parameters()))
    return [k for k in before if np.array_equal(before[k], np.array(after[k]))], len(before)


@pytest.mark.parametrize("method,loss_type,kind", [
    ("dpo", "sigmoid", "lora"), ("dpo", "ipo", "lora"), ("dpo", "hinge", "lora"), ("orpo", "sigmoid", "lora"),
    ("cpo", "sigmoid", "lora"), ("dpo", "sigmoid", "dora"), ("dpo", "sigmoid", "full"), ("orpo", "sigmoid", "full"),
])
def test_every_trained_parameter_moves_on_the_first_step(tokenizer, method, loss_type, kind):
    pairs = PairDataset.from_records(pair_rows(4), tokenizer, 128, list("abcd"))
    if kind == "full":
        model, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)
        apply_adapters(model, AdapterConfig("full", num_layers=1))
        pairs = pairs.with_reference(reference_logps(model, pairs))
    else:
        model = _lora_model(tokenizer, kind)
    frozen, total = _one_step_changes(model, PreferenceLoss(PreferenceConfig(method, loss_type=loss_type)), pairs)
    assert total >= 9 and not frozen, f"{len(frozen)} of {total} parameters had no gradient, e.g. {frozen[:3]}"


def test_cpo_is_the_reference_free_dpo_loss_as_in_mlx_lm_lora(tokenizer):
    model = _lora_model(tokenizer)
    batch = _batch(PairDataset.from_records(pair_rows(3), tokenizer, 128, list("abc")).samples())
    for loss_type in ("sigmoid", "ipo"):
        cpo = PreferenceLoss(PreferenceConfig("cpo", beta=0.3, loss_type=loss_type))(model, batch)
        free = PreferenceLoss(PreferenceConfig("dpo", beta=0.3, loss_type=loss_type, reference_free=True))(model, batch)
        assert cpo[0].item() == free[0].item() and cpo[2]["reward_margin"].item() == free[2]["reward_margin"].item()
    dpo = PreferenceLoss(PreferenceConfig("dpo", beta=0.3, loss_type="ipo"))(model, batch)
    assert abs(dpo[0].item() - cpo[0].item()) > 1e-4  # the reference matters for DPO


def test_full_fine_tuning_without_a_stored_reference_is_refused(tokenizer):
    model, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)
    pairs = PairDataset.from_records(pair_rows(2), tokenizer, 128, ["a", "b"])
    with pytest.raises(ConfigError, match="has no LoRA/DoRA layers"):
        PreferenceLoss(PreferenceConfig("dpo"))(model, _batch(pairs.samples()))


def _config(setup, run_dir, **overrides):
    values = dict(model=str(setup / "base"), data=str(setup / "data"), train_mode="dpo", iters=4, batch_size=4,
                  num_layers=2, learning_rate=1e-2, max_seq_length=128, steps_per_report=1, steps_per_eval=2,
                  val_batches=-1, run_dir=str(run_dir), lora_parameters={"rank": 4, "scale": 10.0, "dropout": 0.0})
    values.update(overrides)
    return FineTuneConfig(**values)


def _max_rel_err(a, b):
    """The largest difference of a tensor relative to that tensor's largest value (as in test_oom)."""
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in b)


def _adapters(result):
    return {k: np.array(v) for k, v in tree_flatten(result["model"].trainable_parameters())}


def test_dpo_learns_an_obvious_preference_that_mlx_lm_sees(setup, tmp_path, tokenizer):
    import mlx_lm

    result = finetune(_config(setup, tmp_path / "run", iters=24, beta=0.5, steps_per_eval=8))
    assert result["val_metrics"]["reward_accuracy"] == 1.0
    assert result["val_metrics"]["reward_margin"] > 0
    val = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    reports = [r for r in val if "reward_accuracy" in r]
    assert reports and {"rewards_chosen", "rewards_rejected", "reward_margin", "logps_chosen",
                        "logps_rejected"} <= set(reports[-1])
    assert reports[-1]["reward_accuracy"] == 1.0
    assert any("val_reward_accuracy" in r for r in val)
    from rich.console import Console

    from mlx_train.monitor.dashboard import render
    from mlx_train.monitor.run import RunReader

    console = Console(record=True, width=140)
    console.print(render(RunReader(tmp_path / "run").read(), width=140))
    screen = console.export_text()
    assert screen.count("reward accuracy") >= 2 and "val reward accuracy" in screen  # train and validation rows

    def gap(model):  # log p(chosen) - log p(rejected) over the validation pairs
        total = 0.0
        for row in pair_rows(4, 100):
            chosen, rejected, n = encode_pair(row, tokenizer)
            total += (_reply_logp(model, chosen, n) - _reply_logp(model, rejected, n)).item()
        return total

    tuned, _ = mlx_lm.load(str(setup / "base"), adapter_path=str(tmp_path / "run" / "adapters"))
    base, _ = mlx_lm.load(str(setup / "base"))
    assert gap(tuned) > gap(base) + 1.0


def test_accumulation_counts_pairs(setup, tmp_path):
    # SGD: the parameters follow the gradients linearly (Adam's first steps amplify rounding near zero)
    whole = _adapters(finetune(_config(setup, tmp_path / "a", iters=2, steps_per_eval=100, optimizer="sgd",
                                       learning_rate=0.5)))
    # mlx_lm.lora's counting: 4 iterations of 2 rows, an update every 2 = the same 2 updates of 4 rows
    halves = _adapters(finetune(_config(setup, tmp_path / "b", iters=4, steps_per_eval=100, optimizer="sgd",
                                        learning_rate=0.5, batch_size=2, grad_accumulation_steps=2)))
    assert whole.keys() == halves.keys()
    assert _max_rel_err(halves, whole) < 1e-5


def test_a_precomputed_reference_trains_like_the_in_step_one(setup, tmp_path, capsys):
    sgd = {"iters": 2, "steps_per_eval": 100, "optimizer": "sgd", "learning_rate": 0.5}
    in_step = finetune(_config(setup, tmp_path / "a", **sgd))
    stored = finetune(_config(setup, tmp_path / "b", precompute_ref_log_probs=True, **sgd))
    out = capsys.readouterr().out
    assert "computing reference log-probabilities with the model with its adapters off" in out
    assert stored["trainer"]._loaders[0].dataset.reference is not None
    assert in_step["trainer"]._loaders[0].dataset.reference is None
    assert _max_rel_err(_adapters(stored), _adapters(in_step)) < 1e-5
    assert stored["val_loss"] == pytest.approx(in_step["val_loss"], rel=1e-5)


def test_a_reference_model_path_is_scored_once_and_the_test_split_reports_rewards(setup, tmp_path, capsys):
    data = write_pairs(str(tmp_path / "data"))
    with open(os.path.join(data, "test.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in pair_rows(4, 200))
    other = tmp_path / "other"
    llm_tiny.write_model_dir(str(other), seed=11)
    result = finetune(_config(setup, tmp_path / "run", data=data, iters=1, reference_model_path=str(other),
                              test=True))
    assert f"computing reference log-probabilities with {other}" in capsys.readouterr().out
    rows = result["trainer"]._loaders[0].dataset
    base, _ = llm_tiny.make_model(len(llm_tiny.make_tokenizer()._tokenizer), seed=11)
    np.testing.assert_allclose(rows.reference, reference_logps(base, rows), rtol=1e-5)
    assert {"loss", "reward_accuracy", "reward_margin"} <= set(result["test_metrics"])
    assert len(result["history"]["train_reward_margin"]) == 1  # the epoch the run stopped in (1 of 2 steps)


def test_the_precomputed_reference_is_the_model_with_its_adapters_off(setup, tokenizer):
    from mlx_train.llm.preference import build_splits

    model = _lora_model(tokenizer)  # adapters that change the output (as after --resume-adapter-file)
    base, _ = llm_tiny.make_model(len(tokenizer._tokenizer), seed=3)
    splits = build_splits(_config(setup, "unused", precompute_ref_log_probs=True), model, tokenizer, log=lambda m: None)
    np.testing.assert_allclose(splits["train"].reference, reference_logps(base, splits["train"]), rtol=1e-5)
    assert not np.allclose(splits["train"].reference, reference_logps(model, splits["train"]), rtol=1e-3)


def test_out_of_memory_halves_the_batch_with_pairs_whole(setup, tmp_path):
    simulated = SimulatedOutOfMemory(steps=[2])
    # weight_decay as this test was written with (finetune's sgd now takes mlx's default, 0)
    sgd = {"iters": 3, "steps_per_eval": 100, "optimizer": "sgd", "learning_rate": 0.5,
           "optimizer_config": {"sgd": {"weight_decay": 0.01}}}
    recovered = finetune(_config(setup, tmp_path / "a", **sgd), callbacks=[simulated])
    assert simulated.failures == [2] and recovered["trainer"].memory_guard.accumulation == 2
    # the recovered run's settings from the start: 2 micro-batches of 2 pairs per step (6 iterations = 3 steps)
    reference = finetune(_config(setup, tmp_path / "b", **{**sgd, "iters": 6, "batch_size": 2,
                                                          "grad_accumulation_steps": 2}))
    # float rounding only, amplified by three SGD steps at learning rate 0.5: a matrix product's rows
    # round differently with the number of rows (whole batch vs halves), here ~1e-5 to 2e-5
    assert _max_rel_err(_adapters(recovered), _adapters(reference)) < 5e-5


@pytest.mark.parametrize("row,message", [
    ({"prompt": "Hi", "rejected": "no"},
     r"train.jsonl:3: the row has no \"chosen\" reply .*\"prompt\": ..., \"chosen\""),
    ({"prompt": "Hi", "chosen": "  ", "rejected": "no"}, r"train.jsonl:3: the \"chosen\" reply is empty; give it text"),
    ({"chosen": "yes", "rejected": "no"}, r"train.jsonl:3: the row has no \"prompt\""),
    ({"prompt": "Hi", "chosen": "yes " * 200, "rejected": "no"},
     r"train.jsonl:3: prompt and chosen reply are \d+ tokens, more than max_seq_length=128; raise --max-seq-length"),
    ({"prompt": "Hi", "chosen": 3, "rejected": "no"}, r"train.jsonl:3: \"chosen\" must be a string, a message"),
])
def test_bad_rows_name_the_file_line_and_fix(setup, tmp_path, row, message):
    rows = pair_rows(2) + [row] + pair_rows(2)
    data = write_pairs(str(tmp_path / "data"), rows=rows)
    with pytest.raises(DataError, match=message):
        finetune(_config(setup, tmp_path / "run", data=data))


def test_packing_and_unknown_settings_are_refused(setup, tmp_path):
    with pytest.raises(ConfigError, match="--pack does not apply to --train-mode dpo"):
        finetune(_config(setup, tmp_path / "a", pack=True))
    # the settings themselves are checked when the config is made, before any model is loaded
    with pytest.raises(ConfigError, match="dpo_loss_type must be one of sigmoid, hinge, ipo, got 'dpop'"):
        _config(setup, tmp_path / "b", dpo_loss_type="dpop")
    with pytest.raises(ConfigError, match="train_mode must be one of sft, dpo, orpo, cpo, grpo, got 'ppo'"):
        _config(setup, tmp_path / "c", train_mode="ppo")
    with pytest.raises(ConfigError, match="label_smoothing applies to the DPO sigmoid loss only"):
        _config(setup, tmp_path / "d", dpo_loss_type="ipo", label_smoothing=0.1)


def test_chat_rows_are_scored_on_the_reply_only(tokenizer):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "chosen": [{"role": "assistant", "content": "four"}], "rejected": {"role": "assistant", "content": "five"}}
    chosen, rejected, n = encode_pair(row, tokenizer)
    assert tokenizer.decode(chosen[n:]) == "four<|im_end|>\n" and tokenizer.decode(rejected[n:]) == "five<|im_end|>\n"
    sample = PairDataset.from_records([row], tokenizer, 64, ["x"])[0]
    # target j is token j + 1: exactly the reply's tokens count
    assert sample["chosen_mask"].tolist() == [int(j + 1 >= n) for j in range(len(chosen) - 1)]
    assert tokenizer.decode(list(sample["chosen_targets"][sample["chosen_mask"] == 1])) == "four<|im_end|>\n"
    same = encode_pair({"prompt": "2+2?", "system": "Be brief.", "chosen": "four", "rejected": "five"}, tokenizer)
    assert same == (chosen, rejected, n)


def test_full_fine_tuning_stores_the_reference_once(setup, tmp_path, capsys):
    result = finetune(_config(setup, tmp_path / "run", fine_tune_type="full", num_layers=1, iters=2,
                              learning_rate=1e-3))
    assert "computing reference log-probabilities with the base model" in capsys.readouterr().out
    assert math.isfinite(result["val_loss"])
    rows = result["trainer"]._loaders[0].dataset
    assert rows.reference is not None and rows.reference.shape == (8, 2)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(setup, tmp_path):
    base, data = str(setup / "base"), str(setup / "data")

    def run(run_dir, out, *extra, check=True):
        proc = subprocess.run([sys.executable, SCRIPT, base, data, str(run_dir), str(out), "--train-mode", "dpo",
                               *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
        if check:
            assert proc.returncode == 0, proc.stdout[-3000:]
        return proc

    run(tmp_path / "full", tmp_path / "full.safetensors")
    killed = run(tmp_path / "cut", tmp_path / "unused.safetensors", "--kill-at", "5", check=False)
    assert killed.returncode == -9, killed.stdout[-3000:]
    resumed = run(tmp_path / "cut", tmp_path / "resumed.safetensors")
    assert "resumed from" in resumed.stdout
    full, again = mx.load(str(tmp_path / "full.safetensors")), mx.load(str(tmp_path / "resumed.safetensors"))
    assert full.keys() == again.keys() and any(k.startswith("optimizer.") for k in full)
    different = [k for k in full if not mx.array_equal(full[k], again[k])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"
    assert json.loads((tmp_path / "resumed.safetensors.json").read_text()) == \
        json.loads((tmp_path / "full.safetensors.json").read_text())


@pytest.mark.slow
def test_cli_dpo_end_to_end_with_yaml_aliases_card_and_fuse(setup, tmp_path, capsys):
    import mlx_lm

    from mlx_train.cli.main import main

    config = {"model": str(setup / "base"), "data": str(setup / "data"), "train_mode": "dpo", "beta": 0.5,
              "dpo_cpo_loss_type": "ipo", "iters": 3, "batch_size": 4, "num_layers": 2, "learning_rate": 1e-2,
              "max_seq_length": 128, "steps_per_eval": 3, "val_batches": -1,
              "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}}
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(config))
    run, fused = tmp_path / "run", tmp_path / "fused"
    code = main(["finetune", "-c", str(tmp_path / "dpo.yaml"), "--train-mode", "dpo", "--beta", "0.25",
                 "--run-dir", str(run), "--fuse", str(fused)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "finetune dpo: 3 steps," in out and "validation: loss" in out and "reward accuracy" in out
    adapter_config = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert adapter_config["train_mode"] == "dpo" and adapter_config["dpo_loss_type"] == "ipo"
    assert adapter_config["beta"] == 0.25
    for directory, fused_card in ((run / "adapters", False), (fused, True)):
        text = (directory / "README.md").read_text()
        front = yaml.safe_load(text.split("---")[1])
        assert front["library_name"] == "mlx" and front["base_model"] == "base"
        assert {"mlx", "lora", "dpo"} <= set(front["tags"]) and ("fused" in front["tags"]) == fused_card
        assert f"`{setup / 'base'}`" in text and f"`{setup / 'data'}`" in text
        assert "| beta | `0.25` |" in text and "| dpo_loss_type | `ipo` |" in text
        assert "| learning_rate | `0.01` |" in text and "| steps | 3 |" in text
        facts = json.loads((directory / "model_card.json").read_text())
        assert f"| val_reward_accuracy | {facts['metrics']['val_reward_accuracy']} |" in text
    final = [json.loads(line) for line in open(run / "metrics.jsonl") if "val_reward_accuracy" in line][-1]
    assert facts["metrics"]["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    mlx_lm.load(str(fused))
    # the same settings as flags; an alias flag; a bad value is one clear line
    code = main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--train-mode", "orpo",
                 "--iters", "1", "--num-layers", "1", "--max-seq-length", "128", "--adapter-path",
                 str(tmp_path / "orpo")])
    assert code == 0 and "finetune orpo: 1 steps" in capsys.readouterr().out
    code = main(["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--train-mode", "dpo",
                 "--dpo-cpo-loss-type", "dpop", "--iters", "1"])
    assert code == 2 and "dpo_loss_type must be one of sigmoid, hinge, ipo, got 'dpop'" in capsys.readouterr().err


def test_a_loss_can_report_extra_metrics_weighted_by_its_items():
    """The Trainer feature the preference metrics ride on: ``(loss, n_items, {name: mean})``."""
    x = mx.array(np.random.default_rng(0).normal(size=(6, 2)).astype(np.float32))
    y = mx.array(np.random.default_rng(1).normal(size=(6, 1)).astype(np.float32))

    def loss_fn(model, batch):
        inputs, targets = batch
        error = model(inputs) - targets
        return (error ** 2).mean(), inputs.shape[0], {"abs_error": mx.abs(error).mean()}

    class Reports:
        logs = []

        def on_report(self, trainer, logs):
            self.logs.append(logs)

    mx.random.seed(0)
    model = nn.Linear(2, 1)
    expected = float(mx.abs(model(x) - y).mean())  # learning rate 0: the model stays as it is
    trainer = Trainer(model, optim.SGD(0.0), loss_fn=loss_fn, batch_size=3, gradient_accumulation=2, shuffle=False,
                      report_every="1 steps", num_workers=0)
    history = trainer.train(train_dataset=(x, y), val_dataset=(x, y), epochs=1, callbacks=[Reports()])
    assert Reports.logs[-1]["abs_error"] == pytest.approx(expected, rel=1e-6)
    assert history["train_abs_error"][-1] == pytest.approx(expected, rel=1e-6)
    assert history["val_abs_error"][-1] == pytest.approx(expected, rel=1e-6)
    # 5 samples in evaluation batches of 3 and 2: the mean is over samples, not over batches
    assert trainer.evaluate((x[:5], y[:5]))["abs_error"] == pytest.approx(float(mx.abs(model(x[:5]) - y[:5]).mean()),
                                                                          rel=1e-6)


def test_pairs_whose_chosen_reply_is_the_rejected_one_are_counted(setup, tmp_path, capsys):
    """DPO on pairs with chosen == rejected trains at a constant 0.6931: all of them is refused, some a warning
    with the count and the file:line of the first."""
    from mlx_train.cli.main import main

    same = [{"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["chosen"]} for row in pair_rows(4)]
    data = write_pairs(str(tmp_path / "same"), rows=same)
    flags = ["--model", str(setup / "base"), "--train-mode", "dpo", "--iters", "1", "--num-layers", "1",
             "--batch-size", "2"]
    assert main(["finetune", "--data", data, *flags, "--run-dir", str(tmp_path / "r1")]) == 3
    err = capsys.readouterr().err
    assert f"{data}/train.jsonl:1: in all 4 training pairs the chosen reply is the rejected one" in err
    assert "0.6931" in err and "Traceback" not in err and not (tmp_path / "r1").exists()
    some = pair_rows(4)
    some[2]["rejected"] = some[2]["chosen"]
    data = write_pairs(str(tmp_path / "some"), rows=some)
    with pytest.warns(UserWarning, match=f"{data}/train.jsonl:3: 1 of the 4 train pairs have a chosen reply equal "
                                         "to the rejected one"):
        assert main(["finetune", "--data", data, *flags, "--run-dir", str(tmp_path / "r2")]) == 0
