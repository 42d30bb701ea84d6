"""DataLoader(worker_type="process"): the same batches as threads and no workers (order, resume, shards),
worker errors with the sample and the original message, workers kept across epochs, and no process
left behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from mlx_train.data import DataLoader, LengthBucketing, workers
from mlx_train.errors import DataError

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


class PythonWork:
    """Map-style samples built with Python work per sample: a dict with a token list and a label."""

    def __init__(self, n: int = 70) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        tokens = [(i * 7 + j * 3) % 50 + 1 for j in range(5 + i % 23)]
        return {"tokens": tokens, "label": i}


class Wide:
    """Samples of 40,000 float32 values: batches of 8 are over 1 MiB (the shared-memory path)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple:
        return np.arange(40_000, dtype=np.float32) + i, i


class Broken(PythonWork):
    def __getitem__(self, i: int) -> dict:
        if i == 13:
            raise KeyError("bad row 13")
        return super().__getitem__(i)


class Dies(PythonWork):
    def __getitem__(self, i: int) -> dict:
        if i == 7:
            os._exit(3)
        return super().__getitem__(i)


def as_numpy(batches) -> list:
    out = []
    for b in batches:
        items = b.items() if isinstance(b, dict) else enumerate(b)
        out.append({k: np.array(v) for k, v in items})
    return out


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), key


def loaders(dataset, **options) -> dict[str, DataLoader]:
    return {"none": DataLoader(dataset, num_workers=0, **options),
            "threads": DataLoader(dataset, num_workers=2, **options),
            "processes": DataLoader(dataset, num_workers=2, worker_type="process", **options)}


def close(runs: dict[str, DataLoader]) -> None:
    for loader in runs.values():
        loader.close()


def no_workers_left() -> bool:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return multiprocessing.active_children() == []


# ------------------------------------------------------------------ the same batches
@pytest.mark.parametrize("batching", [None, LengthBucketing(lengths="tokens")], ids=["fixed", "bucketed"])
def test_processes_threads_and_no_workers_give_the_same_batches_over_two_epochs(batching):
    runs = loaders(PythonWork(), batch_size=6, seed=4, batching=batching)
    epochs = {name: [as_numpy(loader)] for name, loader in runs.items()}
    pids = runs["processes"]._pool.pids()
    for name, loader in runs.items():
        epochs[name].append(as_numpy(loader))
    assert runs["processes"]._pool.pids() == pids  # the second epoch kept the workers
    for name in ("threads", "processes"):
        for epoch in (0, 1):
            assert_same(epochs[name][epoch], epochs["none"][epoch])
    assert not np.array_equal(epochs["none"][0][0]["label"], epochs["none"][1][0]["label"])  # a new order
    close(runs)
    assert no_workers_left()


def test_resume_mid_epoch_and_two_rank_shards_match_with_processes():
    reference = DataLoader(PythonWork(), batch_size=4, num_workers=0, seed=1)
    it = iter(reference)
    for _ in range(5):
        next(it)
    state = reference.state_dict()
    rest = as_numpy(it)
    for loader in loaders(PythonWork(), batch_size=4, seed=1).values():
        loader.load_state_dict(state)
        assert_same(as_numpy(loader), rest)
        loader.close()
    for rank in (0, 1):
        shards = loaders(PythonWork(), batch_size=3, seed=2)
        for loader in shards.values():
            loader.set_shard(rank, 2)
        expected = as_numpy(shards["none"])
        assert_same(as_numpy(shards["processes"]), expected)
        assert_same(as_numpy(shards["threads"]), expected)
        close(shards)
    assert no_workers_left()


def test_big_batches_come_back_through_shared_memory_and_are_freed():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    runs = loaders(Wide(), batch_size=8, seed=5)
    batch = next(iter(runs["none"]))
    assert sum(np.array(v).nbytes for v in batch) >= workers.SHARED_MEMORY_MIN_BYTES
    runs["none"].set_epoch(0)
    assert_same(as_numpy(runs["processes"]), as_numpy(runs["none"]))
    close(runs)
    assert no_workers_left()
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) - before == set()


# ------------------------------------------------------------------ errors
def test_a_worker_error_has_the_sample_and_the_original_message_and_stops_the_workers():
    loader = DataLoader(Broken(40), batch_size=4, shuffle=False, num_workers=2, worker_type="process")
    with pytest.raises(KeyError, match="bad row 13") as info:
        list(loader)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "sample 13" in notes and "data worker process" in notes and "__getitem__" in notes
    loader.set_epoch(0)
    with pytest.raises(KeyError, match="bad row 13"):  # the same workers, past the batches left in flight
        list(loader)
    loader.close()
    assert no_workers_left()


def test_a_worker_that_dies_is_reported_with_its_exit_code():
    loader = DataLoader(Dies(40), batch_size=4, shuffle=False, num_workers=2, worker_type="process")
    with pytest.raises(DataError, match=r"data worker process 1 \(pid \d+\) ended with exit code 3 while producing "
                                        r"batch 1"):
        list(loader)
    assert no_workers_left()


def test_process_workers_refuse_what_they_cannot_run():
    class Local(PythonWork):
        pass

    with pytest.raises(DataError, match="define the dataset class and collate function at module level"):
        list(DataLoader(Local(), batch_size=4, num_workers=2, worker_type="process"))
    with pytest.raises(DataError, match="define the dataset class"):
        list(DataLoader(PythonWork(), batch_size=4, num_workers=1, worker_type="process", collate_fn=lambda s: s))
    with pytest.raises(DataError, match="worker_type='process' needs random access"):
        DataLoader(iter(range(10)), batch_size=2, worker_type="process")
    with pytest.raises(DataError, match=r"worker_type must be one of 'thread', 'process', got 'processes' "
                                        r"\(did you mean 'process'\?\)"):
        DataLoader(PythonWork(), worker_type="processes")
    assert DataLoader(PythonWork()).replace(worker_type="process").worker_type == "process"
    assert no_workers_left()


# ------------------------------------------------------------------ shutdown
def test_an_abandoned_iteration_is_continued_and_close_or_collection_stops_the_workers():
    reference = as_numpy(DataLoader(PythonWork(200), batch_size=4, num_workers=0))
    loader = DataLoader(PythonWork(200), batch_size=4, num_workers=2, worker_type="process")
    it = iter(loader)
    first = as_numpy([next(it)])
    children = multiprocessing.active_children()
    assert len(children) == 2 and all(c.name.startswith(workers.PROCESS_PREFIX) for c in children)
    del it  # batches 1..4 are in flight: the next iteration drops them and continues at batch 1
    assert_same(first + as_numpy(loader), reference)
    loader.close()
    assert no_workers_left()
    next(iter(loader))  # a new epoch starts new workers
    assert len(multiprocessing.active_children()) == 2
    del loader
    gc.collect()
    assert no_workers_left()


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_no_worker_outlives_an_interrupted_or_killed_consumer(how):
    """A consumer in the middle of an epoch gets Ctrl-C (it stops its workers) or SIGKILL (its workers see
    their pipe close and exit): either way no worker process is left."""
    script = os.path.join(SCRIPTS, "process_loader_consumer.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SCRIPTS, *sys.path])}
    # Ctrl-C's default action in the consumer, whatever this process inherited (a suite started in the background
    # by a non-interactive shell ignores SIGINT, and so would the consumer).
    proc = subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)
    ready = proc.stdout.readline()  # the consumer prints its workers' pids once both have produced a batch
    pids = [int(pid) for pid in ready.split()]
    assert len(pids) == 2, (ready, proc.communicate())
    proc.send_signal(signal.SIGINT if how == "SIGINT" else signal.SIGKILL)
    out, err = proc.communicate(timeout=300)  # only ends a hung consumer
    if how == "SIGINT":
        assert "KeyboardInterrupt" in err and proc.returncode != 0
    deadline = time.monotonic() + 300  # only ends a worker that never exits; they exit as soon as they run
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids) == []
