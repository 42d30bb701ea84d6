"""Run Python code blocks in order, in one namespace, and record how each one ended.

    python run_readme_blocks.py BLOCKS.json RESULTS.json

BLOCKS.json is ``{"prelude": CODE, "blocks": [[LINE, CODE], ...]}``. The prelude runs first (an
error there ends the run); then every block runs even when an earlier one failed, so one broken
block does not hide the state of the others. RESULTS.json maps each block's LINE to ``null``
(it ran) or the last lines of its traceback.
"""

import json
import sys
import traceback

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)


def main() -> None:
    blocks_path, results_path = sys.argv[1], sys.argv[2]
    with open(blocks_path) as f:
        spec = json.load(f)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(spec["prelude"], "<test_readme prelude>", "exec"), namespace)
    results = {}
    for line, code in spec["blocks"]:
        print(f"--- README.md line {line}", flush=True)
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
            results[line] = None
        except BaseException:  # noqa: B036 (SystemExit from a block is a failure of that block too)
            lines = [t for t in traceback.format_exc().splitlines() if t.strip(" ^~")]  # no caret lines
            results[line] = "\n".join(lines[-12:])
        with open(results_path, "w") as f:  # written after each block: a crash keeps what ran
            json.dump(results, f)


if __name__ == "__main__":
    main()
