"""Exact resume of a fine-tuning run with packing, prompt masking and LoRA dropout: SIGKILLed
after a step and resumed from its last checkpoint, it ends with the same adapter weights, bit for
bit, as a run that was never interrupted."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

import llm_tiny  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "llm_resume_run.py")


def _run(base, data, run_dir, out, *extra, check=True):
    proc = subprocess.run([sys.executable, SCRIPT, base, data, str(run_dir), str(out), *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [5])
def test_sigkill_then_resume_is_bit_exact(tmp_path, kill_at):
    base, data = str(tmp_path / "base"), str(tmp_path / "data")
    llm_tiny.write_model_dir(base, seed=2)
    llm_tiny.write_data(data, "chat", n_train=14, n_valid=4)

    _run(base, data, tmp_path / "full", tmp_path / "full.safetensors")
    killed = _run(base, data, tmp_path / "cut", tmp_path / "unused.safetensors", "--kill-at", str(kill_at), check=False)
    assert killed.returncode == -9, killed.stdout[-3000:]
    assert os.listdir(tmp_path / "cut" / "checkpoints"), "no checkpoint was written before the kill"
    resumed = _run(base, data, tmp_path / "cut", tmp_path / "resumed.safetensors")
    assert "resumed from" in resumed.stdout

    full, again = mx.load(str(tmp_path / "full.safetensors")), mx.load(str(tmp_path / "resumed.safetensors"))
    assert full.keys() == again.keys()
    different = [k for k in full if not mx.array_equal(full[k], again[k])]
    assert not different, f"{len(different)} adapter tensors differ after resume, e.g. {different[:3]}"
    full_info = json.loads((tmp_path / "full.safetensors.json").read_text())
    again_info = json.loads((tmp_path / "resumed.safetensors.json").read_text())
    assert again_info == full_info
