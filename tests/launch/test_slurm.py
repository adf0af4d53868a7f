"""``hacpo launch slurm``: the sbatch script's content (dry run), input checks, and real jobs on
a real two-node Slurm on localhost (tools/local-slurm/: slurmctld + two slurmd, nodes n1/n2 at
127.0.0.2/127.0.0.3), started and stopped by this module."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hacpo.launch.cli import main
from hacpo.launch.ray_wait import ClusterTimeout, Node, _unmatched, wait_for_cluster

from ._launch_helpers import (INHERITED_RAY_ENV, REPO, check_finished_run, free_port, hacpo,
                              processes_mentioning, tiny_run_args)

# --------------------------------------------------------------------------------------------
# the script (dry run): semantics, not one big string
# --------------------------------------------------------------------------------------------


def launch(argv, capsys) -> tuple[int, str, str]:
    """``hacpo ARGV`` in this process (input checks and dry runs need no fresh interpreter)."""
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _dry_run(tmp_path, capsys, *extra):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout:\n  group_size: 2\nprompts_per_step: 4\n")
    rc, out, err = launch(
        ["launch", "slurm", "--nodes", "3", "--gpus-per-node", "2", "--config", str(cfg),
         "--preset", "tiny3", "--set", "steps=7", "agents.0.optim.lr=3e-4",
         "--out-dir", str(tmp_path / "run"), "--partition", "gpu", "--time", "01:30:00",
         "--ray-timeout", "123", "--ray-port", "6400", "--dry-run", *extra], capsys)
    assert rc == 0, err
    # (a script submitted by hand: Slurm does not create its --output folder)
    assert f"submit this script by hand, mkdir -p {tmp_path / 'run' / 'slurm'} first" in err
    return out, cfg


def _sbatch_directives(script: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M):
        out[m.group(1)] = m.group(2)
    return out


def _logical_lines(script: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return script.replace("\\\n", " ").splitlines()


def test_dry_run_script(tmp_path, capsys):
    script, cfg = _dry_run(tmp_path, capsys)
    run = tmp_path / "run"
    assert not run.exists(), "--dry-run must not write the run dir"
    d = _sbatch_directives(script)
    assert d["nodes"] == "3" and d["ntasks-per-node"] == "1" and d["gpus-per-node"] == "2"
    assert d["partition"] == "gpu" and d["time"] == "01:30:00"
    assert d["output"] == f"{run}/slurm/slurm-%j.out"
    assert d["chdir"] == str(REPO)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)   # valid bash

    lines = _logical_lines(script)
    sruns = [ln.strip() for ln in lines if ln.strip().startswith("srun ")]
    assert len(sruns) == 2          # the head, and one line in the loop over the other nodes
    head, worker = sruns
    for s in sruns:   # one task on one named node, backgrounded, ray start blocking in the step
        assert "--nodes=1 --ntasks=1" in s and " -w " in s and s.endswith("&")
        assert "ray start" in s and "--block" in s and '--temp-dir="$RAY_TMP"' in s
        assert '"${NODE_ARGS[@]}"' in s
    assert "NODE_ARGS=(--num-cpus=${SLURM_CPUS_ON_NODE:-1} --num-gpus=2)" in lines
    assert '-w "$HEAD"' in head and "--head" in head and '--port="$RAY_PORT"' in head
    assert '--address="$ADDR"' in worker and '-w "$NODE"' in worker
    loops = [ln for ln in lines if ln.startswith("for NODE in")]
    # every node's IP first, then workers on every node but the first
    assert loops == ['for NODE in "${NODES[@]}"; do', 'for NODE in "${NODES[@]:1}"; do']
    assert "RAY_PORT=6400" in lines and "RAY_TIMEOUT=123" in lines
    # Ray's temp dir: under TMPDIR while Ray's socket paths there fit AF_UNIX's 107 bytes,
    # else under /tmp (test_slurm_fit_and_script runs it), decided before it is made
    assert "RAY_TMP=${TMPDIR:-/tmp}/hacpo-slurm-ray-$SLURM_JOB_ID" in lines
    assert "ray_sockets_fit() { (( $(printf %s \"$1\" | wc -c) + 66 <= 107 )); }" in lines
    assert "  RAY_TMP=/tmp/hacpo-slurm-ray-$SLURM_JOB_ID" in lines
    assert lines.index('if ! ray_sockets_fit "$RAY_TMP"; then') < lines.index(
        'mkdir -p "$LOG_DIR" "$RAY_TMP"')
    assert "ADDR=$HEAD_IP:$RAY_PORT" in lines
    # both waits use the one deadline and fail the job with a message
    assert "DEADLINE=$((T0 + RAY_TIMEOUT))" in lines
    waits = [ln for ln in lines if "-m hacpo.launch.ray_wait" in ln]
    assert len(waits) == 2 and all('--deadline "$DEADLINE"' in w for w in waits)
    for w in waits:                     # a failed wait fails the job
        assert w.rstrip().endswith("||") and lines[lines.index(w) + 1].startswith("  fail ")
    assert 'fail() { echo "[hacpo launch] ERROR: $*" >&2; exit 1; }' in lines
    # the driver: hacpo train with the run's preset/config/overrides + the Ray engine/address
    driver_line = next(ln for ln in lines if ln.startswith("DRIVER=("))
    argv = shlex.split(driver_line[len("DRIVER=("):-1])
    assert argv[1:4] == ["-m", "hacpo.launch.cli", "train"]
    assert argv[argv.index("--preset") + 1] == "tiny3"
    assert argv[argv.index("--config") + 1] == str(cfg.resolve())
    assert argv[argv.index("--out-dir") + 1] == str(run)
    sets = argv[argv.index("--set") + 1:]
    assert sets == ["steps=7", "agents.0.optim.lr=3e-4", "rollout.engine=ray",
                    "rollout.ray_address=$ADDR"]
    assert lines.index(driver_line) > lines.index(waits[1])   # only after the cluster is up
    # teardown: our srun steps on any exit, never `ray stop`
    assert "trap cleanup EXIT" in lines
    cleanup = script[script.index("cleanup() {"):script.index("trap cleanup EXIT")]
    assert 'kill -TERM "${SRUN_PIDS[@]}"' in cleanup and 'rm -rf "$RAY_TMP"' in cleanup
    assert ('-w "$(IFS=,; echo "${WORKER_NODES[*]}")"' in cleanup      # each worker node's own
            and 'rm -rf "$RAY_TMP" >/dev/null' in cleanup)
    assert "ray stop" not in script.replace("never `ray stop`", "")
    assert [ln.strip() for ln in lines].count("SRUN_PIDS+=($!)") == 2   # both steps ended
    # token authentication (Ray listens on every interface): a fresh token made when the job
    # runs, exported before the first srun step (the steps and the driver inherit it); no token
    # is in the script itself
    assert "export RAY_AUTH_MODE=token" in lines and "export RAY_AUTH_TOKEN" in lines
    make = next(ln for ln in lines if ln.startswith("RAY_AUTH_TOKEN="))
    assert make.startswith("RAY_AUTH_TOKEN=$(\"$PY\" -c 'import secrets; print(secrets.token_hex(32))')")
    first_srun = next(i for i, ln in enumerate(lines) if ln.strip().startswith("srun "))
    assert lines.index("export RAY_AUTH_TOKEN") < first_srun
    assert "RAY_AUTH_MODE=disabled" not in script


def test_dry_run_extra_options(tmp_path, capsys):
    script, _ = _dry_run(tmp_path, capsys, "--cpus-per-node", "4", "--object-store-mb", "300",
                         "--sbatch-arg=--account=abc", "--setup", "module load cuda",
                         "--rollout-engine", "vllm", *_HF_AGENTS)
    d = _sbatch_directives(script)
    assert d["cpus-per-task"] == "4" and d["account"] == "abc"
    assert "NODE_ARGS=(--num-cpus=4 --num-gpus=2 --object-store-memory=314572800)" in script
    assert "module load cuda" in script.splitlines()
    assert "rollout.engine=vllm" in script and "rollout.engine=ray" not in script


def test_dry_run_keeps_the_configs_engine_and_quotes_sbatch_values(tmp_path, capsys):
    """The launcher appended rollout.engine=ray whatever the config said (a vllm config sampled
    without vLLM); an --sbatch-arg value with a space or '#' reached sbatch unquoted (split,
    or cut at the '#'); --export=NONE would have left the srun steps without PATH."""
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text("rollout:\n  engine: vllm\n")
    script, _ = _dry_run(tmp_path, capsys, "--config", str(vllm), *_HF_AGENTS,
                         "--sbatch-arg=--comment=my run #5", "--sbatch-arg=--exclusive")
    assert "rollout.engine=vllm" in script and "rollout.engine=ray" not in script
    assert "#SBATCH --comment='my run #5'" in script.splitlines()
    assert "#SBATCH --exclusive" in script.splitlines()
    assert "export SLURM_EXPORT_ENV=ALL" in script
    plain, _ = _dry_run(tmp_path, capsys)       # tiny3's local engine: Ray actors
    assert "rollout.engine=ray" in plain
    p = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert p.returncode == 0, p.stderr


def _driver_after_requeue(script: str, restart_count: int | None) -> list[str]:
    """The driver command the job would run, from the script's own lines (the DRIVER array and
    the requeue branch), with ``SLURM_RESTART_COUNT`` as given (None: unset)."""
    lines = _logical_lines(script)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("DRIVER=("))
    end = next(i for i in range(start, len(lines)) if lines[i] == "fi")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_RESTART_COUNT"}
    if restart_count is not None:
        env["SLURM_RESTART_COUNT"] = str(restart_count)
    code = ("set -uo pipefail\nsay() { :; }\nADDR=10.0.0.1:6400\n"
            + "\n".join(lines[start:end + 1]) + '\nprintf "%s\\n" "${DRIVER[@]}"\n')
    p = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_dry_run_resume_and_requeue(tmp_path, capsys):
    """``--resume`` reaches the driver; without it the driver resumes only in a job Slurm
    requeued (SLURM_RESTART_COUNT > 0), e.g. after a preemption, where a fresh start would
    fail on the run's own checkpoint."""
    script, _ = _dry_run(tmp_path, capsys)
    first = _driver_after_requeue(script, None)
    assert "--resume" not in first and first[-1] == "rollout.ray_address=10.0.0.1:6400"
    assert _driver_after_requeue(script, 0) == first
    requeued = _driver_after_requeue(script, 2)
    assert requeued == first + ["--resume"]
    script, _ = _dry_run(tmp_path, capsys, "--resume")
    given = _driver_after_requeue(script, None)
    assert given.count("--resume") == 1 and given.index("--resume") < given.index("--set")
    assert _driver_after_requeue(script, 3) == given      # not twice
    script, _ = _dry_run(tmp_path, capsys, "--resume", "--accept-encoding-change")
    flagged = _driver_after_requeue(script, None)
    assert flagged == given[:given.index("--resume") + 1] + ["--accept-encoding-change"] + \
        given[given.index("--resume") + 1:]
    script, _ = _dry_run(tmp_path, capsys, "--resume", "--accept-encoding-change", "qwen3")
    named = _driver_after_requeue(script, None)           # an agent's change only
    assert named == given[:given.index("--resume") + 1] + ["--accept-encoding-change",
                                                           "qwen3"] + \
        given[given.index("--resume") + 1:]
    assert _driver_after_requeue(script, 2) == named       # kept on a requeue


def test_dry_run_checkpoint_before_limit(tmp_path, capsys):
    """--checkpoint-before-limit S: Slurm signals the job script S s before its time limit
    (B:USR1: the script only, which passes it on to the driver: a USR1 to every process of
    the job would kill the Ray steps) and may requeue it; the script requeues a job whose
    driver stopped at its checkpoint on that signal. Without it: neither."""
    script, _ = _dry_run(tmp_path, capsys, "--checkpoint-before-limit", "300")
    assert _sbatch_directives(script)["signal"] == "B:USR1@300"
    assert "\n#SBATCH --requeue\n" in script and "\nREQUEUE_ON_STOP=1 " in script
    assert "\ntrap on_usr1 USR1\n" in script
    script, _ = _dry_run(tmp_path, capsys)
    assert "signal" not in _sbatch_directives(script) and "--requeue" not in script
    assert "\nREQUEUE_ON_STOP=0 " in script and "\ntrap on_usr1 USR1\n" in script


_FAKE_DRIVER = """
import signal, sys, time
def usr1(*_):
    print("driver: USR1", flush=True); time.sleep(0.5); sys.exit(75)
def term(*_):
    print("driver: TERM", flush=True); sys.exit(143)
signal.signal(signal.SIGUSR1, usr1)
signal.signal(signal.SIGTERM, term)
print("driver: SIGINT ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      else "driver: SIGINT default", flush=True)
open(sys.argv[1], "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("sig", ["USR1", "INT"])
def test_job_script_traps_reach_the_background_driver(tmp_path, capsys, sig):
    """The job script's own trap logic, with a fake driver in the background as the script
    runs it: SIGUSR1 to the script reaches the driver, and the status the script reads is
    the driver's own (75), not the 138 of a `wait` the trap cut short; SIGINT (a background job
    ignores it) reaches the driver as SIGTERM, and the script fails once the driver is gone."""
    script, _ = _dry_run(tmp_path, capsys, "--checkpoint-before-limit", "300")
    lines = _logical_lines(script)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("TRAPPED=0"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("trap on_usr1 USR1"))
    ready = tmp_path / "ready"
    code = ("set -uo pipefail\nsay() { echo \"say: $*\"; }\n"
            "fail() { echo \"fail: $*\"; exit 1; }\nGOT_USR1=0\n"
            + "\n".join(lines[start:end + 1])
            + f"\n{sys.executable} -c {shlex.quote(_FAKE_DRIVER)} {ready} &\nDRIVER_PID=$!\n"
            "wait_driver\necho \"rc=$RC got_usr1=$GOT_USR1\"\n")
    # SIGINT's default restored: a shell that starts with it ignored (a test run in the
    # background, as CI's) cannot trap it, as a job script started by Slurm can
    p = subprocess.Popen(["bash", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not ready.exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    p.send_signal(getattr(signal, f"SIG{sig}"))
    out, err = p.communicate(timeout=60)
    assert "driver: SIGINT ignored" in out          # (why INT is passed on as TERM)
    if sig == "USR1":
        assert p.returncode == 0, out + err
        assert "driver: USR1" in out and out.rstrip().endswith("rc=75 got_usr1=1"), out
        assert "say: SIGUSR1: the driver writes a checkpoint at the end of its step" in out
    else:
        assert p.returncode == 1, out + err
        assert "driver: TERM" in out and out.rstrip().endswith(
            "fail: job cancelled or timed out (signal)"), out


@pytest.mark.parametrize("value,seconds", [
    ("10", 600), ("10:30", 630), ("1:00:00", 3600), ("2-3", (2 * 24 + 3) * 3600),
    ("1-0:30", 86400 + 1800), ("1-1:1:1", 90061), ("UNLIMITED", None), ("infinite", None),
    ("0", None)])
def test_slurm_time_limits_in_seconds(value, seconds):
    from hacpo.launch.slurm import slurm_time_s
    assert slurm_time_s(value) == seconds


@pytest.mark.parametrize("value", ["", "1:2:3:4", "1-2-3", "x", "1-", "-5", "1.5", "\u00b2"])
def test_slurm_time_limits_that_are_not(value):
    from hacpo.launch.slurm import slurm_time_s
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        slurm_time_s(value)


def test_algorithm_and_steps_reach_the_driver(tmp_path, capsys):
    """``--algorithm`` / ``--steps`` resolve as ``hacpo train``'s do (the preset under the
    algorithm preset, the run preset's minibatch count) and reach the driver's command line;
    an unknown algorithm is an error before anything is submitted."""
    from hacpo.engine.run_config import load_config
    from hacpo.launch.slurm import load_run

    script, _ = _dry_run(tmp_path, capsys, "--algorithm", "gspo", "--steps", "5")
    driver = _driver_after_requeue(script, None)
    assert driver[driver.index("--algorithm") + 1] == "gspo"
    assert driver[driver.index("--steps") + 1] == "5"
    rc, out, err = launch(["launch", "slurm", "--nodes", "1", "--preset", "tiny3", "--dry-run",
                           "--algorithm", "gspo", "--steps", "5", "--out-dir",
                           str(tmp_path / "r2")], capsys)
    assert rc == 0, err
    import argparse
    from hacpo.launch.cli import train_config
    args = argparse.Namespace(preset="tiny3", config=None, algorithm="gspo", steps=5,
                              out_dir=str(tmp_path / "r2"), set=[], rollout_engine="ray",
                              resume=False)
    cfg = load_run(args)
    want, _ = train_config(argparse.Namespace(**{**vars(args), "set": ["rollout.engine=ray"]}))
    assert cfg.algorithm == want.algorithm and cfg.algorithm.name == "gspo" and cfg.steps == 5
    assert cfg.algorithm != load_config("tiny3").algorithm
    rc, out, err = launch(["launch", "slurm", "--nodes", "1", "--preset", "tiny3", "--dry-run",
                           "--algorithm", "nope", "--out-dir", str(tmp_path / "r3")], capsys)
    assert rc == 2 and "hacpo launch: error:" in err and "nope" in err, err


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_run_dir_holding_a_run_needs_resume(tmp_path, capsys, launcher):
    """Refused before anything is submitted or started (the driver would refuse it after the
    queue and the Ray bring-up); with --resume it passes that check (a dry run)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"x")
    base = ["launch", launcher, *(["--nodes", "1"] if launcher == "slurm" else []),
            "--preset", "tiny3", "--out-dir", str(run)]
    rc, out, err = launch(base, capsys)
    assert rc == 2, (out, err)
    assert f"hacpo launch: error: {run} already holds a run (checkpoint.pt); pass --resume " \
           f"to continue it or choose another --out-dir" in err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt"]
    rc, out, err = launch(base + ["--accept-encoding-change"], capsys)   # none to accept
    assert rc == 2 and "hacpo launch: error: --accept-encoding-change applies with --resume " \
                       "only (a new run has no encoding to change)" in err, (out, err)
    rc, out, err = launch(base + ["--resume", "--accept-encoding-change", "qwen3", "nosuch"],
                          capsys)                     # not an agent of the run: before submit
    assert rc == 2 and "hacpo launch: error: --accept-encoding-change 'nosuch': not an agent " \
                       "of this run (its agents: char, qwen3, llama)" in err, (out, err)
    if launcher == "slurm":
        rc, out, err = launch(base + ["--resume", "--dry-run"], capsys)
        assert rc == 0 and out.startswith("#!/bin/bash"), err
    (tmp_path / "file").write_text("")
    rc, out, err = launch(base[:-1] + [str(tmp_path / "file")], capsys)
    assert rc == 2 and f"the run dir {tmp_path / 'file'} is a file" in err, err


def _checkpoint_of(run: Path, step: int) -> None:
    """A checkpoint of tiny3 under a launcher (rollout.engine=ray) at ``step``: the fields the
    pre-submit check reads (its weights are the run's business)."""
    import argparse

    from hacpo.engine import checkpoint as ckpt
    from hacpo.engine.run_config import fingerprint_dict, resolve_paths
    from hacpo.launch.cli import train_config
    cfg, _ = train_config(argparse.Namespace(preset="tiny3", config=None, algorithm=None,
                                             steps=None, out_dir=str(run),
                                             set=["rollout.engine=ray"]))
    run.mkdir(exist_ok=True)
    ckpt.save_atomic({"step": step, "fingerprint": fingerprint_dict(resolve_paths(cfg)),
                      "agents": {}, "sampler": {}}, str(run / "checkpoint.pt"))


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_what_the_driver_would_refuse_is_refused_before_submitting(tmp_path, capsys, launcher):
    """A --resume whose checkpoint is past --steps or was written with another config, and
    results held without a checkpoint, were refused by the driver only, after the queue wait
    and the Ray bring-up; now before anything is submitted or started."""
    run = tmp_path / "run"
    base = ["launch", launcher, *(["--nodes", "1", "--dry-run"] if launcher == "slurm" else []),
            "--preset", "tiny3", "--out-dir", str(run)]
    _checkpoint_of(run, step=3)
    rc, out, err = launch(base + ["--resume", "--steps", "2"], capsys)
    assert rc == 2 and f"cannot resume {run / 'checkpoint.pt'} at step 3 with steps=2" in err, err
    rc, out, err = launch(base + ["--resume", "--set", "agents.0.optim.lr=0.5"], capsys)
    assert rc == 2 and "the config differs from the checkpoint's in agents.0.optim.lr" in err, err
    if launcher == "slurm":          # the same run's config passes (the dry run's script)
        rc, out, err = launch(base + ["--resume", "--steps", "4"], capsys)
        assert rc == 0 and out.startswith("#!/bin/bash"), err
    (run / "checkpoint.pt").unlink()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    rc, out, err = launch(base, capsys)
    assert rc == 2 and "holds the results of a run (metrics.jsonl) but no checkpoint.pt" in err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]     # nothing written


# tiny3's three agents as HF Llama policies (what vLLM engines serve)
_HF_AGENTS = ("--set", *(f"agents.{k}.policy.{f}" for k in range(3)
                         for f in ("kind=hf", "arch=llama")))


@pytest.mark.parametrize("args, message", [
    (["--config", "{bad_yaml}"], "does not load: "),
    (["--config", "{unknown_key}"], "no_such_key"),
    (["--config", "/nonexistent/x.yaml"], "no such file"),
    (["--set", "rollout.engine=local"], "rollout.engine=... is set by the launcher"),
    (["--set", "rollout.group_size=0"], "group_size"),
    (["--cpus-per-node", "1"], "needs 3 Ray CPUs"),      # tiny3: 3 agents x 1 actor x 1 CPU
    # the trainer actors count too (before: only the rollout pool; the job then waited 60 s
    # for a placement group)
    (["--cpus-per-node", "5", "--set", "trainer_backend=ray"],
     "the run needs 6 Ray CPUs (3 for trainer actors (trainer_backend=ray, 3 ranks x "
     "threads=1) + 3 for its rollout.engine=ray actors (3 agents x "
     "rollout.engines_per_agent=1 x 1 CPU (threads))) but 1 node(s) x --cpus-per-node 5 give 5"),
    # 3 agents x 1 vLLM engine on cuda + 2 megatron ranks on cuda
    (["--rollout-engine", "vllm", "--gpus-per-node", "4", "--set", "rollout.device=cuda",
      "trainer_backend=ray", *_HF_AGENTS[1:],
      "agents.0.trainer=megatron", "agents.0.parallel.dp=2", "agents.0.parallel.device=cuda"],
     "the run needs 5 GPUs (2 for megatron ranks with parallel.device=cuda + 3 for vLLM engines "
     "with rollout.device=cuda, rollout.engine_tp each) but 1 node(s) x --gpus-per-node 4 "
     "give 4"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    # numbers that crashed (nan, inf), failed only inside the job, or meant a default silently
    (["--ray-timeout", "nan"], "--ray-timeout must be a finite number of seconds > 0, got nan"),
    (["--ray-timeout", "inf"], "--ray-timeout must be a finite number of seconds > 0"),
    (["--ray-port", "0"], "--ray-port must be a port in 1..65535, got 0"),
    (["--ray-port", "99999"], "--ray-port must be a port in 1..65535, got 99999"),
    (["--object-store-mb", "0"], "--object-store-mb must be >= 1 (leave it out for Ray's "
                                 "default), got 0"),
    (["--wait", "--poll", "-1"], "--poll must be a finite number of seconds > 0, got -1.0"),
    (["--out-dir", "{file}/run"], "cannot create the run dir {file}/run: {file} is a file"),
    (["--out-dir", "{tmp}/back\\slash"], "holds a backslash or a newline, which an #SBATCH "
                                          "line cannot carry"),
    (["--wait-timeout", "60"], "--wait-timeout needs --wait"),
    # Slurm's --signal range; a signal at (or before) the job's start stopped every requeue
    (["--checkpoint-before-limit", "0"], "--checkpoint-before-limit must be 1..65535 seconds "
                                         "(Slurm's --signal), got 0"),
    (["--checkpoint-before-limit", "70000"], "--checkpoint-before-limit must be 1..65535"),
    (["--time", "00:05:00", "--checkpoint-before-limit", "300"],
     "--checkpoint-before-limit 300 is not before --time 00:05:00 (300 s): the job would be "
     "signalled as it starts"),
    (["--time", "UNLIMITED", "--checkpoint-before-limit", "60"],
     "--checkpoint-before-limit needs a time limit to signal before: --time UNLIMITED has none"),
    (["--time", "1:xx", "--checkpoint-before-limit", "60"],
     "--time: not a Slurm time limit: '1:xx'"),
    (["--wait", "--wait-timeout", "-1"], "--wait-timeout must be > 0 seconds, got -1"),
])
def test_bad_input_fails_before_submitting(tmp_path, capsys, monkeypatch, args, message):
    """Each is a clear error, exit 2, and nothing submitted (a fake sbatch records calls)."""
    (tmp_path / "bad.yaml").write_text("rollout: [unclosed\n")
    (tmp_path / "unknown.yaml").write_text("no_such_key: 1\n")
    (tmp_path / "afile").write_text("")
    fmt = dict(bad_yaml=tmp_path / "bad.yaml", unknown_key=tmp_path / "unknown.yaml",
               file=tmp_path / "afile", tmp=tmp_path)
    args = [a.format(**fmt) for a in args]
    message = message.format(**fmt)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f"#!/bin/sh\necho called >> {tmp_path}/sbatch-called\necho 1\n")
    (fake / "sbatch").chmod(0o755)
    if "--nodes" not in args:
        args = ["--nodes", "1", *args]
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    out_dir = [] if "--out-dir" in args else ["--out-dir", str(tmp_path / "run")]
    rc, out, err = launch(["launch", "slurm", "--preset", "tiny3", *out_dir, *args], capsys)
    assert rc == 2, (out, err)
    assert "hacpo launch: error:" in err and message in err, err
    assert not (tmp_path / "sbatch-called").exists()
    assert not (tmp_path / "run").exists()


def test_missing_sbatch_is_a_clear_error(tmp_path, capsys, monkeypatch):
    bindir = tmp_path / "bin"       # a PATH without Slurm's commands
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    rc, out, err = launch(["launch", "slurm", "--nodes", "2", "--preset", "tiny3", "--out-dir",
                           str(tmp_path / "run")], capsys)
    assert rc == 2
    assert "`sbatch` not found on PATH" in err, err
    assert not (tmp_path / "run").exists()
    rc, out, err = launch(["launch", "slurm", "--nodes", "2", "--preset", "tiny3",
                           "--dry-run"], capsys)
    assert rc == 0 and out.startswith("#!/bin/bash")   # a dry run needs no Slurm


# --------------------------------------------------------------------------------------------
# the cluster wait (no Slurm): what it names when the cluster does not come up
# --------------------------------------------------------------------------------------------


def test_wait_names_the_head_when_nothing_listens():
    port = free_port()
    t0 = time.time()
    with pytest.raises(ClusterTimeout, match=rf"Ray head on node n1 did not come up in time.*"
                                             rf"nothing listening on 127.0.0.1:{port}"):
        wait_for_cluster(f"127.0.0.1:{port}", [Node("n1", "127.0.0.1")], time.time() + 1.0,
                         poll_s=0.2)
    assert time.time() - t0 < 10


def test_wait_names_a_node_whose_ray_start_exited(tmp_path):
    log = tmp_path / "ray-n2.log"
    log.write_text("starting\nError: cannot bind node manager port\n")
    p = subprocess.Popen(["true"])
    p.wait()
    port = free_port()
    with pytest.raises(ClusterTimeout, match=r"(?s)Ray worker on node n2 \(127.0.0.3\) exited "
                                             r"before the cluster was up.*cannot bind"):
        wait_for_cluster(f"127.0.0.1:{port}", [Node("n1", "127.0.0.2"),
                                               Node("n2", "127.0.0.3", p.pid, str(log))],
                         time.time() + 30, poll_s=0.1)


def test_unmatched_nodes():
    nodes = [Node("head", "10.0.0.1"), Node("a", "10.0.0.2"), Node("b", None), Node("c", None)]
    assert [n.name for n in _unmatched(nodes, ["10.0.0.1", "10.0.0.2", "x", "y"])] == []
    assert [n.name for n in _unmatched(nodes, ["10.0.0.1", "x"])] == ["a", "c"]
    assert [n.name for n in _unmatched(nodes, ["10.0.0.2", "10.0.0.2"])] == ["head", "c"]


# --------------------------------------------------------------------------------------------
# real Slurm on localhost
# --------------------------------------------------------------------------------------------
SLURM_TOOLS = REPO / "tools" / "local-slurm"
SLURM_DIR = "/tmp/hacpo-test-slurm"


@pytest.fixture(scope="module")
def local_slurm():
    """A real two-node Slurm (installs slurm-wlm + munge with apt if missing, ~15 s), stopped
    afterwards with nothing of it left running."""
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd on localhost needs root (CI runs as root)")
    env = {**os.environ, "LOCAL_SLURM_DIR": SLURM_DIR, "LOCAL_SLURM_NODES": "2",
           "LOCAL_SLURM_CPUS": "2", "LOCAL_SLURM_PORT": "16827",
           "LOCAL_SLURM_NODE_PORT": "17011"}   # not the scripts' defaults: no clash with a dev one
    t0 = time.time()
    r = subprocess.run(["bash", str(SLURM_TOOLS / "start_local_slurm.sh")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"start_local_slurm.sh failed:\n{r.stdout}\n{r.stderr}"
    print(f"local Slurm up in {time.time() - t0:.1f}s")
    conf = f"{SLURM_DIR}/etc/slurm.conf"
    try:
        yield {"SLURM_CONF": conf}
    finally:
        s = subprocess.run(["bash", str(SLURM_TOOLS / "stop_local_slurm.sh")],
                           env={**env, "LOCAL_SLURM_PURGE": "1"},
                           capture_output=True, text=True, timeout=300)
        assert s.returncode == 0, s.stdout + s.stderr
        left = processes_mentioning(conf) + processes_mentioning("hacpo-slurm-ray-")
        assert not left, f"left running after stop_local_slurm.sh: {left}"


def _job_id(stdout: str) -> str:
    m = re.search(r"submitted job (\d+)", stdout)
    assert m, stdout
    return m.group(1)


@pytest.mark.slurm
def test_two_node_slurm_job_trains(local_slurm, tmp_path):
    """The tiny config on 2 Slurm nodes: Ray head on n1, worker on n2; the 3 one-CPU rollout
    actors do not fit on one 2-CPU node, so the run completes only if n2 hosts one. The job
    COMPLETES, the run's outputs are there, and nothing is left running."""
    out = tmp_path / "run"
    port = free_port("127.0.0.2")
    t0 = time.time()
    r = hacpo(["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2",
               "--object-store-mb", "200", "--ray-port", str(port), "--ray-timeout", "240",
               "--time", "00:10:00", "--wait", "--poll", "1", *tiny_run_args(out, tmp_path)],
              env={**local_slurm, **INHERITED_RAY_ENV}, timeout=600)
    job_out = out / "slurm" / f"slurm-{_job_id(r.stdout)}.out"
    log = job_out.read_text() if job_out.exists() else "(no job output)"
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n--- job output:\n{log}"
    assert f"job {_job_id(r.stdout)} finished: state COMPLETED, exit code 0:0" in r.stdout
    print(f"2-node Slurm job: {time.time() - t0:.1f}s")
    check_finished_run(out, ray_address_prefix=f"127.0.0.2:{port}")
    assert "ray cluster: 2 node(s) up at 127.0.0.2:" in log
    assert "driver exited with 0" in log and "job exits with 0" in log
    assert "removed Ray's temp dir on n2" in log    # the worker node's own (not only the head's)
    job_logs = out / "slurm" / f"job-{_job_id(r.stdout)}"
    assert "Ray runtime started" in (job_logs / "ray-n2.log").read_text()   # worker on n2
    assert (out / "slurm" / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert not processes_mentioning(f"hacpo-slurm-ray-{_job_id(r.stdout)}")
    assert not Path(f"/tmp/hacpo-slurm-ray-{_job_id(r.stdout)}").exists()


def _scontrol(env: dict, *args: str) -> str:
    r = subprocess.run(["scontrol", *args], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"scontrol {' '.join(args)}: {r.stdout}{r.stderr}"
    return r.stdout


def _wait_for(what: str, ok, timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.time() + timeout_s
    while not ok():
        assert time.time() < deadline, f"{what}: not within {timeout_s:g}s"
        time.sleep(poll_s)


def _start_requeued_job_now(env: dict, job: str) -> None:
    """Slurm holds a requeued job back a while (BeginTime): let it start at once, but only
    once its nodes have ended its last run (all idle, not completing) and a second later.
    Started sooner, the job's new credential can date from the same second as the old run's
    revoked one: slurmd refuses the launch ("Killing non-startable batch JobId=N: Job
    credential revoked" in slurmctld's log) and the job ends, never resumed (seen in CI and
    reproduced: the requeue and the new allocation 0.6 s apart)."""
    def nodes_idle() -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=60)
        states = r.stdout.split()
        return r.returncode == 0 and bool(states) and set(states) == {"idle"}
    _wait_for("the requeued job's nodes idle", nodes_idle, 120)
    time.sleep(1.5)        # (credentials are compared by the second)
    _scontrol(env, "update", f"JobId={job}", "StartTime=now")


def _submit_long_run(local_slurm: dict, tmp_path: Path, checkpoint_every: int, *extra: str):
    """A 2-node job of a 1000-step tiny run, submitted (not waited for): (run dir, job id,
    job output path, a function reading the steps metrics.jsonl holds so far)."""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=1000"
    args.append(f"checkpoint_every={checkpoint_every}")     # still under --set
    r = hacpo(["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2",
               "--object-store-mb", "200", "--ray-port", str(free_port("127.0.0.2")),
               "--ray-timeout", "240", *extra, *args],
              env={**local_slurm, **INHERITED_RAY_ENV}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job = _job_id(r.stdout)
    metrics = out / "metrics.jsonl"

    def steps() -> list[int]:
        text = metrics.read_text() if metrics.exists() else ""
        return [json.loads(ln)["step"] for ln in text.splitlines() if ln.endswith("}")]
    return out, job, out / "slurm" / f"slurm-{job}.out", steps


def _end_job(local_slurm: dict, job: str) -> None:
    """SIGTERM everywhere (the script tears down), then wait until the job has ended."""
    subprocess.run(["scancel", "--full", "--signal=TERM", job],
                   env={**os.environ, **local_slurm}, timeout=60)
    _wait_for("the job to end", lambda: (_state(local_slurm, job) or "X") not in
              ("RUNNING", "PENDING", "COMPLETING", "REQUEUED"), 150, 1)


@pytest.mark.slurm
def test_requeued_slurm_job_resumes_the_run(local_slurm, tmp_path):
    """A job Slurm requeues mid-run (what a preemption or a node failure does; here `scontrol
    requeue`) starts over from its script: a new Ray cluster (new token), and the driver
    resumes from the last checkpoint instead of refusing the run dir that holds it; the
    steps continue where the checkpoint left them."""
    out, job, job_out, steps = _submit_long_run(local_slurm, tmp_path, 1)
    try:
        t0 = time.time()
        _wait_for("two steps and a checkpoint",
                  lambda: len(steps()) >= 2 and (out / "checkpoint.pt").exists(), 300)
        print(f"requeue test: 2 steps after {time.time() - t0:.0f}s")
        _scontrol(local_slurm, "requeue", job)
        _wait_for("the job back in the queue", lambda: _state(local_slurm, job) == "PENDING",
                  120)
        show = _scontrol(local_slurm, "show", "job", job)
        fields = re.findall(r"(?:JobState|Reason|StartTime|Restarts)=\S+", show)
        print(f"requeue test: requeued after {time.time() - t0:.0f}s: {fields}")
        _start_requeued_job_now(local_slurm, job)
        _wait_for("the resumed driver", lambda: job_out.exists() and "[resume]" in
                  job_out.read_text(), 300)
        log = job_out.read_text()
        print(f"requeue test: resumed after {time.time() - t0:.0f}s")
        assert "restart 1 of this job: the driver resumes the run" in log, log
        m = re.search(r"\[resume\] \S+checkpoint.pt at step (\d+)", log)
        assert m, log
        resumed_at = int(m.group(1))
        assert resumed_at >= 1
        _wait_for("a step after the resume", lambda: len(steps()) > resumed_at + 1, 300)
        got = steps()
        print(f"requeue test: step {resumed_at + 1} after {time.time() - t0:.0f}s")
        # the metrics of the steps past the checkpoint were redone, not duplicated
        assert got == list(range(len(got))), got
    finally:
        _end_job(local_slurm, job)
    assert not processes_mentioning(f"hacpo-slurm-ray-{job}")


@pytest.mark.slurm
def test_slurm_job_signalled_before_its_time_limit_checkpoints_and_requeues(local_slurm,
                                                                           tmp_path):
    """--checkpoint-before-limit: the signal Slurm sends the job script before the time limit
    (here sent by hand as Slurm sends it, `scancel --batch --signal=USR1`: a real limit would
    make the test wait minutes) reaches the driver, which writes a checkpoint at the end of its
    step and stops although checkpoint_every is far; the job requeues itself and resumes from
    that very step (no step lost, none run twice). Before: the script's default action for
    SIGUSR1 killed it, and the time limit then lost every step since the last checkpoint."""
    out, job, job_out, steps = _submit_long_run(local_slurm, tmp_path, 1000, "--time",
                                                "00:30:00", "--checkpoint-before-limit", "600")
    try:
        _wait_for("a step", lambda: len(steps()) >= 1, 300)
        assert not (out / "checkpoint.pt").exists()
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True,
                       env={**os.environ, **local_slurm}, timeout=60)
        log = ""

        def requeued() -> bool:
            nonlocal log
            if job_out.exists():          # (its output may start over when the job does)
                log = max(log, job_out.read_text(), key=len)
            return _state(local_slurm, job) == "PENDING"
        _wait_for("the job requeued", requeued, 300)
        assert "SIGUSR1: the driver writes a checkpoint at the end of its step and stops" in log
        assert "driver exited with 75" in log, log
        assert "requeueing the job: it resumes the run from that checkpoint" in log, log
        from hacpo.engine import checkpoint as ckpt
        at = ckpt.load(str(out / "checkpoint.pt"))["step"]
        assert at >= 1 and steps() == list(range(at))
        _start_requeued_job_now(local_slurm, job)
        _wait_for("the resumed driver", lambda: job_out.exists() and "[resume]" in
                  job_out.read_text(), 300)
        log = job_out.read_text()
        assert "restart 1 of this job: the driver resumes the run" in log, log
        assert f"checkpoint.pt at step {at}" in log, log
        _wait_for("a step after the resume", lambda: len(steps()) > at, 300)
        got = steps()
        assert got == list(range(len(got))), got
    finally:
        _end_job(local_slurm, job)
    assert not processes_mentioning(f"hacpo-slurm-ray-{job}")


def _state(env: dict, job: str) -> str | None:
    r = subprocess.run(["scontrol", "show", "job", "-o", job], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"JobState=(\S+)", r.stdout)
    return m.group(1) if m else None


@pytest.mark.slurm
def test_slurm_job_whose_ray_does_not_start_in_time_fails(local_slurm, tmp_path):
    """A 1 s Ray deadline: the job prints which node timed out and ends FAILED (exit 1);
    --wait exits non-zero; the head's srun step is ended."""
    out = tmp_path / "run"
    r = hacpo(["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2",
               "--ray-port", str(free_port("127.0.0.2")), "--ray-timeout", "1", "--wait",
               "--poll", "1", *tiny_run_args(out, tmp_path)], env=local_slurm, timeout=300)
    job, log = _failed_job(r, out)
    # srun + `ray start` take seconds: the head's GCS port is not open after 1 s (if it were,
    # the cluster wait would name the missing node instead)
    assert re.search(r"ERROR \(ray head\): Ray head on node n1 did not come up in time|"
                     r"ERROR \(ray (head|cluster)\): Ray cluster at 127.0.0.2:\d+ not complete in "
                     r"time.*missing: n", log), log
    assert re.search(r"ERROR: Ray (head on n1 \(127.0.0.2:\d+\)|cluster of 2 nodes) is not up "
                     r"\(error above\); deadline 1s", log), log


@pytest.mark.slurm
def test_slurm_job_whose_ray_head_exits_fails(local_slurm, tmp_path):
    """An impossible Ray setting (1 MiB object store, Ray's minimum is 75 MiB): the head's
    `ray start` exits; the job names the node, shows Ray's own error, and ends FAILED at once
    (well before the 240 s deadline)."""
    out = tmp_path / "run"
    t0 = time.time()
    r = hacpo(["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2", "--object-store-mb",
               "1", "--ray-port", str(free_port("127.0.0.2")), "--ray-timeout", "240", "--wait",
               "--poll", "1", *tiny_run_args(out, tmp_path)], env=local_slurm, timeout=300)
    job, log = _failed_job(r, out)
    assert time.time() - t0 < 120
    assert re.search(r"ERROR \(ray head\): Ray head on node n1 \(127.0.0.2\) exited before the "
                     r"cluster was up", log), log
    assert "minimum allowed is 78643200 bytes" in log      # the tail of n1's Ray log


@pytest.mark.slurm
def test_slurm_job_whose_ray_head_dies_names_it(local_slurm, tmp_path):
    """The head's GCS dies mid-run (SIGKILL): the driver ends with exit 1 and no message of
    its own, so the job names the cause (n1's Ray stopped, with its log's tail) and ends
    FAILED with the driver's status; nothing is left running. The run dir has a space and a
    '%x' in its path (the script's quoting: #SBATCH lines, log dir, driver arguments; the
    job's output file, whose path Slurm expands %x in, lands in the run dir)."""
    out = tmp_path / "run %x dir"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=1000"
    launch_log = tmp_path / "launch.log"
    with open(launch_log, "w") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "hacpo.launch.cli", "launch", "slurm", "--nodes", "2",
             "--cpus-per-node", "2", "--object-store-mb", "200", "--ray-port",
             str(free_port("127.0.0.2")), "--ray-timeout", "240", "--time", "00:10:00",
             "--wait", "--poll", "1", *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **local_slurm, **INHERITED_RAY_ENV})
    try:
        _wait_for("a step of the run", lambda: (out / "metrics.jsonl").exists(), 400)
        job = _job_id(launch_log.read_text())
        gcs = [int(line.split(" ", 1)[0])
               for line in processes_mentioning(f"hacpo-slurm-ray-{job}")
               if "gcs_server" in line]
        assert len(gcs) == 1, processes_mentioning(f"hacpo-slurm-ray-{job}")
        os.kill(gcs[0], signal.SIGKILL)
        assert p.wait(timeout=300) == 1, launch_log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
    text = launch_log.read_text()
    assert f"job {job} finished: state FAILED, exit code 1:0" in text, text
    log = (out / "slurm" / f"slurm-{job}.out").read_text()
    assert "driver exited with 1" in log, log
    assert (f"ERROR: the Ray node n1 stopped while the driver ran (its srun step exited); "
            f"last lines of {out}/slurm/job-{job}/ray-n1.log:") in log, log
    assert "gcs_server" in log.split("stopped while the driver ran")[1]   # the log's tail
    assert "ERROR: the driver failed (exit 1) after the Ray node(s) n1 stopped" in log
    assert "job exits with 1" in log
    time.sleep(1)
    assert not processes_mentioning(f"hacpo-slurm-ray-{job}")
    assert not processes_mentioning(str(out)), "the driver was left running"


def _failed_job(r, out):
    """Common checks of a job that must fail before the driver: state FAILED, exit 1, --wait
    exits 1 and shows the job's last lines, the Ray steps ended, nothing left running."""
    job = _job_id(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"job {job} finished: state FAILED, exit code 1:0" in r.stdout
    log = (out / "slurm" / f"slurm-{job}.out").read_text()
    assert "ending the Ray srun steps" in log and "job exits with 1" in log
    assert "driver:" not in log                   # the driver never ran
    assert not (out / "metrics.jsonl").exists()
    assert "is not up (error above)" in r.stderr  # --wait shows the job's last lines
    time.sleep(1)
    assert not processes_mentioning(f"hacpo-slurm-ray-{job}")
    return job, log


@pytest.mark.slurm
def test_slurm_wait_timeout_cancels_the_job(local_slurm, tmp_path):
    """A run far longer than --wait-timeout 35: the job gets SIGTERM (scancel --full
    --signal=TERM), its script ends the driver and its Ray steps and removes their temp dir;
    --wait exits 124 naming the job, the elapsed time and its logs; nothing is left running."""
    out = tmp_path / "run"
    args = tiny_run_args(out, tmp_path)
    args[args.index("steps=2")] = "steps=1000"
    t0 = time.time()
    r = hacpo(["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2",
               "--object-store-mb", "200", "--ray-port", str(free_port("127.0.0.2")),
               "--ray-timeout", "240", "--wait", "--poll", "1", "--wait-timeout", "35", *args],
              env={**local_slurm, **INHERITED_RAY_ENV}, timeout=300)
    took = time.time() - t0
    job = _job_id(r.stdout)
    assert r.returncode == 124, r.stdout + r.stderr
    m = re.search(rf"hacpo launch: error: job {job} did not finish within --wait-timeout 35s "
                  rf"\(job {job} still RUNNING after 35s; (\d+)s since submission\): sent SIGTERM "
                  rf"to its script, driver and Ray steps \(scancel --full --signal=TERM\); final "
                  rf"state FAILED (\d+)s later\. Job output: (\S+); Ray logs: (\S+)/", r.stderr)
    assert m, r.stderr
    # the limit fired on time (the 1000-step run would take far longer); the job's own
    # cleanup then took its time (up to the 90 s grace before a plain scancel)
    waited, cleanup = int(m.group(1)), int(m.group(2))
    assert 35 <= waited < 35 + 30 and cleanup <= 90 + 5 and took < waited + cleanup + 30, \
        (waited, cleanup, took)
    assert Path(m.group(3)) == out / "slurm" / f"slurm-{job}.out"
    assert Path(m.group(4)) == out / "slurm" / f"job-{job}"
    log = Path(m.group(3)).read_text()
    assert "driver:" in log, log             # the driver was running when the time was up
    assert "job cancelled or timed out (signal)" in log and "ending the Ray srun steps" in log
    assert "job exits with" in log, log      # the job's cleanup ran to its end
    assert not (out / "metrics.jsonl").exists() or \
        (out / "metrics.jsonl").read_text().count("\n") < 1000
    assert not processes_mentioning(f"hacpo-slurm-ray-{job}")
    assert not processes_mentioning(str(out)), "the driver was left running"
    assert not Path(f"/tmp/hacpo-slurm-ray-{job}").exists()


def test_gpu_needs_count_ranks_and_engines_of_their_own():
    """GPUs the launcher asks Slurm for: megatron ranks on cuda, plus vLLM engines on cuda
    unless colocated (they then share the ranks' GPUs); CPU engines need none."""
    from hacpo.engine.run_config import gpu_needs, load_config
    from hacpo.launch.slurm import cluster_needs

    mega = {f"agents.{k}.{key}": v for k in range(3) for key, v in (
        ("policy.kind", "hf"), ("policy.arch", "llama"), ("trainer", "megatron"),
        ("parallel.device", "cuda"))}
    base = {"rollout.engine": "vllm", "trainer_backend": "ray", "agents.0.parallel.dp": 2}
    cfg = load_config("tiny3", overrides={**base, **mega})
    assert gpu_needs(cfg) == (4, 0)                           # engines on CPU
    cuda = cfg.override({"rollout.device": "cuda", "rollout.engines_per_agent": 2})
    assert gpu_needs(cuda) == (4, 6) and cluster_needs(cuda)["GPU"] == 10
    tp = cuda.override({"rollout.engine_tp": 2})      # vLLM TP: GPUs and CPUs per engine
    # CPUs: 4 megatron ranks x threads=1, + 3 agents x 2 engines x engine_tp 2
    assert gpu_needs(tp) == (4, 12) and cluster_needs(tp)["CPU"] == 4 + 12
    # colocated engines: one CPU each in their rank's bundle, no pool of their own
    co = cuda.override({"rollout.colocate": True, "rollout.engines_per_agent": 1})
    assert cluster_needs(co)["CPU"] == 4 + 3
    assert cluster_needs(cuda.override({"threads": 2}))["CPU"] == 4 * 2 + 6
    assert gpu_needs(cuda.override({"rollout.colocate": True,
                                    "rollout.engines_per_agent": 1})) == (4, 0)
    assert "GPU" not in cluster_needs(load_config("tiny3"))


def test_colocated_engine_cpus_are_counted_once_in_their_ranks_bundles():
    """Colocated vLLM engines take one CPU each in the bundle of the rank whose GPU they share
    (only the first engines_per_agent bundles), and are not counted again as a rollout pool."""
    from hacpo.engine.run_config import load_config
    from hacpo.launch.megatron_trainer import rank_bundles
    from hacpo.engine.run_config import colocated_engines, rollout_cpus

    mega = {f"agents.{k}.{key}": v for k in range(2) for key, v in (
        ("policy.kind", "hf"), ("policy.arch", "llama"), ("trainer", "megatron"),
        ("parallel.device", "cuda"), ("parallel.dp", 3))}
    cfg = load_config("default", overrides={"rollout.engine": "vllm", "trainer_backend": "ray",
                                         "rollout.device": "cuda", "rollout.engines_per_agent": 2,
                                         **mega})
    assert (rollout_cpus(cfg), colocated_engines(cfg)) == (4, 0)     # disaggregated: own actors
    co = cfg.override({"rollout.colocate": True})
    assert (rollout_cpus(co), colocated_engines(co)) == (0, 4)
    par = co.agents[0].parallel
    assert rank_bundles(par, 3, 2) == [{"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1},
                                       {"CPU": 3, "GPU": 1}]
    assert rank_bundles(par, 3) == [{"CPU": 3, "GPU": 1}] * 3
    assert rank_bundles(cfg.override({"agents.0.parallel.device": "cpu"}).agents[0].parallel,
                        1) == [{"CPU": 1}] * 3
    with pytest.raises(ValueError, match="4 colocated engines for 3 trainer ranks"):
        rank_bundles(par, 1, 4)
    assert rollout_cpus(load_config("default", overrides={"rollout.engine": "vllm"})) == 2
