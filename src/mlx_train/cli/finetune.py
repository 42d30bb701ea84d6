"""Fine-tune a language model (LoRA, DoRA or full) on jsonl data, with mlx_lm.lora's flags.

Flags and YAML keys are mlx_lm.lora's (-c/--config takes its YAML files as they are), plus
--epochs, --pack, --resume, --run-dir, --overwrite, --quantized and --fuse. A --run-dir that
holds a run is continued with --resume auto, or moved aside first with --overwrite; --fuse never
writes into the base model's directory. Preference tuning takes mlx-lm-lora's --train-mode
dpo|orpo|cpo, --beta, --dpo-loss-type and --reference-model-path, and --label-smoothing,
--reference-free and --precompute-ref-log-probs. Adapters are written in mlx-lm's format, with a
model card (README.md), so `mlx_lm.generate --model BASE --adapter-path RUN_DIR/adapters` uses
them. The run directory gets metrics.jsonl, train.log and resumable checkpoints.

Example::

    from mlx_train.cli.main import main
    main(["finetune", "--model", "base_dir", "--data", "data", "--iters", "100", "--run-dir", "runs/a"])
"""

from __future__ import annotations

import argparse
import dataclasses
import math

HELP = "fine-tune a language model (LoRA/DoRA/full; mlx_lm.lora flags)"
EPILOG = """examples:
  mlx-train finetune --model SmolLM2-135M-Instruct.Q4_1.gguf --data data/ --iters 200 --num-layers 8
  mlx-train finetune -c lora_config.yaml --pack --run-dir runs/a      # an mlx_lm.lora YAML
  mlx-train finetune -c lora_config.yaml --run-dir runs/a --resume auto   # continue after a crash
  mlx-train finetune --model BASE --data prefs/ --train-mode dpo --beta 0.1   # rows: prompt, chosen, rejected
"""

# flag -> FineTuneConfig field (help text comes from the field)
FLAGS = {
    "--model": "model", "--data": "data", "--fine-tune-type": "fine_tune_type", "--optimizer": "optimizer",
    "--num-layers": "num_layers", "--batch-size": "batch_size", "--iters": "iters", "--epochs": "epochs",
    "--val-batches": "val_batches", "--learning-rate": "learning_rate", "--steps-per-report": "steps_per_report",
    "--steps-per-eval": "steps_per_eval", "--grad-accumulation-steps": "grad_accumulation_steps",
    "--resume-adapter-file": "resume_adapter_file", "--adapter-path": "adapter_path", "--save-every": "save_every",
    "--test-batches": "test_batches", "--max-seq-length": "max_seq_length", "--seed": "seed",
    "--run-dir": "run_dir", "--resume": "resume", "--report-to": "report_to", "--project-name": "project_name",
    "--run-name": "run_name",
    "--train-mode": "train_mode", "--beta": "beta", "--dpo-loss-type": "dpo_loss_type",
    "--dpo-cpo-loss-type": "dpo_loss_type", "--label-smoothing": "label_smoothing",
    "--reference-model-path": "reference_model_path",
}
SWITCHES = {"--mask-prompt": "mask_prompt", "--test": "test", "--grad-checkpoint": "grad_checkpoint",
            "--pack": "pack", "--quantized": "quantized", "--overwrite": "overwrite",
            "--reference-free": "reference_free", "--precompute-ref-log-probs": "precompute_ref_log_probs"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``finetune`` flags (mlx_lm.lora's names and ours)."""
    from mlx_train.llm.finetune import FineTuneConfig

    fields = {f.name: f for f in dataclasses.fields(FineTuneConfig)}
    parser.add_argument("-c", "--config", metavar="FILE", help="an mlx_lm.lora YAML file; flags override it")
    for flag, name in FLAGS.items():
        f = fields[name]
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, dest=name, type=kind, default=None, metavar=name.upper(),
                            help=f"{f.metadata['help']} (default: {f.default})")
    for flag, name in SWITCHES.items():
        parser.add_argument(flag, dest=name, action="store_true", default=None, help=fields[name].metadata["help"])
    parser.add_argument("--fuse", metavar="DIR", help="after training, write the base with the adapters folded "
                        "in as an mlx-lm model directory")


def build_config(args: argparse.Namespace):
    """The FineTuneConfig of a command line: defaults, then --config, then the flags."""
    from mlx_train.llm.finetune import FineTuneConfig

    cfg = FineTuneConfig.from_yaml(args.config) if args.config else FineTuneConfig()
    given = {name: getattr(args, name) for name in [*FLAGS.values(), *SWITCHES.values()]
             if getattr(args, name, None) is not None}
    return dataclasses.replace(cfg, **given)


def _check_fuse_target(model: str | None, fuse: str) -> None:
    """Refuse a --fuse directory that is, or is inside, the base model's directory: the fused weights would
    replace the base ones, whose sha256 the run's checkpoints pin, so the run could never be resumed."""
    import os

    from mlx_train.errors import ConfigError

    if not model or not os.path.exists(model):  # a Hugging Face repo id: mlx-lm's cache, not a place we write
        return
    base = os.path.realpath(model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model)))
    target = os.path.realpath(fuse)
    if target == base or target.startswith(base + os.sep):
        raise ConfigError(f"--fuse {fuse} is inside the base model's directory {base}: the fused weights would "
                          "overwrite the base that the run's checkpoints were trained on; give --fuse a new directory")


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train finetune``; prints a summary with the validation perplexity."""
    from mlx_train.errors import CheckpointError
    from mlx_train.llm.finetune import finetune, fuse_model, resume_checkpoint
    from mlx_train.llm.models import is_quantized

    cfg = build_config(args)
    if args.fuse:
        _check_fuse_target(cfg.model, args.fuse)
    if cfg.resume and resume_checkpoint(cfg) is None:  # from Python, "auto" may start a run; here it must continue one
        raise CheckpointError(f"there is nothing to resume in {cfg.run_dir}: no checkpoint in "
                              f"{cfg.path_in_run('checkpoints')}; start a new run without --resume")
    result = finetune(cfg)
    trainer = result["trainer"]
    unit = "trained tokens" if cfg.train_mode == "sft" else "preference pairs"
    name = "finetune" if cfg.train_mode == "sft" else f"finetune {cfg.train_mode}"
    lines = [f"{name}: {trainer.step} steps, {result['trained_tokens']:,} {unit}"]
    if result.get("tokens_per_second"):
        lines[0] += f", {result['tokens_per_second']:.1f} trained tokens/s"
    if "val_perplexity" in result:
        lines.append(f"  validation: loss {result['val_loss']:.4f}, perplexity {result['val_perplexity']:.3f}")
    elif "val_loss" in result:
        val = result["val_metrics"]
        lines.append(f"  validation: loss {val['loss']:.4f}, reward accuracy {val['reward_accuracy']:.3f}, "
                     f"reward margin {val['reward_margin']:.4f}, rewards chosen {val['rewards_chosen']:.4f} / "
                     f"rejected {val['rewards_rejected']:.4f}")
    if "test_perplexity" in result:
        lines.append(f"  test: loss {result['test_loss']:.4f}, perplexity {result['test_perplexity']:.3f}")
    lines.append(f"  adapters: {result['adapter_path']} (mlx-lm format, model card README.md)")
    if args.fuse:
        fuse_model(cfg.model, result["adapter_path"], args.fuse, dequantize=not is_quantized(result["model"]))
        lines.append(f"  fused model: {args.fuse} (mlx_lm.load / mlx_lm.generate --model {args.fuse})")
    elif not str(cfg.model).endswith(".gguf"):
        lines.append(f"  try: mlx_lm.generate --model {cfg.model} --adapter-path {result['adapter_path']}")
    else:
        lines.append("  mlx-lm does not read .gguf bases: add --fuse DIR to get a model directory it loads")
    print("\n".join(lines), flush=True)
    return 0 if math.isfinite(result.get("val_loss", 0.0)) else 1
