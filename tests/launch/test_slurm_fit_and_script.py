"""``hacpo launch slurm`` behaviour no other test pinned down (found by a mutation audit: a
changed comparison or a dropped escape survived every other test), and one real defect: an
actor bigger than a node (a vLLM engine with ``rollout.engine_tp`` GPUs > ``--gpus-per-node``)
passed the launcher's resource check, since only the cluster's totals were compared; Ray places
an actor on one node, so such a job waited for resources until the engine's start timeout,
holding its Slurm nodes, and then failed with "did not start" naming no cause.

Expected values come from Slurm's documentation (sbatch filename patterns: ``%%`` is a literal
``%``; ``SLURM_RESTART_COUNT`` is the number of times the job was restarted, so 1 after the
first requeue) and Ray's scheduling rule (an actor's resources come from a single node)."""
from __future__ import annotations

import re

import pytest

from hacpo.launch.cli import main

from .test_slurm import _driver_after_requeue, _sbatch_directives

_LLAMA = ("--set", *(f"agents.{k}.policy.{f}" for k in range(3)
                     for f in ("kind=hf", "arch=llama")))


def _launch(tmp_path, capsys, *args, out_dir=None) -> tuple[int, str, str]:
    if "--nodes" not in args:
        args = ("--nodes", "1", *args)
    rc = main(["launch", "slurm", "--preset", "tiny3", "--out-dir",
               str(out_dir or tmp_path / "run"), "--dry-run", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("args", [
    # tiny3 needs 3 Ray CPUs (3 agents x 1 rollout actor x threads=1): exactly what is there,
    # on one node or spread one per node
    ["--nodes", "1", "--cpus-per-node", "3"],
    ["--nodes", "3", "--cpus-per-node", "1"],
    # 3 vLLM engines of 1 GPU on cuda + 2 megatron ranks on cuda = 5 GPUs: exactly 5 on one
    # node, or 6 over 3 nodes of 2 (every actor needs 1 GPU: each fits a node)
    ["--nodes", "1", "--gpus-per-node", "5", "--rollout-engine", "vllm", *_LLAMA,
     "rollout.device=cuda", "trainer_backend=ray", "agents.0.trainer=megatron",
     "agents.0.parallel.dp=2", "agents.0.parallel.device=cuda"],
    ["--nodes", "3", "--gpus-per-node", "2", "--rollout-engine", "vllm", *_LLAMA,
     "rollout.device=cuda", "trainer_backend=ray", "agents.0.trainer=megatron",
     "agents.0.parallel.dp=2", "agents.0.parallel.device=cuda"],
    # engines of 2 GPUs (engine_tp=2) on nodes of 2 GPUs: 6 in all
    ["--nodes", "3", "--gpus-per-node", "2", "--rollout-engine", "vllm", *_LLAMA,
     "rollout.device=cuda", "rollout.engine_tp=2"],
], ids=["cpus-1x3", "cpus-3x1", "gpus-1x5", "gpus-3x2", "engine-tp2-3x2"])
def test_resources_that_fit_are_accepted(tmp_path, capsys, args):
    rc, out, err = _launch(tmp_path, capsys, *args)
    assert rc == 0, err
    assert out.startswith("#!/bin/bash")


@pytest.mark.parametrize("args,message", [
    # 3 engines x engine_tp 4 = 12 GPUs, and 6 nodes x 2 GPUs = 12: enough in total, but one
    # engine's 4 GPUs (its TP workers share one actor) are on no node
    (["--nodes", "6", "--gpus-per-node", "2", "--rollout-engine", "vllm", *_LLAMA,
      "rollout.device=cuda", "rollout.engine_tp=4"],
     "each vLLM engine (rollout.engine_tp=4, rollout.device=cuda) needs 4 GPUs on one node "
     "(Ray places an actor on a single node) but --gpus-per-node is 2"),
    # vLLM on CPU: engine_tp CPUs per engine; 6 CPUs in all for 3 engines of 2
    (["--nodes", "6", "--cpus-per-node", "1", "--rollout-engine", "vllm", *_LLAMA,
      "rollout.engine_tp=2"],
     "each vLLM engine (rollout.engine_tp=2, rollout.device=cpu) needs 2 CPUs on one node"),
    # rollout.engine=ray actors of threads=2 CPUs
    (["--nodes", "3", "--cpus-per-node", "2", "--set", "threads=2"], None),
    (["--nodes", "6", "--cpus-per-node", "1", "--set", "threads=2"],
     "each rollout.engine=ray actor (threads=2) needs 2 CPUs on one node"),
], ids=["engine-tp4-on-2-gpu-nodes", "engine-tp2-on-1-cpu-nodes", "ray-threads2-fits",
        "ray-threads2-on-1-cpu-nodes"])
def test_an_actor_bigger_than_a_node_is_refused(tmp_path, capsys, args, message):
    rc, out, err = _launch(tmp_path, capsys, *args)
    if message is None:
        assert rc == 0, err
        return
    assert rc == 2, (out, err)
    assert "hacpo launch: error:" in err and message in err, err
    assert not out and not (tmp_path / "run").exists()


def test_percent_in_the_run_dir_is_escaped_for_sbatch_only(tmp_path, capsys):
    """sbatch expands ``%j``, ``%x``... in ``--output``; a ``%`` of the path itself must be
    written ``%%`` there (and only there: the script's own paths are plain bash)."""
    run = tmp_path / "exp%j"
    rc, script, err = _launch(tmp_path, capsys, out_dir=run)
    assert rc == 0, err
    assert _sbatch_directives(script)["output"] == f"{tmp_path}/exp%%j/slurm/slurm-%j.out"
    assert f"LOG_DIR={run}/slurm/job-$SLURM_JOB_ID" in script.splitlines()


def test_first_requeue_resumes(tmp_path, capsys):
    """SLURM_RESTART_COUNT is 1 in the first requeued run of a job: it must resume (a fresh
    start would fail on the run's own checkpoint)."""
    rc, script, err = _launch(tmp_path, capsys)
    assert rc == 0, err
    first = _driver_after_requeue(script, None)
    assert "--resume" not in first
    assert _driver_after_requeue(script, 1) == first + ["--resume"]


@pytest.mark.parametrize("given,expect", [("0.5", 1), ("2.01", 3), ("7", 7)])
def test_ray_timeout_is_never_shortened(tmp_path, capsys, given, expect):
    """The script's deadline is whole seconds: a fraction rounds up (0.5 s must not become a
    deadline that has passed before the head starts)."""
    rc, script, err = _launch(tmp_path, capsys, "--ray-timeout", given)
    assert rc == 0, err
    assert re.findall(r"^RAY_TIMEOUT=(\d+)$", script, re.M) == [str(expect)]


def _run_script(tmp_path, script: str, addrs: dict[str, str], **env_over):
    """``script`` run as the job's batch step with stand-ins for scontrol (node ``n`` has
    NodeAddr ``addrs[n]``) and srun (it records its call and exits); ``env_over``: more
    environment (SLURM_JOB_ID, TMPDIR)."""
    import os
    import subprocess
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    nodes = "\n".join(addrs)
    shows = "\n".join(f'  {n}) echo "NodeName={n} NodeAddr={a} State=IDLE";;'
                      for n, a in addrs.items())
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$2" = hostnames ]; then printf "%s\\n" "{nodes}"; exit 0; fi\n'
        f'case "$3" in\n{shows}\nesac\n')
    (bin_dir / "srun").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/srun-calls\n")
    for f in ("scontrol", "srun"):
        (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": ",".join(addrs), "TMPDIR": str(tmp_path), **env_over}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_a_head_on_loopback_with_nodes_elsewhere_is_named(tmp_path, capsys):
    """A head node whose name resolves to a loopback address (Debian's /etc/hosts maps the host
    name to 127.0.1.1) while other nodes have real ones: the Ray workers would dial their own
    loopback and the job waited out its deadline, the cause left to a worker's log. Named
    before any srun step; nodes all on loopback (one machine, the local-slurm test) pass."""
    rc, script, err = _launch(tmp_path, capsys, "--nodes", "2")
    assert rc == 0, err
    bad = _run_script(tmp_path, script, {"n1": "127.0.1.1", "n2": "10.0.0.2"})
    assert bad.returncode == 1
    assert ("ERROR: head node n1 resolves to the loopback address 127.0.1.1 (its NodeAddr, or "
            "/etc/hosts): node n2 (10.0.0.2) cannot reach a Ray head there; give n1 a NodeAddr "
            "in slurm.conf that other nodes reach") in bad.stderr
    assert not (tmp_path / "srun-calls").exists()
    one_machine = _run_script(tmp_path, script, {"n1": "127.0.0.1", "n2": "127.0.0.2"})
    assert "resolves to the loopback" not in one_machine.stderr
    assert "Ray head on n1 (127.0.0.1:" in one_machine.stderr       # got as far as the head
    assert "ray start --head --node-ip-address=127.0.0.1" in (tmp_path / "srun-calls").read_text()


def test_rays_temp_dir_goes_under_tmp_when_tmpdir_leaves_no_room_for_its_sockets(tmp_path,
                                                                                capsys):
    """A per-job TMPDIR (/local/scratch/<job id>) long enough that Ray's socket paths under
    $TMPDIR/hacpo-slurm-ray-<job id> pass the AF_UNIX limit (107 bytes): every `ray start`
    failed. The job says so and gives Ray a temp dir under /tmp; a short TMPDIR is kept."""
    import os
    import shutil
    import tempfile

    from hacpo.launch.ray_wait import RAY_SOCKET_TAIL
    rc, script, err = _launch(tmp_path, capsys)
    assert rc == 0, err
    job = f"9{os.getpid()}"      # the fallback dir is the machine's own /tmp: not another's
    long = tmp_path / "local" / "scratch" / job
    long.mkdir(parents=True)
    ray_tmp = f"{long}/hacpo-slurm-ray-{job}"
    assert len(ray_tmp) + RAY_SOCKET_TAIL > 107       # the case at hand
    p = _run_script(tmp_path, script, {"n1": "127.0.0.1"}, SLURM_JOB_ID=job, TMPDIR=str(long))
    assert (f"[hacpo launch] Ray's socket paths under {ray_tmp} (TMPDIR) would exceed the "
            f"AF_UNIX limit of 107 bytes: Ray's temp dir is under /tmp instead") in p.stdout
    calls = (tmp_path / "srun-calls").read_text()
    assert f"--temp-dir=/tmp/hacpo-slurm-ray-{job} " in calls, calls
    assert not os.path.exists(f"/tmp/hacpo-slurm-ray-{job}")      # removed at the end
    (tmp_path / "srun-calls").unlink()
    short = tempfile.mkdtemp(prefix="s", dir="/tmp")      # (pytest's tmp_path is too long)
    try:
        p = _run_script(tmp_path, script, {"n1": "127.0.0.1"}, SLURM_JOB_ID=job, TMPDIR=short)
    finally:
        shutil.rmtree(short)
    assert "AF_UNIX" not in p.stdout + p.stderr
    assert f"--temp-dir={short}/hacpo-slurm-ray-{job} " in (tmp_path / "srun-calls").read_text()
