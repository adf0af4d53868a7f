"""`hacpo` command line parts a mutation audit of hacpo/launch/cli.py found untested, with the
commands' functions (train, run_compare, run_profile, evaluate_checkpoints,
export_checkpoint, the bandit demo) replaced by recorders (conftest's ``command_calls``):
what each option passes on, the one-line errors and exit statuses, the stop lines, and the
SIGTERM handler given back."""
import argparse
import errno
import json
import os
import signal
import time

import pytest

import hacpo.launch.cli as cli
from hacpo.engine import compare, eval_harness, export, trainer
from hacpo.engine.errors import user_errors
from hacpo.engine.signals import CHECKPOINT_STOPPED, RunStopped
from hacpo.launch.cli import TERMINATED, main


def test_demo_passes_its_options_on_and_has_its_defaults(command_calls, capsys):
    assert main(["demo", "--algorithms", "grpo", "--steps", "5", "--agents", "4",
                 "--seed", str(2**32 - 1)]) == 0           # the highest seed is allowed
    assert command_calls["demo"] == [("grpo", {"steps": 5, "agents": 4, "seed": 2**32 - 1})]
    assert capsys.readouterr().out.endswith("final expected accuracy per agent:\n"
                                            "  grpo   0.500  0.250\n")
    command_calls.clear()
    assert main(["demo"]) == 0
    assert command_calls["demo"] == [(a, {"steps": 60, "agents": 3, "seed": 0})
                                     for a in ("gspo", "hacpo")]


def test_a_number_that_is_no_integer_is_argparse_s_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", "ten"])
    assert e.value.code == 2
    assert "argument --steps: invalid int value: 'ten'" in capsys.readouterr().err


def test_run_flags_win_over_the_config_file_and_steps_0_is_given(command_calls, tmp_path):
    """--set and --steps 0 override the --config file (0 steps: evaluate the start only)."""
    y = tmp_path / "c.yaml"
    y.write_text("steps: 5\nprompts_per_step: 3\nseed: 4\n")
    assert main(["train", "--preset", "tiny3", "--config", str(y), "--set", "seed=7",
                 "--steps", "0", "--out-dir", str(tmp_path / "r")]) == 0
    (cfg,), _ = command_calls["train"]
    assert (cfg.steps, cfg.prompts_per_step, cfg.seed) == (0, 3, 7)


def test_paths_starting_with_a_tilde_are_the_home_folder_s(command_calls, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("steps: 5\n")
    assert main(["train", "--preset", "tiny3", "--config", "~/c.yaml", "--out-dir", "~/r"]) == 0
    (cfg,), _ = command_calls["train"]
    assert (cfg.steps, cfg.out_dir) == (5, str(tmp_path / "r"))
    assert main(["eval", "~/r1", "--bench", "a=x.jsonl"]) == 0
    assert command_calls["eval"][0][0] == [str(tmp_path / "r1")]
    assert main(["export", "~/r1", "--out", "~/x"]) == 0
    assert command_calls["export"][0] == (str(tmp_path / "r1"), str(tmp_path / "x"))
    assert main(["compare", "--preset", "tiny3", "--out-dir", "~/c"]) == 0
    assert command_calls["compare"][0][3] == str(tmp_path / "c")


def test_train_says_its_run_and_a_stopped_run_how_to_continue_it(command_calls, tmp_path,
                                                                 monkeypatch, capsys):
    """The first line names the run dir, the algorithm and each agent with its tokenizer; a
    run stopped by Ctrl-C after it wrote its config.json is continued with --resume."""
    out = tmp_path / "r"

    def stopped(cfg, **k):
        os.makedirs(cfg.out_dir)
        open(os.path.join(cfg.out_dir, "config.json"), "w").close()
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "train", stopped)
    assert main(["train", "--preset", "tiny3", "--algorithm", "gspo", "--out-dir", str(out)]) \
        == 130
    said = capsys.readouterr()
    assert said.out == (f"[hacpo] run dir {out}; algorithm gspo; agents char (char), "
                        f"qwen3 (qwen3), llama (llama3.2)\n")
    assert said.err == "hacpo train: interrupted (Ctrl-C); continue it with --resume\n"


def test_compare_and_profile_get_the_user_s_algorithm_settings(command_calls, tmp_path):
    """compare / profile put each of their algorithms under the user's algorithm.* settings
    (``keep``); they got none."""
    assert main(["compare", "--preset", "tiny3", "--set", "algorithm.loss.alpha=0.5"]) == 0
    assert command_calls["compare"][1]["keep"] == {"loss.alpha": 0.5}
    assert main(["profile", "--preset", "tiny3", "--set", "algorithm.loss.alpha=0.5",
                 "--out-dir", str(tmp_path / "p")]) == 0
    assert command_calls["profile"][1]["keep"] == {"loss.alpha": 0.5}
    assert command_calls["profile"][0][1] == str(tmp_path / "p")


@pytest.mark.parametrize("step, where", [(3, "at the checkpoint of step 3"),
                                         (None, "between its runs")])
def test_a_run_stopped_by_sigusr1_says_where_and_exits_75(command_calls, monkeypatch, capsys,
                                                          step, where):
    def stopped(*a, **k):
        raise RunStopped(step, "runs/compare")
    monkeypatch.setattr(compare, "run_compare", stopped)
    assert main(["compare", "--preset", "tiny3"]) == CHECKPOINT_STOPPED == 75
    assert capsys.readouterr().err == (f"hacpo compare: stopped {where} (SIGUSR1); run the "
                                       f"same command again to continue it\n")


def test_a_user_error_keyerror_of_a_run_is_its_message(command_calls, monkeypatch, capsys):
    def missing(*a, **k):
        with user_errors():
            raise KeyError("the checkpoint has no agent 'x'")
    monkeypatch.setattr(trainer, "train", missing)
    assert main(["train", "--preset", "tiny3"]) == 2
    assert capsys.readouterr().err == ("hacpo train: error: the checkpoint has no agent 'x'\n"
                                       "(HACPO_TRACEBACK=1 shows where it was raised)\n")


@pytest.mark.parametrize("command, hint", [
    ("train", "; fix it, then run again (--resume continues from the run's last checkpoint)"),
    ("compare", "")])
def test_a_refused_write_names_the_file_and_only_train_says_resume(command_calls, monkeypatch,
                                                                    capsys, command, hint):
    def full(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", "runs/x/metrics.jsonl")
    monkeypatch.setattr(trainer, "train", full)
    monkeypatch.setattr(compare, "run_compare", full)
    assert main([command, "--preset", "tiny3"]) == 2
    assert capsys.readouterr().err == (
        f"hacpo {command}: error: runs/x/metrics.jsonl: Read-only file system (OSError: "
        f"[Errno {errno.EROFS}] Read-only file system: 'runs/x/metrics.jsonl'){hint}\n"
        f"(HACPO_TRACEBACK=1 shows where it was raised)\n")


@pytest.mark.parametrize("err", [OSError(errno.EPERM, "Operation not permitted"),
                                 OSError(errno.ENOENT, "No such file or directory", "f")])
def test_an_os_error_no_write_explains_keeps_its_traceback(command_calls, monkeypatch, err):
    """EPERM naming no file (os.kill's, not the file system's) and an errno no full or
    read-only storage gives are a bug's: raised, not a one-line storage error."""
    def fails(*a, **k):
        raise err
    monkeypatch.setattr(trainer, "train", fails)
    with pytest.raises(OSError) as e:
        main(["train", "--preset", "tiny3"])
    assert e.value is err


def test_the_sigterm_handler_is_given_back(command_calls):
    """A command's SIGTERM handler is the process's only while the command runs."""
    before = signal.getsignal(signal.SIGTERM)
    assert before is not cli._raise_terminated
    assert main(["train", "--preset", "tiny3"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_while_stopping_is_the_stop_however_deep_the_interrupt(capsys):
    """The Ctrl-C two errors behind (a cleanup's error raised while another handled it)."""
    def func(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            try:
                raise OSError("flush failed")
            except OSError:
                raise RuntimeError("close failed")
    args = argparse.Namespace(command="eval")
    assert cli._stoppable(args, func) == 130
    assert capsys.readouterr().err == ("hacpo eval: interrupted (Ctrl-C) (while it stopped: "
                                       "RuntimeError: close failed)\n")
    assert cli._interrupted_by(RuntimeError()) is None


def test_a_sigterm_then_a_clean_exit_is_the_command_s_own(capsys):
    def exits_0(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit:
            raise SystemExit(0)
    with pytest.raises(SystemExit) as e:
        cli._stoppable(argparse.Namespace(command="eval"), exits_0)
    assert e.value.code == 0 and capsys.readouterr().err == ""


def test_eval_and_export_say_what_they_wrote_and_pass_each_option_on(command_calls, capsys):
    assert main(["eval", "r", "--bench", "a=x.jsonl", "--seed", str(2**32 - 1)]) == 0
    assert command_calls["eval"][1]["seed"] == 2**32 - 1
    assert capsys.readouterr().out == "\n| the table |\n[eval] written to e1, e2\n"
    assert main(["eval", "r", "--bench", "a=x.jsonl", "--set", "agents.0.policy.path=m",
                 "--set", "agents.1.policy.path=n"]) == 0
    assert command_calls["eval"][1]["moved"] == {"agents.0.policy.path": "m",
                                                 "agents.1.policy.path": "n"}
    capsys.readouterr()
    assert main(["export", "r", "--out", "x", "--agents", "a", "b", "--dtype", "float16",
                 "--no-tokenizer", "--force", "--set", "agents.0.policy.path=m",
                 "--set", "agents.0.policy.tokenizer=t"]) == 0
    assert command_calls["export"] == (("r", "x"), {
        "agents": ["a", "b"], "tokenizer": False, "dtype": "float16", "overwrite": True,
        "moved": {"agents.0.policy.path": "m", "agents.0.policy.tokenizer": "t"}})
    assert capsys.readouterr().out == "[export] written: x/a, x/b\n"
    assert main(["export", "r", "--out", "x"]) == 0
    assert command_calls["export"][1] == {"agents": None, "tokenizer": True, "dtype": None,
                                          "overwrite": False, "moved": {}}


@pytest.mark.parametrize("argv, said", [
    (["eval", "r", "--bench", "a=x.jsonl", "--seed", "-1"],
     "argument --seed: must be an integer >= 0 and <= 4294967295, got -1"),
    (["export", "r", "--out", "x", "--dtype", "float64"], "argument --dtype: invalid choice"),
])
def test_eval_and_export_options_out_of_range_are_usage_errors(command_calls, capsys, argv, said):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert argv[0] not in command_calls


def test_eval_and_export_stopped_by_ctrl_c_say_so_as_the_command(command_calls, monkeypatch,
                                                                 capsys):
    def stopped(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(eval_harness, "evaluate_checkpoints", stopped)
    monkeypatch.setattr(export, "export_checkpoint", stopped)
    assert main(["eval", "r", "--bench", "a=x.jsonl"]) == 130
    assert main(["export", "r", "--out", "x"]) == 130
    assert capsys.readouterr().err == ("hacpo eval: interrupted (Ctrl-C)\n"
                                       "hacpo export: interrupted (Ctrl-C)\n")


@pytest.mark.parametrize("error", [KeyError("no agent 'q' in the run"),
                                   RuntimeError("no agent 'q' in the run")])
def test_eval_s_key_and_runtime_errors_are_one_line(command_calls, monkeypatch, capsys, error):
    def fails(*a, **k):
        raise error
    monkeypatch.setattr(eval_harness, "evaluate_checkpoints", fails)
    assert main(["eval", "r", "--bench", "a=x.jsonl"]) == 2
    assert capsys.readouterr().err == "hacpo eval: error: no agent 'q' in the run\n"
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(type(error)):
        main(["eval", "r", "--bench", "a=x.jsonl"])


def test_a_sigterm_stop_names_itself_and_exits_143(capsys):
    def terminated(args):
        raise SystemExit(TERMINATED)
    with pytest.raises(SystemExit) as e:
        cli._stoppable(argparse.Namespace(command="export"), terminated)
    assert e.value.code == 143 and capsys.readouterr().err == "hacpo export: terminated (SIGTERM)\n"


def test_a_run_s_config_json_is_checked_against_its_folder_by_train_only(command_calls,
                                                                          tmp_path, capsys):
    """`--config RUN/config.json` (a checkpoint beside it) of a run reached through a link is
    that run; of a moved run, an error unless --out-dir says where; compare, which chooses
    its runs' folders, and another file beside a checkpoint are not checked."""
    from hacpo.engine.run_config import load_config
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    (run / "config.json").write_text(json.dumps(load_config(
        "tiny3", overrides={"out_dir": str(run)}).to_dict()))
    (tmp_path / "link").symlink_to(run)
    common = ["--preset", "tiny3", "--config"]
    assert main(["train", *common, str(tmp_path / "link" / "config.json"), "--resume"]) == 0
    assert command_calls["train"][0][0].out_dir == str(run)
    moved = tmp_path / "moved"
    run.rename(moved)
    assert main(["train", *common, str(moved / "config.json")]) == 2
    assert "(the run was copied or moved): pass --out-dir" in capsys.readouterr().err
    assert main(["train", *common, str(moved / "config.json"), "--out-dir",
                 str(tmp_path / "new")]) == 0
    assert command_calls["train"][0][0].out_dir == str(tmp_path / "new")
    assert main(["compare", *common, str(moved / "config.json")]) == 0
    (moved / "more.yaml").write_text("steps: 3\n")
    assert main(["train", *common, str(moved / "more.yaml")]) == 0
    assert command_calls["train"][0][0].steps == 3
