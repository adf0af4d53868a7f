"""`hacpo` command line. Subcommands import their heavy dependencies lazily."""
from __future__ import annotations

import argparse
import os
import sys

import hacpo
from hacpo._stop import TERMINATED    # exit status of a command stopped by SIGTERM (143)


def _demo(args) -> int:
    from hacpo.engine.config import available_presets

    from .bandit_demo import run
    unknown = [a for a in args.algorithms if a not in available_presets()]
    if unknown:
        print(f"hacpo demo: error: unknown algorithm preset(s) {', '.join(unknown)}; choose "
              f"from {', '.join(available_presets())}", file=sys.stderr)
        return 2
    results = {}
    for algo in args.algorithms:
        results[algo] = run(algo, steps=args.steps, agents=args.agents, seed=args.seed)
    print("\nfinal expected accuracy per agent:")
    for algo, acc in results.items():
        print(f"  {algo:6s} " + "  ".join(f"{a:.3f}" for a in acc))
    return 0


# what compare / profile choose themselves: given to them, these would be ignored
_RUN_SET = {"compare": (("algorithm", "compare runs each of --algorithms"),),
            "profile": (("algorithm", "profile runs each of --algorithms"),
                        ("steps", "profile runs --rounds x --steps-per-round steps"))}


# the run settings compare / profile set themselves: a --set of one would be ignored
_RUN_SET_KEYS = {
    "compare": {"out_dir": "its runs go under --out-dir",
                "seed": "it runs each of --seeds",
                "eval_pass_k": "its final evaluations take --pass-k samples",
                "progress": "it reports one line per run"},
    "profile": {"out_dir": "its runs go under --out-dir",
                "steps": "it runs --rounds x --steps-per-round steps",
                "checkpoint_every": "it checkpoints every step (the cost it measures)",
                "profile_sync": "it times every stage with device syncs",
                "eval_every": "it evaluates no step (the steps' cost alone)",
                "eval_pass_k": "it makes no sampled final evaluation",
                "plots": "its runs write no plots", "tensorboard": "its runs write no "
                "TensorBoard events", "progress": "it reports one line per round"},
}


def _check_copied_run_config(path, out_dir: str, command: str, out_given: bool) -> None:
    """``--config RUN/config.json`` of a run dir that was copied or moved names the original's
    out_dir: without --out-dir, `hacpo train` would continue (or start over in) the original,
    not the run beside the file. An error saying which to pass."""
    if path is None or out_given or command != "train":
        return
    here = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) != "config.json" or not os.path.exists(
            os.path.join(here, "checkpoint.pt")):
        return
    if os.path.realpath(here) != os.path.realpath(out_dir):
        import shlex
        why = ("the run was copied or moved" if os.path.isabs(out_dir) else
               f"relative: {os.path.abspath(out_dir)} from this directory")
        raise ValueError(f"--config {path} is the config of the run in {here}, but it names "
                         f"out_dir {out_dir} ({why}): pass --out-dir {shlex.quote(here)} to "
                         f"continue that run (or --out-dir {shlex.quote(out_dir)})")


def _read_config(path: str) -> dict:
    """``--config`` file's overrides; YAML that does not parse is one line naming the file.
    pyyaml is imported only here: a run without --config does not need it."""
    from hacpo.engine.errors import require
    from hacpo.engine.run_config import read_config_file
    yaml = require("yaml", f"--config {path}")
    try:
        return read_config_file(path)
    except yaml.YAMLError as e:     # a multi-line message: one line, naming the file
        raise ValueError(f"config file {path} is not valid YAML: "
                         f"{' '.join(str(e).split())}") from None


def train_config(args):
    """The run's TrainConfig and the user's own algorithm settings: the dotted
    ``algorithm.*`` keys ``--set`` gives, and those the YAML gives a value other than the run
    preset's (a saved config.json as ``--config`` keeps only what its run changed), without
    the name. ``--algorithm`` puts the run under that preset keeping the run preset's
    minibatch count and those settings (compare.with_algorithm), as compare and profile do for
    each of theirs."""
    from hacpo.engine.compare import dotted, with_algorithm
    from hacpo.engine.config import available_presets, preset
    from hacpo.engine.configtools import parse_overrides
    from hacpo.engine.run_config import load_config
    from hacpo.engine.errors import user_errors
    with user_errors():
        for flag in ("config", "algorithm", "out_dir"):   # "" (an unset shell variable)
            v = getattr(args, flag)
            if v is not None and not v.strip():
                name = "--" + flag.replace("_", "-")
                raise ValueError(f"{name} {v!r} is empty: give it a value (or leave {name} "
                                 f"out for the default)")
        command = getattr(args, "command", "train")
        for flag, why in _RUN_SET.get(command, ()):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} does not apply to hacpo {command} ({why})")
        overrides = parse_overrides(args.set or [])
        for key, why in _RUN_SET_KEYS.get(command, {}).items():
            if key in overrides:
                raise ValueError(f"--set {key} does not apply to hacpo {command}: {why}")
        if args.steps is not None:
            overrides["steps"] = args.steps
        if args.out_dir is not None:
            overrides["out_dir"] = args.out_dir
        if getattr(args, "skip_bad_rows", False):
            overrides["data.skip_bad_rows"] = True
        from_file = _read_config(args.config) if args.config is not None else {}
        cfg = load_config(args.preset, None, {**from_file, **overrides})
        _check_copied_run_config(args.config, cfg.out_dir, command, "out_dir" in overrides)
        preset_cfg = load_config(args.preset)
        for key, why in _RUN_SET_KEYS.get(command, {}).items():
            # one the file sets (a run's config.json sets them all: not refused, said)
            if key in from_file and key not in overrides and \
                    getattr(cfg, key) != getattr(preset_cfg, key):
                print(f"[warn] {key}={getattr(cfg, key)!r} in --config {args.config} is not "
                      f"used by hacpo {command}: {why}")
        base = preset_cfg.algorithm
        keep = {}
        for source, given in ((from_file, False), (overrides, True)):
            for k in source:
                key = k.removeprefix("algorithm.")
                if k.startswith("algorithm.") and key != "name" and (
                        given or dotted(cfg.algorithm, key) != dotted(base, key)):
                    keep[key] = dotted(cfg.algorithm, key)
        if args.algorithm:
            # a name from --set, or from the file other than the run preset's (a replayed
            # config.json holds one), that is not --algorithm's: two choices, refused
            want = preset(args.algorithm).name if args.algorithm in available_presets() \
                else None
            chosen = cfg.algorithm.name
            if want is not None and chosen != want and ("algorithm.name" in overrides
                                                         or chosen != base.name):
                raise ValueError(f"algorithm.name={chosen!r} and --algorithm {args.algorithm} "
                                 f"both choose the algorithm: give one")
            cfg = with_algorithm(cfg, args.algorithm, keep)
    return cfg, keep


def _train(args) -> int:
    from hacpo.engine.trainer import train
    cfg, _ = train_config(args)
    args.run_dir = cfg.out_dir      # what a stop's "continue it with --resume" refers to
    print(f"[hacpo] run dir {cfg.out_dir}; algorithm {cfg.algorithm.name}; agents "
          + ", ".join(f"{a.policy.name} ({a.policy.tokenizer})" for a in cfg.agents))
    train(cfg, resume=args.resume, accept_encoding_change=accept_arg(args))
    return 0


def accept_arg(args) -> bool | list[str]:
    """``--accept-encoding-change [AGENT ...]`` as ``train``'s ``accept_encoding_change``:
    absent False, alone True (every agent), with names those agents."""
    names = getattr(args, "accept_encoding_change", None)
    return False if names is None else (names or True)


def _compare(args) -> int:
    from hacpo.engine.compare import run_compare
    cfg, keep = train_config(args)
    # a stop's line: the same command continues (finished runs reused, the others resumed)
    args.stop_hint = lambda: "; run the same command again to continue it"
    run_compare(cfg, args.algorithms, args.seeds, args.out_dir or "runs/compare",
                pass_k=args.pass_k, keep=keep,
                accept_encoding_change=accept_arg(args))
    return 0


def _profile(args) -> int:
    from hacpo.engine.profile import profile_runs_held, run_profile
    cfg, keep = train_config(args)
    out = args.out_dir or "runs/profile"

    def stop_hint() -> str:     # a profile measures new runs only: the next one needs them gone
        held = profile_runs_held(out, args.algorithms)
        return (f"; its runs in {out} are partial ({', '.join(held)}): remove them or choose "
                f"another --out-dir to profile again") if held else ""
    args.stop_hint = stop_hint
    run_profile(cfg, out, algorithms=args.algorithms,
                rounds=args.rounds, steps_per_round=args.steps_per_round,
                skip_steps=args.skip_steps, keep=keep)
    return 0


def _run_command(args) -> int:
    """A run command; an error in the user's input (a wrong config, dataset, run directory or
    resume: hacpo.engine.errors) is one line on stderr and exit status 2
    (HACPO_TRACEBACK=1: the traceback instead); any other error propagates with its
    traceback."""
    import os

    from hacpo.engine.errors import is_user_error
    try:
        return _stoppable(args, args.func)
    except Exception as e:
        if os.environ.get("HACPO_TRACEBACK") == "1" or (isinstance(e, BrokenPipeError)
                                                        and _stdout_closed()):
            raise                             # (output closed: main's one line, exit 141)
        msg = _storage_message(e, args.command)
        if msg is None:
            if not is_user_error(e):
                raise
            msg = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e
        print(f"hacpo {args.command}: error: {msg}\n(HACPO_TRACEBACK=1 shows where it was "
              f"raised)", file=sys.stderr)
        return 2


def _storage_message(e: BaseException, command: str) -> str | None:
    """A write that the file system refused while the command ran (disk full, quota, file-size
    limit, read-only mount, permissions: hacpo.engine.errors.STORAGE_ERRNOS) as one line naming
    the file and the cause (a train command: that --resume continues the run once it is
    fixed); None for any other error (a bug keeps its traceback). Files hacpo writes
    atomically name themselves (StorageError); another write (an appended metrics row,
    TensorBoard events) is named by the OSError's file name, where it has one."""
    import errno

    from hacpo.engine.errors import STORAGE_ERRNOS, StorageError, describe_os_error, os_error_in
    oserr = os_error_in(e)
    if oserr is None or oserr.errno not in STORAGE_ERRNOS:
        return None
    if (not isinstance(oserr, StorageError) and not oserr.filename
            and oserr.errno in (errno.EACCES, errno.EPERM, errno.EIO)):
        return None       # no file named: e.g. os.kill's EPERM, not the file system's
    if isinstance(oserr, StorageError):
        msg = str(oserr)
    else:
        where = f"{oserr.filename}: " if oserr.filename else ""
        msg = f"{where}{describe_os_error(oserr)} ({type(e).__name__}: {e})"
    if command == "train":
        msg += "; fix it, then run again (--resume continues from the run's last checkpoint)"
    return msg


def _stoppable(args, func) -> int:
    """``func(args)`` with SIGTERM (kill, a supervisor, a scheduler's time limit) unwinding
    like Ctrl-C: the command's `finally` blocks close reward workers, engines and a private
    Ray cluster (by default Python dies at once and leaves the reward worker processes
    running). Either prints one line and exits 143 (SIGTERM) / 130 (Ctrl-C); a training
    command that SIGUSR1 stopped at a checkpoint exits 75 (EX_TEMPFAIL: --resume)."""
    import signal
    import threading

    from hacpo import _stop
    main = threading.current_thread() is threading.main_thread()
    prev = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    # Ctrl-C recorded as it is raised (hacpo._stop: one raised where Python drops it is raised
    # again at a step's end); SIGINT left alone where it is not Python's default handler (a
    # background job started by a shell ignores it)
    prev_int = (signal.signal(signal.SIGINT, _stop.raise_interrupt)
                if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
                else None)
    import os

    def again() -> str:     # only a run that wrote its config.json can be continued (one
        if (hint := getattr(args, "stop_hint", None)) is not None:  # compare, profile: theirs
            return hint()
        run_dir = getattr(args, "run_dir", None)   # stopped before is removed or never was)
        return "; continue it with --resume" if run_dir is not None and os.path.exists(
            os.path.join(run_dir, "config.json")) else ""

    _SIGTERM_SEEN.clear()
    _stop.interrupts_recorded(True)
    if args.command in TRAINING_COMMANDS:      # SIGUSR1: a checkpoint at this step's end, stop
        func = _checkpoint_stoppable(func, again)
    try:
        rc = func(args)
        _stop.raise_lost_interrupt()     # a Ctrl-C / SIGTERM Python dropped: still the stop
        return rc
    except KeyboardInterrupt:
        print(f"hacpo {args.command}: interrupted (Ctrl-C){again()}", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == TERMINATED:
            print(f"hacpo {args.command}: terminated (SIGTERM){again()}", file=sys.stderr)
        elif _SIGTERM_SEEN and e.code != 0:
            # a library that turned the SIGTERM exit into its own (Ray's ray.get, when the
            # signal lands in it, raises SystemExit(1)): the stop is what happened
            print(f"hacpo {args.command}: terminated (SIGTERM){again()}", file=sys.stderr)
            raise SystemExit(TERMINATED) from e
        raise
    except Exception as e:
        # an error raised while the run unwound from Ctrl-C / SIGTERM (a library's cleanup
        # that fails when cut short): the stop is what happened; the error is named with it
        cause = _interrupted_by(e)
        if cause is None and _SIGTERM_SEEN:     # the SIGTERM exit replaced by the library's
            cause = SystemExit(TERMINATED)
        if cause is None:
            raise
        also = f" (while it stopped: {type(e).__name__}: {e})"
        if isinstance(cause, KeyboardInterrupt):
            print(f"hacpo {args.command}: interrupted (Ctrl-C){again()}{also}",
                  file=sys.stderr)
            return 130
        print(f"hacpo {args.command}: terminated (SIGTERM){again()}{also}", file=sys.stderr)
        raise SystemExit(TERMINATED) from e
    finally:
        _stop.interrupts_recorded(False)
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
        if prev_int is not None:
            signal.signal(signal.SIGINT, prev_int)


# the commands that train: SIGUSR1 (Slurm's --signal before a time limit) stops them at a
# checkpoint (hacpo.engine.signals); the others keep its default action
TRAINING_COMMANDS = ("train", "compare", "profile")


def _checkpoint_stoppable(func, again):
    def run(args) -> int:
        from hacpo.engine.signals import CHECKPOINT_STOPPED, RunStopped
        try:
            return func(args)
        except RunStopped as e:
            where = (f"at the checkpoint of step {e.step}" if e.step is not None
                     else "between its runs")
            print(f"hacpo {args.command}: stopped {where} (SIGUSR1){again()}",
                  file=sys.stderr)
            return CHECKPOINT_STOPPED
    return run


def _interrupted_by(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SIGTERM exit (SystemExit(143)) that ``e`` was raised while
    handling (its ``__context__`` chain), else None."""
    seen = set()
    c = e.__context__
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        if isinstance(c, KeyboardInterrupt) or (isinstance(c, SystemExit)
                                                and c.code == TERMINATED):
            return c
        c = c.__context__
    return None


# set when the SIGTERM handler ran during a command (cleared as _stoppable starts): an exit or
# error a library raised in place of SystemExit(TERMINATED) is still the stop
_SIGTERM_SEEN: list[bool] = []


def _raise_terminated(signum, frame):
    from hacpo._stop import raise_terminated
    _SIGTERM_SEEN.append(True)
    raise_terminated(signum, frame)


def _input_error(command: str, e: BaseException) -> int:
    """An error in a command's input (a checkpoint, benchmark file, agent, option or output
    dir): one line on stderr, exit status 2; HACPO_TRACEBACK=1 raises it instead."""
    import os

    if os.environ.get("HACPO_TRACEBACK") == "1" or (isinstance(e, BrokenPipeError)
                                                    and _stdout_closed()):
        raise e                               # (output closed: main's one line, exit 141)
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"hacpo {command}: error: {msg}", file=sys.stderr)
    return 2


INPUT_ERRORS = (OSError, ValueError, KeyError, RuntimeError)


def _eval(args) -> int:
    """Evaluate; an error in the input is :func:`_input_error`."""
    from hacpo.engine.configtools import parse_overrides
    from hacpo.engine.eval_harness import evaluate_checkpoints
    try:
        out = evaluate_checkpoints(
            args.checkpoints, args.bench, agents=args.agents, samples=args.samples,
            temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
            limit=args.limit, template=args.template, out_dir=args.out_dir, batch=args.batch,
            seed=args.seed, moved=parse_overrides(args.set or []))
    except INPUT_ERRORS as e:
        return _input_error("eval", e)
    print()
    print(out["table"])
    print("[eval] written to " + ", ".join(out["out_dirs"]))
    return 0


def _export(args) -> int:
    """Export agents as Hugging Face model directories; an error in the input (a checkpoint,
    an agent that cannot be exported, an output dir) is :func:`_input_error`."""
    from hacpo.engine.configtools import parse_overrides
    from hacpo.engine.export import export_checkpoint
    try:
        dirs = export_checkpoint(args.checkpoint, args.out, agents=args.agents,
                                 tokenizer=not args.no_tokenizer, dtype=args.dtype,
                                 overwrite=args.force, moved=parse_overrides(args.set or []))
    except INPUT_ERRORS as e:
        return _input_error("export", e)
    print("[export] written: " + ", ".join(dirs.values()))
    return 0


def _int_at_least(low: int, high: int | None = None):
    """An argparse type: an integer >= ``low`` (and <= ``high``), else argparse's one-line
    usage error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {low}" + (f" and <= {high}" if high is not None else "")
                + f", got {v}")
        return v
    return parse


def _add_run_args(p):
    p.add_argument("--preset", default="default", help="run preset (default, tiny3)")
    p.add_argument("--config", default=None, type=os.path.expanduser,
                   help="YAML file of overrides (nested mapping)")
    p.add_argument("--algorithm", default=None,
                   help="algorithm preset: hacpo, hacpo-table5, grpo, gspo, gspo2x, naive, "
                        "or an ablation (see README)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out-dir", default=None, type=os.path.expanduser)
    p.add_argument("--set", nargs="*", action="extend", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. agents.0.optim.lr=3e-4 rollout.group_size=4 "
                        "(repeatable)")


def _add_moved_arg(p):
    p.add_argument("--set", nargs="+", action="extend", metavar="KEY=NEW",
                   help="a model or tokenizer folder moved since the run: "
                        "agents.N.policy.path=NEW, agents.N.policy.tokenizer=NEW (checked to "
                        "hold what the checkpoint records)")


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()       # (a pipe's reader gone: said here, not at the exit's flush)
        return rc
    except KeyboardInterrupt:    # while a command starts (its imports: seconds), before its
        print("hacpo: interrupted (Ctrl-C)", file=sys.stderr)   # own handler: no traceback
        return 130
    except BrokenPipeError:
        if not _stdout_closed():      # another pipe (e.g. a worker process's): a bug's error
            raise
        return _output_closed()


OUTPUT_CLOSED = 141     # as a command killed by SIGPIPE exits (128 + 13): `... | head` ended it


def _stdout_closed() -> bool:
    """Has the reader of standard output gone (a pipe whose read end is closed)?"""
    import select
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):    # no file descriptor behind it
        return False


def _output_closed() -> int:
    """The reader of the command's standard output went away (``hacpo eval ... | head``):
    one line on stderr and exit 141, as a shell tool stopped by SIGPIPE (Python ignores
    SIGPIPE: a BrokenPipeError traceback, or "error: Broken pipe" exit 2, before)."""
    import contextlib
    import os
    with contextlib.suppress(OSError, ValueError):     # no second error as Python exits
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    with contextlib.suppress(OSError, ValueError):
        print("hacpo: stopped: its standard output was closed (the reader of the pipe, e.g. "
              "`head`, exited)", file=sys.stderr)
    return OUTPUT_CLOSED


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="hacpo", description="Heterogeneous agent collaborative RL")
    ap.add_argument("--version", action="version", version=f"hacpo {hacpo.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="seconds-long toy demo of the algorithm library (no LM)")
    d.add_argument("--algorithms", nargs="+", default=["gspo", "hacpo"])
    d.add_argument("--steps", type=_int_at_least(1), default=60)
    d.add_argument("--agents", type=_int_at_least(1), default=3)
    d.add_argument("--seed", type=_int_at_least(0, 2**32 - 1), default=0)
    d.set_defaults(func=_demo)
    t = sub.add_parser("train", help="train n agents together (embedded default: no arguments)")
    _add_run_args(t)
    t.add_argument("--resume", action="store_true", help="continue the run in --out-dir")
    t.add_argument("--skip-bad-rows", action="store_true",
                   help="skip (and count) dataset rows that cannot be parsed")
    t.add_argument("--accept-encoding-change", nargs="*", metavar="AGENT", default=None,
                   help="with --resume: go on although an agent's tokenizer encodes prompts "
                        "otherwise than at the checkpoint (e.g. a fixed chat template); "
                        "said, and recorded in the checkpoint. With agent names: those "
                        "agents' changes only (another agent's is still refused)")
    t.set_defaults(func=_train)
    c = sub.add_parser("compare", help="same budget under several algorithms and seeds; "
                                       "markdown table + plot")
    _add_run_args(c)
    c.add_argument("--algorithms", nargs="+", default=["grpo", "gspo", "gspo2x", "naive", "hacpo"])
    c.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    c.add_argument("--pass-k", type=_int_at_least(0), default=4,
                   help="k of the held-out pass@k (0 or 1: none; default 4)")
    c.add_argument("--accept-encoding-change", nargs="*", metavar="AGENT", default=None,
                   help="the runs it resumes go on although an agent's tokenizer encodes "
                        "prompts otherwise than at their checkpoint (as train --resume "
                        "--accept-encoding-change [AGENT ...])")
    c.set_defaults(func=_compare)
    pr = sub.add_parser("profile", help="gspo vs gspo2x vs hacpo side by side: extra scoring "
                                        "cost, time per trained sample, fitted cost model")
    _add_run_args(pr)
    pr.add_argument("--algorithms", nargs="+", default=["gspo", "gspo2x", "hacpo"])
    pr.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds (each algorithm advances per round)")
    pr.add_argument("--steps-per-round", type=int, default=2)
    pr.add_argument("--skip-steps", type=int, default=1,
                    help="first steps of each run not measured (warm-up)")
    pr.set_defaults(func=_profile)
    e = sub.add_parser("eval", help="evaluate run checkpoints on JSONL/parquet benchmarks; "
                                    "markdown table with 95%% CIs + JSON per agent/benchmark")
    e.add_argument("checkpoints", nargs="+", type=os.path.expanduser,
                   help="run dirs or checkpoint.pt files")
    # (extend: a repeated --bench / --agents adds to the earlier ones, as --set does; it
    # replaced them, and the earlier benchmarks or agents went unscored without a word)
    e.add_argument("--bench", nargs="+", action="extend", required=True,
                   metavar="NAME=PATH[:FIELDMAP]",
                   help="benchmark file (.jsonl/.parquet); FIELDMAP: auto (default), gsm8k, "
                        "math, math_answer, question_answer")
    e.add_argument("--agents", nargs="+", action="extend", default=None,
                   help="agent names (default: all)")
    e.add_argument("--samples", type=int, default=1, help="k: avg@k and pass@k (default 1)")
    e.add_argument("--temperature", type=float, default=None,
                   help="default 0 (greedy) for --samples 1, else the run's rollout temperature")
    e.add_argument("--top-p", type=float, default=None,
                   help="default: the run's rollout top-p")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's eval_max_new_tokens or rollout.max_new_tokens")
    e.add_argument("--limit", type=int, default=None, help="first N problems per benchmark")
    e.add_argument("--template", default=None, help="prompt template (default: the run's)")
    e.add_argument("--out-dir", default=None, type=os.path.expanduser,
                   help="default: <run dir>/eval")
    e.add_argument("--batch", type=int, default=128,
                   help="prompts per generation batch (default 128, as the run's evaluation)")
    e.add_argument("--seed", type=_int_at_least(0, 2**32 - 1), default=None,
                   help="sampling seed (default: the run's evaluation seed, so --samples k on "
                        "its held-out set draws the samples of its eval_pass_k)")
    _add_moved_arg(e)
    e.set_defaults(func=_eval)
    x = sub.add_parser("export", help="write trained agents as Hugging Face model directories "
                                      "(from_pretrained / vLLM load them without hacpo)")
    x.add_argument("checkpoint", type=os.path.expanduser, help="run dir or checkpoint.pt")
    x.add_argument("--out", required=True, type=os.path.expanduser,
                   help="output dir: one <agent>/ folder per agent")
    x.add_argument("--agents", nargs="+", default=None,
                   help="agent names (default: every agent that can be exported; the others "
                        "are skipped, each with a line saying why)")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: the policy's)")
    x.add_argument("--no-tokenizer", action="store_true",
                   help="the model alone, reading hacpo's ids (agents with a reduced "
                        "vocabulary have no tokenizer files)")
    x.add_argument("--force", action="store_true",
                   help="replace existing agent folders (once the new one is complete)")
    _add_moved_arg(x)
    x.set_defaults(func=_export)
    from .slurm import add_launch_parser
    add_launch_parser(sub)
    args = ap.parse_args(argv)
    _console_safe()
    if args.command in TRAINING_COMMANDS:
        # SIGUSR1 from now to the process's end (before torch is imported: its default action
        # killed the run) asks for a checkpoint at the end of the step and a stop
        from hacpo._stop import record_checkpoint_signal
        record_checkpoint_signal()
        return _run_command(args)
    if args.command in ("eval", "export", "demo"):    # eval: reward workers too
        return _stoppable(args, args.func)
    return args.func(args)


def _console_safe() -> None:
    """A console that cannot encode a character a command prints (eval's "±", an agent's or
    run dir's name; PYTHONIOENCODING=ascii, a latin-1 terminal) shows it escaped: it ended
    `hacpo eval` after its first benchmark (stderr escapes by default already)."""
    try:
        sys.stdout.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError, OSError):     # a stream that is not a TextIOWrapper
        pass


if __name__ == "__main__":
    sys.exit(main())
