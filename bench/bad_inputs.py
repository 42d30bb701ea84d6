"""Bad inputs a new user meets, tried through the command line (a process each, as a user runs it) and
the Python API, and what each gets:

- clear: a one-line sentence (``mlx-train: error: ...`` / an ``MLXTrainError``) that matches what the
  case expects (what, where, how to fix), no traceback; for a case that is allowed to go on (a setting
  that changes what trains), the warning or log line that says so;
- unexpected: ``mlx-train: unexpected error: ...``, a traceback, or a Python exception that is not the
  package's own;
- silent: it went on (exit 0 / no exception) without the expected word;
- other: refused, but not with the expected sentence (the table shows what it said);
- accepted: a value the API understands as meant (``epochs="3"``), checked by the result.

The model is the tiny llama of tests/scripts/llm_tiny.py (no download); a finished fine-tuning run and a
finished ``train`` run are made first and copied for the cases that damage or reuse them.

    python bench/bad_inputs.py                # all cases, a table and the counts
    python bench/bad_inputs.py --only gguf    # the cases whose name contains "gguf"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import mlx_train  # noqa: E402,F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

EXPORT = ["export", "--checkpoint", "{run}", "--format"]
FT = ["finetune", "--model", "{model}", "--num-layers", "2", "--batch-size", "2", "--iters", "4"]


@dataclass
class Cli:
    name: str
    argv: list[str]
    expect: str  # regex the output must contain
    files: dict[str, str] = field(default_factory=dict)  # written under the case's folder first
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path], None] | None = None  # gets the case's folder


@dataclass
class Api:
    name: str
    call: Callable[[Path], Any]
    expect: str
    accepted: Callable[[Any], bool] | None = None  # when taking it is right: the result shows it was understood


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _chat(n: int = 8, **extra: Any) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i}."}], **extra} for i in range(n)]


def _data(rows: list[dict], valid: list[dict] | None = None) -> dict[str, str]:
    return {"d/train.jsonl": _lines(rows), "d/valid.jsonl": _lines(_chat(4) if valid is None else valid)}


def _prefs(same: bool = False) -> list[dict]:
    return [{"prompt": f"q{i}?", "chosen": f"good {i}.", "rejected": f"good {i}." if same else f"bad {i}."}
            for i in range(8)]


def _copy_run(source: str) -> Callable[[Path], None]:
    return lambda case: shutil.copytree(source, case / "run")


def _damage_gguf(kind: str) -> Callable[[Path], None]:
    def make(case: Path) -> None:
        if kind == "truncated":
            gguf = case.parent / "setup" / "model.gguf"
            (case / "model.gguf").write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 3])
        else:
            (case / "model.gguf").write_bytes(b"this is not a gguf file\n" * 40)
    return make


def cli_cases(setup: Path) -> list[Cli]:
    model = str(setup / "model")
    ft = [a.replace("{model}", model) for a in FT]
    return [
        # trackers
        Cli("tracker wandb unwritable dir", ["train", "--epochs", "1", "--report-to", "wandb"],
            r"(?i)w&b|wandb", env={"WANDB_MODE": "offline", "WANDB_DIR": "/proc/nope"}),
        Cli("tracker mlflow unreachable", ["train", "--epochs", "1", "--report-to", "mlflow"],
            r"(?i)mlflow.*(reach|connect|server)", env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}),
        Cli("tracker unknown name", ["train", "--epochs", "1", "--report-to", "wandbb"], r"(?i)wandb"),
        # output paths
        Cli("export into /proc", [*EXPORT, "safetensors", "-o", "/proc/x.safetensors"],
            r"(?i)(cannot|can't|not) (be )?writ", prepare=_copy_run(str(setup / "trainrun"))),
        Cli("export onto a directory", [*EXPORT, "safetensors", "-o", "{case}"],
            r"(?i)directory", prepare=_copy_run(str(setup / "trainrun"))),
        Cli("plot into /proc", ["plot", "{run}", "-o", "/proc/x.png"], r"(?i)(cannot|can't|not) (be )?writ",
            prepare=_copy_run(str(setup / "trainrun"))),
        # model files
        Cli("truncated gguf", [*ft[:2], "{case}/model.gguf", *ft[3:], "--data", "{case}/d"], r"(?i)gguf",
            files=_data(_chat()), prepare=_damage_gguf("truncated")),
        Cli("not a gguf", [*ft[:2], "{case}/model.gguf", *ft[3:], "--data", "{case}/d"], r"(?i)gguf",
            files=_data(_chat()), prepare=_damage_gguf("text")),
        Cli("model path missing", [*ft[:2], "{case}/nowhere", *ft[3:], "--data", "{case}/d"],
            r"(?i)(not found|does not exist|no such)", files=_data(_chat())),
        # fine-tuning rows
        Cli("row field not a string", [*ft, "--data", "{case}/d"], r"train\.jsonl:3",
            files=_data([*_chat(2), {"prompt": 7, "completion": "x"}, *_chat(5)])),
        Cli("messages is a string", [*ft, "--data", "{case}/d"], r"train\.jsonl:2",
            files=_data([*_chat(1), {"messages": "hello"}, *_chat(6)])),
        Cli("conversation ends on the user", [*ft, "--data", "{case}/d", "--mask-prompt"], r"train\.jsonl:4",
            files=_data([*_chat(3), {"messages": [{"role": "user", "content": "hi"}]}, *_chat(4)])),
        Cli("not json", [*ft, "--data", "{case}/d"], r"train\.jsonl:2",
            files={"d/train.jsonl": '{"text": "a"}\n{"text": \n', "d/valid.jsonl": _lines(_chat(2))}),
        Cli("no train.jsonl", [*ft, "--data", "{case}/d"], r"train\.jsonl", files={"d/valid.jsonl": "{}\n"}),
        Cli("unknown row format", [*ft, "--data", "{case}/d"], r"train\.jsonl:1",
            files=_data([{"question": "a", "reply": "b"}] * 8)),
        Cli("empty valid.jsonl", [*ft, "--data", "{case}/d"], r"(?i)valid\.jsonl.*(empty|no record)",
            files=_data(_chat(), valid=[])),
        # settings
        Cli("lora rank not a number", [*ft, "--data", "{case}/d", "--set", "lora_parameters.rank=abc"],
            r"(?i)rank", files=_data(_chat())),
        Cli("yaml value not a number", [*ft, "--data", "{case}/d", "-c", "{case}/c.yaml"],
            r"(?i)learning_rate", files={**_data(_chat()), "c.yaml": "learning_rate: fast\n"}),
        Cli("yaml not a mapping", ["train", "-c", "{case}/c.yaml"], r"c\.yaml", files={"c.yaml": "- a\n- b\n"}),
        Cli("unknown flag", ["train", "--epocs", "2"], r"--epochs"),
        Cli("reference-free with sft", [*ft, "--data", "{case}/d", "--reference-free"], r"(?i)reference",
            files=_data(_chat())),
        Cli("reference model with orpo", [*ft, "--data", "{case}/d", "--train-mode", "orpo",
                                          "--reference-model-path", model], r"(?i)reference",
            files=_data(_prefs())),
        Cli("dpo identical pairs", [*ft, "--data", "{case}/d", "--train-mode", "dpo"],
            r"(?i)chosen reply is the rejected one",
            files=_data(_prefs(same=True), valid=_prefs(same=True)[:2])),
        Cli("iters not a multiple of accumulation", [*ft, "--data", "{case}/d", "--iters", "3",
                                                     "--grad-accumulation-steps", "2"], r"(?i)accumulation",
            files=_data(_chat())),
        Cli("batch larger than the data", [*ft, "--data", "{case}/d", "--batch-size", "64"], r"(?i)batch",
            files=_data(_chat())),
        Cli("fuse into a non-empty folder", [*ft, "--data", "{case}/d", "--fuse", "{case}/full"],
            r"(?i)(not empty|non-empty)", files={**_data(_chat()), "full/keep.txt": "mine\n"}),
        Cli("pack with dpo", [*ft, "--data", "{case}/d", "--train-mode", "dpo", "--pack"], r"(?i)pack",
            files=_data(_prefs())),
        Cli("num-layers beyond the model", [*ft, "--data", "{case}/d", "--num-layers", "9"], r"(?i)layers",
            files=_data(_chat())),
        Cli("epochs zero", ["train", "--epochs", "0"], r"(?i)epochs"),
        # run directories and resume
        Cli("resume with nothing there", ["train", "--run-dir", "{case}/empty", "--resume"], r"(?i)nothing to resume"),
        Cli("fresh start into a run", ["train", "--run-dir", "{run}", "--epochs", "1"], r"(?i)--resume|--overwrite",
            prepare=_copy_run(str(setup / "trainrun"))),
        Cli("evaluate a fine-tuning run", ["evaluate", "--checkpoint", "{run}"], r"(?i)fine-tun",
            prepare=_copy_run(str(setup / "ftrun"))),
        Cli("export a fine-tuning run", [*EXPORT, "onnx", "-o", "{case}/m.onnx"], r"(?i)fine-tun|adapters|fuse",
            prepare=_copy_run(str(setup / "ftrun"))),
        Cli("train --resume on a fine-tuning run", ["train", "--run-dir", "{run}", "--resume"], r"(?i)finetune",
            prepare=_copy_run(str(setup / "ftrun"))),
        Cli("resume max-steps below the checkpoint", ["finetune", "--run-dir", "{run}", "--resume", "--max-steps", "1"],
            r"(?i)past max_steps",
            prepare=_copy_run(str(setup / "ftrun"))),
        Cli("damaged checkpoint manifest", ["train", "--run-dir", "{run}", "--resume"], r"(?i)manifest",
            prepare=lambda case: _flip_manifest(case, setup)),
        # cluster
        Cli("configure with no hosts", ["configure", "--hosts", "", "--output", "{case}/hosts.json"], r"(?i)host"),
        Cli("host file not json", ["train", "--distributed", "--hostfile", "{case}/h.json"], r"h\.json",
            files={"h.json": "not json"}),
    ]


def _flip_manifest(case: Path, setup: Path) -> None:
    shutil.copytree(setup / "trainrun", case / "run")
    manifests = sorted((case / "run" / "checkpoints").glob("step-*/manifest.json"))
    for manifest in manifests:
        data = bytearray(manifest.read_bytes())
        data[len(data) // 2] ^= 0x01
        manifest.write_bytes(bytes(data))


def api_cases() -> list[Api]:
    from mlx_train.training import Callback, ModelCheckpoint, Trainer

    x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype(np.int32)

    def train(model: Any = None, optimizer: Any = None, data: Any = (x, y), callbacks: Any = None, **kw: Any) -> Any:
        kw.setdefault("epochs", 1)
        trainer = Trainer(model or nn.Linear(4, 2), optimizer or optim.SGD(learning_rate=0.1), batch_size=16, **kw)
        return trainer.train(data, callbacks=callbacks)

    class Keras(Callback):
        def on_epoch_end(self, epoch, logs=None):  # type: ignore[override]  # Keras' signature, on purpose
            pass

    frozen = nn.Linear(4, 2)
    frozen.freeze()
    return [
        Api("optimizer unknown name", lambda d: train(optimizer="adamm"), r"(?i)adam"),
        Api("loss unknown name", lambda d: train(loss_fn="msee"), r"(?i)mse"),
        Api("epochs a string", lambda d: train(epochs="3"), r"(?i)epochs", accepted=lambda h: h["epoch"] == [0, 1, 2]),
        Api("epochs zero", lambda d: train(epochs=0), r"(?i)epochs"),
        Api("keras callback signature", lambda d: train(callbacks=[Keras()]), r"(?i)on_epoch_end"),
        Api("all-frozen model", lambda d: train(model=frozen), r"(?i)(frozen|trainable)"),
        Api("checkpoint into a file path", lambda d: (d / "f").write_text("x") and train(
            callbacks=[ModelCheckpoint(str(d / "f" / "best"))]), r"(?i)(directory|file)"),
        Api("extra dataset column", lambda d: train(data={"x": x, "y": y, "w": y}), r"'w'"),
        Api("all-zero mask", lambda d: train(data=(x, y, np.zeros(len(x), np.float32))), r"(?i)mask"),
        Api("label out of range", lambda d: train(data=(x, y + 5)), r"(?i)label"),
        Api("inputs and targets of different lengths", lambda d: train(data=(x, y[:10])), r"(?i)(length|samples)"),
        Api("fit save_best without validation", lambda d: Trainer(nn.Linear(4, 2), optim.SGD(learning_rate=0.1),
                                                                  run_dir=str(d / "r"))
            .fit([(mx.array(x), mx.array(y))], epochs=1, save_best=True),
            r"(?i)val"),
        Api("text labels", lambda d: train(data=(x, np.array(["a", "b"] * 32))), r"(?i)(label|string|text)"),
    ]


def _setup(folder: Path) -> None:
    import llm_tiny

    folder.mkdir(parents=True)
    llm_tiny.write_model_dir(str(folder / "model"))
    llm_tiny.write_data(str(folder / "data"), "chat")
    _cli([*[a.replace("{model}", str(folder / "model")) for a in FT], "--data", str(folder / "data"),
          "--run-dir", str(folder / "ftrun"), "--save-every", "2"], folder, {})
    _cli(["train", "--epochs", "1", "--run-dir", str(folder / "trainrun")], folder, {})
    # a well-formed GGUF file (the truncated-file case cuts it)
    mx.save_gguf(str(folder / "model.gguf"), {"token_embd.weight": mx.zeros((64, 32))},
                 {"general.architecture": "llama"})


def _cli(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", **env}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "mlx_train.cli.main", *argv], cwd=cwd, env=full,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {time.monotonic() - started:.0f} s"
    return done.returncode, done.stdout + done.stderr


def classify_cli(code: int, output: str, expect: str) -> str:
    if "unexpected error" in output or "Traceback (most recent call last)" in output or code == -1:
        return "unexpected"
    if re.search(expect, output):
        return "clear"
    return "silent" if code == 0 else "other"


def classify_api(case: Api, folder: Path) -> tuple[str, str]:
    from mlx_train.errors import MLXTrainError

    expect = case.expect
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = case.call(folder)
            if case.accepted is not None and case.accepted(result):
                return "accepted", "(understood: did what was asked)"
        except MLXTrainError as error:
            return ("clear" if re.search(expect, str(error)) else "other"), f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001 - what this benchmark counts
            return "unexpected", f"{type(error).__name__}: {error}"
    said = " | ".join(str(w.message) for w in caught)
    return ("clear" if re.search(expect, said) else "silent"), said or "(went on, nothing said)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    _setup(work / "setup")
    results: list[tuple[str, str, str, str]] = []
    for i, case in enumerate(cli_cases(work / "setup")):
        if args.only not in case.name:
            continue
        folder = work / f"cli{i}"
        folder.mkdir()
        for name, text in case.files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        if case.prepare:
            case.prepare(folder)
        argv = [a.replace("{case}", str(folder)).replace("{run}", str(folder / "run")) for a in case.argv]
        code, output = _cli(argv, folder, case.env)
        said = next((line for line in output.splitlines() if "error" in line.lower() or "warn" in line.lower()),
                    output.strip().splitlines()[-1] if output.strip() else "")
        results.append(("cli", case.name, classify_cli(code, output, case.expect), said[:150]))
    for i, api in enumerate(api_cases()):
        if args.only not in api.name:
            continue
        folder = work / f"api{i}"
        folder.mkdir()
        kind, said = classify_api(api, folder)
        results.append(("api", api.name, kind, said[:150]))
    width = max(len(r[1]) for r in results)
    print(f"\n{'surface':7} {'case':{width}} {'outcome':10} what it said")
    for surface, name, kind, said in results:
        print(f"{surface:7} {name:{width}} {kind:10} {said}")
    counts = Counter(kind for _, _, kind, _ in results)
    print(f"\n{len(results)} bad inputs: " + ", ".join(f"{counts[k]} {k}" for k in
                                                     ("clear", "accepted", "other", "unexpected", "silent")))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
