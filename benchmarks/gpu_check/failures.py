"""A pytest plugin for ``benchmarks/gpu_check.sh``: each failure's report is appended to
``$GPU_CHECK_FAILURES`` as it happens, so a run stopped by its time limit still says why
its tests failed (pytest prints tracebacks only at the end)."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_CHECK_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}\n\n")
