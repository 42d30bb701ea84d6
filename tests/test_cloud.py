"""Checkpoints and published models on object stores, against real servers on 127.0.0.1.

S3: moto's standalone server (ThreadedMotoServer) through s3fs. GCS: gcp-storage-emulator through
gcsfs. Both are started by the fixtures below on a free port and stopped afterwards; fsspec's
config (what users set through FSSPEC_S3 / FSSPEC_GS or ~/.config/fsspec) points the clients at them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
import warnings

import fsspec
import fsspec.config
import gcp_storage_emulator.server as emulator
import gcsfs.core as gcsfs_core
import mlx.core as mx
import mlx.optimizers as optim
import moto.server as moto_server
import numpy as np
import pytest
import s3fs
from helpers_checkpoint_kill import arrays_for
from mlx.utils import tree_flatten

from mlx_train.builtin.models import MLP
from mlx_train.checkpointing import CheckpointManager, CheckpointWarning, load_checkpoint
from mlx_train.errors import CheckpointError, ConfigError
from mlx_train.publish import download, publish
from mlx_train.training import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "mlx-train-tests"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"}}
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(BUCKET)
    yield endpoint, options
    server.stop()


@pytest.fixture(scope="module")
def gcs_endpoint():
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    yield f"http://127.0.0.1:{port}", {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon",
                                       "project": "test"}
    server.stop()


@pytest.fixture(params=["s3", "gcs"])
def store(request, monkeypatch):
    """(URL of a fresh directory in the bucket, env for subprocesses, filesystem) for each back-end."""
    if request.param == "s3":
        _, options = request.getfixturevalue("s3_endpoint")
        scheme, env = "s3", {"FSSPEC_S3": json.dumps(options)}
    else:
        _, options = request.getfixturevalue("gcs_endpoint")
        # The emulator speaks the JSON API only: use gcsfs's plain client, not the one that probes
        # the bucket type over gRPC first (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false does the same).
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, gcsfs_core.GCSFileSystem, clobber=True)
        scheme, env = "gs", {"FSSPEC_GS": json.dumps(options), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    monkeypatch.setitem(fsspec.config.conf, scheme, options)
    url = f"{scheme}://{BUCKET}/{uuid.uuid4().hex[:12]}"
    return url, env, fsspec.filesystem(scheme)


def assert_arrays_equal(got, expected):
    assert got.keys() == expected.keys()
    for group in expected:
        assert got[group].keys() == expected[group].keys()
        for name, value in expected[group].items():
            assert got[group][name].dtype == value.dtype and mx.array_equal(got[group][name], value), name


def listing(fs, url):
    fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(url.split("://", 1)[1], detail=False))


def test_save_load_and_retention(store):
    url, _, fs = store
    manager = CheckpointManager(url, keep_last=2, keep_best=1)
    for step, loss in ((1, 0.1), (2, 0.5), (3, 0.4), (4, 0.3)):
        manager.save(step, arrays_for(step), {"step": step}, {"val_loss": loss})
    manager.wait()
    # keep the 2 newest (3, 4) and the best (1); step 2 is deleted from the bucket itself.
    assert listing(fs, url) == ["step-00000001", "step-00000003", "step-00000004"]
    assert listing(fs, f"{url}/step-00000004") == ["manifest.json", "model.safetensors",
                                                   "optimizer.safetensors", "trainer_state.json"]
    arrays, state = load_checkpoint(CheckpointManager(url).resolve("auto"))
    assert_arrays_equal(arrays, arrays_for(4)) and state == {"step": 4}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _trainer():
    mx.random.seed(3)
    return Trainer(MLP(8, (16,), 2), optim.Adam(learning_rate=1e-2), batch_size=16)


def test_resume_auto_from_the_url_continues_exactly(store, tmp_path):
    url, _, _ = store
    straight = _trainer()
    straight.train(_data(), epochs=3, checkpoint_dir=str(tmp_path / "local"))
    first = _trainer()
    first.train(_data(), epochs=2, checkpoint_dir=url)
    resumed = _trainer()
    history = resumed.train(_data(), epochs=3, checkpoint_dir=url, resume="auto")
    assert len(history["train_loss"]) == 3  # the two restored epochs plus the new one
    for (name, a), (_, b) in zip(tree_flatten(straight.model.parameters()), tree_flatten(resumed.model.parameters()),
                                 strict=False):
        assert mx.array_equal(a, b), name


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause_after", ["model.safetensors", "manifest.json"])
def test_a_save_killed_half_way_never_hides_the_previous_checkpoint(store, pause_after):
    url, env, fs = store
    CheckpointManager(url, keep_last=1, async_save=False).save(100, arrays_for(100), {"step": 100})
    child_env = {**os.environ, **env, "MLX_TRAIN_SAVE_PAUSE_AFTER": pause_after,
                 "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers_checkpoint_kill.py"), url, "200"],
                             env=child_env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in child.stderr:  # the writer announces the pause (its test hook); then it is killed
        seen.append(line)
        if "save paused after " + pause_after in line:
            break
    assert child.poll() is None, "".join(seen)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()

    names = listing(fs, url)
    assert "step-00000100" in names and any(".tmp-" in name for name in names)  # the torn save is there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = CheckpointManager(url, keep_last=1).resolve("auto")
    assert path == f"{url}/step-00000100"
    assert any("left by an interrupted save" in str(w.message) for w in caught)
    arrays, state = load_checkpoint(path)
    assert_arrays_equal(arrays, arrays_for(100)) and state == {"step": 100}


def test_a_checkpoint_without_its_manifest_is_incomplete(store):
    url, _, fs = store
    manager = CheckpointManager(url, keep_last=None, async_save=False)
    manager.save(1, arrays_for(1), {"step": 1})
    manager.save(2, arrays_for(2), {"step": 2})
    fs.rm(f"{url.split('://', 1)[1]}/step-00000002/manifest.json")  # what an upload cut before the end leaves
    with pytest.warns(CheckpointWarning, match="step-00000002"):
        assert CheckpointManager(url).resolve("auto") == f"{url}/step-00000001"


def test_missing_bucket_is_a_clear_error(store):
    url, _, _ = store
    missing = url.replace(BUCKET, "no-such-bucket-" + uuid.uuid4().hex[:6])
    manager = CheckpointManager(missing, async_save=False)
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*no-such-bucket-.*/step-00000001 failed .*; "
                       r"earlier checkpoints are untouched: the bucket does not exist: create it first"):
        manager.save(1, arrays_for(1), {"step": 1})
    with pytest.raises(CheckpointError, match=r"publishing to .*no-such-bucket-.* failed .*the bucket does not exist"):
        publish(MLP(4, (4,), 2), missing)


def test_bad_credentials_are_a_clear_error(s3_endpoint, gcs_endpoint, monkeypatch, tmp_path):
    import requests

    endpoint, options = s3_endpoint
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0").raise_for_status()  # the server now checks keys
    try:
        wrong = {**options, "key": "AKIAWRONGWRONGWRONG1", "secret": "wrong"}
        monkeypatch.setitem(fsspec.config.conf, "s3", wrong)
        manager = CheckpointManager(f"s3://{BUCKET}/denied", async_save=False)
        with pytest.raises(CheckpointError, match=r"failed \(PermissionError: .*the storage service refused the "
                           r"credentials: check AWS_ACCESS_KEY_ID"):
            manager.save(1, arrays_for(1), {"step": 1})
        with pytest.raises(CheckpointError, match=r"publishing to s3://.* failed \(PermissionError: .*refused the "
                           r"credentials"):
            publish(MLP(4, (4,), 2), f"s3://{BUCKET}/denied")
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf").raise_for_status()

    # gcsfs reads its credentials file when the client is created (the emulator itself accepts anyone).
    (tmp_path / "credentials.json").write_text('{"type": "authorized_user"}')
    monkeypatch.setitem(fsspec.config.conf, "gs", {**gcs_endpoint[1], "token": str(tmp_path / "credentials.json")})
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, gcsfs_core.GCSFileSystem, clobber=True)
    with pytest.raises(CheckpointError, match=r"could not open gs://.*/denied \(KeyError: .*\): check the "
                       r"credentials \(.*GOOGLE_APPLICATION_CREDENTIALS for gs://\)"):
        publish(MLP(4, (4,), 2), f"gs://{BUCKET}/denied")


def test_publish_then_download_the_final_model(store, tmp_path):
    url, _, fs = store
    model = MLP(8, (16,), 3)
    manifest = publish(model, f"{url}/model", [mx.zeros((1, 8))], formats=("safetensors", "onnx"),
                       config={"hidden_dims": [16]})
    assert sorted(manifest["files"]) == ["model.json", "model.onnx", "model.safetensors"]
    assert listing(fs, f"{url}/model") == ["model.json", "model.onnx", "model.safetensors", "publish.json"]
    folder = download(f"{url}/model", tmp_path / "copy")
    fresh = MLP(8, (16,), 3)
    fresh.load_weights(str(folder / "model.safetensors"))
    x = mx.random.normal((5, 8))
    assert mx.array_equal(fresh(x), model(x))
    assert json.loads((folder / "model.json").read_text())["config"] == {"hidden_dims": [16]}

    import onnxruntime

    session = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"input_0": np.array(x)})[0] - np.array(model(x))).max() <= 1e-4

    fs.pipe_file(f"{url.split('://', 1)[1]}/model/model.onnx", b"damaged")
    with pytest.raises(CheckpointError, match=r"model.onnx does not match publish.json"):
        download(f"{url}/model", tmp_path / "again")
    with pytest.raises(CheckpointError, match=r"holds no publish.json: nothing was published there"):
        download(f"{url}/elsewhere", tmp_path / "none")


def test_publish_to_a_local_directory_and_bad_arguments(tmp_path):
    model = MLP(4, (4,), 2)
    manifest = publish(model, str(tmp_path / "out"), formats=("safetensors",))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.json", "model.safetensors", "publish.json"]
    assert json.loads((tmp_path / "out" / "publish.json").read_text()) == manifest
    with pytest.raises(ConfigError, match=r"unknown publish format\(s\) \['tflite'\]; formats: safetensors, onnx"):
        publish(model, str(tmp_path / "x"), formats=("tflite",))
    with pytest.raises(ConfigError, match=r"publishing an onnx or mlxfn export needs example_inputs"):
        publish(model, str(tmp_path / "x"), formats=("onnx",))


def _kill_during(url, env, pause_after, step=200):
    """Start one save of ``step`` in a child process and SIGKILL it at the writer's pause point."""
    child_env = {**os.environ, **env, "MLX_TRAIN_SAVE_PAUSE_AFTER": pause_after,
                 "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers_checkpoint_kill.py"), url,
                              str(step)], env=child_env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in child.stderr:
        seen.append(line)
        if "save paused after " + pause_after in line:
            break
    assert child.poll() is None, "".join(seen)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_first_save_killed_during_its_upload_lets_the_run_start_over(store):
    url, env, fs = store
    _kill_during(url, env, "files moved")  # the data files are in step-00000200/, its manifest is not
    assert listing(fs, f"{url}/step-00000200") == ["model.safetensors", "optimizer.safetensors", "trainer_state.json"]

    straight = _trainer()
    straight.train(_data(), epochs=1)
    again = _trainer()
    with pytest.warns(CheckpointWarning, match=r"step-00000200 is missing manifest\.json"):
        again.train(_data(), epochs=1, checkpoint_dir=url, resume="auto")  # was: "nothing to resume from"
    for (name, a), (_, b) in zip(tree_flatten(straight.model.parameters()), tree_flatten(again.model.parameters()),
                                 strict=True):
        assert mx.array_equal(a, b), name
    assert listing(fs, url) == ["step-00000004"]  # the uncommitted upload is cleaned up by the next save


def test_a_bucket_deleted_during_the_run_is_an_error_and_never_recreated(store):
    url, _, fs = store
    bucket = "vanishing-" + uuid.uuid4().hex[:8]
    fs.mkdir(bucket)
    url = url.replace(BUCKET, bucket)
    manager = CheckpointManager(url, async_save=False)
    manager.save(1, arrays_for(1), {"step": 1})
    fs.rm(bucket, recursive=True)
    fs.invalidate_cache()
    assert not fs.exists(bucket)
    with pytest.raises(CheckpointError, match=rf"saving checkpoint {url}/step-00000002 failed: the bucket '{bucket}' "
                       r"no longer exists .*; it was deleted during the run, and every checkpoint saved in .* went "
                       r"with it\. mlx-train never creates buckets: re-create the bucket"):
        manager.save(2, arrays_for(2), {"step": 2})
    fs.invalidate_cache()
    assert not fs.exists(bucket)


def test_a_missing_bucket_is_found_before_training(store):
    url, _, _ = store
    missing = url.replace(BUCKET, "no-such-bucket-" + uuid.uuid4().hex[:6])
    trainer = _trainer()
    with pytest.raises(CheckpointError, match=r"checkpoint_dir .*no-such-bucket-.* cannot be used \(BucketMissing: "
                       r"the bucket '.*' does not exist\); mlx-train never creates buckets: create it first.* nothing "
                       r"was trained yet"):
        trainer.train(_data(), epochs=1, checkpoint_dir=missing)
    assert trainer.step == 0


@pytest.mark.slow
def test_evaluate_and_export_follow_a_run_whose_checkpoints_are_on_object_storage(store, tmp_path, capsys):
    from mlx_train.cli.main import main

    url, _, _ = store
    run = tmp_path / "run"
    tiny = ["--set", "model_options.hidden_dims=[16]", "--set", "checkpoint_every=2"]
    assert main(["train", "--max-steps", "4", *tiny, "--set", f"checkpoint_dir={url}", "--run-dir", str(run)]) == 0
    assert not (run / "checkpoints").exists()
    capsys.readouterr()
    for where in (str(run), url):
        assert main(["evaluate", "--checkpoint", where]) == 0, capsys.readouterr().err
        assert main(["export", "--checkpoint", where, "-o", str(tmp_path / "model.safetensors")]) == 0
        assert f"exported {url}/step-00000004 to " in capsys.readouterr().out


def test_a_bucket_deleted_in_the_middle_of_a_save_is_named_as_such(store, monkeypatch):
    """Not "a file is missing": the bucket went while the save was writing its files."""
    import mlx_train.checkpointing.manager as manager_module

    url, _, fs = store
    bucket = "vanishing-" + uuid.uuid4().hex[:8]
    fs.mkdir(bucket)
    url = url.replace(BUCKET, bucket)
    manager = CheckpointManager(url, async_save=False)
    manager.save(1, arrays_for(1), {"step": 1})

    def delete_the_bucket(point, where):
        if point == "model.safetensors" and fs.exists(bucket):
            fs.rm(bucket, recursive=True)
            fs.invalidate_cache()

    monkeypatch.setattr(manager_module, "_pause_point", delete_the_bucket)
    with pytest.raises(CheckpointError, match=rf"saving checkpoint {url}/step-00000002 failed: the bucket '{bucket}' "
                       r"no longer exists .*; it was deleted during the run"):
        manager.save(2, arrays_for(2), {"step": 2})
    fs.invalidate_cache()
    assert not fs.exists(bucket)


@pytest.mark.parametrize("blip", ["refused", "endpoint"])
def test_a_network_blip_during_a_save_is_retried_with_backoff(store, monkeypatch, blip):
    """The store stops answering after the first file; the save warns, waits and starts over, and the
    checkpoint is complete. The outage ends when the save reports its first retry (no timing guess)."""
    import botocore.exceptions

    import mlx_train.checkpointing.manager as manager_module

    url, _, fs = store
    manager = CheckpointManager(url, async_save=False)
    store_fs = manager._store.fs
    real_pipe = store_fs.pipe_file
    outage = {"on": False, "refused": 0}

    def pipe_file(path, data, **kwargs):
        if outage["on"]:
            outage["refused"] += 1
            if blip == "refused":
                raise ConnectionRefusedError(111, "Connection refused")
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
        return real_pipe(path, data, **kwargs)

    def start_the_outage(point, where):
        if point == "model.safetensors" and not outage["refused"]:
            outage["on"] = True

    monkeypatch.setattr(store_fs, "pipe_file", pipe_file)
    monkeypatch.setattr(manager_module, "_pause_point", start_the_outage)
    monkeypatch.setattr(manager_module, "RETRY_FIRST_DELAY", 0.01)
    shown = []

    def showwarning(message, category, *args, **kwargs):
        shown.append(str(message))
        if "retrying in" in str(message) and len(shown) == 2:
            outage["on"] = False  # the second retry finds the store back

    monkeypatch.setattr(warnings, "showwarning", showwarning)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = showwarning
        manager.save(1, arrays_for(1), {"step": 1})
    assert len(shown) == 2 and all("met a network error" in m and "retrying in" in m for m in shown), shown
    assert_arrays_equal(load_checkpoint(f"{url}/step-00000001")[0], arrays_for(1))

    outage["on"], outage["refused"] = False, 0
    manager.retry_seconds = 0.05  # an outage longer than the retries: the save fails, saying so
    monkeypatch.setattr(manager_module, "_pause_point",
                        lambda point, where: outage.update(on=True) if point == "model.safetensors" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"saving checkpoint .*step-00000002 failed .*earlier checkpoints are "
                                                  r"untouched"):
            manager.save(2, arrays_for(2), {"step": 2})
    assert outage["refused"] >= 2  # it did retry before giving up
    assert listing(fs, url) == ["step-00000001"]
