"""``tp_run.py`` on a tiny llama whose attention does not divide over 2 ranks: 9 query heads in 3
key/value groups (hidden 72, head size 8), split unevenly by groups (2 + 1). Same arguments and outputs
as ``tp_run.py``.

    mlx.launch -n 2 -- python tp_uneven_run.py OUT_DIR full
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)
import tp_run  # noqa: E402


def uneven_config(vocab_size: int, tie: bool = True, layers: int = 2) -> dict:
    return {**llm_tiny.model_config(vocab_size, tie, layers), "hidden_size": 72, "num_attention_heads": 9,
            "num_key_value_heads": 3}


def make_model(vocab_size: int, seed: int = 0):
    """The uneven tiny llama (random, seeded) and its config dict."""
    from mlx_lm.models.llama import Model, ModelArgs

    llm_tiny.mx.random.seed(seed)
    config = uneven_config(vocab_size)
    model = Model(ModelArgs.from_dict(config))
    llm_tiny.mx.eval(model.parameters())
    return model, config


if __name__ == "__main__":
    llm_tiny.make_model = lambda vocab_size, seed=0, tie=True, layers=2: make_model(vocab_size, seed)
    tp_run.main()
