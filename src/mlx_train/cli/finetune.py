"""Fine-tune a language model (LoRA, DoRA or full) on jsonl data: train's flags, mlx_lm.lora's too.

The configuration is a FinetuneConfig: train's (TrainConfig) with the llm section, on mlx_lm.lora's
defaults (which --help shows): the same flags mean the same
(--batch-size: rows per micro-batch per device, --lr/--learning-rate, --max-steps, --epochs, --seed,
--set KEY=VALUE, -c/--config, --run-dir, --resume, --overwrite), plus one flag per setting of the llm
section (--num-layers, --pack, --train-mode, ...) and mlx_lm.lora's names (--data, --iters,
--steps-per-report, --steps-per-eval, --save-every and --grad-accumulation-steps, counted as
mlx_lm.lora counts them: iterations of --batch-size rows). -c/--config takes mlx_lm.lora's YAML files
as they are. The run directory gets config.yaml, metrics.jsonl, train.log and resumable checkpoints;
--resume continues with the run's saved configuration (changed only where a resume allows), a
--run-dir that holds a run is moved aside first with --overwrite, and --fuse never writes into the
base model's directory. Preference tuning takes --train-mode dpo|orpo|cpo, --beta, --dpo-loss-type,
--reference-model-path, --label-smoothing, --reference-free and --precompute-ref-log-probs.
Adapters are written in mlx-lm's format, with a model card (README.md), so `mlx_lm.generate --model
BASE --adapter-path RUN_DIR/adapters` uses them.

Example::

    from mlx_train.cli.main import main
    main(["finetune", "--model", "base_dir", "--data", "data", "--iters", "100", "--run-dir", "runs/a"])
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from mlx_train.config import mlx_lm

HELP = "fine-tune a language model (LoRA/DoRA/full; train's flags and mlx_lm.lora's)"

_ITERATIONS, _DEFAULTS = mlx_lm.DEFAULT_ITERATIONS, mlx_lm.FINETUNE_DEFAULTS
# The numbers are mlx_lm.lora's defaults as config.mlx_lm declares them (the flags' help shows them too).
EPILOG = f"""examples:
  mlx-train finetune --model SmolLM2-135M-Instruct.Q4_1.gguf --data data/ --iters 200 --num-layers 8
  mlx-train finetune -c lora_config.yaml --pack --run-dir runs/a      # an mlx_lm.lora YAML
  mlx-train finetune --run-dir runs/a --resume --max-steps 400        # continue after a crash, train longer
  mlx-train finetune --model BASE --data prefs/ --train-mode dpo --beta 0.1   # rows: prompt, chosen, rejected

Defaults are mlx_lm.lora's: {_ITERATIONS['iters']} iterations, {_DEFAULTS['optimizer']} at --lr \
{_DEFAULTS['learning_rate']:g}, --batch-size {_DEFAULTS['batch_size']},
a report every {_ITERATIONS['steps_per_report']} iterations, a validation every \
{_ITERATIONS['steps_per_eval']} and a checkpoint every {_ITERATIONS['save_every']}. Without --run-dir
nothing but the adapters is written (in --adapter-path).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``finetune`` flags: train's, one per llm field and mlx_lm.lora's, help and defaults from the
    fields of FinetuneConfig (fine-tuning's defaults)."""
    from mlx_train.cli.flags import ITERATION_FLAGS, add_flags, finetune_flags
    from mlx_train.config import FinetuneConfig
    from mlx_train.config.mlx_lm import ITERATION_KEYS

    parser.add_argument("-c", "--config", metavar="FILE", help="a YAML config: train's layout, or an mlx_lm.lora "
                        "file as it is; flags override it")
    add_flags(parser, finetune_flags(), {"run_dir": "; without it only the adapters are written"}, FinetuneConfig)
    for flag, key in ITERATION_FLAGS.items():
        parser.add_argument(flag, dest=key, type=int, default=None, metavar="N",
                            help=f"mlx_lm.lora's {key}: {ITERATION_KEYS[key]} counted in iterations (micro-batches of "
                            "--batch-size rows); N / --grad-accumulation-steps optimizer steps")
    parser.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
        help="continue the run of --run-dir: 'auto' (the default when bare) takes its newest complete "
        "checkpoint, PATH a given checkpoint directory; the run's saved configuration is used, changed "
        "only by the flags a resume allows")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="start a new run in a --run-dir that holds one: the old run is moved aside to "
        "RUN_DIR.old-<date>-<time> (never deleted); without it such a start is refused")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="set any FinetuneConfig field, e.g. --set weight_decay=0.1, --set ema_decay=0.999; repeatable; "
        "the dedicated flags win")
    parser.add_argument("--fuse", metavar="DIR", help="after training, write the base with the adapters folded "
                        "in as an mlx-lm model directory")
    from mlx_train.launch.train import add_train_arguments

    add_train_arguments(parser)  # --distributed, -n, --hostfile: as train's


def resolve_config(args: argparse.Namespace, log: Any = print) -> Any:
    """The FinetuneConfig of a ``finetune`` command line. Without --resume: mlx_lm.lora's defaults < --config
    < --set < flags. With --resume: the configuration the run saved (its checkpoint's, or config.yaml),
    changed only by the flags given, as ``train --resume`` does.

    Example::

        from mlx_train.cli.main import build_parser
        args = build_parser("finetune").parse_args(["finetune", "--model", "base", "--data", "d", "--iters", "8"])
        resolve_config(args).max_steps      # 8
    """
    from pathlib import Path

    from mlx_train.cli.flags import build_config, resume_config
    from mlx_train.cli.train import saved_config
    from mlx_train.distributed.rank import supervised
    from mlx_train.errors import ConfigError

    for given, flag in ((args.num_processes, "-n"), (args.hostfile, "--hostfile"), (args.strategy, "--strategy")):
        if given is not None and not args.distributed:
            raise ConfigError(f"{flag} {given} only applies to a distributed run: add --distributed "
                              f"(mlx-train finetune --distributed {flag} {given} ...), or leave {flag} out")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts the run over and --resume continues it: give one of them")
    config = build_config(args, finetune=True)
    if args.distributed and not config.run_dir:
        raise ConfigError("finetune --distributed needs --run-dir: the ranks share the run directory's checkpoints")
    if args.distributed and args.fuse:
        raise ConfigError("--fuse cannot go with --distributed: fuse the run's adapters afterwards with "
                          "mlx-train finetune ... --fuse on one process, or mlx_lm.fuse")
    if not args.resume:
        return config
    if not config.run_dir:
        if args.resume == "auto":
            raise ConfigError("--resume continues the run of --run-dir: pass --run-dir RUN_DIR")
        return config  # a checkpoint path: its configuration is the command line's
    run_dir = Path(config.run_dir)
    found = saved_config(run_dir, config.checkpoint_dir, args.resume, required=not supervised(), command="finetune")
    if found is None:  # a supervised group restarted before it saved anything: its --config is the run's
        return config
    config, notes = resume_config(args, found[0], found[1], str(run_dir), finetune=True)
    changed = f", changed: {'; '.join(notes)}" if notes else ""
    log(f"resuming {run_dir} with the configuration of {found[1]}{changed}")
    return config


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train finetune``; prints a summary with the validation perplexity."""
    from mlx_train.cli.train import startup_line
    from mlx_train.distributed.rank import in_group, is_main_process, supervised
    from mlx_train.errors import CheckpointError
    from mlx_train.llm.finetune import check_fuse_target, finetune, fuse_model, resume_checkpoint
    from mlx_train.llm.models import is_quantized
    from mlx_train.run_directory import RunDirectory

    cfg = resolve_config(args)
    if args.fuse:
        check_fuse_target(cfg.model, args.fuse)  # before training: a refused --fuse costs nothing
    if args.resume and not supervised() and resume_checkpoint(cfg, args.resume) is None and \
            not RunDirectory.of(cfg.run_dir, cfg.checkpoint_dir).has_checkpoint_or_config():
        # from Python, "auto" may start a run; here it must continue one: a run stopped before its first checkpoint
        # starts again from its config.yaml (as train's), and a restarted group may have none yet
        raise CheckpointError(f"there is nothing to resume in {cfg.run_dir}: no checkpoint in "
                              f"{cfg.run_dir}/checkpoints; start a new run without --resume")
    if args.distributed:
        return _launch(args, cfg)
    say = print if is_main_process() else (lambda *a, **k: None)
    say(startup_line(), flush=True)
    trainer_class, split = None, None
    if in_group():  # a rank of `finetune --distributed`
        from mlx_train.training import DistributedTrainer

        trainer_class, split = DistributedTrainer, tensor_parallel_split(cfg)
    result = finetune(cfg, resume=args.resume, overwrite=args.overwrite, trainer_class=trainer_class, split=split,
                      log=lambda message: say(message, flush=True))
    if not is_main_process():
        return 0
    lines = result["task"].summary(result)
    lines.append(f"  adapters: {result['adapter_path']} ({result['task'].library} format, model card README.md)")
    library = result["task"].library.replace("-", "_")  # mlx_lm, or mlx_vlm for a vision-language model
    if args.fuse:
        fuse_model(cfg.model, result["adapter_path"], args.fuse, dequantize=not is_quantized(result["model"]))
        lines.append(f"  fused model: {args.fuse} ({library}.load / {library}.generate --model {args.fuse})")
    elif not str(cfg.model).endswith(".gguf"):
        lines.append(f"  try: {library}.generate --model {cfg.model} --adapter-path {result['adapter_path']}")
    else:
        lines.append("  mlx-lm does not read .gguf bases: add --fuse DIR to get a model directory it loads")
    print("\n".join(lines), flush=True)
    return 0 if math.isfinite(result.get("val_loss", 0.0)) else 1


def tensor_parallel_split(config: Any) -> Any:
    """On a rank of a launched group: the ``TensorParallelAdapters`` of a ``distributed_strategy:
    tensor_parallel`` run over the group (None for another strategy, or a group of one)."""
    from mlx_train.distributed.topology import init_group
    from mlx_train.llm.tensor_parallel import finetune_split

    if config.distributed_strategy != "tensor_parallel":
        return None
    return finetune_split(config, init_group(config.distributed_backend))


def _launch(args: argparse.Namespace, config: Any) -> int:
    """``finetune --distributed``: make room in the run directory (or continue it), then run the ranks under
    train's supervisor; each rank runs ``mlx-train finetune --config <the resolved config>``."""
    from mlx_train.launch.train import cluster_for, train_distributed
    from mlx_train.llm.finetune import check_before_loading, check_tensor_parallel
    from mlx_train.run_directory import RunDirectory

    check_before_loading(config, args.resume, args.overwrite, launched=True)
    split = config.replace(distributed_strategy=args.strategy or config.distributed_strategy)
    check_tensor_parallel(split)
    if split.distributed_strategy == "tensor_parallel":  # the heads must split over the ranks: said before launching
        from mlx_train.llm.tensor_parallel import check_process_count

        check_process_count(split, cluster_for(args.num_processes, args.hostfile, config.distributed_backend)
                            .num_processes)
    if not args.resume:
        RunDirectory.of(config.run_dir, config.checkpoint_dir).make_room(args.overwrite, print)
    return train_distributed(args, config, command_name="finetune")
