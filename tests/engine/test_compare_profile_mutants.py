"""hacpo compare / hacpo profile around their runs, with ``train`` replaced by a stand-in that
writes what a run leaves (summary.json; metrics.jsonl and a checkpoint): each run's config,
what reaches the user, what is reused and the numbers written to the files; and the parts of
the compare table and the profile report (targets, cost model, extrapolation) a mutation
audit found untested."""
import copy
import json
import os

import pytest

import hacpo.engine.trainer as trainer_mod
from hacpo.engine.compare import plot_compare, render_table, run_compare, with_algorithm
from hacpo.engine.profile import (AGENT_STAGES, UPDATE_PARTS, build_report, fit_cost_model,
                                  run_profile)
from hacpo.engine.run_config import config_hash, load_config, resolve_paths

from .test_profile import _run

ACC = {"gspo": 0.25, "hacpo": 0.5}          # a run's held-out accuracy after RL: algo + seed/10


def _base(tmp_path, **over):
    return load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache"),
                                           "threads": 1, "plots": False,
                                           "tensorboard": False, **over})


@pytest.fixture
def compare_runs(monkeypatch):
    """``train`` for compare: records (cfg, resume), says a progress line and a [warn] line and
    writes the summary.json a finished run leaves (its config hash as train stores it)."""
    calls = []

    def fake_train(cfg, *, resume=False, echo=print, **_):
        calls.append((cfg, resume))
        echo("[eval] held-out accuracy after RL ...")
        echo("[warn] 2 prompts per step, fewer than the 4 minibatches")
        names = [a.policy.name for a in cfg.agents]
        acc = ACC[cfg.algorithm.name] + cfg.seed / 10
        summary = {"before": {n: {"accuracy": 0.125} for n in names},
                   "after": {n: {"accuracy": acc, "pass@4": acc + 0.125} for n in names},
                   "steps": cfg.steps,
                   "config_hash": config_hash(resolve_paths(copy.deepcopy(cfg)).to_dict())}
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
        return summary
    monkeypatch.setattr(trainer_mod, "train", fake_train)
    return calls


def test_compare_gives_each_run_its_seed_directory_pass_k_and_the_kept_settings(
        tmp_path, compare_runs):
    root = tmp_path / "cmp"
    run_compare(_base(tmp_path), ["gspo", "hacpo"], [0, 1], str(root), pass_k=4,
                keep={"loss.alpha": 0.5}, echo=lambda *_: None)
    got = [(c.algorithm.name, c.seed, c.out_dir, c.eval_pass_k, c.progress,
            c.algorithm.loss.alpha, resume) for c, resume in compare_runs]
    assert got == [(a, s, str(root / f"{a}-seed{s}"), 4, False, 0.5, True)
                   for a in ("gspo", "hacpo") for s in (0, 1)]


def test_compare_passes_on_a_runs_warnings_only_naming_the_run(tmp_path, compare_runs):
    said = []
    run_compare(_base(tmp_path), ["gspo"], [3], str(tmp_path / "cmp"), pass_k=4,
                echo=said.append)
    assert "[compare] gspo seed 3: [warn] 2 prompts per step, fewer than the 4 minibatches" \
        in said
    assert not any("[eval]" in line or line.startswith("[warn]") for line in said), said


def test_compare_writes_every_seeds_numbers_and_the_accuracy_before_rl(tmp_path, compare_runs):
    root = tmp_path / "cmp"
    res = run_compare(_base(tmp_path), ["gspo", "hacpo"], [0, 1], str(root), pass_k=4,
                      echo=lambda *_: None)
    stored = json.loads((root / "compare.json").read_text())
    assert stored == res
    for algo in ("gspo", "hacpo"):
        assert set(stored[algo]) == {a.policy.name for a in _base(tmp_path).agents}
        for rows in stored[algo].values():
            assert rows == [{"seed": s, "accuracy": ACC[algo] + s / 10,
                             "pass@4": ACC[algo] + s / 10 + 0.125, "before": 0.125}
                            for s in (0, 1)]
    md = (root / "compare.md").read_text()
    assert md == render_table(res, 4)
    assert "| gspo | 30.0 ± 63.5 | 42.5 ± 63.5 |" in md and "char 12.5" in md


def test_compare_reruns_a_run_whose_summary_is_unreadable(tmp_path, compare_runs):
    """A summary.json cut short (a crash while it was written by another version) is not a
    finished run: trained again (resumed), not a JSON traceback."""
    root = tmp_path / "cmp"
    (root / "gspo-seed0").mkdir(parents=True)
    (root / "gspo-seed0" / "summary.json").write_text('{"before": {')
    run_compare(_base(tmp_path), ["gspo"], [0], str(root), pass_k=0, echo=lambda *_: None)
    assert len(compare_runs) == 1


def test_compare_reuses_a_run_whose_config_names_a_file_by_a_relative_path(
        tmp_path, compare_runs, monkeypatch):
    """train stores the config hash with relative file paths made absolute: a finished run
    with ``data.train_path`` relative is reused, not trained again."""
    monkeypatch.chdir(tmp_path)
    for f in ("train.jsonl", "eval.jsonl"):
        (tmp_path / f).write_text("")
    base = _base(tmp_path, **{"data.task": "files", "data.train_path": "train.jsonl",
                              "data.eval_path": "eval.jsonl"})
    said = []
    for _ in range(2):
        run_compare(base, ["gspo"], [0], str(tmp_path / "cmp"), pass_k=0, echo=said.append)
    assert len(compare_runs) == 1 and any("reusing the finished run" in s for s in said), said


def test_compare_stops_before_its_first_run_on_a_request(tmp_path, compare_runs):
    from hacpo.engine.signals import (RunStopped, clear_stop_request, request_stop,
                                      stop_requested)
    request_stop()
    try:
        with pytest.raises(RunStopped):
            run_compare(_base(tmp_path), ["gspo"], [0], str(tmp_path / "cmp"), pass_k=0,
                        echo=lambda *_: None)
        assert compare_runs == [] and not stop_requested()
    finally:                    # a request left over would stop a later test's run
        clear_stop_request()


def test_compare_table_marks_what_a_run_lacks_and_shows_no_interval_for_one_seed():
    """An agent one algorithm has no result for, or a run without pass@k: a dash in its cell
    (the columns stay under their headers); one seed: its mean without a "± nan"."""
    res = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "before": 0.25}]},
           "hacpo": {"a": [{"seed": 0, "accuracy": 0.75, "pass@4": 1.0, "before": 0.25}],
                     "b": [{"seed": 0, "accuracy": 0.5, "pass@4": 0.75, "before": 0.5}]}}
    lines = render_table(res, 4).splitlines()
    assert lines[0] == "| algorithm | a avg@1 | a pass@4 | b avg@1 | b pass@4 | seeds |"
    assert lines[2] == "| gspo | 50.0 | – | – | – | 1 |"
    assert lines[3] == "| hacpo | 75.0 | 100.0 | 50.0 | 75.0 | 1 |"
    assert "nan" not in "\n".join(lines) and "a 25.0, b 50.0." in lines[-1]


def test_with_algorithm_keeps_a_minibatch_count_the_user_set():
    base = load_config("default")
    assert base.algorithm.num_minibatches == 2
    assert with_algorithm(base, "gspo", {"num_minibatches": 4}).algorithm.num_minibatches == 4


def test_compare_plot_is_as_wide_as_its_algorithms_need(tmp_path, monkeypatch):
    import hacpo.engine.compare as compare_mod
    sizes = []
    real = compare_mod.subplots
    monkeypatch.setattr(compare_mod, "subplots",
                        lambda *a, **k: sizes.append(k["figsize"]) or real(*a, **k))
    row = [{"seed": 0, "accuracy": 0.5, "before": 0.25}]
    plot_compare({"gspo": {"a": row}, "grpo": {"a": row}, "hacpo": {"a": row}},
                 str(tmp_path / "compare.png"))
    assert sizes == [(1.6 * 3 + 3, 4)] and (tmp_path / "compare.png").stat().st_size > 0


# -- profile ------------------------------------------------------------------------------
def _row(step, names, algo):
    """A metrics.jsonl row: every stage 0.5 s per agent except generation (0.25 s), a
    reward of 0.3 s; 8 samples trained per agent, 4 of them cross samples under HACPO."""
    r = {"step": step, "time/step": 10.0 + step, "time/reward": 0.3}
    for a in names:
        r.update({f"time/{s}/{a}": 0.5 for s in AGENT_STAGES + UPDATE_PARTS})
        r[f"time/generate/{a}"] = 0.25
        r.update({f"tokens/{t}/{a}": 64.0 for t in ("generated", "scored_self", "scored_cross",
                                                    "forward_self", "forward_cross")})
        r[f"tokens/forward_prompt/{a}"] = 0.0
        r[f"train/{a}/trained_samples"] = 8.0
        r[f"train/{a}/trained_cross"] = 4.0 if algo == "hacpo" else 0.0
    return r


@pytest.fixture
def profile_runs(monkeypatch):
    """``train`` for profile: records (cfg, resume) and writes the rows of the steps up to
    cfg.steps into metrics.jsonl, and a checkpoint."""
    calls = []

    def fake_train(cfg, *, resume=False, echo=print, **_):
        calls.append((cfg, resume))
        echo("[warn] fewer prompts than minibatches")
        names = [a.policy.name for a in cfg.agents]
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        done = sum(1 for _ in open(path)) if os.path.exists(path) else 0
        with open(path, "a") as f:
            for step in range(done, cfg.steps):
                f.write(json.dumps(_row(step, names, cfg.algorithm.name)) + "\n")
        open(os.path.join(cfg.out_dir, trainer_mod.CHECKPOINT), "wb").close()
    monkeypatch.setattr(trainer_mod, "train", fake_train)
    return calls


def test_profile_runs_each_algorithm_round_by_round_as_measured_runs(tmp_path, profile_runs):
    base = _base(tmp_path, eval_every=5, checkpoint_every=10)
    said = []
    run_profile(base, str(tmp_path / "prof"), rounds=2, steps_per_round=3, skip_steps=1,
                keep={"loss.alpha": 0.5}, echo=said.append)
    got = [(c.algorithm.name, c.steps, c.out_dir, resume) for c, resume in profile_runs]
    assert got == [(a, s, str(tmp_path / "prof" / a), True) for a, s in (
        ("gspo", 3), ("gspo2x", 3), ("hacpo", 3), ("gspo2x", 6), ("hacpo", 6), ("gspo", 6))]
    for c, _ in profile_runs:
        assert (c.checkpoint_every, c.profile_sync, c.eval_every, c.eval_pass_k) == (1, True, 0, 0)
        assert (c.progress, c.plots, c.tensorboard) == (False, False, False)
        assert c.algorithm.loss.alpha == 0.5
    assert "[profile] hacpo: [warn] fewer prompts than minibatches" in said
    assert not any(line.startswith("[warn]") for line in said), said


def test_profile_writes_the_measured_steps_of_every_run_and_agent(tmp_path, profile_runs):
    base = _base(tmp_path)
    names = [a.policy.name for a in base.agents]
    rep = run_profile(base, str(tmp_path / "prof"), rounds=2, steps_per_round=2, skip_steps=1,
                      echo=lambda *_: None)
    stored = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert stored == json.loads(json.dumps(rep))
    assert set(stored["measured"]) == {"gspo", "gspo2x", "hacpo"}
    for m in stored["measured"].values():       # steps 1-3 of 0-3: mean time/step 12
        assert (m["steps"], m["step_time"], set(m["agents"])) == (3, 12.0, set(names))
    assert set(stored["agents"]) == set(names)
    assert stored["setup"]["prompts_per_step"] == base.prompts_per_step
    assert stored["setup"]["agents"] == names
    md = (tmp_path / "prof" / "profile.md").read_text()
    # 8 trained samples per agent and 3 agents: 24 per step, 12 s / 24 = 0.5 s each
    assert "| gspo | 3 | 12.00 | 24 | 0.50000 |" in md


def test_profile_refuses_bad_step_counts_before_any_run(tmp_path, profile_runs):
    base = _base(tmp_path)
    with pytest.raises(ValueError, match="skip_steps >= 0"):
        run_profile(base, str(tmp_path / "p"), rounds=1, steps_per_round=1, skip_steps=-1,
                    echo=lambda *_: None)
    with pytest.raises(ValueError, match="leave nothing after skipping 2"):
        run_profile(base, str(tmp_path / "p"), rounds=1, steps_per_round=2, skip_steps=2,
                    echo=lambda *_: None)
    assert profile_runs == [] and not (tmp_path / "p").exists()


def test_profile_is_blocked_only_by_a_checkpointed_run_of_an_algorithm_it_profiles(
        tmp_path, profile_runs):
    """A run of a profiled algorithm with a checkpoint blocks a new profile; another
    algorithm's run (one of the default three included), or a run directory with no checkpoint
    yet, does not."""
    out = tmp_path / "prof"
    (out / "gspo").mkdir(parents=True)                    # created, stopped before a step
    for algo in ("grpo", "gspo2x"):                       # not profiled below
        (out / algo).mkdir()
        (out / algo / "checkpoint.pt").write_bytes(b"")
    run_profile(_base(tmp_path), str(out), algorithms=("gspo", "hacpo"), rounds=1,
                steps_per_round=2, skip_steps=1, echo=lambda *_: None)
    assert [c.algorithm.name for c, _ in profile_runs] == ["gspo", "hacpo"]
    with pytest.raises(FileExistsError, match=f"already holds profile runs \\({out / 'grpo'}\\)"):
        run_profile(_base(tmp_path), str(out), algorithms=("grpo",), rounds=1,
                    steps_per_round=2, skip_steps=1, echo=lambda *_: None)
    assert len(profile_runs) == 2


def test_profile_stops_before_its_first_run_on_a_request(tmp_path, profile_runs):
    from hacpo.engine.signals import (RunStopped, clear_stop_request, request_stop,
                                      stop_requested)
    request_stop()
    try:
        with pytest.raises(RunStopped):
            run_profile(_base(tmp_path), str(tmp_path / "prof"), rounds=1, steps_per_round=2,
                        echo=lambda *_: None)
        assert profile_runs == [] and not stop_requested()
    finally:                    # a request left over would stop a later test's run
        clear_stop_request()


def test_profile_report_extrapolates_over_the_kappas_asked_for():
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 64)}
    ex = build_report(meas, ["a0", "a1"], kappas=(0.5, 2))["extrapolation"]
    assert [k for k, _ in ex["by_kappa"]["2"]] == [0.5, 2]


def test_the_cost_model_predicts_a_steps_time_outside_the_agents_stages():
    """Step time no stage accounts for (data, metrics, bookkeeping) is fitted on GSPO and
    predicted for every run: with 0.7 s of it per step every check still fits."""
    meas = {"gspo": _run(64, 0), "gspo2x": _run(128, 0), "hacpo": _run(64, 64)}
    for m in meas.values():
        m["step_time"] += 0.7
    rep = build_report(meas, ["a0", "a1"])
    assert rep["cost_model"]["overhead_per_step"] == pytest.approx(0.7)
    for algo, chk in rep["model_check"].items():
        assert abs(chk["error"]) < 1e-9, algo


def test_a_ratio_that_no_decode_factor_brings_to_the_target_is_never_reached():
    """With no generation cost to weigh (kappa multiplies nothing) the ratio stays above the
    target at every kappa: "never", not the bisection's last bracket (about 1e9)."""
    import dataclasses

    from hacpo.engine.profile import _num
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 64)}
    model = dataclasses.replace(fit_cost_model(meas["gspo"], ["a0", "a1"],
                                               cross_from=meas["hacpo"]), gen_per_token=0.0)
    assert model.per_sample_ratio(n=2) > 0.75
    assert _num(model.break_even_kappa(n=2, target=0.75)) == "never"


def test_update_time_outside_its_parts_is_never_a_negative_cost():
    """Parts timed a little over their update (clock granularity): nothing outside them, not a
    negative fixed cost per step."""
    meas = {"gspo": _run(64, 0)}
    for d in meas["gspo"]["agents"].values():
        d["update"] -= 0.01
    assert build_report(meas, ["a0", "a1"])["cost_model"]["update_other_per_step"] == 0.0


def test_report_marks_the_per_sample_target_inclusively():
    """A HACPO / GSPO x2 ratio of exactly the 0.75 target is met ("target <= 0.75")."""
    from hacpo.engine.profile import render_report
    rep = {"measured": {}, "agents": {},
           "per_trained_sample": {"ratio": 0.75, "n_agents": 2, "cross_trained": True}}
    assert "**0.75** (target <= 0.75) (met)" in render_report(rep)


def test_report_marks_a_missed_target_as_not_met():
    from hacpo.engine.profile import render_report
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 64)}
    for d in meas["hacpo"]["agents"].values():       # scoring: half of GSPO's agent time
        d["score_cross"], d["retokenize"] = 0.5 * meas["gspo"]["agents"]["a0"]["agent_time"], 0
    assert render_report(build_report(meas, ["a0", "a1"])).count("+50% (not met)") == 2
    rep = {"measured": {}, "agents": {},
           "per_trained_sample": {"ratio": 0.76, "n_agents": 2, "cross_trained": True}}
    assert "**0.76** (target <= 0.75) (not met)" in render_report(rep)


def test_report_table_gives_the_ratio_at_kappa_one_wherever_it_is_in_the_kappas():
    from hacpo.engine.profile import render_report
    meas = {"gspo": _run(64, 0), "hacpo": _run(64, 64)}
    model = fit_cost_model(meas["gspo"], ["a0", "a1"], cross_from=meas["hacpo"])
    md = render_report(build_report(meas, ["a0", "a1"], kappas=(0.25, 1, 4)))
    assert f"| 2 | {model.per_sample_ratio(n=2, kappa=1):.2f} |" in md
    assert "| 2 | - |" in render_report(build_report(meas, ["a0", "a1"], kappas=(0.25, 4)))


def test_report_says_when_the_cross_costs_are_assumed():
    from hacpo.engine.profile import render_report
    md = render_report(build_report({"gspo": _run(64, 0), "hacpo": _run(64, 0)}, ["a0", "a1"]))
    assert ("Cost model fitted on GSPO (NO cross sample was trained: cross costs assumed equal "
            "to self costs)") in md
    md = render_report(build_report({"gspo": _run(64, 0), "hacpo": _run(64, 8)}, ["a0", "a1"]))
    assert "Cost model fitted on GSPO (cross costs measured on HACPO)" in md
