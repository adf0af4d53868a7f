"""hacpo profile: the cost model recovers known per-token costs and predicts exactly when the
costs are linear, for whole-sequence policies and for policies with shared prompt states;
break-even solving; a real side-by-side run on the tiny preset."""
import json
import math
import os
import re

import pytest

from hacpo.engine.profile import (build_report, fit_cost_model, render_report, run_profile,
                                  summarize_run)
from hacpo.engine.run_config import load_config

C = dict(gen=2e-3, old=3e-4, tself=9e-4, tcross=1.2e-3, retok=5e-5, opt=0.05, rew=1e-3,
         tprompt=7e-4)
PROMPTS = 8          # prompts per step: every run below trains each prompt's samples together


def _agent(samples, cross, shared, prompt_len=40, resp_len=10, cross_len=12):
    """Stage times of one agent under exactly linear costs C. shared: prompt states (each
    prompt trained once, samples per response token); else whole sequences."""
    gen_tok = samples * resp_len
    fwd_self = samples * (prompt_len + resp_len)
    fwd_cross = cross * (prompt_len + cross_len)
    fwd_prompt = PROMPTS * prompt_len if shared else 0
    t_self = samples * resp_len if shared else fwd_self
    t_cross = cross * cross_len if shared else fwd_cross
    d = {"generate": C["gen"] * gen_tok, "old_logprobs": C["old"] * fwd_self,
         "retokenize": C["retok"] * cross * cross_len, "sync": 0.0,
         "score_prompt": 0.4 * C["tprompt"] * fwd_prompt,
         "backward_prompt": 0.6 * C["tprompt"] * fwd_prompt,
         "score_self": 0.5 * C["tself"] * t_self, "backward_self": 0.5 * C["tself"] * t_self,
         "score_cross": 0.5 * C["tcross"] * t_cross,
         "backward_cross": 0.5 * C["tcross"] * t_cross, "optimizer": C["opt"],
         "tokens_generated": gen_tok, "tokens_scored_self": samples * resp_len,
         "tokens_scored_cross": cross * cross_len, "tokens_forward_self": fwd_self,
         "tokens_forward_cross": fwd_cross, "tokens_forward_prompt": fwd_prompt,
         "trained_samples": samples + cross, "trained_cross": cross,
         "generated_samples": samples}
    d["update"] = sum(d[k] for k in ("score_prompt", "backward_prompt", "score_self",
                                     "backward_self", "score_cross", "backward_cross",
                                     "optimizer"))
    return d


def _run(samples, cross, n=2, shared=False):
    agents = {f"a{i}": _agent(samples, cross, shared) for i in range(n)}
    reward = C["rew"] * samples * n
    for d in agents.values():
        d["agent_time"] = (d["generate"] + d["old_logprobs"] + d["retokenize"] + d["update"]
                           + d["sync"] + reward / n)
    step = sum(d["agent_time"] for d in agents.values())
    return {"steps": 5, "step_time": step, "reward_time": reward, "agents": agents,
            "trained_samples": sum(d["trained_samples"] for d in agents.values())}


@pytest.mark.parametrize("shared", [False, True])
def test_cost_model_recovers_linear_costs_and_predicts_exactly(shared):
    meas = {"gspo": _run(64, 0, shared=shared), "gspo2x": _run(128, 0, shared=shared),
            "hacpo": _run(64, 64, shared=shared)}
    rep = build_report(meas, ["a0", "a1"], kappas=(1, 4))
    cm = rep["cost_model"]
    assert cm["shared_prompts"] is shared
    assert cm["train_prompt_per_token"] == pytest.approx(C["tprompt"] if shared else 0.0)
    assert cm["prompts_per_agent"] == pytest.approx(PROMPTS if shared else 0.0)
    assert cm["gen_per_token"] == pytest.approx(C["gen"])
    assert cm["old_per_token"] == pytest.approx(C["old"])
    assert cm["train_self_per_token"] == pytest.approx(C["tself"])
    assert cm["train_cross_per_token"] == pytest.approx(C["tcross"])
    assert cm["retok_per_token"] == pytest.approx(C["retok"])
    assert cm["cross_measured"] is True
    for algo, chk in rep["model_check"].items():     # fitted on gspo, predicts the others
        assert abs(chk["error"]) < 1e-9, algo
    # extra over GSPO: the cross fwd+bwd and re-tokenization, relative to GSPO's agent time
    g, h = meas["gspo"]["agents"]["a0"], meas["hacpo"]["agents"]["a0"]
    extra = (h["score_cross"] + h["backward_cross"] + h["retokenize"]) / g["agent_time"]
    assert rep["agents"]["a0"]["extra_over_gspo"] == pytest.approx(extra)
    assert rep["agents"]["a0"]["cross_scoring_share"] == pytest.approx(
        (h["score_cross"] + h["retokenize"]) / g["agent_time"])
    assert rep["agents"]["a0"]["cross_backward_share"] == pytest.approx(
        h["backward_cross"] / g["agent_time"])
    assert rep["per_trained_sample"]["ratio"] == pytest.approx(
        (meas["hacpo"]["step_time"] / 256) / (meas["gspo2x"]["step_time"] / 256))


@pytest.mark.parametrize("shared", [False, True])
def test_per_sample_ratio_and_break_even(shared):
    meas = {"gspo": _run(64, 0, shared=shared), "hacpo": _run(64, 64, shared=shared)}
    model = fit_cost_model(meas["gspo"], ["a0", "a1"], cross_from=meas["hacpo"])
    S, lp, lr = 64, 40, 10
    gen, old = C["gen"] * S * lr, C["old"] * S * (lp + lr)
    trained = lr if shared else lp + lr
    ts, tc = C["tself"] * S * trained, C["tcross"] * S * trained
    pr = C["tprompt"] * PROMPTS * lp if shared else 0.0   # prompts trained once, any n
    rt, rew = C["retok"] * S * lr, C["rew"] * S
    hand = ((gen + old + pr + ts + tc + rt + C["opt"] + rew)
            / (2 * (gen + old + ts + rew) + pr + C["opt"]))
    assert model.per_sample_ratio(n=2) == pytest.approx(hand)
    # the ratio falls with the decode cost towards 1/n
    rs = [model.per_sample_ratio(n=3, kappa=k) for k in (0.1, 1, 10, 1e4)]
    assert rs == sorted(rs, reverse=True) and rs[-1] == pytest.approx(1 / 3, abs=0.01)
    k = model.break_even_kappa(n=2, target=0.75)
    assert model.per_sample_ratio(n=2, kappa=k) == pytest.approx(0.75, abs=1e-6)
    assert model.break_even_kappa(n=2, target=0.5) == math.inf     # never below 1/n
    assert model.break_even_kappa(n=2, target=10.0) == 0.0


def test_no_cross_samples_assumes_self_costs():
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 0)}
    model = fit_cost_model(meas["gspo"], ["a0", "a1"], cross_from=meas["hacpo"])
    assert not model.cross_measured
    assert model.train_cross_per_token == pytest.approx(C["tself"])
    # the report marks no cross-scoring target as met when HACPO trained no cross sample
    md = render_report(build_report(meas, ["a0", "a1"]))
    assert md.count("+0% (no cross sample trained)") == 2 and "(met)" not in md
    md = render_report(build_report({"gspo": _run(64, 0), "hacpo": _run(64, 32)}, ["a0", "a1"]))
    assert "(no cross sample trained)" not in md and md.count("(met)") == 2


def test_the_per_sample_target_is_judged_for_two_agents_that_trained_cross_samples():
    """The target compares HACPO's 2 agents with GSPO on twice the samples: with one or three
    agents, or no cross sample trained, a "(not met)" / "(met)" judged another comparison."""
    def line(meas, names):
        md = render_report(build_report(meas, names))
        return next(ln for ln in md.splitlines() if ln.startswith("HACPO wall time per"))
    two = {"gspo2x": _run(128, 0), "hacpo": _run(64, 64)}
    assert re.search(r"\*\* \(target <= 0.75\) \((not )?met\)$", line(two, ["a0", "a1"]))
    three = {"gspo2x": _run(128, 0, n=3), "hacpo": _run(64, 128, n=3)}
    assert "(not judged: GSPO x2 matches HACPO's samples for 2 agents; this config has 3)" in \
        line(three, ["a0", "a1", "a2"])
    none = {"gspo2x": _run(128, 0), "hacpo": _run(64, 0)}
    assert line(none, ["a0", "a1"]).endswith("(no cross sample trained: HACPO trained its own "
                                              "samples only, as GSPO)")


def test_summarize_skips_first_steps():
    rows = [{"step": s, "time/step": 10.0 if s == 0 else 2.0, "time/reward": 0.0,
             "time/generate/a": 1.0, "tokens/generated/a": 5.0,
             "train/a/trained_samples": 4.0, "train/a/trained_cross": 0.0} for s in range(3)]
    m = summarize_run(rows, ["a"], skip_steps=1)
    assert m["steps"] == 2 and m["step_time"] == 2.0
    assert m["agents"]["a"]["generate"] == 1.0 and m["agents"]["a"]["score_cross"] == 0.0
    with pytest.raises(ValueError, match="no measured steps"):
        summarize_run(rows, ["a"], skip_steps=3)


def test_summarize_splits_the_reward_and_counts_generated_samples():
    """Per agent: T(a) = generate + old log-probs + re-tokenize + update + sync + reward / n
    (the shared verifier split evenly over the n agents; module docstring), and the samples an
    agent generated are its trained samples less the cross samples it learned from."""
    stages = {"generate": 1.0, "old_logprobs": 0.5, "retokenize": 0.25, "update": 2.0,
              "sync": 0.125}
    rows = []
    for s in range(2):
        r = {"step": s, "time/step": 9.0, "time/reward": 0.6}
        for a in ("a", "b", "c"):
            r.update({f"time/{k}/{a}": v for k, v in stages.items()})
            r.update({f"train/{a}/trained_samples": 24.0, f"train/{a}/trained_cross": 16.0})
        rows.append(r)
    m = summarize_run(rows, ["a", "b", "c"], skip_steps=0)
    for a in ("a", "b", "c"):
        d = m["agents"][a]
        assert d["agent_time"] == pytest.approx(1.0 + 0.5 + 0.25 + 2.0 + 0.125 + 0.6 / 3)
        assert d["generated_samples"] == 8.0 and d["trained_samples"] == 24.0
    assert m["trained_samples"] == 72.0


def test_report_marks_the_cross_scoring_target_inclusively():
    """A cross-scoring share of exactly the 25% target is met ("target <= 25%")."""
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 64)}
    g = meas["gspo"]["agents"]["a0"]
    for a in ("a0", "a1"):           # scoring = exactly a quarter of GSPO's agent time
        meas["hacpo"]["agents"][a]["score_cross"] = 0.25 * g["agent_time"]
        meas["hacpo"]["agents"][a]["retokenize"] = 0.0
    rep = build_report(meas, ["a0", "a1"])
    assert rep["agents"]["a0"]["cross_scoring_share"] == 0.25
    assert render_report(rep).count("+25% (met)") == 2


def test_profile_end_to_end_tiny(tmp_path):
    cfg = load_config("tiny3", overrides={"cache_dir": str(tmp_path / "cache"), "threads": 1})
    said = []
    rep = run_profile(cfg, str(tmp_path / "prof"), rounds=2, steps_per_round=1, skip_steps=1,
                      echo=said.append)
    # a run's warnings reach the user (gspo2x: fewer prompts than minibatches), its progress not
    warned = [s for s in said if s.startswith("[profile] gspo2x: [warn]")]
    assert len(warned) == 2 and "minibatch" in warned[0], said     # once per round (a resume)
    assert not any(s.startswith("[eval]") or s.startswith("[warm-up]") for s in said), said
    # the order rotates every round (module docstring, README): round 2 starts with gspo2x
    order = [s.split(": ")[1] for s in said if s.startswith("[profile] round")]
    assert order == ["gspo to step 1", "gspo2x to step 1", "hacpo to step 1",
                     "gspo2x to step 2", "hacpo to step 2", "gspo to step 2"], said
    for f in ("profile.json", "profile.md", "profile.png"):
        assert (tmp_path / "prof" / f).exists()
    assert set(rep["measured"]) == {"gspo", "gspo2x", "hacpo"}
    for algo, m in rep["measured"].items():
        assert m["steps"] == 1 and m["step_time"] > 0
        rows = [json.loads(l) for l in open(tmp_path / "prof" / algo / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [0, 1]        # interleaved rounds resumed
    # gspo2x generates twice the samples per agent
    assert rep["measured"]["gspo2x"]["trained_samples"] == \
        2 * rep["measured"]["gspo"]["trained_samples"]
    assert "ratio" in rep["per_trained_sample"]
    assert "HACPO wall time per trained sample" in (tmp_path / "prof" / "profile.md").read_text()
    # a second profile into the same directory would measure nothing new: refused, untouched
    before = (tmp_path / "prof" / "profile.json").read_text()
    with pytest.raises(FileExistsError, match=r"already holds profile runs .* choose another "
                                              r"--out-dir"):
        run_profile(cfg, str(tmp_path / "prof"), rounds=2, steps_per_round=1, skip_steps=1,
                    echo=lambda *_: None)
    assert (tmp_path / "prof" / "profile.json").read_text() == before


def _with_fixed_costs(run, sync=0.3, update_other=0.2):
    """``run`` plus a weight sync and update time outside the scored parts (batching,
    bookkeeping), both fixed per agent and step: part of every agent's step time."""
    for d in run["agents"].values():
        d["sync"] += sync
        d["update"] += update_other
        d["agent_time"] += sync + update_other
        run["step_time"] += sync + update_other
    return run


@pytest.mark.parametrize("shared", [False, True])
def test_cost_model_counts_sync_and_update_outside_its_parts(shared):
    """The weight sync and the update's time outside its parts are stage times of every step:
    the GSPO fit reproduces GSPO's step and predicts the other runs, and the per-sample ratio
    charges them to both sides (one step each)."""
    meas = {"gspo": _with_fixed_costs(_run(64, 0, shared=shared)),
            "gspo2x": _with_fixed_costs(_run(128, 0, shared=shared)),
            "hacpo": _with_fixed_costs(_run(64, 64, shared=shared))}
    rep = build_report(meas, ["a0", "a1"])
    assert rep["cost_model"]["sync_per_step"] == pytest.approx(0.3)
    assert rep["cost_model"]["update_other_per_step"] == pytest.approx(0.2)
    for algo, chk in rep["model_check"].items():
        assert abs(chk["error"]) < 1e-9, algo
    model = fit_cost_model(meas["gspo"], ["a0", "a1"], cross_from=meas["hacpo"])
    S, lp, lr = 64, 40, 10
    trained = lr if shared else lp + lr
    gen, old = C["gen"] * S * lr, C["old"] * S * (lp + lr)
    ts, tc = C["tself"] * S * trained, C["tcross"] * S * trained
    pr = C["tprompt"] * PROMPTS * lp if shared else 0.0
    rt, rew, fixed = C["retok"] * S * lr, C["rew"] * S, C["opt"] + 0.3 + 0.2
    hacpo = gen + old + pr + ts + tc + rt + fixed + rew
    gspo2 = 2 * (gen + old + ts + rew) + pr + fixed
    assert model.per_sample_ratio(n=2) == pytest.approx(hacpo / gspo2)


def test_model_check_says_what_the_fit_saw_of_each_run():
    """GSPO's check is in-sample, HACPO's shares its cross costs with the fit, GSPO x2's is
    held out: the report says so next to each error."""
    meas = {"gspo": _run(64, 0), "gspo2x": _run(128, 0), "hacpo": _run(64, 64)}
    rep = build_report(meas, ["a0", "a1"])
    assert {a: c["fit"] for a, c in rep["model_check"].items()} == {
        "gspo": "in-sample", "gspo2x": "held out", "hacpo": "cross costs fitted on it"}
    md = render_report(rep)
    assert ("gspo +0% (in-sample), gspo2x +0% (held out), hacpo +0% (cross costs fitted on it)"
            in md)
    # no cross sample trained: HACPO's check uses nothing of the HACPO run
    rep = build_report({"gspo": _run(64, 0), "hacpo": _run(64, 0)}, ["a0", "a1"])
    assert rep["model_check"]["hacpo"]["fit"] == "held out"


def test_profile_into_a_file_is_a_user_error(tmp_path):
    """--out-dir naming a file: an error naming it (was a FileExistsError traceback), before
    any run, the file untouched."""
    from hacpo.engine.errors import is_user_error
    cfg = load_config("tiny3", overrides={"cache_dir": str(tmp_path / "cache")})
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(ValueError, match=r"notes\.txt is a file") as e:
        run_profile(cfg, str(f), rounds=1, steps_per_round=2, echo=lambda *_: None)
    assert is_user_error(e.value) and f.read_text() == "mine"
    assert not (tmp_path / "cache").exists()


def test_report_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """compare/profile/run plots and reports are replaced atomically: a write that fails halfway
    (a crash, a full disk) leaves the previous file as it was and no temp file beside it."""
    from hacpo.engine.plots import save_figure, subplots
    path = tmp_path / "profile.png"
    fig, ax = subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, str(path))
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG")

    def half_then_fail(self, f, **kw):
        f.write(old[:100])
        raise OSError(28, "No space left on device")
    fig, ax = subplots()
    monkeypatch.setattr(type(fig), "savefig", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_figure(fig, str(path))
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["profile.png"]
