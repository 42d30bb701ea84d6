"""Vision-language LoRA fine-tuning: mlx-train's ``finetune`` against mlx-vlm's own trainer
(``mlx_vlm.trainer.api.Trainer``, what ``python -m mlx_vlm.train`` runs), side by side.

The model is a random Qwen2-VL made offline (tests/scripts/vlm_tiny.py: "tiny", 174 K parameters and 56x56
pictures, or "small", 4.6 M parameters and 224x224 pictures); the data are its coloured squares (16 train
rows, each a picture and "What colour is the square?" / "The square is <colour>.", no text-only row: mlx-vlm
batches rows of one kind together). Both sides: LoRA rank 8, scale 2 (mlx-vlm's alpha 16 / rank 8) on every
linear layer of the language model's blocks, Adam at --lr, batch --batch, --iters steps, every token of a row
trained (mlx-vlm's default; mlx-train's without --mask-prompt), seed 0, no validation during training.

Every run is its own process (so that one run's peak memory cannot mask another's), in alternating order
for --rounds rounds. Both sides report every --report steps (5; each side's report reads the loss, so
the host waits for the device there, as in a real run: reporting every step would keep mlx-train's loop
from preparing the next step while the device computes). Per run: the wall-clock and process-CPU seconds
per step, the median over the report intervals after the first (start-up, model loading and the first
steps' allocations are left out; neither side compiles its step: the model's forward pass reads values to
Python), the peak memory over the training (``mx.get_peak_memory``, reset after the model and the data are
ready) and the process's peak RSS, and the reported losses (each the mean over its --report steps). Keep
--iters a multiple of --report. Printed:

  (a) learning: log p(answer | picture) on the 4 pictures x 4 answers, scored by mlx-vlm itself
      (``mlx_vlm.load(model, adapter_path=...)``, its chat template and processor) for the base and each
      side's adapters of the last round: the mean log p of the right answer, how many pictures get their own
      colour as the likeliest answer, and how many different answers the 4 pictures get (4: the answer
      follows the picture; 1: it ignores it)
  (b) step time ratio mlx-train / mlx-vlm (below 1.0: mlx-train is faster) and peak memory ratio, medians
      over the rounds, with each round's
  (c) the loss curves of the last round, at each report: the mean loss since the last report (mlx-train
      also reports at each epoch's end, every 8 steps here, which restarts its mean; mlx-vlm also trains the
      image-marker targets, which mlx-train leaves out)

    python bench/vlm.py                          # tiny model, 60 steps, 2 rounds
    python bench/vlm.py --rounds 8               # the tiny model's table in docs/benchmarks.md
    python bench/vlm.py --size small --rounds 3
    python bench/vlm.py --size small --iters 200 --lr 5e-4 --rounds 2    # the small model learns the colours
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "scripts")
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
SIDES = ("mlx-train", "mlx-vlm")
RANK, SCALE = 8, 2.0


def peak_rss() -> int:
    """The process's peak resident memory in bytes (Linux reports KiB, macOS bytes)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def run_mlx_train(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from mlx_train.llm.finetune import FineTuneConfig, finetune
    from mlx_train.training import Callback

    stamps, cpu, losses = [], [], []

    class Record(Callback):
        def on_fit_start(self, trainer):
            mx.reset_peak_memory()
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_report(self, trainer, logs):
            if trainer.step % args.report:  # the report at an epoch's end (8 steps here) restarts the window
                return
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            losses.append(float(logs["loss"]))

    config = FineTuneConfig(model=args.model, data=args.data, iters=args.iters, batch_size=args.batch,
                            learning_rate=args.lr, num_layers=-1, seed=0, steps_per_report=args.report,
                            steps_per_eval=10**9, run_dir=os.path.join(args.out, "run"),
                            lora_parameters={"rank": RANK, "scale": SCALE, "dropout": 0.0})
    result = finetune(config, callbacks=[Record()], log=lambda line: None)
    return {"stamps": stamps, "cpu": cpu, "losses": losses, "peak": mx.get_peak_memory(),
            "adapters": result["adapter_path"]}


def run_mlx_vlm(args: argparse.Namespace) -> dict:
    import contextlib
    import io

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_vlm import load
    from mlx_vlm.trainer.api import Trainer
    from mlx_vlm.trainer.common.callbacks import TrainingCallback
    from mlx_vlm.trainer.common.model import prepare_model_for_training
    from mlx_vlm.trainer.datasets.loading import load as load_rows
    from mlx_vlm.trainer.vlm.config import VLMTrainingArgs

    stamps, cpu, losses = [], [], []

    class Record(TrainingCallback):
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            losses.append(float(info["train_loss"]))

    mx.random.seed(0)
    model, processor = load(args.model)
    rows = load_rows(args.data)
    with contextlib.redirect_stdout(io.StringIO()):
        model = prepare_model_for_training(model, lora_rank=RANK, lora_alpha=RANK * SCALE, lora_dropout=0.0)
    adapters = os.path.join(args.out, "adapters")
    os.makedirs(adapters, exist_ok=True)
    settings = VLMTrainingArgs(batch_size=args.batch, iters=args.iters, steps_per_report=args.report,
                               steps_per_eval=None,
                               steps_per_save=10**9, adapter_file=os.path.join(adapters, "adapters.safetensors"))
    trainer = Trainer(model, settings, optimizer=optim.Adam(learning_rate=args.lr), train_dataset=rows["train"],
                      processing_class=processor, training_callback=Record(), seed=0)
    mx.reset_peak_memory()
    stamps.append(time.perf_counter())
    cpu.append(time.process_time())
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.train()
    return {"stamps": stamps, "cpu": cpu, "losses": losses, "peak": mx.get_peak_memory(), "adapters": adapters}


def score(args: argparse.Namespace) -> dict:
    """log p(answer | picture), pictures x answers, by mlx-vlm alone (its load, template, processor, model)."""
    import mlx.core as mx
    import numpy as np
    import vlm_tiny
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(args.model, adapter_path=args.adapters or None)
    model.eval()
    config = vars(model.config)
    colours = list(vlm_tiny.COLOURS)
    table = np.zeros((len(colours), len(colours)))
    for i, picture in enumerate(colours):
        image = [os.path.join(args.data, "images", f"{picture}.png")]
        question = [{"role": "user", "content": vlm_tiny.QUESTION}]
        prompt = apply_chat_template(processor, config, question, add_generation_prompt=True, num_images=1)
        start = prepare_inputs(processor, images=image, prompts=prompt)["input_ids"].shape[1]
        for j, answer in enumerate(colours):
            chat = [*question, {"role": "assistant", "content": f"The square is {answer}."}]
            text = apply_chat_template(processor, config, chat, add_generation_prompt=False, num_images=1)
            inputs = prepare_inputs(processor, images=image, prompts=text)
            ids = inputs["input_ids"]
            for name in ("_position_ids", "_rope_deltas"):  # positions cached by the last call
                if hasattr(model.language_model, name):
                    setattr(model.language_model, name, None)
            logits = model(ids[:, :-1], inputs["pixel_values"], mask=inputs["attention_mask"][:, :-1],
                           image_grid_thw=inputs["image_grid_thw"]).logits.astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logp, ids[:, 1:, None], axis=-1)[0, :, 0]
            table[i, j] = float(picked[start - 1:].sum())  # the answer's tokens (after the prompt)
    return {"table": table.tolist()}


def child(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [SRC, SCRIPTS]
    import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

    work = {"mlx-train": run_mlx_train, "mlx-vlm": run_mlx_vlm, "score": score}[args.child]
    result = work(args)
    result["rss"] = peak_rss()
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)


def launch(args: argparse.Namespace, role: str, out: str, adapters: str | None = None) -> dict:
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--child", role, "--model", args.model, "--data", args.data,
               "--out", out, "--iters", str(args.iters), "--batch", str(args.batch), "--lr", str(args.lr),
               "--report", str(args.report)]
    if adapters:
        command += ["--adapters", adapters]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{role} failed:\n{done.stdout[-4000:]}")
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def per_step(run: dict, key: str, report: int) -> float:
    """Seconds per step: the median over the report intervals after the first (whose first steps allocate;
    a shared machine's load comes in bursts, which the median leaves out and a mean does not)."""
    times = run[key][1:]
    return statistics.median(b - a for a, b in zip(times[:-1], times[1:], strict=True)) / report


def learning_line(name: str, table: list[list[float]]) -> str:
    import numpy as np

    t = np.array(table)
    right = float(np.diag(t).mean())
    wrong = float((t.sum() - np.trace(t)) / (t.size - len(t)))
    best = t.argmax(axis=1)
    return (f"| {name} | {right:.2f} | {wrong:.2f} | {int((best == np.arange(len(t))).sum())}/{len(t)} | "
            f"{len(set(best.tolist()))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--report", type=int, default=5, help="steps between reports (both sides), the timings' "
                        "unit: the first report's steps are left out")
    parser.add_argument("--child", choices=(*SIDES, "score"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [SRC, SCRIPTS]
    import vlm_tiny

    root = tempfile.mkdtemp(prefix="bench-vlm-")
    side = vlm_tiny.SIZES[args.size]["side"]
    args.model = vlm_tiny.write_model_dir(os.path.join(root, "model"), size=args.size)
    args.data = vlm_tiny.write_squares(os.path.join(root, "squares"), text_rows=0, side=side)
    print(f"{args.size} Qwen2-VL, {side}x{side} pictures; LoRA rank {RANK} scale {SCALE}, batch {args.batch}, "
          f"lr {args.lr}, {args.iters} steps, {args.rounds} rounds (timings after step {args.report}); {root}")
    runs: dict[str, list[dict]] = {name: [] for name in SIDES}
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for name in order:
            runs[name].append(launch(args, name, os.path.join(root, f"round{r}", name)))
            last = runs[name][-1]
            print(f"  round {r + 1} {name}: {per_step(last, 'stamps', args.report) * 1e3:.1f} ms/step, "
                  f"{per_step(last, 'cpu', args.report) * 1e3:.1f} ms CPU/step, peak {last['peak'] / 2**20:.1f} MiB, "
                  f"RSS {last['rss'] / 2**20:.0f} MiB, loss {last['losses'][0]:.3f} -> {last['losses'][-1]:.3f}",
                  flush=True)

    print("\n(a) learning: log p(answer | picture), scored by mlx_vlm.load(model, adapter_path=...)\n")
    print("| adapters | log p(right answer) | log p(wrong answer) | pictures answered right | different answers |")
    print("|---|---|---|---|---|")
    tables = {"base (before)": launch(args, "score", os.path.join(root, "score-base"))["table"]}
    for name in SIDES:
        tables[name] = launch(args, "score", os.path.join(root, f"score-{name}"), runs[name][-1]["adapters"])["table"]
    for name, table in tables.items():
        print(learning_line(name, table))

    print("\n(b) mlx-train / mlx-vlm, medians over the rounds (and each round)\n")
    print("| measure | ratio | rounds | mlx-train | mlx-vlm |")
    print("|---|---|---|---|---|")
    measures = {"s/step (wall)": lambda run: per_step(run, "stamps", args.report),
                "CPU s/step": lambda run: per_step(run, "cpu", args.report),
                "peak memory (mx)": lambda run: run["peak"], "peak RSS": lambda run: run["rss"]}
    for label, measure in measures.items():
        ours = [measure(run) for run in runs["mlx-train"]]
        theirs = [measure(run) for run in runs["mlx-vlm"]]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        unit, scale = ("ms", 1e3) if "step" in label else ("MiB", 2**-20)
        print(f"| {label} | **{statistics.median(ratios):.2f}x** | {', '.join(f'{x:.2f}' for x in ratios)} | "
              f"{statistics.median(ours) * scale:.1f} {unit} | {statistics.median(theirs) * scale:.1f} {unit} |")

    print(f"\n(c) training loss of the last round, the mean of the {args.report} steps up to each report (12 "
          "reports at most)\n")
    reports = len(runs["mlx-vlm"][-1]["losses"])
    shown = sorted({round(i * (reports - 1) / 11) for i in range(12)}) if reports > 12 else list(range(reports))
    print("| step | " + " | ".join(str(min(args.iters, (i + 1) * args.report)) for i in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for name in SIDES:
        print(f"| {name} | " + " | ".join(f"{runs[name][-1]['losses'][i]:.3f}" for i in shown) + " |")


if __name__ == "__main__":
    main()
