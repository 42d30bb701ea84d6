"""A vision-language fine-tuning run for the data-parallel test: 3 optimizer steps of 4 rows (pictures, and
text rows mixed in), LoRA on the tiny Qwen2-VL of vlm_tiny.py.

    mlx.launch -n 2 -- python vlm_dp_run.py BASE DATA RUN_DIR OUT      # 2 rows per rank and step
    python vlm_dp_run.py BASE DATA RUN_DIR OUT                         # 2 rows x accumulation 2

Each process writes OUT.rank<R>.safetensors (its trainable parameters).
"""

import sys

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train.llm import FineTuneConfig, finetune
from mlx_train.training import DistributedTrainer


def main():
    base, data, run_dir, out = sys.argv[1:5]
    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    config = FineTuneConfig(model=base, data=data, run_dir=run_dir, iters=3 * (2 // world), batch_size=2,
                            grad_accumulation_steps=2 // world, num_layers=2, learning_rate=3e-3,
                            assistant_only_loss=True, steps_per_report=1, steps_per_eval=100, num_workers=0)
    result = finetune(config, trainer_class=DistributedTrainer if world > 1 else None, log=lambda line: None)
    mx.save_safetensors(f"{out}.rank{rank}.safetensors", dict(tree_flatten(result["model"].trainable_parameters())))


if __name__ == "__main__":
    main()
