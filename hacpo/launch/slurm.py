"""``hacpo launch slurm``: run ``hacpo train`` on a Ray cluster that a Slurm job brings up.

The launcher loads and checks the run config (so a bad config fails here, before anything is
submitted), writes an sbatch script into the run dir and submits it. The script:

1. makes a fresh Ray authentication token for the job (``RAY_AUTH_MODE=token``: Ray listens on
   every interface of every node, and only the job's own processes, which get the token through
   their environment, may join or drive the cluster), starts a Ray head on the job's first node
   (``srun -w NODE ray start --head --block``, one task, in the background) and waits until
   its GCS answers;
2. starts a Ray worker on every other node the same way and waits until all N nodes are
   registered. Both waits share one deadline (``--ray-timeout``); if it passes, or a node's
   ``ray start`` exits, the job prints which node / what timed out and exits 1 (Slurm state
   FAILED);
3. runs the driver: ``hacpo train ... --set rollout.engine=ray rollout.ray_address=HEAD:PORT``
   (``--resume`` with ``hacpo launch --resume``, and always in a job Slurm requeued, e.g.
   after a preemption: ``SLURM_RESTART_COUNT`` > 0), in the background: a SIGUSR1 to the
   script (``--checkpoint-before-limit S``: Slurm's ``--signal=B:USR1@S`` before the time
   limit) is passed on to it, it writes a checkpoint at the end of its step and exits 75, and
   the job then requeues itself (with the option) to resume from there;
4. ends the ``srun`` steps (SIGTERM to each step; ``ray start --block`` then stops its node's
   processes) and removes the Ray temp dir. Never ``ray stop``: on a shared machine it would
   stop every Ray there.

``--wait`` polls the job until it ends and reports its state and exit code; with
``--wait-timeout S`` a job not finished S seconds after submission (queue time included) is
cancelled (``scancel``) and the command exits 124 naming the job, the elapsed time and its logs.
``hacpo launch local`` (:mod:`hacpo.launch.launch_local`) does the same without Slurm.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Overrides the launcher owns: the driver gets them from the launch options.
_LAUNCHER_KEYS = ("rollout.engine", "rollout.ray_address")


class LaunchError(RuntimeError):
    """Bad launch input or a failed submission: printed as ``hacpo launch: error: ...``."""
    exit_code = 2


class WaitTimeout(LaunchError):
    """``--wait-timeout`` passed: the job was cancelled (exit code 124, as ``timeout(1)``)."""
    exit_code = 124


def check_wait_timeout(value: float | None) -> None:
    if value is not None and not value > 0:
        raise LaunchError(f"--wait-timeout must be > 0 seconds, got {value:g}")


# --------------------------------------------------------------------------------------------
# run config: loaded and checked before anything starts
# --------------------------------------------------------------------------------------------
def load_run(args):
    """The resolved TrainConfig of the run (``--preset/--config/--algorithm/--steps/--set/
    --out-dir``, resolved as ``hacpo train`` resolves them), or the config loader's error as a
    :class:`LaunchError`."""
    import argparse

    from hacpo.engine.configtools import parse_overrides
    from hacpo.engine.run_config import accepted_encoding_agents
    from .cli import accept_arg, train_config
    if args.config and not Path(args.config).is_file():
        raise LaunchError(f"--config {args.config}: no such file")
    if accept_arg(args) and not args.resume:
        raise LaunchError("--accept-encoding-change applies with --resume only (a new run "
                          "has no encoding to change)")
    try:
        overrides = parse_overrides(args.set or [])
    except (ValueError, KeyError) as e:
        raise LaunchError(f"--set: {e}") from e
    for k in _LAUNCHER_KEYS:
        if k in overrides:
            raise LaunchError(f"--set {k}=... is set by the launcher; use --rollout-engine "
                              f"(the Ray address is the job's head node)")
    run_args = argparse.Namespace(
        preset=args.preset, config=args.config, algorithm=args.algorithm, steps=args.steps,
        out_dir=args.out_dir, set=list(args.set or []))
    try:
        if args.rollout_engine is None:     # the config's engine (a vllm config stays vllm)
            engine = train_config(run_args)[0].rollout.engine
            args.rollout_engine = "ray" if engine == "local" else engine
        run_args.set.append(f"rollout.engine={args.rollout_engine}")
        cfg, _ = train_config(run_args)
        cfg.check_runnable()            # e.g. vLLM engines for plain-torch decoder agents
    except Exception as e:  # the config loader's own error (yaml, unknown key, bad value)
        raise LaunchError(f"config {args.config or '(preset ' + args.preset + ')'} does not "
                          f"load: {type(e).__name__}: {e}") from e
    try:                                # names that are not the run's agents: before submit
        accepted_encoding_agents(accept_arg(args), [a.policy.name for a in cfg.agents])
    except ValueError as e:
        raise LaunchError(str(e)) from None
    _check_run_dir(cfg, args.resume)
    return cfg


def _check_run_dir(cfg, resume: bool) -> None:
    """What the driver would refuse, refused before anything starts (or waits in a queue): a
    run dir that is a file, one holding a run without ``--resume``, a checkpoint ``--resume``
    cannot continue with this config (:func:`hacpo.engine.trainer.check_run_dir`)."""
    from hacpo.engine.trainer import CHECKPOINT, check_run_dir
    run_dir = Path(cfg.out_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise LaunchError(f"the run dir {run_dir} is a file, not a directory")
    above = run_dir.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():      # e.g. --out-dir some_file/run: the driver could not make it
        raise LaunchError(f"cannot create the run dir {run_dir}: {above} is a file, not a "
                          f"directory")
    if (run_dir / CHECKPOINT).exists() and not resume:
        raise LaunchError(f"{run_dir} already holds a run ({CHECKPOINT}); pass --resume to "
                          f"continue it or choose another --out-dir")
    try:
        check_run_dir(cfg, resume)
    except (ValueError, OSError) as e:     # (FileExistsError, a dangling checkpoint link)
        raise LaunchError(str(e)) from None


def cluster_needs(cfg) -> dict[str, float]:
    """Ray resources the run needs that can be known from the config alone: CPUs for the
    trainer actors (``trainer_backend=ray``) and the remote rollout pool
    (:func:`hacpo.engine.run_config.trainer_cpus`, :func:`~hacpo.engine.run_config.rollout_cpus`),
    GPUs (:func:`hacpo.engine.run_config.gpu_needs`)."""
    from hacpo.engine.run_config import gpu_needs, rollout_cpus, trainer_cpus

    need = {}
    if trainer_cpus(cfg) + rollout_cpus(cfg):
        need["CPU"] = trainer_cpus(cfg) + rollout_cpus(cfg)
    if sum(gpu_needs(cfg)):
        need["GPU"] = sum(gpu_needs(cfg))
    return need


def _cpu_parts(cfg) -> str:
    """What the run's Ray CPUs are for, e.g. "3 for trainer actors (trainer_backend=ray, 3 ranks
    x threads=1) + 3 for its rollout.engine=ray actors (3 agents x rollout.engines_per_agent=1
    x 1 CPU (threads))"."""
    from hacpo.engine.run_config import colocated_engines, rollout_cpus, trainer_cpus
    r, n = cfg.rollout, len(cfg.agents)
    threads = cfg.threads if cfg.threads > 0 else 1
    parts = []
    if trainer_cpus(cfg):
        ranks = (trainer_cpus(cfg) - colocated_engines(cfg)) // threads
        parts.append(f"{trainer_cpus(cfg)} for trainer actors (trainer_backend=ray, {ranks} "
                     f"ranks x threads={threads}"
                     + (f" + {colocated_engines(cfg)} colocated vLLM engines"
                        if colocated_engines(cfg) else "") + ")")
    if rollout_cpus(cfg):
        per = threads if r.engine == "ray" else r.engine_tp
        parts.append(f"{rollout_cpus(cfg)} for its rollout.engine={r.engine} actors ({n} "
                     f"agents x rollout.engines_per_agent={r.engines_per_agent} x {per} CPU"
                     + (" (threads)" if r.engine == "ray" else " (rollout.engine_tp)") + ")")
    return " + ".join(parts)


def check_resources(cfg, nodes: int, cpus_per_node: int | None, gpus_per_node: int) -> None:
    if nodes < 1:
        raise LaunchError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise LaunchError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    if cpus_per_node is not None and cpus_per_node < 1:
        raise LaunchError(f"--cpus-per-node must be >= 1, got {cpus_per_node}")
    need = cluster_needs(cfg)
    if cpus_per_node is not None and need.get("CPU", 0) > nodes * cpus_per_node:
        raise LaunchError(
            f"the run needs {need['CPU']:g} Ray CPUs ({_cpu_parts(cfg)}) but {nodes} node(s) "
            f"x --cpus-per-node {cpus_per_node} give {nodes * cpus_per_node}; add nodes or "
            f"CPUs, or lower threads or rollout.engines_per_agent")
    if need.get("GPU", 0) > nodes * gpus_per_node:
        from hacpo.engine.run_config import gpu_needs

        ranks, engines = gpu_needs(cfg)
        raise LaunchError(
            f"the run needs {need['GPU']} GPUs ({ranks} for megatron ranks with "
            f"parallel.device=cuda + {engines} for vLLM engines with rollout.device=cuda, "
            f"rollout.engine_tp each) but "
            f"{nodes} node(s) x --gpus-per-node {gpus_per_node} give "
            f"{nodes * gpus_per_node}; add nodes or GPUs, lower tp / pp / dp or "
            f"rollout.engines_per_agent, or colocate the engines (rollout.colocate)")
    # Ray places each actor (a placement-group bundle too) on one node: enough in total is not
    # enough if one actor needs more than a node has (it would wait for resources forever,
    # until the engine's start timeout, the Slurm job holding its nodes all the while)
    for what, res in single_actor_needs(cfg):
        for key, per_node, flag in (("GPU", gpus_per_node, "--gpus-per-node"),
                                    ("CPU", cpus_per_node, "--cpus-per-node")):
            if per_node is not None and res.get(key, 0) > per_node:
                raise LaunchError(
                    f"{what} needs {res[key]:g} {key}s on one node (Ray places an actor on a "
                    f"single node) but {flag} is {per_node}; lower it or use nodes with more "
                    f"{key}s")


def single_actor_needs(cfg) -> list[tuple[str, dict[str, float]]]:
    """(who, Ray resources) of each kind of actor of the run that Ray must place whole on one
    node: a vLLM engine (``engine_tp`` CPUs, and GPUs on CUDA, for its TP worker processes;
    colocated engines are in the trainer ranks' bundles), a ``rollout.engine=ray`` actor
    (``threads`` CPUs) and a trainer rank (``trainer_backend=ray``: ``threads`` CPUs, one more
    for a colocated engine, one GPU for a megatron rank on cuda)."""
    from hacpo.engine.run_config import colocated_engines
    r = cfg.rollout
    threads = cfg.threads if cfg.threads > 0 else 1
    out = []
    if r.engine == "vllm" and not r.colocate:
        out.append((f"each vLLM engine (rollout.engine_tp={r.engine_tp}, rollout.device="
                    f"{r.device})", {"CPU": r.engine_tp,
                                     "GPU": r.engine_tp if r.device == "cuda" else 0}))
    elif r.engine == "ray":
        out.append((f"each rollout.engine=ray actor (threads={threads})", {"CPU": threads}))
    if cfg.trainer_backend == "ray":
        cuda = any(a.trainer == "megatron" and a.parallel.device == "cuda" for a in cfg.agents)
        out.append((f"each trainer rank (trainer_backend=ray, threads={threads}"
                    + (" + 1 colocated vLLM engine" if colocated_engines(cfg) else "") + ")",
                    {"CPU": threads + (1 if colocated_engines(cfg) else 0),
                     "GPU": 1 if cuda else 0}))
    return out


def driver_argv(args, cfg, python: str) -> list[str]:
    """``hacpo train`` for the driver, minus the Ray address (known only once the job runs).
    Paths are absolute: the job may start elsewhere."""
    from .cli import accept_arg
    argv = [python, "-m", "hacpo.launch.cli", "train", "--preset", args.preset,
            "--out-dir", str(Path(cfg.out_dir).resolve())]
    if args.resume:
        argv.append("--resume")
    if accept_arg(args):
        argv += ["--accept-encoding-change"] + list(args.accept_encoding_change)
    if args.algorithm:
        argv += ["--algorithm", args.algorithm]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.config:
        argv += ["--config", str(Path(args.config).resolve())]
    argv += ["--set", *(args.set or []), f"rollout.engine={args.rollout_engine}"]
    return argv


# --------------------------------------------------------------------------------------------
# the sbatch script
# --------------------------------------------------------------------------------------------
SBATCH_TEMPLATE = r"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --output={output_dir}/slurm-%j.out
#SBATCH --chdir={workdir}
{extra_sbatch}# Generated by `hacpo launch slurm`. Ray head on the first node, a Ray worker on each
# other node (one background srun step per node), wait for all {nodes} nodes (deadline
# {ray_timeout}s), run the driver, end the srun steps (never `ray stop`).
set -uo pipefail
export SLURM_EXPORT_ENV=ALL   # the srun steps get this environment (--export=NONE would drop PATH)
{setup}export PATH={bin_dir}:$PATH
export RAY_USAGE_STATS_ENABLED=0
export RAY_task_events_max_num_task_in_gcs=${{RAY_task_events_max_num_task_in_gcs:-10000}}   # bounded GCS
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1   # an inherited 0 would refuse every worker node
PY={python}
# Ray listens on every interface of every node: the cluster requires a token, made here for this
# job only and passed to the srun steps and the driver through their environment (never written
# to a file or printed)
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))') &&
  [ -n "$RAY_AUTH_TOKEN" ] || {{ echo "[hacpo launch] ERROR: cannot make a Ray token" >&2; exit 1; }}
export RAY_AUTH_TOKEN
RAY_PORT={ray_port}
RAY_TIMEOUT={ray_timeout}
LOG_DIR={log_dir}/job-$SLURM_JOB_ID
# Ray's socket paths live in RAY_TMP, the longest {socket_tail} bytes longer, and an AF_UNIX path
# holds {socket_max}: a per-job TMPDIR (/local/scratch/<job id>) may leave no room, /tmp then
ray_sockets_fit() {{ (( $(printf %s "$1" | wc -c) + {socket_tail} <= {socket_max} )); }}
RAY_TMP=${{TMPDIR:-/tmp}}/hacpo-slurm-ray-$SLURM_JOB_ID
if ! ray_sockets_fit "$RAY_TMP"; then
  echo "[hacpo launch] Ray's socket paths under $RAY_TMP (TMPDIR) would exceed the AF_UNIX" \
    "limit of {socket_max} bytes: Ray's temp dir is under /tmp instead"
  RAY_TMP=/tmp/hacpo-slurm-ray-$SLURM_JOB_ID
  ray_sockets_fit "$RAY_TMP" || {{ echo "[hacpo launch] ERROR: Ray's socket paths under" \
    "$RAY_TMP would exceed the AF_UNIX limit of {socket_max} bytes too" >&2; exit 1; }}
fi
NODE_ARGS=({node_args})
mkdir -p "$LOG_DIR" "$RAY_TMP"
T0=$(date +%s)
DEADLINE=$((T0 + RAY_TIMEOUT))
SRUN_PIDS=()
STEP_NODES=()   # the node of each srun step in SRUN_PIDS
WORKER_NODES=()   # the nodes with a Ray worker (their own temp dir is removed at the end)

say() {{ echo "[hacpo launch] $(date +%H:%M:%S) $*"; }}
fail() {{ echo "[hacpo launch] ERROR: $*" >&2; exit 1; }}
cleanup() {{  # end our srun steps: SIGTERM, then SIGKILL after 30 s; then Ray's temp dir
  local rc=$? pid
  trap : TERM INT USR1   # (the time limit's TERM, the requeue's) never cut it short
  if ((${{#SRUN_PIDS[@]}})); then
    say "ending the Ray srun steps (pids ${{SRUN_PIDS[*]}})"
    kill -TERM "${{SRUN_PIDS[@]}}" 2>/dev/null
    for _ in $(seq 60); do
      pid=""; for p in "${{SRUN_PIDS[@]}}"; do kill -0 "$p" 2>/dev/null && pid=$p; done
      [ -z "$pid" ] && break; sleep 0.5
    done
    kill -KILL "${{SRUN_PIDS[@]}}" 2>/dev/null
    wait 2>/dev/null
  fi
  rm -rf "$RAY_TMP"
  if ((${{#WORKER_NODES[@]}})); then   # this script runs on the head: the workers' dirs too
    if timeout 60 srun --nodes=${{#WORKER_NODES[@]}} --ntasks=${{#WORKER_NODES[@]}} \
        --ntasks-per-node=1 --overlap -w "$(IFS=,; echo "${{WORKER_NODES[*]}}")" \
        rm -rf "$RAY_TMP" >/dev/null 2>&1; then
      say "removed Ray's temp dir on ${{WORKER_NODES[*]}}"
    else
      say "could not remove Ray's temp dir $RAY_TMP on ${{WORKER_NODES[*]}}"
    fi
  fi
  if ((REQUEUE)); then   # last: Slurm ends this script as it requeues the job
    say "requeueing the job: it resumes the run from that checkpoint when it starts again"
    scontrol requeue "$SLURM_JOB_ID" ||
      echo "[hacpo launch] ERROR: \`scontrol requeue $SLURM_JOB_ID\` failed: submit the job" \
        "again with --resume to continue the run" >&2
  fi
  say "job exits with $rc"
  exit $rc
}}
trap cleanup EXIT
DRIVER_PID=""   # the driver while it runs (in the background: signals reach the traps at once)
GOT_USR1=0
REQUEUE=0
REQUEUE_ON_STOP={requeue_on_stop}   # 1: --checkpoint-before-limit given
TRAPPED=0
wait_driver() {{  # RC: the driver's exit status (a trap ends `wait` early: 128 + its signal)
  while :; do TRAPPED=0; wait "$DRIVER_PID"; RC=$?; ((TRAPPED)) || break; done
}}
on_stop() {{  # TERM / INT (scancel, the time limit): the driver, signalled with the job, ends first
  TRAPPED=1
  if [ -n "$DRIVER_PID" ]; then  # (a background job ignores SIGINT: it gets SIGTERM for it)
    [ "$1" = INT ] && kill -TERM "$DRIVER_PID" 2>/dev/null
    wait_driver
  fi
  fail "job cancelled or timed out (signal)"
}}
on_usr1() {{  # --signal=B:USR1@N before the time limit, or `scancel --batch --signal=USR1`
  TRAPPED=1
  GOT_USR1=1
  if [ -n "$DRIVER_PID" ]; then
    say "SIGUSR1: the driver writes a checkpoint at the end of its step and stops"
    kill -USR1 "$DRIVER_PID" 2>/dev/null
  fi
}}
trap 'on_stop TERM' TERM
trap 'on_stop INT' INT
trap on_usr1 USR1
stopped_nodes() {{  # the nodes whose Ray srun step has exited
  local i
  for i in "${{!SRUN_PIDS[@]}}"; do
    kill -0 "${{SRUN_PIDS[$i]}}" 2>/dev/null || echo "${{STEP_NODES[$i]}}"
  done
}}
node_ip() {{  # a node's NodeAddr, resolved to an IPv4 address
  local a
  a=$(scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  [ -n "$a" ] || return 1
  [[ $a =~ ^[0-9]+(\.[0-9]+){{3}}$ ]] || a=$(getent ahostsv4 "$a" | awk 'NR==1{{print $1}}')
  [ -n "$a" ] && echo "$a"
}}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${{#NODES[@]}} == {nodes})) ||
  fail "allocation has ${{#NODES[@]}} nodes (${{NODES[*]}}), expected {nodes}"
HEAD=${{NODES[0]}}
declare -A NODE_IP
for NODE in "${{NODES[@]}}"; do
  NODE_IP[$NODE]=$(node_ip "$NODE") || fail "cannot resolve the IP of node $NODE"
done
HEAD_IP=${{NODE_IP[$HEAD]}}
if [[ $HEAD_IP == 127.* ]]; then  # e.g. /etc/hosts mapping the host name to 127.0.1.1
  for NODE in "${{NODES[@]:1}}"; do
    [[ ${{NODE_IP[$NODE]}} == 127.* ]] || fail "head node $HEAD resolves to the loopback" \
      "address $HEAD_IP (its NodeAddr, or /etc/hosts): node $NODE (${{NODE_IP[$NODE]}}) cannot" \
      "reach a Ray head there; give $HEAD a NodeAddr in slurm.conf that other nodes reach"
  done
fi
ADDR=$HEAD_IP:$RAY_PORT
say "nodes: ${{NODES[*]}}; Ray head $HEAD at $ADDR; logs in $LOG_DIR"

# 1. Ray head on the first node
srun --nodes=1 --ntasks=1 --overlap -w "$HEAD" ray start --head --node-ip-address="$HEAD_IP" \
  --port="$RAY_PORT" --temp-dir="$RAY_TMP" --include-dashboard=false "${{NODE_ARGS[@]}}" --block \
  >"$LOG_DIR/ray-$HEAD.log" 2>&1 &
SRUN_PIDS+=($!)
STEP_NODES+=("$HEAD")
WAIT_NODES=(--node "$HEAD=$HEAD_IP:$!:$LOG_DIR/ray-$HEAD.log")
"$PY" -m hacpo.launch.ray_wait --phase "ray head" --address "$ADDR" --deadline "$DEADLINE" \
  "${{WAIT_NODES[@]}}" ||
  fail "Ray head on $HEAD ($ADDR) is not up (error above); deadline ${{RAY_TIMEOUT}}s"

# 2. a Ray worker on each other node
for NODE in "${{NODES[@]:1}}"; do
  IP=${{NODE_IP[$NODE]}}
  srun --nodes=1 --ntasks=1 --overlap -w "$NODE" ray start --address="$ADDR" \
    --node-ip-address="$IP" --temp-dir="$RAY_TMP" "${{NODE_ARGS[@]}}" --block \
    >"$LOG_DIR/ray-$NODE.log" 2>&1 &
  SRUN_PIDS+=($!)
  STEP_NODES+=("$NODE")
  WORKER_NODES+=("$NODE")
  WAIT_NODES+=(--node "$NODE=$IP:$!:$LOG_DIR/ray-$NODE.log")
done
"$PY" -m hacpo.launch.ray_wait --phase "ray cluster" --address "$ADDR" --deadline "$DEADLINE" \
  "${{WAIT_NODES[@]}}" ||
  fail "Ray cluster of {nodes} nodes is not up (error above); deadline ${{RAY_TIMEOUT}}s"
say "Ray cluster of {nodes} nodes up after $(( $(date +%s) - T0 ))s"

# 3. the driver
DRIVER=({driver} "rollout.ray_address=$ADDR")
if (( ${{SLURM_RESTART_COUNT:-0}} > 0 )) && ! {resumes}; then   # (true: launched with --resume)
  DRIVER+=(--resume)   # requeued (preemption, node failure): continue from the last checkpoint
  say "restart $SLURM_RESTART_COUNT of this job: the driver resumes the run"
fi
if ((GOT_USR1)); then   # the time limit is near already: no step could be run and checkpointed
  say "SIGUSR1 before the driver started: nothing new to checkpoint; the job stops (--resume" \
    "continues the run from its last checkpoint)"
  exit {stopped}
fi
say "driver: ${{DRIVER[*]}}"
"${{DRIVER[@]}}" &
DRIVER_PID=$!
((GOT_USR1)) && kill -USR1 "$DRIVER_PID"   # it came as the driver started
wait_driver
DRIVER_PID=""
say "driver exited with $RC"
if ((RC == {stopped} && GOT_USR1)); then
  if ((REQUEUE_ON_STOP)); then
    say "the driver stopped at its checkpoint before the time limit"
    REQUEUE=1
  else
    say "the driver stopped at its checkpoint (SIGUSR1): submit the job again with --resume" \
      "to continue the run"
  fi
elif ((RC != 0)); then  # did it fail because Ray went away (e.g. the head's GCS died: the driver
  LOST=""             # then exits 1 without a message)? A step may end a moment after it
  for _ in $(seq 10); do LOST=$(stopped_nodes); [ -n "$LOST" ] && break; sleep 0.5; done
  for NODE in $LOST; do
    echo "[hacpo launch] ERROR: the Ray node $NODE stopped while the driver ran (its srun" \
      "step exited); last lines of $LOG_DIR/ray-$NODE.log:" >&2
    tail -n 15 "$LOG_DIR/ray-$NODE.log" | sed 's/^/    | /' >&2
  done
  [ -z "$LOST" ] ||
    echo "[hacpo launch] ERROR: the driver failed (exit $RC) after the Ray node(s)" $LOST \
      "stopped; --resume continues the run from its last checkpoint" >&2
fi
exit $RC
"""


def render_sbatch(args, cfg, *, python: str | None = None) -> str:
    """The sbatch script for ``args`` (the ``hacpo launch slurm`` options) and run ``cfg``."""
    python = python or sys.executable
    q = shlex.quote
    run_dir = Path(cfg.out_dir).resolve()
    advice = ": choose a path without them"
    lines = [("the run dir", str(run_dir), advice), ("the working directory", os.getcwd(), advice)]
    lines += [(flag, v, "") for flag, v in (("--job-name", args.job_name),
                                            ("--partition", args.partition),
                                            ("--time", args.time)) if v is not None]
    lines += [("--sbatch-arg", a, "") for a in args.sbatch_arg or []]
    for what, value, why in lines:
        # sbatch reads '\' in an #SBATCH line as an escape, quoted or not (--output, --chdir
        # then name another folder; a value loses it); a newline ends the line and the #SBATCH
        # block (sbatch then ignored --nodes, --output, ...; bash read the rest as commands)
        if "\\" in value or "\n" in value:
            raise LaunchError(f"{what} {value!r} holds a backslash or a newline, which an "
                              f"#SBATCH line cannot carry{why}")
    extra = []
    if args.partition:
        extra.append(f"--partition={q(args.partition)}")
    if args.time:
        extra.append(f"--time={q(args.time)}")
    before = getattr(args, "checkpoint_before_limit", None)
    if before is not None:      # the job script passes B:USR1 on to the driver; then requeues
        extra += [f"--signal=B:USR1@{before}", "--requeue"]
    if args.gpus_per_node:
        extra.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_node:
        extra.append(f"--cpus-per-task={args.cpus_per_node}")
    for a in args.sbatch_arg or []:
        # the value of --key=value quoted ("--comment=my run": sbatch split it at the space,
        # and a '#' in it began a comment)
        key, eq, value = a.partition("=")
        extra.append(f"{key}={q(value)}" if eq and key.startswith("-") else a)
    node_args = [f"--num-cpus={args.cpus_per_node}" if args.cpus_per_node
                 else "--num-cpus=${SLURM_CPUS_ON_NODE:-1}",
                 f"--num-gpus={args.gpus_per_node}"]
    if args.object_store_mb:
        node_args.append(f"--object-store-memory={args.object_store_mb * 1024 * 1024}")
    from hacpo.engine.signals import CHECKPOINT_STOPPED

    # the nodes' limit (Linux), whatever machine renders the script
    from .ray_wait import LINUX_AF_UNIX_PATH_MAX, RAY_SOCKET_TAIL
    return SBATCH_TEMPLATE.format(
        job_name=q(args.job_name), nodes=args.nodes, log_dir=q(str(run_dir / "slurm")),
        # --output expands %j, %x, ...: a '%' of the path itself is written %%
        output_dir=q(str(run_dir / "slurm").replace("%", "%%")),
        workdir=q(os.getcwd()),
        extra_sbatch="".join(f"#SBATCH {a}\n" for a in extra),
        ray_timeout=math.ceil(args.ray_timeout), setup="".join(f"{s}\n" for s in args.setup or []),
        bin_dir=q(str(Path(python).parent)), python=q(python), ray_port=args.ray_port or 6379,
        node_args=" ".join(a if "${" in a else q(a) for a in node_args),
        driver=" ".join(q(a) for a in driver_argv(args, cfg, python)),
        socket_tail=RAY_SOCKET_TAIL, socket_max=LINUX_AF_UNIX_PATH_MAX,
        requeue_on_stop=int(before is not None), stopped=CHECKPOINT_STOPPED,
        resumes="true" if args.resume else "false")


# --------------------------------------------------------------------------------------------
# submit and wait
# --------------------------------------------------------------------------------------------
def _slurm_bin(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"`{name}` not found on PATH: Slurm's client commands are needed "
                          f"(run on a Slurm login node, or use `hacpo launch local`, or "
                          f"`--dry-run` to only print the script)")
    return path


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT`` -> job id."""
    p = subprocess.run([_slurm_bin("sbatch"), "--parsable", str(script)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise LaunchError(f"sbatch {script} failed (exit {p.returncode}): "
                          f"{(p.stderr or p.stdout).strip()}")
    return p.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, exit code "N:SIG") of a job Slurm still knows (scontrol, else sacct)."""
    p = subprocess.run([_slurm_bin("scontrol"), "show", "job", "-o", job_id],
                       capture_output=True, text=True)
    if p.returncode == 0 and "JobState=" in p.stdout:
        f = dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)
        return f.get("JobState", "UNKNOWN"), f.get("ExitCode", "?")
    if shutil.which("sacct"):
        p = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                           capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[:1]
        if p.returncode == 0 and line:
            state, code = line[0].split("|")
            return state.split()[0], code
    return None


_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def wait_job(job_id: str, *, poll_s: float = 2.0, timeout_s: float | None = None,
             echo=print) -> tuple[str, str]:
    """Poll until the job reaches a final state; returns (state, exit code)."""
    t0, last = time.time(), None
    while True:
        st = job_state(job_id)
        if st is None:
            raise LaunchError(f"job {job_id}: Slurm no longer knows it (no scontrol/sacct "
                              f"record); check its output file")
        if st[0] != last:
            echo(f"[hacpo launch] job {job_id}: {st[0]}")
            last = st[0]
        if st[0] in _DONE:
            return st
        if timeout_s is not None and time.time() - t0 > timeout_s:
            raise WaitTimeout(f"job {job_id} still {st[0]} after {timeout_s:g}s")
        time.sleep(poll_s)


def check_launch_numbers(args) -> None:
    """The launchers' numbers: a non-finite --ray-timeout crashed (nan waited forever), a port
    out of range or an object store <= 0 failed only inside the job (or meant Ray's default
    silently), a --poll <= 0 crashed after the job was submitted or polled without pause."""
    if not 0 < args.ray_timeout < math.inf:
        raise LaunchError(f"--ray-timeout must be a finite number of seconds > 0, got "
                          f"{args.ray_timeout}")
    if args.ray_port is not None and not 1 <= args.ray_port <= 65535:
        raise LaunchError(f"--ray-port must be a port in 1..65535, got {args.ray_port}")
    if args.object_store_mb is not None and args.object_store_mb < 1:
        raise LaunchError(f"--object-store-mb must be >= 1 (leave it out for Ray's default), "
                          f"got {args.object_store_mb}")
    poll = getattr(args, "poll", None)
    if poll is not None and not 0 < poll < math.inf:
        raise LaunchError(f"--poll must be a finite number of seconds > 0, got {poll}")


# Slurm's --signal takes at most this many seconds
SIGNAL_MAX_S = 65535


def slurm_time_s(value: str) -> int | None:
    """Seconds of a Slurm time limit (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``); None for no limit (``UNLIMITED``, ``INFINITE``, ``0``); ValueError for
    anything else."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = re.fullmatch(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", v)
    if m is None:
        raise ValueError(f"not a Slurm time limit: {value!r}")
    days, *rest = m.groups()
    nums = [int(x) for x in rest if x is not None]
    if days is not None:       # D-H, D-H:M, D-H:M:S
        h, mins, sec = (nums + [0, 0])[:3]
        total = ((int(days) * 24 + h) * 60 + mins) * 60 + sec
    elif len(nums) == 1:       # M
        total = nums[0] * 60
    elif len(nums) == 2:       # M:S
        total = nums[0] * 60 + nums[1]
    else:                      # H:M:S
        total = (nums[0] * 60 + nums[1]) * 60 + nums[2]
    return total or None       # (0: no limit, as Slurm reads it)


def check_checkpoint_before_limit(args) -> None:
    """--checkpoint-before-limit: within what Slurm's --signal takes, and before the job's own
    --time (a signal at its start would stop every requeue at once)."""
    before = args.checkpoint_before_limit
    if before is None:
        return
    if not 1 <= before <= SIGNAL_MAX_S:
        raise LaunchError(f"--checkpoint-before-limit must be 1..{SIGNAL_MAX_S} seconds "
                          f"(Slurm's --signal), got {before}")
    if args.time is None:
        return                    # the partition's default time limit
    try:
        limit = slurm_time_s(args.time)
    except ValueError as e:
        raise LaunchError(f"--time: {e}") from None
    if limit is None:
        raise LaunchError(f"--checkpoint-before-limit needs a time limit to signal before: "
                          f"--time {args.time} has none")
    if before >= limit:
        raise LaunchError(f"--checkpoint-before-limit {before} is not before --time "
                          f"{args.time} ({limit} s): the job would be signalled as it starts")


def launch_slurm(args) -> int:
    check_launch_numbers(args)
    check_checkpoint_before_limit(args)
    cfg = load_run(args)
    check_resources(cfg, args.nodes, args.cpus_per_node, args.gpus_per_node)
    check_wait_timeout(args.wait_timeout)
    if args.wait_timeout is not None and not args.wait:
        raise LaunchError("--wait-timeout needs --wait")
    script = render_sbatch(args, cfg)
    if args.dry_run:
        print(script, end="")
        # Slurm does not create #SBATCH --output's folder: a job without it fails with no output
        print(f"[hacpo launch] dry run: nothing submitted; to submit this script by hand, "
              f"mkdir -p {shlex.quote(str(Path(cfg.out_dir).resolve() / 'slurm'))} first (its "
              f"job output goes there)", file=sys.stderr)
        return 0
    _slurm_bin("sbatch")
    run_dir = Path(cfg.out_dir).resolve()
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = run_dir / "slurm" / "job.sbatch"
    # the bytes of the paths and values as given (a name not in UTF-8 raised
    # UnicodeEncodeError and left an empty script)
    path.write_bytes(os.fsencode(script))
    t0 = time.time()
    job_id = submit(path)
    out = run_dir / "slurm" / f"slurm-{job_id}.out"
    print(f"[hacpo launch] submitted job {job_id} ({args.nodes} nodes): script {path}, "
          f"output {out}", flush=True)
    if not args.wait:
        return 0
    try:
        state, code = wait_job(job_id, poll_s=args.poll, timeout_s=args.wait_timeout)
    except WaitTimeout as e:
        _print_tail(out)
        raise WaitTimeout(_cancel(job_id, t0, args.wait_timeout, str(e), out,
                                  run_dir / "slurm" / f"job-{job_id}", args.poll)) from None
    ok = state == "COMPLETED" and code.split(":")[0] == "0"
    print(f"[hacpo launch] job {job_id} finished: state {state}, exit code {code}", flush=True)
    if not ok:
        _print_tail(out)
    return 0 if ok else 1


def _print_tail(out: Path, n: int = 20) -> None:
    if out.exists():
        tail = out.read_text(errors="replace").splitlines()[-n:]
        print(f"[hacpo launch] last lines of {out}:\n" + "\n".join("  | " + t for t in tail),
              file=sys.stderr)


# After the job is signalled: how long it may take to end (the driver exits, then the job's
# cleanup ends its Ray steps, up to 30 s) before it is cancelled outright.
CANCEL_GRACE_S = 90.0


def _scancel(*args: str) -> str | None:
    """``scancel ARGS``; None, or what went wrong."""
    p = subprocess.run([_slurm_bin("scancel"), *args], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`scancel {' '.join(args)}` failed (exit {p.returncode}: " \
               f"{(p.stderr or p.stdout).strip()})"
    return None


def _ended(job_id: str, poll_s: float, timeout_s: float) -> str | None:
    """The job's final state once it has one (within ``timeout_s``), else None."""
    try:
        return wait_job(job_id, poll_s=min(poll_s, 2.0), timeout_s=timeout_s,
                        echo=lambda *_: None)[0]
    except WaitTimeout:
        return None
    except LaunchError:         # Slurm has no record left: it has ended
        return "ended (no record left)"


def _cancel(job_id: str, t0: float, timeout_s: float, why: str, out: Path, ray_logs: Path,
            poll_s: float) -> str:
    """End the job; returns the message for the error: job, elapsed time, how it was ended,
    its final state, where its logs are.

    A running job first gets SIGTERM everywhere (``scancel --full --signal=TERM``): the
    driver exits and the job script's own cleanup ends its Ray steps and removes their temp
    dir, which a plain ``scancel`` could cut short after Slurm's KillWait. A job that has not
    ended CANCEL_GRACE_S later, or was not running, is cancelled (``scancel``)."""
    t_cancel = time.time()
    st = job_state(job_id)
    how, state = [], None
    if st is not None and st[0] in _DONE:         # it ended just now
        how.append("it ended meanwhile")
        state = st[0]
    elif st is not None and st[0] == "RUNNING":
        err = _scancel("--full", "--signal=TERM", job_id)
        how.append(err or "sent SIGTERM to its script, driver and Ray steps (scancel --full "
                          "--signal=TERM)")
        if err is None:
            state = _ended(job_id, poll_s, CANCEL_GRACE_S)
    if state is None:
        err = _scancel(job_id)
        how.append(err or f"cancelled it (scancel {job_id})")
        state = _ended(job_id, poll_s, CANCEL_GRACE_S)
    ended = (f"final state {state} {time.time() - t_cancel:.0f}s later" if state is not None
             else f"it has not ended {CANCEL_GRACE_S:g}s later; check `squeue -j {job_id}`")
    return (f"job {job_id} did not finish within --wait-timeout {timeout_s:g}s ({why}; "
            f"{t_cancel - t0:.0f}s since submission): {', then '.join(how)}; {ended}. Job "
            f"output: {out}; Ray logs: {ray_logs}/")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _add_run_args(p) -> None:
    p.add_argument("--preset", default="default", help="run preset (default, tiny3)")
    p.add_argument("--config", default=None, type=os.path.expanduser, help="YAML file of overrides")
    p.add_argument("--set", nargs="*", action="extend", metavar="KEY=VALUE",
                   help="dotted overrides for the run (repeatable)")
    p.add_argument("--algorithm", default=None,
                   help="algorithm preset, as for `hacpo train` (hacpo, grpo, gspo, gspo2x, "
                        "naive, an ablation)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (as `--set steps=N`)")
    p.add_argument("--out-dir", default=None, type=os.path.expanduser,
                   help="run dir (default: the config's out_dir)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in the run dir (the driver runs `hacpo train "
                        "--resume`); without it a run dir holding a run is an error. A Slurm "
                        "job that Slurm requeues resumes either way")
    p.add_argument("--accept-encoding-change", nargs="*", metavar="AGENT", default=None,
                   help="with --resume: the driver goes on although an agent's tokenizer "
                        "encodes prompts otherwise than at the checkpoint (`hacpo train "
                        "--accept-encoding-change [AGENT ...]`; with names: those agents')")
    p.add_argument("--rollout-engine", default=None, choices=["ray", "vllm", "local"],
                   help="rollout.engine of the driver (default: the config's, its 'local' "
                        "as 'ray': actors over the cluster)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="Ray logical CPUs per node (slurm: also --cpus-per-task; default "
                        "Slurm's CPUs on the node / local: this machine's CPU count)")
    p.add_argument("--object-store-mb", type=int, default=None,
                   help="Ray object store per node in MiB (default Ray's)")
    p.add_argument("--ray-port", type=int, default=None,
                   help="Ray head GCS port (default: slurm 6379, local a free port)")
    p.add_argument("--ray-timeout", type=float, default=300.0,
                   help="seconds for the whole Ray cluster to come up (default 300)")


def _add_wait_timeout(p, what: str) -> None:
    p.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"{what}; then it is cancelled, nothing of it is left running, and "
                        f"the command exits 124 naming the job, the elapsed time and its logs "
                        f"(default: no limit)")


def _run(fn):
    def call(args) -> int:
        try:
            return fn(args)
        except LaunchError as e:
            print(f"hacpo launch: error: {e}", file=sys.stderr)
            return e.exit_code
    return call


def add_launch_parser(subparsers) -> None:
    """``hacpo launch {slurm,local}`` on the ``hacpo`` command's subparsers."""
    def launch_local(args) -> int:     # imported when it runs: building the `hacpo` parser
        from .launch_local import launch_local as run   # imports no torch (`hacpo --version`,
        return run(args)                                # a Ctrl-C while it starts)
    lp = subparsers.add_parser("launch", help="run `hacpo train` on a Ray cluster started on "
                                              "Slurm nodes or on this machine")
    sub = lp.add_subparsers(dest="launcher", required=True)
    s = sub.add_parser("slurm", help="write and submit an sbatch job: Ray head + workers via "
                                     "srun, then the driver")
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--gpus-per-node", type=int, default=0)
    _add_run_args(s)
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default=None, help="Slurm time limit, e.g. 01:00:00")
    s.add_argument("--checkpoint-before-limit", type=int, default=None, metavar="SECONDS",
                   help="SECONDS before the time limit (Slurm's --signal=B:USR1, up to 60 s "
                        "early) the driver writes a checkpoint at the end of its step and "
                        "stops, and the job requeues itself (--requeue) to continue the run; "
                        "allow a step and a checkpoint")
    s.add_argument("--job-name", default="hacpo")
    s.add_argument("--sbatch-arg", action="append", metavar="ARG",
                   help="extra #SBATCH line, e.g. --sbatch-arg=--account=abc (repeatable)")
    s.add_argument("--setup", action="append", metavar="CMD",
                   help="shell line run first in the job, e.g. 'module load cuda' (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    s.add_argument("--wait", action="store_true",
                   help="poll until the job ends; exit 0 only if it COMPLETED with exit 0")
    s.add_argument("--poll", type=float, default=5.0, help="--wait poll period in seconds")
    _add_wait_timeout(s, "with --wait: the most seconds the job may take from submission "
                         "(queue time included)")
    s.set_defaults(func=_run(launch_slurm))
    loc = sub.add_parser("local", help="the same on this machine without Slurm: a Ray head "
                                       "(+ --workers local worker nodes), the driver, teardown")
    loc.add_argument("--workers", type=int, default=0, help="extra local Ray worker nodes")
    loc.add_argument("--gpus-per-node", type=int, default=0)
    _add_run_args(loc)
    _add_wait_timeout(loc, "the most seconds the whole launch (Ray bring-up and the driver) "
                           "may take")
    loc.set_defaults(func=_run(launch_local))
