"""Live monitoring: the run directory, the step-time breakdown, `mlx-train monitor` (once and live)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.cli.main import main
from mlx_train.config import TrainConfig
from mlx_train.monitor import RunReader, Series, line_chart, rank_status
from mlx_train.training import Callback, Heartbeat, Trainer

LIVE_EPOCHS = "100000"  # the background run trains until the test stops it
FRAME_START = b"\x1b[H"  # the live monitor (rich's Live on the alternate screen) begins each frame at home


def _rows(run_dir, kind=None):
    """Complete rows of metrics.jsonl (a half-written last line is left out)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    lines = text.split("\n")[:-1]
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def _wait_for(predicate, what, timeout=600.0):  # only ends a hung run
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _once(capsys, *args):
    capsys.readouterr()
    code = main(["monitor", *map(str, args), "--once"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code = main(["train", "--epochs", "2", "--run-dir", str(run_dir), "--set", "report_every=5 steps",
                 "--set", "checkpoint_every=20 steps"])
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A real `mlx-train train` running in the background for the whole module."""
    root = tmp_path_factory.mktemp("live")
    run_dir = root / "runs" / "live"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_train", "train", "--epochs", LIVE_EPOCHS, "--run-dir", str(run_dir),
         "--set", "report_every=5 steps", "--set", "num_workers=0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: len(_rows(run_dir, "val")) >= 2 and (run_dir / "heartbeat-0.json").exists(),
                  "the background run's first validations")
        yield {"run_dir": run_dir, "process": process, "root": root / "runs"}
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


# -- the run directory ------------------------------------------------------------------

def test_run_directory_holds_config_metrics_heartbeat_checkpoints(finished_run):
    assert TrainConfig.from_yaml(finished_run / "config.yaml").run_dir == str(finished_run)
    train = _rows(finished_run, "train")
    assert {"step", "epoch", "loss", "learning_rate", "samples_per_second", "peak_memory_gb", "step_time",
            "time_data", "time_compute", "time_comm", "time_checkpoint"} <= set(train[0])
    assert [r["step"] for r in train][:3] == [5, 10, 15]
    beat = json.loads((finished_run / "heartbeat-0.json").read_text())
    assert beat["state"] == "finished" and beat["rank"] == 0 and beat["world_size"] == 1
    assert beat["step"] == train[-1]["step"] == beat["total_steps"]
    assert beat["pid"] == os.getpid() and beat["peak_memory_gb"] > 0
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir())[-1] == f"step-{beat['step']:08d}"


def test_trainer_writes_config_yaml_and_train_log_itself(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.0), batch_size=16, run_dir=str(tmp_path / "r"),
                      early_stopping_patience=0, seed=3)
    trainer.train((x, y), (x, y), epochs=3)
    assert TrainConfig.from_yaml(tmp_path / "r" / "config.yaml") == trainer.config
    assert "early stopping at epoch 2" in (tmp_path / "r" / "train.log").read_text()
    assert "early stopping at epoch 2" in RunReader(tmp_path / "r").read().log_lines[-1]


def test_heartbeat_takes_its_rank_from_the_group(tmp_path):
    class Group:
        def rank(self):
            return 1

        def size(self):
            return 2

    trainer = SimpleNamespace(group=Group(), step=0, epoch=0, epochs=1, total_steps=10)
    beat = Heartbeat(str(tmp_path), interval=0.0)
    beat.on_fit_start(trainer)
    trainer.step = 4
    beat.on_report(trainer, {"samples_per_second": 100.0, "loss": 1.0, "peak_memory_gb": 0.5, "step_time": 0.01})
    beat.on_batch_end(trainer, 4)
    record = json.loads((tmp_path / "heartbeat-1.json").read_text())
    assert (record["rank"], record["world_size"], record["state"], record["step"]) == (1, 2, "running", 4)
    assert record["samples_per_second"] == 50.0  # this rank's share of the global rate
    assert record["peak_memory_gb"] >= 0.5 and record["timing"] == {"step_time": 0.01}
    assert not (tmp_path / "heartbeat-0.json").exists()


def test_a_failing_run_says_so_in_its_heartbeat(tmp_path):
    class Boom(Callback):
        def on_batch_end(self, trainer, step):
            if step == 3:
                raise RuntimeError("disk on fire")

    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8, report_every="2 steps", run_dir=str(tmp_path))
    x = np.zeros((64, 4), np.float32)
    with pytest.raises(RuntimeError, match="disk on fire"):
        trainer.train((x, np.zeros(64, np.int32)), epochs=1, callbacks=[Boom()])
    record = json.loads((tmp_path / "heartbeat-0.json").read_text())
    assert (record["state"], record["step"], record["error"]) == ("failed", 3, "RuntimeError: disk on fire")
    assert record["samples_per_second"] > 0 and "time_data" in record["timing"]
    assert RunReader(tmp_path).read().state == "failed"


# -- the step-time breakdown ------------------------------------------------------------

class SlowSource:
    """A map-style dataset whose reads take a known time, like a slow disk."""

    def __init__(self, n=96, delay=0.001):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 32)).astype(np.float32)
        self.y = rng.integers(0, 4, size=n).astype(np.int32)
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


class Stopwatch(Callback):
    """Wall time between reports, measured from outside the Trainer."""

    def __init__(self):
        self.marks, self.logs = [], []

    def on_report(self, trainer, logs):
        self.marks.append((time.perf_counter(), trainer.step))
        self.logs.append(logs)


def test_step_time_breakdown_adds_up_to_the_measured_step_time(tmp_path):
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    batch, delay = 8, 0.001
    trainer = Trainer(model, optim.Adam(1e-3), batch_size=batch, num_workers=0, report_every="6 steps",
                      checkpoint_every="4 steps", run_dir=str(tmp_path / "run"), max_steps=36)
    watch = Stopwatch()
    trainer.train(SlowSource(delay=delay), epochs=3, checkpoint_dir=str(tmp_path / "ckpt"), callbacks=[watch])
    assert len(watch.logs) == 6
    for (t0, s0), (t1, s1), logs in zip(watch.marks, watch.marks[1:], watch.logs[1:], strict=False):
        parts = logs["time_data"] + logs["time_compute"] + logs["time_comm"] + logs["time_checkpoint"]
        assert parts == pytest.approx(logs["step_time"], rel=0.10)
        assert logs["step_time"] * (s1 - s0) == pytest.approx(t1 - t0, rel=0.10)  # measured from outside
        assert logs["time_data"] >= batch * delay  # the loader's sleep is counted as waiting for data
        assert logs["time_checkpoint"] > 0 and logs["time_comm"] == 0.0
    rows = _rows(tmp_path / "run", "train")
    assert [r["step_time"] for r in rows] == [log["step_time"] for log in watch.logs]


def test_comm_seconds_hook_is_reported_and_taken_out_of_compute():
    class Grab(Callback):
        logs = []

        def on_report(self, trainer, logs):
            self.logs.append(logs)

    x = np.zeros((64, 4), np.float32)
    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8, report_every="4 steps")
    trainer.comm_seconds = 1e-9
    trainer.train((x, np.zeros(64, np.int32)), epochs=1, callbacks=[Grab()])
    assert all(log["time_comm"] == 1e-9 for log in Grab.logs)
    trainer.comm_seconds = 1e3  # more than the whole step: capped at the step's own time
    trainer.train(epochs=1, callbacks=[Grab()])
    assert Grab.logs[-1]["time_compute"] == 0.0 and 0 < Grab.logs[-1]["time_comm"] < 1e3


# -- monitor --once -----------------------------------------------------------------------

def test_monitor_once_on_a_finished_run_prints_its_numbers(finished_run, capsys):
    code, out, _ = _once(capsys, finished_run, "--performance")
    assert code == 0
    last, val, epoch = (_rows(finished_run, kind)[-1] for kind in ("train", "val", "epoch"))
    assert "FINISHED" in out and f"step {last['step']}/{last['step']} (100%)" in out and "epoch 2/2" in out
    assert f"latest (step {last['step']})" in out
    assert re.search(rf"train loss\s+{last['loss']:.4f}", out)
    assert re.search(rf"val loss\s+{val['val_loss']:.4f}", out)
    assert re.search(rf"val accuracy\s+{val['val_accuracy']:.4f}", out)
    assert re.search(rf"train loss/epoch\s+{epoch['train_loss']:.4f}", out)
    assert re.search(rf"learning rate\s+{last['learning_rate']:.3e}", out)
    assert re.search(rf"samples/s\s+{last['samples_per_second']:,.0f}", out)
    assert re.search(rf"peak memory\s+{last['peak_memory_gb']:.3f} GB", out)
    assert f"latest checkpoint: checkpoints/step-{last['step']:08d}" in out and "(3 kept)" in out
    assert "where step time goes" in out and "waiting for data" in out and "checkpointing" in out
    # One steps/s for the run: the header's, in rank 0's row; the step-time panel's is labelled as another thing.
    header = re.search(r"· ([\d,.]+) steps/s", out).group(1)
    assert re.search(rf"\b0\s+\S+\s+\d+\s+finished\s+\d+\s+{re.escape(header)}\s", out), out
    assert re.search(r"[\d,.]+ steps/s of training", out)
    assert "━━ train loss" in out and "━━ val loss" in out and re.search("[\u2801-\u28ff]", out)  # curves drawn


def test_monitor_without_argument_takes_the_latest_run(finished_run, tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    shutil.copytree(finished_run, runs / "older")
    time.sleep(0.05)
    shutil.copytree(finished_run, runs / "newer")
    (runs / "newer" / "config.yaml").touch()
    monkeypatch.chdir(tmp_path)
    code, out, _ = _once(capsys)
    assert code == 0 and str(Path("runs") / "newer") in out


def test_monitor_errors_say_what_to_pass(tmp_path, finished_run, capsys):
    code, _, err = _once(capsys, "--runs", tmp_path / "nothing")
    assert code == 2 and "no run directory under" in err and "pass RUN_DIR" in err
    shutil.copytree(finished_run, tmp_path / "runs" / "a")
    code, _, err = _once(capsys, tmp_path / "runs")
    assert code == 2 and "is not a run directory; it contains the runs a: pass one of them" in err
    code, _, err = _once(capsys, tmp_path / "missing")
    assert code == 2 and "does not exist" in err


def test_a_stale_heartbeat_is_flagged(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    path = run_dir / "heartbeat-0.json"
    beat = json.loads(path.read_text())
    beat.update(state="running", time=time.time() - 600, pid=os.getpid())
    path.write_text(json.dumps(beat))
    code, out, _ = _once(capsys, run_dir, "--stale-after", "60")
    assert code == 0 and "STALE" in out
    assert f"rank 0: heartbeat is stale, last beat 10m00s ago at step {beat['step']} (limit 60s)" in out
    beat["time"] = time.time() - 5  # fresh again
    path.write_text(json.dumps(beat))
    _, out, _ = _once(capsys, run_dir)
    assert "STALE" not in out and "RUNNING" in out


def test_stale_limit_follows_slow_steps_and_validation():
    now = time.time()
    beat = {"state": "running", "time": now - 100, "interval": 2.0, "pid": os.getpid()}
    assert rank_status(beat, now, 60).status == "stale"
    assert rank_status({**beat, "steps_per_second": 0.04}, now, 60).status == "running"  # 25 s a step
    assert rank_status({**beat, "val_time": 80.0}, now, 60).status == "running"
    assert rank_status({**beat, "state": "finished"}, now, 60).status == "finished"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    gone = rank_status({**beat, "time": now, "pid": int(done.stdout), "host": socket.gethostname()}, now, 60)
    assert gone.status == "gone" and gone.flagged


# -- a run in progress ------------------------------------------------------------------

@pytest.mark.slow
def test_monitor_once_on_a_run_in_progress(live_run, capsys):
    process, run_dir = live_run["process"], live_run["run_dir"]
    process.send_signal(signal.SIGSTOP)  # hold the writer still while the snapshot is compared
    try:
        code, out, _ = _once(capsys, run_dir)
        train, val = _rows(run_dir, "train"), _rows(run_dir, "val")
    finally:
        process.send_signal(signal.SIGCONT)
    assert code == 0 and "RUNNING" in out
    last = train[-1]
    assert f"latest (step {last['step']})" in out
    assert re.search(rf"train loss\s+{last['loss']:.4f}", out)
    assert re.search(rf"val loss\s+{val[-1]['val_loss']:.4f}", out)
    assert re.search(rf"learning rate\s+{last['learning_rate']:.3e}", out)
    assert re.search(rf"samples/s\s+{last['samples_per_second']:,.0f}", out)
    total = json.loads((run_dir / "heartbeat-0.json").read_text())["total_steps"]
    assert total % int(LIVE_EPOCHS) == 0  # whole epochs
    assert re.search(rf"step {last['step']}/{total} \(0%\)", out)
    assert re.search(rf"\b{process.pid}\s+running\b", out)


@pytest.mark.slow
def test_live_dashboard_in_a_pseudo_terminal(live_run):
    import pexpect  # pexpect and pyte (a terminal emulator) are in the dev extra
    import pyte

    rows, cols = 50, 120
    screen = pyte.Screen(cols, rows)
    stream = pyte.ByteStream(screen)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(TERM="xterm-256color", LANG="C.UTF-8")
    # preexec_fn: Ctrl-C's default action in the monitor, whatever this process inherited (a suite started in the
    # background by a non-interactive shell ignores SIGINT, and the monitor would never quit).
    child = pexpect.spawn(sys.executable, ["-m", "mlx_train", "monitor", str(live_run["run_dir"]), "--interval",
                                           "0.2", "--performance"], dimensions=(rows, cols), env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    frames = bytearray()  # the monitor's output not yet fed to the screen: a frame starts at cursor-home

    def screen_when(done, what):
        """The screen of the first whole frame that satisfies ``done`` (a frame is whole once the next begins)."""
        deadline = time.monotonic() + 600  # only ends a hung monitor or run: both report as they go
        while True:
            try:
                frames.extend(child.read_nonblocking(1 << 16, timeout=0.1))
            except pexpect.TIMEOUT:
                pass
            while (end := frames.find(FRAME_START, 1)) != -1:
                stream.feed(bytes(frames[:end]))
                del frames[:end]
                text = "\n".join(screen.display)
                if done(text):
                    return text
            assert time.monotonic() < deadline, f"the monitor never showed {what}:\n" + "\n".join(screen.display)

    def latest_step(text):
        found = re.search(r"latest \(step (\d+)\)", text)
        return int(found.group(1)) if found else None

    try:
        first = screen_when(lambda text: latest_step(text) is not None, "a step")
        second = screen_when(lambda text: (latest_step(text) or 0) > latest_step(first), "a later step")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=600)  # only ends a monitor that does not quit
        child.wait()  # its exit status (close() gives a process not yet reaped 0.1 s, then kills it)
    finally:
        child.close(force=True)
    Path(os.environ.get("MLX_TRAIN_SCREEN", os.devnull)).write_text(second)
    assert latest_step(first) is not None and latest_step(second) > latest_step(first), second
    for text in (first, second):
        assert f"mlx-train monitor  {live_run['run_dir']}" in text and "RUNNING" in text
        assert "loss" in text and "learning rate" in text and "throughput" in text
        assert "where step time goes" in text and re.search(rf"\b{live_run['process'].pid}\s+running", text)
        assert "Ctrl-C quits" in text
    assert re.search("[\u2801-\u28ff]", second)  # the loss curve
    assert child.exitstatus == 0


@pytest.mark.slow
def test_status_lists_the_run_in_progress(live_run, capsys):
    capsys.readouterr()
    assert main(["status", "--runs", str(live_run["root"])]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("live "))
    assert re.search(r"running\s+\d+/\d+\s+[\d,.]+\s+[\d,]+\s+\d+s ago\s+1$", line.strip()), line
    assert "backends:" in out and "default device:" in out


@pytest.mark.slow
def test_a_killed_run_is_flagged(live_run, capsys):
    process = live_run["process"]
    process.kill()  # SIGKILL: no chance to say goodbye
    process.wait(timeout=30)
    code, out, _ = _once(capsys, live_run["run_dir"])
    assert code == 0 and "STOPPED" in out and f"rank 0: process {process.pid} is gone (killed?)" in out
    assert re.search(r"\bGONE\b", out)
    capsys.readouterr()
    main(["status", "--runs", str(live_run["root"])])
    assert "none (--all lists finished and stopped runs too)" in capsys.readouterr().out


# -- pieces -------------------------------------------------------------------------------

def test_reader_reads_only_complete_new_lines_and_notices_a_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "time": 1.0, "loss": 2.0}\n{"kind": "train", "st')
    reader = RunReader(tmp_path)
    assert [r["step"] for r in reader.read().train] == [1]
    with open(path, "a") as f:
        f.write('ep": 2, "time": 2.0, "loss": 1.5}\n')
    assert [r["loss"] for r in reader.read().train] == [2.0, 1.5]
    path.write_text('{"kind": "train", "step": 1, "time": 3.0, "loss": 9.0}\n'
                    '{"kind": "train", "step": 2, "time": 4.0, "loss": 8.0}\n')  # rewritten by a resume
    assert [r["loss"] for r in reader.read().train] == [9.0, 8.0]


def test_line_chart_fits_its_box_and_draws_every_series():
    chart = line_chart([Series("a", [0, 1, 2, 3], [3.0, 2.0, 1.5, 1.0], "cyan"),
                        Series("b", [1, 3], [2.5, 1.2], "magenta")], width=50, height=10)
    lines = chart.plain.split("\n")
    assert len(lines) == 10 and max(len(line) for line in lines) <= 50
    assert "━━ a 1" in lines[-1] and "━━ b 1.2" in lines[-1]
    styles = {span.style for span in chart.spans}
    assert {"cyan", "magenta"} <= styles
    assert line_chart([Series("a", [], [])], 40, 8).plain == "no data yet"


def test_best_of_a_metric_the_direction_rule_cannot_place_is_quiet(recwarn):
    from mlx_train.monitor.run import RunSnapshot

    val = [{"step": 2, "val_kappa": 3.0}, {"step": 4, "val_kappa": 1.0}]
    snapshot = RunSnapshot("runs/a", {}, [], val, [], [], [], [], 0.0)
    assert snapshot.best("val_kappa") == (1.0, 4)  # shown as lower-is-better, like metric_direction
    assert not [w for w in recwarn if "cannot tell which way" in str(w.message)]
