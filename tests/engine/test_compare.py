"""hacpo compare on the tiny preset: table with mean ± CI per agent, plot, shared warm-up."""
import json
import math

import pytest

from hacpo.engine.compare import mean_ci, render_table, run_compare, with_algorithm
from hacpo.engine.run_config import load_config


def test_mean_ci_by_hand():
    m, ci = mean_ci([0.5, 0.7, 0.6])
    # mean 0.6, sd 0.1, t(2) = 4.303 -> 4.303 * 0.1 / sqrt(3)
    assert math.isclose(m, 0.6) and math.isclose(ci, 4.303 * 0.1 / math.sqrt(3), rel_tol=1e-9)
    assert math.isnan(mean_ci([0.3])[1])


def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """Student-t CDF at x >= 0 from its density (Simpson's rule over [0, x])."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda u: c * (1 + u * u / df) ** (-(df + 1) / 2)
    h = x / steps
    s = f(0) + f(x) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


def test_t95_is_the_two_sided_95_quantile_or_a_conservative_one():
    """Each tabulated t is the 97.5% quantile of Student t (to its 3 decimals); a df between
    table rows uses the next lower row's, a wider interval, never a narrower one."""
    from hacpo.engine.compare import _T95, t95
    for df, t in _T95.items():
        assert abs(_t_cdf(t, df) - 0.975) < 5e-5, (df, t)
    for df in range(1, 41):
        assert _t_cdf(t95(df), df) > 0.975 - 5e-5, df
    assert math.isnan(t95(0))


def test_render_table_numbers():
    res = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "pass@4": 0.9, "before": 0.4},
                          {"seed": 1, "accuracy": 0.7, "pass@4": 0.7, "before": 0.4}]}}
    t = render_table(res, 4)
    ci = 12.706 * math.sqrt(0.02) / math.sqrt(2) * 100
    assert f"| gspo | 60.0 ± {ci:.1f} | 80.0 ± {ci:.1f} | 2 |" in t
    assert "a 40.0" in t


def test_render_table_without_pass_k():
    """pass_k 0 or 1 (no sampled evaluation): no pass@k column of dashes, no pass@k note."""
    res = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "before": 0.4},
                          {"seed": 1, "accuracy": 0.7, "before": 0.4}]}}
    for k in (0, 1):
        t = render_table(res, k)
        assert t.splitlines()[:2] == ["| algorithm | a avg@1 | seeds |", "| --- | --- | --- |"]
        ci = 12.706 * math.sqrt(0.02) / math.sqrt(2) * 100
        assert f"| gspo | 60.0 ± {ci:.1f} | 2 |" in t
        assert "pass@" not in t and "–" not in t


def test_compare_runs_and_writes_table(tmp_path):
    base = load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache"),
                                           "threads": 1, "plots": False, "tensorboard": False})
    root = tmp_path / "cmp"
    res = run_compare(base, ["gspo", "hacpo"], [0, 1], str(root), pass_k=2, echo=lambda *_: None)
    assert set(res) == {"gspo", "hacpo"}
    for algo in res:
        for agent, rows in res[algo].items():
            assert [r["seed"] for r in rows] == [0, 1]
            assert 0 <= rows[0]["accuracy"] <= 1 and "pass@2" in rows[0]
    # one warm-up per agent, shared by all four runs
    assert len(list((tmp_path / "cache").glob("warmup-*.pt"))) == 3
    md = (root / "compare.md").read_text()
    assert md.startswith("| algorithm |") and "| hacpo |" in md and "| gspo |" in md
    assert (root / "compare.png").stat().st_size > 0
    assert json.loads((root / "compare.json").read_text()).keys() == {"gspo", "hacpo"}
    # the algorithm really differs between runs
    cfg_g = json.loads((root / "gspo-seed0" / "config.json").read_text())
    assert cfg_g["algorithm"]["name"] == "gspo" and cfg_g["seed"] == 0


def test_compare_reuses_only_runs_finished_with_the_same_config(tmp_path):
    """A finished run is reused only when its config.json is this config; more steps resume
    it; an unknown algorithm is an error before any run starts."""
    base = load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache"),
                                           "threads": 1, "plots": False, "tensorboard": False})
    root = tmp_path / "cmp"
    with pytest.raises(ValueError, match="unknown algorithm preset 'nosuch'"):
        run_compare(base, ["gspo", "nosuch"], [0], str(root), pass_k=0, echo=lambda *_: None)
    assert not root.exists()
    said = []
    first = run_compare(base, ["gspo"], [0], str(root), pass_k=0, echo=said.append)
    again = run_compare(base, ["gspo"], [0], str(root), pass_k=0, echo=said.append)
    assert again == first and any("reusing the finished run" in line for line in said)
    said = []
    run_compare(base.override({"steps": 2}), ["gspo"], [0], str(root), pass_k=0,
                echo=said.append)
    assert f"[compare] gspo seed 0 -> {root / 'gspo-seed0'}" in said
    rows = [json.loads(line) for line in open(root / "gspo-seed0" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]                  # resumed to the new budget
    assert json.load(open(root / "gspo-seed0" / "summary.json"))["steps"] == 2
    with pytest.raises(ValueError, match=r"cannot resume .* rollout\.group_size"):
        run_compare(base.override({"steps": 2, "rollout.group_size": 3}), ["gspo"], [0],
                    str(root), pass_k=0, echo=lambda *_: None)
    with pytest.raises(ValueError, match="no held-out set"):
        run_compare(base.override({"data.eval_size": 0}), ["gspo"], [0], str(tmp_path / "x"),
                    echo=lambda *_: None)


def test_with_algorithm_keeps_the_budget_and_the_users_overrides():
    base = load_config("default")                 # hacpo, tuned to 2 minibatches
    assert base.algorithm.num_minibatches == 2
    g = with_algorithm(base, "gspo")
    assert (g.algorithm.name, g.algorithm.num_minibatches) == ("gspo", 2)
    h = with_algorithm(base, "hacpo", {"loss.alpha": 0.5, "capability.window": 2})
    assert (h.algorithm.loss.alpha, h.algorithm.capability.window) == (0.5, 2)
    # an ablation keeps what makes it one (before: the run's minibatch order overrode it)
    assert with_algorithm(base, "hacpo-self-first").algorithm.minibatch_order == "self_first"
    assert with_algorithm(base, "hacpo-table5").algorithm.loss.cross_clip_delta == 0.8
    with pytest.raises(ValueError, match="algorithm.name='grpo' conflicts"):
        with_algorithm(base, "gspo", {"name": "grpo"})


def test_compare_refuses_a_seed_or_algorithm_listed_twice(tmp_path):
    """``--seeds 0 0`` would train one run and count it twice (2 seeds, CI +- 0.0): an error
    naming the duplicate, before any run starts."""
    base = load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache"),
                                           "threads": 1, "plots": False, "tensorboard": False})
    root = tmp_path / "cmp"
    with pytest.raises(ValueError, match="seed 0 given more than once"):
        run_compare(base, ["gspo"], [0, 1, 0], str(root), pass_k=0, echo=lambda *_: None)
    with pytest.raises(ValueError, match="algorithm gspo given more than once"):
        run_compare(base, ["gspo", "hacpo", "gspo"], [0], str(root), pass_k=0,
                    echo=lambda *_: None)
    with pytest.raises(ValueError, match="at least one seed"):
        run_compare(base, ["gspo"], [], str(root), pass_k=0, echo=lambda *_: None)
    with pytest.raises(ValueError, match=r"--accept-encoding-change 'nosuch': not an agent of "
                                         r"this run \(its agents: char, qwen3, llama\)"):
        run_compare(base, ["gspo"], [0], str(root), pass_k=0, accept_encoding_change=["nosuch"],
                    echo=lambda *_: None)
    assert not root.exists()


def test_compare_into_a_file_is_a_user_error(tmp_path):
    """--out-dir naming a file: an error naming it (was a FileExistsError traceback), the file
    untouched."""
    from hacpo.engine.errors import is_user_error
    base = load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache")})
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(ValueError, match=r"notes\.txt is a file") as e:
        run_compare(base, ["gspo"], [0], str(f), pass_k=0, echo=lambda *_: None)
    assert is_user_error(e.value) and f.read_text() == "mine"


def test_compare_resumes_a_run_whose_chat_template_changed_only_when_told(tmp_path):
    """A run compare resumes (more steps) after an agent's chat template was edited in its
    tokenizer folder: train's refusal, naming the flag; with accept_encoding_change (``hacpo
    compare --accept-encoding-change``) it goes on, the [warn] line said with the run's prefix
    and the change recorded in its checkpoint; a finished run reused is not trained again."""
    import dataclasses
    import shutil

    from hacpo.engine import checkpoint as ckpt
    from hacpo.models import tokenizer as tokmod
    folder = tmp_path / "qwen3-files"
    shutil.copytree(tokmod.tokenizer_path("qwen3"), folder)
    base = load_config("tiny3", overrides={"steps": 1, "cache_dir": str(tmp_path / "cache"),
                                           "threads": 1, "plots": False, "tensorboard": False,
                                           "agents.1.policy.tokenizer": str(folder)})
    base = dataclasses.replace(base, agents=base.agents[:2])       # char and qwen3: faster
    root = tmp_path / "cmp"
    quiet = lambda *_: None
    run_compare(base, ["gspo"], [0], str(root), pass_k=0, echo=quiet)
    conf = folder / "tokenizer_config.json"
    spec = json.loads(conf.read_text())
    spec["chat_template"] = spec["chat_template"].replace("<|im_start|>", "<|im_start|>" * 2)
    conf.write_text(json.dumps(spec))
    tokmod._load_hf.cache_clear()                  # as a new process reads the folder again
    said = []                                      # finished with this config: reused as is
    run_compare(base, ["gspo"], [0], str(root), pass_k=0, accept_encoding_change=True,
                echo=said.append)
    assert not any("accepted" in s for s in said)
    longer = base.override({"steps": 2})
    with pytest.raises(ValueError, match=r"^cannot resume .*gspo-seed0/checkpoint\.pt: agent "
                                         r"qwen3's prompts are not encoded as when its .*pass "
                                         r"--accept-encoding-change qwen3 to go on"):
        run_compare(longer, ["gspo"], [0], str(root), pass_k=0, echo=quiet)
    said = []
    run_compare(longer, ["gspo"], [0], str(root), pass_k=0, accept_encoding_change=["qwen3"],
                echo=said.append)
    accepted = [s for s in said if "accepted" in s]
    assert len(accepted) == 1 and accepted[0].startswith(
        "[compare] gspo seed 0: [warn] agent qwen3's prompts are not encoded as when its "
        "weights were trained") and accepted[0].endswith(
        "accepted (--accept-encoding-change): from step 1 on, agent qwen3 trains on prompts "
        "encoded by its tokenizer as it is now")
    state = ckpt.load(str(root / "gspo-seed0" / "checkpoint.pt"))
    assert state["step"] == 2 and state["encoding_changes"] == [{"agent": "qwen3", "step": 1}]
