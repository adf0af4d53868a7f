"""A Ctrl-C or SIGTERM whose exception Python dropped: a signal's handler runs between any two
bytecodes of the main thread, a finalizer's or a garbage-collector callback's too, where its
KeyboardInterrupt / SystemExit is printed ("Exception ignored in: <WeakKeyDictionary ...>")
and dropped. Found by interrupting `hacpo compare` (1 of 4 Ctrl-Cs): it went on through all
its runs and exited 0. The handlers the CLI installs record the signal (hacpo._stop); one
recorded but never seen unwinding is raised again at the run's next step end, between
compare's runs, before eval's next pair, or when the command returns."""
import argparse
import signal
import sys

import pytest

from hacpo import _stop
from hacpo.launch.cli import TERMINATED, _stoppable


class _SignalOnFree:
    def __init__(self, sig):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)     # its handler's exception: raised here, dropped


@pytest.fixture
def dropped(monkeypatch):
    """The exceptions Python drops (sys.unraisablehook), with SIGINT's Python default handler
    (a background job, as CI runs the tests, starts with SIGINT ignored)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield seen
    signal.signal(signal.SIGINT, prev)


def _signal_dropped(sig) -> None:
    _SignalOnFree(sig)                    # freed at once: its __del__ runs here


def test_a_dropped_ctrl_c_or_sigterm_still_stops_the_command(dropped, capsys):
    def cut(sig):
        def func(args):
            _signal_dropped(sig)
            return 0                      # the command went on and finished
        return func

    args = argparse.Namespace(command="eval")
    assert _stoppable(args, cut(signal.SIGINT)) == 130
    assert dropped == [KeyboardInterrupt]
    assert capsys.readouterr().err == "hacpo eval: interrupted (Ctrl-C)\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler     # put back
    with pytest.raises(SystemExit) as e:
        _stoppable(args, cut(signal.SIGTERM))
    assert e.value.code == TERMINATED and dropped == [KeyboardInterrupt, SystemExit]
    assert capsys.readouterr().err == "hacpo eval: terminated (SIGTERM)\n"


def test_a_ctrl_c_the_command_saw_is_not_raised_again(dropped, capsys):
    def ctrl_c(args):
        signal.raise_signal(signal.SIGINT)
    args = argparse.Namespace(command="eval")
    assert _stoppable(args, ctrl_c) == 130
    assert capsys.readouterr().err == "hacpo eval: interrupted (Ctrl-C)\n"
    assert _stoppable(args, lambda a: 0) == 0 and capsys.readouterr().err == ""
    assert dropped == [] and _stop.lost_interrupt() is None


def test_outside_a_command_a_dropped_signal_is_not_raised_again(dropped, capsys):
    """The library called from Python (a test, a notebook) with the CLI's handler installed:
    nothing is raised again later (a train() after it stopped at its first step), and the
    next command starts with none."""
    before = signal.signal(signal.SIGTERM, _stop.raise_terminated)
    try:
        _signal_dropped(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert dropped == [SystemExit] and _stop.lost_interrupt() is None
    _stop.raise_lost_interrupt()
    assert _stoppable(argparse.Namespace(command="eval"), lambda a: 0) == 0
    assert capsys.readouterr().err == ""


def test_an_ignored_sigint_stays_ignored(dropped):
    """A background job started by a shell ignores SIGINT: the CLI leaves it so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen = []
    assert _stoppable(argparse.Namespace(command="eval"),
                      lambda a: seen.append(signal.getsignal(signal.SIGINT)) or 0) == 0
    assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_run_stops_at_the_end_of_the_step_a_ctrl_c_was_dropped_in(dropped, tmp_path,
                                                                     monkeypatch, capsys):
    """The run does not go on to its next step (it trained all its steps and returned)."""
    import hacpo.engine.trainer as trainer_mod
    from hacpo.engine.trainer import train
    from tests.engine.test_trainer import _cfg
    cfg = _cfg(tmp_path, steps="3", plots="false", tensorboard="false")
    real, calls = trainer_mod.generate_agents, []

    def dropped_in_step_0(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            _signal_dropped(signal.SIGINT)
        return real(*a, **k)
    monkeypatch.setattr(trainer_mod, "generate_agents", dropped_in_step_0)
    args = argparse.Namespace(command="train", run_dir=cfg.out_dir)
    assert _stoppable(args, lambda a: train(cfg, echo=lambda *_: None) and 0) == 130
    assert dropped == [KeyboardInterrupt] and len(calls) == 1
    assert capsys.readouterr().err == ("hacpo train: interrupted (Ctrl-C); continue it with "
                                       "--resume\n")
    assert not (tmp_path / "run" / "summary.json").exists()
