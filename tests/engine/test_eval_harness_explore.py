"""`hacpo eval` used as a user would, with awkward input: an error before any pair was scored
keeps an earlier evaluation's eval.md / eval.json."""
import pytest

from hacpo.engine.eval_harness import evaluate_checkpoints
from tests.engine.test_eval_harness_mutants import cheap  # noqa: F401  (fixture)


def test_an_error_before_any_pair_is_scored_keeps_the_earlier_summary(cheap, tmp_path):
    """An earlier evaluation's eval.md / eval.json were removed as the evaluation started, so a
    --max-new-tokens an agent's context cannot hold (an error raised once its policy is
    rebuilt) removed them and wrote nothing in their place; they go only as this evaluation's
    first per-pair file replaces one of that evaluation's."""
    run, bench = cheap
    out = tmp_path / "ev"
    out.mkdir()
    for f in ("eval.md", "eval.json", "char__b.json"):
        (out / f).write_text("earlier")
    with pytest.raises(ValueError, match=r"max_new_tokens 100000 leaves no room for a prompt "
                                         r"in agent 'char'"):
        evaluate_checkpoints([run], [f"b={bench}"], out_dir=str(out), max_new_tokens=100000,
                             echo=lambda *_: None)
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "eval.md": "earlier", "eval.json": "earlier", "char__b.json": "earlier"}
