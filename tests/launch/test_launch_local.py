"""``hacpo launch local``: a real Ray head + a worker node as local processes, the tiny config
through the Ray rollout engine, and teardown that leaves nothing running."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hacpo.launch.cli import main

from ._launch_helpers import (INHERITED_RAY_ENV, check_finished_run, hacpo, processes_mentioning,
                              tiny_run_args)


def _temp_dir(stdout: str) -> str:
    m = re.search(r"temp dir (\S+),", stdout)
    assert m, stdout
    return m.group(1)


@pytest.mark.slow
def test_launch_local_head_and_worker_trains(tmp_path):
    out = tmp_path / "run"
    r = hacpo(["launch", "local", "--workers", "1", "--cpus-per-node", "2",
               "--object-store-mb", "200", "--ray-timeout", "240", *tiny_run_args(out, tmp_path)],
              env=INHERITED_RAY_ENV, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Ray cluster of 2 node(s) up" in r.stdout and "driver exited with 0" in r.stdout
    check_finished_run(out, ray_address_prefix="127.0.0.1:")
    logs = out / "launch-local"
    assert "Ray runtime started" in (logs / "ray-worker1.log").read_text()
    tmp = _temp_dir(r.stdout)
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp), "Ray processes left running"


def test_launch_local_ray_not_up_in_time_is_a_clear_error(tmp_path):
    """A deadline too short for the head: exit 2 naming the head, the driver never runs, and
    the started `ray start` is torn down."""
    out = tmp_path / "run"
    r = hacpo(["launch", "local", "--ray-timeout", "0.5", "--cpus-per-node", "3",
               *tiny_run_args(out, tmp_path)], timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    # the head's GCS port may or may not open within 0.5 s; either way the message names it
    assert re.search(r"hacpo launch: error: Ray (head on node head did not come up in time|"
                     r"cluster at 127.0.0.1:\d+ not complete in time.*missing: head)", r.stderr), \
        r.stderr
    assert "driver:" not in r.stdout and not (out / "metrics.jsonl").exists()
    tmp = _temp_dir(r.stdout)
    assert not Path(tmp).exists() and not processes_mentioning(tmp)


def test_launch_local_needs_enough_cpus(tmp_path, capsys):
    """Checked before any Ray process starts (in this process: nothing is launched)."""
    rc = main(["launch", "local", "--cpus-per-node", "2", *tiny_run_args(tmp_path / "r", tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "needs 3 Ray CPUs" in err and "1 node(s) x --cpus-per-node 2 give 2" in err
    assert not (tmp_path / "r").exists()


def test_launch_local_ray_head_that_exits_is_a_clear_error(tmp_path):
    """An impossible Ray setting (1 MiB object store; Ray's minimum is 75 MiB): the head's
    `ray start` exits; the error names it and shows Ray's own message, without waiting for
    the 240 s deadline."""
    out = tmp_path / "run"
    r = hacpo(["launch", "local", "--ray-timeout", "240", "--cpus-per-node", "3",
               "--object-store-mb", "1", *tiny_run_args(out, tmp_path)], timeout=200)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "hacpo launch: error: Ray head on node head exited before the cluster was up" \
        in r.stderr
    assert "minimum allowed is 78643200 bytes" in r.stderr
    tmp = _temp_dir(r.stdout)
    assert not Path(tmp).exists() and not processes_mentioning(tmp)


def test_launch_local_sigterm_stops_driver_and_cluster(tmp_path):
    """SIGTERM to the launcher (kill, timeout, a scheduler) mid-run: the driver and every Ray
    process it started end, the temp dir goes, exit 143 (before: the launcher died alone and
    the cluster and driver ran on)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from ._launch_helpers import REPO

    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=40"                   # still running when signalled
    p = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "launch", "local",
                          "--cpus-per-node", "3", "--ray-timeout", "240", *args], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **INHERITED_RAY_ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.5)
    assert (out / "metrics.jsonl").exists(), "the driver never started training"
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 143, stdout + stderr
    assert "terminated (SIGTERM)" in stderr
    tmp = _temp_dir(stdout)
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp), "Ray processes left running"
    assert not processes_mentioning(str(out)), "the driver was left running"
