"""Shared pieces of the launcher tests: running the CLI as a subprocess, checking a finished
tiny run, finding processes that mention a path."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_STEPS = 2
# What an in-process Ray test earlier in the session leaves in os.environ (ray_cluster.connect
# sets it); the launchers must still bring up multi-node clusters.
INHERITED_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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
    """tiny3 reduced to its first two agents (char and reduced-vocab Qwen3 tokenizers)."""
    import dataclasses

    from hacpo.engine.run_config import load_config
    base = {"out_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"),
            "threads": 1, "plots": False, "tensorboard": False}
    cfg = load_config("tiny3", overrides={**base, **over})
    return dataclasses.replace(cfg, agents=cfg.agents[:2])
