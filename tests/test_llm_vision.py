"""Fine-tuning a vision-language model (mlx-vlm's Qwen2-VL, tiny and random, made offline) on rows with
images: the model is recognised before it loads, images reach the loss, the loss masks are the chat
masks', training lowers the held-out loss of the answers, the adapters load in ``mlx_vlm.load``, and a
killed run resumes bit for bit. Also the errors: mlx-vlm missing, image rows for a text-only model."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx_vlm")  # CI has it (the dev extra); a local install without the vlm extra skips
os.environ["HF_HUB_OFFLINE"] = "1"  # the processor loaders look names up on the Hub otherwise
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
import vlm_tiny  # noqa: E402

import mlx_train  # noqa: E402, F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402

from mlx_train.errors import ConfigError, DataError  # noqa: E402
from mlx_train.llm.chat_masks import Supervision  # noqa: E402
from mlx_train.llm.data import Records, collate, load_records  # noqa: E402
from mlx_train.llm.finetune import FineTuneConfig, finetune  # noqa: E402
from mlx_train.llm.tasks import VisionPreference, VisionSFT, task_for  # noqa: E402
from mlx_train.llm.vision.data import ImageChatRows, ImagePairRows  # noqa: E402
from mlx_train.llm.vision.loss import vision_lm_loss  # noqa: E402
from mlx_train.llm.vision.models import vision_model_type  # noqa: E402

RESUME_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "llm_resume_run.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, squares data directory, model, processor)."""
    import mlx_vlm

    root = tmp_path_factory.mktemp("vlm")
    base = vlm_tiny.write_model_dir(str(root / "qwen2-vl"))
    data = vlm_tiny.write_squares(str(root / "squares"))
    model, processor = mlx_vlm.load(base)
    return base, data, model, processor


ANSWERS = Supervision(assistant_only_loss=True)


def _rows(tiny, records, supervision=ANSWERS):
    _, data, model, processor = tiny
    return ImageChatRows(Records(records, os.path.join(data, "valid.jsonl")), processor, vars(model.config),
                         supervision)


def _batch(rows, indices=None):
    return {k: mx.array(v) for k, v in collate([rows[i] for i in (indices or range(len(rows)))]).items()}


def _config(tiny, tmp_path, **values):
    base, data = tiny[:2]
    settings = {"model": base, "data": data, "iters": 4, "num_layers": 2, "batch_size": 2, "learning_rate": 5e-4,
                "steps_per_report": 2, "steps_per_eval": 100, "run_dir": str(tmp_path / "run"), **values}
    return FineTuneConfig(**settings)


def test_a_vision_language_model_is_recognised_and_gets_the_vision_task(tiny, tmp_path):
    base = tiny[0]
    assert vision_model_type(base) == "qwen2_vl"
    llm_tiny.write_model_dir(str(tmp_path / "text"))
    assert vision_model_type(str(tmp_path / "text")) is None
    task = task_for(_config(tiny, tmp_path))
    assert isinstance(task, VisionSFT) and task.model_type == "qwen2_vl"
    with pytest.raises(ConfigError, match="--train-mode grpo is not supported for vision-language models"):
        task_for(_config(tiny, tmp_path, train_mode="grpo", beta=0.0, max_seq_length=2048))
    assert isinstance(task_for(_config(tiny, tmp_path, train_mode="dpo")), VisionPreference)
    with pytest.raises(ConfigError, match="--reference-model-path is not supported for vision-language models"):
        task_for(_config(tiny, tmp_path, train_mode="dpo", reference_model_path=base))
    with pytest.raises(ConfigError, match="--train-vision with --train-mode dpo"):
        task_for(_config(tiny, tmp_path, train_mode="dpo", train_vision=True))
    assert isinstance(task_for(_config(tiny, tmp_path, train_mode="orpo", train_vision=True)), VisionPreference)
    with pytest.raises(ConfigError, match="rows with images are not packed"):
        task_for(_config(tiny, tmp_path, pack=True))
    with pytest.raises(ConfigError, match="--fine-tune-type full with --train-mode dpo"):
        task_for(_config(tiny, tmp_path, train_mode="dpo", fine_tune_type="full"))
    assert isinstance(task_for(_config(tiny, tmp_path, train_mode="orpo", fine_tune_type="full")), VisionPreference)
    with pytest.raises(ConfigError, match="quantized True: full fine-tuning trains float weights"):
        task_for(_config(tiny, tmp_path, fine_tune_type="full", quantized=True))


def test_without_mlx_vlm_a_vision_model_is_refused_before_loading(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # what `import mlx_vlm` meets when it is not installed
    with pytest.raises(ConfigError, match=r"needs mlx-vlm.*pip install 'mlx-train\[vlm\]'"):
        finetune(_config(tiny, tmp_path))
    assert not os.path.exists(tmp_path / "run" / "adapters")


def test_image_rows_for_a_text_model_name_file_and_line(tiny, tmp_path, capsys):
    text_model, data = str(tmp_path / "text"), str(tmp_path / "data")
    llm_tiny.write_model_dir(text_model)
    llm_tiny.write_data(data, "chat", n_train=4, n_valid=2)
    with open(os.path.join(data, "train.jsonl"), "a") as f:
        f.write(json.dumps(vlm_tiny.square_row("red")) + "\n")  # line 5
    cfg = FineTuneConfig(model=text_model, data=data, iters=2, num_layers=2, batch_size=1)
    with pytest.raises(DataError, match=r"train\.jsonl:5: this row has images, but .* is a text-only model"):
        finetune(cfg)
    from mlx_train.cli.main import main

    code = main(["finetune", "--model", text_model, "--data", data, "--iters", "2", "--num-layers", "2"])
    err = capsys.readouterr().err
    assert code == 3 and "train.jsonl:5: this row has images" in err and "Traceback" not in err


def test_masks_train_the_answers_and_never_the_image_tokens(tiny):
    processor = tiny[3]
    chat = {"messages": [{"role": "user", "content": "Describe the picture."},
                         {"role": "assistant", "content": "Be brief."},
                         {"role": "user", "content": vlm_tiny.QUESTION},
                         {"role": "assistant", "content": "The square is red."}], "images": ["images/red.png"]}
    image_token = tiny[2].config.image_token_id

    def trained(supervision):
        rows = _rows(tiny, [chat], supervision)
        row = rows.rows[0]
        assert (row.tokens == image_token).sum() == 4  # one 56x56 picture: 4 image tokens
        assert not row.mask[row.tokens == image_token].any()
        return processor.tokenizer.decode(row.tokens[row.mask.astype(bool)].tolist())

    assert trained(Supervision(assistant_only_loss=True)) == "Be brief.<|im_end|>The square is red.<|im_end|>"
    assert trained(Supervision(mask_prompt=True)) == "The square is red.<|im_end|>\n"


def test_the_images_reach_the_loss(tiny):
    red, blue = _rows(tiny, [vlm_tiny.square_row("red"), vlm_tiny.square_row("red", "images/blue.png")]).samples()
    assert red["pixel_values"].shape == (16, 1176) and red["image_grid_thw"].tolist() == [[1, 4, 4]]
    model = tiny[2]
    losses = [vision_lm_loss(model, {k: mx.array(v)[None] for k, v in row.items()})[0].item() for row in (red, blue)]
    assert abs(losses[0] - losses[1]) > 1e-3, losses  # the same text, another picture: another loss


def test_a_batch_of_rows_equals_the_rows_alone(tiny):
    """Padding (tokens on the right, patches per row) changes nothing, and a text row after an image row
    gets its own positions (the model's cached ones are cleared)."""
    text = {"messages": [{"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "Two plus two is four."}]}
    rows = _rows(tiny, [vlm_tiny.square_row("green"), text, vlm_tiny.square_row("yellow")])
    model = tiny[2]
    alone = []
    for i in range(len(rows)):
        loss, n = vision_lm_loss(model, _batch(rows, [i]))
        alone.append((loss * n).item())
    together, n = vision_lm_loss(model, _batch(rows))
    assert np.isclose((together * n).item(), sum(alone), rtol=1e-5)
    vision_lm_loss(model, _batch(rows, [0]))  # an image row, then the text row again
    again, m = vision_lm_loss(model, _batch(rows, [1]))
    assert np.isclose((again * m).item(), alone[1], rtol=1e-6)


def test_training_lowers_the_held_out_answer_loss_and_the_adapters_load_in_mlx_vlm(tiny, tmp_path):
    import mlx_vlm

    base, data, model, processor = tiny
    held_out = _rows(tiny, [vlm_tiny.square_row(c) for c in vlm_tiny.COLOURS])
    before = vision_lm_loss(model, _batch(held_out))[0].item()
    logs = []
    result = finetune(_config(tiny, tmp_path, iters=12, assistant_only_loss=True, test=True), log=logs.append)
    assert any(line.startswith("compile: off for this qwen2_vl model") for line in logs)
    assert result["trainer"].config.compile is False
    trained = result["model"]
    trained.eval()
    after = vision_lm_loss(trained, _batch(held_out))[0].item()
    assert after < before - 1.0, (before, after)
    assert np.isclose(result["test_loss"], result["val_loss"], rtol=1e-5)  # the squares' test split is valid's

    adapters = result["adapter_path"]
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        keys = json.load(f)["lora_parameters"]["keys"]
    assert "language_model.model.layers.1.self_attn.q_proj" in keys and len(keys) == 14
    with open(os.path.join(adapters, "README.md")) as f:
        assert f'load("{base}", adapter_path=' in f.read()  # the card's usage is mlx-vlm's
    loaded, _ = mlx_vlm.load(base, adapter_path=adapters)
    assert np.isclose(vision_lm_loss(loaded, _batch(held_out))[0].item(), after, rtol=1e-5)
    assert np.isclose(result["val_loss"], vision_lm_loss(loaded, _batch(_rows(
        tiny, load_records(data)["valid"])))[0].item(), rtol=1e-5)


def test_dora_adapters_load_in_mlx_vlm(tiny, tmp_path):
    import mlx_vlm

    result = finetune(_config(tiny, tmp_path, fine_tune_type="dora", assistant_only_loss=True))
    held_out = _rows(tiny, [vlm_tiny.square_row(c) for c in vlm_tiny.COLOURS])
    result["model"].eval()
    loaded, _ = mlx_vlm.load(tiny[0], adapter_path=result["adapter_path"])
    trained = vision_lm_loss(result["model"], _batch(held_out))[0].item()
    assert np.isclose(vision_lm_loss(loaded, _batch(held_out))[0].item(), trained, rtol=1e-5)
    assert not np.isclose(vision_lm_loss(tiny[2], _batch(held_out))[0].item(), trained, rtol=1e-3)


def _logits(model, batch):
    from mlx_train.llm.vision.loss import image_inputs
    from mlx_train.llm.vision.models import reset_position_caches

    images = image_inputs(batch)
    reset_position_caches(model)
    output = model(batch["inputs"], images.pop("pixel_values", None), mask=batch["attention_mask"], **images)
    return output.logits.astype(mx.float32)


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_fuse_writes_a_model_that_mlx_vlm_loads_and_generates_from(tiny, tmp_path, capsys, method):
    """``finetune --fuse DIR`` on a vision-language model: mlx_vlm.load(DIR) gives the logits of the base with
    the adapters (LoRA or DoRA; to float tolerance) or with the full fine-tuning's weights, and generates from a
    picture."""
    import mlx_vlm

    from mlx_train.cli.main import main

    base, data = tiny[:2]
    run, fused = tmp_path / "run", str(tmp_path / "fused")
    code = main(["finetune", "--model", base, "--data", data, "--iters", "6", "--num-layers", "2", "--batch-size", "2",
                 "--learning-rate", "5e-3", "--fine-tune-type", method, "--run-dir", str(run), "--fuse", fused])
    out = capsys.readouterr().out
    assert code == 0 and f"fused model: {fused} (mlx_vlm.load" in out, out[-2000:]
    assert f"adapters: {run / 'adapters'} (mlx-vlm format" in out
    assert os.path.isfile(os.path.join(fused, "preprocessor_config.json"))
    card = open(os.path.join(fused, "README.md")).read()  # the adapters' card, for the fused model
    assert 'model, processor = load("path/to/this/directory")' in card and "adapter_path" not in card
    batch = _batch(_rows(tiny, [vlm_tiny.square_row(c) for c in vlm_tiny.COLOURS]))
    with_adapters, _ = mlx_vlm.load(base, adapter_path=str(run / "adapters"))
    model, processor = mlx_vlm.load(fused)
    assert not any("lora" in name for name, _ in tree_flatten(model.parameters()))
    expected, got = _logits(with_adapters, batch), _logits(model, batch)
    assert float(mx.abs(got - expected).max()) < 1e-4
    assert float(mx.abs(_logits(tiny[2], batch) - expected).max()) > 1e-2  # the adapters changed something
    prompt = mlx_vlm.prompt_utils.apply_chat_template(processor, vars(model.config), vlm_tiny.QUESTION, num_images=1)
    reply = mlx_vlm.generate(model, processor, prompt, image=[os.path.join(data, "images", "red.png")], max_tokens=4,
                             verbose=False)
    assert reply.generation_tokens > 0


def _direct_logp(model, processor, row, reply, data):
    """log p(reply | picture, question) of one sequence alone (no batch, no padding), through mlx-vlm's prompt
    and processor functions."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    from mlx_train.llm.vision.models import reset_position_caches

    config, image = vars(model.config), [os.path.join(data, row["images"][0])]
    question = [{"role": "user", "content": row["prompt"]}]
    prompt = apply_chat_template(processor, config, question, add_generation_prompt=True, num_images=1)
    start = prepare_inputs(processor, images=image, prompts=prompt)["input_ids"].shape[1]
    text = apply_chat_template(processor, config, [*question, {"role": "assistant", "content": reply}],
                               add_generation_prompt=False, num_images=1)
    inputs = prepare_inputs(processor, images=image, prompts=text)
    ids = inputs["input_ids"]
    reset_position_caches(model)
    logits = model(ids[:, :-1], inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
    logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    return mx.take_along_axis(logp, ids[:, 1:, None], axis=-1)[0, start - 1:, 0].sum()


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_preference_loss_and_gradients_equal_a_direct_computation(tiny, tmp_path, method):
    """A batch of image pairs (padded, pictures shown to both replies, DPO's reference the adapters off) gives
    the loss and the gradients of the formula computed on each sequence alone, the reference on a separate
    copy of the base."""
    import mlx_vlm

    from mlx_train.llm.adapters import AdapterConfig, apply_adapters
    from mlx_train.llm.preference import PreferenceConfig
    from mlx_train.llm.vision.loss import VisionPreferenceLoss

    base, _, reference, processor = tiny
    data = vlm_tiny.write_square_pairs(str(tmp_path / "pairs"))
    rows = [vlm_tiny.square_pair("red", "blue"), vlm_tiny.square_pair("green", "yellow"),
            {**vlm_tiny.square_pair("blue", "red"), "rejected": "The square is red, I think, or maybe not."}]
    pairs = ImagePairRows(Records(rows, os.path.join(data, "train.jsonl")), processor, vars(reference.config))
    # mlx-vlm's other layout: whole conversations, no prompt; the same pairs
    whole = [{"images": r["images"], **{side: [{"role": "user", "content": r["prompt"]},
                                              {"role": "assistant", "content": r[side]}]
                                        for side in ("chosen", "rejected")}} for r in rows]
    again = ImagePairRows(Records(whole, os.path.join(data, "train.jsonl")), processor, vars(reference.config))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(pairs.samples(), again.samples(), strict=True) for k in a)
    whole[1]["rejected"][0]["content"] = "Another question?"
    with pytest.raises(DataError, match=r"record 2: the row has no \"prompt\", and its \"chosen\" and \"rejected\""):
        ImagePairRows(Records(whole, os.path.join(data, "train.jsonl")), processor, vars(reference.config))
    model, _ = mlx_vlm.load(base)
    mx.random.seed(1)
    apply_adapters(model, AdapterConfig("lora", num_layers=2, rank=4, scale=2.0))
    model.update(tree_map_with_path(lambda k, v: mx.random.normal(v.shape) * 0.05 if "lora_b" in k else v,
                                    model.trainable_parameters()))
    model.train()
    beta = 0.1
    loss_fn = VisionPreferenceLoss(PreferenceConfig(method, beta=beta))
    batch = {k: mx.array(v) for k, v in collate(pairs.samples()).items()}

    def batched(m):
        return loss_fn(m, batch)[0]

    def direct(m):
        losses = []
        for row in rows:
            chosen, rejected = (_direct_logp(m, processor, row, row[side], data) for side in ("chosen", "rejected"))
            if method == "dpo":
                ref = [_direct_logp(reference, processor, row, row[side], data) for side in ("chosen", "rejected")]
                losses.append(-nn.log_sigmoid(beta * ((chosen - rejected) - (ref[0] - ref[1]))))
            else:
                n = [len(processor.tokenizer.encode(row[side] + "<|im_end|>\n")) for side in ("chosen", "rejected")]
                c, r = chosen / n[0], rejected / n[1]
                log_odds = (c - r) - (mx.log(-mx.expm1(c)) - mx.log(-mx.expm1(r)))
                losses.append(-c - beta * nn.log_sigmoid(log_odds))
        return mx.stack(losses).mean()

    value, grads = nn.value_and_grad(model, batched)(model)
    expected, expected_grads = nn.value_and_grad(model, direct)(model)
    assert np.isclose(value.item(), expected.item(), rtol=1e-5), (value.item(), expected.item())
    flat, want = dict(tree_flatten(grads)), dict(tree_flatten(expected_grads))
    assert flat.keys() == want.keys() and len(flat) == 28  # lora_a, lora_b of 7 layers x 2 blocks
    worst = max(float(mx.abs(flat[k] - want[k]).max() / (mx.abs(want[k]).max() + 1e-12)) for k in flat)
    assert worst < 1e-4, worst
    assert max(float(mx.abs(g).max()) for g in flat.values()) > 1e-4  # the gradients are not all zero


def test_a_short_dpo_run_lowers_the_held_out_loss_and_its_adapters_load_in_mlx_vlm(tiny, tmp_path):
    import mlx_vlm

    from mlx_train.llm.preference import PreferenceConfig
    from mlx_train.llm.vision.loss import VisionPreferenceLoss

    data = vlm_tiny.write_square_pairs(str(tmp_path / "pairs"))
    logs = []
    result = finetune(_config(tiny, tmp_path, data=data, train_mode="dpo", iters=10, learning_rate=5e-3, beta=0.1,
                              steps_per_eval=5), log=logs.append)
    assert isinstance(result["task"], VisionPreference) and result["trained_pairs"] == 20
    assert any(line.startswith("train: 8 preference pairs (8 with images)") for line in logs)
    # before training the adapters add nothing: the policy is its reference, and the loss log 2 = 0.693
    assert result["val_loss"] < np.log(2) - 0.1 and result["val_metrics"]["reward_margin"] > 0.1, result["val_metrics"]
    loaded, processor = mlx_vlm.load(tiny[0], adapter_path=result["adapter_path"])
    pairs = ImagePairRows(load_records(data)["valid"], processor, vars(loaded.config))
    batch = {k: mx.array(v) for k, v in collate(pairs.samples()).items()}
    score = VisionPreferenceLoss(PreferenceConfig("orpo"))  # (no reference: the metrics of the model alone)
    trained, reloaded = score(result["model"], batch)[2], score(loaded, batch)[2]
    for name in ("logps_chosen", "logps_rejected"):
        assert np.isclose(reloaded[name].item(), trained[name].item(), rtol=1e-5)


def _answer_logprobs(model, tiny):
    """log p(answer | picture) for each picture (rows) and each colour's answer (columns)."""
    colours = list(vlm_tiny.COLOURS)
    rows = _rows(tiny, [vlm_tiny.square_row(answer, f"images/{picture}.png") for picture in colours
                        for answer in colours])
    scores = []
    for i in range(len(rows)):
        loss, n = vision_lm_loss(model, _batch(rows, [i]))
        scores.append(-(loss * n).item())
    return np.array(scores).reshape(len(colours), len(colours))


@pytest.mark.slow
def test_training_learns_the_colour_from_the_picture(tiny, tmp_path):
    """60 steps: for every held-out picture the right colour's answer is the likeliest (only the picture
    tells which it is); the random model before training has no such preference."""
    before = _answer_logprobs(tiny[2], tiny)
    result = finetune(_config(tiny, tmp_path, iters=60, assistant_only_loss=True))
    result["model"].eval()
    after = _answer_logprobs(result["model"], tiny)
    assert (after.argmax(axis=1) == np.arange(4)).all(), after
    assert np.diag(after).mean() > np.diag(before).mean() + 20, (np.diag(before), np.diag(after))
    wrong = (after.sum() - np.trace(after)) / 12
    assert np.diag(after).mean() > wrong + 3, after


def test_accumulation_equals_the_whole_batch(tiny, tmp_path):
    def trained(**values):
        result = finetune(_config(tiny, tmp_path / str(len(values)), **{"num_layers": 1, **values}))
        return dict(tree_flatten(result["model"].trainable_parameters()))

    whole = trained(batch_size=4, iters=4)
    parts = trained(batch_size=2, grad_accumulation_steps=2, iters=8)  # mlx_lm.lora's iterations: 8 x 2 rows
    worst = max(float(mx.abs(whole[k] - parts[k]).max()) for k in whole)
    assert worst < 1e-5, worst


def test_recomputing_the_language_blocks_changes_no_number(tiny, tmp_path):
    plain = finetune(_config(tiny, tmp_path / "plain", gradient_checkpointing=False))
    again = finetune(_config(tiny, tmp_path / "again", gradient_checkpointing=True))
    assert again["trainer"].config.checkpoint_modules == ["language_model.model.layers"]
    assert again["val_loss"] == plain["val_loss"]


def _resume_run(base, data, run_dir, out, *extra):
    return subprocess.run([sys.executable, RESUME_SCRIPT, base, data, str(run_dir), str(out), *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["float", "qlora", "dpo", "full"])
def test_sigkill_then_resume_is_bit_exact(tiny, tmp_path, kind):
    base, data = tiny[:2]
    extra: tuple = ("--train-mode", "vision")
    if kind == "full":  # full fine-tuning: the language blocks' own weights and their Adam moments
        extra = (*extra, "--fine-tune-type", "full")
    if kind == "qlora":  # QLoRA: the language model in 4 bits, kept so
        base, extra = vlm_tiny.write_model_dir(str(tmp_path / "q4"), bits=4), (*extra, "--quantized")
    if kind == "dpo":  # preference pairs with pictures
        data, extra = vlm_tiny.write_square_pairs(str(tmp_path / "pairs")), ("--train-mode", "vision-dpo")
    full = _resume_run(base, data, tmp_path / "full", tmp_path / "full.safetensors", *extra)
    assert full.returncode == 0, full.stdout[-3000:]
    killed = _resume_run(base, data, tmp_path / "cut", tmp_path / "unused.safetensors", "--kill-at", "3", *extra)
    assert killed.returncode == -9, killed.stdout[-3000:]
    resumed = _resume_run(base, data, tmp_path / "cut", tmp_path / "resumed.safetensors", *extra)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    a, b = mx.load(str(tmp_path / "full.safetensors")), mx.load(str(tmp_path / "resumed.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    different = [k for k in a if not mx.array_equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"
    assert json.loads((tmp_path / "full.safetensors.json").read_text()) == \
        json.loads((tmp_path / "resumed.safetensors.json").read_text())


def test_qlora_trains_on_a_quantized_language_model(tiny, tmp_path):
    """A base whose language model is quantized (4 bits) stays so with ``quantized``: LoRA trains on top, the
    held-out loss falls, and the adapters load in mlx-vlm over the same quantized base."""
    import mlx_vlm

    from mlx_train.llm.models import is_quantized

    base = vlm_tiny.write_model_dir(str(tmp_path / "q4"), bits=4)
    quantized, _ = mlx_vlm.load(base)
    held_out = _batch(_rows(tiny, [vlm_tiny.square_row(c) for c in vlm_tiny.COLOURS]))
    before = vision_lm_loss(quantized, held_out)[0].item()
    result = finetune(_config(tiny, tmp_path, model=base, quantized=True, iters=8, learning_rate=5e-3,
                              assistant_only_loss=True))
    model = result["model"]
    assert is_quantized(model) and not is_quantized(model.vision_tower)
    model.eval()
    after = vision_lm_loss(model, held_out)[0].item()
    assert after < before - 1.0, (before, after)
    loaded, _ = mlx_vlm.load(base, adapter_path=result["adapter_path"])
    assert np.isclose(vision_lm_loss(loaded, held_out)[0].item(), after, rtol=1e-5)


def _vision_weights(model):
    return dict(tree_flatten(model.vision_tower.parameters()))


@pytest.mark.parametrize("train_vision", [False, True])
def test_full_fine_tuning_trains_the_language_blocks_and_loads_in_mlx_vlm(tiny, tmp_path, train_vision):
    """``fine_tune_type: full``: the last ``num_layers`` blocks of the language model train (the vision tower
    too with ``train_vision``, nothing else), the held-out loss falls, and the adapter directory holds every
    weight, which ``mlx_vlm.load(base, adapter_path=...)`` loads as the whole model: its logits are the trained
    model's."""
    import mlx_vlm

    base, _, base_model, _ = tiny
    held_out = _batch(_rows(tiny, [vlm_tiny.square_row(c) for c in vlm_tiny.COLOURS]))
    before = vision_lm_loss(base_model, held_out)[0].item()
    logs = []
    result = finetune(_config(tiny, tmp_path, iters=8, learning_rate=2e-3, fine_tune_type="full",
                              assistant_only_loss=True, train_vision=train_vision), log=logs.append)
    model = result["model"]
    model.eval()
    after = vision_lm_loss(model, held_out)[0].item()
    assert after < before - 1.0, (before, after)
    assert any(line.startswith("full: training ") for line in logs)
    trained, original = dict(tree_flatten(model.parameters())), dict(tree_flatten(base_model.parameters()))
    changed = {k for k in trained if not mx.array_equal(trained[k], original[k])}
    blocks = ("language_model.model.layers.0.", "language_model.model.layers.1.")  # the tiny model's 2 blocks
    assert {k for k in trained if k.startswith(blocks) and k.endswith("proj.weight")} <= changed
    assert "language_model.model.embed_tokens.weight" not in changed
    tower = {k for k in changed if k.startswith("vision_tower.")}
    assert changed == {k for k in trained if k.startswith(blocks)} | tower
    assert bool(tower) == train_vision and (not train_vision or "vision_tower.merger.mlp.0.weight" in tower)

    adapters = result["adapter_path"]
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        facts = json.load(f)
    assert facts["fine_tune_type"] == "full" and facts["lora_parameters"] is None
    assert mx.load(os.path.join(adapters, "adapters.safetensors")).keys() == trained.keys()
    loaded, _ = mlx_vlm.load(base, adapter_path=adapters)
    assert mx.array_equal(_logits(loaded, held_out), _logits(model, held_out))


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_tower_trains_only_when_asked(tiny, tmp_path, train_vision):
    """``train_vision`` (mlx-vlm's --train-vision): the vision tower and its projector (Qwen2-VL's merger) train
    with the adapters, are saved with them and load with them in mlx-vlm; the language model's own weights stay.
    Without it the tower does not change."""
    import mlx_vlm

    base_model = tiny[2]
    result = finetune(_config(tiny, tmp_path, iters=3, learning_rate=5e-3, train_vision=train_vision))
    model = result["model"]
    tower, before = _vision_weights(model), _vision_weights(base_model)
    changed = sorted(k for k in tower if not mx.array_equal(tower[k], before[k]))
    trainable = dict(tree_flatten(model.trainable_parameters()))
    language = {k.replace(".linear.", "."): v for k, v in tree_flatten(model.language_model.parameters())
                if "lora_" not in k}
    assert all(mx.array_equal(v, dict(tree_flatten(base_model.language_model.parameters()))[k])
               for k, v in language.items())
    with open(os.path.join(result["adapter_path"], "adapter_config.json")) as f:
        facts = json.load(f)
    if not train_vision:
        assert not changed and not any(k.startswith("vision_tower") for k in trainable)
        assert "train_vision" not in facts
        return
    assert "merger.mlp.0.weight" in changed and "blocks.0.attn.qkv.weight" in changed
    assert len(changed) > 0.9 * len(tower), (len(changed), len(tower))
    assert facts["train_vision"] is True
    loaded, _ = mlx_vlm.load(tiny[0], adapter_path=result["adapter_path"])
    assert all(mx.array_equal(_vision_weights(loaded)[k], tower[k]) for k in tower)


def test_full_fine_tuning_of_a_quantized_base_trains_and_writes_float_weights(tiny, tmp_path):
    """A 4-bit base is dequantized for full fine-tuning (as mlx-vlm's full training): its weights load over
    the quantized base in mlx-vlm, and the fused folder is a float model (its config without quantization)."""
    import mlx_vlm

    from mlx_train.llm.finetune import fuse_model
    from mlx_train.llm.models import is_quantized

    base = vlm_tiny.write_model_dir(str(tmp_path / "q4"), bits=4)
    config = _config(tiny, tmp_path, model=base, iters=2, fine_tune_type="full")
    # a GPU keeps a quantized base quantized by default (QLoRA): not for full fine-tuning
    assert not is_quantized(task_for(config).load_model(True, False, lambda line: None)[0])
    result = finetune(config, log=lambda line: None)
    trained = dict(tree_flatten(result["model"].parameters()))
    assert not is_quantized(result["model"])
    loaded, _ = mlx_vlm.load(base, adapter_path=result["adapter_path"])
    fused = fuse_model(base, result["adapter_path"], str(tmp_path / "fused"), dequantize=True)
    with open(os.path.join(fused, "config.json")) as f:
        assert "quantization" not in json.load(f)
    for model in (loaded, mlx_vlm.load(fused)[0]):
        weights = dict(tree_flatten(model.parameters()))
        assert weights.keys() == trained.keys() and all(mx.array_equal(weights[k], trained[k]) for k in trained)


def test_train_vision_is_refused_for_a_text_model(tmp_path):
    llm_tiny.write_model_dir(str(tmp_path / "text"))
    with pytest.raises(ConfigError, match="--train-vision trains the vision tower of a vision-language model"):
        task_for(FineTuneConfig(model=str(tmp_path / "text"), data=str(tmp_path), train_vision=True))


def _assert_close_and_trained(got, expected, tolerance):
    """Adapters equal to ``tolerance`` relative to each tensor's largest value, and trained (no lora_b at 0)."""
    assert got.keys() == expected.keys()
    worst = max(float(mx.abs(got[k] - expected[k]).max() / mx.abs(expected[k]).max()) for k in expected)
    assert worst < tolerance, worst
    assert all(float(mx.abs(v).max()) > 0 for k, v in expected.items() if k.endswith("lora_b"))


def test_an_out_of_memory_step_splits_image_rows_and_trains_what_the_whole_batch_trains(tiny, tmp_path):
    """Step 2 runs out of memory: it is redone as two micro-batches of 2 rows (tokens and pictures cut along
    the rows), and the run ends with the unsplit run's adapters to float rounding."""
    from mlx_train.testing import SimulatedOutOfMemory

    def run(name, callbacks):
        result = finetune(_config(tiny, tmp_path / name, iters=3, batch_size=4, num_layers=1,
                                  assistant_only_loss=True), callbacks=callbacks, log=lambda line: None)
        return dict(tree_flatten(result["model"].trainable_parameters())), result["trainer"]

    simulated = SimulatedOutOfMemory(steps=[2])
    split, trainer = run("split", [simulated])
    whole, _ = run("whole", [])
    assert simulated.failures == [2] and trainer.memory_guard.events[0]["step"] == 2
    _assert_close_and_trained(split, whole, 1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_ranks_train_what_one_process_trains_with_accumulation(tiny, tmp_path):
    """2 ranks launched for real on 127.0.0.1 with 2 rows each per step (pictures and text rows), against one
    process taking the same 4 rows a step as 2 micro-batches of 2: the ranks end with identical adapters, the
    one process's to float rounding (3.2e-5 relative measured after 3 Adam steps at 3e-3: the gradients are
    summed in another order, and Adam's division by the root of the second moment magnifies a rounding
    difference where a gradient is small)."""
    import shutil

    base, data = tiny[:2]
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))
    scripts = os.path.join(os.path.dirname(__file__), "scripts")
    launcher = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, scripts, os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, os.path.join(scripts, "vlm_dp_run.py"), base, data]
    for name, launch in (("one", []), ("two", [launcher, "-n", "2", "--"])):
        ran = subprocess.run([*launch, *script, str(tmp_path / name), str(tmp_path / name)], env=env, timeout=600,
                             capture_output=True, text=True)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    rank0, rank1, one = (mx.load(str(tmp_path / f"{name}.safetensors")) for name in ("two.rank0", "two.rank1",
                                                                                     "one.rank0"))
    assert rank0.keys() == rank1.keys() == one.keys() and len(one) == 28
    assert all(mx.array_equal(rank0[k], rank1[k]) for k in rank0)
    _assert_close_and_trained(rank0, one, 1e-4)


def test_qwen2_5_vl_trains_too(tmp_path):
    base = vlm_tiny.write_model_dir(str(tmp_path / "qwen2.5-vl"), model_type="qwen2_5_vl")
    data = vlm_tiny.write_squares(str(tmp_path / "squares"), n_train=4, n_valid=2, text_rows=0)
    result = finetune(FineTuneConfig(model=base, data=data, iters=2, num_layers=2, batch_size=2,
                                     run_dir=str(tmp_path / "run")))
    assert isinstance(result["task"], VisionSFT) and result["task"].model_type == "qwen2_5_vl"
    assert np.isfinite(result["val_loss"])
