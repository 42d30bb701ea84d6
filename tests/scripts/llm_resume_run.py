"""A fine-tuning run for the exact-resume tests, checkpoints every 2 steps. ``--train-mode sft``
(the default): LoRA with dropout, packing, prompt masking, shuffled token-length buckets;
``--train-mode dpo``: DPO pairs with LoRA dropout, shuffled buckets and gradient accumulation;
``--train-mode grpo``: GRPO prompts (rewards from grpo_rewards.py) with the same;
``--train-mode vision``: SFT of a vision-language model (rows with images) with LoRA dropout, gradient
accumulation, clipping and a warmup + cosine schedule; ``--train-mode vision-dpo``: DPO of one on pairs with
pictures, with gradient accumulation.

    python llm_resume_run.py BASE_DIR DATA_DIR RUN_DIR OUT.safetensors [--kill-at STEP] [--train-mode dpo]
        [--quantized] [--num-iterations N]

--kill-at sends SIGKILL to the process itself after that optimizer step (no warning, no cleanup).
OUT holds the trained parameters and the optimizer state (``optimizer.*``); OUT.json the step,
history and validation loss.
"""

import argparse
import json
import os
import signal

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train.llm import FineTuneConfig, finetune
from mlx_train.training import Callback

SETTINGS = {
    "sft": {"iters": 9, "batch_size": 2, "max_seq_length": 200, "pack": True, "mask_prompt": True},
    "dpo": {"iters": 14, "batch_size": 2, "grad_accumulation_steps": 2, "max_seq_length": 128,
            "train_mode": "dpo", "beta": 0.5},
    "grpo": {"iters": 14, "batch_size": 2, "grad_accumulation_steps": 2, "max_seq_length": 128, "train_mode": "grpo",
             "beta": 0.05, "group_size": 3, "max_completion_length": 10,
             "reward_functions": "grpo_rewards:letter_share,grpo_rewards:says_answer"},
    # a vision-language model (BASE from vlm_tiny.py): rows with images, accumulation, clipping, a schedule
    "vision": {"iters": 16, "batch_size": 2, "grad_accumulation_steps": 2, "max_seq_length": 200,
               "assistant_only_loss": True, "max_grad_norm": 1.0,
               "lr_schedule": {"name": "cosine_decay", "warmup": 2, "arguments": [3e-3, 8, 1e-4]}},
    # DPO of a vision-language model on preference pairs with pictures (DATA from vlm_tiny.write_square_pairs)
    "vision-dpo": {"iters": 12, "batch_size": 2, "grad_accumulation_steps": 2, "max_seq_length": 200,
                   "train_mode": "dpo", "beta": 0.5},
}


class KillAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    for name in ("base", "data", "run_dir", "out"):
        parser.add_argument(name)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--train-mode", choices=sorted(SETTINGS), default="sft")
    parser.add_argument("--fine-tune-type", default="lora")
    parser.add_argument("--quantized", action="store_true", help="keep a quantized base quantized (QLoRA)")
    parser.add_argument("--num-iterations", type=int, default=1, help="GRPO: optimizer steps per rollout batch")
    args = parser.parse_args()
    extra = {"num_iterations": args.num_iterations} if args.num_iterations > 1 else {}
    cfg = FineTuneConfig(model=args.base, data=args.data, run_dir=args.run_dir, num_layers=2,
                         learning_rate=3e-3, fine_tune_type=args.fine_tune_type,
                         lora_parameters={"rank": 4, "scale": 10.0, "dropout": 0.1},
                         steps_per_report=2, steps_per_eval=3, save_every=2, val_batches=2,
                         quantized=args.quantized or None, **SETTINGS[args.train_mode], **extra)
    result = finetune(cfg, callbacks=[KillAt(args.kill_at)] if args.kill_at else [], resume="auto")
    trainer = result["trainer"]
    arrays = dict(tree_flatten(result["model"].trainable_parameters()))
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(trainer.optimizer.state)})
    mx.save_safetensors(args.out, arrays)
    with open(args.out + ".json", "w") as f:
        json.dump({"step": trainer.step, "history": result["history"], "val_loss": result["val_loss"]}, f)


if __name__ == "__main__":
    main()
