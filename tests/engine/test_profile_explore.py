"""hacpo profile's report on degenerate measurements, found by using it: a run whose steps
trained no sample (every response empty, so every sample was dropped)."""
import pytest

from hacpo.engine.profile import build_report, render_report, run_profile
from hacpo.engine.run_config import load_config

from .test_profile import _run


def _trained_nothing(run):
    """``run`` with its stage times kept but no sample trained (no token scored)."""
    for d in run["agents"].values():
        for k in ("trained_samples", "trained_cross", "generated_samples"):
            d[k] = 0.0
        for k in [k for k in d if k.startswith("tokens_")]:
            d[k] = 0.0
    run["trained_samples"] = 0.0
    return run


@pytest.mark.parametrize("algo", ["gspo", "gspo2x", "hacpo"])
def test_a_run_that_trained_no_sample_has_no_time_per_trained_sample(algo):
    """The report is written (it was a ZeroDivisionError after every run had been measured,
    and the runs then blocked a new profile of that --out-dir): the time per trained sample
    of that run is a dash, and the HACPO / GSPO x2 ratio (or, for GSPO, the cost model: its
    per-token costs were all 0) says why it is not measured."""
    meas = {"gspo": _run(8, 0), "gspo2x": _run(16, 0), "hacpo": _run(8, 8)}
    _trained_nothing(meas[algo])
    rep = build_report(meas, ["a0", "a1"])
    md = render_report(rep)
    row = next(line for line in md.splitlines() if line.startswith(f"| {algo} | 5 |"))
    assert row.endswith(" | 0 | – |"), row
    if algo == "gspo":            # HACPO and GSPO x2 both trained: their ratio stands
        assert "ratio" in rep["per_trained_sample"]
        # no token to fit per-token costs on: no model of zeros, no extrapolation from it
        assert "cost_model" not in rep and "extrapolation" not in rep
        assert "Cost model: not fitted (gspo trained no sample)" in md
    else:
        assert rep["per_trained_sample"] == {"not_measured": f"{algo} trained no sample"}
        assert (f"HACPO wall time per trained sample / GSPO x2's: not measured ({algo} "
                f"trained no sample)") in md


@pytest.mark.parametrize("algorithms, why", [
    (["gspo", "hacpo", "gspo"], "algorithm gspo given more than once; each algorithm is one "
                                "run directory, list it once"),
    ([], "hacpo profile needs at least one algorithm")])
def test_a_repeated_or_missing_algorithm_is_refused_before_any_run(tmp_path, algorithms, why):
    """`hacpo profile --algorithms gspo hacpo gspo` measured gspo once and said nothing (hacpo
    compare refuses it); no algorithm at all (the Python API) was a ZeroDivisionError."""
    base = load_config("tiny3", overrides={"out_dir": str(tmp_path / "unused")})
    with pytest.raises(ValueError, match=f"^{why}$"):
        run_profile(base, str(tmp_path / "p"), algorithms=algorithms, echo=lambda *_: None)
    assert not (tmp_path / "p").exists()
