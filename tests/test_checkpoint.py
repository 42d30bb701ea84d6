"""Checkpoints: round trips, async saves, retention, torn/corrupt detection, SIGKILL mid-save, fsspec URLs."""

import builtins
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
import warnings

import mlx.core as mx
import numpy as np
import pytest
from helpers_checkpoint_kill import arrays_for

import mlx_train.checkpointing.manager as manager_module
import mlx_train.checkpointing.storage as storage_module
from mlx_train.checkpointing import CheckpointManager, CheckpointWarning, load_checkpoint
from mlx_train.errors import CheckpointError, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(step: int) -> dict:
    return {"model": {"w": mx.full((4,), float(step))}, "optimizer": {"step": mx.array(step)}}


def assert_arrays_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for group in want:
        assert got[group].keys() == want[group].keys(), group
        for key, value in want[group].items():
            assert got[group][key].dtype == value.dtype, (group, key)
            assert got[group][key].shape == value.shape, (group, key)
            assert mx.array_equal(got[group][key], value).item(), (group, key)


def saved(directory, steps_and_losses, **options) -> CheckpointManager:
    manager = CheckpointManager(str(directory), async_save=False, **options)
    for step, loss in steps_and_losses:
        manager.save(step, small(step), {"step": step}, {"val_loss": loss})
    return manager


# ---------------------------------------------------------------- round trips
def test_round_trip_of_every_dtype_and_the_state(tmp_path):
    arrays = {
        "model": {"layers.0.weight": mx.random.normal((3, 5)), "layers.0.bias": mx.zeros((5,)),
                  "embed": mx.random.normal((4, 2)).astype(mx.bfloat16)},
        "optimizer": {"step": mx.array(7, dtype=mx.uint64), "mask": mx.array([0, 2**32 - 1], dtype=mx.uint32),
                      "ids": mx.array([-3, 4], dtype=mx.int32), "big": mx.array([2**40], dtype=mx.int64)},
        "callbacks": {},
    }
    state = {"epoch": 3, "lr": 1e-3, "rng": [1, 2], "loader": {"epoch": 3, "position": 0},
             "history": {"val_loss": [0.5, float("inf")]}, "pair": (1, "a"), "none": None,
             "np_scalar": np.float32(0.25), "mx_scalar": mx.array(5)}
    manager = CheckpointManager(str(tmp_path), keep_last=None)
    path = manager.save(300, arrays, state, {"val_loss": 0.25})
    manager.wait()

    assert path == str(tmp_path / "step-00000300")
    assert sorted(os.listdir(tmp_path)) == ["step-00000300"]
    assert sorted(os.listdir(path)) == ["callbacks.safetensors", "manifest.json", "model.safetensors",
                                        "optimizer.safetensors", "trainer_state.json"]
    got_arrays, got_state = load_checkpoint(path)
    assert_arrays_equal(got_arrays, arrays)
    assert got_state == {**state, "pair": [1, "a"], "np_scalar": 0.25, "mx_scalar": 5}

    manifest = json.loads((tmp_path / "step-00000300" / "manifest.json").read_text())
    assert manifest["step"] == 300 and manifest["metrics"] == {"val_loss": 0.25}
    assert manifest["files"]["model.safetensors"]["size"] == os.path.getsize(os.path.join(path, "model.safetensors"))
    assert len(manifest["files"]["trainer_state.json"]["sha256"]) == 64
    info = manager.latest()
    assert (info.step, info.path, info.metrics) == (300, path, {"val_loss": 0.25})


@pytest.mark.parametrize("url", ["local", "memory"])
def test_where_a_writer_thread_must_not_read_mlx_arrays_the_save_serialises_on_the_callers_thread(
        tmp_path, monkeypatch, url):
    # On CUDA a background thread reading MLX arrays that the training thread uses can crash the process.
    monkeypatch.setattr(manager_module, "_writer_needs_host_bytes", lambda: True)
    saved_on = []
    real_save = storage_module.mx.save_safetensors

    def recording_save(*args, **kwargs):
        saved_on.append(threading.current_thread() is threading.main_thread())
        return real_save(*args, **kwargs)

    monkeypatch.setattr(storage_module.mx, "save_safetensors", recording_save)
    arrays = {"model": {"w": mx.random.normal((3, 5)), "e": mx.random.normal((4, 2)).astype(mx.bfloat16)},
              "optimizer": {"step": mx.array(7, dtype=mx.uint64), "m": mx.ones((2, 2), dtype=mx.float16)}}
    directory = str(tmp_path) if url == "local" else f"memory://staged-{uuid.uuid4().hex[:8]}"
    manager = CheckpointManager(directory, keep_last=None)
    path = manager.save(5, arrays, {"step": 5})
    manager.wait()

    assert saved_on == [True, True]  # both groups serialised on this thread, none on the writer's
    got_arrays, got_state = load_checkpoint(path)
    assert_arrays_equal(got_arrays, arrays)
    assert got_state == {"step": 5}


def test_load_only_some_groups_and_unknown_group(tmp_path):
    saved(tmp_path, [(1, 0.5)])
    path = str(tmp_path / "step-00000001")
    with open(os.path.join(path, "optimizer.safetensors"), "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x7f")  # corrupt the group we do not ask for
    arrays, state = load_checkpoint(path, groups=["model"])
    assert list(arrays) == ["model"] and state == {"step": 1}
    with pytest.raises(CheckpointError, match=r"has no array group 'opt' \(it has: model, optimizer\)"):
        load_checkpoint(path, groups=["opt"])


def test_save_takes_a_snapshot_of_the_callers_dicts(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    arrays, state = small(1), {"epoch": 1, "nested": {"a": 1}}
    manager.save(1, arrays, state)
    arrays["model"]["w"] = mx.zeros((4,))
    arrays["extra"] = {"x": mx.ones((1,))}
    state["epoch"], state["nested"]["a"] = 99, 99
    manager.wait()
    got_arrays, got_state = load_checkpoint(manager.latest().path)
    assert_arrays_equal(got_arrays, small(1))
    assert got_state == {"epoch": 1, "nested": {"a": 1}}


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = saved(tmp_path, [(5, 0.5)])
    manager.save(5, {"model": {"w": mx.ones((2,))}}, {"again": True})
    arrays, state = load_checkpoint(manager.latest().path)
    assert state == {"again": True} and list(arrays) == ["model"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000005"]


# ---------------------------------------------------------------- async
def test_async_save_returns_before_writing_and_one_save_at_a_time(tmp_path, monkeypatch):
    release, paused = threading.Event(), threading.Event()

    def blocking_pause(point, where):
        if point == "model.safetensors":
            paused.set()
            release.wait()

    monkeypatch.setattr(manager_module, "_pause_point", blocking_pause)
    manager = CheckpointManager(str(tmp_path), keep_last=None)
    manager.save(1, small(1), {"step": 1})
    assert paused.wait(30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the in-flight temporary directory is not reported as a leftover
        assert manager.latest() is None and manager.checkpoints() == []

    arrays = small(2)
    mx.eval(arrays)  # MLX evaluates lazy arrays only on the thread that owns their stream
    second = threading.Thread(target=manager.save, args=(2, arrays, {"step": 2}))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # at most one save in flight: the second waits for the first
    release.set()
    second.join()
    manager.wait()
    assert [info.step for info in manager.checkpoints()] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]


def test_lazy_arrays_saved_from_another_thread_get_a_clear_error(tmp_path):
    manager, lazy, errors = CheckpointManager(str(tmp_path)), small(1), []

    def save_in_thread():
        try:
            manager.save(1, lazy, {})
        except CheckpointError as error:
            errors.append(str(error))

    thread = threading.Thread(target=save_in_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and re.match(r"save\(\) got arrays that are not evaluated yet, on a thread without an "
                                         r"MLX stream .*: call mx.eval on them first", errors[0])


@pytest.mark.parametrize("host_bytes", [False, True], ids=["arrays", "host-bytes"])
def test_background_error_is_raised_by_wait_and_by_the_next_save(tmp_path, monkeypatch, host_bytes):
    monkeypatch.setattr(manager_module, "_writer_needs_host_bytes", lambda: host_bytes)
    manager = CheckpointManager(str(tmp_path), keep_last=None)
    manager.save(1, small(1), {"step": 1})
    manager.wait()
    real_write = storage_module.LocalStore.write_safetensors

    def full_disk(self, rel, arrays):
        if rel.endswith("optimizer.safetensors"):
            raise OSError(28, "No space left on device")
        return real_write(self, rel, arrays)

    monkeypatch.setattr(storage_module.LocalStore, "write_safetensors", full_disk)
    expected = r"saving checkpoint .*step-00000002 failed \(OSError: .*No space left on device\); earlier checkpoints"
    manager.save(2, small(2), {"step": 2})
    with pytest.raises(CheckpointError, match=expected):
        manager.wait()
    manager.save(3, small(3), {"step": 3})
    with pytest.raises(CheckpointError, match=expected.replace("00000002", "00000003")):
        manager.save(4, small(4), {"step": 4})
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]  # failed saves leave nothing behind

    monkeypatch.setattr(storage_module.LocalStore, "write_safetensors", real_write)
    manager.save(5, small(5), {"step": 5})
    manager.wait()
    assert [info.step for info in manager.checkpoints()] == [1, 5]


# ---------------------------------------------------------------- retention
def test_retention_keeps_last_n_and_the_best_even_when_old(tmp_path):
    manager = saved(tmp_path, [(1, 0.1), (2, 0.5), (3, 0.4), (4, 0.6), (5, 0.7)], keep_last=2, keep_best=1)
    assert [info.step for info in manager.checkpoints()] == [1, 4, 5]
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000004", "step-00000005"]


def test_retention_max_mode_and_nan_never_best(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=1, keep_best=2, monitor="val_accuracy", mode="auto",
                                async_save=False)
    for step, accuracy in [(1, 0.9), (2, float("nan")), (3, 0.95), (4, 0.2), (5, 0.3)]:
        manager.save(step, small(step), {}, {"val_accuracy": accuracy})
    assert [info.step for info in manager.checkpoints()] == [1, 3, 5]


def test_retention_never_deletes_the_newest_checkpoint(tmp_path):
    manager = saved(tmp_path, [(1, 0.1), (2, 0.9), (3, 0.8)], keep_last=0, keep_best=1)
    assert [info.step for info in manager.checkpoints()] == [1, 3]
    manager = saved(tmp_path / "b", [(1, 0.1), (2, 0.9)], keep_last=0, keep_best=0)
    assert [info.step for info in manager.checkpoints()] == [2]
    manager = saved(tmp_path / "c", [(1, 0.1), (2, 0.9), (3, 0.3)], keep_last=None)
    assert [info.step for info in manager.checkpoints()] == [1, 2, 3]
    manager = saved(tmp_path / "d", [(1, 0.1), (2, 0.9)], keep_last=3)  # fewer than keep_last: keep all
    assert [info.step for info in manager.checkpoints()] == [1, 2]


def test_after_resuming_from_an_older_checkpoint_the_new_saves_count_as_newest(tmp_path):
    saved(tmp_path, [(100, 0.5), (200, 0.5), (300, 0.5)], keep_last=None)
    manager = saved(tmp_path, [(150, 0.5)], keep_last=2)  # a run resumed from step 100
    assert manager.latest().step == 150
    assert [info.step for info in manager.checkpoints()] == [300, 150]
    manager.save(160, small(160), {})
    assert [info.step for info in manager.checkpoints()] == [150, 160]


# ---------------------------------------------------------------- torn and corrupt checkpoints
def _remove(path, name):
    os.remove(os.path.join(path, name))


def _truncate(path, name):
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, name)) - 3)


def _flip_last_byte(path, name):
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def _flip_a_recorded_hash(path, name):
    """One flipped character inside the sha256 the manifest records for model.safetensors (the file is intact)."""
    with open(os.path.join(path, name), "r+b") as f:
        data = f.read()
        at = data.index(b'"sha256": "') + len(b'"sha256": "')
        f.seek(at)
        f.write(b"0" if data[at:at + 1] != b"0" else b"1")


def _garble(path, name):
    with open(os.path.join(path, name), "w") as f:
        f.write('{"format": "mlx-train-checkpoint", ')


DAMAGE = {
    "manifest missing": (_remove, "manifest.json", r"is missing manifest\.json \(written by an interrupted save\?\)"),
    "file missing": (_remove, "optimizer.safetensors",
                     r"is missing optimizer\.safetensors \(written by an interrupted save\?\)"),
    "file truncated": (_truncate, "model.safetensors", r"has a truncated model\.safetensors \(\d+ of \d+ bytes"),
    "sha mismatch": (_flip_last_byte, "model.safetensors",
                     r"has a corrupt model\.safetensors \(its sha256 does not match manifest\.json"),
    "state sha mismatch": (_flip_last_byte, "trainer_state.json", r"has a corrupt trainer_state\.json"),
    "manifest unreadable": (_garble, "manifest.json", r"has an unreadable manifest\.json \("),
    "manifest byte flipped": (_flip_a_recorded_hash, "manifest.json",
                              r"has a damaged manifest\.json \(its own checksum, manifest_sha256, does not match its "
                              r"content.*the files it describes were not blamed"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_torn_or_corrupt_checkpoint_is_skipped_reported_and_refused(tmp_path, damage):
    damage_fn, file_name, reason = DAMAGE[damage]
    saved(tmp_path, [(100, 0.5), (200, 0.4)], keep_last=None)
    bad, good = str(tmp_path / "step-00000200"), str(tmp_path / "step-00000100")
    damage_fn(bad, file_name)

    manager = CheckpointManager(str(tmp_path))
    with pytest.warns(CheckpointWarning, match=re.escape(bad) + " " + reason + ".*; skipped it, using "
                      + re.escape(good)):
        assert manager.latest().path == good
    assert_arrays_equal(load_checkpoint(good)[0], small(100))
    message = (re.escape(f"checkpoint {bad} ") + reason + ".*; the last complete checkpoint is "
               + re.escape(f"{good}: resume with --resume {good}") + "$")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match=message):
        manager.resolve(bad)
    assert manager.resolve("auto") == good


def test_leftover_temporary_directory_is_ignored_reported_and_refused(tmp_path):
    saved(tmp_path, [(100, 0.5)])
    leftover = tmp_path / "step-00000200.tmp-0123abcd"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    manager = CheckpointManager(str(tmp_path))
    with pytest.warns(CheckpointWarning, match=re.escape(str(leftover)) + " is a temporary directory left by an "
                      r"interrupted save \(ignored; safe to delete\)"):
        assert manager.latest().step == 100
    with pytest.raises(CheckpointError, match=r"is a temporary directory left by an interrupted save, not a "
                       r"checkpoint .*; the last complete checkpoint is .*step-00000100: resume with --resume"):
        load_checkpoint(str(leftover))
    manager.save(300, small(300), {})
    manager.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-00000100", "step-00000300"]  # the next save cleans it up


def test_no_complete_checkpoint_left_says_start_without_resume(tmp_path):
    saved(tmp_path, [(100, 0.5)])
    os.remove(tmp_path / "step-00000100" / "trainer_state.json")
    with pytest.warns(CheckpointWarning, match="is missing trainer_state.json .*; skipped it$"):
        assert CheckpointManager(str(tmp_path)).latest() is None
    with pytest.raises(CheckpointError, match=r"is missing trainer_state\.json \(written by an interrupted save\?\); "
                       f"there is no complete checkpoint in {re.escape(str(tmp_path))}: start without --resume$"):
        load_checkpoint(str(tmp_path / "step-00000100"))


def test_a_step_directory_without_its_manifest_was_never_committed(tmp_path):
    saved(tmp_path, [(100, 0.5)])
    os.remove(tmp_path / "step-00000100" / "manifest.json")  # a directory left half-written (a copy cut short)
    manager = CheckpointManager(str(tmp_path), keep_last=1, async_save=False)
    with pytest.warns(CheckpointWarning, match=r"step-00000100 is missing manifest\.json .*; skipped it$"):
        assert manager.resolve("auto") is None
    assert not manager.has_step_directories()  # nothing was committed: a resume starts over, it does not refuse
    manager.save(200, small(200), {"step": 200})
    assert sorted(os.listdir(tmp_path)) == ["step-00000200"]  # the uncommitted one is cleaned up by the next save


def test_resolve_accepts_auto_names_and_run_directories(tmp_path):
    empty = CheckpointManager(str(tmp_path / "empty"))
    assert empty.resolve(None) is None and empty.resolve("auto") is None
    manager = saved(tmp_path / "run", [(100, 0.5), (200, 0.4)], keep_last=None)
    step_100 = str(tmp_path / "run" / "step-00000100")
    assert manager.resolve("step-00000100") == step_100
    assert empty.resolve(str(tmp_path / "run")) == str(tmp_path / "run" / "step-00000200")
    with pytest.raises(CheckpointError, match=r"checkpoint step-00000999 does not exist; the last complete "
                       r"checkpoint is .*step-00000200: resume with --resume"):
        manager.resolve("step-00000999")


# ---------------------------------------------------------------- a real SIGKILL in the middle of a save
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause_after", ["model.safetensors", "trainer_state.json", "manifest.json", "commit"])
def test_sigkill_during_a_save_never_hides_the_previous_checkpoint(tmp_path, pause_after):
    directory = str(tmp_path / "ckpt")
    first = CheckpointManager(directory, keep_last=1, async_save=False)
    first.save(100, arrays_for(100), {"step": 100}, {"val_loss": 0.01})

    env = {**os.environ, "MLX_TRAIN_SAVE_PAUSE_AFTER": pause_after,
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers_checkpoint_kill.py"),
                              directory, "200"], env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in child.stderr:  # wait until the writer announces the pause (the hook), then kill it
        seen.append(line)
        if "mlx-train test hook: save paused after " + pause_after in line:
            break
    assert child.poll() is None, "".join(seen)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    manager = CheckpointManager(directory, keep_last=1)
    expected_step = 200 if pause_after == "commit" else 100
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = manager.latest()
    assert info.step == expected_step
    arrays, state = load_checkpoint(info.path)
    assert_arrays_equal(arrays, arrays_for(expected_step))
    assert state == {"step": expected_step}
    leftovers = [name for name in os.listdir(directory) if ".tmp-" in name]
    assert len(leftovers) == (0 if pause_after == "commit" else 1)
    assert len([w for w in caught if "temporary directory left by an interrupted save" in str(w.message)]) \
        == len(leftovers)

    manager.save(300, arrays_for(300), {"step": 300})
    manager.wait()
    assert os.listdir(directory) == ["step-00000300"]  # retention ran; the leftover is gone


# ---------------------------------------------------------------- fsspec URLs
def test_memory_url_round_trip_retention_and_torn_detection():
    import fsspec

    url = f"memory://mlx-train-tests/{uuid.uuid4().hex}"
    try:
        manager = CheckpointManager(url, keep_last=2)
        for step in (1, 2, 3):
            assert manager.save(step, small(step), {"step": step}, {"val_loss": 1.0}) == f"{url}/step-{step:08d}"
        manager.wait()
        assert [info.step for info in manager.checkpoints()] == [2, 3]
        arrays, state = load_checkpoint(f"{url}/step-00000003")
        assert_arrays_equal(arrays, small(3)) and state == {"step": 3}

        fs = fsspec.filesystem("memory")
        fs.rm(url.replace("memory://", "/") + "/step-00000003/model.safetensors")
        with pytest.warns(CheckpointWarning, match="step-00000003 is missing model.safetensors"):
            assert CheckpointManager(url).latest().path == f"{url}/step-00000002"
        with pytest.raises(CheckpointError, match=f"the last complete checkpoint is {url}/step-00000002: "
                           f"resume with --resume {url}/step-00000002$"):
            load_checkpoint(f"{url}/step-00000003")
    finally:
        fsspec.filesystem("memory").rm(url.replace("memory://", "/"), recursive=True)


def test_file_url_round_trip(tmp_path):
    url = f"file://{tmp_path}/run"
    manager = CheckpointManager(url, keep_last=1)
    manager.save(7, arrays_for(7), {"step": 7})
    manager.save(8, arrays_for(8), {"step": 8})
    manager.wait()
    assert manager.latest().path == f"{url}/step-00000008"
    assert os.listdir(tmp_path / "run") == ["step-00000008"]
    arrays, state = load_checkpoint(manager.resolve("auto"))
    assert_arrays_equal(arrays, arrays_for(8)) and state == {"step": 8}


def test_unknown_scheme_and_missing_extras_name_the_fix(monkeypatch):
    with pytest.raises(CheckpointError, match=r"unknown storage scheme 'nope://'.*use a local path, file://"):
        CheckpointManager("nope://bucket/run")

    import fsspec.core

    def no_s3fs(url, **kwargs):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_s3fs)
    with pytest.raises(CheckpointError,
                       match=r"s3://bucket/run needs a storage back-end.*pip install 'mlx-train\[s3\]'"):
        CheckpointManager("s3://bucket/run")

    real_import = builtins.__import__

    def without_fsspec(name, *args, **kwargs):
        if name == "fsspec" or name.startswith("fsspec."):
            raise ImportError("No module named 'fsspec'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_fsspec)
    with pytest.raises(CheckpointError, match=r"gs://bucket/run is a gs:// URL, which needs fsspec: "
                       r"pip install 'mlx-train\[cloud\]'"):
        CheckpointManager("gs://bucket/run")
    CheckpointManager("plain/local/dir")  # local paths never import fsspec


# ---------------------------------------------------------------- bad arguments
def test_bad_arguments_say_what_and_how_to_fix(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    with pytest.raises(CheckpointError,
                       match=r"state\['callbacks'\]\[0\] is a function, which cannot be saved as JSON"):
        manager.save(1, small(1), {"callbacks": [lambda: 0]})
    with pytest.raises(CheckpointError, match=r"state\['rng'\] has the key 3 \(int\); JSON keys must be strings"):
        manager.save(1, small(1), {"rng": {3: "x"}})
    with pytest.raises(CheckpointError, match=r"arrays\['model'\]\['w'\] is a list; each group must map str names"):
        manager.save(1, {"model": {"w": [1.0]}}, {})
    with pytest.raises(CheckpointError, match=r"arrays\['model'\] must be a flat dict .*tree_flatten"):
        manager.save(1, {"model": [mx.ones((1,))]}, {})
    with pytest.raises(CheckpointError, match=r"array group name 'a/b' cannot be a file name"):
        manager.save(1, {"a/b": {}}, {})
    with pytest.raises(CheckpointError, match=r"step must be an int >= 0, got -1"):
        manager.save(-1, small(1), {})
    with pytest.raises(ConfigError, match=r"keep_last must be None \(keep all\) or an int >= 0, got -2"):
        CheckpointManager(str(tmp_path), keep_last=-2)
    with pytest.raises(ConfigError, match=r"mode must be 'min', 'max' or 'auto', got 'lowest'"):
        CheckpointManager(str(tmp_path), mode="lowest")
    assert os.listdir(tmp_path) == []
