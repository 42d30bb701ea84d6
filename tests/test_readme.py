"""Every ```python block of README.md runs.

The blocks run in README order in one namespace (later blocks use the ``model``, ``trainer`` and
``data`` of earlier ones, as a reader would), in a subprocess whose working directory is a fresh
temporary directory. Each block is its own test: one that raises fails with its traceback.

The README leaves a few things to the reader; the prelude below provides them, and nothing else:

- ``sys`` (the supervisor example passes ``sys.executable``);
- ``train_data`` / ``val_data`` (the distributed example): a small slice of the digits dataset;
- ``custom_config.yaml`` (the ``TrainConfig.from_yaml`` example): the README's own YAML block;
- ``train.py`` (the script the supervisor example launches on 2 ranks): a short DistributedTrainer
  run on 128 digits samples.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUNNER = Path(__file__).parent / "scripts" / "run_readme_blocks.py"

PRELUDE = """
import sys
from mlx_train.builtin.datasets import load_dataset as _load_dataset

_digits = _load_dataset("digits", seed=0)
train_data = tuple(a[:256] for a in _digits["train"])
val_data = tuple(a[:64] for a in _digits["val"])
"""

TRAIN_PY = """
import mlx_train  # before mlx.core: BLAS preload
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_train.builtin.datasets import load_dataset
from mlx_train.training import DistributedTrainer

data = load_dataset("digits", seed=0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
trainer = DistributedTrainer(model, optim.Adam(1e-3), strategy="data_parallel", batch_size=16)
trainer.train(tuple(a[:128] for a in data["train"]), epochs=1, checkpoint_dir="runs/a/ckpt")
"""


def fenced_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) for every ```language block of a Markdown text."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if current is None and re.fullmatch(rf"```{language}\s*", line.strip()):
            current, start = [], number
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


BLOCKS = fenced_blocks(README.read_text(encoding="utf-8"), "python")


def test_readme_has_python_blocks_and_they_parse():
    assert len(BLOCKS) >= 5, "README.md has (almost) no ```python blocks: did the fence syntax change?"
    for line, code in BLOCKS:
        compile(code, f"README.md:{line}", "exec")  # a syntax error names the block's line


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the prelude and every block once; block line -> None (ran) or its traceback."""
    cwd = tmp_path_factory.mktemp("readme")
    yaml_blocks = fenced_blocks(README.read_text(encoding="utf-8"), "yaml")
    assert yaml_blocks, "README.md has no ```yaml block to write custom_config.yaml from"
    (cwd / "custom_config.yaml").write_text(yaml_blocks[0][1])
    (cwd / "train.py").write_text(TRAIN_PY)
    spec = cwd / "blocks.json"
    spec.write_text(json.dumps({"prelude": PRELUDE, "blocks": BLOCKS}))
    out = cwd / "results.json"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLX_TRAIN_HOME": str(cwd / "home")}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec), str(out)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the README runner crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return {int(line): error for line, error in json.loads(out.read_text()).items()}


@pytest.mark.slow
@pytest.mark.parametrize("line", [line for line, _ in BLOCKS], ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(results, line):
    assert line in results, f"the block at README.md:{line} never ran (the runner stopped before it)"
    assert results[line] is None, f"the block at README.md:{line} raised:\n{results[line]}"
