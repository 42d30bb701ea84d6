"""Every script in examples/ runs as a user would run it, in a fresh directory."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# What each script must print: proof that it trained and got somewhere, not only that it exited.
EXPECTED = {
    "perceptron_digits.py": r"test accuracy: 0\.9\d\d",
    "training_api.py": r"resumed from checkpoints/step-\d+.*\n(.*\n)*test: loss [\d.]+, accuracy 0\.9\d\d",
    "yaml_config.py": r"epochs 4, batch 32 x 2, adamw lr 0\.002, checkpoint every 2 epochs(.*\n)*test accuracy: 0\.9",
    "export_onnx.py": r"max \|ONNX - MLX\| \d\.\de-0[5-9](.*\n)*onnxruntime test accuracy: 0\.[89]\d\d"
                      r"\nmlxfn agrees with onnxruntime: True",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script, tmp_path):
    """Run twice in the same directory, as a user trying it again would: the second run works too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for attempt in ("first", "second"):
        result = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=280)
        assert result.returncode == 0, f"{attempt} run: {result.stderr[-3000:]}"
        assert re.search(EXPECTED[script], result.stdout), result.stdout[-3000:]
