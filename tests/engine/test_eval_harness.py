"""`hacpo eval`: checkpoints of a 1-step tiny3 run evaluated on two tiny benchmarks (API + CLI),
the numbers' consistency, greedy determinism, the tokenizer fallback, and the bad-input errors."""
import json

import pytest
import torch

from hacpo.engine.data import DataError
from hacpo.engine.eval_harness import (Benchmark, evaluate_checkpoints, parse_benchmark_spec,
                                       prompt_ids_lenient)
from hacpo.engine.rewards import register_reward
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train
from hacpo.launch import cli
from hacpo.models.tokenizer import UnencodableTextError

AGENTS = ["char", "qwen3", "llama"]
LONG = "Sam has 4 cups. " + "He looks at them for a long while and counts them again. " * 3 \
       + "How many cups does Sam have?"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    cfg = load_config("tiny3", overrides={
        "out_dir": str(tmp / "run"), "cache_dir": str(tmp / "cache"), "threads": "1",
        "steps": 1, "plots": False, "tensorboard": False})
    train(cfg, echo=lambda *_: None)
    gsm = [{"question": "Eva has 9 coins. She gives away 3. Then she gets 1 more. How many "
                        "coins does Eva have?", "answer": "9-3=6, 6+1=7. #### 7"},
           {"question": "Tom has 2 pens. He gives away 2. Then he gets 5 more. How many pens "
                        "does Tom have?", "answer": "#### 5"},
           {"question": "Ann has 4 eggs. She gets 3 more. How many eggs does Ann have?",
            "answer": "4+3=7 #### 7"},
           {"question": "What is 2 + 3?", "answer": "#### 5"},
           {"question": "A café sells 3 cakes and then 2 more. How many?",   # 'é': char fallback
            "answer": "#### 1,005"},
           {"question": LONG, "answer": "#### 4"}]                         # too long for char
    math_rows = [{"problem": "Compute $1+1$.", "solution": "It is $\\boxed{2}$."},
                 {"problem": "Bob has 5 hats. He gives away 1. How many hats does Bob have?",
                  "solution": "5-1=4, so \\boxed{4}"},
                 {"problem": "What is $\\frac{6}{3}$?", "solution": "$\\boxed{2}$"},
                 {"problem": "Mia has 3 cats. She gets 2 more. How many cats does Mia have?",
                  "solution": "\\boxed{5}"},
                 {"problem": "Find $x$ if $x+1=3$.", "solution": "\\boxed{2}"},
                 {"problem": "What is 10 - 7?", "solution": "\\boxed{3}"}]
    gsm_path, math_path = tmp / "gsm.jsonl", tmp / "math.jsonl"
    gsm_path.write_text("".join(json.dumps(r) + "\n" for r in gsm))
    math_path.write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    return {"dir": tmp / "run", "tmp": tmp, "benches": [f"gsm={gsm_path}:gsm8k",
                                                          f"math={math_path}"]}


def test_api_table_json_and_determinism(run):
    out_dir = run["tmp"] / "ev1"
    rep = evaluate_checkpoints([str(run["dir"])], run["benches"], out_dir=str(out_dir),
                               echo=lambda *_: None)
    assert [r["row"] for r in rep["rows"]] == AGENTS
    lines = rep["table"].splitlines()
    header = next(l for l in lines if l.startswith("| agent"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["agent", "gsm", "math", "mean"]
    body = [l for l in lines if l.startswith("| ") and not l.startswith("| agent")]
    assert [l.split("|")[1].strip() for l in body] == AGENTS
    assert "1.96" in rep["table"] and "unencodable" in rep["table"]
    for agent in AGENTS:
        row = next(r for r in rep["rows"] if r["agent"] == agent)
        vals = []
        for bench in ("gsm", "math"):
            rec = json.loads((out_dir / f"{agent}__{bench}.json").read_text())
            assert rec["n"] == 6 and rec["samples"] == 1 and rec["temperature"] == 0.0
            assert rec["reward"] == "math" and rec["step"] == 1
            assert 0.0 <= rec["avg@1"] <= 1.0 and rec["pass@1"] >= rec["avg@1"] - 1e-12
            assert rec["ci95"] == pytest.approx(1.96 * (rec["avg@1"] * (1 - rec["avg@1"]) / 6)
                                                ** 0.5)
            assert rec["avg@1"] == pytest.approx(
                sum(p["rewards"][0] for p in rec["problems"]) / 6)
            assert row["benchmarks"][bench]["avg@1"] == rec["avg@1"]
            vals.append(rec["avg@1"])
            if rec["field_map"] == "gsm8k":
                assert [p["gold"] for p in rec["problems"]][4] == "1005"
        assert row["mean"]["avg@1"] == pytest.approx(sum(vals) / 2)
    char_gsm = json.loads((out_dir / "char__gsm.json").read_text())
    assert char_gsm["fallback"] == 1 and char_gsm["too_long"] == 1
    assert char_gsm["problems"][5]["rewards"] == [0.0] and char_gsm["problems"][5]["status"] \
        == "too_long"
    assert json.loads((out_dir / "char__math.json").read_text())["fallback"] == 1  # "\\frac"
    # greedy is deterministic: a second call gives the same responses and numbers
    rep2 = evaluate_checkpoints([str(run["dir"] / "checkpoint.pt")], run["benches"],
                                out_dir=str(run["tmp"] / "ev2"), echo=lambda *_: None)
    assert rep2["rows"] == rep["rows"]
    for agent in AGENTS:
        a = json.loads((out_dir / f"{agent}__math.json").read_text())["problems"]
        b = json.loads((run["tmp"] / "ev2" / f"{agent}__math.json").read_text())["problems"]
        assert a == b


def test_cli_samples_agents_default_out_dir(run, capsys):
    rc = cli.main(["eval", str(run["dir"]), "--bench", *run["benches"], "--agents", "qwen3",
                   "--samples", "3", "--limit", "4", "--max-new-tokens", "8"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "avg@3" in text and "pass@3" in text and "| qwen3 |" in text and "| char |" not in text
    ev = run["dir"] / "eval"
    assert sorted(p.name for p in ev.iterdir()) == ["eval.json", "eval.md", "qwen3__gsm.json",
                                                    "qwen3__math.json"]
    for bench in ("gsm", "math"):
        rec = json.loads((ev / f"qwen3__{bench}.json").read_text())
        assert rec["n"] == 4 and rec["temperature"] == 1.0 and rec["max_new_tokens"] == 8
        assert all(len(p["rewards"]) == 3 and len(p["responses"]) == 3 for p in rec["problems"])
        assert 0.0 <= rec["avg@3"] <= rec["pass@3"] <= 1.0


def test_two_runs_add_t_rows(run):
    rep = evaluate_checkpoints([str(run["dir"]), str(run["dir"] / "checkpoint.pt")],
                               run["benches"][:1], agents=["char"], limit=2,
                               out_dir=str(run["tmp"] / "ev3"), echo=lambda *_: None)
    assert [r["row"] for r in rep["rows"]] == ["run#0/char", "run#1/char",
                                               "char (mean of 2 runs)"]
    assert rep["rows"][2]["ci"] == "t" and "Student-t" in rep["table"]
    assert rep["notes"] == []


def test_no_mean_over_runs_scored_by_different_rewards(run, tmp_path):
    """Each run is scored by its own reward: two runs of another reward (numeric_closeness's
    partial credit vs math's 0/1) made one '(mean of 2 runs)' row of two measures, said
    nowhere. No such row; a note names the rewards."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run["dir"] / "checkpoint.pt"))
    state["config"]["reward"]["name"] = "numeric_closeness"
    ckpt.save_atomic(state, str(tmp_path / "close" / "checkpoint.pt"))
    rep = evaluate_checkpoints([str(run["dir"]), str(tmp_path / "close")], run["benches"][:1],
                               agents=["char"], limit=2, out_dir=str(tmp_path / "ev"),
                               echo=lambda *_: None)
    assert [(r["row"], r["reward"]) for r in rep["rows"]] == [
        ("run/char", "math"), ("close/char", "numeric_closeness")]
    note = "No 'char (mean of 2 runs)' row: its runs are scored by different rewards (math, " \
        "numeric_closeness)."
    assert rep["notes"] == [note] and note in rep["table"]


def test_run_labels_are_unique_whatever_the_folder_names(run, tmp_path):
    """A third run whose folder is itself named "run#1" took the label of the second "run":
    its results merged into that row and its per-pair files overwrote the other's."""
    import shutil

    from hacpo.engine.eval_harness import _labels
    assert _labels(["/a/r1", "/b/r1", "/c/r1#1"]) == ["r1#0", "r1#1#1", "r1#1"]
    assert _labels(["/a/r1#1", "/b/r1", "/c/r1"]) == ["r1#1", "r1#1#1", "r1#2"]
    assert _labels(["/a/x", "/b/y/"]) == ["x", "y"]
    odd = tmp_path / "run#1"
    shutil.copytree(run["dir"], odd, ignore=shutil.ignore_patterns("eval"))
    rep = evaluate_checkpoints([str(run["dir"]), str(run["dir"] / "checkpoint.pt"), str(odd)],
                               run["benches"][:1], agents=["char"], limit=1,
                               out_dir=str(tmp_path / "ev"), echo=lambda *_: None)
    assert [r["row"] for r in rep["rows"]] == ["run#0/char", "run#1#1/char", "run#1/char",
                                               "char (mean of 3 runs)"]
    assert sorted(p.name for p in (tmp_path / "ev").iterdir() if p.is_dir()) == \
        ["run#0", "run#1", "run#1#1"]
    got = json.loads((tmp_path / "ev" / "run#1" / "char__gsm.json").read_text())
    assert got["run_dir"] == str(odd) and got["batch"] == 128      # the batch is recorded


def test_max_new_tokens_past_the_context_is_an_error(run, tmp_path, capsys):
    """--max-new-tokens at or past an agent's max_len (tiny3's char: 128) scored every problem
    0 as "prompts too long"; it is an error naming the flag."""
    with pytest.raises(ValueError, match=r"max_new_tokens 128 leaves no room for a prompt in "
                                         r"agent 'char''s context of 128 tokens"):
        evaluate_checkpoints([str(run["dir"])], run["benches"][:1], agents=["char"],
                             max_new_tokens=128, out_dir=str(tmp_path / "e"),
                             echo=lambda *_: None)
    with pytest.raises(SystemExit):
        cli.main(["eval", str(run["dir"]), "--bench", *run["benches"], "--seed", "-1"])
    assert "argument --seed: must be an integer >= 0" in capsys.readouterr().err


@register_reward("_test_even_length", in_process=True, overwrite=True)
def _even_length(response, gold):
    return float(len(response) % 2 == 0)


def test_run_reward_is_used_and_numbers_consistent(run):
    """The checkpoint's reward name picks the verifier; a 0/1 reward that is not all zeros
    makes avg@k, pass@k, the CI and the mean column non-trivial."""
    state = torch.load(run["dir"] / "checkpoint.pt", weights_only=False)
    state["config"]["reward"]["name"] = "_test_even_length"
    (run["tmp"] / "run2").mkdir()
    torch.save(state, run["tmp"] / "run2" / "checkpoint.pt")
    rep = evaluate_checkpoints([str(run["tmp"] / "run2")], run["benches"], samples=4,
                               temperature=1.0, echo=lambda *_: None)
    recs = {(r["agent"], r["benchmark"]): r for r in rep["results"]}
    assert all(r["reward"] == "_test_even_length" for r in recs.values())
    assert 0.0 < sum(r["avg@4"] for r in recs.values()) < len(recs)
    for row in rep["rows"]:
        vals, ses = [], []
        for bench in ("gsm", "math"):
            rec = json.loads((run["tmp"] / "run2" / "eval" / f"{row['agent']}__{bench}.json")
                             .read_text())
            per = [sum(p["rewards"]) / 4 for p in rec["problems"]]
            m = sum(per) / 6
            assert rec["avg@4"] == pytest.approx(m)
            assert rec["ci95"] == pytest.approx(1.96 * (sum((x - m) ** 2 for x in per) / 36)
                                                ** 0.5)
            assert rec["avg@4"] - 1e-12 <= rec["pass@4"] <= 1.0
            # unbiased pass@k with n = k: a problem counts iff one of its samples is correct
            assert rec["pass@4"] == pytest.approx(
                sum(any(r > 0.5 for r in p["rewards"]) for p in rec["problems"]) / 6)
            vals.append(rec["avg@4"])
            ses.append(rec["stderr"])
        assert row["mean"]["avg@4"] == pytest.approx(sum(vals) / 2)
        # the mean of B benchmarks: SE = sqrt(sum SE_b^2) / B (README), CI 1.96 SE
        assert row["mean"]["ci95"] == pytest.approx(1.96 * (ses[0] ** 2 + ses[1] ** 2) ** 0.5
                                                    / 2)
        assert row["mean"]["pass@4"] == pytest.approx(
            sum(row["benchmarks"][b]["pass@4"] for b in ("gsm", "math")) / 2)


def test_pass_at_k_is_the_unbiased_estimator_and_needs_k_samples():
    """pass@k = 1 - C(n-c, k) / C(n, k) for 1 <= k <= n; fewer samples than k (or c outside
    [0, n]) is an error, not pass@k = 1 (before: pass_at_k(2, 0, 3) was 1.0 with no sample
    correct)."""
    from math import comb
    from hacpo.engine.evaluate import pass_at_k
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)     # 1 - C(3,2)/C(5,2) = 1 - 3/10
    for n, c, k in ((2, 0, 3), (0, 0, 1), (3, 1, 0), (3, 4, 2), (3, -1, 2)):
        with pytest.raises(ValueError, match="pass@k needs 1 <= k <= n"):
            pass_at_k(n, c, k)


def test_eval_summary_counts_a_sample_above_half_as_solved():
    """README: pass@k counts a sample whose reward is above 0.5 as solved; avg@k is the mean
    reward whatever its size (a reward of 0.25 is not solved, 0.5 is not above 0.5)."""
    from hacpo.engine.eval_harness import _summary
    from hacpo.engine.evaluate import mean_and_stderr
    per = [{"rewards": [0.25, 0.0]}, {"rewards": [0.75, 0.0]}, {"rewards": [0.5, 0.5]},
           {"rewards": [1.0, 0.0]}]
    s = _summary(per, 2)
    # solved samples per problem 0, 1, 0, 1: pass@2 is 1 for the two with one solved
    assert s["pass@2"] == pytest.approx(0.5)
    assert s["avg@2"] == pytest.approx((0.125 + 0.375 + 0.5 + 0.5) / 4)
    se = mean_and_stderr([0.125, 0.375, 0.5, 0.5])[1]
    assert (s["n"], s["stderr"], s["ci95"]) == (4, pytest.approx(se), pytest.approx(1.96 * se))


def test_lenient_prompt_ids():
    class NoFallback:
        def prompt_ids(self, q, errors="strict"):
            raise UnencodableTextError("nope")

    assert prompt_ids_lenient(NoFallback(), "x") == (None, "unencodable")
    from hacpo.models.tokenizer import CharTokenizer
    tok = CharTokenizer()
    ids, status = prompt_ids_lenient(tok, "What is 2+2? \u2603")   # snowman: not in the charset
    assert status == "fallback" and ids[0] == tok.bos_id
    assert prompt_ids_lenient(tok, "What is 2+2?") == (tok.prompt_ids("What is 2+2?"), "ok")


def test_checkpoint_of_another_vocabulary_is_clear_error(run, tmp_path):
    """The policies `hacpo eval` rebuilds from the run's config must have the tokenizers the
    checkpoint's weights were trained with (a vocabulary reduced to data that changed since
    maps ids to other tokens): an error naming the checkpoint and agent, also for a checkpoint
    that records no tokenizers but whose weights do not fit."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run["dir"] / "checkpoint.pt"))
    k = AGENTS.index("qwen3")
    assert len(state["tokenizers"]) == len(AGENTS)
    state["tokenizers"][k] = "0" * 64
    ckpt.save_atomic(state, str(tmp_path / "other" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"cannot evaluate .*other/checkpoint\.pt: agent "
                                         r"qwen3's tokenizer \(\d+ tokens\) is not the one"):
        evaluate_checkpoints([str(tmp_path / "other")], run["benches"], agents=["qwen3"])
    del state["tokenizers"]
    emb = "model.embed.weight"
    w = state["agents"][k]["model"][emb]
    state["agents"][k]["model"][emb] = torch.zeros(w.shape[0] + 3, w.shape[1], dtype=w.dtype)
    ckpt.save_atomic(state, str(tmp_path / "other" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"(?s)cannot evaluate .*other/checkpoint\.pt: agent "
                                         r"qwen3's weights do not fit .*size mismatch"):
        evaluate_checkpoints([str(tmp_path / "other")], run["benches"], agents=["qwen3"])


def test_an_agent_whose_prompt_encoding_changed_since_the_checkpoint_is_said(run, tmp_path):
    """An agent whose tokenizer encodes text otherwise than when the checkpoint was written
    (its recorded encoding digest edited here: a chat template changed since) is evaluated on
    the prompts of now, with a one-line note naming it (a resume is refused instead); an
    unchanged agent gets none."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run["dir"] / "checkpoint.pt"))
    assert len(state["encodings"]) == len(AGENTS)
    state["encodings"][AGENTS.index("qwen3")] = "0" * 64
    ckpt.save_atomic(state, str(tmp_path / "other" / "checkpoint.pt"))
    said = []
    rep = evaluate_checkpoints([str(tmp_path / "other")], run["benches"][:1], limit=1,
                               agents=["char", "qwen3"], echo=said.append)
    assert [r["row"] for r in rep["rows"]] == ["char", "qwen3"]
    notes = [s for s in said if "note" in s]
    assert len(notes) == 1 and notes[0].startswith(
        "[eval] note: agent qwen3's prompts are not encoded as when its weights were trained: ")
    assert notes[0].endswith("; it is evaluated on prompts encoded as now")


def test_bad_inputs(run, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        evaluate_checkpoints([str(tmp_path / "nope")], run["benches"])
    with pytest.raises(FileNotFoundError, match="holds no checkpoint.pt"):
        evaluate_checkpoints([str(tmp_path)], run["benches"])
    with pytest.raises(ValueError, match=r"unknown agent\(s\) \['bob'\].*'char'"):
        evaluate_checkpoints([str(run["dir"])], run["benches"], agents=["bob"])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):  # not the default
        evaluate_checkpoints([str(run["dir"])], run["benches"], max_new_tokens=0)
    for kw, msg in (({"batch": 0}, "batch must be >= 1, got 0"),
                    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
                    ({"temperature": -1.0}, "temperature must be a finite number >= 0")):
        with pytest.raises(ValueError, match=msg):
            evaluate_checkpoints([str(run["dir"])], run["benches"], **kw)
    for spec in ("gsm", "=x.jsonl", "gsm=", "gsm=x.jsonl:nope"):
        with pytest.raises(ValueError, match="malformed benchmark spec"):
            parse_benchmark_spec(spec)
    assert parse_benchmark_spec("aime=/d/a.jsonl:math_answer") == \
        Benchmark("aime", "/d/a.jsonl", "math_answer")
    assert parse_benchmark_spec("m=/d/a.jsonl") == Benchmark("m", "/d/a.jsonl", "auto")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "2+2?"}\n')
    with pytest.raises(DataError, match=r"benchmark bad: .*bad.jsonl:line 3: missing field "
                                        r"'answer'"):
        evaluate_checkpoints([str(run["dir"])], [f"bad={bad}"])
    with pytest.raises(FileNotFoundError, match="benchmark gone: no file at"):
        evaluate_checkpoints([str(run["dir"])], [f"gone={tmp_path / 'gone.jsonl'}"])
    assert cli.main(["eval", str(tmp_path / "nope"), "--bench", *run["benches"]]) == 2
    assert "hacpo eval: error: no checkpoint at" in capsys.readouterr().err
    assert cli.main(["eval", str(run["dir"]), "--bench", "oops"]) == 2
    assert "malformed benchmark spec" in capsys.readouterr().err


def _with_config(run, tmp_path, name, edit):
    """A copy of the run's checkpoint whose stored config ``edit`` changed (as an older
    version of hacpo may have written it)."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run["dir"] / "checkpoint.pt"))
    edit(state["config"])
    ckpt.save_atomic(state, str(tmp_path / name / "checkpoint.pt"))
    return str(tmp_path / name)


def _means(rep):
    return {r["row"]: r["mean"] for r in rep["rows"]}


def test_stored_settings_eval_does_not_use_do_not_block_it(run, tmp_path):
    """`hacpo eval` rebuilds the policies from the checkpoint's config: values this version
    refuses where evaluation reads nothing (rollout engine settings, timeouts, an optimizer,
    a key it no longer knows, an HF setting on a decoder that its build never used) still
    evaluate, to the same numbers as the unedited checkpoint; the unused policy setting is
    named in a note."""
    def edit(c):
        c["rollout"].update(gpu_memory_utilization=0.5, call_timeout_s=float("inf"),
                            removed_option=1)
        c["trainer_call_timeout_s"] = float("inf")
        c["algorithm"]["no_such_key"] = 0
        c["agents"][0]["optim"]["lr"] = -1.0
        c["agents"][1]["policy"]["arch"] = "qwen2"
    old = _with_config(run, tmp_path, "old", edit)
    kw = dict(agents=["char", "qwen3"], limit=2, echo=lambda *_: None)
    want = evaluate_checkpoints([str(run["dir"])], run["benches"],
                                out_dir=str(tmp_path / "e0"), **kw)
    said = []
    got = evaluate_checkpoints([old], run["benches"], out_dir=str(tmp_path / "e1"),
                               **{**kw, "echo": said.append})
    assert _means(got) == _means(want)
    assert any("ignoring agents.1 ('qwen3'): policy.arch='qwen2' (the run's policy build "
               "never used it)" in s for s in said), said


def test_stored_value_eval_needs_and_refuses_is_one_line(run, tmp_path, capsys, monkeypatch):
    """A stored value evaluation does use and this version refuses is an error naming the key
    (and the option that replaces it, where one does); with that option given it evaluates."""
    hot = _with_config(run, tmp_path, "hot",
                       lambda c: c["rollout"].update(temperature=float("inf")))
    with pytest.raises(ValueError, match=r"^cannot evaluate .*hot/checkpoint\.pt: its stored "
                                         r"config: rollout\.temperature must be a finite number "
                                         r">= 0 \(0: greedy\), got inf \(or give "
                                         r"--temperature\)$"):
        evaluate_checkpoints([hot], run["benches"], samples=2, limit=1, echo=lambda *_: None)
    for kw in ({"samples": 1}, {"samples": 2, "temperature": 0.5}):   # not read
        evaluate_checkpoints([hot], run["benches"], agents=["char"], limit=1,
                             out_dir=str(tmp_path / "e"), echo=lambda *_: None, **kw)
    slow = _with_config(run, tmp_path, "slow",
                        lambda c: c["reward"].update(timeout_s=float("inf")))
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    assert cli.main(["eval", slow, "--bench", *run["benches"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo eval: error: cannot evaluate ") and err.count("\n") == 1, err
    assert "its stored config: reward.timeout_s must be a finite number > 0, got inf" in err


def test_hf_config_key_an_old_run_ignored_does_not_block_it(run, tmp_path):
    """A checkpoint of an HF agent whose stored hf_config holds a key that is no field of the
    architecture's config (written before that was checked: the model was built without it)
    evaluates like the same checkpoint without the key, with a note naming it."""
    from hacpo.engine import build, checkpoint as ckpt
    cfg = load_config("tiny3", overrides={
        "cache_dir": str(tmp_path / "cache"), "agents": [{"policy": {
            "name": "h", "kind": "hf", "tokenizer": "char", "seed": 1, "hf_config": {
                "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1}}}]})
    pol = build.build_policies(cfg, build.load_data(cfg))[0]
    state = {"step": 0, "config": cfg.to_dict(), "agents": [{"name": "h",
                                                             "model": pol.state_dict()}],
             "tokenizers": [build.tokenizer_digest(pol.tokenizer)]}
    ckpt.save_atomic(state, str(tmp_path / "clean" / "checkpoint.pt"))
    state["config"]["agents"][0]["policy"]["hf_config"]["hiden_size"] = 999
    ckpt.save_atomic(state, str(tmp_path / "typo" / "checkpoint.pt"))
    kw = dict(limit=2, max_new_tokens=4)
    want = evaluate_checkpoints([str(tmp_path / "clean")], run["benches"], echo=lambda *_: None,
                                **kw)
    said = []
    got = evaluate_checkpoints([str(tmp_path / "typo")], run["benches"], echo=said.append, **kw)
    assert _means(got) == _means(want)
    assert any("ignoring agents.0 ('h'): policy.hf_config.hiden_size=999" in s for s in said)


def test_sampled_eval_uses_the_runs_top_p(run, tmp_path, capsys, monkeypatch):
    """`--samples k` samples as the run's own pass@k does: at its rollout temperature *and*
    top-p (a run trained and evaluated with top_p 0.5 is not scored at top_p 1 unless
    `--top-p` says so); greedy reads no top-p (a stored one this version refuses does not
    block it), and a refused one is one line naming `--top-p`, which replaces it."""
    nucleus = _with_config(run, tmp_path, "nucleus", lambda c: c["rollout"].update(top_p=0.5))
    kw = dict(agents=["qwen3"], samples=3, limit=3, max_new_tokens=8, echo=lambda *_: None)
    got = evaluate_checkpoints([nucleus], run["benches"], out_dir=str(tmp_path / "d"), **kw)
    want = evaluate_checkpoints([str(run["dir"])], run["benches"], top_p=0.5,
                                out_dir=str(tmp_path / "w"), **kw)
    evaluate_checkpoints([nucleus], run["benches"], top_p=1.0, out_dir=str(tmp_path / "f"),
                         **kw)
    for bench in ("gsm", "math"):
        d, w, f = (json.loads((tmp_path / o / f"qwen3__{bench}.json").read_text())
                   for o in ("d", "w", "f"))
        assert d["top_p"] == 0.5 and f["top_p"] == 1.0 and d["temperature"] == 1.0
        assert d["problems"] == w["problems"]
    assert _means(got) == _means(want)
    def texts(o):
        return [p["responses"] for b in ("gsm", "math")
                for p in json.loads((tmp_path / o / f"qwen3__{b}.json").read_text())["problems"]]
    assert texts("d") != texts("f")     # the nucleus cut something: top_p 1 samples others
    bad = _with_config(run, tmp_path, "bad", lambda c: c["rollout"].update(top_p=0.0))
    greedy = evaluate_checkpoints([bad], run["benches"], agents=["char"], limit=1,
                                  out_dir=str(tmp_path / "g"), echo=lambda *_: None)
    assert greedy["results"][0]["top_p"] == 1.0 and greedy["results"][0]["temperature"] == 0.0
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    assert cli.main(["eval", bad, "--bench", *run["benches"], "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.top_p must be in (0, 1]" in err \
        and err.rstrip().endswith("(or give --top-p)"), err
    assert cli.main(["eval", bad, "--bench", *run["benches"], "--samples", "2", "--top-p",
                     "0.9", "--agents", "char", "--limit", "1", "--out-dir",
                     str(tmp_path / "h")]) == 0
    rec = json.loads((tmp_path / "h" / "char__gsm.json").read_text())
    assert rec["top_p"] == 0.9


# --------------------------------------------------------------------------------------------
# `hacpo eval` of a run's checkpoint on the run's own held-out set == the run's final eval
# --------------------------------------------------------------------------------------------

# a continuous verifier (exp(-|pred - gold| / |gold|)) on warm-started agents: every problem's
# reward depends on the exact number each response ends with, and a mean of n = 20 of them is
# no float32 number, so a response or a rounding that differs shows in the accuracy
OWN_RUN = {"threads": 1, "plots": False, "tensorboard": False, "steps": 2,
           "reward.name": "numeric_closeness", "data.eval_size": 20, "data.template": "short",
           "eval_max_new_tokens": 24,
           **{f"agents.{k}.{key}": v for k in range(3)
              for key, v in (("warmup.steps", 150), ("optim.lr", 1e-4))}}


def export_heldout(run_dir) -> str:
    """The run's own held-out problems (``build.load_data`` of the config its checkpoint
    holds) as a ``math_answer`` JSONL benchmark: the raw question (the template is the run's,
    applied by `hacpo eval`) and the gold answer. Returns the file's path."""
    from hacpo.engine import build, checkpoint as ckpt
    from hacpo.engine.run_config import TrainConfig
    cfg = TrainConfig.from_dict(ckpt.load(str(run_dir / "checkpoint.pt"))["config"])
    path = run_dir / "own.jsonl"
    path.write_text("".join(json.dumps({"problem": e.prompt, "answer": e.answer}) + "\n"
                            for e in build.load_data(cfg).eval))
    return str(path)


def assert_eval_equals_run(run_dir, summary, out_dir, own_responses=None):
    """`hacpo eval RUN --bench own=FILE:math_answer` (greedy, one sample) scores every agent
    exactly as the run's final evaluation did (summary.json), problem by problem where the
    run's own responses were recorded (``own_responses``: agent -> [[text]])."""
    assert json.loads((run_dir / "summary.json").read_text())["after"] == summary["after"]
    bench = export_heldout(run_dir)
    assert cli.main(["eval", str(run_dir), "--bench", f"own={bench}:math_answer",
                     "--out-dir", str(out_dir)]) == 0
    for agent, want in summary["after"].items():
        rec = json.loads((out_dir / f"{agent}__own.json").read_text())
        assert rec["n"] == want["n"] and rec["ok"] == rec["n"], rec
        assert rec["avg@1"] == want["accuracy"], (agent, rec["avg@1"], want["accuracy"])
        if own_responses is not None:
            assert [p["responses"] for p in rec["problems"]] == own_responses[agent], agent
    # the check can fail: the answers are neither all right nor all wrong, nor all equal
    rewards = {r for a in summary["after"]
               for p in json.loads((out_dir / f"{a}__own.json").read_text())["problems"]
               for r in p["rewards"]}
    assert len(rewards) > 2, rewards
    # the run's sampled pass@k (eval_pass_k): `--samples k` with no other option draws the
    # very samples (the run's seed + 1, batch 128, its rollout temperature and top-p)
    ks = {int(key[5:]) for a in summary["after"].values() for key in a if key.startswith("pass@")}
    for k in ks:
        assert cli.main(["eval", str(run_dir), "--bench", f"own={bench}:math_answer",
                         "--out-dir", str(out_dir / "sampled"), "--samples", str(k)]) == 0
        for agent, want in summary["after"].items():
            rec = json.loads((out_dir / "sampled" / f"{agent}__own.json").read_text())
            assert (rec[f"avg@{k}"], rec[f"pass@{k}"]) == (want[f"avg@{k}"], want[f"pass@{k}"]), \
                (agent, rec[f"avg@{k}"], rec[f"pass@{k}"], want)
        # can fail: sampling gave some problems answers of differing rewards
        assert any(len(set(p["rewards"])) > 1 for a in summary["after"] for p in json.loads(
            (out_dir / "sampled" / f"{a}__own.json").read_text())["problems"])


def record_final_responses(monkeypatch) -> dict:
    """agent -> the greedy responses of its last driver-side evaluation (in-process policies,
    the driver's megatron copies, or a rollout engine with eval_engine=rollout): after the
    run, its final evaluation's."""
    from hacpo.engine import evaluate as ev
    own: dict[str, list] = {}
    real = ev.sample_and_score

    def recording(policy, *a, **kw):
        out = real(policy, *a, **kw)
        if kw.get("samples", 1) == 1:
            own[policy.name] = out[1]
        return out
    monkeypatch.setattr(ev, "sample_and_score", recording)
    return own


def test_eval_of_the_run_on_its_own_heldout_set_equals_its_final_eval(tmp_path, monkeypatch):
    """The local trainer (tiny3: three tokenizers, two with reduced vocabularies; the run's
    template and eval_max_new_tokens): `hacpo eval` of the checkpoint on the run's held-out
    set gives each agent's final greedy accuracy to the last bit, with the same responses,
    and `--samples 2` its eval_pass_k=2 avg@2 and pass@2 with no other option (the seed used
    to default to 0, not the run's, and the batch to 64, not the run's 128).
    Before, the run's accuracy was a float32 mean (0.47984418 vs eval's 0.47984417)."""
    own = record_final_responses(monkeypatch)
    cfg = load_config("tiny3", overrides={"out_dir": str(tmp_path / "run"),
                                          "cache_dir": str(tmp_path / "cache"), **OWN_RUN,
                                          "eval_pass_k": 2, "seed": 3, "data.eval_size": 70})
    summary = train(cfg, echo=lambda *_: None)
    own = dict(own)          # `hacpo eval` below samples through the same function
    # RL moved the weights the checkpoint holds: the final accuracy is not the warm start's
    assert any(summary["after"][a]["accuracy"] != summary["before"][a]["accuracy"]
               for a in AGENTS), summary
    assert_eval_equals_run(tmp_path / "run", summary, tmp_path / "ev", own)


def test_a_run_that_sampled_its_eval_on_another_engine_gets_a_note(run, tmp_path):
    """--samples k draws the run's own eval_pass_k samples only where the run drew them
    in-process too: a run that sampled them on vLLM, or on several Ray engines per agent (each
    its own generator), gets one note saying so; greedy evaluation and the in-process cases
    none."""
    cases = {"vllm": ({"engine": "vllm"}, "with its vLLM engines"),
             "ray2": ({"engine": "ray", "engines_per_agent": 2},
                      "with 2 Ray rollout engines per agent"),
             "ray1": ({"engine": "ray", "engines_per_agent": 1}, None)}
    for name, (roll, want) in cases.items():
        def edit(c, roll=roll):
            c["eval_engine"] = "rollout"
            c["rollout"].update(roll)
        ck = _with_config(run, tmp_path, name, edit)
        for samples in (1, 2):
            said = []
            evaluate_checkpoints([ck], run["benches"], agents=["char"], limit=1,
                                 samples=samples, out_dir=str(tmp_path / "e" / name),
                                 echo=said.append)
            notes = [s for s in said if "note: the run sampled its own evaluation" in s]
            if want is None or samples == 1:
                assert notes == [], said
            else:
                assert len(notes) == 1 and want in notes[0], said


def test_a_prompt_that_just_fits_is_scored_and_one_token_more_is_too_long(monkeypatch):
    """``too_long`` is prompt + max_new_tokens > max_len, the sampler's own limit
    (hacpo.models.generation refuses only more): a prompt that fills max_len exactly with
    max_new_tokens is sampled; one token longer scores 0, counted."""
    from types import SimpleNamespace

    from hacpo.engine import eval_harness

    tok = SimpleNamespace(prompt_ids=lambda q, errors="strict": list(range(len(q))))
    policy = SimpleNamespace(tokenizer=tok, max_len=10)
    sampled = []

    def fake(pol, ids, golds, rc, **kw):
        sampled.extend(ids)
        return [[1.0] for _ in ids], [["r"] for _ in ids], {}
    monkeypatch.setattr(eval_harness, "sample_and_score", fake)
    per, counts = eval_harness._score_policy(
        policy, ["x" * 5, "x" * 6, "x" * 7], ["1"] * 3, None, samples=1, temperature=0.0,
        top_p=1.0, max_new_tokens=4, batch=8, seed=0, bench="b")
    assert [len(i) for i in sampled] == [5, 6]
    assert [p["status"] for p in per] == ["ok", "ok", "too_long"]
    assert [p["rewards"] for p in per] == [[1.0], [1.0], [0.0]]
    assert (counts["ok"], counts["too_long"]) == (2, 1)


def test_table_counts_each_problem_once_with_rows_over_runs():
    """The counts under the tables are the problems of the evaluated (run, agent) pairs; a
    '(mean of N runs)' row repeats its runs' counts and adds none."""
    from hacpo.engine.eval_harness import _markdown

    cell = {"avg@1": 0.5, "ci95": 0.1, "pass@1": 0.5}
    rows = [{"row": f"r{i}/a", "ci": "normal", "benchmarks": {"b": cell}, "mean": cell,
             "fallback": fb, "unencodable": un, "too_long": tl}
            for i, (fb, un, tl) in enumerate(((3, 1, 0), (0, 2, 4)))]
    rows.append({"row": "a (mean of 2 runs)", "ci": "t", "benchmarks": {"b": cell},
                 "mean": cell, "fallback": 3, "unencodable": 3, "too_long": 4})
    md = _markdown({"rows": rows, "notes": []}, ["b"], 1)
    assert ("Prompts encoded with the tokenizer fallback: 3; unencodable prompts (scored 0): 3; "
            "prompts too long for the policy (scored 0): 4.") in md


def test_eval_and_export_of_some_agents_build_those_only(run, tmp_path, monkeypatch, capsys):
    """`--agents X` rebuilt every agent: another agent's missing model or tokenizer files (a
    deleted HF checkpoint) stopped the evaluation or export of X."""
    from hacpo.engine import build
    from hacpo.engine.export import export_checkpoint
    real = build.build_policy

    def missing_llama(config, **kw):
        if config.name == "llama":
            raise FileNotFoundError("unknown tokenizer '/gone/llama': not an existing local path")
        return real(config, **kw)
    monkeypatch.setattr(build, "build_policy", missing_llama)
    out = tmp_path / "ev"
    assert cli.main(["eval", str(run["dir"]), "--bench", *run["benches"], "--agents", "qwen3",
                     "--limit", "2", "--max-new-tokens", "8", "--out-dir", str(out)]) == 0
    assert "rebuilding 1 policy from" in capsys.readouterr().out
    assert json.loads((out / "qwen3__gsm.json").read_text())["n"] == 2
    done = export_checkpoint(str(run["dir"]), str(tmp_path / "x"), agents=["char"],
                             echo=lambda *_: None)
    assert list(done) == ["char"]
    with pytest.raises(FileNotFoundError, match="/gone/llama"):    # the agent asked for: said
        export_checkpoint(str(run["dir"]), str(tmp_path / "y"), agents=["llama"],
                          tokenizer=False, echo=lambda *_: None)


def test_an_earlier_evaluations_files_in_the_out_dir_are_said(run, tmp_path, capsys):
    """A second evaluation into the same --out-dir kept the first's per-pair files beside its
    own eval.md / eval.json, with nothing said; they are kept (results) and named."""
    out = tmp_path / "ev"
    common = ["eval", str(run["dir"]), "--bench", *run["benches"], "--limit", "1",
              "--max-new-tokens", "8", "--out-dir", str(out)]
    assert cli.main([*common, "--agents", "char"]) == 0
    assert "of an earlier evaluation" not in capsys.readouterr().out
    assert cli.main([*common, "--agents", "qwen3"]) == 0
    said = capsys.readouterr().out
    assert f"[eval] {out} also holds 2 file(s) of an earlier evaluation (char__gsm.json, " \
           f"char__math.json): kept; eval.md and eval.json are this evaluation's" in said
    assert (out / "char__gsm.json").exists() and "| char |" not in (out / "eval.md").read_text()


def test_a_stopped_evaluation_leaves_no_summary_of_other_files_nor_folders_it_made(
        run, tmp_path, capsys, monkeypatch):
    """An evaluation stopped after some per-pair files (Ctrl-C, a full disk) kept the eval.md /
    eval.json of the evaluation before it, which no longer described the pair files now there;
    and one stopped before writing left the (empty) output folders it made."""
    import hacpo.engine.eval_harness as eh
    out = tmp_path / "ev"
    common = ["eval", str(run["dir"]), "--bench", *run["benches"], "--limit", "1",
              "--max-new-tokens", "8", "--agents", "char", "--out-dir", str(out)]
    assert cli.main(common) == 0
    assert (out / "eval.md").exists() and (out / "eval.json").exists()
    real, calls = eh._score_policy, []

    def stopped_after_one(*a, **k):       # the second benchmark is interrupted
        calls.append(k["bench"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(eh, "_score_policy", stopped_after_one)
    assert cli.main([*common[:6], "2", *common[7:]]) == 130          # --limit 2
    assert f"[eval] {out}: removed eval.md and eval.json of an earlier evaluation" \
           in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["char__gsm.json", "char__math.json"]
    assert json.loads((out / "char__gsm.json").read_text())["n"] == 2     # this evaluation's
    calls.clear()
    new = tmp_path / "a" / "b"
    monkeypatch.setattr(eh, "_score_policy", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt))
    assert cli.main([*common[:-1], str(new)]) == 130
    assert not (tmp_path / "a").exists()


def test_a_reduced_vocabulary_comes_from_the_checkpoint_not_the_data(run, tmp_path,
                                                                      monkeypatch):
    """The checkpoint records the reduced vocabularies' tokens: `hacpo eval` rebuilds
    it from them and reads none of the run's data (a large training file took minutes to
    tokenize again), with the same responses as a checkpoint that records none (written before
    it did), whose vocabulary is reduced to the data again."""
    from hacpo.engine import build
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run["dir"] / "checkpoint.pt"))
    assert list(state["vocabs"]) == ["qwen3", "llama"]          # char: no vocabulary to reduce
    del state["vocabs"]
    ckpt.save_atomic(state, str(tmp_path / "old" / "checkpoint.pt"))
    kw = {"agents": ["qwen3", "llama"], "limit": 3, "max_new_tokens": 8, "echo": lambda *_: None}
    old = evaluate_checkpoints([str(tmp_path / "old")], run["benches"],
                               out_dir=str(tmp_path / "ev-old"), **kw)

    def no_data(*a, **k):
        raise AssertionError("the run's data was read")
    monkeypatch.setattr(build, "load_data", no_data)
    new = evaluate_checkpoints([str(run["dir"])], run["benches"],
                               out_dir=str(tmp_path / "ev-new"), **kw)
    assert [{**r, "run": "-", "row": "-"} for r in new["rows"]] == \
        [{**r, "run": "-", "row": "-"} for r in old["rows"]]         # (labels: the folders)
    for f in ("qwen3__gsm.json", "qwen3__math.json", "llama__gsm.json", "llama__math.json"):
        assert json.loads((tmp_path / "ev-new" / f).read_text())["problems"] == \
            json.loads((tmp_path / "ev-old" / f).read_text())["problems"]
    with pytest.raises(AssertionError, match="data was read"):     # the old one reads it
        evaluate_checkpoints([str(tmp_path / "old")], run["benches"], **kw)


_HOLDER = """
import fcntl, os, socket, sys
f = open(sys.argv[1], "a+")
fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
f.write(f"{socket.gethostname()}:{os.getpid()}\\n"); f.flush()
print("ready", flush=True)
sys.stdin.read()
"""


def test_an_out_dir_another_evaluation_writes_is_refused(run, tmp_path, capsys):
    """Two evaluations into one folder at once (two terminals, the default <run>/eval) wrote
    an eval.md / eval.json of per-pair files the other one had replaced, with nothing said: each
    holds <out>/.hacpo-eval.lock (as a run its run dir), a second one is one line naming the
    holder; the lock file is no output, nor a stale one a killed evaluation left."""
    import socket
    import subprocess
    import sys

    from hacpo.engine.eval_harness import EVAL_LOCK
    out = tmp_path / "ev"
    common = ["eval", str(run["dir"]), "--bench", *run["benches"][:1], "--limit", "1",
              "--max-new-tokens", "8", "--agents", "char", "--out-dir", str(out)]
    assert cli.main(common) == 0
    before = {p.name: p.read_text() for p in out.iterdir()}
    assert sorted(before) == ["char__gsm.json", "eval.json", "eval.md"]
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out / EVAL_LOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        capsys.readouterr()
        assert cli.main([*common[:5], "2", *common[6:]]) == 2              # --limit 2
        err = capsys.readouterr().err.strip()
        assert err == (f"hacpo eval: error: {out} is in use by another hacpo evaluation (process "
                       f"{socket.gethostname()}:{holder.pid}, lock {out / EVAL_LOCK}): wait for "
                       f"it to end (or stop it), or choose another --out-dir")
        # nothing of the other evaluation's was touched
        assert {p.name: p.read_text() for p in out.iterdir() if p.name != EVAL_LOCK} == before
    finally:
        holder.stdin.close()
        holder.wait()
    assert (out / EVAL_LOCK).exists()            # as a killed evaluation leaves it
    assert cli.main(common) == 0
    said = capsys.readouterr().out
    assert "earlier evaluation" in said and EVAL_LOCK not in said
    assert sorted(p.name for p in out.iterdir()) == ["char__gsm.json", "eval.json", "eval.md"]
    assert EVAL_LOCK not in (out / "eval.json").read_text()


def test_several_runs_into_an_out_dir_replace_and_name_each_runs_folder(run, tmp_path, capsys):
    """With several runs and --out-dir X the per-pair files go to X/<run>, but an earlier
    evaluation's eval.md / eval.json there were kept (a summary of files this one replaced) and
    its other per-pair files not named; X/<run> is locked as X is; the step scored is said."""
    from hacpo.engine.eval_harness import EVAL_LOCK
    from hacpo.engine.trainer import lock_dir
    out = tmp_path / "ev"
    two = [str(run["dir"]), str(run["dir"] / "checkpoint.pt")]         # labels run#0, run#1
    kw = dict(limit=1, max_new_tokens=8, echo=print)
    evaluate_checkpoints(two[:1], run["benches"][:1], agents=["qwen3"],
                         out_dir=str(out / "run#0"), **kw)
    ck = run["dir"] / "checkpoint.pt"
    assert f"[eval] run: rebuilding 1 policy from {ck} (step 1)" in capsys.readouterr().out
    assert (out / "run#0" / "eval.md").read_text().startswith(f"Checkpoint: {ck} (step 1)\n")
    lock = lock_dir(str(out / "run#0"), EVAL_LOCK, "evaluation", "x")   # this process's
    try:
        with pytest.raises(RuntimeError, match=r"run#0 is in use by another hacpo evaluation"):
            evaluate_checkpoints(two, run["benches"][:1], agents=["char"], out_dir=str(out),
                                 **kw)
    finally:
        lock.close()
    assert (out / "run#0" / "eval.md").exists()
    capsys.readouterr()
    rep = evaluate_checkpoints(two, run["benches"][:1], agents=["char"], out_dir=str(out), **kw)
    said = capsys.readouterr().out
    sub = out / "run#0"
    assert f"[eval] {sub}: removed eval.md and eval.json of an earlier evaluation (this one's " \
           f"are written to {out})" in said
    assert f"[eval] {sub} also holds 1 file(s) of an earlier evaluation (qwen3__gsm.json): " \
           f"kept; this evaluation's eval.md and eval.json are in {out}" in said
    assert sorted(p.name for p in sub.iterdir()) == ["char__gsm.json", "qwen3__gsm.json"]
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md", "run#0", "run#1"]
    assert f"[eval] run#1: rebuilding 1 policy from {ck} (step 1)" in said
    assert rep["table"].startswith(f"Checkpoints:\n\n- run#0: {ck} (step 1)\n- run#1: {ck} "
                                   f"(step 1)\n\n")


def test_a_lock_file_removed_by_its_holder_as_it_is_taken_is_not_held(tmp_path, monkeypatch):
    """An evaluation removes its lock file as it ends: one that opened that file just before
    would lock the removed file while a third takes the new one, both 'holding' the folder; the
    lock is taken again on the file at the path."""
    import fcntl
    import os

    from hacpo.engine.eval_harness import EVAL_LOCK
    from hacpo.engine.trainer import lock_dir
    path, real, calls = tmp_path / EVAL_LOCK, fcntl.lockf, []

    def removed_first(fd, op, *a):       # the holder removes the file, another makes it anew
        if not calls:
            path.unlink()
            path.write_text("")
        calls.append(op)
        return real(fd, op, *a)
    monkeypatch.setattr(fcntl, "lockf", removed_first)
    lock = lock_dir(str(tmp_path), EVAL_LOCK, "evaluation", "x")
    try:
        assert len(calls) == 2 and os.fstat(lock.fileno()).st_ino == path.stat().st_ino
        assert path.read_text().strip().endswith(f":{os.getpid()}")
    finally:
        lock.close()


def test_two_checkpoints_of_one_run_dir_without_an_out_dir_are_refused(run, tmp_path):
    """Both wrote <run>/eval: the second's per-pair files replaced the first's (and one run
    under two names, a link, was "in use by another hacpo evaluation in this process")."""
    link = tmp_path / "link"
    link.symlink_to(run["dir"])
    for two in ([str(run["dir"]), str(run["dir"] / "checkpoint.pt")],
                [str(run["dir"]), str(link)]):
        with pytest.raises(ValueError, match=r"checkpoint\.pt would both write .*/eval: pass "
                                             r"--out-dir \(a folder per run under it\)"):
            evaluate_checkpoints(two, run["benches"][:1], agents=["char"], limit=1,
                                 max_new_tokens=8, echo=lambda *_: None)


# --------------------------------------------------------------------------------------------
# found by a mutation audit: behaviours no test above pinned
# --------------------------------------------------------------------------------------------

def test_a_relative_run_path_records_the_absolute_run_dir(run, tmp_path, monkeypatch, capsys):
    """`hacpo eval .` (in the run dir) or `hacpo eval run/checkpoint.pt` records the run dir as
    an absolute path and labels the run by its folder's name; eval.json's results leave the
    responses to the per-pair files; one agent named twice is evaluated once; an earlier
    evaluation's files are named four at most."""
    out = tmp_path / "e"
    out.mkdir()
    for i in range(5):
        (out / f"old__b{i}.json").write_text("{}")
    kw = dict(agents=["char", "char"], limit=1, max_new_tokens=8, out_dir=str(out), echo=print)
    monkeypatch.chdir(run["dir"])
    evaluate_checkpoints(["."], run["benches"][:1], **kw)
    said = capsys.readouterr().out
    assert "rebuilding 1 policy" in said
    assert f"{out} also holds 5 file(s) of an earlier evaluation (old__b0.json, old__b1.json, " \
           f"old__b2.json, old__b3.json, ...): kept" in said
    monkeypatch.chdir(run["dir"].parent)
    evaluate_checkpoints(["run/checkpoint.pt"], run["benches"][:1],
                         **{**kw, "out_dir": str(tmp_path / "f")})
    for d in (out, tmp_path / "f"):
        rec = json.loads((d / "char__gsm.json").read_text())
        assert (rec["run"], rec["run_dir"], len(rec["problems"])) == ("run", str(run["dir"]), 1)
        results = json.loads((d / "eval.json").read_text())["results"]
        assert [(r["run_dir"], "problems" in r) for r in results] == [(str(run["dir"]), False)]


def test_sampled_eval_defaults_and_per_benchmark_seeds(run, tmp_path, monkeypatch):
    """--samples k samples at the run's own rollout temperature (here 0.7, not 1) from the
    run's seed + 1; the i-th benchmark is sampled from seed + 1000 i, as if evaluated alone
    with that seed; --template replaces the run's template."""
    warm = _with_config(run, tmp_path, "warm", lambda c: c["rollout"].update(temperature=0.7))
    kw = dict(agents=["qwen3"], samples=2, limit=2, max_new_tokens=8, echo=lambda *_: None)
    evaluate_checkpoints([warm], run["benches"], out_dir=str(tmp_path / "a"), **kw)
    gsm = json.loads((tmp_path / "a" / "qwen3__gsm.json").read_text())
    math_ = json.loads((tmp_path / "a" / "qwen3__math.json").read_text())
    stored = json.loads((run["dir"] / "config.json").read_text())
    assert (gsm["temperature"], gsm["seed"], math_["seed"]) == (0.7, stored["seed"] + 1,
                                                                  stored["seed"] + 1001)
    evaluate_checkpoints([warm], run["benches"][1:], seed=stored["seed"] + 1001,
                         out_dir=str(tmp_path / "b"), **kw)
    alone = json.loads((tmp_path / "b" / "qwen3__math.json").read_text())
    assert alone["problems"] == math_["problems"]
    evaluate_checkpoints([warm], run["benches"][1:], seed=stored["seed"] + 1,
                         out_dir=str(tmp_path / "c"), **kw)
    first = json.loads((tmp_path / "c" / "qwen3__math.json").read_text())
    assert first["problems"] != math_["problems"]      # the seed draws other samples
    assert {gsm["template"], math_["template"]} == {stored["data"]["template"]} != {"short"}
    from hacpo.engine import eval_harness
    real, asked = eval_harness._score_policy, []

    def recording(policy, questions, *a, **k):
        asked.extend(questions)
        return real(policy, questions, *a, **k)
    monkeypatch.setattr(eval_harness, "_score_policy", recording)
    evaluate_checkpoints([warm], run["benches"][1:], template="short",
                         out_dir=str(tmp_path / "d"), **kw)
    assert json.loads((tmp_path / "d" / "qwen3__math.json").read_text())["template"] == "short"
    assert asked == ["Q: Compute $1+1$.\nA:", "Q: Bob has 5 hats. He gives away 1. How many "
                     "hats does Bob have?\nA:"]


def test_the_policies_are_scored_with_the_runs_thread_count(run, tmp_path, monkeypatch):
    """The run's `threads` (tiny3 here: 1) is the torch thread count while `hacpo eval`
    samples; the caller's is restored after it."""
    from hacpo.engine import eval_harness
    seen = []

    def fake(pol, ids, golds, rc, samples, **kw):
        seen.append(torch.get_num_threads())
        return [[0.0] * samples for _ in ids], [["r"] * samples for _ in ids], {}
    monkeypatch.setattr(eval_harness, "sample_and_score", fake)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        evaluate_checkpoints([str(run["dir"])], run["benches"][:1], agents=["char"], limit=1,
                             out_dir=str(tmp_path / "e"), echo=lambda *_: None)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_python_api_takes_paths_and_one_checkpoint_benchmark_or_agent_alone(run, tmp_path):
    """The API called as a user would: a pathlib.Path to a checkpoint.pt, or a Benchmark of a
    Path, crashed after the first pair was scored (eval.json writes no Path: "Object of type
    PosixPath is not JSON serializable"); one run, benchmark or agent name given alone, not in
    a list, was iterated by character ("run dir / holds no checkpoint.pt", "malformed
    benchmark spec 'g'", "unknown agent(s) ['c', 'h', 'a', 'r']")."""
    ck = run["dir"] / "checkpoint.pt"
    kw = dict(limit=1, max_new_tokens=8, echo=lambda *_: None)
    rep = evaluate_checkpoints([ck], [Benchmark("gsm", run["tmp"] / "gsm.jsonl", "gsm8k")],
                               agents=["char"], out_dir=str(tmp_path / "a"), **kw)
    rec = json.loads((tmp_path / "a" / "char__gsm.json").read_text())
    assert (rec["checkpoint"], rec["path"]) == (str(ck), str(run["tmp"] / "gsm.jsonl"))
    assert json.loads((tmp_path / "a" / "eval.json").read_text())["rows"] == rep["rows"]
    alone = evaluate_checkpoints(str(run["dir"]), run["benches"][0], agents="char",
                                 out_dir=str(tmp_path / "b"), **kw)
    assert [(r["agent"], list(r["benchmarks"])) for r in alone["rows"]] == [("char", ["gsm"])]
    assert alone["rows"] == rep["rows"]
