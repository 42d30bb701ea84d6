"""Built-in datasets: digits split, the stdlib text corpus, options and errors."""

import sys

import numpy as np
import pytest

from mlx_train.builtin.datasets import available_datasets, load_dataset, stdlib_corpus
from mlx_train.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


@pytest.fixture(scope="module")
def text():
    return load_dataset("text")


def test_available_datasets():
    assert available_datasets() == ["digits", "text"]


def test_digits_arrays(digits):
    assert digits["info"] == {
        "name": "digits", "task": "classification", "in_dims": 64, "num_classes": 10,
        "image_shape": (8, 8, 1),
    }
    sizes = {split: len(digits[split][0]) for split in ("train", "val", "test")}
    assert sizes == {"train": 1258, "val": 180, "test": 359}
    for split in ("train", "val", "test"):
        x, y = digits[split]
        assert x.dtype == np.float32 and x.shape[1:] == (64,) and y.dtype == np.int32
        assert x.min() == 0.0 and x.max() == 1.0
        assert set(np.unique(y)) == set(range(10))  # stratified: every class in every split


def test_digits_splits_are_disjoint_and_complete(digits):
    rows = np.concatenate([digits[s][0] for s in ("train", "val", "test")])
    assert len(rows) == 1797
    # Digits has a few duplicate images; the split must still use each sample once.
    from sklearn.datasets import load_digits

    original = np.sort((load_digits().data / 16.0).astype(np.float32), axis=0)
    assert np.array_equal(np.sort(rows, axis=0), original)


def test_digits_split_follows_the_seed(digits):
    again = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert np.array_equal(again["train"][0], digits["train"][0])
    assert np.array_equal(again["test"][1], digits["test"][1])
    assert not np.array_equal(other["train"][1], digits["train"][1])


def test_digits_as_images(digits):
    images = load_dataset("digits", seed=0, as_images=True)
    assert images["train"][0].shape == (1258, 8, 8, 1)
    assert np.array_equal(images["train"][0].reshape(-1, 64), digits["train"][0])


@pytest.mark.slow
def test_text_corpus_is_deterministic_and_nontrivial():
    corpus = stdlib_corpus()
    rebuilt = stdlib_corpus.__wrapped__()  # bypass the cache: parse the sources again
    assert corpus == rebuilt
    assert len(corpus) > 100_000
    assert len(set(corpus)) < 200
    assert "Return" in corpus and "argument" in corpus


@pytest.mark.slow
def test_text_tokens(text):
    info = text["info"]
    assert info["task"] == "language_modeling" and info["block_size"] == 64
    assert info["vocab_size"] == len(info["vocab"]) < 200
    assert info["vocab"] == "".join(sorted(info["vocab"]))
    train = text["train"]["tokens"]
    assert train.dtype == np.int32 and train.shape[1] == 65
    assert len(text["val"]["tokens"]) > 0 and len(text["test"]["tokens"]) > 0
    assert train.min() >= 0 and train.max() < info["vocab_size"]
    # Chunks start every block_size characters: each row's last token starts the next row.
    assert np.array_equal(train[:-1, -1], train[1:, 0])
    decoded = "".join(info["vocab"][i] for i in train[0])
    assert decoded == stdlib_corpus()[:65]


@pytest.mark.slow
def test_text_split_is_contiguous_90_5_5(text):
    counts = {s: text[s]["tokens"].shape[0] * 64 for s in ("train", "val", "test")}
    total = len(stdlib_corpus())
    assert abs(counts["train"] - 0.9 * total) < 200
    assert abs(counts["val"] - 0.05 * total) < 200


def test_text_from_a_file(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 100, encoding="utf-8")
    data = load_dataset("text", block_size=8, path=str(path))
    assert data["info"]["vocab"] == " .abcdefghijklmnopqrstuvwxyz"
    assert data["train"]["tokens"].shape == ((int(4500 * 0.9) - 1) // 8, 9)
    with pytest.raises(DataError, match=r"the val split of the 'text' dataset has 225 characters, "
                                        r"fewer than block_size \+ 1 = 301"):
        load_dataset("text", block_size=300, path=str(path))
    with pytest.raises(DataError, match=r"cannot read the text file .*missing.txt"):
        load_dataset("text", path=str(tmp_path / "missing.txt"))


def test_unknown_dataset_suggests_closest():
    with pytest.raises(ConfigError,
                       match=r"unknown dataset 'digit' \(did you mean 'digits'\?\); built-in datasets: digits, text"):
        load_dataset("digit")


def test_unknown_or_mistyped_option():
    with pytest.raises(ConfigError, match=r"unknown option 'as_image' for dataset 'digits' "
                                          r"\(did you mean 'as_images'\?\); valid options: as_images"):
        load_dataset("digits", as_image=True)
    with pytest.raises(ConfigError, match=r"option 'block_size' of dataset 'text' must be an integer, got '64'"):
        load_dataset("text", block_size="64")
    with pytest.raises(ConfigError, match=r"option 'block_size' of dataset 'text' must be positive, got 0"):
        load_dataset("text", block_size=0)


def test_missing_scikit_learn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"needs scikit-learn.*pip install 'mlx-train\[examples\]'"):
        load_dataset("digits")
