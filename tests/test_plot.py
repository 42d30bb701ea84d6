"""`mlx-train plot`: one line per series, checked in the figure and in the PNG written."""

import json
import sys

import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from matplotlib.colors import to_rgb  # matplotlib: the 'plot' extra, in dev
from matplotlib.image import imread

from mlx_train.cli.main import main
from mlx_train.monitor.plot import plot_run
from mlx_train.training import Trainer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plot") / "run"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    trainer = Trainer(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)),
                      optim.Adam(optim.cosine_decay(1e-2, 100)), batch_size=16, report_every="4 steps",
                      run_dir=str(run_dir), max_grad_norm=5.0)
    trainer.train((x, y), (x[:64], y[:64]), epochs=4)
    return run_dir


def _rows(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


@pytest.mark.slow
def test_plot_has_one_line_per_series_with_the_logged_values(run_dir, tmp_path):
    figure = plot_run(run_dir, tmp_path / "curves.png")
    axes = {ax.get_title(): ax for ax in figure.axes}
    assert list(axes) == ["loss", "validation metrics", "learning rate", "throughput", "gradient norm",
                          "peak memory", "step time"]
    train, val = _rows(run_dir, "train"), _rows(run_dir, "val")
    expected = {
        ("loss", "train loss"): ("loss", train), ("loss", "val loss"): ("val_loss", val),
        ("validation metrics", "val accuracy"): ("val_accuracy", val),
        ("learning rate", "learning rate"): ("learning_rate", train),
        ("throughput", "samples/s"): ("samples_per_second", train),
        ("gradient norm", "grad norm"): ("grad_norm", train),
        ("step time", "data"): ("time_data", train),
    }
    for (title, label), (key, rows) in expected.items():
        lines = {line.get_label(): line for line in axes[title].get_lines()}
        steps, values = lines[label].get_data()
        scale = 1e3 if key.startswith("time_") else 1.0  # step times are drawn in milliseconds
        assert list(steps) == [r["step"] for r in rows]
        assert np.allclose(values, [r[key] * scale for r in rows])
    assert [line.get_label() for line in axes["step time"].get_lines()] == [
        "step time", "data", "compute", "communication", "checkpointing"]
    assert [line.get_label() for line in axes["loss"].get_lines()] == ["train loss", "val loss"]


@pytest.mark.slow
def test_the_png_shows_the_figure(run_dir, tmp_path):
    out = tmp_path / "sub" / "curves.png"
    assert main(["plot", str(run_dir), "-o", str(out), "--dpi", "50"]) == 0
    image = imread(out)
    figure = plot_run(run_dir)
    width, height = figure.get_size_inches() * 50
    assert image.shape[:2] == (round(height), round(width))
    pixels = image[..., :3].reshape(-1, 3)
    for color in ("C0", "C1"):  # the first two series' colours are drawn
        near = np.abs(pixels - np.array(to_rgb(color))).max(axis=1) < 0.05
        assert near.sum() > 50, color


@pytest.mark.slow
def test_plot_selected_metrics_and_errors(run_dir, tmp_path, capsys):
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "loss.svg"), "--metrics", "loss,val_loss"]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "loss.svg").read_text().startswith("<?xml")
    figure = plot_run(run_dir, keys=["learning_rate"])
    assert [ax.get_title() for ax in figure.axes] == ["learning rate"]
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "x.nope")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert main(["plot", str(run_dir), "--metrics", "nothing_like_this"]) == 2
    assert "unknown metric nothing_like_this; " in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(run_dir, monkeypatch):
    from mlx_train.errors import ConfigError

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match=r"pip install 'mlx-train\[plot\]'"):
        plot_run(run_dir)
