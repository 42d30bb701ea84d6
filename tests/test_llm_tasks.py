"""Fine-tuning tasks: every train_mode has one; each refuses what does not apply to it, counts its own
items and says so in its summary and model card."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

from mlx_train.config import FinetuneConfig, TrainConfig  # noqa: E402
from mlx_train.config.finetune import TRAIN_MODES  # noqa: E402
from mlx_train.errors import ConfigError  # noqa: E402
from mlx_train.llm import card  # noqa: E402
from mlx_train.llm.preference import PreferenceLoss  # noqa: E402
from mlx_train.llm.tasks import SFT, TASKS, Preference, task_for  # noqa: E402


def test_every_train_mode_has_a_task():
    assert list(TASKS) == list(TRAIN_MODES)
    for mode in TRAIN_MODES:
        task = task_for(FinetuneConfig(train_mode=mode))
        assert task.name == mode and isinstance(task, TASKS[mode])  # type: ignore[arg-type]
    assert isinstance(task_for(FinetuneConfig()), SFT) and isinstance(task_for(FinetuneConfig(train_mode="orpo")),
                                                                       Preference)
    with pytest.raises(ConfigError, match="fine-tuning takes a FinetuneConfig .* got TrainConfig"):
        task_for(TrainConfig())  # type: ignore[arg-type]


def test_a_task_refuses_settings_that_do_not_apply():
    with pytest.raises(ConfigError, match=r"--reference-free True does not apply to --train-mode sft \(it is a "
                                          r"setting of the preference tasks \(dpo, orpo, cpo\)\)"):
        task_for(FinetuneConfig(reference_free=True))
    with pytest.raises(ConfigError, match="--beta 0.5 does not apply to --train-mode sft"):
        task_for(FinetuneConfig(beta=0.5))
    with pytest.raises(ConfigError, match="--pack does not apply to --train-mode dpo"):
        task_for(FinetuneConfig(train_mode="dpo", pack=True))
    task_for(FinetuneConfig(train_mode="dpo", reference_free=True, beta=0.5))  # they apply to DPO
    for mode in ("orpo", "cpo"):  # no reference policy: DPO's reference settings mean nothing there
        with pytest.raises(ConfigError, match=f"--reference-model-path 'ref' does not apply to --train-mode {mode} "
                                              r"\(it is a setting of --train-mode dpo"):
            task_for(FinetuneConfig(train_mode=mode, reference_model_path="ref"))
        with pytest.raises(ConfigError, match=f"--reference-free True does not apply to --train-mode {mode}"):
            task_for(FinetuneConfig(train_mode=mode, reference_free=True))
        with pytest.raises(ConfigError, match="--precompute-ref-log-probs True does not apply"):
            task_for(FinetuneConfig(train_mode=mode, precompute_ref_log_probs=True))
        task_for(FinetuneConfig(train_mode=mode, beta=0.5))


@pytest.mark.parametrize("flags,said", [
    (["--reference-free"], "--reference-free True does not apply to --train-mode sft"),
    (["--train-mode", "orpo", "--reference-model-path", "ref"],
     "--reference-model-path 'ref' does not apply to --train-mode orpo"),
])
def test_the_command_refuses_them_before_the_model_loads(tmp_path, capsys, flags, said):
    from mlx_train.cli.main import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "a"}\n')
    missing = str(tmp_path / "no-such-model")  # loading it would fail: the setting is refused first
    assert main(["finetune", "--model", missing, "--data", str(tmp_path / "data"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "no-such-model" not in err and "Traceback" not in err


class _Trainer:
    step = 3


def test_a_preference_task_counts_pairs():
    sft, dpo = task_for(FinetuneConfig()), task_for(FinetuneConfig(train_mode="dpo"))
    assert (sft.unit, dpo.unit) == ("trained tokens", "preference pairs")
    assert sft.counter().unit == "trained tokens" and dpo.counter().unit == "preference pairs"
    assert isinstance(dpo.loss(), PreferenceLoss) and sft.loss().__name__ == "lm_loss"
    val = {"loss": 0.5, "reward_accuracy": 0.75, "reward_margin": 0.25, "rewards_chosen": 0.1, "rewards_rejected": -0.1}
    lines = dpo.summary({"trainer": _Trainer(), "trained": 12, "per_second": 2.0, "val_metrics": val,
                         "val_loss": 0.5})
    assert lines[0] == "finetune dpo: 3 steps, 12 preference pairs, 2.0 preference pairs/s"
    assert lines[1].startswith("  validation: loss 0.5000, reward accuracy 0.750")
    assert sft.summary({"trainer": _Trainer(), "trained": 1234, "per_second": None})[0] == \
        "finetune: 3 steps, 1,234 trained tokens"


def test_the_model_card_asks_the_task():
    result = {"trainer": _Trainer(), "val_metrics": {"loss": 0.5}}
    orpo = FinetuneConfig(model="base", dataset="data", train_mode="orpo", beta=0.2)
    facts = card.card_facts(orpo, result)
    assert facts["train_mode"] == "orpo" and facts["hyperparameters"]["beta"] == 0.2
    assert "dpo_loss_type" not in facts["hyperparameters"]  # ORPO has none
    sft = card.card_facts(FinetuneConfig(model="base", dataset="data"), result)
    assert sft["train_mode"] == "sft" and "beta" not in sft["hyperparameters"]
    assert list(sft["hyperparameters"])[0] == "train_mode"


def test_the_applications_test_no_mode():
    import inspect

    from mlx_train.cli import finetune as cli_finetune
    from mlx_train.llm import finetune

    for module in (finetune, cli_finetune, card):
        source = inspect.getsource(module)
        assert "train_mode ==" not in source and "train_mode !=" not in source, module.__name__
