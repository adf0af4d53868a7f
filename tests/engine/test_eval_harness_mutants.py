"""Behaviours of hacpo.engine.eval_harness that a mutation audit found no test pinning, each
checked without training a run: benchmark specs (a spaced name, a PATH with ':' in it, a
name that is no file name), problems that are scored 0 (unencodable) or scored through the
fallback, the stored config `hacpo eval` reads (the run's max_new_tokens and the option
replacing it, the loaded state left as it was), the input checks (samples, limit, temperature,
names, field maps, template, empty benchmark, unmakeable out dir), and the numbers of the
report and its markdown table (rows over runs, counts, percentages, pass@k table)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from hacpo.engine import eval_harness
from hacpo.engine.data import DataError
from hacpo.engine.eval_harness import (Benchmark, _load_run, _markdown, _report, eval_config,
                                       evaluate_checkpoints, parse_benchmark_spec)
from hacpo.engine.run_config import load_config
from hacpo.models.tokenizer import UnencodableTextError


def test_benchmark_spec_paths_with_colons_and_names():
    """NAME is stripped; the field map is what follows the *last* ':'; a tail that looks like
    a file name (a '.'), or a whole PATH that exists, is part of the path, not an unknown field
    map; '~' is expanded; a NAME with '/' (it names output files) is refused."""
    assert parse_benchmark_spec(" gsm =/d/a.jsonl") == Benchmark("gsm", "/d/a.jsonl", "auto")
    assert parse_benchmark_spec("m=/d/a:b.jsonl:math") == Benchmark("m", "/d/a:b.jsonl", "math")
    assert parse_benchmark_spec("m=/d/a:b.jsonl") == Benchmark("m", "/d/a:b.jsonl", "auto")
    assert parse_benchmark_spec("m=~/a.jsonl").path == os.path.expanduser("~/a.jsonl")
    with pytest.raises(ValueError, match=r"malformed benchmark spec .*NAME must be"):
        parse_benchmark_spec("a/b=/d/a.jsonl")


def test_benchmark_spec_of_an_existing_file_whose_name_has_a_colon(tmp_path):
    f = tmp_path / "set:v2"
    f.write_text("")
    assert parse_benchmark_spec(f"s={f}") == Benchmark("s", str(f), "auto")
    with pytest.raises(ValueError, match="unknown field map 'v2'"):     # none there: an error
        parse_benchmark_spec(f"s={tmp_path / 'other'}:v2")


def _policy():
    """A policy whose tokenizer encodes "ok..." strictly, "fb..." only with its fallback and
    "no..." not at all (one id per character)."""
    def prompt_ids(q, errors="strict"):
        if q.startswith("no") or (q.startswith("fb") and errors == "strict"):
            raise UnencodableTextError(q)
        return list(range(len(q)))
    return SimpleNamespace(tokenizer=SimpleNamespace(prompt_ids=prompt_ids), max_len=64)


def test_unencodable_problems_score_0_and_fallback_ones_are_sampled(monkeypatch):
    """An unencodable prompt is counted and scored 0 with one reward per sample (no crash on
    its missing ids); a fallback-encoded one is sampled and scored like an encodable one; the
    error context of a sampled problem names its index among all problems."""
    seen = {}

    def fake(pol, ids, golds, rc, where, samples, **kw):
        seen["ids"], seen["where"] = ids, [where(j) for j in range(len(ids))]
        return [[1.0] * samples for _ in ids], [["r"] * samples for _ in ids], {}
    monkeypatch.setattr(eval_harness, "sample_and_score", fake)
    per, counts = eval_harness._score_policy(
        _policy(), ["no a", "ok b", "fb c"], ["1"] * 3, None, samples=3, temperature=1.0,
        top_p=1.0, max_new_tokens=4, batch=8, seed=0, bench="b")
    assert [p["status"] for p in per] == ["unencodable", "ok", "fallback"]
    assert [p["rewards"] for p in per] == [[0.0] * 3, [1.0] * 3, [1.0] * 3]
    assert (counts["unencodable"], counts["ok"], counts["fallback"]) == (1, 1, 1)
    assert seen["where"] == ["benchmark b, problem 1", "benchmark b, problem 2"]


def _stored():
    return load_config("tiny3").to_dict()


def test_eval_config_reads_the_runs_max_new_tokens_unless_replaced():
    """The stored eval_max_new_tokens is the default; with --max-new-tokens it is not read (a
    value this version refuses does not block it), and the error without the option names the
    option; the loaded config is not changed (its unused policy settings are dropped from a
    copy)."""
    stored = _stored()
    stored["eval_max_new_tokens"] = 24
    assert eval_config(stored)[0].eval_max_new_tokens == 24
    stored["eval_max_new_tokens"] = -3
    assert eval_config(stored, max_new_tokens=False)[0].eval_max_new_tokens != -3
    with pytest.raises(ValueError, match=r"eval_max_new_tokens.* \(or give --max-new-tokens\)$"):
        eval_config(stored)
    stored = _stored()
    stored["agents"][1]["policy"]["arch"] = "qwen2"       # unused by its build: dropped
    _, notes = eval_config(stored)
    assert notes and stored["agents"][1]["policy"]["arch"] == "qwen2"


def test_a_stored_config_or_checkpoint_without_agents_is_a_clear_error(tmp_path):
    stored = _stored()
    del stored["agents"]
    with pytest.raises(ValueError, match="cannot evaluate x: its stored config holds no list of "
                                         "agents"):
        eval_config(stored, where="x")
    torch.save({"config": _stored()}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"is not a hacpo training checkpoint \(no "
                                         r"'config'/'agents'\)"):
        _load_run(str(tmp_path))


@pytest.fixture
def cheap(tmp_path):
    """A checkpoint that loads (tiny3's config, agent "char" without weights) and a one-problem
    benchmark: enough for every check before a policy is built."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"config": _stored(), "agents": [{"name": "char"}]}, run / "checkpoint.pt")
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    return str(run), str(bench)


def test_bad_numeric_inputs_are_refused(cheap):
    run, bench = cheap
    for kw, msg in (({"samples": 0}, "samples must be >= 1, got 0"),
                    ({"limit": 0}, "limit must be >= 1, got 0"),
                    ({"temperature": float("inf")},
                     "temperature must be a finite number >= 0, got inf")):
        with pytest.raises(ValueError, match=msg):
            evaluate_checkpoints([run], [f"b={bench}"], **kw)


def test_bad_benchmarks_and_template_are_refused_before_any_work(cheap, tmp_path):
    run, bench = cheap
    with pytest.raises(ValueError, match=r"benchmark names must be unique, got \['b', 'b'\]"):
        evaluate_checkpoints([run], [f"b={bench}", f"b={bench}:gsm8k"])
    with pytest.raises(ValueError, match="benchmark b: unknown field map 'nope'; one of auto"):
        evaluate_checkpoints([run], [Benchmark("b", bench, "nope")])
    with pytest.raises(KeyError, match="no_such_template"):       # not a missing checkpoint's
        evaluate_checkpoints([str(tmp_path / "none")], [f"b={bench}"],
                             template="no_such_template")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"benchmark e: .*empty\.jsonl holds no problems"):
        evaluate_checkpoints([run], [f"e={empty}"], out_dir=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_greedy_with_explicit_temperature_0_reads_no_stored_top_p(cheap, tmp_path):
    """--temperature 0 is greedy whatever --samples: the stored top-p (here one this version
    refuses) is not read, so the evaluation goes on (to the unknown agent's error here)."""
    run, bench = cheap
    state = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
    state["config"]["rollout"]["top_p"] = 0.0
    torch.save(state, os.path.join(run, "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"unknown agent\(s\) \['bob'\]"):
        evaluate_checkpoints([run], [f"b={bench}"], samples=2, temperature=0.0, agents=["bob"])


def test_an_out_dir_that_cannot_be_made_names_the_option(cheap, tmp_path):
    run, bench = cheap
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match=r"\(--out-dir chooses another\)"):
        evaluate_checkpoints([run], [f"b={bench}"], out_dir=str(blocker / "x"))


def _result(run, agent, bench, avg, pk, se, fb=0, un=0, tl=0, n=4, reward="math"):
    return {"run": run, "agent": agent, "benchmark": bench, "avg@2": avg, "pass@2": pk,
            "stderr": se, "ci95": 1.96 * se, "reward": reward, "fallback": fb,
            "unencodable": un, "too_long": tl, "n": n, "checkpoint": f"/{run}/checkpoint.pt",
            "step": None}


def test_report_rows_over_runs_and_counts():
    """A row per (run, agent) sums its benchmarks' counts and problems; the '(mean of N runs)'
    row has the t CI of the runs' values per benchmark and of their means, and the mean of
    their pass@k; an agent of one run only gets no such row."""
    from hacpo.engine.compare import mean_ci
    res = [_result("r1", "a", "x", 0.5, 0.75, 0.1, fb=1, un=2, tl=0, n=4),
           _result("r1", "a", "y", 0.25, 0.5, 0.2, fb=3, un=0, tl=1, n=5),
           _result("r2", "a", "x", 0.75, 1.0, 0.1),
           _result("r2", "a", "y", 0.25, 0.25, 0.3),
           _result("r2", "b", "x", 0.5, 0.5, 0.1),
           _result("r2", "b", "y", 0.5, 0.5, 0.1)]
    rep = _report(res, ["x", "y"], 2, multi=True)
    rows = {r["row"]: r for r in rep["rows"]}
    assert list(rows) == ["r1/a", "r2/a", "r2/b", "a (mean of 2 runs)"]
    r1 = rows["r1/a"]
    assert (r1["fallback"], r1["unencodable"], r1["too_long"], r1["problems"]) == (4, 2, 1, 9)
    assert r1["mean"]["ci95"] == pytest.approx(1.96 * (0.1 ** 2 + 0.2 ** 2) ** 0.5 / 2)
    t = rows["a (mean of 2 runs)"]
    assert t["benchmarks"]["x"]["ci95"] == pytest.approx(mean_ci([0.5, 0.75])[1])
    assert t["mean"]["avg@2"] == pytest.approx((0.375 + 0.5) / 2)
    assert t["mean"]["ci95"] == pytest.approx(mean_ci([0.375, 0.5])[1])
    assert t["mean"]["pass@2"] == pytest.approx((0.625 + 0.625) / 2)
    md = _markdown(rep, ["x", "y"], 2)
    assert "| r1/a | 50.0 ± 19.6 | 25.0 ± 39.2 | 37.5 ± 21.9 |" in md
    assert "| r1/a | 75.0 | 50.0 | 62.5 |" in md                     # pass@2: no CI
    assert "pass@2 (%, unbiased estimator)" in md
    assert md.startswith("Checkpoints:\n\n- r1: /r1/checkpoint.pt (step unknown)\n")


def test_one_sample_has_no_pass_table():
    rep = _report([{**_result("r", "a", "x", 0.5, 0.5, 0.1), "avg@1": 0.5, "pass@1": 0.5}],
                  ["x"], 1, multi=False)
    md = _markdown(rep, ["x"], 1)
    assert "| a | 50.0 ± 19.6 | 50.0 ± 19.6 |" in md and "pass@1" not in md
