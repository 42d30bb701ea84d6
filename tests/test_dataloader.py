"""DataLoader: order, sharding, resume by arithmetic, prefetch threads, padding, batching."""

from __future__ import annotations

import json
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_train.data import (
    THREAD_PREFIX,
    DataLoader,
    LengthBucketing,
    RepeatedBatches,
    TokenBudget,
    default_collate,
    pad_collate,
)
from mlx_train.errors import DataError


def arrays(n: int = 100):
    x = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    return x, np.arange(n, dtype=np.int64)


def ids(batches) -> list[int]:
    """Sample ids of a list of batches whose last field (or 'y') holds the sample index."""
    out: list[int] = []
    for b in batches:
        out += (b["y"] if isinstance(b, dict) else b[-1]).tolist()
    return out


class Counting:
    """Map-style dataset of (x, index) samples that counts reads."""

    def __init__(self, n: int = 60, delay_every: int = 0) -> None:
        self.n, self.reads, self.delay_every = n, 0, delay_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads += 1
        if self.delay_every and i % self.delay_every == 0:
            time.sleep(0.002)  # uneven work: later batches may finish first on other workers
        return np.full(2, i, dtype=np.float32), i


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def wait_no_data_threads(seconds: float = 2.0) -> list[threading.Thread]:
    for t in data_threads():
        t.join(timeout=seconds)
    return data_threads()


# ------------------------------------------------------------------ order and batches
def test_arrays_order_is_the_seeded_permutation_and_dtypes_are_mlx_friendly():
    x, y = arrays(100)
    loader = DataLoader((x, y), batch_size=32, num_workers=0, seed=7)
    batches = list(loader)
    assert [b[0].shape for b in batches] == [(32, 3)] * 3 + [(4, 3)]
    assert batches[0][0].dtype == mx.float32 and batches[0][1].dtype == mx.int32
    assert ids(batches) == np.random.default_rng([7, 0]).permutation(100).tolist()
    assert np.array_equal(np.array(batches[0][0])[:, 0], 3 * np.array(batches[0][1]))
    assert loader.epoch == 1 and loader.position == 0
    assert ids(loader) == np.random.default_rng([7, 1]).permutation(100).tolist()


def test_dict_and_mlx_arrays_and_shuffle_false():
    x, y = arrays(10)
    loader = DataLoader({"x": mx.array(x), "y": y}, batch_size=4, shuffle=False, num_workers=0)
    batches = list(loader)
    assert set(batches[0]) == {"x", "y"} and ids(batches) == list(range(10))
    assert len(loader) == 3


def _values(batches) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v) for k, v in (b.items() if isinstance(b, dict) else enumerate(b))} for b in batches]


@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_small_arrays_held_by_mlx_give_the_batches_numpy_gives(monkeypatch, as_dict, shuffle):
    from mlx_train.data import sources

    x, y = arrays(100)
    data = {"x": x, "y": y} if as_dict else (x, y)
    resident = DataLoader(data, batch_size=32, shuffle=shuffle, num_workers=0, seed=4)
    held = [list(resident), list(resident)]  # two epochs: each its own order
    assert resident._source.resident() is not None
    monkeypatch.setattr(sources, "RESIDENT_MAX_BYTES", 0)  # the same data, batched through NumPy
    host = DataLoader(data, batch_size=32, shuffle=shuffle, num_workers=0, seed=4)
    assert host._source.resident() is None
    for mine, theirs in zip(held, [list(host), list(host)], strict=True):
        assert len(mine) == len(theirs) == 4
        for a, b in zip(mine, theirs, strict=True):
            assert type(a) is type(b)
            assert all(va.dtype == vb.dtype and va.shape == vb.shape for va, vb in
                       zip((a.values() if as_dict else a), (b.values() if as_dict else b), strict=True))
        mine_values, their_values = _values(mine), _values(theirs)
        assert all(m.keys() == t.keys() and all(np.array_equal(m[k], t[k]) for k in m)
                   for m, t in zip(mine_values, their_values, strict=True))


def test_resident_arrays_resume_mid_epoch_and_shard_as_numpy_ones():
    x, y = arrays(70)
    reference = list(DataLoader((x, y), batch_size=16, num_workers=0, seed=9))
    first = DataLoader((x, y), batch_size=16, num_workers=0, seed=9)
    it = iter(first)
    next(it)
    next(it)
    resumed = DataLoader((x, y), batch_size=16, num_workers=0, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert ids(resumed) == ids(reference[2:])
    halves = []
    for rank in range(2):
        loader = DataLoader((x, y), batch_size=8, num_workers=0, seed=9)
        loader.set_shard(rank, 2)
        halves.append(list(loader))
    assert ids([halves[0][0], halves[1][0]]) == ids(reference[:1])


def test_arrays_over_the_resident_limit_stay_in_numpy(monkeypatch):
    from mlx_train.data import sources

    x, y = arrays(100)
    monkeypatch.setattr(sources, "RESIDENT_MAX_BYTES", x.size * 4)  # x (float32) fits, x and y together do not
    loader = DataLoader((x, y), batch_size=32, num_workers=0, seed=1)
    assert ids(loader) == np.random.default_rng([1, 0]).permutation(100).tolist()
    assert loader._source.resident() is None


def test_batch_128_is_four_batches_of_32_and_drop_last():
    x, y = arrays(300)
    small = list(DataLoader((x, y), batch_size=32, num_workers=0, seed=3))
    big = list(DataLoader((x, y), batch_size=128, num_workers=0, seed=3))
    assert ids(big[:1]) == ids(small[:4]) and ids(big[1:2]) == ids(small[4:8])
    dropped = DataLoader((x, y), batch_size=128, num_workers=0, drop_last=True)
    assert len(dropped) == 2 and all(b[1].shape == (128,) for b in dropped)


def test_set_shard_takes_contiguous_slices_of_the_global_batch():
    x, y = arrays(70)
    whole = list(DataLoader((x, y), batch_size=32, num_workers=0, seed=1))
    ranks = []
    for rank in range(2):
        loader = DataLoader((x, y), batch_size=16, num_workers=0, seed=1)
        loader.set_shard(rank, 2)
        ranks.append(list(loader))
    assert len(ranks[0]) == len(ranks[1]) == len(whole) == 3
    for k in range(3):
        assert ids([ranks[0][k], ranks[1][k]]) == ids([whole[k]])
    assert [b[1].shape[0] for b in ranks[0]] == [16, 16, 3]  # the partial batch of 6 is split 3 + 3
    with pytest.raises(DataError, match=r"rank must be an integer in \[0, 1\]"):
        loader.set_shard(2, 2)


def test_fixed_layout_is_shared_across_epochs_read_only_and_the_order_stays_seeded():
    from mlx_train.data.batching import fixed_bounds, fixed_layout, plan_epoch, rank_slices

    x, y = arrays(70)
    for world_size, drop_last in ((1, False), (2, False), (2, True), (3, False)):
        for rank in range(world_size):
            loader = DataLoader((x, y), batch_size=8, num_workers=0, seed=5, drop_last=drop_last)
            loader.set_shard(rank, world_size)
            bounds = fixed_bounds(70, 8 * world_size, world_size, drop_last)
            starts, stops = rank_slices(bounds, rank, world_size)
            for epoch in range(3):
                order = np.random.default_rng([5, epoch]).permutation(70)
                assert len(loader) == len(starts)  # counted from the geometry: no order computed for it
                assert ids(loader) == [int(i) for a, b in zip(starts, stops, strict=True)
                                      for i in order[a:b]]
            plans = [plan_epoch(70, 5, e, True, (8, rank, world_size, drop_last)) for e in (0, 1)]
            assert plans[0].bounds is plans[1].bounds and plans[0].starts is plans[1].starts  # shared
            assert not np.array_equal(plans[0].order, plans[1].order)
    shared = fixed_layout(70, 8, 0, 1, False)[0]
    with pytest.raises(ValueError):
        shared[0] = 1  # a cached layout cannot be changed by one loader for all the others


def test_the_next_epochs_order_drawn_ahead_is_the_seeded_one_whatever_epoch_comes_next():
    x, y = arrays(70)
    loader = DataLoader((x, y), batch_size=8, num_workers=2, seed=3)  # background work allowed: drawn ahead
    for epoch in (0, 1, 2):
        assert ids(loader) == np.random.default_rng([3, epoch]).permutation(70).tolist()
    assert loader._ahead is not None and loader._ahead[0][0] == 3  # the next epoch, drawn while epoch 2 ran
    loader.set_epoch(7)  # not the epoch drawn ahead: planned on the spot
    assert ids(loader) == np.random.default_rng([3, 7]).permutation(70).tolist()
    state = loader.state_dict()
    resumed = DataLoader((x, y), batch_size=8, num_workers=2, seed=3)
    resumed.load_state_dict(state)
    assert ids(resumed) == ids(loader) == np.random.default_rng([3, 8]).permutation(70).tolist()
    assert DataLoader((x, y), batch_size=8, num_workers=0)._ahead is None and list(
        DataLoader((x, y), batch_size=8, num_workers=0))  # no background thread when asked for none
    synchronous = DataLoader((x, y), batch_size=8, num_workers=0, seed=3)
    list(synchronous)
    assert synchronous._ahead is None


# ------------------------------------------------------------------ resume by arithmetic
def test_resume_mid_epoch_reads_no_sample_and_continues_exactly():
    reference = list(DataLoader(Counting(), batch_size=8, num_workers=0, seed=5))
    first = DataLoader(Counting(), batch_size=8, num_workers=0, seed=5)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 0 and state["position"] == 3 and state["sample_offset"] == 24

    dataset = Counting()
    resumed = DataLoader(dataset, batch_size=8, num_workers=2, seed=5)
    resumed.load_state_dict(state)
    assert dataset.reads == 0  # restored by arithmetic: nothing read
    rest = list(resumed)
    assert ids(rest) == ids(reference[3:])
    assert dataset.reads == 60 - 24  # only the samples actually yielded
    assert resumed.epoch == 1


def test_resume_on_a_different_world_size_and_clear_errors():
    x, y = arrays(96)
    two = DataLoader((x, y), batch_size=16, num_workers=0, seed=2)
    two.set_shard(0, 2)
    it = iter(two)
    next(it), next(it)
    state = two.state_dict()
    one = DataLoader((x, y), batch_size=32, num_workers=0, seed=2)
    one.load_state_dict(state)
    assert one.position == 2
    whole = list(DataLoader((x, y), batch_size=32, num_workers=0, seed=2))
    assert ids(one) == ids(whole[2:])

    odd = DataLoader((x, y), batch_size=24, num_workers=0, seed=2)
    with pytest.raises(DataError, match=r"64 samples of epoch 0 .* not a batch boundary"):
        odd.load_state_dict(state)
    other_seed = DataLoader((x, y), batch_size=32, num_workers=0, seed=3)
    with pytest.raises(DataError, match=r"saved loader had seed=2 but this one has seed=3"):
        other_seed.load_state_dict(state)
    with pytest.raises(DataError, match=r"state is missing \['position'"):
        one.load_state_dict({k: v for k, v in state.items() if k != "position"})


def test_replace_keeps_position_in_samples():
    x, y = arrays(128)
    micro = DataLoader((x, y), batch_size=8, num_workers=0, seed=4)
    it = iter(micro)
    for _ in range(4):
        next(it)
    step = micro.replace(batch_size=32)
    assert step.position == 1 and step.epoch == 0 and step.batch_size == 32
    reference = list(DataLoader((x, y), batch_size=32, num_workers=0, seed=4))
    assert ids(step) == ids(reference[1:])
    next(it)
    with pytest.raises(DataError, match=r"cannot keep the position in replace\(\): 40 samples"):
        micro.replace(batch_size=32)
    with pytest.raises(DataError, match=r"unknown option 'batch_sise' \(did you mean 'batch_size'\?\)"):
        micro.replace(batch_sise=4)


# ------------------------------------------------------------------ prefetch threads
def test_workers_keep_order_and_position_counts_yielded_batches():
    sync = list(DataLoader(Counting(97, delay_every=3), batch_size=5, num_workers=0, seed=9))
    loader = DataLoader(Counting(97, delay_every=3), batch_size=5, num_workers=3, seed=9)
    it = iter(loader)
    first = next(it)
    time.sleep(0.05)  # let workers read ahead
    assert loader.position == 1 and loader.dataset.reads > 5
    assert ids([first, *it]) == ids(sync)


def test_big_array_batches_are_gathered_on_worker_threads_in_order():
    x = np.arange(64 * 70_000, dtype=np.float32).reshape(64, 70_000)  # 4 rows: > 1 MiB per batch
    y = np.arange(64)
    sync = list(DataLoader((x, y), batch_size=4, num_workers=0, seed=2))
    loader = DataLoader((x, y), batch_size=4, num_workers=2, seed=2)
    it = iter(loader)
    batches = [next(it)]
    assert data_threads()  # big batches go through the prefetch threads
    batches += list(it)
    assert ids(batches) == ids(sync)
    assert all(np.array_equal(np.array(a[0]), np.array(b[0])) for a, b in zip(batches, sync, strict=True))


def test_abandoned_iteration_leaves_no_thread_alive():
    loader = DataLoader(Counting(400), batch_size=4, num_workers=2)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert wait_no_data_threads() == []
    it = iter(loader)
    next(it)
    assert data_threads()  # prefetching is on
    del it
    assert wait_no_data_threads() == []
    assert loader.position == 4 and loader.epoch == 0


def test_worker_error_reaches_the_consumer_and_threads_stop():
    class Broken(Counting):
        def __getitem__(self, i):
            if i == 13:
                raise KeyError("bad row 13")
            return super().__getitem__(i)

    with pytest.raises(KeyError, match="bad row 13") as info:
        list(DataLoader(Broken(40), batch_size=4, shuffle=False, num_workers=2))
    assert any("sample 13" in note for note in getattr(info.value, "__notes__", []))
    assert wait_no_data_threads() == []


# ------------------------------------------------------------------ collation and padding
def test_token_sequences_are_padded_to_multiples_of_32_with_masks():
    batch = default_collate([[1, 2, 3], list(range(1, 41))])
    assert batch["tokens"].shape == (2, 64) and batch["tokens"].dtype == np.int32
    assert batch["mask"].sum(axis=1).tolist() == [3, 40] and batch["tokens"][0, 3] == 0
    samples = [{"ids": np.array([5, 6]), "label": 1}, {"ids": np.array([7]), "label": 0}]
    rows = pad_collate(samples, multiple=8)
    assert set(rows) == {"ids", "ids_mask", "label"}
    assert rows["ids"].tolist() == [[5, 6] + [0] * 6, [7] + [0] * 7]
    pairs = default_collate([([4, 5, 6], 1), ([7], 0)])
    assert len(pairs) == 2 and pairs[0].shape == (2, 32)  # tuples keep their arity
    loader = DataLoader([[1, 2], [3, 4, 5]], batch_size=2, shuffle=False, num_workers=0)
    out = next(iter(loader))
    assert out["tokens"].dtype == mx.int32 and out["tokens"].shape == (2, 32)


def test_float_feature_lists_are_stacked_not_padded():
    # What a Hugging Face dataset yields in its default (Python) format: dicts of Python lists.
    rng = np.random.default_rng(0)
    rows = [{"features": rng.normal(size=8).tolist(), "label": int(i % 3)} for i in range(6)]
    batch = default_collate(rows[:4])
    assert set(batch) == {"features", "label"}
    assert batch["features"].shape == (4, 8) and batch["features"].dtype == np.float32
    np.testing.assert_allclose(batch["features"], np.array([r["features"] for r in rows[:4]]), rtol=1e-6)
    loader = DataLoader(rows, batch_size=3, shuffle=False, num_workers=0)
    assert [b["features"].shape for b in loader] == [(3, 8), (3, 8)]
    bare = default_collate([[0.5, 1.5], [2.5, 3.5]])
    assert len(bare) == 1 and bare[0].tolist() == [[0.5, 1.5], [2.5, 3.5]]
    pairs = default_collate([([0.5, 1.5], 1), ([2.5, 3.5], 0)])
    assert pairs[0].shape == (2, 2) and pairs[1].tolist() == [1, 0]


def test_ragged_float_rows_and_integer_lists_are_still_padded():
    ragged = default_collate([{"x": [0.5, 1.5, 2.5]}, {"x": [3.5]}])
    assert ragged["x"].shape == (2, 32) and ragged["x"].dtype == np.float32
    assert ragged["x_mask"].sum(axis=1).tolist() == [3, 1]
    same_length_ids = default_collate([{"ids": [1, 2]}, {"ids": [3, 4]}])
    assert same_length_ids["ids"].shape == (2, 32) and "ids_mask" in same_length_ids


def test_refused_padding_names_it_and_the_numpy_format():
    rows = [{"image": [[0.0, 1.0], [2.0, 3.0]]}, {"image": [[0.0, 1.0]]}]
    with pytest.raises(DataError, match=r'padded.*with_format\("numpy"\)'):
        default_collate(rows)


def sequence_rows(n: int = 600):
    rng = np.random.default_rng(0)
    sizes = rng.integers(4, 300, n)
    return [{"tokens": rng.integers(1, 100, size).tolist(), "y": i} for i, size in enumerate(sizes)]


def waste(batches) -> float:
    real = sum(int(b["tokens_mask"].sum().item()) for b in batches)
    return 1 - real / sum(b["tokens_mask"].size for b in batches)


def test_length_bucketing_wastes_less_padding_and_is_deterministic_and_resumable():
    rows = sequence_rows()
    plain = list(DataLoader(rows, batch_size=16, num_workers=0, seed=1))

    def make() -> DataLoader:
        return DataLoader(rows, batch_size=16, num_workers=0, seed=1, batching=LengthBucketing("tokens"))

    bucketed = list(make())
    assert sorted(ids(bucketed)) == list(range(600))
    assert waste(bucketed) < 0.15 < 0.4 < waste(plain)  # rounding to 32 alone wastes ~10%
    padded = [b["tokens"].shape[1] for b in bucketed]
    assert len(set(padded)) <= 10 and padded != sorted(padded)  # few shapes; batch order shuffled
    assert ids(bucketed) == ids(make())  # same (seed, epoch), same batches
    loader = make()
    it = iter(loader)
    for _ in range(5):
        next(it)
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert ids(resumed) == ids(bucketed[5:])


@pytest.mark.parametrize("inner", [None, "bucketed"])
def test_repeated_batches_hand_each_batch_out_times_in_a_row_and_resume_inside_a_repeat(inner):
    rows = sequence_rows(50)

    def make(times: int, world_size: int = 1, rank: int = 0, batch_size: int = 4) -> DataLoader:
        batching = None if inner is None else LengthBucketing("tokens")
        loader = DataLoader(rows, batch_size=batch_size, num_workers=0, seed=2, drop_last=True,
                            batching=RepeatedBatches(batching, times) if times > 1 else batching)
        if world_size > 1:
            loader.set_shard(rank, world_size)
        return loader

    once, thrice = list(make(1)), list(make(3))
    assert len(thrice) == 3 * len(once) == 3 * 12
    assert [ids([b]) for b in thrice] == [ids([b]) for b in once for _ in range(3)]
    loader = make(3)
    it = iter(loader)
    for _ in range(7):  # inside the third batch's repeats
        next(it)
    resumed = make(3)
    resumed.load_state_dict(loader.state_dict())
    assert [ids([b]) for b in resumed] == [ids([b]) for b in thrice[7:]]
    halves = [[ids([b]) for b in make(3, 2, r)] for r in range(2)]  # two ranks: each its half, repeated alike
    assert [a + b for a, b in zip(*halves, strict=True)] == [ids([b]) for b in make(3, batch_size=8)]
    with pytest.raises(DataError, match="batching"):
        make(2).load_state_dict(loader.state_dict())


def test_token_budget_batches_fit_the_budget_and_cover_every_sample():
    rows = sequence_rows(400)
    loader = DataLoader(rows, num_workers=2, seed=0, batching=TokenBudget(max_tokens=2048, lengths="tokens"))
    batches = list(loader)
    assert all(b["tokens"].size <= 2048 for b in batches)
    assert sorted(ids(batches)) == list(range(400))
    assert len({b["tokens"].shape[0] for b in batches}) > 3  # dynamic batch sizes
    too_long = r"sample \d+ has \d+ tokens \(padded to \d+\), more than TokenBudget max_tokens=64"
    with pytest.raises(DataError, match=too_long):
        len(DataLoader(rows, batching=TokenBudget(max_tokens=64, lengths="tokens")))


# ------------------------------------------------------------------ map-style and iterables
def test_hugging_face_like_dataset_uses_getitems():
    class Rows:
        column_names = ["input_ids", "label"]

        def __init__(self):
            self.batched = 0

        def __len__(self):
            return 10

        def __getitem__(self, i):
            if isinstance(i, str):
                return [[1] * (j + 1) for j in range(10)]
            return {"input_ids": [1] * (i + 1), "label": i}

        def __getitems__(self, keys):
            self.batched += 1
            return [self[k] for k in keys]

    data = Rows()
    batches = list(DataLoader(data, batch_size=4, num_workers=0, batching=LengthBucketing("input_ids")))
    assert data.batched == 3 and sorted(sum((b["label"].tolist() for b in batches), [])) == list(range(10))


class Stream:
    """A re-iterable stream with state_dict/load_state_dict (position of the next item)."""

    def __init__(self, n: int = 23) -> None:
        self.n, self.start, self.at = n, 0, 0

    def __iter__(self):
        self.at, self.start = self.start, 0
        while self.at < self.n:
            self.at += 1
            yield np.float32(self.at - 1), self.at - 1

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["at"]


def test_iterables_stream_in_order_and_resume_only_with_state():
    loader = DataLoader(Stream(), batch_size=5, num_workers=1)
    assert ids(loader) == list(range(23)) and loader.epoch == 1
    with pytest.raises(TypeError, match="has no length"):
        len(loader)
    it = iter(loader)
    next(it), next(it)
    resumed = DataLoader(Stream(), batch_size=5, num_workers=0)
    resumed.load_state_dict(loader.state_dict())
    assert ids(resumed) == list(range(10, 23))

    plain = DataLoader(iter(range(30)), batch_size=4, num_workers=0)
    it = iter(plain)
    next(it)
    with pytest.raises(DataError, match=r"cannot resume in the middle of epoch 0 \(after 4 items\)"):
        DataLoader(iter(range(30)), batch_size=4).load_state_dict(plain.state_dict())
    list(it)
    with pytest.raises(DataError, match="one-shot iterator, exhausted after the first epoch"):
        list(plain)


def test_abandoned_stream_continues_exactly_or_says_why_not():
    sync = DataLoader(iter(range(30)), batch_size=4, num_workers=0)
    for _ in sync:
        break
    assert [v for b in sync for v in b[0].tolist()] == list(range(4, 30))  # the live iterator continues
    stateful = DataLoader(Stream(), batch_size=5, num_workers=1)
    for _ in stateful:
        break
    assert ids(stateful) == list(range(5, 23))  # read-ahead dropped, restored from the state
    ahead = DataLoader(iter(range(30)), batch_size=4, num_workers=1)
    for _ in ahead:
        break
    with pytest.raises(DataError, match=r"cannot continue epoch 0 after 4 items: .* use num_workers=0"):
        list(ahead)


# ------------------------------------------------------------------ bad input
X5 = np.zeros((5, 2))
BAD_INPUT = [
    (lambda: DataLoader((X5, np.zeros(4))), r"different lengths \(0 of the tuple: 5, 1 of the tuple: 4\)"),
    (lambda: DataLoader({"x": X5, "y": np.zeros(3)}), r"'x': 5, 'y': 3"),
    (lambda: DataLoader((X5,), batch_size=0), r"batch_size must be a positive integer, got 0"),
    (lambda: DataLoader([]), r"dataset is empty \(0 samples"),
    (lambda: DataLoader("train.csv"), r"a file name is not a dataset"),
    (lambda: DataLoader((X5,), num_workers=-1), r"num_workers must be an integer >= 0"),
    (lambda: DataLoader(({"a": [[1], [1, 2]]},)), r"array 0 of the tuple is ragged"),
    (lambda: len(DataLoader((X5,), batch_size=8, drop_last=True)), r"fewer than one global batch of 8"),
    (lambda: list(DataLoader(["a", "b"], num_workers=0)), r"dataset sample \d is a str; expected a tuple"),
    (
        lambda: list(DataLoader([(np.zeros(2), 1), (np.zeros(3), 0)], shuffle=False, num_workers=0)),
        r"field 0 of dataset sample 1 has shape \(3,\) but dataset sample 0 has \(2,\)",
    ),
    (
        lambda: list(DataLoader([{"a": 1}, {"b": 2}], shuffle=False, num_workers=0)),
        r"dataset sample 1 does not match dataset sample 0: expected key 'a'",
    ),
    (lambda: len(DataLoader((X5,), batching=LengthBucketing())), r"arrays datasets are rectangular"),
    (
        lambda: list(DataLoader([{"x": [1], "text": "hi"}], num_workers=0)),
        r"field 'text' of dataset sample 0 holds str",
    ),
]


@pytest.mark.parametrize("make, match", BAD_INPUT)
def test_bad_input_gets_a_clear_data_error(make, match):
    with pytest.raises(DataError, match=match):
        make()
