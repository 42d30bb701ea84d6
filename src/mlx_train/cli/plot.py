"""Draw a run's curves into an image: loss, validation metrics, learning rate, throughput,
gradient norm, peak memory and step time, one line per series (needs the 'plot' extra:
pip install 'mlx-train[plot]').

Example::

    from mlx_train.monitor.plot import plot_run
    plot_run("runs/a", "curves.png")
"""

from __future__ import annotations

import argparse
import os

EPILOG = """examples:
  mlx-train plot runs/a -o curves.png
  mlx-train plot runs/a -o loss.svg --metrics loss,val_loss
  mlx-train plot                            # the latest run under ./runs, to RUN_DIR/curves.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plot`` flags."""
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                        help="run directory (default: the run under ./runs that was active last)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="image to write; the extension picks the format: .png, .svg, .pdf "
                             "(default: RUN_DIR/curves.png)")
    parser.add_argument("--metrics", metavar="KEY,...",
                        help="only these metrics.jsonl keys, e.g. loss,val_loss,learning_rate (default: all)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of a .png (default: 100)")


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train plot`` from parsed arguments."""
    from mlx_train.monitor.plot import plot_run
    from mlx_train.monitor.run import resolve_run_dir
    from mlx_train.paths import writable_file

    if args.output:
        writable_file(args.output, "the plot's output (-o)")  # before the run is read
    run_dir = resolve_run_dir(args.run_dir)
    output = args.output or os.path.join(run_dir, "curves.png")
    keys = [k.strip() for k in args.metrics.split(",") if k.strip()] if args.metrics else None
    figure = plot_run(run_dir, output, keys=keys, dpi=args.dpi)
    print(f"wrote {output} ({', '.join(ax.get_title() for ax in figure.axes)})")
    return 0
