"""The fine-tuning guide's commands run as written (docs/guides/finetuning.md): its run, resume and --fuse
block, its DPO block and its GRPO block, in a fresh directory where ``SmolLM2-135M-Instruct.Q4_1.gguf`` is a
tiny 8-block llama saved under that name (the guide says so), ``data/`` a few hundred small records and
``lora_config.yaml`` an mlx_lm.lora file; the runs' 200 iterations (and the resume to 400) are cut to 2
(and 4): the packed run's rows are 2048 tokens long. The page runner (tests/test_docs.py) skips these blocks,
as they need a base model."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402
from test_docs import DOCS, ROOT, page_blocks  # noqa: E402
from test_llm_models import write_gguf  # noqa: E402

GUIDE = DOCS / "guides" / "finetuning.md"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _block(containing: str) -> str:
    found = [b.code for b in page_blocks(GUIDE) if b.language == "bash" and containing in b.code]
    assert len(found) == 1, f"the guide has {len(found)} bash blocks with {containing!r}"
    return found[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The reader's directory: the base model file, data/ and an mlx_lm.lora YAML."""
    root = tmp_path_factory.mktemp("guide")
    raw = llm_tiny.raw_tokenizer()
    model, config = llm_tiny.make_model(raw.get_vocab_size(), seed=1, layers=8)
    write_gguf(str(root / MODEL), model, config, raw)
    llm_tiny.write_data(str(root / "data"), "completion", n_train=320, n_valid=8)  # --pack: 4+ rows of 2048
    (root / "lora_config.yaml").write_text(f"model: {MODEL}\ndata: data/\niters: 8\nbatch_size: 4\nnum_layers: 8\n")
    bin_dir = root / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "mlx-train"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m mlx_train.cli.main "$@"\n')
    shim.chmod(0o755)
    return root


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLX_TRAIN_HOME": str(cwd / ".home"),
           "PATH": f"{cwd / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_run_resume_and_fuse_commands_run_as_written(workdir):
    code = _block("--fuse smol-tuned")
    assert MODEL in code and "--iters 200" in code and "--max-steps 400" in code
    ran = _run(code.replace("--iters 200", "--iters 2").replace("--max-steps 400", "--max-steps 4"), workdir)
    assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    assert "finetune: 4 steps" in ran.stdout  # the resumed run trained on to --max-steps
    assert (workdir / "smol-tuned" / "config.json").is_file() and (workdir / "runs" / "smol" / "adapters").is_dir()
    import mlx_lm

    mlx_lm.load(str(workdir / "smol-tuned"))


@pytest.mark.slow
def test_the_dpo_command_runs_as_written(workdir):
    ran = _run(_block("prefs/train.jsonl"), workdir)
    assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    assert "finetune dpo: 200 steps" in ran.stdout and (workdir / "smol-dpo" / "config.json").is_file()


@pytest.mark.slow
def test_the_grpo_command_runs_as_written(workdir):
    """The GSM8K-style block: its data, its reward file and its command (200 iterations cut to 2, validation every
    2): the reward functions' metrics reach metrics.jsonl, and the adapters and their card name the rewards."""
    import json

    code = _block("--train-mode grpo")
    assert "--iters 200" in code and "--steps-per-eval 50" in code
    ran = _run(code.replace("--iters 200", "--iters 2").replace("--steps-per-eval 50", "--steps-per-eval 2"), workdir)
    assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    assert "finetune grpo: 2 steps, 16 completions" in ran.stdout and "validation: reward" in ran.stdout
    run = workdir / "runs" / "grpo"
    reports = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in reports if r["kind"] == "train"]
    assert trained and {"reward_mean", "reward_std", "reward_correct_answer_mean", "reward_has_marker_mean",
                        "reward_has_marker_coverage", "completion_length", "kl"} <= set(trained[-1])
    assert any("val_reward_correct_answer_mean" in r for r in reports)
    facts = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert (facts["train_mode"], facts["reward_functions"], facts["reward_weights"]) == \
        ("grpo", ["correct_answer", "has_marker"], [1.0, 0.2])
    card = (run / "adapters" / "README.md").read_text()
    assert (run / "adapters" / "adapters.safetensors").is_file() and "- **Method:** LORA fine-tuning, GRPO" in card
    assert "| reward_functions | `['correct_answer', 'has_marker']` |" in card and \
        "| reward_weights | `[1.0, 0.2]` |" in card and "| reward_functions_file | `rewards.py` |" in card
