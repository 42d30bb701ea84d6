"""CLI start-up: how long ``mlx-train --help`` and friends take, against the bare interpreter and
against importing the training stack (what ``--help`` used to cost).

Every command runs in a fresh interpreter; the rounds alternate between the commands so that
machine noise hits them all, and the medians are compared.

    python bench/cli_startup.py              # 9 rounds
    python bench/cli_startup.py --rounds 21
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import mlx_train.training": [sys.executable, "-c", "import mlx_train.training"],
    "mlx-train --help": [sys.executable, "-m", "mlx_train", "--help"],
    "mlx-train train --help": [sys.executable, "-m", "mlx_train", "train", "--help"],
    "mlx-train monitor --help": [sys.executable, "-m", "mlx_train", "monitor", "--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, argv in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    bare, stack = medians["python -c pass"], medians["import mlx_train.training"]
    print(f"{'command':28s} {'median s':>9s} {'- bare python':>14s} {'/ training import':>18s}")
    for name, seconds in medians.items():
        print(f"{name:28s} {seconds:9.3f} {seconds - bare:14.3f} {seconds / stack:18.2f}")


if __name__ == "__main__":
    main()
