import os
import resource
import sys
import time

import pytest

# mlx_train must be imported before mlx.core so that the optimized BLAS is loaded first.
import mlx_train  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))


# -- the fast tier's budget ----------------------------------------------------------------
# A test without the `slow` mark should take well under FAST_TEST_SECONDS of CPU time (this
# process and the processes it waited for, setup and teardown included). CPU time rather than
# wall time, so that the report means the same on a busy machine; tests over it are listed at the
# end of the run (a report, never a failure): mark them slow or make them cheaper.
FAST_TEST_SECONDS = float(os.environ.get("MLX_TRAIN_FAST_TEST_SECONDS", "5"))
_over_budget: list[tuple[float, float, str]] = []


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
    if cpu > FAST_TEST_SECONDS and item.get_closest_marker("slow") is None:
        _over_budget.append((cpu, wall, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _over_budget:
        return
    terminalreporter.section(f"fast-tier tests over {FAST_TEST_SECONDS:g} s of CPU (mark them slow or make "
                             "them cheaper)")
    for cpu, wall, nodeid in sorted(_over_budget, reverse=True):
        terminalreporter.write_line(f"{cpu:7.2f}s cpu {wall:7.2f}s wall  {nodeid}")
