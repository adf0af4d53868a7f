"""Command line: the toy demo runs and improves the agents; config errors are clear."""
import pytest

from hacpo.launch.bandit_demo import run
from hacpo.launch.cli import main


def test_bandit_demo_learns():
    lines = []
    acc = run("hacpo", steps=15, agents=2, prompts=16, echo=lines.append)
    first = [float(x) for x in lines[0].split(":")[1].split()]
    assert len(acc) == 2 and all(a > f for a, f in zip(acc, first))


def test_train_cli_bad_override_is_clear():
    with pytest.raises(ValueError, match="unknown config key 'rollout.gsize'"):
        main(["train", "--preset", "tiny3", "--set", "rollout.gsize=3"])
    with pytest.raises(ValueError, match="unknown run preset 'big'"):
        main(["train", "--preset", "big"])
