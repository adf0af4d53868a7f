"""Shared pieces of the launcher tests: running the CLI as a subprocess, checking a finished
tiny run, finding processes that mention a path."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_STEPS = 2
# What an in-process Ray test earlier in the session leaves in os.environ (ray_cluster.connect
# sets it); the launchers must still bring up multi-node clusters.
INHERITED_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def run_benchmark(script: str, args: list[str], *, timeout: float = 300,
                  temp_prefix: str | None = None) -> subprocess.CompletedProcess:
    """``benchmarks/SCRIPT ARGS`` in a fresh interpreter (repo root on PYTHONPATH, one OpenMP
    thread), output captured; asserts it exited 0 (its output tails in the message) and, given
    ``temp_prefix``, that it left no new ``<temp dir>/<temp_prefix>*`` behind."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    pattern = os.path.join(tempfile.gettempdir(), f"{temp_prefix}*")
    before = set(glob.glob(pattern)) if temp_prefix else set()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if temp_prefix:
        assert set(glob.glob(pattern)) <= before, f"{script} left {pattern} behind"
    return proc


def hacpo(args: list[str], *, env: dict | None = None, timeout: float = 300,
          cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``hacpo ARGS`` in a fresh interpreter (what a user runs), output captured."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hacpo.launch.cli", *args], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def tiny_run_args(out_dir: Path, cache_dir: Path) -> list[str]:
    """The tiny CPU config: 3 agents, 3 tokenizers, 2 RL steps, 1 thread per rollout actor."""
    return ["--preset", "tiny3", "--out-dir", str(out_dir),
            "--set", f"steps={TINY_STEPS}", f"cache_dir={cache_dir}", "threads=1",
            "plots=false", "tensorboard=false"]


def check_finished_run(out_dir: Path, *, ray_address_prefix: str) -> dict:
    """A completed tiny run: one metrics line per step, a checkpoint, a summary, and a config
    that says the rollouts went through the Ray engine at the launcher's cluster."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == list(range(TINY_STEPS))
    assert (out_dir / "checkpoint.pt").stat().st_size > 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert set(summary["before"]) == set(summary["after"]) == {"char", "qwen3", "llama"}
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["rollout"]["engine"] == "ray"
    assert cfg["rollout"]["ray_address"].startswith(ray_address_prefix), cfg["rollout"]
    return cfg


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def processes_mentioning(text: str) -> list[str]:
    """``pid cmdline`` of every live process whose command line contains ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{d.name} {cmd[:200]}")
    return out


def two_agent_cfg(tmp_path: Path, name: str = "run", **over):
    """tiny3 reduced to its first two agents (char and reduced-vocab Qwen3 tokenizers), with
    drop_unencodable=false: the warm-up leaves the agents nearly random, and neither reduced
    vocabulary can spell the other's random text, so with the default every cross sample is
    dropped (16 a step) and a run trains no cross term at all; kept, each learner trains 8
    cross samples a step (assert_trained_cross)."""
    import dataclasses

    from hacpo.engine.run_config import load_config
    base = {"out_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"),
            "threads": 1, "plots": False, "tensorboard": False, "drop_unencodable": False}
    cfg = load_config("tiny3", overrides={**base, **over})
    return dataclasses.replace(cfg, agents=cfg.agents[:2])


def assert_trained_cross(rows: list[dict], names) -> None:
    """Every learner in ``names`` trained on cross samples (the other agents' re-tokenized
    responses) over the run's metrics ``rows``: a backend compared with the local trainer on
    such a run is compared on HACPO's cross-agent term too, not only on self samples."""
    for name in names:
        assert sum(r[f"train/{name}/cross_count"] for r in rows) > 0, \
            (name, [r[f"train/{name}/cross_count"] for r in rows])


def perturb_weights(policy, seed: int) -> None:
    """Add seeded noise (0.05 x N(0, 1)) to every parameter of ``policy``, in place: weights
    that differ from the ones an engine was started with, so a weight sync must matter."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


# -- fault-injection helpers ----------------------------------------------------------------------
def capture_instances(monkeypatch, cls) -> list:
    """Every instance of ``cls`` constructed while ``monkeypatch`` holds (appended after its
    ``__init__`` returns), e.g. to reach a run's agent group from the test."""
    made = []
    real_init = cls.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(cls, "__init__", init)
    return made


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    """Start ``fn()`` in a thread; the dict receives its "result" or its exception ("err")."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as e:           # handed to the test thread
            out["err"] = e
    th = threading.Thread(target=run)
    th.start()
    return th, out


def wait_for_first_step(metrics: Path, th: threading.Thread, out: dict, timeout_s: float) -> None:
    """Until the run in ``th`` has logged a step to ``metrics`` (it must stay alive meanwhile)."""
    t0 = time.time()
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.time() - t0 < timeout_s and th.is_alive(), ("run never logged a step", out)
        time.sleep(0.05)


def free_cpus_back(total: int = 4, timeout: float = 30) -> None:
    """Until the Ray cluster has ``total`` free CPUs again (actors killed, groups removed)."""
    import ray
    deadline = time.time() + timeout
    while ray.available_resources().get("CPU", 0) < total:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def reap(pids) -> None:
    """Test cleanup: a process a test froze (SIGSTOP) must not outlive it."""
    for pid in pids:
        if alive(pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def install_ray_stand_ins(monkeypatch, module, fake_ray, cluster_base, **more):
    """A Ray launcher module (ray_rollout, ray_trainer) without a Ray cluster: its ``ray`` is
    ``fake_ray``, ``connect`` gives a ``cluster_base`` subclass (made with the shared call log;
    its ``release`` recorded), the placement strategy its keyword arguments, and each of
    ``more`` that module attribute. Returns ``fake_ray``, whose ``log`` holds the cluster's
    calls and ``released`` what ``close`` released."""
    log, released = [], []

    class Cluster(cluster_base):
        @staticmethod
        def release(actors, pgs):
            released.append((list(actors), list(pgs)))

    def connect(address, *, timeout_s, num_cpus, weights):
        log.append(("connect", num_cpus))
        return Cluster(log)
    for name, value in {"ray": fake_ray, "connect": connect, "RayCluster": Cluster,
                        "PlacementGroupSchedulingStrategy": lambda **kw: kw, **more}.items():
        monkeypatch.setattr(module, name, value)
    fake_ray.log, fake_ray.released = log, released
    return fake_ray
