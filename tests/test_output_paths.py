"""A file a command writes where the user said: a bad place is one sentence before any work, from the CLI and Python."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_train.cli.main import main
from mlx_train.errors import ConfigError
from mlx_train.export import export
from mlx_train.monitor.plot import plot_run
from mlx_train.paths import writable_file


def test_a_directory_is_refused_with_an_example_name(tmp_path):
    with pytest.raises(ConfigError, match=rf"^the output {tmp_path} is a directory: give the name of a file"):
        writable_file(tmp_path, "the output")


def test_a_pseudo_file_system_is_refused():
    with pytest.raises(ConfigError, match=r"^the output /proc/x\.onnx cannot be written: its folder /proc refuses new "
                                          r"files \(.*\); choose a file in a folder you can write to"):
        writable_file("/proc/x.onnx", "the output")


def test_a_folder_that_cannot_be_made(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"its folder .*a-file/sub cannot be made \(.*\); choose a file"):
        writable_file(tmp_path / "a-file" / "sub" / "m.onnx", "the output")


def test_missing_folders_are_made(tmp_path):
    target = tmp_path / "new" / "deeper" / "m.onnx"
    assert writable_file(target, "the output") == str(target)
    assert target.parent.is_dir() and not target.exists() and list(target.parent.iterdir()) == []


def test_python_export_and_plot_refuse_a_directory(tmp_path):
    (tmp_path / "d.onnx").mkdir()
    with pytest.raises(ConfigError, match="the export's output .*d.onnx is a directory"):
        export(nn.Linear(3, 2), [mx.zeros((1, 3))], tmp_path / "d.onnx")
    with pytest.raises(ConfigError, match="the plot's output .* is a directory"):
        plot_run(tmp_path / "no-run", tmp_path)


@pytest.mark.parametrize("command", [["export", "--checkpoint", "no-such-run", "--format", "onnx"], ["plot", "no-run"]])
def test_cli_bad_output_is_one_sentence_before_any_work(command, capsys):
    assert main([*command, "-o", "/proc/out.file"]) == 2
    err = capsys.readouterr().err
    assert "output" in err and "/proc/out.file cannot be written" in err and "unexpected error" not in err
