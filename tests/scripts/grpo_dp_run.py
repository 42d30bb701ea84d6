"""A GRPO fine-tuning run for the data-parallel test: 3 steps of 4 prompts x 3 completions.

    mlx.launch -n 2 -- python grpo_dp_run.py BASE DATA RUN_DIR OUT      # 2 prompts per rank and step
    python grpo_dp_run.py BASE DATA RUN_DIR OUT                         # 2 prompts x accumulation 2
    python grpo_dp_run.py BASE DATA RUN_DIR OUT 2                       # num_iterations 2

Each process writes OUT.rank<R>.safetensors (its trainable parameters) and OUT.rank<R>.json (the rows of every
micro-batch it trained on: prompt and completion tokens, prompt length, advantage and reward of each completion,
by step).
"""

import json
import sys

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.llm import FineTuneConfig, finetune
from mlx_train.training import Callback, DistributedTrainer
from mlx_train.training.step import StepObserver

REWARDS = "grpo_rewards:letter_share,grpo_rewards:says_answer"


class Rollouts(Callback, StepObserver):
    """The completions of every micro-batch, by step (a string): [prompt + completion tokens, prompt length,
    advantage, reward] per row, and the number of micro-batches run (those of a failed attempt too)."""

    def __init__(self):
        self.rows = {}
        self.micro_batches = {}
        self._trainer = None

    def on_fit_start(self, trainer):
        self._trainer = trainer
        trainer.memory_guard.observe(self)

    def before_micro_batch(self, step, batch, update, weighted):
        targets, positions = np.array(batch["targets"]), np.array(batch["positions"])
        inputs, advantages, rewards = (np.array(batch[k]) for k in ("inputs", "advantages", "rewards"))
        number = str(self._trainer.step + 1)
        self.micro_batches[number] = self.micro_batches.get(number, 0) + 1
        for r in range(len(targets)):
            where = positions[r][positions[r] >= 0]
            tokens = inputs[r, :where[0] + 1].tolist() + targets[r, where].tolist()
            self.rows.setdefault(number, []).append(
                [tokens, int(where[0]) + 1, float(advantages[r]), float(rewards[r])])

    def after_micro_batch(self, step, batch, result, update, weighted):
        """Nothing: the rows were recorded before."""


def main():
    base, data, run_dir, out = sys.argv[1:5]
    iterations = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    config = FineTuneConfig(model=base, data=data, run_dir=run_dir, train_mode="grpo", iters=3 * (2 // world),
                            batch_size=2, grad_accumulation_steps=2 // world, group_size=3, max_completion_length=8,
                            max_seq_length=128, num_layers=2, learning_rate=1e-3, beta=0.05, reward_functions=REWARDS,
                            steps_per_report=1, steps_per_eval=100, num_workers=0, num_iterations=iterations)
    rollouts = Rollouts()
    result = finetune(config, callbacks=[rollouts], trainer_class=DistributedTrainer if world > 1 else None,
                      log=lambda line: None)
    mx.save_safetensors(f"{out}.rank{rank}.safetensors", dict(tree_flatten(result["model"].trainable_parameters())))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(rollouts.rows, f)


if __name__ == "__main__":
    main()
