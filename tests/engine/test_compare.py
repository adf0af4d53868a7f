"""hacpo compare on the tiny preset: table with mean ± CI per agent, plot, shared warm-up."""
import json
import math

from hacpo.engine.compare import mean_ci, render_table, run_compare
from hacpo.engine.run_config import load_config


def test_mean_ci_by_hand():
    m, ci = mean_ci([0.5, 0.7, 0.6])
    # mean 0.6, sd 0.1, t(2) = 4.303 -> 4.303 * 0.1 / sqrt(3)
    assert math.isclose(m, 0.6) and math.isclose(ci, 4.303 * 0.1 / math.sqrt(3), rel_tol=1e-9)
    assert math.isnan(mean_ci([0.3])[1])


def test_render_table_numbers():
    res = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "pass@4": 0.9, "before": 0.4},
                          {"seed": 1, "accuracy": 0.7, "pass@4": 0.7, "before": 0.4}]}}
    t = render_table(res, 4)
    ci = 12.706 * math.sqrt(0.02) / math.sqrt(2) * 100
    assert f"| gspo | 60.0 ± {ci:.1f} | 80.0 ± {ci:.1f} | 2 |" in t
    assert "a 40.0" in t


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
