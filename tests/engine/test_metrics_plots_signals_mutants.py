"""Tests from a mutation audit of metrics.py / plots.py / errors.py / signals.py / _stop.py:
each checks a behaviour that a hand-made mutant of those files changed while every other test
passed."""
import errno
import json
import logging
import os
import signal
import sys
import threading
import types

import numpy as np
import pytest

from hacpo.engine.metrics import MetricsLogger, amend_row, read_metrics

from .test_update_mutants import _rows


# --------------------------------------------------------------------------------------------
# metrics.py
# --------------------------------------------------------------------------------------------
def test_a_resume_at_step_1_keeps_the_row_of_step_0(tmp_path):
    """A resume from the checkpoint of step 1 drops the rows logged after it and keeps step 0's
    (the file is not started over as a new run's)."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0, 1, 2])
    log = MetricsLogger(str(tmp_path), start_step=1, tensorboard=False)
    assert log.dropped == [1, 2]
    log.log(1, {"loss": 0.25})
    log.close()
    assert read_metrics(str(path)) == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.25}]


def test_a_resume_over_blank_lines_keeps_every_row(tmp_path):
    """Blank lines (an editor's, or a trailing one) are no rows: the resume passes over them
    and so does read_metrics, not an error naming a line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n\n" for s in (0, 1, 2)) + "  \n")
    assert [r["step"] for r in read_metrics(str(path))] == [0, 1, 2]
    MetricsLogger(str(tmp_path), start_step=2, tensorboard=False).close()
    assert [r["step"] for r in read_metrics(str(path))] == [0, 1]


@pytest.mark.parametrize("line, error", [('{"loss": 0.5}', "KeyError: 'step'"),
                                         ("[0, 1]", "TypeError: list indices must be")])
def test_a_resume_over_a_line_not_a_row_names_the_line(tmp_path, line, error):
    """A JSON line that is not a row (no "step", not an object) is a ValueError naming the file
    and line, as a line that is not JSON is (not a KeyError / TypeError traceback)."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0], last=line + "\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=rf"metrics\.jsonl:line 2 is not a metrics row "
                                         rf"\({error}"):
        MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)


def test_warned_missing_steps_are_single_steps_and_spans(tmp_path, caplog):
    """The resume's warning lists missing steps as "1, 3-4": a step on its own is not
    "1-1"."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 2, 5)))
    with caplog.at_level(logging.WARNING):
        MetricsLogger(str(tmp_path), start_step=7, tensorboard=False).close()
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"{path} holds no rows of steps 1, 3-4, 6 (of the 7 before"), said


def test_amend_row_without_a_file_or_past_an_unreadable_line(tmp_path):
    """amend_row: False for a metrics file that is not there (nothing made); a line that is not
    JSON before the step's row is passed over, the row amended and that line kept."""
    path = tmp_path / "metrics.jsonl"
    assert not amend_row(str(path), 0, {"eval/a/accuracy": 0.5})
    assert not path.exists()
    path.write_text('{"step": 0, "lo\n' + json.dumps({"step": 1}) + "\n")
    assert amend_row(str(path), 1, {"eval/a/accuracy": 0.5})
    assert path.read_text().splitlines() == ['{"step": 0, "lo',
                                             json.dumps({"step": 1, "eval/a/accuracy": 0.5})]


# --------------------------------------------------------------------------------------------
# plots.py
# --------------------------------------------------------------------------------------------
@pytest.fixture
def figures(monkeypatch):
    """plot_run's figures by file name, as it saves them (the files are written too)."""
    pytest.importorskip("matplotlib")
    from hacpo.engine import plots

    saved = {}
    real = plots.save_figure

    def keep(fig, path):
        saved[os.path.basename(path)] = fig
        real(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    return saved


def _lines(ax) -> dict:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
            for ln in ax.get_lines()}


def _metrics(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_reward_curves_plot_each_agents_reward_and_its_moving_average(tmp_path, figures):
    """Each agent's reward/<name> per step, labelled with its name, and its moving average over
    the last min(10, steps) steps (none for a single step); no capability-ratio plot for a run
    without omega/ keys (one agent)."""
    from hacpo.engine.plots import plot_run

    for n, k in ((12, 10), (2, 2)):
        _metrics(tmp_path, [{"step": s, "reward/a": float(s), "reward/b": float(s * s)}
                            for s in range(n)])
        figures.clear()
        written = plot_run(str(tmp_path), ["a", "b"])
        assert written == [str(tmp_path / "reward_curves.png")]
        assert list(figures) == ["reward_curves.png"]
        got = _lines(figures["reward_curves.png"].axes[0])
        steps = list(range(n))
        assert list(got) == ["a", f"a (moving avg {k})", "b", f"b (moving avg {k})"]
        assert got["a"] == (steps, [float(s) for s in steps])
        assert got["b"] == (steps, [float(s * s) for s in steps])
        assert got[f"a (moving avg {k})"][0] == steps[k - 1:]
        assert got[f"a (moving avg {k})"][1] == pytest.approx(
            [sum(range(i - k + 1, i + 1)) / k for i in steps[k - 1:]])
    _metrics(tmp_path, [{"step": 0, "reward/a": 0.5}])
    plot_run(str(tmp_path), ["a"])
    assert list(_lines(figures["reward_curves.png"].axes[0])) == ["a"]


def test_capability_ratios_plot_each_omega_on_a_log_scale(tmp_path, figures):
    from hacpo.engine.plots import plot_run

    _metrics(tmp_path, [{"step": s, "reward/a": 0.0, "reward/b": 0.0, "omega/b->a": 2.0,
                         "omega/a->b": 1.0 + s} for s in range(3)])
    plot_run(str(tmp_path), ["a", "b"])
    ax = figures["capability_ratios.png"].axes[0]
    assert ax.get_yscale() == "log"
    assert _lines(ax) == {"a->b": ([0, 1, 2], [1.0, 2.0, 3.0]),
                          "b->a": ([0, 1, 2], [2.0, 2.0, 2.0])}
    assert [ln.get_label() for ln in ax.get_lines()] == ["a->b", "b->a"]


def test_ratio_histograms_are_each_learners_densities_of_its_parts(tmp_path, figures):
    """One panel per learner, titled with its name, in the order given: a density (area 1) per
    part with samples, labelled with its count; a part without samples is no series. Without
    metrics rows (a run of 0 steps) only the histograms are written; without the counts file,
    no histograms."""
    from hacpo.engine.plots import RATIO_EDGES, RATIO_FILE, plot_run

    counts = {"a/self": np.arange(80), "a/cross": np.zeros(80, dtype=np.int64),
              "b/self": np.ones(80, dtype=np.int64), "b/cross": np.eye(80, dtype=np.int64)[3]}
    np.savez(tmp_path / RATIO_FILE, edges=RATIO_EDGES, **counts)
    _metrics(tmp_path, [])
    assert plot_run(str(tmp_path), ["a", "b"]) == [str(tmp_path / "ratio_histograms.png")]
    axes = figures["ratio_histograms.png"].axes
    assert [ax.get_title() for ax in axes] == ["learner a: sequence ratio s",
                                               "learner b: sequence ratio s"]
    parts = [{p.get_label(): p.get_data() for p in ax.patches} for ax in axes]
    assert list(parts[0]) == [f"self (n={sum(range(80))})"]
    assert list(parts[1]) == ["self (n=80)", "cross (n=1)"]
    for series in parts:
        for values, edges, _ in series.values():
            assert np.array_equal(edges, RATIO_EDGES)
            assert float(np.sum(values * np.diff(edges))) == pytest.approx(1.0)
    os.remove(tmp_path / RATIO_FILE)
    _metrics(tmp_path, [{"step": 0, "reward/a": 0.5}])
    assert plot_run(str(tmp_path), ["a"]) == [str(tmp_path / "reward_curves.png")]


def test_ratio_counts_put_ratios_above_the_range_in_the_last_bin():
    from hacpo.engine.plots import ratio_counts

    c = ratio_counts(np.log([0.01, 1.0, 2.49, 3.0, 1e6]))
    assert c.shape == (80,) and c.sum() == 5
    assert (c[0], c[32], c[-1]) == (1, 1, 3)


def test_a_matplotlib_that_cannot_be_imported_is_one_line():
    """An installed matplotlib that fails to import (ImportError, not ModuleNotFoundError: a
    version without what hacpo imports) is one line, as a missing one is."""
    from hacpo.engine.plots import plot_or_say

    def plot(data, path):
        raise ImportError("cannot import name 'FigureCanvasAgg'")

    said = []
    plot_or_say(plot, {}, "runs/c/compare.png", said.append, "compare.md")
    assert said == ["[plots] not written: runs/c/compare.png needs the Python package "
                    "matplotlib, which cannot be imported (ImportError: cannot import name "
                    "'FigureCanvasAgg'): pip install matplotlib (compare.md are complete)"]


# --------------------------------------------------------------------------------------------
# signals.py, _stop.py
# --------------------------------------------------------------------------------------------
def test_signals_deferred_handles_the_first_signal_once():
    """Signals held back by signals_deferred (SIGUSR1 three times, then SIGUSR2) are handled
    once at the end: the first one's handler, once (a KeyboardInterrupt raised once, not a
    handler run per signal)."""
    from hacpo.engine.signals import signals_deferred

    got = []
    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum))
                for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        with signals_deferred(signal.SIGUSR1, signal.SIGUSR2):
            for sig in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2):
                signal.raise_signal(sig)
            assert got == []
        assert got == [signal.SIGUSR1]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_record_checkpoint_signal_makes_sigusr1_a_stop_request_in_the_main_thread_only():
    """record_checkpoint_signal: a request left from before is dropped and SIGUSR1 requests a
    stop from then on; off the main thread it does nothing (its handler stays)."""
    from hacpo._stop import (CHECKPOINT_SIGNAL, clear_stop_request, record_checkpoint_signal,
                             request_stop, stop_requested)

    def other(signum, frame):      # not the default action, which ends the process
        pass

    previous = signal.signal(CHECKPOINT_SIGNAL, other)
    try:
        t = threading.Thread(target=record_checkpoint_signal)
        t.start()
        t.join()
        assert signal.getsignal(CHECKPOINT_SIGNAL) is other
        request_stop()
        record_checkpoint_signal()
        assert not stop_requested()
        signal.raise_signal(CHECKPOINT_SIGNAL)
        assert stop_requested()
    finally:
        clear_stop_request()
        signal.signal(CHECKPOINT_SIGNAL, previous)


# --------------------------------------------------------------------------------------------
# errors.py
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kinds, error, marked", [
    ((ValueError,), KeyError("k"), False), ((ValueError,), ValueError("v"), True),
    ((), KeyError("k"), True), ((), TypeError("t"), False)])
def test_user_errors_marks_the_types_it_is_given_only(kinds, error, marked):
    """user_errors(ValueError) marks a ValueError only (a KeyError is a bug's); with no types,
    the setup errors (SETUP_ERRORS), not a TypeError."""
    from hacpo.engine.errors import is_user_error, user_errors

    with pytest.raises(type(error)) as e:
        with user_errors(*kinds):
            raise error
    assert is_user_error(e.value) == marked


@pytest.mark.parametrize("module, name, said", [
    ("pyarrow.parquet", "pyarrow.parquet",
     "the Python package pyarrow, which is not installed: pip install pyarrow"),
    ("transformers", "tokenizers", "the Python package tokenizers, which is not installed: "
                                   "pip install transformers==5.19.0"),
    ("transformers", "sentencepiece", "the Python package transformers, which cannot be "
                                      "imported (ModuleNotFoundError: No module named "
                                      "'sentencepiece'): pip install sentencepiece"),
])
def test_missing_package_names_what_to_install(module, name, said):
    """A missing submodule names its package; a missing package that hacpo knows (one of PIP)
    is itself not installed; another one missing inside the package is that package broken."""
    from hacpo.engine.errors import missing_package

    e = ModuleNotFoundError(f"No module named {name!r}", name=name)
    assert missing_package(module, "x", e) == f"x needs {said}"


def test_require_installed_takes_a_module_without_a_spec_for_missing(monkeypatch):
    """find_spec raises ValueError for a module in sys.modules whose __spec__ is None: that is
    no installed package (the error saying so), not a ValueError traceback."""
    from hacpo.engine.errors import MissingPackageError, require_installed

    monkeypatch.setitem(sys.modules, "hacpo_no_spec", types.ModuleType("hacpo_no_spec"))
    with pytest.raises(MissingPackageError, match=r"^x=1 needs the Python package "
                                                  r"hacpo_no_spec, which is not installed"):
        require_installed("hacpo_no_spec", "x=1")


def test_storage_error_like_a_storage_error_keeps_its_kind():
    """A StorageError made again with another message (a caller adding what was kept) is still
    the OSError subclass it was (FileNotFoundError: what callers catch), with its errno."""
    from hacpo.engine.errors import StorageError

    first = StorageError.like(FileNotFoundError(errno.ENOENT, "gone"), "cannot write a", "a")
    again = StorageError.like(first, "cannot write b", "b")
    assert isinstance(again, FileNotFoundError) and isinstance(again, StorageError)
    assert (str(again), again.errno, again.filename) == ("cannot write b", errno.ENOENT, "b")


def test_os_error_in_follows_runtime_errors_only():
    """The OSError a RuntimeError was raised from or while handling (torch.save's "unexpected
    pos"); another error raised while handling one is not a storage error."""
    from hacpo.engine.errors import os_error_in

    full = OSError(errno.ENOSPC, "No space left on device")
    for other in (RuntimeError, ValueError):
        try:
            try:
                raise full
            except OSError:
                raise other("unexpected pos")
        except Exception as e:
            assert os_error_in(e) is (full if other is RuntimeError else None), other


@pytest.mark.parametrize("code, said", [
    (errno.EDQUOT, "Disk quota exceeded (the disk quota is used up)"),
    (errno.EFBIG, "File too large (a file-size limit: ulimit -f, or the file system's)"),
    (errno.EIO, "Input/output error")])
def test_describe_os_error_says_what_a_storage_errno_means(code, said):
    from hacpo.engine.errors import describe_os_error

    assert describe_os_error(OSError(code, os.strerror(code))) == said


def test_an_io_error_writing_a_named_file_is_one_line():
    """EIO (a failing disk, a network file system gone) writing a named file is a refused
    write: the command's one line, not a traceback."""
    from hacpo.launch.cli import _storage_message

    e = OSError(errno.EIO, "Input/output error", "runs/x/metrics.jsonl")
    assert _storage_message(e, "compare") == (
        "runs/x/metrics.jsonl: Input/output error (OSError: [Errno 5] Input/output error: "
        "'runs/x/metrics.jsonl')")
