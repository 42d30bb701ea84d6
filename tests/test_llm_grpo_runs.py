"""GRPO runs as a whole: what cannot change on resume is refused (and what may, may), the out-of-memory split
trains the same completions to the same adapters, and 2 data-parallel ranks launched for real train what one
process trains with gradient accumulation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from grpo_dp_run import Rollouts  # noqa: E402
from test_llm_grpo import REWARDS, write_setup  # noqa: E402

from mlx_train.cli.main import main  # noqa: E402
from mlx_train.llm import FineTuneConfig, finetune  # noqa: E402
from mlx_train.testing import SimulatedOutOfMemory  # noqa: E402

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_setup(tmp_path_factory.mktemp("grpo_runs"))


def _grpo(setup, run, *extra):
    return ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--train-mode", "grpo",
            "--num-layers", "2", "--batch-size", "2", "--group-size", "3", "--max-completion-length", "8",
            "--max-seq-length", "128", "--learning-rate", "5e-3", "--beta", "0.05", "--reward-functions", REWARDS,
            "--save-every", "1", "--steps-per-report", "1", "--val-batches", "1", "--run-dir", str(run), *extra]


def _snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_grpo_settings_cannot_change_on_resume_but_max_steps_can(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_grpo(setup, run, "--iters", "2")) == 0
    before = _snapshot(run)
    capsys.readouterr()
    for flags, name in [(["--group-size", "4"], "group_size"), (["--temperature", "1.0"], "temperature"),
                        (["--max-completion-length", "6"], "max_completion_length"), (["--beta", "0.0"], "beta"),
                        (["--grpo-loss-type", "bnpo"], "grpo_loss_type"), (["--clip-epsilon", "0.2"], "clip_epsilon"),
                        (["--reward-weights", "1.0,2.0"], "reward_weights"),
                        (["--reward-functions", "grpo_rewards:letter_share"], "reward_functions")]:
        assert main(["finetune", "--run-dir", str(run), "--resume", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"{name} cannot change on resume (the run has {name}=" in err and flags[0] in err, err
        assert "start a new run" in err and "Traceback" not in err
        assert _snapshot(run) == before  # a refused command changes nothing
    assert main(["finetune", "--run-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "max_steps 2 -> 3 (--max-steps 3)" in out and "finetune grpo: 3 steps" in out


def _grpo_run(setup, run, callbacks, iterations=1):
    config = FineTuneConfig(model=str(setup / "base"), data=str(setup / "data"), train_mode="grpo", iters=3,
                            batch_size=2, group_size=3, max_completion_length=8, max_seq_length=128, num_layers=2,
                            learning_rate=1e-3, beta=0.05, reward_functions=REWARDS, steps_per_report=1,
                            steps_per_eval=100, run_dir=str(run), num_iterations=iterations)
    result = finetune(config, callbacks=callbacks, log=lambda line: None)
    reports = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return dict(tree_flatten(result["model"].trainable_parameters())), result["trainer"], \
        [r for r in reports if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2])
def test_an_out_of_memory_step_trains_the_same_completions_to_the_same_adapters(setup, tmp_path, iterations):
    """Step 2 runs out of memory after its update was dispatched: it is undone and redone as two micro-batches of
    the same rollout (not sampled again), and the run (3 steps) ends with the unsplit run's adapters to float
    rounding. With num_iterations 2 step 2 trains on step 1's rollouts: their kept log-probabilities are cut
    with them. (At a learning rate that makes this tiny model's steps chaotic, e.g. adam at 5e-3 or sgd at 0.5,
    the rounding differences of step 2 grow to 1-2% by step 3 in both directions: a property of the
    optimisation, not of the split, whose gradients agree to 1e-6.)"""
    recorded, plain = Rollouts(), Rollouts()
    simulated = SimulatedOutOfMemory(steps=[2])
    split, trainer, split_reports = _grpo_run(setup, tmp_path / "split", [simulated, recorded], iterations)
    whole, _, whole_reports = _grpo_run(setup, tmp_path / "whole", [plain], iterations)
    assert simulated.failures == [2] and trainer.memory_guard.events[0]["step"] == 2
    assert [recorded.micro_batches[s] for s in "123"] == [1, 3, 2]  # one failed attempt, then halves
    assert [plain.micro_batches[s] for s in "123"] == [1, 1, 1]
    for step in "123":  # the last attempt's rows: the same completions, advantages and rewards
        assert recorded.rows[step][-6:] == plain.rows[step], step
    assert (plain.rows["2"] == plain.rows["1"]) == (iterations == 2)
    assert [r["reward_mean"] for r in split_reports] == pytest.approx([r["reward_mean"] for r in whole_reports],
                                                                      rel=1e-6)
    assert split.keys() == whole.keys()
    worst = max(float(mx.abs(split[k] - whole[k]).max() / mx.abs(whole[k]).max()) for k in whole)
    # The halves pad their completion slots on their own and sum in another order: gradients that differ by
    # ~1e-7 become 1-2e-5 of the adapters after Adam's normalised steps 2 and 3 (the bound the data-parallel
    # test, whose ranks pad their own rows, also uses).
    assert worst < 1e-4, worst
    assert all(float(mx.abs(v).max()) > 0 for k, v in whole.items() if k.endswith("lora_b"))  # it trained


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("iterations", [1, 2])
def test_two_data_parallel_ranks_train_what_one_process_trains_with_accumulation(setup, tmp_path, iterations):
    """2 ranks launched for real on 127.0.0.1, 2 prompts each per step, against one process taking the same 4
    prompts a step as 2 micro-batches of 2: each rank samples whole groups of its own prompts, which are the
    completions the one process samples (the key comes from the seed, the step and the prompts' rows); the
    reported reward is the mean over both ranks' completions; the ranks end with bit-identical adapters, equal
    to the one process's to float rounding. With num_iterations 2 each rank trains step 2 on step 1's rollouts."""
    launcher = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    scripts = os.path.join(os.path.dirname(__file__), "scripts")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([SRC, scripts, os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, os.path.join(scripts, "grpo_dp_run.py"), str(setup / "base"), str(setup / "data")]
    for name, launch in (("one", []), ("two", [launcher, "-n", "2", "--"])):
        ran = subprocess.run([*launch, *script, str(tmp_path / name), str(tmp_path / name), str(iterations)], env=env,
                             timeout=600,
                             capture_output=True, text=True)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    rows = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one.rank0", "two.rank0",
                                                                                     "two.rank1")}
    reports = {name: [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                      if r["kind"] == "train"] for name in ("one", "two")}
    assert [r["step"] for r in reports["two"]] == [r["step"] for r in reports["one"]] == [1, 2, 3]
    for step, one, two in zip((1, 2, 3), reports["one"], reports["two"], strict=True):
        ranks = [rows["two.rank0"][str(step)], rows["two.rank1"][str(step)]]
        for rank in ranks:  # 2 groups of 3 completions, each group of one prompt
            assert len(rank) == 6
            for group in (rank[:3], rank[3:]):
                assert len({tuple(tokens[:length]) for tokens, length, _, _ in group}) == 1
        assert [r[0] for r in ranks[0] + ranks[1]] == [r[0] for r in rows["one.rank0"][str(step)]]
        assert [r[2] for r in ranks[0] + ranks[1]] == [r[2] for r in rows["one.rank0"][str(step)]]  # advantages
        both = [r[3] for r in ranks[0] + ranks[1]]
        assert two["reward_mean"] == pytest.approx(sum(both) / len(both), rel=1e-6, abs=1e-9)
        assert two["reward_mean"] == pytest.approx(one["reward_mean"], rel=1e-6, abs=1e-9)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-9)
    assert any(r[3] for rank in ("two.rank0", "two.rank1") for step in rows[rank].values() for r in step)  # scored
    for run in rows.values():  # the rollouts of a step trained again at the next one, with num_iterations 2
        assert (run["2"] == run["1"]) == (iterations == 2) and run["3"] != run["2"]
    rank0, rank1, one = (mx.load(str(tmp_path / f"{name}.safetensors")) for name in ("two.rank0", "two.rank1",
                                                                                     "one.rank0"))
    assert rank0.keys() == rank1.keys() == one.keys()
    assert all(mx.array_equal(rank0[k], rank1[k]) for k in rank0)
    worst = max(float(mx.abs(rank0[k] - one[k]).max() / mx.abs(one[k]).max()) for k in one)
    assert worst < 1e-4, worst  # rollouts padded per rank (8-token widths) round differently from one process
