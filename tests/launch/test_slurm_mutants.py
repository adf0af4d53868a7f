"""``hacpo launch slurm`` behaviour no other test without a real Slurm pinned down, found by a
mutation audit of hacpo/launch/slurm.py (each test names what a changed line got past the other
tests): the submit / ``--wait`` / ``--wait-timeout`` path with stand-ins for Slurm's commands,
the job script's end (the driver's exit status, the requeue after a checkpoint stop) run with a
stand-in driver, each worker node's own ``ray start``, and paths and names with spaces.

Stand-ins follow Slurm's documented output: ``sbatch --parsable`` prints ``JOBID[;CLUSTER]``,
``scontrol show job -o`` one line of ``Key=Value`` fields, ``sacct -P`` ``|``-separated fields
where State may read ``CANCELLED by UID``."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from hacpo.launch.cli import main

from .test_slurm import _driver_after_requeue, _sbatch_directives


def _launch(tmp_path, capsys, *args, out_dir=None) -> tuple[int, str, str]:
    rc = main(["launch", "slurm", "--nodes", "1", "--preset", "tiny3", "--out-dir",
               str(out_dir or tmp_path / "run"), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fake_slurm(tmp_path, monkeypatch, *, sbatch_rc: int = 0, state: str | None = None) -> None:
    """sbatch (job 42 on cluster c1; its job output file says "job says hi"), scontrol (the
    job's state from tmp_path/state, RUNNING without it; COMPLETED from its 50th call on, so a
    wait that never ends cannot hang a test) and scancel (the job then reads CANCELLED); each
    records its arguments in tmp_path/<name>-calls."""
    b = tmp_path / "fakebin"
    b.mkdir()
    if state is not None:
        (tmp_path / "state").write_text(state)
    scripts = {
        "sbatch": (f'echo "$@" >> {tmp_path}/sbatch-calls\n'
                   + ('echo "sbatch: error: Invalid partition name specified" >&2; exit 1\n'
                      if sbatch_rc else
                      'echo "job says hi" > "$(dirname "$2")/slurm-42.out"; echo "42;c1"\n')),
        "scontrol": (f'echo "$@" >> {tmp_path}/scontrol-calls\n'
                     f'n=$(wc -l < {tmp_path}/scontrol-calls)\n'
                     f's="JobState=RUNNING ExitCode=0:0"\n'
                     f'[ -f {tmp_path}/state ] && s=$(cat {tmp_path}/state)\n'
                     f'[ "$n" -ge 50 ] && s="JobState=COMPLETED ExitCode=0:0"\n'
                     f'echo "JobId=42 JobName=hacpo $s Partition=p"\n'),
        "scancel": (f'echo "$@" >> {tmp_path}/scancel-calls\n'
                    f'echo "JobState=CANCELLED ExitCode=0:15" > {tmp_path}/state\n'),
    }
    for name, body in scripts.items():
        (b / name).write_text("#!/bin/bash\n" + body)
        (b / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")


def test_submit_writes_the_script_and_names_the_job(tmp_path, capsys, monkeypatch):
    """Without --wait: exit 0 once sbatch took the job; the job id without sbatch's cluster
    name, the script in the run dir's slurm/ folder (made here: Slurm does not make it)."""
    _fake_slurm(tmp_path, monkeypatch)
    run = tmp_path / "run"
    rc, out, err = _launch(tmp_path, capsys)
    assert rc == 0, err
    script = run / "slurm" / "job.sbatch"
    assert (f"[hacpo launch] submitted job 42 (1 nodes): script {script}, output "
            f"{run}/slurm/slurm-42.out") in out
    assert (tmp_path / "sbatch-calls").read_text() == f"--parsable {script}\n"
    assert script.read_text().startswith("#!/bin/bash\n#SBATCH --job-name=hacpo\n")
    assert not (tmp_path / "scontrol-calls").exists()      # no --wait: no polling


def test_a_failed_sbatch_is_an_error(tmp_path, capsys, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch, sbatch_rc=1)
    rc, out, err = _launch(tmp_path, capsys)
    assert rc == 2, (out, err)
    assert (f"hacpo launch: error: sbatch {tmp_path}/run/slurm/job.sbatch failed (exit 1): "
            f"sbatch: error: Invalid partition name specified") in err
    assert "submitted" not in out


@pytest.mark.parametrize("state,rc", [("JobState=COMPLETED ExitCode=0:0", 0),
                                      ("JobState=FAILED ExitCode=1:0", 1),
                                      ("JobState=PREEMPTED ExitCode=0:0", 1)])
def test_wait_reports_the_final_state(tmp_path, capsys, monkeypatch, state, rc):
    """--wait: exit 0 only for COMPLETED with exit 0; any other final state (PREEMPTED too:
    it ends the wait) exits 1 with the job output's last lines."""
    _fake_slurm(tmp_path, monkeypatch, state=state)
    got, out, err = _launch(tmp_path, capsys, "--wait", "--poll", "0.01")
    st, code = state.replace("JobState=", "").replace("ExitCode=", "").split()
    assert got == rc, (out, err)
    assert f"[hacpo launch] job 42 finished: state {st}, exit code {code}" in out
    assert ("  | job says hi" in err) == (rc == 1), err


@pytest.mark.parametrize("state,how,scancel", [
    ("RUNNING", "sent SIGTERM to its script, driver and Ray steps (scancel --full "
                "--signal=TERM)", "--full --signal=TERM 42"),
    ("PENDING", "cancelled it (scancel 42)", "42")])
def test_wait_timeout_ends_the_job_and_exits_124(tmp_path, capsys, monkeypatch, state, how,
                                                 scancel):
    """A job still RUNNING at --wait-timeout gets SIGTERM everywhere first (its script's
    cleanup then ends its Ray steps), one still in the queue is cancelled; the command exits
    124 as timeout(1) does."""
    _fake_slurm(tmp_path, monkeypatch, state=f"JobState={state} ExitCode=0:0")
    rc, out, err = _launch(tmp_path, capsys, "--wait", "--poll", "0.05", "--wait-timeout", "0.3")
    assert rc == 124, (out, err)
    assert "hacpo launch: error: job 42 did not finish within --wait-timeout 0.3s" in err
    assert f"{how}; final state CANCELLED" in err, err
    assert (tmp_path / "scancel-calls").read_text() == f"{scancel}\n"


def test_job_state_falls_back_to_sacct(tmp_path, monkeypatch):
    """A job scontrol has forgotten: its state from sacct, without sacct's "by UID"."""
    from hacpo.launch.slurm import job_state
    b = tmp_path / "bin"
    b.mkdir()
    (b / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id' >&2\n"
                                "exit 1\n")
    (b / "sacct").write_text("#!/bin/sh\necho 'CANCELLED by 1000|0:15'\n")
    for f in ("scontrol", "sacct"):
        (b / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    assert job_state("42") == ("CANCELLED", "0:15")


def test_ports_default_and_bounds(tmp_path, capsys):
    """The head's GCS port: 6379 by default (as the --ray-port help says); 1 and 65535 are
    ports; a negative --gpus-per-node is refused."""
    import re
    for args, port in (((), "6379"), (("--ray-port", "65535"), "65535"),
                       (("--ray-port", "1"), "1")):
        rc, script, err = _launch(tmp_path, capsys, "--dry-run", *args)
        assert rc == 0, err
        assert re.findall(r"^RAY_PORT=(\d+)$", script, re.M) == [port]
    rc, out, err = _launch(tmp_path, capsys, "--dry-run", "--gpus-per-node", "-1")
    assert rc == 2 and "hacpo launch: error: --gpus-per-node must be >= 0, got -1" in err, err


def test_spaces_in_paths_and_job_name(tmp_path, capsys, monkeypatch):
    """A working directory, run dir and job name with spaces reach sbatch and bash as one
    word each; a relative --config reaches the driver as an absolute path."""
    work = tmp_path / "my work"
    work.mkdir()
    (work / "run.yaml").write_text("steps: 3\n")
    monkeypatch.chdir(work)
    run = tmp_path / "my run"
    rc, script, err = _launch(tmp_path, capsys, "--dry-run", "--job-name", "my job",
                              "--config", "run.yaml", out_dir=run)
    assert rc == 0, err
    d = _sbatch_directives(script)
    assert shlex.split(d["job-name"]) == ["my job"] and shlex.split(d["chdir"]) == [str(work)]
    assert shlex.split(d["output"]) == [f"{run}/slurm/slurm-%j.out"]
    log_dir = next(ln for ln in script.splitlines() if ln.startswith("LOG_DIR="))
    p = subprocess.run(["bash", "-c", f'SLURM_JOB_ID=7\n{log_dir}\nprintf %s "$LOG_DIR"'],
                       capture_output=True, text=True)
    assert p.stdout == f"{run}/slurm/job-7", p.stderr
    driver = _driver_after_requeue(script, None)
    assert driver[driver.index("--config") + 1] == str(work / "run.yaml")
    assert driver[driver.index("--out-dir") + 1] == str(run)


def test_each_worker_node_starts_ray_with_its_own_address(tmp_path, capsys):
    """The script's worker loop (stand-in srun): a `ray start` on every node but the head,
    joining the head's address with the node's own IP."""
    rc, script, err = _launch(tmp_path, capsys, "--dry-run", "--nodes", "3",
                              "--gpus-per-node", "2")
    assert rc == 0, err
    lines = script.splitlines()
    start = lines.index('for NODE in "${NODES[@]:1}"; do')
    end = lines.index("done", start)
    b = tmp_path / "bin"
    b.mkdir()
    (b / "srun").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/srun-calls\n')
    (b / "srun").chmod(0o755)
    code = ("set -uo pipefail\nNODES=(n1 n2 n3)\n"
            "declare -A NODE_IP=([n1]=10.0.0.1 [n2]=10.0.0.2 [n3]=10.0.0.3)\n"
            f"ADDR=10.0.0.1:6400\nRAY_TMP=/rt\nNODE_ARGS=(--num-gpus=2)\nLOG_DIR={tmp_path}\n"
            "SRUN_PIDS=()\nSTEP_NODES=()\nWORKER_NODES=()\nWAIT_NODES=()\n"
            + "\n".join(lines[start:end + 1]) + '\nwait\necho "${WORKER_NODES[*]}"\n')
    p = subprocess.run(["bash", "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{b}:{os.environ['PATH']}"})
    assert p.returncode == 0 and p.stdout == "n2 n3\n", p.stderr
    calls = sorted((tmp_path / "srun-calls").read_text().splitlines())
    assert calls == [f"--nodes=1 --ntasks=1 --overlap -w n{i} ray start --address=10.0.0.1:6400 "
                     f"--node-ip-address=10.0.0.{i} --temp-dir=/rt --num-gpus=2 --block"
                     for i in (2, 3)]


_FAKE_DRIVER = """
import os, signal, sys, time
open(os.environ["RAN"], "w").close()
mode = os.environ["MODE"]
if mode == "exit3":
    sys.exit(3)
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))   # checkpoint written, stopped
os.kill(os.getppid(), signal.SIGUSR1)      # as Slurm's --signal=B:USR1 to the job script
time.sleep(60)
"""


def _job_end(tmp_path, capsys, mode: str, *extra: str, usr1_first: bool = False,
             lost: str = ""):
    """The job script from its traps to its end (the cluster taken as up), its driver a
    stand-in: ``usr1``: the script gets SIGUSR1, passes it on, the driver stops with 75;
    ``exit3``: the driver fails. ``usr1_first``: the SIGUSR1 comes before the driver starts.
    ``lost``: a node whose Ray srun step has exited (a pid no process can have).
    Returns the process and the stand-in scontrol's calls."""
    rc, script, err = _launch(tmp_path, capsys, "--dry-run", *extra)
    assert rc == 0, err
    lines = script.splitlines()
    a = lines[next(i for i, ln in enumerate(lines) if ln.startswith("say() {")):
              next(i for i, ln in enumerate(lines) if ln.startswith("node_ip() {"))]
    d = next(i for i, ln in enumerate(lines) if ln.startswith("DRIVER=("))
    b = tmp_path / "bin"
    b.mkdir()
    (b / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol-calls\n')
    (b / "scontrol").chmod(0o755)
    ray_tmp = tmp_path / "raytmp"
    ray_tmp.mkdir()
    steps = f"SRUN_PIDS=(2147483647)\nSTEP_NODES=({lost})\n" if lost else \
        "SRUN_PIDS=()\nSTEP_NODES=()\n"
    code = ("set -uo pipefail\n" + steps + "WORKER_NODES=()\n"
            f"RAY_TMP={ray_tmp}\nLOG_DIR={tmp_path}\nADDR=10.0.0.1:6400\n" + "\n".join(a)
            + ("\nkill -USR1 $$\n" if usr1_first else "\n")
            + 'DRIVER=("$FAKE_PY" -c "$FAKE_DRIVER" "rollout.ray_address=$ADDR")\n'
            + "\n".join(lines[d + 1:]) + "\n")
    env = {**os.environ, "PATH": f"{b}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "FAKE_PY": sys.executable, "FAKE_DRIVER": _FAKE_DRIVER, "MODE": mode,
           "RAN": str(tmp_path / "driver-ran")}
    env.pop("SLURM_RESTART_COUNT", None)
    p = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert not ray_tmp.exists()                       # the cleanup ran
    calls = tmp_path / "scontrol-calls"
    return p, calls.read_text() if calls.exists() else ""


def test_a_checkpoint_stop_requeues_the_job_with_the_option_only(tmp_path, capsys):
    """The driver stopped at its checkpoint on SIGUSR1 (exit 75): with
    --checkpoint-before-limit the job requeues itself (`scontrol requeue JOBID`), without it
    it says how to continue; the job's exit status is the driver's."""
    (tmp_path / "a").mkdir()
    p, calls = _job_end(tmp_path / "a", capsys, "usr1", "--checkpoint-before-limit", "300")
    assert p.returncode == 75, p.stdout + p.stderr
    assert "requeueing the job: it resumes the run" in p.stdout and calls == "requeue 7\n"
    (tmp_path / "b").mkdir()
    p, calls = _job_end(tmp_path / "b", capsys, "usr1")
    assert p.returncode == 75, p.stdout + p.stderr
    assert "submit the job again with --resume" in p.stdout
    assert "requeueing" not in p.stdout and calls == ""


def test_a_failed_driver_fails_the_job_without_a_requeue(tmp_path, capsys):
    """The job's exit status is the failed driver's; a Ray node whose step had exited is named
    with its log's last lines."""
    (tmp_path / "ray-n2.log").write_text("raylet: lost the GCS\n")
    p, calls = _job_end(tmp_path, capsys, "exit3", "--checkpoint-before-limit", "300",
                        lost="n2")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "driver exited with 3" in p.stdout and "job exits with 3" in p.stdout
    assert calls == ""
    assert (f"ERROR: the Ray node n2 stopped while the driver ran (its srun step exited); last "
            f"lines of {tmp_path}/ray-n2.log:\n    | raylet: lost the GCS\n") in p.stderr
    assert ("ERROR: the driver failed (exit 3) after the Ray node(s) n2 stopped; --resume "
            "continues the run from its last checkpoint") in p.stderr, p.stderr


def test_sigusr1_before_the_driver_starts_stops_the_job(tmp_path, capsys):
    """The time limit is near before the driver started: nothing new to checkpoint, the driver
    is not started and the job stops with the driver's stop status (75), without a requeue."""
    p, calls = _job_end(tmp_path, capsys, "usr1", "--checkpoint-before-limit", "300",
                        usr1_first=True)
    assert p.returncode == 75, p.stdout + p.stderr
    assert "SIGUSR1 before the driver started" in p.stdout
    assert not (tmp_path / "driver-ran").exists() and calls == ""
