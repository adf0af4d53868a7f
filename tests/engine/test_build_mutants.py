"""What `hacpo.engine.build` does that its other tests left unchecked (a mutation audit): the
settings each agent's warm-up gets and what its cache keys on, the cached states it refuses,
the data errors' and warnings' details, and the checks of a checkpoint's tokenizers and of
folders named at a new place. Most call build's functions directly; the warm-up itself is a
stand-in (no training)."""
import dataclasses
import errno
import json
import logging
import os

import pytest
import torch

from hacpo.engine import build
from hacpo.engine.data import DataError

from ._cases import char_policy
from .test_warm_start_cache import EVAL, TRAIN, _cached, _cfg, _warm, _write


@pytest.fixture
def fake_warmup(monkeypatch):
    """supervised_warmup replaced by a stand-in that records its inputs, reports each step to
    ``progress`` and returns the losses [1.0, ..., 0.5] (one per step): the list of calls."""
    calls = []

    def fake(pol, prompts, targets, *, steps, progress=None, **kw):
        calls.append({"policy": pol.name, "prompts": prompts, "targets": targets,
                      "steps": steps, **kw})
        for s in range(steps):
            progress(s, 1.0)
        return [1.0] * (steps - 1) + [0.5]
    monkeypatch.setattr(build, "supervised_warmup", fake)
    return calls


def _files(tmp_path):
    return _write(tmp_path / "d.jsonl", TRAIN), _write(tmp_path / "e.jsonl", EVAL)


# -- the warm-up and its cache -------------------------------------------------------------------

def test_each_agent_warms_up_with_its_own_settings(tmp_path, fake_warmup):
    """warmup.lr (not optim.lr), warmup.batch_size, the batch seed policy.seed + 101 * k,
    micro_batch; prompts as the tokenizer encodes the templated questions, targets ending in
    EOS; an agent with warmup.steps=0 gets none."""
    cfg = _cfg(tmp_path, *_files(tmp_path), **{
        "micro_batch": "3", "agents.0.warmup.lr": "0.002", "agents.0.warmup.batch_size": "5",
        "agents.1.warmup.lr": "0.0007", "agents.1.warmup.batch_size": "2",
        "agents.1.policy.seed": "9"})
    char = cfg.agents[0]
    cfg.agents.append(dataclasses.replace(
        char, policy=dataclasses.replace(char.policy, name="char2"),
        warmup=dataclasses.replace(char.warmup, steps=0)))
    out, pols, _ = _warm(cfg)
    assert out[2] == {"steps": 0} and [c["policy"] for c in fake_warmup] == ["char", "qwen3"]
    data = build.load_data(cfg)
    for k, (call, pol) in enumerate(zip(fake_warmup, pols)):
        a = cfg.agents[k]
        assert (call["steps"], call["lr"], call["batch_size"], call["seed"],
                call["micro_batch"]) == (2, [0.002, 0.0007][k], [5, 2][k],
                                         [1, 9 + 101][k], 3)
        tok = pol.tokenizer
        assert call["prompts"] == [tok.prompt_ids(build.prompt_text(cfg, e)) for e in data.train]
        assert call["targets"] == [tok.response_ids(data.target_text(e), add_eos=True)
                                   for e in data.train]
        assert all(t[-1] == tok.eos_id for t in call["targets"])
        assert a.optim.lr != call["lr"]


def test_a_cached_warm_start_reports_its_final_loss_and_progress_names_the_last_step(
        tmp_path, fake_warmup):
    cfg = _cfg(tmp_path, *_files(tmp_path), n_agents=1, **{"agents.0.warmup.steps": "12"})
    first, _, lines = _warm(cfg)
    assert first == [{"steps": 12, "cached": False, "final_loss": 0.5}]
    # every 12 // 5 = 2nd step, and the last (step 12, odd)
    assert [ln.split(" loss")[0] for ln in lines] == [
        f"[warm-up] char: step {s}/12" for s in (1, 3, 5, 7, 9, 11, 12)]
    again, _, lines = _warm(cfg)
    assert again == [{"steps": 12, "cached": True, "final_loss": 0.5}], lines
    assert len(fake_warmup) == 1


def test_cache_follows_the_initial_weights_and_a_cut_batch(tmp_path, fake_warmup):
    """The same config with other initial weights (e.g. an HF policy.path folder whose
    weights changed) is another warm start; so is a batch cut into micro-batches (its
    gradient sums in another order), while any micro_batch >= the batch keeps the key."""
    train, ev = _files(tmp_path)
    cfg = _cfg(tmp_path, train, ev)
    assert _cached(_warm(cfg)[0]) == [False, False]
    data = build.load_data(cfg)
    pols = build.build_policies(cfg, data)
    with torch.no_grad():
        next(pols[0].parameters()).add_(1.0)
    assert _cached(build.warm_start(cfg, data, pols, echo=lambda *_: None)) == [False, True]
    big = _cfg(tmp_path, train, ev, micro_batch="64")       # warm-up batch_size 32
    assert _cached(_warm(big)[0]) == [True, True]
    cut = _cfg(tmp_path, train, ev, micro_batch="16")
    assert _cached(_warm(cut)[0]) == [False, False]


def test_a_cached_state_that_would_not_load_as_it_was_trained_is_refused():
    """A file with an entry the policy lacks (a strict load: a traceback), another dtype (a
    load casts it silently: not the warm start that was trained) or no losses is no warm
    start of this policy."""
    pol = char_policy("p", 3)
    good = {"model": pol.state_dict(), "losses": [1.0]}
    assert build._state_misfit(good, pol) is None
    extra = {**good, "model": {**pol.state_dict(), "extra.weight": torch.zeros(2)}}
    assert build._state_misfit(extra, pol) == "missing entries [], unexpected entries " \
                                              "['extra.weight']"
    name, w = next(iter(pol.state_dict().items()))
    half = {**good, "model": {**pol.state_dict(), name: w.to(torch.bfloat16)}}
    assert build._state_misfit(half, pol) == (
        f"{name}: {list(w.shape)} torch.bfloat16 in the file, {list(w.shape)} torch.float32 "
        f"in the policy")
    assert build._state_misfit({**good, "losses": []}, pol) == \
        "not a warm-start file: no model state and losses"


def test_a_cache_file_torch_cannot_read_is_a_logged_miss(tmp_path, caplog, monkeypatch):
    from hacpo.engine import checkpoint as ckpt
    path = tmp_path / "warmup.pt"
    path.write_bytes(b"x")

    def unreadable(p):
        raise RuntimeError(f"checkpoint {p} cannot be read: truncated")
    monkeypatch.setattr(ckpt, "load", unreadable)
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        assert build._cached_warm_start(str(path), char_policy("p", 3)) is None
    assert "[warm-up] p: ignoring the cached warm start, checkpoint" in caplog.text


def test_a_reduced_vocabulary_covers_the_held_out_prompts_as_the_template_renders_them(
        tmp_path):
    """Evaluation encodes the held-out questions in the chat template: their tokens there
    (e.g. "Ann" after the template's newline) are in the vocabulary, not only the training
    questions' (a token missing: the eval before RL fails)."""
    cfg = _cfg(tmp_path, *_files(tmp_path))
    data = build.load_data(cfg)
    tok = build.build_policies(cfg, data)[1].tokenizer
    assert tok.reduced
    for e in data.eval:
        ids = tok.prompt_ids(build.prompt_text(cfg, e))       # strict: raises where not
        assert e.prompt in tok.decode(ids, skip_special=False)


# -- data ----------------------------------------------------------------------------------------

def test_held_out_file_linked_to_the_training_file_is_the_same_file(tmp_path, caplog):
    train = _write(tmp_path / "d.jsonl", TRAIN)
    os.symlink(train, tmp_path / "link.jsonl")
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        data = build.load_data(_cfg(tmp_path, train, tmp_path / "link.jsonl"))
    assert data.load_stats["eval_in_train"] == 4
    assert "4 of its 4 held-out problems" in caplog.text and "(the same file)" in caplog.text


def test_eval_size_takes_the_first_held_out_examples(tmp_path):
    train = _write(tmp_path / "d.jsonl", TRAIN)
    ev = _write(tmp_path / "e.jsonl", TRAIN[:3])
    data = build.load_data(_cfg(tmp_path, train, ev, **{"data.eval_size": "2"}))
    assert [e.prompt for e in data.eval] == [r["question"] for r in TRAIN[:2]]
    assert data.load_stats["eval"]["loaded"] == 2 and data.load_stats["eval_in_train"] == 2


def test_one_skipped_row_is_warned_and_five_are_listed_without_an_ellipsis(tmp_path, caplog):
    ev = _write(tmp_path / "e.jsonl", EVAL)
    skip = {"data.skip_bad_rows": "true"}
    for bad, listed in ((1, "at line 2; first"), (5, "at line 2, line 3, line 4, line 5, "
                                                      "line 6; first")):
        train = _write(tmp_path / "d.jsonl", TRAIN[:1] + ["{oops"] * bad + TRAIN[1:])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hacpo"):
            build.load_data(_cfg(tmp_path, train, ev, **skip))
        (warn,) = [r.getMessage() for r in caplog.records]
        assert f"4 examples from {4 + bad} rows; skipped {bad} bad rows" in warn \
            and listed in warn, warn


def test_a_file_of_bad_rows_names_the_first_three_problems(tmp_path):
    ev = _write(tmp_path / "e.jsonl", EVAL)
    bad = _write(tmp_path / "bad.jsonl", ["{oops"] * 4)
    with pytest.raises(DataError) as e:
        build.load_data(_cfg(tmp_path, bad, ev, **{"data.skip_bad_rows": "true"}))
    msg = str(e.value)
    assert "all 4 non-blank rows were bad and skipped (data.skip_bad_rows), field map auto " \
           "(detected from the first good row); first: " in msg
    assert [f"bad.jsonl:line {n}" in msg for n in (1, 2, 3, 4)] == [True, True, True, False]


def test_an_unknown_field_map_is_named_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown data\.field_map 'bogus'; one of auto, gsm8k, "
                                         r"math, math_answer, question_answer$"):
        build.load_data(_cfg(tmp_path, *_files(tmp_path), **{"data.field_map": "bogus"}))


def test_an_io_error_reading_a_data_file_names_its_key(tmp_path, monkeypatch):
    train, ev = _files(tmp_path)

    def failing(path, *a, **k):
        raise OSError(errno.EIO, "Input/output error", path)
    monkeypatch.setattr(build, "load_examples", failing)
    with pytest.raises(DataError, match=r"^data\.train_path .*d\.jsonl: cannot be read: "):
        build.load_data(_cfg(tmp_path, train, ev))


# -- policies rebuilt from a checkpoint; moved folders -------------------------------------------

def test_rebuilding_some_agents_needs_neither_the_others_folders_nor_their_data(tmp_path,
                                                                               monkeypatch):
    """`hacpo eval --agents char`: agent qwen3's model folder gone and its vocabulary to be
    reduced to the data (a checkpoint that records none) stop neither the char agent nor read
    the data; asked for, qwen3's folder is named."""
    cfg = _cfg(tmp_path, *_files(tmp_path), **{"agents.1.policy.kind": "hf",
                                               "agents.1.policy.path": str(tmp_path / "gone")})

    def no_data(*a, **k):
        raise AssertionError("the run's data was read")
    monkeypatch.setattr(build, "load_data", no_data)
    (pol,) = build.rebuild_policies(cfg, {}, ["char"], "cannot evaluate X")
    assert pol.name == "char"
    with pytest.raises(FileNotFoundError, match=r"^cannot evaluate X: agent qwen3's policy\.path "
                                                 r".*gone does not exist \(moved\? --set "
                                                 r"agents\.1\.policy\.path=NEW"):
        build.rebuild_policies(cfg, {}, ["qwen3"], "cannot evaluate X")


def _config_json(folder, **d):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return str(folder)


def test_a_model_folder_saved_again_elsewhere_is_the_same_model(tmp_path):
    a = _config_json(tmp_path / "a", hidden_size=32, _name_or_path="/x/a",
                     transformers_version="4.40.0")
    b = _config_json(tmp_path / "b", hidden_size=32, _name_or_path="/y/b",
                     transformers_version="4.57.1")
    c = _config_json(tmp_path / "c", hidden_size=64)
    assert build.model_config_digest(a) == build.model_config_digest(b) \
        != build.model_config_digest(c)


def _state(tmp_path, **policy):
    """A training checkpoint's state of one HF agent "q" (model_configs / tokenizers records
    of a folder ``tmp/old``)."""
    old = str(tmp_path / "old")
    return {"config": {"agents": [{"policy": {"name": "q", "kind": "hf", "path": old,
                                              "tokenizer": old, **policy}}]},
            "model_configs": {"q": "digest"}, "tokenizers": ["t"]}


def test_moved_folder_checks(tmp_path, monkeypatch):
    state = _state(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^agents\.0\.policy\.path=.*broken: cannot read its "
                                         r"config\.json: "):
        build.check_moved(state, 0, "q", "path", str(tmp_path / "old"), str(broken))
    # a tokenizer folder is checked against the recorded vocabulary once built: here it is
    # enough that the checkpoint records one (a record of the model folder is not asked for)
    build.check_moved({**state, "model_configs": {}}, 0, "q", "tokenizer",
                      str(tmp_path / "old"), str(broken))
    with pytest.raises(ValueError, match=r"does not record what the run's folder .*old held"):
        build.check_moved({**state, "tokenizers": []}, 0, "q", "tokenizer",
                          str(tmp_path / "old"), str(broken))
    # a relative new place is stored absolute (the run's config outlives the current dir)
    monkeypatch.chdir(tmp_path)
    stored = build.moved_config(state, {"agents.0.policy.tokenizer": "broken"}, "W")
    assert stored["agents"][0]["policy"]["tokenizer"] == str(broken)
    assert state["config"]["agents"][0]["policy"]["tokenizer"] == str(tmp_path / "old")
    with pytest.raises(ValueError, match=r"^--set agents\.0\.policy\.tokenizer: agent 0 of W "
                                         r"reads no folder there \(policy\.tokenizer='char'\)"):
        build.moved_config(_state(tmp_path, tokenizer="char"),
                           {"agents.0.policy.tokenizer": str(broken)}, "W")


def test_a_tokenizer_folder_named_with_a_trailing_slash_has_its_folders_name():
    state = {"config": {"agents": [{"policy": {"name": "q", "tokenizer": "/m/tok/"}},
                                   {"policy": {"name": "c", "tokenizer": "char"}}]}}
    assert build._recorded_tokenizer_names(state) == {"q": "tok"}


# -- a checkpoint's tokenizer records ------------------------------------------------------------

def test_the_first_agent_whose_encoding_changed_is_named():
    pols = [char_policy("a", 1), char_policy("b", 2)]
    state = {"agents": [{"name": "a"}, {"name": "b"}], "encodings": ["x", "y"]}
    assert [n for n, _ in build.encoding_mismatches(state, pols)] == ["a", "b"]
    assert build.encoding_mismatch(state, pols).startswith("agent a's prompts are not encoded")
    state["encodings"] = build.encoding_digests(pols)
    assert build.encoding_mismatch(state, pols) is None


def test_a_tokenizer_with_another_eos_is_another_tokenizer():
    from hacpo.models.tokenizer import CharTokenizer
    tok, other = CharTokenizer(), CharTokenizer()
    other.eos_id = tok.unk_id         # (the same tokens, pad and BOS)
    assert build.tokenizer_digest(other) != build.tokenizer_digest(tok)


def test_padding_saved_in_a_tokenizer_json_is_no_other_encoding():
    """hacpo's encodes never pad nor truncate: a tokenizer.json saved with padding on (common
    on the Hub) keys the warm-start cache as the same tokenizer without it; its normalizer
    does not."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer as Backend
    from tokenizers.normalizers import Lowercase

    from hacpo.models.tokenizer import CharTokenizer
    hf = CharTokenizer().to_hf()          # (an HF tokenizer of a small vocabulary)
    plain, padded = (Backend.from_str(hf.backend_tokenizer.to_str()) for _ in range(2))
    padded.enable_padding(pad_id=0, pad_token="!")
    padded.enable_truncation(max_length=6)

    def digest(backend):
        return build.encoding_digest(SimpleNamespace(hf=SimpleNamespace(
            chat_template=hf.chat_template, backend_tokenizer=backend)))
    assert digest(padded) == digest(plain)
    padded.normalizer = Lowercase()
    assert digest(padded) != digest(plain)


def test_vocab_source_names_the_eval_file_only_where_one_is_read(tmp_path):
    train, ev = _files(tmp_path)
    assert build.vocab_source(_cfg(tmp_path, train, ev)) == \
        f"data.train_path {train}, data.eval_path {ev}"
    assert build.vocab_source(_cfg(tmp_path, train, ev, **{"data.eval_size": "0"})) == \
        f"data.train_path {train}"


def test_build_policies_sets_the_configured_thread_count(tmp_path):
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = _cfg(tmp_path, *_files(tmp_path), n_agents=1)
        build.build_policies(cfg, None)                 # threads=1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        build.build_policies(dataclasses.replace(cfg, threads=0), None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_the_local_rollout_engine_gets_the_runs_seed(tmp_path):
    from hacpo.engine.rollout import agent_generators
    cfg = _cfg(tmp_path, *_files(tmp_path), n_agents=1, seed="5")
    engine = build.rollout_engine(cfg, [char_policy("char", 1)])
    assert [g.get_state().tolist() for g in engine.generators] == \
        [g.get_state().tolist() for g in agent_generators(5, 1)]


def test_which_policy_settings_name_a_folder_of_the_runs():
    """A decoder reads no policy.path (a path set there is no model folder to record or to
    look for); a tokenizer known by name is no folder."""
    assert build.is_folder("path", "/m/model", "hf")
    assert not build.is_folder("path", "/m/model", "decoder")
    assert build.is_folder("tokenizer", "/m/tok", "decoder")
    assert not any(build.is_folder("tokenizer", t) for t in ("char", "qwen3", "", None))
