"""benchmarks/bench_algorithms.py at a tiny size: the printed numbers are the JSON's, the
vectorized functions agree with the loop, and sizes it cannot run are a usage error."""
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import bench_algorithms  # noqa: E402


def test_printed_numbers_are_the_json_ones(tmp_path, capsys):
    out = tmp_path / "r.json"
    bench_algorithms.main(["--n-samples", "2000", "--agents", "2", "--group", "4",
                           "--repeat", "3", "--json", str(out)])
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["N"] == 2000 and f"N={r['N']:,} samples" in text
    for name in ("advantages", "loss_fwd_bwd"):
        d = r[name]
        assert d["vectorized_p20_s"] <= d["vectorized_p50_s"] <= d["vectorized_p80_s"]
        assert d["speedup"] == pytest.approx(d["python_loop_s"] / d["vectorized_p50_s"])
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name))
        m = re.search(r"= +([\d.]+) / +([\d.]+) / +([\d.]+) ms +python loop = +([\d.]+) ms",
                      line)
        shown = [float(x) for x in m.groups()]
        assert shown == [round(1e3 * d[k], 1) for k in ("vectorized_p20_s", "vectorized_p50_s",
                                                         "vectorized_p80_s", "python_loop_s")]
    assert r["advantages"]["max_abs_diff"] < 1e-4
    assert r["loss_fwd_bwd"]["grad_max_abs_diff"] < 1e-6


@pytest.mark.parametrize("args, says", [
    (["--n-samples", "10"], "less than one prompt's samples"),
    (["--n-samples", "100", "--repeat", "0"], "--repeat must be >= 1"),
    (["--agents", "0"], "--agents and --group must be >= 1"),
])
def test_sizes_it_cannot_run_are_usage_errors(args, says, capsys):
    """Were a ValueError from the capability tracker (N rounded down to 0 samples) and an
    IndexError (no timed repetition) after the work had started."""
    with pytest.raises(SystemExit) as e:
        bench_algorithms.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err
