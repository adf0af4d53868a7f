"""Trainer behaviour a mutation audit found untested: the resume's checks of a checkpoint
against the config (its fields, a folder named as a known tokenizer), what a resume
restores (the warm-up record, the step of its checkpoint), a stop pending at a finished run's resume, an extended run's final
evaluation, the rows a resume drops, and the run dir checks (empty result files, a
checkpoint beside an export, a launcher's check_run_dir)."""
import dataclasses
import json
import shutil

import pytest

from hacpo.engine import checkpoint as ckpt
from hacpo.engine import trainer as trainer_mod
from hacpo.engine.trainer import train

from .test_trainer import _cfg


def quiet(*_):
    """An ``echo`` that says nothing."""


def _two_agents(tmp_path, name="run", **over):
    """tiny3's char and qwen3 agents, quiet, 4 held-out problems."""
    cfg = _cfg(tmp_path, name, plots="false", tensorboard="false", **{"data.eval_size": "4"},
               **over)
    return dataclasses.replace(cfg, agents=cfg.agents[:2])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run of :func:`_two_agents` (a checkpoint every step), in
    ``<tmp>/run``; tests copy it before they resume it."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = _two_agents(tmp, steps="2")
    summary = train(cfg, echo=quiet)
    return tmp, cfg, summary


def _copy(finished, tmp_path, name="run"):
    """The finished run copied to ``tmp_path/name``; its config pointed there."""
    tmp, cfg, _ = finished
    shutil.copytree(tmp / "run", tmp_path / name)
    return cfg.override({"out_dir": str(tmp_path / name)})


def test_a_checkpoint_without_its_data_cursor_is_not_a_training_checkpoint(finished):
    """A checkpoint with step, fingerprint and agents but no 'sampler' (the data cursor) is
    refused as no training checkpoint, not resumed into a KeyError."""
    tmp, cfg, _ = finished
    path = str(tmp / "run" / "checkpoint.pt")
    state = ckpt.load(path)
    trainer_mod._check_resumable(cfg, state, path)           # whole: resumable
    del state["sampler"]
    with pytest.raises(ValueError, match=r"checkpoint\.pt is not a hacpo training checkpoint "
                                         r"\(no 'step', 'fingerprint', 'agents' and "
                                         r"'sampler'\)"):
        trainer_mod._check_resumable(cfg, state, path)


def test_a_stop_pending_at_a_finished_runs_resume_is_left_for_the_caller(finished, tmp_path):
    """A resume at the run's last step has no step to stop after: a stop request pending then
    (SIGUSR1 while a compare reuses a finished run) does not stop it; it evaluates, writes its
    summary (the warm-up's and the evaluation before RL's record as the run wrote them) and
    leaves the request to the caller."""
    from hacpo.engine.signals import clear_stop_request, request_stop, stop_requested
    _, _, summary = finished
    cfg = _copy(finished, tmp_path)
    (tmp_path / "run" / "summary.json").unlink()
    request_stop()
    try:
        again = train(cfg, resume=True, echo=quiet)
        assert stop_requested()
    finally:
        clear_stop_request()
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == again
    for key in ("steps", "warmup", "before", "after"):
        assert again[key] == summary[key], key


def test_a_resumed_run_stopped_before_its_next_checkpoint_names_the_one_it_resumed(
        finished, tmp_path, monkeypatch):
    """Ctrl-C in the first step after a resume: the [stop] line names the checkpoint the
    resume started from, not "no checkpoint yet"."""
    cfg = _copy(finished, tmp_path).override({"steps": 4})

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer_mod, "generate_agents", interrupted)
    said = []
    with pytest.raises(KeyboardInterrupt):
        train(cfg, resume=True, echo=said.append)
    assert said[-1] == "[stop] the last checkpoint is at step 2: --resume goes on from there"


def test_a_folder_named_as_a_known_tokenizer_is_a_config_difference_not_a_move(tmp_path):
    """A run's tokenizer folder named at resume as a tokenizer known by name ("qwen3") or
    "char" is another setting (the config difference names it), not the folder moved to a
    place that does not exist."""
    base = str(tmp_path / "base")
    for now in ("qwen3", "char"):
        stored = {"agents": [{"policy": {"name": "a", "kind": "hf", "path": base,
                                         "tokenizer": base}}]}
        new = {"agents": [{"policy": {"name": "a", "kind": "hf", "path": base,
                                      "tokenizer": now}}]}
        trainer_mod._accept_moved_folders({}, stored, new)
        assert stored["agents"][0]["policy"]["tokenizer"] == base


@pytest.mark.parametrize("finished_at, summary_steps, carried", [
    (4, 4, True),       # a finished run extended: its final evaluation to the row of step 3
    (3, 3, False),      # eval_every=2 does not divide 3: a longer run evaluates no step 2
    (4, 2, False)])     # the summary.json of another (shorter) run: not this run's finish
def test_an_extended_runs_final_evaluation_goes_where_a_longer_run_evaluates(
        tmp_path, finished_at, summary_steps, carried):
    cfg = _cfg(tmp_path, steps="6", eval_every="2")
    run = tmp_path / "run"
    run.mkdir()
    rows = "".join(json.dumps({"step": s, "reward/a": 0.5}) + "\n" for s in range(finished_at))
    (run / "metrics.jsonl").write_text(rows)
    (run / "summary.json").write_text(json.dumps({"steps": summary_steps,
                                                  "after": {"a": {"accuracy": 0.25}}}))
    got = trainer_mod._carry_final_eval(cfg, finished_at, ["a"])
    if not carried:
        assert got == {} and (run / "metrics.jsonl").read_text() == rows
        return
    assert got == {"eval/a/accuracy": 0.25}
    assert [json.loads(ln) for ln in open(run / "metrics.jsonl")][-2:] == [
        {"step": 2, "reward/a": 0.5}, {"step": 3, "reward/a": 0.5, "eval/a/accuracy": 0.25}]


def test_empty_result_files_are_no_run_to_keep(tmp_path):
    """A metrics.jsonl with no row and an empty summary.json (a run killed as it made them)
    hold no results: a new run starts there without --resume; one row is a run's."""
    cfg = _cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "summary.json"):
        (run / name).write_text("")
    ck_path = str(run / "checkpoint.pt")
    assert trainer_mod._check_new_run(cfg, False, ck_path) == []
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(FileExistsError, match=r"holds the results of a run \(metrics\.jsonl\) "
                                              r"but no checkpoint\.pt"):
        trainer_mod._check_new_run(cfg, False, ck_path)


@pytest.mark.parametrize("steps, after", [
    (2, "this run ends at step 2"),       # resumed at its checkpoint's step: none runs again
    (3, "step 2 runs again")])
def test_rows_logged_after_the_checkpoint_are_said_dropped_and_which_run_again(
        finished, tmp_path, steps, after):
    """A run killed after logging steps 2 and 3 past its checkpoint at step 2, resumed for
    ``steps``: the note says which of the dropped rows' steps run again."""
    cfg = _copy(finished, tmp_path).override({"steps": steps})
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(ln) for ln in open(metrics)]
    with open(metrics, "a") as f:
        for s in (2, 3):
            f.write(json.dumps({**rows[-1], "step": s}) + "\n")
    said = []
    train(cfg, resume=True, echo=said.append)
    assert ("[resume] metrics.jsonl's rows of steps 2-3, logged after the checkpoint, are "
            f"dropped: {after}") in said
    assert [json.loads(ln)["step"] for ln in open(metrics)] == list(range(steps))


def test_a_launchers_run_dir_check_refuses_what_train_would(finished, tmp_path):
    """check_run_dir (a launcher, before its job waits in a queue): a run's checkpoint
    without --resume, a checkpoint --resume cannot continue (steps below its step), and a
    dangling checkpoint link are refused as train refuses them; the run resumed as it was
    passes."""
    from hacpo.engine.trainer import check_run_dir
    _, cfg, _ = finished
    check_run_dir(cfg, True)
    with pytest.raises(FileExistsError, match=r"already holds a run \(checkpoint\.pt\); pass "
                                              r"--resume"):
        check_run_dir(cfg, False)
    with pytest.raises(ValueError, match=r"at step 2 with steps=1: the run is past it"):
        check_run_dir(cfg.override({"steps": 1}), True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").symlink_to(tmp_path / "unmounted" / "checkpoint.pt")
    moved = cfg.override({"out_dir": str(tmp_path / "run")})
    for resume in (True, False):
        with pytest.raises(FileNotFoundError, match=r"checkpoint\.pt is a symbolic link to .*"
                                                    r"unmounted/checkpoint\.pt, which does not "
                                                    r"exist"):
            check_run_dir(moved, resume)


def test_a_run_dir_with_a_checkpoint_and_an_export_in_it_is_a_run_dir(tmp_path):
    """A run dir that also holds a model's files (exported into it) is a run's: a new run
    there is refused for its checkpoint (--resume continues it), not as a model folder."""
    cfg = _cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"x")
    (run / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"already holds a run \(checkpoint\.pt\); pass "
                                              r"--resume"):
        trainer_mod._check_new_run(cfg, False, str(run / "checkpoint.pt"))
