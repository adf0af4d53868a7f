"""``hacpo launch local``: a real Ray head + a worker node as local processes, the tiny config
through the Ray rollout engine, and teardown that leaves nothing running."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hacpo.launch.cli import main
from hacpo.launch.ray_cluster import (OWNER_LOCK, STALE_AFTER_S, TEMP_PREFIX,
                                      sweep_dead_temp_dirs)

from ._launch_helpers import (INHERITED_RAY_ENV, REPO, TINY_STEPS, check_finished_run, free_port,
                              hacpo, processes_mentioning, tiny_run_args)


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
    # --resume: a new cluster, the driver continues the run from its checkpoint
    args = tiny_run_args(out, tmp_path)
    args[args.index(f"steps={TINY_STEPS}")] = f"steps={TINY_STEPS + 1}"
    r = hacpo(["launch", "local", "--cpus-per-node", "3", "--ray-timeout", "240", "--resume",
               *args], env=INHERITED_RAY_ENV, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"[resume] {out / 'checkpoint.pt'} at step {TINY_STEPS}" in r.stdout + r.stderr
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(TINY_STEPS + 1))
    assert not processes_mentioning(_temp_dir(r.stdout))


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


def test_launch_local_into_a_run_dir_in_use_is_refused_before_ray_starts(tmp_path, capsys):
    """A second launch on a run dir a run holds started a whole Ray cluster (and truncated the
    first launch's Ray logs) before its driver was refused; now refused first, nothing started
    (here the holder is this process; another process's lock is found the same way)."""
    from hacpo.engine.trainer import lock_run_dir
    run = tmp_path / "r"
    lock = lock_run_dir(str(run))
    try:
        rc = main(["launch", "local", "--cpus-per-node", "3", *tiny_run_args(run, tmp_path),
                   "--resume"])
    finally:
        lock.close()
    err = capsys.readouterr().err
    assert rc == 2 and f"{run} is in use by another hacpo run (process " in err, err
    assert sorted(p.name for p in run.iterdir()) == [".hacpo-run.lock"]


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


def _stranger(code: list[str], auth: dict[str, str], timeout: float = 60
              ) -> tuple[int | None, str, str]:
    """``python CODE...`` from a process that is not the launch's (its environment minus Ray's
    auth variables, plus ``auth``): (exit status, None if still running after ``timeout`` s
    and killed; stdout; stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    try:
        r = subprocess.run([sys.executable, *code], cwd=REPO, env={**env, **auth},
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:      # Ray's client retries a refused token
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, text(e.stdout), text(e.stderr)
    return r.returncode, r.stdout, r.stderr


def _driver_token(out: Path) -> str:
    """RAY_AUTH_TOKEN from the environment of the launch's driver (``hacpo train`` for
    ``out``)."""
    for line in processes_mentioning(str(out)):
        pid, cmd = line.split(" ", 1)
        if " train " not in cmd:
            continue
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        tokens = [e.split(b"=", 1)[1].decode() for e in environ
                  if e.startswith(b"RAY_AUTH_TOKEN=")]
        assert len(tokens) == 1 and len(tokens[0]) == 64, "the driver has no launch token"
        return tokens[0]
    raise AssertionError(f"no driver process for {out}: {processes_mentioning(str(out))}")


def test_launch_local_refuses_strangers_and_sigterm_stops_driver_and_cluster(tmp_path):
    """While a launch trains, processes without its token (none, or a wrong one) can neither
    join its cluster (ray.init) nor query its GCS (ray_wait: refused at once, not a wait to the
    deadline); Ray listens on every interface, so this is what keeps the network out.
    Then SIGTERM to the launcher (kill, timeout, a scheduler) mid-run: the driver and every Ray
    process it started end, the temp dir goes, exit 143 (before: the launcher died alone and
    the cluster and driver ran on)."""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=1000"                 # still running when signalled
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "launch", "local",
                          "--cpus-per-node", "3", "--ray-timeout", "240", "--ray-port",
                          str(port), *args], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **INHERITED_RAY_ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.5)
        assert (out / "metrics.jsonl").exists(), "the driver never started training"
        address = f"127.0.0.1:{port}"
        wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
        join = ["-c", f"import ray; ray.init(address={address!r}); print('JOINED')"]
        for auth in ({}, wrong):   # refused: an error, or Ray's client retrying until killed
            rc, stdout, stderr = _stranger(join, auth, timeout=20)
            assert rc != 0 and "JOINED" not in stdout, (auth, rc, stdout)
            assert "InvalidAuthToken" in stderr or "Failed to connect" in stderr, \
                (auth, stderr[-2000:])
        # control: the token the launch gave its driver (read from the driver's environment)
        # joins, so the refusals above are the token's doing
        token = _driver_token(out)
        rc, stdout, stderr = _stranger(join, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        assert rc == 0 and "JOINED" in stdout, (rc, stderr[-2000:])
        t0 = time.time()
        rc, stdout, stderr = _stranger(["-m", "hacpo.launch.ray_wait", "--address", address,
                                        "--node", "head=127.0.0.1", "--deadline",
                                        str(time.time() + 90)], wrong, timeout=120)
        assert rc == 3, (rc, stdout + stderr)
        assert f"the Ray cluster at {address} refused this process's authentication token" \
            in stderr, stderr[-2000:]
        assert time.time() - t0 < 60, "a refused token waited for the deadline"
        # a driver joining with a wrong token: the command's one-line error, exit 2, at once
        t0 = time.time()
        rc, stdout, stderr = _stranger(["-m", "hacpo.launch.cli", "train", *tiny_run_args(
            tmp_path / "stranger", tmp_path), "--set", "rollout.engine=ray",
            f"rollout.ray_address={address}"], wrong, timeout=240)
        assert rc == 2, (rc, stdout[-2000:] + stderr[-2000:])
        assert f"hacpo train: error: the Ray cluster at '{address}' refused this process's " \
               f"authentication token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN set)" in stderr, \
            stderr[-2000:]
        assert "Traceback" not in stderr
        print(f"wrong-token driver refused after {time.time() - t0:.1f}s")
        assert p.poll() is None, "the launch ended while strangers knocked"
    finally:
        p.send_signal(signal.SIGTERM)
    _assert_torn_down(p, out, 143, "terminated (SIGTERM)")


def _assert_torn_down(p: subprocess.Popen, out: Path, code: int, said: str) -> None:
    """The launcher ``p`` (signalled) exits ``code`` saying ``said``; its Ray temp dir is gone
    and none of its Ray processes or its driver (run dir ``out``) is left running."""
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == code, stdout + stderr
    assert said in stderr
    tmp = _temp_dir(stdout)
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp), "Ray processes left running"
    assert not processes_mentioning(str(out)), "the driver was left running"


@pytest.mark.slow
def test_launch_local_ctrl_c_stops_driver_and_cluster(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the launcher's process group) mid-run: the driver and
    the Ray nodes run in sessions of their own, so the launcher passes it on to the driver,
    which stops as an interrupted ``hacpo train`` does; then the cluster goes, one line each,
    no traceback, exit 130 (before: a KeyboardInterrupt traceback from the launcher, whose
    driver was stopped with SIGTERM and said so). (A launch's --resume: the test above.)"""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index(f"steps={TINY_STEPS}")] = "steps=1000"
    launch = [sys.executable, "-m", "hacpo.launch.cli", "launch", "local", "--cpus-per-node",
              "3", "--ray-timeout", "240"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **INHERITED_RAY_ENV}
    # its own session, SIGINT's default restored (a background job inherits it ignored)
    p = subprocess.Popen(launch + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists():
            assert p.poll() is None and time.time() < deadline, "the driver never trained"
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, stdout + stderr
    assert "hacpo train: interrupted (Ctrl-C); continue it with --resume" in stderr, stderr
    assert "[hacpo launch] interrupted (Ctrl-C): the driver and the Ray cluster were " \
           "stopped" in stderr, stderr
    assert "Traceback" not in stderr and "SIGTERM" not in stderr, stderr
    tmp = _temp_dir(stdout)
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp), "Ray processes left running"
    assert not processes_mentioning(str(out)), "the driver was left running"


@pytest.mark.slow
def test_launch_local_passes_sigusr1_on_and_the_driver_stops_at_a_checkpoint(tmp_path):
    """SIGUSR1 to the launcher (a time limit coming) reaches the driver, which writes a
    checkpoint at the end of its step and stops (checkpoint_every far away); the cluster is
    torn down and the launcher exits 75 as its driver did (before: SIGUSR1's default action
    killed the launcher; its driver then got SIGTERM and lost the steps since the last
    checkpoint)."""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index(f"steps={TINY_STEPS}")] = "steps=1000"
    args += ["--set", "checkpoint_every=1000"]
    p = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "launch", "local",
                          "--cpus-per-node", "3", "--ray-timeout", "240", *args], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **INHERITED_RAY_ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists():
            assert p.poll() is None and time.time() < deadline, "the driver never trained"
            time.sleep(0.2)
    except BaseException:
        p.send_signal(signal.SIGTERM)       # (torn down as on any SIGTERM)
        p.communicate(timeout=120)
        raise
    p.send_signal(signal.SIGUSR1)
    _assert_torn_down(p, out, 75, "(SIGUSR1); continue it with --resume")
    from hacpo.engine import checkpoint as ckpt
    step = ckpt.load(str(out / "checkpoint.pt"))["step"]
    rows = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert step >= 1 and rows == list(range(step))


def _launch_in_background(out: Path, tmp_path: Path, log: Path) -> subprocess.Popen:
    """``hacpo launch local`` of a long tiny run (1000 steps), its output into ``log``."""
    args = tiny_run_args(out, tmp_path)
    args[args.index(f"steps={TINY_STEPS}")] = "steps=1000"
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "launch", "local",
                                 "--cpus-per-node", "3", "--ray-timeout", "240", *args],
                                cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1",
                                     **INHERITED_RAY_ENV})


def _wait_for(what: str, found, p: subprocess.Popen, log: Path, timeout_s: float = 300):
    deadline = time.time() + timeout_s
    while not (value := found()):
        assert p.poll() is None and time.time() < deadline, (what, log.read_text()[-3000:])
        time.sleep(0.2)
    return value


def _driver_pid(out: Path) -> int | None:
    pids = [int(line.split(" ", 1)[0]) for line in processes_mentioning(str(out))
            if " train " in line]
    return pids[0] if pids else None


@pytest.mark.slow
def test_launch_local_names_a_dead_ray_head_and_a_killed_driver(tmp_path):
    """The head's GCS dies mid-run (SIGKILL): the driver ends with exit 1 and no message of
    its own, so the launcher names the cause: the Ray head node stopped (with its log's tail);
    it exits with the driver's status and leaves nothing running. A driver killed by a
    signal: the launcher exits 128 + N, as a shell reports it (before: the status -9 left it
    as exit 247)."""
    out, log = tmp_path / "run", tmp_path / "launch.log"
    p = _launch_in_background(out, tmp_path, log)
    try:
        _wait_for("a step", lambda: (out / "metrics.jsonl").exists(), p, log)
        tmp = _temp_dir(log.read_text())
        gcs = [int(line.split(" ", 1)[0]) for line in processes_mentioning(tmp)
               if "gcs_server" in line]
        assert len(gcs) == 1, processes_mentioning(tmp)
        os.kill(gcs[0], signal.SIGKILL)
        assert p.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)
    text = log.read_text()
    assert "[hacpo launch] the Ray head node stopped while the driver ran: its `ray start " \
           "--block`" in text, text[-3000:]
    assert f"last lines of {out / 'launch-local' / 'ray-head.log'}:" in text
    assert "gcs_server" in text.split("stopped while the driver ran")[1]   # the log's tail
    assert "[hacpo launch] error: the driver failed (exit 1) after the Ray head node stopped" \
        in text
    assert not Path(tmp).exists() and not processes_mentioning(tmp)
    assert not processes_mentioning(str(out)), "the driver was left running"

    # a driver killed by a signal
    out2, log2 = tmp_path / "run2", tmp_path / "launch2.log"
    p = _launch_in_background(out2, tmp_path, log2)
    try:
        pid = _wait_for("the driver", lambda: _driver_pid(out2), p, log2)
        os.kill(pid, signal.SIGKILL)
        assert p.wait(timeout=120) == 128 + signal.SIGKILL, log2.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)
    text = log2.read_text()
    assert "[hacpo launch] driver was killed by SIGKILL" in text, text[-3000:]
    assert "stopped while the driver ran" not in text      # no node is blamed
    tmp = _temp_dir(text)
    assert not Path(tmp).exists() and not processes_mentioning(tmp)


_STUBBORN = ("import signal, time\n"
             "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "print('up', flush=True)\n"
             "time.sleep(600)\n")

_TEARDOWN = f"""
import subprocess, sys
from hacpo.launch.launch_local import _Teardown, _kill_group, _stop
def stubborn():
    p = subprocess.Popen([sys.executable, "-c", {_STUBBORN!r}], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    assert p.stdout.readline() == b"up\\n"
    return p
driver, nodes = stubborn(), [stubborn(), stubborn()]
print("pids", driver.pid, *(p.pid for p in nodes), flush=True)
print("stopping", flush=True)
with _Teardown() as teardown:
    _kill_group(driver, teardown, grace_s=600)
    _stop(nodes, teardown, grace_s=600)
print("stopped", driver.returncode, *(p.returncode for p in nodes), flush=True)
"""


def test_a_second_signal_hurries_the_teardown_and_never_cuts_it(tmp_path):
    """The launcher stops the driver (grace 10 s) and the Ray nodes (grace 30 s); a second
    Ctrl-C (or a SIGTERM) meanwhile used to raise out of the teardown with a traceback and leave
    the Ray nodes running. Now it ends the grace periods: every process still there is
    SIGKILLed, one line says so. Here the driver and two "nodes" ignore SIGINT and SIGTERM and
    the grace periods are 600 s: only the hurry ends them."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        p = subprocess.Popen([sys.executable, "-c", _TEARDOWN], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        pids = []
        try:
            pids = [int(x) for x in p.stdout.readline().split()[1:]]
            assert p.stdout.readline() == "stopping\n"
            time.sleep(0.5)
            os.kill(p.pid, sig)
            stdout, stderr = p.communicate(timeout=120)
        finally:
            for pid in [p.pid, *pids]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        assert p.returncode == 0, stderr
        assert stdout == "stopped -9 -9 -9\n", (stdout, stderr)
        assert stderr == (f"[hacpo launch] {signal.Signals(sig).name} while stopping: killing "
                          "the driver's process group and the Ray nodes now (SIGKILL)\n"), stderr


def _launch_until_training(out: Path, tmp_path: Path) -> subprocess.Popen:
    args = tiny_run_args(out, tmp_path)
    args[args.index(f"steps={TINY_STEPS}")] = "steps=1000"       # still running when stopped
    p = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "launch", "local",
                          "--cpus-per-node", "3", "--ray-timeout", "240", "--ray-port",
                          str(free_port()), *args], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **INHERITED_RAY_ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a test run under nohup (SIGHUP ignored, inherited): not here
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.5)
    assert (out / "metrics.jsonl").exists(), "the driver never started training"
    return p


def _kill_leftovers(*texts: str) -> list[str]:
    """SIGKILL every process whose command line mentions one of ``texts``; returns them (a
    failed check must not leave a launch running)."""
    left = [ln for t in texts for ln in processes_mentioning(t)]
    for line in left:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    return left


@pytest.mark.slow
def test_launch_local_hang_up_or_kill_9_leaves_nothing_running(tmp_path):
    """The terminal closing (SIGHUP) killed the launcher alone: the driver trained on and the
    Ray head ran on under init. SIGHUP now tears down as SIGTERM does (exit 129); a SIGKILLed
    launcher, whose teardown cannot run, takes its driver and Ray nodes with it (they get
    SIGTERM when it dies)."""
    out = tmp_path / "hup"
    p = _launch_until_training(out, tmp_path)
    try:
        p.send_signal(signal.SIGHUP)
        _assert_torn_down(p, out, 129, "terminated (SIGHUP: the terminal closed)")
    finally:       # (a failed check: its children get SIGTERM as it dies, PR_SET_PDEATHSIG)
        if p.poll() is None:
            p.kill()
            p.wait()

    out = tmp_path / "kill9"
    p = _launch_until_training(out, tmp_path)
    p.kill()
    stdout, _ = p.communicate(timeout=60)
    tmp = _temp_dir(stdout)
    deadline = time.time() + 90
    while time.time() < deadline and (processes_mentioning(tmp)
                                       or processes_mentioning(str(out))):
        time.sleep(0.5)
    left = _kill_leftovers(tmp, str(out))
    assert not left, left
    # its Ray temp dir, which it could not remove, is removed by the next launch's sweep (its
    # owner lock, once old enough, is held by nobody); a live launch's dir is never swept
    assert Path(tmp).name.startswith(TEMP_PREFIX) and (Path(tmp) / OWNER_LOCK).exists()
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(Path(tmp) / OWNER_LOCK, (old, old))
    assert tmp in sweep_dead_temp_dirs(str(Path(tmp).parent))
    assert not Path(tmp).exists()
