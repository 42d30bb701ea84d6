"""Every ```python block of README.md runs.

The blocks run in README order in one namespace (later blocks use the ``model``, ``trainer`` and
``data`` of earlier ones, as a reader would), in a subprocess whose working directory is a fresh
temporary directory. Each block is its own test: one that raises fails with its traceback.

The README leaves one thing to the reader, which the test provides: ``custom_config.yaml`` (the
``TrainConfig.from_yaml`` example) is the README's own YAML block. The guides under docs/ are run
by tests/test_docs.py.
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

PRELUDE = ""


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
    assert len(BLOCKS) >= 3, "README.md has (almost) no ```python blocks: did the fence syntax change?"
    for line, code in BLOCKS:
        compile(code, f"README.md:{line}", "exec")  # a syntax error names the block's line


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the prelude and every block once; block line -> None (ran) or its traceback."""
    cwd = tmp_path_factory.mktemp("readme")
    yaml_blocks = fenced_blocks(README.read_text(encoding="utf-8"), "yaml")
    assert yaml_blocks, "README.md has no ```yaml block to write custom_config.yaml from"
    (cwd / "custom_config.yaml").write_text(yaml_blocks[0][1])
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
