"""Language-model fine-tuning (what ``mlx_lm.lora`` users do) on the mlx-train Trainer.

Needs the ``llm`` extra (``pip install 'mlx-train[llm]'``: mlx-lm and tokenizers).

Example::

    from mlx_train.llm import FineTuneConfig, finetune
    result = finetune(FineTuneConfig(model="SmolLM2-135M-Instruct.Q4_1.gguf", data="data/", iters=100))
"""

# Imported eagerly, unlike the other packages: every module here needs MLX and mlx-lm anyway, and
# ``finetune`` is both a module and a function of this package (a lazy name would lose to the
# submodule once ``mlx_train.llm.finetune`` is imported).
from mlx_train.llm.adapters import AdapterConfig, apply_adapters, fuse_adapters, load_adapters, save_adapters
from mlx_train.llm.data import SequenceDataset, collate, load_records, make_loader, pack_documents, tokenize
from mlx_train.llm.finetune import FineTuneConfig, finetune
from mlx_train.llm.loss import document_attention_mask, lm_loss
from mlx_train.llm.models import base_reference, load_model, save_model
from mlx_train.llm.preference import PairDataset, PreferenceConfig, PreferenceLoss

__all__ = [
    "AdapterConfig", "apply_adapters", "fuse_adapters", "load_adapters", "save_adapters",
    "SequenceDataset", "collate", "load_records", "make_loader", "pack_documents", "tokenize",
    "FineTuneConfig", "finetune", "document_attention_mask", "lm_loss",
    "base_reference", "load_model", "save_model", "PairDataset", "PreferenceConfig", "PreferenceLoss",
]
