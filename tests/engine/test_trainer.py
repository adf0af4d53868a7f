"""End to end: `hacpo train` on the tiny3 preset (3 agents, 3 different tokenizers), resume after
kill -9, config mismatch, and the trainer's bad-input paths."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from hacpo.engine import checkpoint as ckpt
from hacpo.engine.rewards import register_reward
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train

from ._locks import held_lock


def _cfg(tmp_path, name="run", **over):
    base = {"out_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"),
            "threads": "1"}
    return load_config("tiny3", overrides={**base, **over})


def test_two_step_run_three_tokenizers(tmp_path):
    t0 = time.time()
    cfg = _cfg(tmp_path)
    assert len({a.policy.tokenizer for a in cfg.agents}) == 3
    summary = train(cfg, echo=lambda *_: None)
    assert time.time() - t0 < 60
    out = tmp_path / "run"
    for f in ("config.json", "metrics.jsonl", "checkpoint.pt", "summary.json",
              "reward_curves.png", "capability_ratios.png", "ratio_histograms.png"):
        assert (out / f).exists(), f
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for name in ("char", "qwen3", "llama"):
        assert 0.0 <= rows[-1][f"reward/{name}"] <= 1.0
        assert rows[-1][f"train/{name}/trained_self"] > 0
        r = rows[-1]
        # per-stage accounting: wall time and tokens per agent and step
        for stage in ("generate", "old_logprobs", "retokenize", "score_self", "score_cross",
                      "backward_self", "backward_cross", "optimizer", "sync", "update"):
            assert r[f"time/{stage}/{name}"] >= 0, stage
        # the stages that work for every agent every step on the local engine were timed
        # (a stage run outside its timer, or never entered, reads 0); cross scoring only for
        # an agent with cross samples; sync copies nothing (the engine reads the policy)
        cross = ("retokenize", "score_cross", "backward_cross")
        for stage in ("generate", "old_logprobs", "score_self", "backward_self", "optimizer",
                      "update") + (cross if r[f"train/{name}/trained_cross"] > 0 else ()):
            assert r[f"time/{stage}/{name}"] > 0, stage
        parts = sum(r[f"time/{s}/{name}"] for s in ("score_self", "score_cross",
                                                    "backward_self", "backward_cross",
                                                    "optimizer"))
        assert parts <= r[f"time/update/{name}"] <= r["time/step"]
        # the phases: all agents' wall time (one after another here: at least each agent's)
        for phase in ("generate", "old_logprobs", "update", "sync"):
            assert r[f"time/{phase}/{name}"] <= r[f"time/{phase}"] <= r["time/step"], phase
        assert r[f"tokens/generated/{name}"] > 0
        assert r[f"tokens/scored_self/{name}"] > 0
        for row in rows:   # cross samples can all be dropped (unencodable) for a learner
            has_cross = row[f"train/{name}/trained_cross"] > 0
            assert (row[f"tokens/scored_cross/{name}"] > 0) == has_cross
            assert (row[f"time/score_cross/{name}"] > 0) == has_cross
    assert sum(r[f"tokens/scored_cross/{nm}"] for r in rows for nm in ("char", "qwen3", "llama"))\
        < sum(r[f"tokens/forward_cross/{nm}"] for r in rows for nm in ("char", "qwen3", "llama"))
    # every response was scored by the verifier and re-tokenized for two other learners
    n = 3 * cfg.prompts_per_step * cfg.rollout.group_size
    assert rows[0]["reward_fn/total"] == n
    assert rows[0]["retok/samples"] == 2 * n
    assert set(summary["after"]) == {"char", "qwen3", "llama"}
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, echo=lambda *_: None)


def _strip_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "reward_fn/seconds"))}
            for r in rows]


def test_resume_after_kill_matches_uninterrupted(tmp_path):
    steps = 30
    common = ["--preset", "tiny3", "--steps", str(steps), "--set", "threads=1",
              f"cache_dir={tmp_path / 'cache'}", "plots=false", "tensorboard=false",
              "checkpoint_every=1", "rollout.group_size=4", "prompts_per_step=6"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "hacpo.launch.cli", "train"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(cli + ["--out-dir", str(ref_dir)] + common, check=True, env=env,
                   capture_output=True)
    proc = subprocess.Popen(cli + ["--out-dir", str(run_dir)] + common, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= 3:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines_at_kill = sum(1 for _ in open(metrics))
    assert lines_at_kill < steps, "the run finished before it could be killed"
    subprocess.run(cli + ["--out-dir", str(run_dir), "--resume"] + common, check=True, env=env,
                   capture_output=True)
    ref = [json.loads(l) for l in open(ref_dir / "metrics.jsonl")]
    got = [json.loads(l) for l in open(metrics)]
    assert len(got) == steps
    assert _strip_times(got) == _strip_times(ref)
    s_ref = json.load(open(ref_dir / "summary.json"))
    s_got = json.load(open(run_dir / "summary.json"))
    assert s_got["after"] == s_ref["after"] and s_got["before"] == s_ref["before"]


def test_resume_with_other_config_is_clear_error(tmp_path):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(NotADirectoryError, match="afile is a file, not a directory"):
        train(_cfg(tmp_path, "afile"), echo=lambda *_: None)
    assert (tmp_path / "afile").read_text() == "mine"
    cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false")
    train(cfg, echo=lambda *_: None)
    other = cfg.override({"agents.1.optim.lr": 0.5, "rollout.group_size": 3, "steps": 2})
    with pytest.raises(ValueError, match=r"agents\.1\.optim\.lr.*rollout\.group_size \(resume "
                                         r"with the run's own settings: --config "
                                         + re.escape(os.path.join(cfg.out_dir, "config.json"))):
        train(other, resume=True, echo=lambda *_: None)
    os.rename(os.path.join(cfg.out_dir, "config.json"), tmp_path / "kept.json")
    with pytest.raises(ValueError, match=r"\(resume with the run's own settings: the --preset "
                                         r"/ --set it was started with\)"):   # no config.json
        train(other, resume=True, echo=lambda *_: None)                    # to point to
    os.rename(tmp_path / "kept.json", os.path.join(cfg.out_dir, "config.json"))
    train(cfg.override({"steps": 2}), resume=True, echo=lambda *_: None)   # steps may grow
    with pytest.raises(ValueError, match=r"at step 2 with steps=1: the run is past it .* "
                                         r"pass steps >= 2"):
        train(cfg, resume=True, echo=lambda *_: None)
    said = []
    train(cfg.override({"out_dir": str(tmp_path / "new")}), resume=True, echo=said.append)
    assert f"[resume] no checkpoint.pt in {tmp_path / 'new'}: starting a new run there" in said


def test_a_run_that_is_not_finished_holds_no_summary_of_a_run_before(tmp_path, monkeypatch):
    """summary.json marks a finished run: a finished run resumed for more steps, or a run
    started over where its checkpoint was removed, and stopped before it finishes, left the
    old summary (its steps, its results) beside the new run's files. Starting over with
    results to replace is a [warn] (compare, which shows only those, said nothing while it
    retrained a run from step 0)."""
    import hacpo.engine.trainer as trainer_mod
    cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false")
    train(cfg, echo=lambda *_: None)
    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    train(cfg, resume=True, echo=lambda *_: None)           # at its last step: still finished
    assert (run / "summary.json").exists()

    def stop(*_, **__):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:     # stopped before it changed anything: still finished
        m.setattr(trainer_mod, "sync_agents", stop)
        with pytest.raises(KeyboardInterrupt):
            train(cfg.override({"steps": 2}), resume=True, echo=lambda *_: None)
    assert (run / "summary.json").exists()
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "generate_agents", stop)     # stopped in its first new step
        with pytest.raises(KeyboardInterrupt):
            train(cfg.override({"steps": 2}), resume=True, echo=lambda *_: None)
    assert not (run / "summary.json").exists() and (run / "checkpoint.pt").exists()
    train(cfg.override({"steps": 2}), resume=True, echo=lambda *_: None)
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    os.remove(run / "checkpoint.pt")
    said = []
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "sync_agents", stop)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, resume=True, echo=said.append)
    assert f"[warn] no checkpoint.pt in {run}: starting a new run there (metrics.jsonl, " \
           f"summary.json of the run before are replaced)" in said
    assert not (run / "summary.json").exists()


def test_resume_of_a_run_with_a_setting_now_refused_once_it_is_removed(tmp_path):
    """A run written before a config check existed may hold a policy setting its build never
    used (here an HF setting on a decoder agent); this version refuses the setting, and once
    the user removes it the run resumes (the stored fingerprint is compared without it)."""
    cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false")
    train(cfg, echo=lambda *_: None)
    ck_path = os.path.join(cfg.out_dir, "checkpoint.pt")
    state = ckpt.load(ck_path)
    state["fingerprint"]["agents"][0]["policy"]["arch"] = "qwen2"    # unused by a decoder
    state["fingerprint"]["agents"][0]["policy"]["hf_config"] = {"hidden_size": 8}
    ckpt.save_atomic(state, ck_path)
    train(cfg.override({"steps": 2}), resume=True, echo=lambda *_: None)
    assert ckpt.load(ck_path)["step"] == 2
    # a setting the build did use still counts
    state = ckpt.load(ck_path)
    state["fingerprint"]["agents"][0]["policy"]["d_model"] += 1
    ckpt.save_atomic(state, ck_path)
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in agents\.0\.policy\."
                                         r"d_model \(resume with"):
        train(cfg.override({"steps": 3}), resume=True, echo=lambda *_: None)


def test_resume_of_a_foreign_checkpoint_or_changed_data_is_clear_error(tmp_path):
    """A checkpoint.pt that torch reads but that is no training checkpoint (e.g. a warm-start
    cache file copied there), and a resume over training data that changed since the
    checkpoint (another row count: the data cursor; the same rows with other words: the
    cursor's record of their content — before it, reduced vocabularies of the same size that
    map ids to other tokens resumed silently; a held-out set that changed: the checkpoint's
    record of it; for older checkpoints, the reduced vocabulary), are one-line errors naming the checkpoint, before any step; checkpoint,
    metrics and config.json (this resume asks for more steps) are kept."""
    from hacpo.engine import checkpoint as ckpt
    from hacpo.engine.errors import is_user_error
    run = tmp_path / "run"
    run.mkdir()
    for foreign in (torch.zeros(3), {"model": {}, "losses": [1.0]}):
        torch.save(foreign, run / "checkpoint.pt")
        with pytest.raises(ValueError, match=r"run/checkpoint\.pt is not a hacpo training "
                                             r"checkpoint") as e:
            train(_cfg(tmp_path, steps="1"), resume=True, echo=lambda *_: None)
        assert is_user_error(e.value)
    rows = [{"question": f"Tom has {a} apples and gets {b} more. How many apples?",
             "answer": f"#### {a + b}"} for a, b in ((1, 2), (3, 4), (2, 5), (4, 4))]
    train_f, eval_f = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_f.write_text(json.dumps({"question": "Ann has 2 cats and gets 3 more. How many cats?",
                                  "answer": "#### 5"}) + "\n")
    over = {"data.task": "files", "data.train_path": str(train_f),
            "data.eval_path": str(eval_f), "plots": "false", "tensorboard": "false"}
    train(_cfg(tmp_path, "files", steps="1", **over), echo=lambda *_: None)
    ck_path = tmp_path / "files" / "checkpoint.pt"

    def resume_fails(changed, msg, path=train_f):
        path.write_text("".join(json.dumps(r) + "\n" for r in changed))
        kept = {f: (tmp_path / "files" / f).read_bytes() for f in ("checkpoint.pt",
                                                                   "metrics.jsonl",
                                                                   "config.json")}
        with pytest.raises(ValueError, match=r"(?s)cannot resume .*files/checkpoint\.pt: "
                                             + msg) as e:
            train(_cfg(tmp_path, "files", steps="2", **over), resume=True, echo=lambda *_: None)
        assert is_user_error(e.value)
        assert {f: (tmp_path / "files" / f).read_bytes() for f in kept} == kept

    other = {"question": "Zed has 9 pens and loses 1. How many pens?", "answer": "#### 8"}
    resume_fails(rows + [other], r"the training data changed since it was written \(data\."
                                 r"train_path .*train\.jsonl\): .*4 examples.*now 5")
    renamed = [{**r, "question": r["question"].replace("Tom", "Tim")} for r in rows]
    resume_fails(renamed, r"the training data changed since it was written \(data\.train_path "
                          r".*train\.jsonl\): .*other content")
    train_f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the held-out set ("before RL" was measured on it): another problem in other words (the
    # reduced vocabulary changes too), or in the same words
    changed = r"the held-out set changed since it was written \(data\.eval_path .*eval\.jsonl: 1 "
    zoe = [{"question": "Zoe has 2 cats and gets 3 more. How many cats?", "answer": "#### 5"}]
    resume_fails(zoe, changed, path=eval_f)
    resume_fails([{"question": "Ann has 3 cats and gets 2 more. How many cats?",
                   "answer": "#### 5"}], changed, path=eval_f)
    state = ckpt.load(ck_path)       # older checkpoints: no record of the held-out set, and of
    del state["heldout"]             # the data cursor's content: the reduced vocabulary, which
    del state["sampler"]["content"]  # follows the held-out set's words too, catches it
    ckpt.save_atomic(state, ck_path)
    resume_fails(zoe, r"agent qwen3's tokenizer \(\d+ tokens\) is not the one its weights "
                      r"were trained with .*train\.jsonl", path=eval_f)
    eval_f.write_text(json.dumps({"question": "Ann has 2 cats and gets 3 more. How many cats?",
                                  "answer": "#### 5"}) + "\n")
    state = ckpt.load(ck_path)       # and one that records no tokenizers either
    del state["tokenizers"]
    ckpt.save_atomic(state, ck_path)
    resume_fails(rows[:3] + [other], r"agent qwen3's weights do not fit its policy .*"
                                     r"size mismatch")


def test_resume_after_an_agents_chat_template_changed_is_refused(tmp_path):
    """The checkpoint records how each agent's tokenizer turns text into ids (chat template,
    BOS, an HF tokenizer.json's rules), apart from what its ids mean: a resume after a chat
    template edited in the tokenizer folder (the same vocabulary; before, the steps after it
    trained on prompts the steps before never saw, silently) is a one-line error naming the
    agent and the likely cause, the run dir kept; with accept_encoding_change (a template
    fixed on purpose) it goes on, says so and records the step and agent in the checkpoints
    after it; an unchanged tokenizer resumes, and so does a checkpoint written before the
    record (not checked)."""
    import dataclasses
    import shutil

    from hacpo.engine.errors import is_user_error
    from hacpo.models import tokenizer as tokmod
    folder = tmp_path / "qwen3-files"
    shutil.copytree(tokmod.tokenizer_path("qwen3"), folder)
    cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false",
               **{"agents.1.policy.tokenizer": str(folder)})
    cfg = dataclasses.replace(cfg, agents=cfg.agents[:2])        # char and qwen3: faster
    train(cfg, echo=lambda *_: None)
    ck_path = tmp_path / "run" / "checkpoint.pt"
    assert len(set(ckpt.load(str(ck_path))["encodings"])) == 2
    train(cfg, resume=True, echo=lambda *_: None)              # unchanged: resumes
    was = ckpt.load(str(ck_path))["encodings"]
    conf = folder / "tokenizer_config.json"
    spec = json.loads(conf.read_text())
    spec["chat_template"] = spec["chat_template"].replace("<|im_start|>", "<|im_start|>" * 2)
    conf.write_text(json.dumps(spec))
    tokmod._load_hf.cache_clear()                  # as a new process reads the folder again
    kept = {f: (tmp_path / "run" / f).read_bytes() for f in ("checkpoint.pt", "metrics.jsonl")}
    longer = cfg.override({"steps": 2})
    with pytest.raises(ValueError, match=r"^cannot resume .*run/checkpoint\.pt: agent qwen3's "
                                         r"prompts are not encoded as when its weights were "
                                         r"trained: the chat template .* of its tokenizer "
                                         r"'qwen3-files' changed since the checkpoint .*"
                                         r"transformers / tokenizers upgrade\?\); restore "
                                         r"the tokenizer files .*, pass "
                                         r"--accept-encoding-change qwen3 to go on with the "
                                         r"encoding of now, or start a new run") as e:
        train(longer, resume=True, echo=lambda *_: None)
    assert is_user_error(e.value) and "\n" not in str(e.value)
    # another agent's change accepted by name: qwen3's is still refused
    with pytest.raises(ValueError, match=r"^cannot resume .*: agent qwen3's prompts .*pass "
                                         r"--accept-encoding-change qwen3 to go on") as e2:
        train(longer, resume=True, accept_encoding_change=["char"], echo=lambda *_: None)
    assert is_user_error(e2.value)
    for names, why in ((["nosuch"], r"--accept-encoding-change 'nosuch': not an agent of this "
                                    r"run \(its agents: char, qwen3\)"),
                       (["qwen3", "qwen3"], "names an agent more than once: qwen3 qwen3"),
                       ([], "an empty list of agents")):
        with pytest.raises(ValueError, match=why):
            train(longer, resume=True, accept_encoding_change=names, echo=lambda *_: None)
    assert {f: (tmp_path / "run" / f).read_bytes() for f in kept} == kept
    said = []
    train(longer, resume=True, accept_encoding_change=["qwen3", "char"], echo=said.append)
    assert "[resume] --accept-encoding-change char: agent char's prompts are encoded as at " \
           "the checkpoint (nothing to accept)" in said
    assert [s for s in said if s.startswith("[warn]") and "encoded" in s] == [
        f"[warn] {str(e.value).split(': ', 1)[1].split('; restore')[0]}: accepted "
        f"(--accept-encoding-change): from step 1 on, agent qwen3 trains on prompts encoded "
        f"by its tokenizer as it is now"]
    state = ckpt.load(str(ck_path))
    assert state["step"] == 2 and state["encoding_changes"] == [{"agent": "qwen3", "step": 1}]
    assert state["encodings"][0] == was[0] and state["encodings"][1] != was[1]
    said = []       # the new encoding is the checkpoint's now; the record goes on
    train(cfg.override({"steps": 3}), resume=True, accept_encoding_change=True,
          echo=said.append)
    assert "[resume] --accept-encoding-change: every agent's prompts are encoded as at the " \
           "checkpoint (nothing to accept)" in said
    state = ckpt.load(str(ck_path))
    assert state["step"] == 3 and state["encoding_changes"] == [{"agent": "qwen3", "step": 1}]
    from hacpo.engine.export import export_checkpoint     # the export's provenance
    export_checkpoint(str(tmp_path / "run"), str(tmp_path / "out"), tokenizer=False,
                      echo=lambda *_: None)
    assert [json.loads((tmp_path / "out" / a / "hacpo_export.json").read_text())[
        "encoding_changes"] for a in ("char", "qwen3")] == [[], [1]]
    with pytest.raises(ValueError, match=r"^accept_encoding_change \(--accept-encoding-change"
                                         r"\) applies to a resume only"):
        train(cfg.override({"out_dir": str(tmp_path / "new")}), accept_encoding_change=True,
              echo=lambda *_: None)
    assert not (tmp_path / "new").exists()
    spec["chat_template"] = spec["chat_template"].replace("<|im_start|>" * 2, "<|im_start|>")
    conf.write_text(json.dumps(spec))
    tokmod._load_hf.cache_clear()
    state = ckpt.load(str(ck_path))        # a checkpoint of older code: no record, no check
    del state["encodings"]
    ckpt.save_atomic(state, str(ck_path))
    train(cfg.override({"steps": 4}), resume=True, echo=lambda *_: None)
    assert ckpt.load(str(ck_path))["step"] == 4


def test_encoding_refusal_names_every_agent_it_refuses_and_the_flag_for_every_change(
        monkeypatch):
    """Two or more agents whose prompts are encoded otherwise than at the checkpoint: the
    refusal gives the first agent's reason, names the other refused agents, and the flag it
    suggests takes every change found (an agent accepted by name included, its change taken
    again); the names are shell-quoted. Nothing is recorded in the state when it refuses;
    accepted (every agent by name, or True), each change is said and added to the record of
    the changes accepted before."""
    from hacpo.engine import build
    from hacpo.engine.trainer import _check_encodings
    changed = [("a b", "agent a b's prompts changed"), ("c", "agent c's prompts changed"),
               ("d", "agent d's prompts changed")]
    monkeypatch.setattr(build, "encoding_mismatches", lambda state, policies: list(changed))
    state = {"step": 5, "encoding_changes": [{"agent": "c", "step": 2}]}
    for accept, first, others in ((False, "a b", "c, d"), (("c",), "a b", "d"),
                                  (("a b", "d"), "c", None)):
        with pytest.raises(ValueError) as e:
            _check_encodings(state, [], "run/checkpoint.pt", accept, lambda *_: None)
        msg = str(e.value)
        assert msg.startswith(f"cannot resume run/checkpoint.pt: agent {first}'s prompts "
                              f"changed"), msg
        assert (f" (and agent(s) {others});" in msg) == (others is not None), msg
        assert "pass --accept-encoding-change 'a b' c d to go on" in msg, msg
    assert state == {"step": 5, "encoding_changes": [{"agent": "c", "step": 2}]}
    for accept in (("a b", "c", "d"), True):      # by name, or a bare flag: every agent
        said, taken = [], {**state, "encoding_changes": list(state["encoding_changes"])}
        _check_encodings(taken, [], "run/checkpoint.pt", accept, said.append)
        assert [s.split(":")[0] for s in said] == [f"[warn] agent {n}'s prompts changed"
                                                   for n in ("a b", "c", "d")]
        assert taken["encoding_changes"] == [{"agent": "c", "step": 2}] + [
            {"agent": n, "step": 5} for n in ("a b", "c", "d")]    # the earlier one kept


def test_resume_rewrites_metrics_atomically_and_drops_a_cut_last_row(tmp_path, monkeypatch):
    """On resume at step s, metrics.jsonl loses its rows of steps >= s through a new file
    renamed over the old one: a full disk while it is written leaves the old file whole (the
    rows before s are never lost). A last row cut short (the interrupted run's last write) is
    dropped; another unreadable row is an error naming the file and line, the file kept."""
    import re

    from hacpo.engine import metrics

    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "reward/a": 0.5}) + "\n" for s in range(3))
    path.write_text(rows)

    def disk_full(fd):          # the new file's data cannot reach the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        metrics.MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    monkeypatch.undo()
    assert path.read_text() == rows and os.listdir(tmp_path) == ["metrics.jsonl"]

    path.write_text(rows + '{"step": 3, "reward/a')          # cut short by a full disk
    metrics.MetricsLogger(str(tmp_path), start_step=3, tensorboard=False).log(3, {"reward/a": 1})
    assert [r["step"] for r in metrics.read_metrics(str(path))] == [0, 1, 2, 3]

    bad = rows.replace('"step": 1,', '"step": 1')
    path.write_text(bad)
    with pytest.raises(ValueError, match=re.escape(f"{path}:line 2 is not a metrics row")):
        metrics.MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    assert path.read_text() == bad
    # a byte that is no UTF-8 (a damaged file): named by file and line too, not only the byte
    # offset of a bare UnicodeDecodeError; a last row cut inside a character is a cut row
    damaged = rows.encode().replace(b'0.5}\n{"step": 2', b'0.5}\n{"s\xfftep": 2')
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=re.escape(f"{path}:line 3 is not a metrics row "
                                                   f"(UnicodeDecodeError: ")):
        metrics.MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    assert path.read_bytes() == damaged
    path.write_bytes(rows.encode() + '{"step": 3, "x": "\u00e9'.encode()[:-1])
    metrics.MetricsLogger(str(tmp_path), start_step=3, tensorboard=False).close()
    assert [r["step"] for r in metrics.read_metrics(str(path))] == [0, 1, 2]


def test_a_refused_resume_keeps_a_finished_runs_summary_and_a_dangling_checkpoint_link_is_named(
        tmp_path):
    """A resume refused for an unreadable metrics row removed the finished run's summary.json
    first (the run then read as unfinished: `hacpo compare` trained it again). A checkpoint.pt
    that is a link to a file that is not there (a volume not mounted) was taken for no
    checkpoint: the run started over, replacing its results."""
    over = {"plots": "false", "tensorboard": "false"}
    train(_cfg(tmp_path, steps="1", **over), echo=lambda *_: None)
    run = tmp_path / "run"
    summary = (run / "summary.json").read_bytes()
    rows = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text("{" + rows)
    with pytest.raises(ValueError, match="metrics.jsonl:line 1 is not a metrics row"):
        train(_cfg(tmp_path, steps="2", **over), resume=True, echo=lambda *_: None)
    assert (run / "summary.json").read_bytes() == summary
    (run / "metrics.jsonl").write_text(rows)
    (run / "checkpoint.pt").rename(tmp_path / "moved.pt")
    (run / "checkpoint.pt").symlink_to(tmp_path / "volume" / "checkpoint.pt")
    for resume in (True, False):
        with pytest.raises(FileNotFoundError, match=r"checkpoint\.pt is a symbolic link to "
                                                    r".*volume/checkpoint\.pt, which does "
                                                    r"not exist"):
            train(_cfg(tmp_path, steps="2", **over), resume=resume, echo=lambda *_: None)
        assert (run / "summary.json").read_bytes() == summary
        assert (run / "metrics.jsonl").read_text() == rows
        assert (run / "checkpoint.pt").is_symlink()


def test_vllm_engines_for_decoder_agents_fail_before_any_work(tmp_path):
    cfg = _cfg(tmp_path, "v", **{"rollout.engine": "vllm"})
    with pytest.raises(ValueError, match=r"agent 0 \('char'\) is kind 'decoder'"):
        train(cfg, echo=lambda *_: None)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "v").exists()   # no warm-up


def test_resumed_run_keeps_the_ratio_log(tmp_path):
    """ratio_histograms.npz (the ratio histograms' counts) of a run resumed after 2 of 4 steps
    equals the uninterrupted run's: the counts up to the checkpoint come back with it. The
    checkpoint holds counts over fixed bins, not every sample's ratio: its ratio record is the
    same size after 2 steps as after 4 (it grew by every sample of every step, in memory and in
    each checkpoint: ~1.3 GB after 10k steps of 512 prompts x G=16, 2 agents). A checkpoint of
    older code holds the ratios themselves: they are counted on resume."""
    import numpy as np

    from hacpo.engine.plots import RATIO_EDGES, ratio_counts

    over = {"plots": "true", "tensorboard": "false"}
    train(_cfg(tmp_path, "straight", steps="4", **over), echo=lambda *_: None)
    train(_cfg(tmp_path, "resumed", steps="2", **over), echo=lambda *_: None)
    half = ckpt.load(str(tmp_path / "resumed" / "checkpoint.pt"))
    train(_cfg(tmp_path, "resumed", steps="4", **over), resume=True, echo=lambda *_: None)
    want = np.load(tmp_path / "straight" / "ratio_histograms.npz")
    got = np.load(tmp_path / "resumed" / "ratio_histograms.npz")
    assert sorted(got.files) == sorted(want.files) and "edges" in want.files
    assert np.array_equal(want["edges"], RATIO_EDGES)
    full = ckpt.load(str(tmp_path / "straight" / "checkpoint.pt"))
    assert "ratio_log" not in full and full["ratio_hist"].keys() == half["ratio_hist"].keys()
    # each learner's histograms count its own samples: every self / cross sample it trained on
    # (train/<name>/{self,cross}_count of each step's metrics row), filed under its own name
    rows = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    names = [a.policy.name for a in _cfg(tmp_path).agents]
    for name in names:
        for part in ("self", "cross"):
            n = sum(r[f"train/{name}/{part}_count"] for r in rows)
            key = f"{name}/{part}"
            assert (int(want[key].sum()) if key in want.files else 0) == n, (key, n)
    assert {k.split("/")[0] for k in want.files if k != "edges"} == set(names)
    for key in set(want.files) - {"edges"}:
        assert np.array_equal(got[key], want[key]), key
        assert want[key].shape == (80,) and want[key].sum() > 0, key
        assert half["ratio_hist"][key].shape == full["ratio_hist"][key].shape == (80,), key
        assert half["ratio_hist"][key].sum() <= full["ratio_hist"][key].sum(), key
    assert 0 < sum(c.sum() for c in half["ratio_hist"].values()) < sum(
        c.sum() for c in full["ratio_hist"].values())     # steps 3 and 4 added samples
    # an older checkpoint's raw ratios: counted on resume, as if the run had counted them
    rng = np.random.default_rng(0)
    raw = {key: torch.from_numpy(rng.normal(0, 0.3, int(c.sum())))
           for key, c in half["ratio_hist"].items()}
    old = {k: v for k, v in half.items() if k != "ratio_hist"}
    old["ratio_log"] = raw
    ckpt.save_atomic(old, str(tmp_path / "resumed" / "checkpoint.pt"))
    train(_cfg(tmp_path, "resumed", steps="4", **over), resume=True, echo=lambda *_: None)
    got = np.load(tmp_path / "resumed" / "ratio_histograms.npz")
    for key in raw:
        added = want[key] - half["ratio_hist"][key].numpy()
        assert np.array_equal(got[key], ratio_counts(raw[key].numpy()) + added), key


def test_zero_steps_and_no_held_out_set(tmp_path):
    """steps=0 evaluates the warm start only (plots of an empty run, no crash); data.eval_size=0
    trains without held-out evaluation (summary: None per agent)."""
    s0 = train(_cfg(tmp_path, "s0", steps="0", tensorboard="false"), echo=lambda *_: None)
    assert (tmp_path / "s0" / "metrics.jsonl").read_text() == ""
    assert s0["steps"] == 0 and s0["after"] == s0["before"]   # no step: the same weights
    # the warm start is a checkpoint: hacpo eval scores it, --resume trains on from it
    state = ckpt.load(str(tmp_path / "s0" / "checkpoint.pt"))
    assert state["step"] == 0 and state["eval_before"] == s0["before"]
    s0b = train(_cfg(tmp_path, "s0", steps="1", tensorboard="false"), resume=True,
                echo=lambda *_: None)
    assert s0b["before"] == s0["before"] and ckpt.load(str(tmp_path / "s0" /
                                                           "checkpoint.pt"))["step"] == 1
    assert [json.loads(l)["step"] for l in open(tmp_path / "s0" / "metrics.jsonl")] == [0]
    said = []
    s1 = train(_cfg(tmp_path, "noeval", **{"steps": "1", "tensorboard": "false",
                                           "data.eval_size": "0", "eval_every": "1"}),
               echo=said.append)
    assert "[eval] no held-out set (data.eval_size=0): held-out evaluation skipped" in said
    assert s1["before"] == s1["after"] == {"char": None, "qwen3": None, "llama": None}
    rows = [json.loads(l) for l in open(tmp_path / "noeval" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0] and not any(k.startswith("eval/") for k in rows[0])


@register_reward("_test_out_of_range", in_process=True, overwrite=True)
def _bad_reward(response, gold):
    return 1.5


@register_reward("_test_raises", in_process=True, overwrite=True)
def _raising_reward(response, gold):
    raise RuntimeError("boom")


def test_reward_out_of_range_names_prompt_and_agent(tmp_path):
    cfg = _cfg(tmp_path, **{"reward.name": "_test_out_of_range", "steps": "1",
                            "agents.0.warmup.steps": "0", "agents.1.warmup.steps": "0",
                            "agents.2.warmup.steps": "0"})
    with pytest.raises(ValueError, match=r"item \d+.*prompt \d+, agent char"):
        train(cfg, echo=lambda *_: None)


def test_raising_reward_counts_zero(tmp_path):
    cfg = _cfg(tmp_path, **{"reward.name": "_test_raises", "steps": "1", "plots": "false"})
    train(cfg, echo=lambda *_: None)
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["reward_fn/errors"] == row["reward_fn/total"] > 0
    assert row["reward/char"] == 0.0


def test_bad_dataset_row_error_and_skip(tmp_path):
    good = {"question": "What is 2+2?", "answer": "2+2=4 #### 4"}
    train_f = tmp_path / "train.jsonl"
    train_f.write_text("\n".join(json.dumps(r) for r in
                                 [good, {"question": "no answer here"}, good]) + "\n")
    eval_f = tmp_path / "eval.jsonl"
    eval_f.write_text(json.dumps(good) + "\n")
    over = {"data.task": "files", "data.train_path": str(train_f),
            "data.eval_path": str(eval_f), "steps": "1", "plots": "false",
            "agents.0.policy.tokenizer": "char", "agents.1.policy.tokenizer": "char",
            "agents.2.policy.tokenizer": "char", "agents.1.policy.reduce_vocab": "false",
            "agents.2.policy.reduce_vocab": "false"}
    with pytest.raises(ValueError, match=r"train\.jsonl:line 2"):
        train(_cfg(tmp_path, **over), echo=lambda *_: None)
    train(_cfg(tmp_path, name="skip", **{**over, "data.skip_bad_rows": "true"}),
          echo=lambda *_: None)


def test_prompt_too_long_for_a_policy_is_a_user_error_before_any_work(tmp_path):
    """A training prompt that leaves no room for rollout.max_new_tokens in an agent's max_len
    (here one long row of a file dataset; char: one token per character) stopped the run with
    a traceback at the step that drew it, after the warm-up and the steps before (a resume
    drew it again). Now: an error naming the agent, the example and the lengths, before the
    warm-up."""
    from hacpo.engine.errors import is_user_error
    short = {"question": "What is 2+2?", "answer": "2+2=4 #### 4"}
    train_f = tmp_path / "train.jsonl"
    train_f.write_text("\n".join(json.dumps(r) for r in
                                 [short, {**short, "question": "What is 2+2? " * 12}, short])
                       + "\n")
    eval_f = tmp_path / "eval.jsonl"
    eval_f.write_text(json.dumps(short) + "\n")
    over = {"data.task": "files", "data.train_path": str(train_f),
            "data.eval_path": str(eval_f), "steps": "4", "prompts_per_step": "1",
            "plots": "false", "tensorboard": "false"}
    with pytest.raises(ValueError, match=r"agent 'char' \(agents\.0\): 1 of 3 training "
                                         r"\(.*train\.jsonl\) prompts do not fit its "
                                         r"max_len=128 with rollout\.max_new_tokens=12 "
                                         r".*example 'train:2', has 163 prompt tokens") as e:
        train(_cfg(tmp_path, **over), echo=lambda *_: None)
    assert is_user_error(e.value)
    assert not (tmp_path / "cache").exists()          # before the warm-up
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # held-out prompts with the evaluation's own number of new tokens
    with pytest.raises(ValueError, match=r"1 of 1 held-out \(.*eval\.jsonl\) prompts .*"
                                         r"eval_max_new_tokens=120"):
        train(_cfg(tmp_path, name="ev", **{**over, "data.train_path": str(eval_f),
                                           "eval_max_new_tokens": "120"}),
              echo=lambda *_: None)


def test_prompt_a_tokenizer_cannot_spell_names_agent_example_and_template(tmp_path):
    """A template with characters outside a fixed character set (tiny3's char agent under
    data.template=boxed: a backslash) stopped the run with the tokenizer's bare message; now
    the error names the agent, the example and the template, before the warm-up and before
    the run dir gets a config.json."""
    from hacpo.engine.errors import is_user_error
    with pytest.raises(ValueError, match=r"^agent 'char' \(agents\.0\): the training prompt of "
                                         r"example '[^']+' \(data\.template='boxed'\) cannot be "
                                         r"tokenized: tokenizer 'char': character '\\\\'") as e:
        train(_cfg(tmp_path, **{"data.template": "boxed"}), echo=lambda *_: None)
    assert is_user_error(e.value)
    assert not (tmp_path / "cache").exists()          # before the warm-up
    assert not (tmp_path / "run" / "config.json").exists()


def test_fewer_prompts_than_minibatches_is_said_not_silent(tmp_path):
    """Minibatches split by prompt: with fewer prompts per step than minibatches the empty ones
    are no updates, e.g. tiny3 under gspo2x (4 prompts, 4 x 2 minibatches) made 4 updates of
    one prompt each, as many and as large as gspo's, with nothing said. The run now says so
    (before the warm-up); a config that makes its M updates says nothing."""
    from hacpo.engine.algorithm import split_minibatches
    from hacpo.engine.compare import with_algorithm
    from hacpo.engine.trainer import minibatch_shortfall
    cfg = with_algorithm(_cfg(tmp_path), "gspo2x", {})
    M = cfg.algorithm.num_minibatches * cfg.algorithm.minibatch_factor
    P = cfg.prompts_per_step
    assert P < M
    prompt = torch.arange(P).repeat_interleave(2 * cfg.rollout.group_size)
    mbs = split_minibatches(prompt, torch.ones_like(prompt, dtype=torch.bool), M, "mixed",
                            torch.Generator().manual_seed(0))
    assert len(mbs) == P                      # what the note says happens
    note = minibatch_shortfall(cfg)
    assert note is not None and f"{M} minibatches per step" in note
    assert f"at most {P} updates per step, not {M}" in note and "gspo2x" in note
    assert minibatch_shortfall(_cfg(tmp_path)) is None        # hacpo: 4 prompts, 4 minibatches
    assert minibatch_shortfall(_cfg(tmp_path, **{"algorithm.minibatch_order": "self_first",
                                                 "algorithm.num_minibatches": "8"})) is None
    lines = []
    cfg = with_algorithm(_cfg(tmp_path, steps="0", plots="false", tensorboard="false",
                              **{"data.eval_size": "0"}), "gspo2x", {})
    train(cfg, echo=lines.append)
    assert lines[0] == f"[warn] {note}"


def test_groups_that_cannot_differ_are_said_to_give_no_signal(tmp_path):
    """rollout.temperature=0 with G > 1 (an agent's G responses are identical) or G = 1: a
    grpo / gspo group has one reward, zero advantages and zero gradients every step; the run
    said nothing. Now it says so before the warm-up (hacpo / naive: that only agents differ;
    a greedy pass@k: that it is avg@1)."""
    from hacpo.engine.compare import with_algorithm
    from hacpo.engine.trainer import no_signal_note
    over = {"steps": "1", "plots": "false", "tensorboard": "false", "data.eval_size": "0",
            "rollout.temperature": "0"}
    cfg = with_algorithm(_cfg(tmp_path, **over), "grpo", {})
    lines = []
    train(cfg, echo=lines.append)
    note = no_signal_note(cfg)
    assert f"[warn] {note}" in lines and "every grpo group has one reward" in note
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    for name in ("char", "qwen3", "llama"):         # what the note says: no gradient
        assert row[f"train/{name}/grad_norm"] == 0.0 and row[f"train/{name}/loss"] == 0.0
    sampled = {**over, "rollout.temperature": "0.7"}
    assert "differs only between agents" in no_signal_note(_cfg(tmp_path, **over))
    assert no_signal_note(_cfg(tmp_path, **{**over, "rollout.group_size": "1"})) is None
    assert no_signal_note(_cfg(tmp_path, **sampled)) is None
    g1 = with_algorithm(_cfg(tmp_path, **{**sampled, "rollout.group_size": "1"}), "gspo", {})
    assert "each gspo group holds one response" in no_signal_note(g1)
    assert no_signal_note(with_algorithm(_cfg(tmp_path, **sampled), "gspo", {})) is None
    assert "equal greedy avg@1" in no_signal_note(_cfg(tmp_path, **{**over,
                                                                     "eval_pass_k": "4"}))


def test_settings_a_run_never_reads_are_said(tmp_path):
    """Extreme but legal settings that changed nothing, silently: algorithm settings the
    algorithm never reads (grpo with loss.alpha / the GSPO clip: bit for bit plain grpo), a
    self_first split into more minibatches than a learner has samples (9 updates, not 64), a
    rollout.top_p so small that sampling is greedy (every group one reward)."""
    from hacpo.engine.compare import with_algorithm
    from hacpo.engine.trainer import (minibatch_shortfall, no_signal_note,
                                      unused_algorithm_note, unused_hook_note,
                                      unused_rollout_note)
    hooked = _cfg(tmp_path, **{"trainer_setup_hook": "no_such_module:setup"})
    assert unused_hook_note(hooked) == (
        "trainer_setup_hook='no_such_module:setup' runs in megatron trainer ranks only "
        "(agents.N.trainer=megatron); this run has none, so it never runs")
    assert unused_hook_note(_cfg(tmp_path)) is None
    pools = _cfg(tmp_path, **{"rollout.engines_per_agent": "4", "rollout.call_timeout_s": "60",
                              "rollout.ray_address": "10.9.9.9:6379"})
    assert unused_rollout_note(pools) == (
        "rollout.engines_per_agent=4, rollout.call_timeout_s=60.0, rollout.ray_address="
        "'10.9.9.9:6379': for the Ray / vLLM rollout pools (rollout.engine=ray or vllm, or a Ray "
        "trainer); this run samples in-process (rollout.engine=local) and never reads them")
    assert unused_rollout_note(_cfg(tmp_path)) is None
    assert unused_rollout_note(_cfg(tmp_path, **{"rollout.engine": "ray",
                                                 "rollout.engines_per_agent": "4"})) is None
    assert unused_rollout_note(_cfg(tmp_path, **{"trainer_backend": "ray",
                                                 "rollout.ray_address": "h:1"})) is None
    grpo = with_algorithm(_cfg(tmp_path), "grpo", {"loss.alpha": 0.0, "loss.self_clip_low": 0.9,
                                                  "capability.window": 1})
    assert unused_algorithm_note(grpo) == (
        "algorithm.loss.alpha=0.0, algorithm.loss.self_clip_low=0.9: algorithm grpo never "
        "reads these (the run trains as if they were not set)")
    assert unused_algorithm_note(with_algorithm(_cfg(tmp_path), "gspo", {})) is None
    assert unused_algorithm_note(_cfg(tmp_path, **{"algorithm.loss.grpo_clip_high": "0.5"})) \
        == ("algorithm.loss.grpo_clip_high=0.5: algorithm hacpo never reads this (the run "
            "trains as if it was not set)")
    sf = {"algorithm.minibatch_order": "self_first", "prompts_per_step": "1",
          "rollout.group_size": "2"}
    gspo = with_algorithm(_cfg(tmp_path, **sf, **{"algorithm.num_minibatches": "64"}), "gspo",
                          {"minibatch_order": "self_first"})
    assert "a learner has at most 2 samples a step (prompts_per_step=1 x 2 responses; " \
        "minibatch_order=self_first cuts them into pieces): at most 2 updates per step, " \
        "not 64" in minibatch_shortfall(gspo)
    hacpo = _cfg(tmp_path, **sf, **{"algorithm.num_minibatches": "6"})      # 1 x 2 x 3 agents
    assert minibatch_shortfall(hacpo) is None
    assert "at most 6 samples" in minibatch_shortfall(
        _cfg(tmp_path, **sf, **{"algorithm.num_minibatches": "7"}))
    tiny = with_algorithm(_cfg(tmp_path, **{"rollout.top_p": "0.001", "eval_pass_k": "4"}),
                          "gspo", {})
    note = no_signal_note(tiny, vocab=562)
    assert note.startswith("rollout.top_p=0.001 <= 1/562 (the largest agent vocabulary): "
                           "nucleus sampling keeps the most likely token alone") and \
        "(every gspo group has one reward" in note and "eval_pass_k=4's samples" in note
    assert no_signal_note(tiny, vocab=1001) is None      # 0.001 > 1/1001: a second token fits
    lines = []
    train(with_algorithm(_cfg(tmp_path, "warned", steps="0", plots="false",
                              tensorboard="false", **{"data.eval_size": "0",
                                                      "rollout.top_p": "0.001"}),
                         "grpo", {"loss.alpha": 0.0}), echo=lines.append)
    warned = [ln for ln in lines if ln.startswith("[warn]")]
    assert warned[0].startswith("[warn] algorithm.loss.alpha=0.0: algorithm grpo never reads")
    assert warned[1].startswith("[warn] rollout.top_p=0.001 <= 1/562 (the largest agent "
                                "vocabulary)")


def test_unknown_tokenizer_path_is_clear_error(tmp_path):
    cfg = _cfg(tmp_path, **{"agents.1.policy.tokenizer": str(tmp_path / "nope")})
    with pytest.raises(FileNotFoundError, match="nope"):
        train(cfg, echo=lambda *_: None)


def test_nonfinite_updates_are_skipped_then_stop():
    from hacpo.engine import preset
    from hacpo.engine.pool import LearnerView
    from hacpo.engine.update import NonFiniteUpdateError, update_learner

    class NaNPolicy(torch.nn.Module):
        name = "nan"

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def response_logprobs(self, prompts, resps, temperature=1.0):
            T = max(len(r) for r in resps)
            return self.w * torch.full((len(resps), T), float("nan")), \
                torch.ones(len(resps), T, dtype=torch.bool)

    pol = NaNPolicy()
    opt = torch.optim.SGD(pol.parameters(), lr=0.1)
    view = LearnerView(torch.arange(4), torch.ones(4), torch.ones(4), torch.ones(4, dtype=torch.bool),
                       [[1]] * 4, [[2, 3]] * 4, {})
    state = {"streak": 0, "total": 0}
    algo = preset("gspo", {"num_minibatches": 2})
    m = update_learner(algo, pol, opt, view, lp_old=torch.zeros(4), old_token_logp=[],
                       prompt_of_sample=torch.tensor([0, 0, 1, 1]),
                       generator=torch.Generator().manual_seed(0), micro_batch=8, grad_clip=1.0,
                       nonfinite=state, max_nonfinite=3)
    assert m["skipped_updates"] == 2 and state == {"streak": 2, "total": 2, "agents": {"nan": 2}}
    assert pol.w.item() == 1.0   # no update applied
    with pytest.raises(NonFiniteUpdateError, match="3 non-finite updates in a row"):
        update_learner(algo, pol, opt, view, lp_old=torch.zeros(4), old_token_logp=[],
                       prompt_of_sample=torch.tensor([0, 0, 1, 1]),
                       generator=torch.Generator().manual_seed(0), micro_batch=8,
                       grad_clip=1.0, nonfinite=state, max_nonfinite=3)


def test_drawn_minibatches_and_replayed_streak_equal_one_agent_after_another():
    """What lets Ray trainer actors update at once: update_learner on minibatches drawn
    beforehand (ray_trainer.draw_minibatches) is the generator path's update, and a later
    agent's trace, run from a streak of 0 and replayed into the run's counters
    (replay_nonfinite), raises where one agent after another would, with the same message."""
    from hacpo.engine import preset
    from hacpo.engine.pool import LearnerView
    from hacpo.engine.update import NonFiniteUpdateError, replay_nonfinite, update_learner
    from hacpo.launch.ray_trainer import draw_minibatches

    class Lin(torch.nn.Module):
        """log-prob of every token = w * (token id) - 1, or NaN with ``nan``."""
        def __init__(self, name, nan=False):
            super().__init__()
            self.name, self.nan = name, nan
            self.w = torch.nn.Parameter(torch.tensor(0.1))

        def response_logprobs(self, prompts, resps, temperature=1.0):
            T = max(len(r) for r in resps)
            ids = torch.tensor([r + [0] * (T - len(r)) for r in resps], dtype=torch.float)
            out = self.w * ids * 0.01 - 1.0
            return (out * float("nan") if self.nan else out), torch.ones(len(resps), T,
                                                                          dtype=torch.bool)

    n = 8
    view = LearnerView(torch.arange(n), torch.linspace(-1, 1, n), torch.ones(n),
                       torch.tensor([True] * 4 + [False] * 4), [[1]] * n,
                       [[2 + j, 3] for j in range(n)], {})
    prompt = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    algo = preset("gspo", {"num_minibatches": 2})
    kw = dict(lp_old=torch.full((n,), -1.0), old_token_logp=[], micro_batch=8, grad_clip=1.0,
              max_nonfinite=3)
    pool = type("P", (), {"prompt": prompt})()
    cfg = type("C", (), {"algorithm": algo})()

    def run(drawn: bool, seed=5):
        pol, gen = Lin("a"), torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(pol.parameters(), lr=0.5)
        trace: list = []
        extra = (dict(minibatches=draw_minibatches(cfg, view, pool, gen), generator=None,
                      prompt_of_sample=None, trace=trace) if drawn
                 else dict(generator=gen, prompt_of_sample=prompt))
        m = update_learner(algo, pol, opt, view, nonfinite={"streak": 0, "total": 0},
                           **kw, **extra)
        return m, pol.w.item(), gen.get_state(), trace

    (m0, w0, g0, _), (m1, w1, g1, trace) = run(False), run(True)
    assert m0 == m1 and w0 == w1 != 0.1 and torch.equal(g0, g1)   # same draws, same update
    assert [t["finite"] for t in trace] == [True, True]
    other = run(True, seed=6)[3]               # other draws: other updates (the check can fail)
    assert [t["loss"] for t in other] != [t["loss"] for t in trace]

    # NaN agents: agent a's 2 updates leave a streak of 2; agent b then stops at its first
    def nan_update(name, state, trace=None):
        pol = Lin(name, nan=True)
        return update_learner(algo, pol, torch.optim.SGD(pol.parameters(), lr=0.1), view,
                              generator=torch.Generator().manual_seed(0),
                              prompt_of_sample=prompt, nonfinite=state, trace=trace, **kw)

    seq = {"streak": 0, "total": 0}
    nan_update("a", seq)
    with pytest.raises(NonFiniteUpdateError) as one_after_another:
        nan_update("b", seq)
    run_state = {"streak": 0, "total": 0}
    nan_update("a", run_state)
    b_trace: list = []
    nan_update("b", {"streak": 0, "total": 0}, b_trace)   # b at once: its own streak only
    assert [t["finite"] for t in b_trace] == [False, False]
    with pytest.raises(NonFiniteUpdateError) as replayed:
        replay_nonfinite(b_trace, run_state, 3, "b")
    assert str(replayed.value) == str(one_after_another.value)
    assert "3 non-finite updates in a row for policy 'b'" in str(replayed.value)
    assert run_state == seq == {"streak": 3, "total": 3, "agents": {"a": 2, "b": 1}}
    fresh = {"streak": 0, "total": 0}                    # from 0: counted, no error
    replay_nonfinite(b_trace, fresh, 3, "b")
    assert fresh == {"streak": 2, "total": 2, "agents": {"b": 2}}


def test_engine_metrics_flattens_counters():
    """Rollout engine counters reach the metrics whatever their shape: the Ray pool's totals as
    they are, vLLM's per-agent-and-engine lists summed; per-actor mappings are left out."""
    from hacpo.engine.trainer import engine_metrics

    ray_like = {"restarts": 2, "restarts_per_actor": {"a": [1, 1]}, "retried_calls": 3}
    assert engine_metrics(ray_like) == {"rollout/restarts": 2.0, "rollout/retried_calls": 3.0}
    vllm_like = {"restarts": [[0, 1], [2]], "timeouts": [[0], [1]], "versions": [3, 4]}
    assert engine_metrics(vllm_like) == {"rollout/restarts": 3.0, "rollout/timeouts": 1.0,
                                         "rollout/versions": 7.0}
    assert engine_metrics({"flag": True, "name": "x", "mixed": [1, "a"]}) == {}


@register_reward("trainer_test_length", in_process=True)
def _length_reward(response: str, gold: str) -> float:
    """Untrained tiny policies almost never answer right: a reward that varies with the
    response length gives the groups non-zero advantages, so the losses are not all 0."""
    return (len(response) % 5) / 4.0


def test_fused_lm_head_run_equals_logits_run(tmp_path, monkeypatch):
    """agents.N.policy.lm_head=fused (every agent) trains to the same metrics as the default
    "logits" path: the same rollouts (sampling does not use it) and the same log-probs and
    gradients up to float rounding (~1e-7 in a log-prob), which the step's 4 AdamW minibatch
    updates carry into the losses and ratios at well under 1e-4 relative."""
    quiet = dict(echo=lambda *_: None)
    over = {"steps": "1", "plots": "false", "tensorboard": "false",
            "reward.name": "trainer_test_length"}
    train(_cfg(tmp_path, "logits", **over), **quiet)
    cfg = _cfg(tmp_path, "fused", **over)
    cfg = cfg.override({f"agents.{k}.policy.lm_head": "fused" for k in range(len(cfg.agents))})
    assert {a.policy.lm_head for a in cfg.agents} == {"fused"}
    import hacpo.kernels
    calls = []
    kernel = hacpo.kernels.fused_linear_token_logprobs
    monkeypatch.setattr(hacpo.kernels, "fused_linear_token_logprobs",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    train(cfg, **quiet)
    assert calls, "the fused path never ran"
    a, b = ([json.loads(line) for line in open(tmp_path / n / "metrics.jsonl")]
            for n in ("logits", "fused"))
    keys = [k for k in a[0] if k.startswith(("train/", "reward/", "tokens/"))]
    assert any(k.endswith("/loss") for k in keys) and keys
    for k in keys:
        assert b[0][k] == pytest.approx(a[0][k], rel=1e-4, abs=1e-6), k
    assert any(abs(a[0][k]) > 1e-3 for k in keys if k.endswith("/loss")), "vacuous check"


def test_eval_engine_rollout_equals_trainer(tmp_path, monkeypatch):
    """eval_engine="rollout": the held-out responses come from the rollout engine (here the
    local one, the same sampler on the same policies), so the greedy accuracies before, during
    (eval_every) and after training, and the sampled avg@k / pass@k after it (the engine's
    generator seeded as the in-process one), equal eval_engine="trainer"'s, and training is
    unchanged; every greedy request went to the engine."""
    from hacpo.engine import rollout as ro
    quiet = dict(echo=lambda *_: None)
    over = {"steps": "2", "eval_every": "1", "plots": "false", "tensorboard": "false",
            "eval_pass_k": "4"}
    calls = []
    gen = ro.LocalRolloutEngine.generate
    monkeypatch.setattr(ro.LocalRolloutEngine, "generate", lambda self, k, p, **kw: (
        calls.append((k, len(p), kw["temperature"])) or gen(self, k, p, **kw)))
    a = train(_cfg(tmp_path, "trainer", **over), **quiet)
    assert calls and all(t == 1.0 for _, _, t in calls)       # training rollouts only
    calls.clear()
    b = train(_cfg(tmp_path, "rollout", eval_engine="rollout", **over), **quiet)
    greedy = [(k, n) for k, n, t in calls if t == 0.0]
    # before, after step 0 (eval_every=1; not after the last step) and after: 3 agents x 16
    assert sorted(greedy) == sorted([(k, 16) for k in range(3)] * 3)
    assert a["before"] == b["before"] and a["after"] == b["after"]
    assert any(r["pass@4"] > 0 for r in a["after"].values())    # samples that can differ
    ra, rb = ([json.loads(line) for line in open(tmp_path / n / "metrics.jsonl")]
              for n in ("trainer", "rollout"))
    assert _strip_times(ra) == _strip_times(rb)
    assert {"eval/char/accuracy", "train/char/loss"} <= set(rb[0])


def test_eval_through_the_engine_keeps_its_rng(tmp_path):
    """Sampled evaluation (pass@k at the rollout temperature) through the rollout engine draws
    from the engine's per-agent generators; they are restored afterwards, so evaluating never
    changes the training rollouts that follow."""
    from hacpo.engine import build
    from hacpo.engine.agents import build_agents
    from hacpo.engine.rewards import RewardComputer
    from hacpo.engine.trainer import evaluate_all

    cfg = _cfg(tmp_path, eval_engine="rollout", **{"data.eval_size": "4"})
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    agents, engine = build_agents(cfg, policies), build.rollout_engine(cfg, policies)
    start = [s.clone() for s in engine.state_dict()["generators"]]
    seen = []
    gen = engine.generate

    def spy(k, prompts, **kw):
        out = gen(k, prompts, **kw)
        seen.append(torch.equal(engine.generators[k].get_state(), start[k]))
        return out

    engine.generate = spy
    with RewardComputer(cfg.reward.name, num_workers=0) as rc:
        out = evaluate_all(cfg, data, agents, engine, rc, pass_k=2)
    assert set(out) == {"char", "qwen3", "llama"} and all("pass@2" in r for r in out.values())
    assert False in seen, "the sampled evaluation never drew from the engine's generators"
    assert all(torch.equal(s, e) for s, e in zip(start, engine.state_dict()["generators"]))


def test_second_run_in_a_run_dir_in_use_is_an_error_and_a_killed_run_frees_it(tmp_path):
    """Two runs in one run dir at once (a second `hacpo train`, or `--resume` while the first
    still runs) once both ran, interleaving their rows in one metrics.jsonl and overwriting
    each other's checkpoints. The second is refused before it writes anything; the run dir's
    lock dies with its process (kill -9), so the resume after a kill starts."""
    out = tmp_path / "run"
    common = ["--preset", "tiny3", "--out-dir", str(out), "--set", "threads=1", "steps=1",
              f"cache_dir={tmp_path / 'cache'}", "plots=false", "tensorboard=false"]
    proc = subprocess.Popen([sys.executable, "-m", "hacpo.launch.cli", "train"] + common,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "config.json").exists() and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the first run ended before the second started"
        config = (out / "config.json").read_text()
        cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false")
        for resume in (False, True):
            with pytest.raises(RuntimeError, match=f"{out} is in use by another hacpo run "
                                                   f"\\(process [^ ]+:{proc.pid},"):
                train(cfg, resume=resume, echo=lambda *_: None)
        assert (out / "config.json").read_text() == config
    finally:
        proc.kill()
        proc.wait()
    train(cfg, resume=True, echo=lambda *_: None)
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0]


def test_restart_without_checkpoint_purges_the_killed_runs_tensorboard_steps(tmp_path):
    """A run killed before its first checkpoint starts again at step 0 (`--resume` with no
    checkpoint.pt); its TensorBoard scalars must not show the killed run's steps as well."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hacpo.engine.metrics import MetricsLogger, read_metrics

    first = MetricsLogger(str(tmp_path), start_step=0)
    for step, v in ((0, 0.1), (1, 0.2)):
        first.log(step, {"reward/a": v})
    first.close()
    time.sleep(1.1)            # a later events file (TensorBoard names them by the second)
    again = MetricsLogger(str(tmp_path), start_step=0)
    again.log(0, {"reward/a": 0.7})
    again.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert [(e.step, round(e.value, 3)) for e in ea.Scalars("reward/a")] == [(0, 0.7)]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0]


def test_resume_removes_the_metrics_rewrite_temp_of_a_killed_writer(tmp_path, caplog):
    """A run killed while its resume rewrote metrics.jsonl leaves that temp file; the next
    resume's rewrite removes it (a live writer's is kept), as a checkpoint save does."""
    import socket

    from hacpo.engine.metrics import MetricsLogger, read_metrics

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = tmp_path / f".tmp-metrics.jsonl.{host}.{dead.pid}.rewrite"
    live = tmp_path / f".tmp-metrics.jsonl.{host}.{os.getppid()}.rewrite"
    left.write_text('{"step": 0}\n')
    with held_lock(live):     # a live writer: it holds its temp file's lock
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                                        for s in range(3)))
        from hacpo.engine.checkpoint import FRESH_S
        old = time.time() - 2 * FRESH_S          # left long ago (a fresh file is kept)
        for p in (left, live):
            os.utime(p, (old, old))
        with caplog.at_level("WARNING"):
            MetricsLogger(str(tmp_path), start_step=2, tensorboard=False).close()
        assert sorted(os.listdir(tmp_path)) == sorted(["metrics.jsonl", live.name])
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 1]
    assert "died mid-save" in caplog.text and left.name in caplog.text


def test_summary_is_written_after_the_plots(tmp_path, monkeypatch):
    """summary.json marks a finished run (`hacpo compare` skips a run holding one): a run that
    dies while writing its plots must not leave one, and its resume writes plots and summary."""
    from hacpo.engine import plots

    def dies(out_dir, names):
        assert not (tmp_path / "run" / "summary.json").exists()
        raise KeyboardInterrupt        # e.g. Ctrl-C (or a kill) while the plots are written

    monkeypatch.setattr(plots, "plot_run", dies)
    cfg = _cfg(tmp_path, steps="1", tensorboard="false")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, echo=lambda *_: None)
    assert not (tmp_path / "run" / "summary.json").exists()
    monkeypatch.undo()
    train(cfg, resume=True, echo=lambda *_: None)
    for f in ("summary.json", "ratio_histograms.npz", "reward_curves.png"):
        assert (tmp_path / "run" / f).exists(), f
    assert not [n for n in os.listdir(tmp_path / "run") if n.startswith(".tmp-")]


def test_a_plot_that_fails_does_not_hide_a_finished_run(tmp_path, monkeypatch):
    """A plot error (e.g. a matplotlib backend) after the run finished is reported, and
    summary.json is still written (else `hacpo compare` would resume and fail it forever)."""
    from hacpo.engine import plots

    def broken(out_dir, names):
        raise RuntimeError("no backend")

    monkeypatch.setattr(plots, "plot_run", broken)
    said = []
    summary = train(_cfg(tmp_path, steps="1", tensorboard="false"), echo=said.append)
    assert summary["plots_error"] == "RuntimeError: no backend"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["plots_error"] == \
        "RuntimeError: no backend"
    assert any(line.startswith("[plots] not written: RuntimeError: no backend") for line in said)


_OTHER_HOST_HOLDER = r"""
import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.lockf(f.fileno(), fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write("some-dead-node:4242\n"); f.flush()
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_run_dir_locked_from_another_host_is_waited_for(tmp_path, monkeypatch):
    """A lock held from another host (a node that died holding it keeps it on NFS until its
    lease ends) is waited for up to HACPO_RUN_LOCK_WAIT_S: taken once it is freed, an error
    naming the holder and the wait if it is not."""
    from hacpo.engine.trainer import RUN_LOCK, RUN_LOCK_WAIT_ENV, lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    for hold_s, wait_s, frees in ((60, 1.5, False), (1.0, 30, True)):
        holder = subprocess.Popen([sys.executable, "-c", _OTHER_HOST_HOLDER,
                                   str(run / RUN_LOCK), str(hold_s)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            monkeypatch.setenv(RUN_LOCK_WAIT_ENV, str(wait_s))
            t0 = time.monotonic()
            if frees:
                lock_run_dir(str(run)).close()          # taken once the holder ended
                assert 0.5 < time.monotonic() - t0 < 25
            else:
                with pytest.raises(RuntimeError, match=r"in use by another hacpo run \(process "
                                                       r"some-dead-node:4242, .*still held "
                                                       r"after 1.5 s"):
                    lock_run_dir(str(run))
                assert time.monotonic() - t0 >= 1.4
        finally:
            holder.kill()
            holder.wait()


def test_relative_data_paths_are_stored_absolute(tmp_path, monkeypatch):
    """A run started with relative data paths names its files by absolute path in config.json
    and the checkpoint: `hacpo export` (which rebuilds the reduced vocabulary from the training
    data) works from another directory. A checkpoint written with relative paths (before they
    were stored absolute) still resumes from the directory it was started in."""
    from hacpo.engine.export import export_checkpoint
    launch = tmp_path / "launch"
    launch.mkdir()
    rows = [{"question": f"Tom has {a} apples and gets {b} more. How many apples?",
             "answer": f"#### {a + b}"} for a, b in ((1, 2), (3, 4), (2, 5), (4, 4))]
    (launch / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {"data.task": "files", "data.train_path": "train.jsonl",
            "data.eval_path": "train.jsonl", "data.eval_size": "2", "plots": "false",
            "tensorboard": "false", "out_dir": "runs/r"}
    monkeypatch.chdir(launch)
    cfg = _cfg(tmp_path, steps="1", **over)
    train(cfg, echo=lambda *_: None)
    assert cfg.data.train_path == "train.jsonl"         # the caller's config is not edited
    run = launch / "runs" / "r"
    from hacpo.engine.compare import _finished_with     # compare reuses it as finished
    assert _finished_with(str(run), cfg)
    stored = json.loads((run / "config.json").read_text())["data"]
    want = str(launch / "train.jsonl")
    assert (stored["train_path"], stored["eval_path"]) == (want, want)
    state = ckpt.load(str(run / "checkpoint.pt"))
    assert state["fingerprint"]["data"]["train_path"] == want
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    export_checkpoint(str(run), str(tmp_path / "exported"), agents=["qwen3"], tokenizer=False,
                      echo=lambda *_: None)
    assert (tmp_path / "exported" / "qwen3" / "config.json").is_file()
    # an older checkpoint: relative paths in its fingerprint, read from the launch directory
    state["fingerprint"]["data"]["train_path"] = "train.jsonl"
    state["fingerprint"]["data"]["eval_path"] = "train.jsonl"
    ckpt.save_atomic(state, str(run / "checkpoint.pt"))
    monkeypatch.chdir(launch)
    train(_cfg(tmp_path, steps="2", **over), resume=True, echo=lambda *_: None)
    assert [json.loads(ln)["step"] for ln in open(run / "metrics.jsonl")] == [0, 1]


def test_extending_a_finished_run_keeps_its_final_eval_point(tmp_path):
    """A finished run resumed for more steps: its final held-out evaluation (at its last step,
    kept in the summary.json the longer run replaces) was lost; it goes to the metrics row of
    that step, where an uninterrupted run of the longer length evaluates."""
    over = {"plots": "false", "tensorboard": "false", "eval_every": "2"}
    train(_cfg(tmp_path, "ref", steps="4", **over), echo=lambda *_: None)
    train(_cfg(tmp_path, "ext", steps="2", **over), echo=lambda *_: None)
    first = json.loads((tmp_path / "ext" / "summary.json").read_text())["after"]
    train(_cfg(tmp_path, "ext", steps="4", **over), resume=True, echo=lambda *_: None)
    ref = [json.loads(ln) for ln in open(tmp_path / "ref" / "metrics.jsonl")]
    got = [json.loads(ln) for ln in open(tmp_path / "ext" / "metrics.jsonl")]
    assert [sorted(k for k in r if k.startswith("eval/")) for r in got] == \
        [[], sorted(f"eval/{n}/accuracy" for n in ("char", "qwen3", "llama")), [], []]
    assert {k: v for k, v in got[1].items() if k.startswith("eval/")} == \
        {f"eval/{n}/accuracy": first[n]["accuracy"] for n in first}
    assert _strip_times(got) == _strip_times(ref)


def test_a_run_gives_back_the_callers_torch_thread_count(tmp_path):
    """train(threads=1) left torch at 1 thread for the rest of the process: a later run with
    threads=0 ("torch's default") ran on 1 (and its metrics differed from a fresh process)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(_cfg(tmp_path, steps="0", plots="false", tensorboard="false",
                   **{"data.eval_size": "0"}), echo=lambda *_: None)      # threads=1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_warm_up_examples_longer_than_max_len_are_an_error_before_it(tmp_path):
    """The warm-up trains on prompt + worked solution + EOS: a max_len the prompts fit but
    those do not stopped the warm-up mid-way with no example named (which one depends on
    the batch drawn). Checked with the prompts, before any work; warmup.steps=0 runs."""
    over = {"data.difficulty": "medium", "steps": "0", "plots": "false",
            "tensorboard": "false", "data.eval_size": "0",
            **{f"agents.{k}.policy.max_len": "140" for k in range(3)}}
    with pytest.raises(ValueError, match=r"agent 'char' \(agents.0\): \d+ of 200 training "
                                         r"examples do not fit its max_len=140 in the warm-up, "
                                         r"which trains on the prompt \+ worked solution \+ EOS "
                                         r"\(the longest, example 'arith-train-.*', has \d+ "
                                         r"tokens\)"):
        train(_cfg(tmp_path, **over), echo=lambda *_: None)
    assert not (tmp_path / "run").exists()
    no_warmup = {**over, **{f"agents.{k}.warmup.steps": "0" for k in range(3)}}
    train(_cfg(tmp_path, "nw", **no_warmup), echo=lambda *_: None)


def test_a_second_run_of_one_process_in_a_run_dir_in_use_is_an_error(tmp_path):
    """POSIX record locks are per process: a second train() in the same process (two threads,
    a notebook) took the run dir's lock again, both runs wrote one metrics.jsonl (steps 0, 0,
    1, 1), and the second's close() dropped the first's lock."""
    import threading

    from hacpo.engine.trainer import lock_run_dir
    run = tmp_path / "run"
    first = lock_run_dir(str(run))
    errors = []

    def second():
        try:
            lock_run_dir(str(tmp_path / "." / "run"))     # the same folder by another spelling
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=second)
    t.start()
    t.join()
    assert len(errors) == 1 and "is in use by another hacpo run in this process" in errors[0]
    with pytest.raises(RuntimeError, match="in use by another hacpo run in this process"):
        train(_cfg(tmp_path, steps="1"), echo=lambda *_: None)
    assert not (run / "metrics.jsonl").exists()
    first.close()
    lock_run_dir(str(run)).close()                        # free again once closed


def test_a_config_edited_in_place_is_checked_again_before_any_work(tmp_path):
    """A TrainConfig's checks ran only when it was made: ``cfg.agents[0].optim.lr = -1`` after
    loading went through the warm-up into torch's own "Invalid learning rate" mid-run (a run
    dir made); ``cfg.prompts_per_step = 0`` likewise. Now each is the loader's error, before
    the run dir exists; a value a loader coerces (``"1"``) is coerced, the caller's object
    untouched."""
    from hacpo.engine.run_config import TrainConfig
    cfg = _cfg(tmp_path)
    cfg.agents[0].optim.lr = -1.0
    with pytest.raises(ValueError, match=r"agents\.0\): optim\.lr must be a finite number > 0"):
        train(cfg, echo=lambda *_: None)
    cfg = _cfg(tmp_path)
    cfg.prompts_per_step = 0
    with pytest.raises(ValueError, match="prompts_per_step"):
        train(cfg, echo=lambda *_: None)
    assert not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="expected a TrainConfig, got dict"):
        train(cfg.to_dict(), echo=lambda *_: None)
    cfg = _cfg(tmp_path, steps="0", eval_every="0")
    cfg.steps = "1"            # as a loader would take it
    assert isinstance(cfg, TrainConfig) and train(cfg, echo=lambda *_: None)["steps"] == 1
    assert cfg.steps == "1"


def test_a_stopped_run_says_where_resume_goes_on(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM save no checkpoint: the steps logged after the last one run again on
    --resume, and their metrics rows are dropped — neither was said ("continue it with
    --resume" only). The stop names the checkpoint's step and the steps that run again; the
    resume names the rows it drops."""
    import hacpo.engine.trainer as trainer_mod
    cfg = _cfg(tmp_path, steps="4", checkpoint_every="2", plots="false", tensorboard="false",
               **{"data.eval_size": "0"})
    real, calls = trainer_mod.generate_agents, []

    def stop_in_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)
    said = []
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "generate_agents", stop_in_step_3)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, echo=said.append)
    assert said[-1] == ("[stop] the last checkpoint is at step 2 (checkpoint_every=2): "
                        "--resume runs step 2 again")
    said = []
    train(cfg, resume=True, echo=said.append)
    assert ("[resume] metrics.jsonl's row of step 2, logged after the checkpoint, is dropped: "
            "step 2 runs again") in said
    rows = [json.loads(l)["step"] for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows == [0, 1, 2, 3]
    said = []
    with monkeypatch.context() as m:     # stopped in its first step: no checkpoint yet
        m.setattr(trainer_mod, "generate_agents", lambda *a, **k: (_ for _ in ()).throw(
            KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            train(cfg.override({"out_dir": str(tmp_path / "new")}), echo=said.append)
    assert said[-1] == "[stop] no checkpoint yet: --resume starts the run over"
    assert trainer_mod._stopped_note(4, 4, 2) == ("[stop] the last checkpoint is at step 4: "
                                                  "--resume goes on from there")
    assert trainer_mod._stopped_note(10, 15, 10).endswith("--resume runs steps 10-14 again")
    assert trainer_mod._steps([8, 3, 5, 3]) == "steps 3, 5, 8"


def test_a_stop_while_the_checkpoint_is_written_names_that_checkpoint(tmp_path, monkeypatch):
    """A Ctrl-C held while checkpoint.pt is written (it takes effect once the file is whole)
    came out of the save: the [stop] line named the checkpoint before, not the one written."""
    import hacpo.engine.trainer as trainer_mod
    cfg = _cfg(tmp_path, steps="3", checkpoint_every="1", plots="false", tensorboard="false",
               **{"data.eval_size": "0"})
    real = trainer_mod._save

    def stopped_once_written(path, cfg, next_step, *a):
        real(path, cfg, next_step, *a)
        if next_step == 2:
            raise KeyboardInterrupt        # as the held signal is raised: the file is whole
    monkeypatch.setattr(trainer_mod, "_save", stopped_once_written)
    said = []
    with pytest.raises(KeyboardInterrupt):
        train(cfg, echo=said.append)
    assert said[-1] == "[stop] the last checkpoint is at step 2: --resume goes on from there"
    assert ckpt.load(str(tmp_path / "run" / "checkpoint.pt"))["step"] == 2


def test_a_stop_request_checkpoints_the_step_and_the_resume_goes_on(tmp_path, monkeypatch):
    """request_stop() (SIGUSR1 in `hacpo train`: Slurm's --signal before a time limit) stops
    the run at the end of its step with a checkpoint there, whatever checkpoint_every says
    (Ctrl-C / SIGTERM lose the steps since the last one); the resume goes on from it and the
    run equals one never stopped. Asked during the evaluation before RL: a checkpoint at step
    0 (the warm-up and that evaluation are not redone). A request that came after the last
    checkpoint (the evaluation after RL) is left for the caller."""
    import hacpo.engine.trainer as trainer_mod
    from hacpo.engine.signals import (RunStopped, clear_stop_request, request_stop,
                                      stop_requested)
    cfg = _cfg(tmp_path, steps="4", checkpoint_every="100", plots="false", tensorboard="false",
               **{"data.eval_size": "4"})
    real, calls = trainer_mod.generate_agents, []

    def asked_in_step_2(*a, **k):
        calls.append(1)
        if len(calls) == 2:            # step 1 (0-based) runs, then the run stops
            request_stop()
        return real(*a, **k)
    said = []
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "generate_agents", asked_in_step_2)
        with pytest.raises(RunStopped) as e:
            train(cfg, echo=said.append)
    assert e.value.step == 2 and not stop_requested()
    assert said[-1] == ("[stop] stop requested: the checkpoint at step 2 is written; --resume "
                        "goes on from there")
    run = tmp_path / "run"
    assert ckpt.load(str(run / "checkpoint.pt"))["step"] == 2
    assert [json.loads(l)["step"] for l in open(run / "metrics.jsonl")] == [0, 1]
    assert not (run / "summary.json").exists()
    said = []
    stopped = train(cfg, resume=True, echo=said.append)
    assert "[resume] " + str(run / "checkpoint.pt") + " at step 2" in said
    assert not any("dropped" in line for line in said), said
    whole = train(cfg.override({"out_dir": str(tmp_path / "whole")}), echo=lambda *_: None)
    assert stopped["after"] == whole["after"] and stopped["before"] == whole["before"]
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    ref = [json.loads(l) for l in open(tmp_path / "whole" / "metrics.jsonl")]
    assert _strip_times(rows) == _strip_times(ref)

    def ask_before_rl(line):           # during the held-out evaluation before RL
        said.append(line)
        if line.startswith("[eval] held-out accuracy before RL"):
            request_stop()
    said = []
    with pytest.raises(RunStopped) as e:
        train(cfg.override({"out_dir": str(tmp_path / "early")}), echo=ask_before_rl)
    assert e.value.step == 0
    assert ckpt.load(str(tmp_path / "early" / "checkpoint.pt"))["step"] == 0
    assert not (tmp_path / "early" / "metrics.jsonl").exists() or \
        (tmp_path / "early" / "metrics.jsonl").read_text() == ""
    said = []
    train(cfg.override({"out_dir": str(tmp_path / "early"), "steps": 1}), resume=True,
          echo=said.append)
    assert not any("before RL ..." in line for line in said), said   # measured once

    def ask_after_rl(line):            # too late for this run: it finishes; the request stays
        if line.startswith("[eval] held-out accuracy after RL"):   # for the caller (compare)
            request_stop()
    done = train(cfg.override({"out_dir": str(tmp_path / "late"), "steps": 1}),
                 echo=ask_after_rl)
    assert done["steps"] == 1 and stop_requested()
    clear_stop_request()


def test_compare_stops_between_runs_on_a_request_its_last_run_was_too_late_for(tmp_path,
                                                                               monkeypatch):
    """A stop request (SIGUSR1) during a compare run's evaluation after RL (its checkpoint is
    written) stops the compare before the next run, which is not started (it trained to its
    end, losing what it did since its last checkpoint at the time limit)."""
    import hacpo.engine.trainer as trainer_mod
    from hacpo.engine.compare import run_compare
    from hacpo.engine.signals import RunStopped, request_stop, stop_requested
    real, calls = trainer_mod.evaluate_all, []

    def asked_after_rl(*a, **k):          # the first run's evaluations: before RL, after RL
        calls.append(1)
        if len(calls) == 2:
            request_stop()
        return real(*a, **k)
    monkeypatch.setattr(trainer_mod, "evaluate_all", asked_after_rl)
    cfg = _cfg(tmp_path, steps="1", plots="false", tensorboard="false",
               **{"data.eval_size": "4"})
    root = tmp_path / "cmp"
    with pytest.raises(RunStopped) as e:
        run_compare(cfg, ["grpo", "hacpo"], [0], str(root), echo=lambda *_: None)
    assert e.value.step is None and not stop_requested()
    assert (root / "grpo-seed0" / "summary.json").exists()
    assert not (root / "hacpo-seed0").exists()


def test_a_resume_without_plots_leaves_no_plots_of_the_run_before(tmp_path):
    """A finished run resumed for more steps with plots=false kept the earlier run's PNGs and
    ratio histograms, which then looked like this run's; they go with its summary.json (a
    resume at the last step, which changes nothing, keeps them)."""
    from hacpo.engine.plots import PLOT_FILES
    cfg = _cfg(tmp_path, steps="1", tensorboard="false", **{"data.eval_size": "0"})
    train(cfg, echo=lambda *_: None)
    run = tmp_path / "run"
    assert all((run / f).exists() for f in PLOT_FILES)
    train(cfg.override({"plots": False}), resume=True, echo=lambda *_: None)   # nothing to do
    assert all((run / f).exists() for f in PLOT_FILES)
    train(cfg.override({"plots": False, "steps": 2}), resume=True, echo=lambda *_: None)
    assert not any((run / f).exists() for f in PLOT_FILES)
    assert (run / "summary.json").exists()


def _lengths_case(rows, max_len=128):
    """tiny3's char agent alone (a tokenizer that counts its prompt_ids calls) and a training
    set of ``rows`` (question, answer), the first also held out, for check_prompt_lengths."""
    from types import SimpleNamespace

    from hacpo.engine.build import Data
    from hacpo.engine.data import Example
    from hacpo.models.tokenizer import CharTokenizer

    class Counting(CharTokenizer):
        calls = 0

        def prompt_ids(self, question, *, errors="strict"):
            Counting.calls += 1
            return super().prompt_ids(question, errors=errors)

    cfg = load_config("tiny3")
    examples = [Example(f"x{i}", q, a, "t") for i, (q, a) in enumerate(rows)]
    data = Data(train=examples, eval=examples[:1], worked=False, load_stats={})
    return cfg, data, [SimpleNamespace(name="char", max_len=max_len, tokenizer=Counting())]


def test_the_warm_up_check_counts_each_training_prompt_once():
    """The warm-up check counted the training prompts' tokens again, after the prompt check
    had (a pass over the dataset per agent: ~15 s at 50k rows); now it reuses them."""
    from hacpo.engine.trainer import check_prompt_lengths
    rows = [(f"What is {i % 5} + 1?", str(i % 5 + 1)) for i in range(12)]
    cfg, data, policies = _lengths_case(rows)
    assert cfg.agents[0].warmup.steps > 0
    check_prompt_lengths(cfg, data, policies)
    assert policies[0].tokenizer.calls == 5 + 1       # distinct training prompts + held-out


@pytest.mark.parametrize("chunk", [4096, 2])
def test_length_checks_name_the_first_bad_example_whatever_the_chunk(chunk, monkeypatch):
    """The length checks encode the dataset in chunks (prompt_ids_batch, response_ids_batch):
    a prompt or warm-up target the tokenizer cannot spell, or one too long, is named as when
    the checks went one example at a time (the first such example; the longest)."""
    import hacpo.models.tokenizer as tokmod
    from hacpo.engine.trainer import check_prompt_lengths
    monkeypatch.setattr(tokmod, "ENCODE_CHUNK", chunk)
    good = [(f"What is {i} + 1?", str(i + 1)) for i in range(8)]

    def fails(rows, max_len=128):
        with pytest.raises(ValueError) as e:
            check_prompt_lengths(*_lengths_case(rows, max_len))
        return str(e.value)

    bad_prompt = list(good)
    bad_prompt[3] = ("caf\u00e9?", "1")
    bad_prompt[6] = ("\u2615?", "1")
    assert re.match(r"agent 'char' \(agents\.0\): the training prompt of example 'x3' .*"
                    r"character '\u00e9' at position 6", fails(bad_prompt))
    bad_target = list(good)
    bad_target[5] = ("What is 5 + 1?", "\u2615")
    bad_target[7] = ("What is 7 + 1?", "caf\u00e9")
    assert re.match(r"agent 'char' \(agents\.0\): the warm-up target of example 'x5' cannot "
                    r"be tokenized: .*'\u2615' at position 5", fails(bad_target))
    long_target = list(good)
    long_target[2] = ("What is 2 + 1?", "3" * 20)
    long_target[4] = ("What is 4 + 1?", "5" * 25)
    long_target[6] = ("What is 6 + 1?", "7" * 25)
    assert re.match(r"agent 'char' \(agents\.0\): 3 of 8 training examples do not fit its "
                    r"max_len=40 in the warm-up, .*the longest, example 'x6', has 53 tokens",
                    fails(long_target, max_len=40))


def test_a_run_resumes_over_its_data_files_moved(tmp_path):
    """Run and data copied to another machine or mount: the resume was refused ("the config
    differs from the checkpoint's in data.train_path") with no way to name the new place. The
    checkpoint's record of the data's content is what is checked now; a checkpoint without
    that record still refuses a path that changed."""
    from hacpo.engine import checkpoint as ckpt
    rows = [{"question": f"Tom has {a} apples and gets {b} more. How many apples?",
             "answer": f"#### {a + b}"} for a, b in ((1, 2), (3, 4), (2, 5), (4, 4))]
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    (old / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (old / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")

    def cfg(where, steps):
        return _cfg(tmp_path, "files", steps=steps, plots="false", tensorboard="false",
                    **{"data.task": "files", "data.train_path": str(where / "train.jsonl"),
                       "data.eval_path": str(where / "eval.jsonl")})
    train(cfg(old, "1"), echo=lambda *_: None)
    old.rename(new)
    said = []
    train(cfg(new, "2"), resume=True, echo=said.append)
    assert ckpt.load(str(tmp_path / "files" / "checkpoint.pt"))["step"] == 2
    stored = json.loads((tmp_path / "files" / "config.json").read_text())
    assert stored["data"]["train_path"] == str(new / "train.jsonl")
    ck = tmp_path / "files" / "checkpoint.pt"
    state = ckpt.load(str(ck))
    del state["sampler"]["content"]       # a checkpoint written before the record
    ckpt.save_atomic(state, str(ck))
    new.rename(old)
    with pytest.raises(ValueError, match=r"the config differs from the checkpoint's in "
                                         r"data\.eval_path.*data\.train_path"):
        train(cfg(old, "3"), resume=True, echo=lambda *_: None)
