"""The PNG plots of train / compare / profile (and bench_logprobs) leave the caller's matplotlib
alone: its backend (a notebook's inline one, QtAgg) and pyplot's list of open figures."""
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")


@pytest.fixture
def users_pyplot():
    """pyplot as a user holds it: a backend other than Agg and one figure of their own open."""
    import matplotlib
    import matplotlib.pyplot as plt
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    mine = plt.figure()
    yield plt
    plt.close(mine)
    matplotlib.use(before)


def _png_shape(path) -> tuple:
    from matplotlib.image import imread
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), path
    return imread(str(path)).shape[:2]


def _profile_report() -> dict:
    from hacpo.engine.profile import AGENT_STAGES, UPDATE_PARTS
    stages = AGENT_STAGES[:-2] + UPDATE_PARTS + ("sync",)
    agents = {a: {s: 0.1 for s in stages} for a in ("char", "qwen3")}
    pts = [[0.5, 1.2], [1, 0.9], [2, 0.7]]
    return {"measured": {"hacpo": {"agents": agents}, "gspo": {"agents": agents}},
            "extrapolation": {"by_kappa": {"2": pts}, "by_response_len": {"2": pts}}}


def test_plots_keep_the_callers_backend_and_figures(tmp_path, users_pyplot):
    import matplotlib

    from benchmarks import bench_logprobs
    from hacpo.engine.compare import plot_compare
    from hacpo.engine.plots import RATIO_EDGES, RATIO_FILE, plot_run
    from hacpo.engine.profile import plot_profile
    plt = users_pyplot
    figs = plt.get_fignums()
    names = ["char", "qwen3"]
    rows = [{"step": s, **{f"reward/{n}": 0.1 * s for n in names}, "omega/char,qwen3": 1.0 + s}
            for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = {f"{n}/{k}": np.arange(80) for n in names for k in ("self", "cross")}
    np.savez(tmp_path / RATIO_FILE, edges=RATIO_EDGES, **counts)
    written = plot_run(str(tmp_path), names)
    assert sorted(p.rsplit("/", 1)[1] for p in written) == [
        "capability_ratios.png", "ratio_histograms.png", "reward_curves.png"]
    results = {algo: {a: [{"accuracy": 0.5, "before": 0.4}, {"accuracy": 0.6, "before": 0.4}]
                      for a in names} for algo in ("hacpo", "gspo")}
    plot_compare(results, str(tmp_path / "compare.png"))
    plot_profile(_profile_report(), str(tmp_path / "profile.png"))
    bench_rows = [{"op": "logits", "impl": i, "mode": m, "p50_ms": 1.0, "extra_MB": 2.0}
                  for i in ("naive", "torch") for m in bench_logprobs.MODES]
    bench_logprobs.plot(bench_rows, str(tmp_path / "results.png"), {"cpu": "x", "torch": "2"})
    assert matplotlib.get_backend() == "svg"
    assert plt.get_fignums() == figs
    # each figure's size at its dpi (110; bench_logprobs 100), as with pyplot's figures
    assert _png_shape(tmp_path / "reward_curves.png") == (440, 770)
    assert _png_shape(tmp_path / "capability_ratios.png") == (440, 770)
    assert _png_shape(tmp_path / "ratio_histograms.png") == (396, 1100)
    assert _png_shape(tmp_path / "compare.png") == (440, int(110 * (1.6 * 2 + 3)))
    assert _png_shape(tmp_path / "profile.png") == (495, 1760)
    assert _png_shape(tmp_path / "results.png") == (400, 1200)
