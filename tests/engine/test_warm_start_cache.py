"""The supervised warm-up cache (build.warm_start) and the data a run loads (build.load_data):
the cache key follows the training examples' content and each policy's actual vocabulary (not
file paths), a cached state that does not fit the policy is retrained instead of crashing, empty
files are clear errors naming the file, skipped rows are logged, and evaluating no prompts is an
error instead of a division by zero."""
import json
import logging
import os
import shutil

import pytest
import torch

from hacpo.engine import build
from hacpo.engine import checkpoint as ckpt
from hacpo.engine.data import DataError
from hacpo.engine.evaluate import evaluate_policy
from hacpo.engine.run_config import load_config

from ._locks import held_lock

TRAIN = [{"question": f"Tom has {a} apples and gets {b} more. How many apples?",
          "answer": f"{a}+{b}={a + b}\n#### {a + b}"} for a, b in ((1, 2), (3, 4), (2, 5), (4, 4))]
EVAL = [{"question": "Ann has 2 cats and gets 3 more. How many cats?", "answer": "#### 5"}]


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _cfg(tmp_path, train, ev, n_agents=2, **over):
    """tiny3's char agent (fixed vocabulary) and qwen3 agent (vocabulary reduced to the data),
    2 warm-up steps each, on JSONL files."""
    cfg = load_config("tiny3", overrides={
        "data.task": "files", "data.train_path": str(train), "data.eval_path": str(ev),
        "cache_dir": str(tmp_path / "cache"), "out_dir": str(tmp_path / "run"), "threads": "1",
        **over})
    cfg.agents = cfg.agents[:n_agents]
    return cfg


def _warm(cfg):
    """warm_start on freshly built policies: (per-agent results, policies, echoed lines)."""
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    lines = []
    return build.warm_start(cfg, data, policies, echo=lines.append), policies, lines


def _cached(out):
    return [w["cached"] for w in out]


def test_cache_follows_training_file_contents_not_its_path(tmp_path, one_thread):
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    first, pols, _ = _warm(_cfg(tmp_path, train, ev))
    assert _cached(first) == [False, False]
    again, pols2, lines = _warm(_cfg(tmp_path, train, ev))
    assert _cached(again) == [True, True], lines
    for a, b in zip(pols, pols2):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                     b.state_dict().values()))
    # An identical copy elsewhere is the same data: the cache still hits.
    os.makedirs(tmp_path / "copy")
    copy = shutil.copy(train, tmp_path / "copy" / "other-name.jsonl")
    out, _, lines = _warm(_cfg(tmp_path, copy, ev))
    assert _cached(out) == [True, True], lines
    # Editing the training file in place (same path, same size of vocabulary for char) trains
    # again: the old warm start was fitted to other targets.
    _write(train, TRAIN[:3] + [{"question": TRAIN[3]["question"], "answer": "4+4=8\n#### 9"}])
    out, _, lines = _warm(_cfg(tmp_path, train, ev))
    assert _cached(out) == [False, False], lines


def test_cache_follows_the_reduced_vocabulary(tmp_path, one_thread):
    """Editing only the held-out file leaves the char agent's warm-up inputs as they were (its
    cache hits) but changes qwen3's reduced vocabulary, here to another of the same size: the
    cached embeddings would load without complaint and mean other tokens, so it must retrain."""
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    first, pols, _ = _warm(_cfg(tmp_path, train, ev))
    assert _cached(first) == [False, False]
    _write(ev, [{"question": EVAL[0]["question"].replace("cats", "dogs"), "answer": "#### 5"}])
    out, pols2, lines = _warm(_cfg(tmp_path, train, ev))
    old, new = pols[1].tokenizer, pols2[1].tokenizer
    assert old.vocab_size == new.vocab_size and old.token_strings() != new.token_strings()
    assert _cached(out) == [True, False], lines


def test_cache_changed_vocabulary_size_retrains_instead_of_crashing(tmp_path, one_thread):
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    _warm(_cfg(tmp_path, train, ev))
    _write(train, TRAIN + [{"question": "Zed owns 3 yachts and buys 1 more. How many yachts?",
                            "answer": "3+1=4\n#### 4"}])
    out, pols, lines = _warm(_cfg(tmp_path, train, ev))   # was: size mismatch for embed.weight
    assert _cached(out) == [False, False], lines


def test_cached_state_that_does_not_fit_is_a_logged_miss(tmp_path, caplog, one_thread):
    """A cache file whose shapes do not match the policy (or that cannot be read) is never
    loaded: a warning, then the warm-up trains again and replaces the file."""
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    cfg = _cfg(tmp_path, train, ev, n_agents=1)
    _warm(cfg)
    (path,) = [os.path.join(cfg.cache_dir, f) for f in os.listdir(cfg.cache_dir)]
    good = ckpt.load(path)
    bad = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) if v.dim() else v
           for k, v in good["model"].items()}
    ckpt.save_atomic({**good, "model": bad}, path)
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        out, pols, lines = _warm(cfg)
    assert _cached(out) == [False], lines
    assert any(path in r.getMessage() and "does not fit" in r.getMessage()
               for r in caplog.records), caplog.text
    out, _, lines = _warm(cfg)   # replaced by the retrained state
    assert _cached(out) == [True], lines

    for losses in (torch.tensor([4.4, 4.3]), ["x"]):     # (a tensor raised a traceback)
        ckpt.save_atomic({**ckpt.load(path), "losses": losses}, path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hacpo"):
            out, _, lines = _warm(cfg)
        assert _cached(out) == [False], lines
        assert any("not a warm-start file" in r.getMessage() for r in caplog.records)

    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        out, _, lines = _warm(cfg)
    assert _cached(out) == [False], lines
    assert any(path in r.getMessage() and "cannot be read" in r.getMessage()
               for r in caplog.records), caplog.text


def test_cache_key_includes_the_agent_position(tmp_path, one_thread):
    """The warm-up's batch seed is policy.seed + 101 * k: the same agent at another position
    trains on other batches, so it does not share the cache entry."""
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    cfg = _cfg(tmp_path, train, ev)
    out, _, _ = _warm(cfg)
    assert _cached(out) == [False, False]
    cfg.agents = [cfg.agents[1], cfg.agents[0]]
    out, _, lines = _warm(cfg)
    assert _cached(out) == [False, False], lines


# -- empty data ----------------------------------------------------------------------------------

def test_empty_training_file_names_the_file(tmp_path):
    ev = _write(tmp_path / "e.jsonl", EVAL)
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"data.train_path .*empty.jsonl.* no examples"):
        build.load_data(_cfg(tmp_path, empty, ev))
    bad = _write(tmp_path / "bad.jsonl", [{"q": "x", "a": "#### 1"}, "{oops"])
    with pytest.raises(DataError, match=r"bad.jsonl.*all 2 non-blank rows were bad and skipped"
                                        r".*field map gsm8k.*first.*bad.jsonl:line 1"):
        build.load_data(_cfg(tmp_path, bad, ev, **{"data.skip_bad_rows": "true",
                                                   "data.field_map": "gsm8k"}))


def test_empty_eval_file_is_an_error_but_eval_size_0_is_no_held_out_set(tmp_path):
    train = _write(tmp_path / "d.jsonl", TRAIN)
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match=r"data.eval_path .*empty.jsonl.* no examples"):
        build.load_data(_cfg(tmp_path, train, empty))
    data = build.load_data(_cfg(tmp_path, train, empty, **{"data.eval_size": "0"}))
    assert data.eval == [] and len(data.train) == 4
    assert data.load_stats["eval"] == {"path": empty, "rows": 0, "loaded": 0, "skipped": 0,
                                       "problems": [], "bad_rows": []}
    arith = load_config("tiny3", overrides={"data.eval_size": "0"})
    data = build.load_data(arith)
    assert data.eval == [] and len(data.train) == 200 and data.load_stats == {}


def test_evaluate_no_prompts_is_a_clear_error():
    from hacpo.engine.rewards import RewardComputer
    from hacpo.models.policy import PolicyConfig, build_policy

    pol = build_policy(PolicyConfig(tokenizer="char", d_model=16, n_layers=1, n_heads=2))
    with RewardComputer("math", num_workers=0) as rc:
        with pytest.raises(ValueError, match="no prompts to evaluate"):
            evaluate_policy(pol, [], [], rc, max_new_tokens=4)
        with pytest.raises(ValueError, match="1 prompts but 2 gold answers"):
            evaluate_policy(pol, [pol.tokenizer.prompt_ids("1+1?")], ["2", "3"], rc,
                            max_new_tokens=4)


# -- skipped rows are reported -------------------------------------------------------------------

def test_skipped_rows_are_logged_and_counted(tmp_path, caplog):
    train = _write(tmp_path / "d.jsonl", TRAIN[:1] + ["{oops", {"question": "q"}] + TRAIN[1:])
    ev = _write(tmp_path / "e.jsonl", EVAL)
    with caplog.at_level(logging.INFO, logger="hacpo"):
        data = build.load_data(_cfg(tmp_path, train, ev, **{"data.skip_bad_rows": "true"}))
    st = data.load_stats["train"]
    assert (st["path"], st["rows"], st["loaded"], st["skipped"]) == (train, 6, 4, 2)
    assert st["bad_rows"] == ["line 2", "line 3"] and len(st["problems"]) == 2
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and train in warn[0] and "skipped 2 bad rows" in warn[0] \
        and "line 2, line 3" in warn[0], caplog.text
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(ev in m and "1 examples" in m for m in info), caplog.text


def test_a_cache_hit_removes_a_dead_writers_temp_file(tmp_path, one_thread, caplog):
    """Two runs warm up at once into one cache_dir; one is killed mid-save after the other saved
    the file. Its temp file (the model's size) was left for good, as only a later save of that
    path removed it; a run that loads the cached file now removes it too (a live writer's
    stays)."""
    import socket
    import subprocess
    import sys
    import time

    from hacpo.engine.checkpoint import FRESH_S

    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    cfg = _cfg(tmp_path, train, ev, n_agents=1)
    _warm(cfg)
    (cached,) = os.listdir(tmp_path / "cache")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = tmp_path / "cache" / f".tmp-{cached}.{host}.{dead.pid}.abc"
    live = tmp_path / "cache" / f".tmp-{cached}.{host}.{os.getppid()}.abc"
    left.write_bytes(b"half a model")
    with held_lock(live):     # a live writer: it holds its temp file's lock
        old = time.time() - 2 * FRESH_S          # left long ago (a fresh file is kept)
        for p in (left, live):
            os.utime(p, (old, old))
        with caplog.at_level(logging.WARNING, logger="hacpo"):
            out, _, _ = _warm(cfg)
        assert _cached(out) == [True]
        assert sorted(os.listdir(tmp_path / "cache")) == sorted([cached, live.name])
    assert "died mid-save" in caplog.text and left.name in caplog.text


def test_reduced_vocabulary_covers_every_warm_up_target(tmp_path):
    """The reduction corpus held the targets of the first 5000 training examples only, while
    the warm-up encodes all of them: with llama3.2's byte-level BPE (digits merged into
    multi-digit tokens) tiny3 with data.train_size=20000 failed before training ("token '27'
    ... was not in the reduction corpus")."""
    from hacpo.engine import build
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3", overrides={"data.train_size": 20000,
                                          "cache_dir": str(tmp_path / "cache")})
    data = build.load_data(cfg)
    reduced = 0
    for a, pol in zip(cfg.agents, build.build_policies(cfg, data)):
        if a.policy.reduce_vocab:
            tok = pol.tokenizer
            assert tok.reduced, a.policy.name
            reduced += 1
            for e in data.train:
                ids = tok.response_ids(data.target_text(e), add_eos=True)
                # some content before the EOS, every id one of the reduced vocabulary's
                assert len(ids) > 1 and ids[-1] == tok.eos_id, e
                assert all(0 <= i < tok.vocab_size for i in ids), e
    assert reduced > 0      # tiny3 reduces some agent's vocabulary: the loop above ran


def test_held_out_problems_that_are_in_the_training_file_are_said(tmp_path, caplog):
    """The same file for data.train_path and data.eval_path (or an eval file cut from the
    training data) trained on the "held-out" problems without a word: a warning counts them
    (same question up to whitespace and case), and load_stats records the count."""
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL + [{"question": "  tom has 1 apples and gets 2 "
                                                            "more.   How many apples?",
                                                "answer": "#### 3"}])
    with caplog.at_level(logging.INFO, logger="hacpo"):
        data = build.load_data(_cfg(tmp_path, train, ev))
        same = build.load_data(_cfg(tmp_path, train, train))
        apart = build.load_data(_cfg(tmp_path, train, _write(tmp_path / "x.jsonl", EVAL)))
    assert (data.load_stats["eval_in_train"], same.load_stats["eval_in_train"],
            apart.load_stats["eval_in_train"]) == (1, 4, 0)
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warn == [
        f"data.eval_path {ev}: 1 of its 2 held-out problems are in data.train_path {train} too "
        f"(the same question): their accuracy after RL is not held out",
        f"data.eval_path {train}: 4 of its 4 held-out problems are in data.train_path {train} "
        f"too (the same file): their accuracy after RL is not held out"]


def test_cache_follows_how_the_tokenizer_encodes_not_only_its_vocabulary(tmp_path, one_thread):
    """A chat template (or a plain template) changed under the same tokenizer name keeps the
    vocabulary, and the cache loaded a warm start trained on other ids."""
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", EVAL)
    cfg = _cfg(tmp_path, train, ev)

    def warm(edit=None):
        data = build.load_data(cfg)
        policies = build.build_policies(cfg, data)
        if edit:
            edit(policies)
        return build.warm_start(cfg, data, policies, echo=lambda *_: None)

    assert _cached(warm()) == [False, False]
    assert _cached(warm()) == [True, True]
    hf = build.build_policies(cfg, build.load_data(cfg))[1].tokenizer.hf
    original = hf.chat_template      # (qwen3: prompts go through its chat template)
    other = original.replace("<|im_start|>", "<|im_start|>" * 2)

    def templates(char, chat):
        def edit(policies):          # (the HF tokenizer object may be shared between builds)
            policies[0].tokenizer.template = char
            policies[1].tokenizer.hf.chat_template = chat
        return edit
    assert _cached(warm(templates("Question: {question}\nAnswer: ", other))) == [False, False]
    assert _cached(warm(templates("Question: {question}\nAnswer: ", other))) == [True, True]
    assert _cached(warm(templates("Q: {question}\nA: ", original))) == [True, True]


def test_encoding_digest_values_are_stable():
    """The warm-start cache keys on encoding_digest: a change to its values (how it serializes,
    an object JSON cannot hold hashed as its repr) would make every cached warm start a miss."""
    from types import SimpleNamespace

    from hacpo.models.tokenizer import CharTokenizer

    class NotJSON:
        def __repr__(self):
            return "NotJSON<1>"
    assert build.encoding_digest(CharTokenizer()) == (
        "9958efd860fb5656af1fa355a44aec4d4b718b1bfec825a6e1670f9b56967341")
    odd = SimpleNamespace(template=NotJSON(), _use_chat=True, _add_bos=False)
    assert build.encoding_digest(odd) == (
        "c3cf6d5a815700d43744647ff9334eef3a49b27f506fc505a140d46f32ffe4fa")
