"""The plain report line (ProgressBar without a terminal): its fields, in order, as one write per report."""

from __future__ import annotations

import io

from mlx_train.training.loggers import ProgressBar, format_report

BASE = {"step": 10, "epoch": 0, "loss": 1.23456, "learning_rate": 1e-3, "samples_per_second": 2791.4,
        "peak_memory_gb": 0.0123}


def test_the_report_line_names_each_field_in_order():
    assert format_report(BASE) == "step 10 | epoch 1 | loss 1.2346 | lr 1.000e-03 | 2791 samples/s | peak mem 0.012 GB"
    full = {**BASE, "tokens_per_second": 12.44, "grad_norm": 0.5}
    assert format_report(full) == ("step 10 | epoch 1 | loss 1.2346 | lr 1.000e-03 | 12.4 tok/s | 2791 samples/s | "
                                   "grad_norm 0.500 | peak mem 0.012 GB")
    assert "grad_norm" not in format_report({**BASE, "grad_norm": 0.0})  # no clipping: no norm to show


def test_a_plain_progress_bar_writes_one_line_per_report():
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, live=False)
    bar.on_report(None, BASE)  # type: ignore[arg-type]  # the trainer is not read for a plain line
    bar.on_report(None, {**BASE, "step": 20})  # type: ignore[arg-type]
    assert stream.getvalue().splitlines() == [format_report(BASE), format_report({**BASE, "step": 20})]
    assert stream.getvalue().endswith("\n")
