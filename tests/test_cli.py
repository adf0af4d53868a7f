"""Command line: the toy demo runs and improves the agents; config errors are clear."""
import pytest

from hacpo.launch.bandit_demo import run
from hacpo.launch.cli import main


def test_bandit_demo_learns():
    lines = []
    acc = run("hacpo", steps=15, agents=2, prompts=16, echo=lines.append)
    first = [float(x) for x in lines[0].split(":")[1].split()]
    assert len(acc) == 2 and all(a > f for a, f in zip(acc, first))


def test_train_cli_bad_override_is_clear(capsys, monkeypatch):
    """Config errors of the run commands are one line on stderr and exit status 2 (with
    HACPO_TRACEBACK=1 the exception itself)."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    for cmd in ("train", "compare", "profile"):
        assert main([cmd, "--preset", "tiny3", "--set", "rollout.gsize=3"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hacpo {cmd}: error: unknown config key 'rollout.gsize'"), err
        assert "Traceback" not in err
    assert main(["train", "--preset", "big"]) == 2
    assert "unknown run preset 'big'" in capsys.readouterr().err
    # --set given twice: both apply (the first one's bad key is reported)
    assert main(["train", "--preset", "tiny3", "--set", "rollout.gsize=3", "--set",
                 "steps=1"]) == 2
    assert "unknown config key 'rollout.gsize'" in capsys.readouterr().err
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(ValueError, match="unknown run preset 'big'"):
        main(["train", "--preset", "big"])


def test_algorithm_flag_keeps_the_run_budget_and_set_overrides(tmp_path):
    """``--algorithm`` puts the run preset under another algorithm as compare does: the
    preset's minibatch count stays, and the user's algorithm overrides (YAML, --set) win."""
    import argparse

    from hacpo.launch.cli import _train_config

    def cfg(*extra, config=None, algorithm=None):
        args = argparse.Namespace(preset="default", config=config, algorithm=algorithm,
                                  steps=None, out_dir=None, set=list(extra))
        return _train_config(args)

    plain, keep = cfg()
    assert (plain.algorithm.name, plain.algorithm.num_minibatches, keep) == ("hacpo", 2, {})
    g, _ = cfg(algorithm="gspo")
    assert (g.algorithm.name, g.algorithm.num_minibatches) == ("gspo", 2)
    y = tmp_path / "c.yaml"
    y.write_text("algorithm:\n  capability: {window: 3}\n")
    h, keep = cfg("algorithm.loss.alpha=0.5", config=str(y), algorithm="hacpo-table5")
    assert keep == {"loss.alpha": "0.5", "capability.window": 3}   # as given
    a = h.algorithm
    assert (a.loss.alpha, a.capability.window, a.loss.cross_clip_delta, a.num_minibatches) \
        == (0.5, 3, 0.8, 2)
