"""The configs, loaded together: ``TrainConfig`` (the Trainer's), ``LaunchConfig`` (the launcher's) and
``FinetuneConfig`` (fine-tuning's). A config that extends ``TrainConfig`` registers when its module
loads, so ``mlx_train.config`` resolves every config name here: whichever is used first, a setting given
to the wrong one says where it goes.

Example: ``from mlx_train.config import TrainConfig`` loads this module.
"""

from mlx_train.config.finetune import FinetuneConfig
from mlx_train.config.launch import LaunchConfig
from mlx_train.config.sections import MisplacedSetting
from mlx_train.config.train import TrainConfig

__all__ = ["FinetuneConfig", "LaunchConfig", "MisplacedSetting", "TrainConfig"]
