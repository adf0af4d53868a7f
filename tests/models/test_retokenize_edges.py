"""retokenize's boundaries, with hand-made responses: exactly max_len tokens is not a
truncation, EOS_ONLY means exactly [EOS], a learner without any fallback gets [] flagged
UNENCODABLE (never an exception), and the stats count each flag once per sample."""
import json

import pytest

from hacpo.models.retokenize import RetokStats, RetokStatus, retokenize
from hacpo.models.tokenizer import CharTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def char():
    return CharTokenizer()


def test_exactly_max_len_tokens_is_not_truncated(char):
    src = char.encode("12345") + [char.eos_id]                  # 6 learner tokens
    ids, status = retokenize(src, char, char, max_len=6)
    assert (ids, status) == (src, RetokStatus.OK)
    ids, status = retokenize(src, char, char, max_len=5)
    assert (ids, status) == (char.encode("12345"), RetokStatus.TRUNCATED)   # EOS cut off
    ids, status = retokenize(char.encode("12345"), char, char, max_len=5)
    assert (ids, status) == (char.encode("12345"), RetokStatus.OK)


def test_eos_only_means_exactly_one_eos(char):
    ids, status = retokenize([char.eos_id], char, char, 8)
    assert (ids, status) == ([char.eos_id], RetokStatus.EOS_ONLY | RetokStatus.EMPTY)
    # an EOS that is not the last token is an ordinary special token: dropped, not an end
    src = [char.eos_id] + char.encode("5")
    ids, status = retokenize(src, char, char, 8)
    assert (ids, status) == (char.encode("5"), RetokStatus.OK)
    ids, status = retokenize([char.eos_id, char.eos_id], char, char, 8)
    assert (ids, status) == ([char.eos_id], RetokStatus.EMPTY)


def _word_level(tmp_path, words):
    """A tokenizer.json of a WordLevel model (not byte-level: no fallback for unseen words)."""
    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    spec = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 1, "content": "<eos>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True}],
            "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_a_learner_without_fallback_gets_no_ids_flagged(char, tmp_path):
    """A reduced vocabulary of a tokenizer that is not byte-level has no fallback for a word
    outside its corpus: retokenize returns [] flagged UNENCODABLE instead of raising."""
    path = _word_level(tmp_path, ["answer", "is", "five", "six"])
    learner = load_tokenizer(path, eos_token="<eos>", corpus=["answer is five"])
    src = char.encode("answer is five") + [char.eos_id]
    ids, status = retokenize(src, char, learner, 16)
    assert status == RetokStatus.OK and learner.decode(ids) == "answer is five"
    assert ids[-1] == learner.eos_id
    src = char.encode("answer is six") + [char.eos_id]
    ids, status = retokenize(src, char, learner, 16)
    assert (ids, status) == ([], RetokStatus.UNENCODABLE)


def test_stats_count_every_flag_of_a_combined_status():
    stats = RetokStats()
    stats.update(RetokStatus.EOS_ONLY | RetokStatus.EMPTY, 1, 1)
    stats.update(RetokStatus.TRUNCATED | RetokStatus.UNENCODABLE | RetokStatus.INVALID_UTF8, 9, 4)
    stats.update(RetokStatus.OK, 2, 3)
    d = stats.as_dict(prefix="r/")
    assert d == {"r/samples": 3.0, "r/token_ratio": 8 / 12, "r/empty": 1.0,
                 "r/eos_only": 1.0, "r/truncated": 1.0, "r/unencodable": 1.0,
                 "r/invalid_utf8": 1.0}
    assert RetokStats().as_dict()["retok/token_ratio"] == 0.0     # no tokens yet: no division
