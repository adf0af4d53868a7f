"""Under CI (``CI`` set and non-empty) on a machine without a GPU, a skipped test fails the
session unless its reason says it needs a GPU: a dependency that did not install, a service
that did not start or a missing permission must not pass CI as a skip.

The hooks are imported by ``tests/conftest.py``; ``HACPO_STRICT_SKIPS=0`` turns the check off
(``=1`` turns it on outside CI)."""
import os
import re

import pytest

# the only skips a CPU-only CI machine may report: tests that need a GPU
GPU_ONLY = re.compile(r"\bneeds a (CUDA )?GPU\b")

_skipped = []


def strict() -> bool:
    flag = os.environ.get("HACPO_STRICT_SKIPS")
    if flag is not None:
        return flag == "1"
    if not os.environ.get("CI"):
        return False
    import torch
    return not torch.cuda.is_available()


def skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:      # (path, line, "Skipped: ...")
        return re.sub(r"^Skipped: ", "", str(longrepr[2]))
    return str(longrepr)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, skip_reason(report)))


def pytest_sessionfinish(session, exitstatus):
    if not strict():
        return
    bad = [(nodeid, why) for nodeid, why in _skipped if not GPU_ONLY.search(why)]
    if not bad:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(bad)} test(s) skipped for a reason other than needing a GPU (CI on a "
             f"CPU machine runs everything else; HACPO_STRICT_SKIPS=0 allows it):"]
    lines += [f"  {nodeid}: {why}" for nodeid, why in bad]
    for line in lines:
        if tr is not None:
            tr.write_line(line, red=True)
        else:
            print(line)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
