from hacpo.models.retokenize import RetokStats, RetokStatus, retokenize
from hacpo.models.tokenizer import load_tokenizer
from tests.models.conftest import MATH_TEXTS


def test_qwen3_to_llama32_and_back_is_exact(qwen3, llama32):
    for text in MATH_TEXTS:
        src = qwen3.response_ids(text, add_eos=True)
        ids, status = retokenize(src, qwen3, llama32, max_len=512)
        assert status == RetokStatus.OK
        assert ids[-1] == llama32.eos_id and ids[:-1] == llama32.encode(text)
        back, status = retokenize(ids, llama32, qwen3, max_len=512)
        assert status == RetokStatus.OK and back == src
        assert llama32.decode(ids) == text


def test_eos_appended_only_if_source_ended_with_eos(qwen3, llama32):
    src = qwen3.encode(MATH_TEXTS[1])
    ids, status = retokenize(src, qwen3, llama32, max_len=512)
    assert status == RetokStatus.OK and llama32.eos_id not in ids


def test_char_and_reduced_qwen3(qwen3_reduced):
    char = load_tokenizer("char")
    text = MATH_TEXTS[1]
    ids, status = retokenize(char.response_ids(text, add_eos=True), char, qwen3_reduced, 512)
    assert status == RetokStatus.OK
    assert ids[-1] == qwen3_reduced.eos_id and qwen3_reduced.decode(ids) == text
    back, status = retokenize(ids, qwen3_reduced, char, 512)
    assert status == RetokStatus.OK and back == char.response_ids(text, add_eos=True)


def test_unencodable_is_flagged_not_raised(qwen3, qwen3_reduced):
    char = load_tokenizer("char")
    text = "The answer is 5 €, café."
    src = qwen3.response_ids(text, add_eos=True)
    ids, status = retokenize(src, qwen3, char, 512)
    assert status == RetokStatus.UNENCODABLE
    assert ids[-1] == char.eos_id and ids.count(char.unk_id) == 2
    # Reduced byte-level vocabulary: flagged, but the byte fallback keeps the text exact.
    ids, status = retokenize(src, qwen3, qwen3_reduced, 512)
    assert status == RetokStatus.UNENCODABLE and qwen3_reduced.decode(ids) == text


def test_empty_eos_only_and_over_length(qwen3, llama32):
    ids, status = retokenize([], qwen3, llama32, 16)
    assert ids == [] and status == RetokStatus.EMPTY
    ids, status = retokenize([qwen3.eos_id], qwen3, llama32, 16)
    assert ids == [llama32.eos_id]
    assert status == RetokStatus.EOS_ONLY | RetokStatus.EMPTY
    # Only special tokens (decoded text empty) but no EOS at the end.
    ids, status = retokenize([qwen3.pad_id, qwen3.pad_id], qwen3, llama32, 16)
    assert ids == [] and status == RetokStatus.EMPTY
    src = qwen3.response_ids(MATH_TEXTS[0], add_eos=True)
    ids, status = retokenize(src, qwen3, llama32, 5)
    assert status == RetokStatus.TRUNCATED
    assert ids == llama32.encode(MATH_TEXTS[0])[:5]  # truncated: EOS dropped


def test_retok_stats_counts(qwen3, llama32):
    stats = RetokStats()
    for src in ([], [qwen3.eos_id], qwen3.response_ids(MATH_TEXTS[0], add_eos=True)):
        ids, status = retokenize(src, qwen3, llama32, 5)
        stats.update(status, len(src), len(ids))
    d = stats.as_dict()
    assert d["retok/samples"] == 3
    assert d["retok/empty"] == 2 and d["retok/eos_only"] == 1 and d["retok/truncated"] == 1
    assert d["retok/unencodable"] == 0
    n_src = 1 + len(qwen3.response_ids(MATH_TEXTS[0], add_eos=True))
    assert d["retok/token_ratio"] == (0 + 1 + 5) / n_src
