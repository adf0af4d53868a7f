"""Command line: the toy demo runs and improves the agents; config errors are clear."""
import json
import re

import pytest

from hacpo.launch.bandit_demo import run
from hacpo.launch.cli import main


def test_bandit_demo_learns():
    lines = []
    acc = run("hacpo", steps=15, agents=2, prompts=16, echo=lines.append)
    first = [float(x) for x in lines[0].split(":")[1].split()]
    assert len(acc) == 2 and all(a > f for a, f in zip(acc, first))


def test_train_cli_bad_override_is_clear(capsys, monkeypatch):
    """Config errors of the run commands are one line on stderr and exit status 2 (with
    HACPO_TRACEBACK=1 the exception itself)."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    for cmd in ("train", "compare", "profile"):
        assert main([cmd, "--preset", "tiny3", "--set", "rollout.gsize=3"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hacpo {cmd}: error: unknown config key 'rollout.gsize'"), err
        assert "Traceback" not in err
    assert main(["train", "--preset", "big"]) == 2
    assert "unknown run preset 'big'" in capsys.readouterr().err
    # --set given twice: both apply (the first one's bad key is reported)
    assert main(["train", "--preset", "tiny3", "--set", "rollout.gsize=3", "--set",
                 "steps=1"]) == 2
    assert "unknown config key 'rollout.gsize'" in capsys.readouterr().err
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(ValueError, match="unknown run preset 'big'"):
        main(["train", "--preset", "big"])


def test_algorithm_flag_keeps_the_run_budget_and_set_overrides(tmp_path):
    """``--algorithm`` puts the run preset under another algorithm as compare does: the
    preset's minibatch count stays, and the user's algorithm overrides (YAML, --set) win."""
    import argparse

    from hacpo.launch.cli import train_config

    def cfg(*extra, config=None, algorithm=None):
        args = argparse.Namespace(preset="default", config=config, algorithm=algorithm,
                                  steps=None, out_dir=None, set=list(extra))
        return train_config(args)

    plain, keep = cfg()
    assert (plain.algorithm.name, plain.algorithm.num_minibatches, keep) == ("hacpo", 2, {})
    g, _ = cfg(algorithm="gspo")
    assert (g.algorithm.name, g.algorithm.num_minibatches) == ("gspo", 2)
    y = tmp_path / "c.yaml"
    y.write_text("algorithm:\n  capability: {window: 3}\n")
    h, keep = cfg("algorithm.loss.alpha=0.5", config=str(y), algorithm="hacpo-table5")
    assert keep == {"loss.alpha": 0.5, "capability.window": 3}
    a = h.algorithm
    assert (a.loss.alpha, a.capability.window, a.loss.cross_clip_delta, a.num_minibatches) \
        == (0.5, 3, 0.8, 2)


def test_algorithm_settings_kept_are_the_users_changes(tmp_path):
    """A saved config.json as --config keeps only what differs from the run preset (so
    compare / profile can take it), and a setting that contradicts an ablation preset is an
    error, never two identical "algorithms"."""
    import argparse

    from hacpo.engine.compare import with_algorithm
    from hacpo.engine.run_config import load_config
    from hacpo.launch.cli import train_config

    saved = load_config("default", overrides={"algorithm.loss.alpha": 0.5}).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    args = argparse.Namespace(preset="default", config=str(path), algorithm="gspo", steps=None,
                              out_dir=None, set=[])
    cfg, keep = train_config(args)
    assert keep == {"loss.alpha": 0.5} and cfg.algorithm.name == "gspo"
    with pytest.raises(ValueError, match=r"algorithm.loss.alpha=0.5 contradicts the algorithm "
                                         r"preset 'hacpo-alpha0', which sets loss.alpha=0.0"):
        with_algorithm(cfg, "hacpo-alpha0", keep)
    assert with_algorithm(cfg, "hacpo-alpha0", {"loss.alpha": 0}).algorithm.loss.alpha == 0.0
    args.set = ["algorithm.name=grpo"]
    with pytest.raises(ValueError, match="both choose the algorithm"):
        train_config(args)


def test_algorithm_flag_agreeing_with_the_files_name_and_explicit_settings(tmp_path):
    """A replayed config.json of a gspo run under --algorithm gspo agrees (was "both choose
    the algorithm"); a --set algorithm key counts even when it equals the run preset's value
    (was dropped, so an ablation silently replaced it); a config read from a pipe keeps its
    algorithm settings (the file was read a second time, empty)."""
    import argparse
    import os

    from hacpo.engine.run_config import load_config
    from hacpo.launch.cli import train_config

    def cfg(*extra, config=None, algorithm=None):
        return train_config(argparse.Namespace(preset="default", config=config,
                                               algorithm=algorithm, steps=None, out_dir=None,
                                               set=list(extra)))

    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_config("default", overrides={
        "algorithm.name": "gspo", "algorithm.loss.alpha": 0.5}).to_dict()))
    got, keep = cfg(config=str(path), algorithm="gspo")
    assert got.algorithm.name == "gspo" and keep == {"loss.alpha": 0.5}
    with pytest.raises(ValueError, match="both choose the algorithm"):
        cfg(config=str(path), algorithm="hacpo")
    with pytest.raises(ValueError, match="both choose the algorithm"):
        cfg("algorithm.name=hacpo", algorithm="gspo")      # explicit, even the preset's name
    with pytest.raises(ValueError, match=r"algorithm.loss.alpha=1.0 contradicts the algorithm "
                                         r"preset 'hacpo-alpha0'"):
        cfg("algorithm.loss.alpha=1.0", algorithm="hacpo-alpha0")
    r, w = os.pipe()
    os.write(w, b"algorithm: {loss: {alpha: 0.5}}\n")
    os.close(w)
    try:
        got, keep = cfg(config=f"/dev/fd/{r}", algorithm="hacpo-table5")
    finally:
        os.close(r)
    assert (got.algorithm.loss.alpha, got.algorithm.loss.cross_clip_delta) == (0.5, 0.8)
    assert keep == {"loss.alpha": 0.5}


@pytest.mark.parametrize("argv,msg", [
    (["train", "--config", ""], "--config '' is empty"),
    (["train", "--algorithm", " "], "--algorithm ' ' is empty"),
    (["train", "--out-dir", ""], "--out-dir '' is empty"),
    (["compare", "--algorithm", "gspo"], r"--algorithm does not apply to hacpo compare "
                                         r"\(compare runs each of --algorithms\)"),
    (["profile", "--algorithm", "gspo"], "--algorithm does not apply to hacpo profile"),
    (["profile", "--steps", "10"], r"--steps does not apply to hacpo profile \(profile runs "
                                   r"--rounds x --steps-per-round steps\)"),
    (["profile", "--set", "steps=10"], "--set steps does not apply to hacpo profile"),
    (["compare", "--set", "out_dir=x"], "--set out_dir does not apply to hacpo compare"),
    (["train", "--set", "seed=9223372036854775807"], r"seed must be an integer in \[0, "),
    # what compare / profile set for their runs: a --set of it was silently replaced
    (["compare", "--set", "seed=7"], r"--set seed does not apply to hacpo compare: it runs "
                                     r"each of --seeds"),
    (["compare", "--set", "eval_pass_k=2"], "--set eval_pass_k does not apply to hacpo compare"),
    (["profile", "--set", "profile_sync=false"], "--set profile_sync does not apply to hacpo "
                                                 "profile: it times every stage"),
    (["profile", "--set", "checkpoint_every=5"], "--set checkpoint_every does not apply"),
    (["profile", "--set", "eval_every=5"], "--set eval_every does not apply"),
    (["profile", "--set", "plots=true"], "--set plots does not apply"),
    # every run's seed checked before the first run trains (a bad last one ended a compare
    # with a traceback after the runs before it)
    (["compare", "--algorithms", "gspo", "--seeds", "5", "-1", "--steps", "1"],
     r"seed must be an integer in \[0, 4294967295\], got -1"),
])
def test_run_options_that_would_be_ignored_are_errors(argv, msg, tmp_path, capsys, monkeypatch):
    """An empty --config / --algorithm (an unset shell variable) trained the preset as if not
    given; compare / profile took --algorithm, profile --steps, and ignored them: each is now
    a one-line error, exit 2, before anything runs."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--preset", "tiny3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hacpo {argv[0]}: error: ") and re.search(msg, err.splitlines()[0])
    assert "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_demo_seed_out_of_range_is_a_usage_error(capsys):
    """hacpo demo --seed 99999999999999999999 was an OverflowError traceback."""
    with pytest.raises(SystemExit) as e:
        main(["demo", "--seed", "99999999999999999999"])
    assert e.value.code == 2
    assert "argument --seed: must be an integer >= 0 and <= 4294967295" in capsys.readouterr().err


def test_a_binary_file_as_config_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    ck = tmp_path / "checkpoint.pt"
    ck.write_bytes(b"PK\x03\x04\x80\x81\xff" * 10)
    assert main(["train", "--preset", "tiny3", "--config", str(ck),
                 "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hacpo train: error: config file {ck}: not a text (UTF-8) file")
    assert "Traceback" not in err, err


def test_yaml_and_set_are_checked_together(tmp_path):
    """A config valid only with both the YAML and --set applied loads (not checked half-way)."""
    from hacpo.engine.run_config import load_config

    y = tmp_path / "hf.yaml"
    y.write_text("agents:\n  0: {policy: {arch: llama, hf_config: {num_hidden_layers: 1}}}\n")
    cfg = load_config("tiny3", str(y), {"agents.0.policy.kind": "hf"})
    assert cfg.agents[0].policy.kind == "hf" and cfg.agents[0].policy.arch == "llama"


def test_only_input_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """An error in the run's inputs (here a resume past the run's steps) is one line, exit 2;
    an error raised while training is not the user's and keeps its traceback."""
    from hacpo.engine import trainer

    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    common = ["train", "--preset", "tiny3", "--out-dir", str(tmp_path / "run"), "--set",
              f"cache_dir={tmp_path / 'cache'}", "plots=false", "tensorboard=false"]
    assert main(common + ["steps=1"]) == 0
    capsys.readouterr()
    assert main(common + ["steps=0", "--resume"]) == 2
    assert "the run is past it" in capsys.readouterr().err

    def boom(*a, **k):
        raise ValueError("a bug in a step")
    monkeypatch.setattr(trainer, "_run", boom)
    with pytest.raises(ValueError, match="a bug in a step"):
        main(common + ["steps=2", "--resume"])


def test_demo_bad_input_is_a_usage_error(capsys):
    """`hacpo demo` with an unknown algorithm, no agents or no steps: one line, exit 2 (not a
    traceback from inside the demo)."""
    assert main(["demo", "--algorithms", "gspo", "bogus", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo demo: error: unknown algorithm preset(s) bogus; choose from "
                          "hacpo, "), err
    for bad in (["--agents", "0"], ["--steps", "0"], ["--steps", "-3"]):
        with pytest.raises(SystemExit) as e:
            main(["demo", *bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {bad[0]}: must be an integer >= 1, got {int(bad[1])}" in err, err
        assert "Traceback" not in err


def test_invalid_yaml_config_is_one_line(tmp_path, capsys, monkeypatch):
    """A --config file that is not valid YAML is the user's error: one line naming the file and
    where the parser stopped, exit 2 (HACPO_TRACEBACK=1: the exception)."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    y = tmp_path / "broken.yaml"
    y.write_text("steps: [\n")
    assert main(["train", "--preset", "tiny3", "--config", str(y)]) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith(f"hacpo train: error: config file {y} is not valid YAML: ") and \
        "line 2, column 1" in first, err
    assert "Traceback" not in err
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(ValueError, match="is not valid YAML"):
        main(["train", "--preset", "tiny3", "--config", str(y)])


def test_eval_input_errors_are_one_line_and_traceback_on_request(tmp_path, capsys,
                                                                 monkeypatch):
    """`hacpo eval`: an output dir that cannot be made is one line, exit 2; with
    HACPO_TRACEBACK=1 the error propagates, as for the run commands."""
    import torch

    from hacpo.engine.run_config import load_config

    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"config": load_config("tiny3").to_dict(), "agents": [{"name": "char"}]},
               run / "checkpoint.pt")
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["eval", str(run), "--bench", f"b={bench}:gsm8k", "--out-dir", str(blocker / "x")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo eval: error: ") and "Not a directory" in err, err
    assert "Traceback" not in err
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(NotADirectoryError):
        main(args)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        main(["eval", str(tmp_path / "none"), "--bench", f"b={bench}"])


def test_compare_negative_pass_k_is_a_usage_error(capsys):
    """`hacpo compare --pass-k -1` is argparse's one-line error before any run starts (it was a
    traceback from the run config once the warm-up had been set up)."""
    with pytest.raises(SystemExit) as e:
        main(["compare", "--preset", "tiny3", "--pass-k", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --pass-k: must be an integer >= 0, got -1" in err, err


def test_empty_out_dir_is_an_error_not_the_presets(tmp_path, capsys, monkeypatch):
    """`--out-dir ""` (e.g. an unset shell variable) is an error; it once fell back silently to
    the preset's run dir (runs/tiny3: another run's, which --resume would then continue)."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    for cmd in ("train", "compare", "profile"):
        assert main([cmd, "--preset", "tiny3", "--out-dir", "", "--set", "steps=0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hacpo {cmd}: error: --out-dir '' is empty"), err
    assert list(tmp_path.iterdir()) == []


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    import os
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


@pytest.mark.parametrize("sig,code,said", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                           ("SIGINT", 130, "interrupted (Ctrl-C)")])
def test_a_signalled_run_stops_its_reward_workers_and_resumes(tmp_path, sig, code, said):
    """SIGTERM (a supervisor, a scheduler) and Ctrl-C unwind the run: exit 143 / 130 with one
    line saying --resume continues it, and the reward worker processes end with it (on SIGTERM
    Python used to die at once and leave them running); the run then resumes. Ctrl-C goes to
    the whole process group, as a terminal sends it: the workers print no traceback of their
    own."""
    import os
    import signal
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hacpo.launch.cli", "train", "--preset", "tiny3", "--out-dir",
           str(run), "--set", f"cache_dir={tmp_path / 'cache'}", "plots=false",
           "tensorboard=false", "reward.num_workers=2"]
    # SIGINT's default restored: a job started in the background (CI, nohup) inherits it
    # ignored, and Python then keeps ignoring it (no KeyboardInterrupt)
    proc = subprocess.Popen(cmd + ["--set", "steps=500", "checkpoint_every=1"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        # a checkpoint written and the reward workers (started at their first use) running
        while not ((run / "checkpoint.pt").exists() and len(_descendants(proc.pid)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        workers = _descendants(proc.pid)
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:         # never leave the run or its workers (its process group) behind
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == code, err
    assert f"hacpo train: {said}; continue it with --resume" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 20
    while (alive := [p for p in workers if os.path.exists(f"/proc/{p}")]):
        assert time.monotonic() < deadline, f"processes left running: {alive}"
        time.sleep(0.2)
    step = json.loads(open(run / "metrics.jsonl").readlines()[-1])["step"]
    done = subprocess.run(cmd + ["--set", f"steps={step + 2}", "--resume"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == \
        list(range(step + 2))


def test_sigusr1_stops_a_run_at_a_checkpoint_of_its_step(tmp_path):
    """SIGUSR1 (Slurm's `--signal=B:USR1@N` before a time limit; its default action killed the
    run, losing every step since the last checkpoint) makes `hacpo train` write a checkpoint
    at the end of the step it is in and stop: exit 75, one line naming the step, the reward
    workers ended, the metrics rows exactly the steps before the checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hacpo.launch.cli", "train", "--preset", "tiny3", "--out-dir",
           str(run), "--set", f"cache_dir={tmp_path / 'cache'}", "plots=false",
           "tensorboard=false", "reward.num_workers=2", "checkpoint_every=1000"]
    proc = subprocess.Popen(cmd + ["--set", "steps=500"], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = run / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        workers = _descendants(proc.pid)
        proc.send_signal(signal.SIGUSR1)
        err = proc.communicate(timeout=120)[1]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 75, err
    from hacpo.engine import checkpoint as ckpt
    step = ckpt.load(str(run / "checkpoint.pt"))["step"]
    assert 1 <= step < 500
    assert err.endswith(f"hacpo train: stopped at the checkpoint of step {step} (SIGUSR1); "
                        f"continue it with --resume\n"), err
    assert "Traceback" not in err
    assert [json.loads(line)["step"] for line in open(metrics)] == list(range(step))
    deadline = time.monotonic() + 20
    while (alive := [p for p in workers if os.path.exists(f"/proc/{p}")]):
        assert time.monotonic() < deadline, f"processes left running: {alive}"
        time.sleep(0.2)
    # (the resume from it: tests/engine/test_trainer.py, tests/launch/test_slurm.py)


def test_a_closed_standard_output_is_one_line_and_exit_141(tmp_path):
    """`hacpo demo | head -1` (or eval's, train's output): the reader of stdout gone, the next
    write raised BrokenPipeError: a traceback (demo) or "error: Broken pipe", exit 2 (eval).
    Now one line on stderr and exit 141, as a shell tool stopped by SIGPIPE."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "demo"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()                      # the reader gone before the first line
    err = p.stderr.read()
    p.wait(timeout=120)
    assert p.returncode == 141, err
    assert err == ("hacpo: stopped: its standard output was closed (the reader of the pipe, "
                   "e.g. `head`, exited)\n")


@pytest.mark.parametrize("stdout_closed", [True, False])
def test_eval_whose_output_closed_exits_141_and_another_broken_pipe_is_an_error(
        capsys, monkeypatch, stdout_closed):
    """eval's input errors include OSError: a closed stdout was "error: Broken pipe", exit 2.
    It is the one line and 141 now; a BrokenPipeError of another pipe (a worker process gone)
    is not called a closed output."""
    import hacpo.engine.eval_harness as eh
    import hacpo.launch.cli as cli

    def broken(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(eh, "evaluate_checkpoints", broken)
    monkeypatch.setattr(cli, "_stdout_closed", lambda: stdout_closed)
    monkeypatch.setattr(cli.os, "dup2", lambda *a: None)       # (pytest's own stdout stays)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    rc = main(["eval", "some/run", "--bench", "x.jsonl"])
    err = capsys.readouterr().err
    if stdout_closed:
        assert rc == 141 and err.startswith("hacpo: stopped: its standard output was closed")
    else:
        assert rc == 2 and err == "hacpo eval: error: [Errno 32] Broken pipe\n", err


def test_policy_settings_nothing_would_use_fail_before_the_run(capsys, monkeypatch):
    """A decoder size given for an HF policy, and a misspelt hf_config key, are one error line
    when the config loads: before any data, warm-up or model is built."""
    import hacpo.engine.trainer as trainer

    def reached(*a, **k):
        raise AssertionError("the run started")
    monkeypatch.setattr(trainer, "train", reached)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    hf = ["--preset", "tiny3", "--set", "agents.0.policy.kind=hf"]
    assert main(["train", *hf, "agents.0.policy.d_model=512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo train: error: agent 'char': agents.0.policy.d_model=512 "
                          "applies to policy.kind='decoder' only"), err
    assert main(["train", *hf, "agents.0.policy.hf_config={hiden_size: 32}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo train: error: agent 'char': policy.hf_config: HF llama "
                          "config: unknown key(s) ['hiden_size']"), err


def test_an_error_raised_while_a_run_stops_is_reported_as_the_stop(capsys, tmp_path):
    """An error a library raises while the run unwinds from Ctrl-C or SIGTERM (torch's zip
    writer cut inside torch.save raised "RuntimeError: unexpected pos" in place of the
    KeyboardInterrupt) is the stop: one line naming it and the error, exit 130 / 143, not a
    traceback; an error with no interrupt behind it propagates as before."""
    import argparse

    from hacpo.launch.cli import TERMINATED, _stoppable

    def cut_short(interrupt):
        def func(args):
            try:
                raise interrupt
            except BaseException:
                raise RuntimeError("unexpected pos 91584 vs 91472")
        return func

    (tmp_path / "config.json").write_text("{}")     # a run that can be continued
    args = argparse.Namespace(command="train", run_dir=str(tmp_path))
    assert _stoppable(args, cut_short(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == (
        "hacpo train: interrupted (Ctrl-C); continue it with --resume (while it stopped: "
        "RuntimeError: unexpected pos 91584 vs 91472)\n")
    with pytest.raises(SystemExit) as e:
        _stoppable(args, cut_short(SystemExit(TERMINATED)))
    assert e.value.code == TERMINATED
    assert capsys.readouterr().err.startswith("hacpo train: terminated (SIGTERM); continue it "
                                              "with --resume (while it stopped: RuntimeError")
    # a run stopped before it wrote its config.json (its folder removed, or never made) has
    # nothing to continue: no "--resume" hint
    for run_dir in (None, str(tmp_path / "gone")):
        args = argparse.Namespace(command="train", run_dir=run_dir)
        assert _stoppable(args, cut_short(KeyboardInterrupt())) == 130
        assert capsys.readouterr().err == ("hacpo train: interrupted (Ctrl-C) (while it stopped: "
                                           "RuntimeError: unexpected pos 91584 vs 91472)\n")
    with pytest.raises(RuntimeError, match="plain"):
        _stoppable(args, lambda a: (_ for _ in ()).throw(RuntimeError("plain")))
    with pytest.raises(RuntimeError, match="unexpected"):     # SystemExit(1): not a SIGTERM
        _stoppable(args, cut_short(SystemExit(1)))


def test_every_run_and_eval_flag_reaches_its_command(tmp_path, command_calls, capsys):
    """Each option of train / compare / profile / eval arrives where it acts (the command's
    config or its function's argument), none parsed and dropped: the commands' functions are
    replaced by recorders here, so nothing runs."""
    got = command_calls
    out = str(tmp_path / "r")
    assert main(["train", "--preset", "tiny3", "--steps", "7", "--out-dir", out,
                 "--skip-bad-rows", "--resume", "--set", "prompts_per_step=3",
                 "--accept-encoding-change"]) == 0
    (cfg,), kw = got["train"]
    assert (cfg.steps, cfg.out_dir, cfg.data.skip_bad_rows, cfg.prompts_per_step, kw) == \
        (7, out, True, 3, {"resume": True, "accept_encoding_change": True})
    assert main(["train", "--preset", "tiny3", "--resume", "--accept-encoding-change", "qwen3",
                 "char"]) == 0                          # those agents' changes only
    assert got["train"][1] == {"resume": True, "accept_encoding_change": ["qwen3", "char"]}
    assert main(["train", "--preset", "tiny3"]) == 0
    (cfg,), kw = got["train"]
    assert (cfg.steps, cfg.out_dir, cfg.data.skip_bad_rows, kw) == \
        (2, "runs/tiny3", False, {"resume": False, "accept_encoding_change": False})
    assert main(["compare", "--preset", "tiny3", "--algorithms", "gspo", "hacpo", "--seeds",
                 "3", "4", "--pass-k", "0", "--out-dir", out, "--steps", "5"]) == 0
    (cfg, algos, seeds, root), kw = got["compare"]
    assert (cfg.steps, algos, seeds, root, kw["pass_k"]) == (5, ["gspo", "hacpo"], [3, 4], out,
                                                             0)
    assert kw["accept_encoding_change"] is False
    assert main(["compare", "--preset", "tiny3", "--accept-encoding-change"]) == 0
    assert got["compare"][0][1:] == (["grpo", "gspo", "gspo2x", "naive", "hacpo"], [0, 1, 2],
                                     "runs/compare") and got["compare"][1]["pass_k"] == 4
    assert got["compare"][1]["accept_encoding_change"] is True
    assert main(["compare", "--preset", "tiny3", "--accept-encoding-change", "qwen3"]) == 0
    assert got["compare"][1]["accept_encoding_change"] == ["qwen3"]
    assert main(["profile", "--preset", "tiny3", "--algorithms", "gspo", "hacpo", "--rounds",
                 "4", "--steps-per-round", "3", "--skip-steps", "2", "--out-dir", out]) == 0
    (cfg, root), kw = got["profile"]
    assert (root, kw["algorithms"], kw["rounds"], kw["steps_per_round"], kw["skip_steps"]) == \
        (out, ["gspo", "hacpo"], 4, 3, 2)
    assert main(["profile", "--preset", "tiny3"]) == 0
    (cfg, root), kw = got["profile"]
    assert (root, kw["algorithms"], kw["rounds"], kw["steps_per_round"], kw["skip_steps"]) == \
        ("runs/profile", ["gspo", "gspo2x", "hacpo"], 3, 2, 1)
    assert main(["eval", "r1", "r2", "--bench", "a=x.jsonl", "b=y.jsonl:gsm8k", "--agents", "q",
                 "--samples", "3", "--temperature", "0.5", "--top-p", "0.9",
                 "--max-new-tokens", "11", "--limit", "5", "--template", "t", "--out-dir", out,
                 "--batch", "7", "--seed", "9", "--set", "agents.1.policy.path=m"]) == 0
    (ck, bench), kw = got["eval"]
    assert (ck, bench) == (["r1", "r2"], ["a=x.jsonl", "b=y.jsonl:gsm8k"])
    assert kw == {"agents": ["q"], "samples": 3, "temperature": 0.5, "top_p": 0.9,
                  "max_new_tokens": 11, "limit": 5, "template": "t", "out_dir": out,
                  "batch": 7, "seed": 9, "moved": {"agents.1.policy.path": "m"}}
    assert main(["eval", "r1", "--bench", "a=x.jsonl"]) == 0
    assert got["eval"][1] == {"agents": None, "samples": 1, "temperature": None, "top_p": None,
                              "max_new_tokens": None, "limit": None, "template": None,
                              "out_dir": None, "batch": 128, "seed": None, "moved": {}}
    # a repeated --bench / --agents adds to the earlier ones, as --set does (the last one
    # replaced them: those benchmarks and agents went unscored without a word)
    assert main(["eval", "r1", "--bench", "a=x.jsonl", "--agents", "q", "--bench", "b=y.jsonl",
                 "c=z.jsonl", "--agents", "p"]) == 0
    (ck, bench), kw = got["eval"]
    assert (bench, kw["agents"]) == (["a=x.jsonl", "b=y.jsonl", "c=z.jsonl"], ["q", "p"])
    with pytest.raises(SystemExit):           # --pass-k: an integer >= 0
        main(["compare", "--preset", "tiny3", "--pass-k", "-1"])
    assert "must be an integer >= 0, got -1" in capsys.readouterr().err


def test_version_is_the_package_s_own(capsys):
    """`hacpo --version` prints hacpo.__version__, the one version setup.py installs (the
    installed distribution's metadata says the same)."""
    import importlib.metadata
    import re
    import hacpo
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hacpo {hacpo.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", hacpo.__version__)
    assert importlib.metadata.version("hacpo") == hacpo.__version__


def test_a_run_that_fails_before_writing_leaves_no_folder_it_made(tmp_path, capsys, monkeypatch):
    """A new run refused after its run dir was made and locked (an agent name new runs may not
    use is checked there) removes the folders it made and its lock file; a run dir that existed
    is kept, with what it held."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    bad = ["train", "--preset", "tiny3", "--set", "agents.0.policy.name=a b",
           f"cache_dir={tmp_path / 'cache'}", "--out-dir"]
    assert main(bad + [str(tmp_path / "new" / "sub" / "run")]) == 2
    assert "agents.0.policy.name='a b'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    mine = tmp_path / "mine"
    (mine / "keep").mkdir(parents=True)
    assert main(bad + [str(mine / "keep" / "run")]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["keep"]
    assert list((mine / "keep").iterdir()) == []
    (mine / "notes.txt").write_text("mine")
    assert main(bad + [str(mine)]) == 2
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "keep").is_dir()
    assert sorted(p.name for p in mine.iterdir()) == ["keep", "notes.txt"]   # no lock file left
    (mine / ".hacpo-run.lock").write_text("")      # an earlier run's lock file is not its to remove
    assert main(bad + [str(mine)]) == 2
    assert sorted(p.name for p in mine.iterdir()) == [".hacpo-run.lock", "keep", "notes.txt"]


def test_a_sigterm_a_library_turned_into_its_own_exit_is_still_the_stop(capsys, tmp_path):
    """Ray's ray.get, when SIGTERM's handler raises inside it (a Ray trainer group or megatron
    ranks starting), raises SystemExit(1) in place of the handler's SystemExit(143): the run
    exited 1 with no line. It is the stop: the line and exit 143."""
    import argparse
    import os
    import signal
    import time

    from hacpo.launch.cli import TERMINATED, _stoppable

    def ray_like(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit:
            raise SystemExit(1)          # what Ray's C-level get raises instead

    def error_after(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit:
            pass
        raise RuntimeError("actor died")

    args = argparse.Namespace(command="train", run_dir=str(tmp_path))
    for func, also in ((ray_like, ""), (error_after, " (while it stopped: RuntimeError: actor "
                                                      "died)")):
        with pytest.raises(SystemExit) as e:
            _stoppable(args, func)
        assert e.value.code == TERMINATED
        assert capsys.readouterr().err == f"hacpo train: terminated (SIGTERM){also}\n"
    # without a SIGTERM, an exit status of 1 is the command's own
    def exits_1(args):
        raise SystemExit(1)
    with pytest.raises(SystemExit) as e:
        _stoppable(args, exits_1)
    assert e.value.code == 1 and capsys.readouterr().err == ""


def test_a_copied_runs_config_without_out_dir_is_an_error(tmp_path, capsys, monkeypatch):
    """`hacpo train --config copy/config.json --resume` continued (or started over in) the
    original run dir that config.json names, not the copy beside it."""
    import shutil
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    run = tmp_path / "run"
    common = ["--preset", "tiny3", "--set", "threads=1", "plots=false", "tensorboard=false",
              f"cache_dir={tmp_path / 'cache'}"]
    assert main(["train", "--steps", "1", "--out-dir", str(run), *common]) == 0
    shutil.copytree(run, tmp_path / "copy")
    capsys.readouterr()
    before = sorted(p.name for p in run.iterdir())
    argv = ["train", "--config", str(tmp_path / "copy" / "config.json"), "--resume",
            "--steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"is the config of the run in {tmp_path / 'copy'}, but it names out_dir {run}" in err
    assert f"pass --out-dir {tmp_path / 'copy'} to continue that run" in err
    assert sorted(p.name for p in run.iterdir()) == before
    assert main([*argv, "--out-dir", str(tmp_path / "copy")]) == 0      # the copy continues
    assert json.loads((tmp_path / "copy" / "summary.json").read_text())["steps"] == 2
    assert main(["train", "--config", str(run / "config.json"), "--resume", "--steps", "2"]) == 0
    # a run made with a relative out_dir, resumed from another directory: not "copied or moved"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", "--out-dir", "rel run", *common]) == 0
    monkeypatch.chdir(run)
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "rel run" / "config.json"), "--resume",
                 "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert (f"but it names out_dir rel run (relative: {run / 'rel run'} from this directory): "
            f"pass --out-dir '{tmp_path / 'rel run'}' to continue that run") in err, err


def test_hacpo_version_imports_no_torch_and_an_early_ctrl_c_is_one_line(monkeypatch, capsys):
    """Building the `hacpo` parser imported launch_local, hence hacpo.engine and torch: every
    command (`hacpo --version` too) paid the import, and a Ctrl-C during it was a traceback.
    The launcher is imported when it runs; a Ctrl-C before a command's own handler is one line,
    exit 130."""
    import subprocess
    import sys
    code = ("import sys\nfrom hacpo.launch.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.splitlines()[-1] == "False", out.stdout + out.stderr
    import hacpo.launch.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run_command", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "hacpo: interrupted (Ctrl-C)\n"


def test_demo_stops_on_sigterm_with_one_line():
    """`hacpo demo` ran outside the commands' stop handling: SIGTERM ended it silently, Ctrl-C
    with a traceback."""
    import signal
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-u", "-m", "hacpo.launch.cli", "demo", "--steps",
                          "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "step" in p.stdout.readline()       # it runs (its first progress line)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143 and err.strip() == "hacpo demo: terminated (SIGTERM)", err


def test_a_stopped_compare_or_profile_says_what_to_do_next(tmp_path, monkeypatch, capsys):
    """compare's stop line says the same command continues it (it reuses finished runs and
    resumes the others); profile's, that its partial runs block the next profile of that out
    dir (it measures new runs only) — neither said anything."""
    from hacpo.engine import compare, profile

    def stopped(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(compare, "run_compare", stopped)
    assert main(["compare", "--preset", "tiny3", "--out-dir", str(tmp_path / "c")]) == 130
    assert capsys.readouterr().err == ("hacpo compare: interrupted (Ctrl-C); run the same "
                                       "command again to continue it\n")
    out = tmp_path / "p"

    def stopped_after_a_step(cfg, out_dir, *, algorithms, **k):
        (out / "hacpo").mkdir(parents=True)
        (out / "hacpo" / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: stopped())
    assert main(["profile", "--preset", "tiny3", "--out-dir", str(out)]) == 130
    assert capsys.readouterr().err == "hacpo profile: interrupted (Ctrl-C)\n"   # nothing held
    monkeypatch.setattr(profile, "run_profile", stopped_after_a_step)
    assert main(["profile", "--preset", "tiny3", "--out-dir", str(out)]) == 130
    assert capsys.readouterr().err == (
        f"hacpo profile: interrupted (Ctrl-C); its runs in {out} are partial ({out}/hacpo): "
        f"remove them or choose another --out-dir to profile again\n")


def test_settings_compare_or_profile_choose_given_in_a_config_file_are_said(
        tmp_path, monkeypatch, capsys):
    """`--set seed=5` to hacpo compare is refused (it runs each of --seeds), but `seed: 5` in
    the --config file was dropped without a word (results for other seeds than meant). Not
    refused (a run's config.json sets them all), said: a [warn] line per key that differs from
    the preset's, none for one that does not."""
    from hacpo.engine import compare, profile
    got = {}
    monkeypatch.setattr(compare, "run_compare", lambda cfg, *a, **k: got.update(cfg=cfg))
    monkeypatch.setattr(profile, "run_profile", lambda cfg, *a, **k: got.update(cfg=cfg))
    y = tmp_path / "c.yaml"
    y.write_text("seed: 5\neval_pass_k: 4\nsteps: 7\nplots: true\n")    # tiny3: plots true
    assert main(["compare", "--preset", "tiny3", "--config", str(y), "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert out == (f"[warn] seed=5 in --config {y} is not used by hacpo compare: it runs each "
                   f"of --seeds\n[warn] eval_pass_k=4 in --config {y} is not used by hacpo "
                   f"compare: its final evaluations take --pass-k samples\n")
    assert got["cfg"].steps == 7         # a setting compare does not choose: used
    assert main(["profile", "--preset", "tiny3", "--config", str(y)]) == 0
    out = capsys.readouterr().out
    assert f"[warn] steps=7 in --config {y} is not used by hacpo profile: it runs --rounds x " \
        f"--steps-per-round steps\n" in out and "plots" not in out
    assert main(["compare", "--preset", "tiny3", "--seeds", "0"]) == 0      # no file: nothing
    assert capsys.readouterr().out == ""


def test_a_console_that_cannot_encode_what_a_command_prints_gets_it_escaped():
    """PYTHONIOENCODING=ascii (or a latin-1 terminal): `hacpo eval`'s "±" line ended it after
    its first benchmark ("'ascii' codec can't encode character", exit 2)."""
    import os
    import subprocess
    import sys
    code = ("import sys\nfrom hacpo.launch import cli\n"
            "cli._demo = lambda args: print('acc 0.5 \\u00b1 0.1 \\u221a') or 0\n"
            "sys.exit(cli.main(['demo']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout == b"acc 0.5 \\xb1 0.1 \\u221a\n"


@pytest.mark.parametrize("text, said", [
    ("steps: 3\nseed: 1\nsteps: 5\n", "key 'steps' is given twice (lines 1 and 3)"),
    ("algorithm: {clip_low: 0.1, clip_low: 0.2}\n", "key 'clip_low' is given twice (lines 1 "
                                                    "and 1)"),
    ("algorithm:\n  clip_low: 0.1\nalgorithm.clip_low: 0.2\n",
     "key algorithm.clip_low is given twice (as a dotted key and nested)"),
])
def test_a_config_key_given_twice_is_an_error(tmp_path, capsys, monkeypatch, text, said):
    """yaml.safe_load kept the last of two keys silently ("steps: 10" near the top of a long
    file and "steps: 2" further down ran 2 steps); a merge key still overrides."""
    from hacpo.engine.run_config import read_config_file
    monkeypatch.chdir(tmp_path)     # (a run that went ahead: its run dir and cache here)
    y = tmp_path / "c.yaml"
    y.write_text(text)
    assert main(["train", "--preset", "tiny3", "--config", str(y)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hacpo train: error: config file {y}") and said in err, err
    y.write_text("base: &b {clip_low: 0.1, clip_high: 0.2}\nalgorithm:\n  <<: *b\n"
                 "  clip_low: 0.3\n")
    assert read_config_file(str(y))["algorithm.clip_low"] == 0.3
