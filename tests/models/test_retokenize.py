from types import SimpleNamespace

import torch

from hacpo.engine.pool import StepPool, learner_view
from hacpo.models.policy import PolicyConfig, build_policy
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


def test_special_token_strings_in_a_response_stay_text(qwen3, llama32):
    """Llama text that writes out Qwen's "<|im_end|>" (and the reverse) must not become the
    learner's EOS / special tokens: the learner would score an end of turn in the middle of
    the response, or take a truncated response for a finished one."""
    text = "The answer <|im_end|> is 5 <|eot_id|>"
    for src, dst in ((llama32, qwen3), (qwen3, llama32)):
        src_ids = src.encode(text)
        ids, status = retokenize(src_ids + [src.eos_id], src, dst, 512)
        assert status == RetokStatus.OK
        assert ids[-1] == dst.eos_id and not set(ids[:-1]) & dst.special_ids()
        assert dst.decode(ids) == text
        ids, status = retokenize(src_ids, src, dst, 512)        # truncated: no EOS
        assert status == RetokStatus.OK and not set(ids) & dst.special_ids()


def test_multibyte_character_cut_is_flagged_for_every_learner(qwen3, llama32, qwen3_reduced):
    """A response cut inside a multi-byte character decodes to U+FFFD: no learner's
    tokenization spells what the generator produced. Reduced and character learners flagged it
    (U+FFFD is outside their vocabularies); full vocabularies encoded U+FFFD silently."""
    char = load_tokenizer("char")
    src = qwen3.encode("I like 🍎")[:-1]                   # max_new_tokens inside the apple
    assert "\ufffd" in qwen3.decode(src)
    for dst in (llama32, qwen3_reduced, char):
        _, status = retokenize(src, qwen3, dst, 512)
        assert RetokStatus.INVALID_UTF8 in status, dst.name
    for ids in (qwen3.encode("I like 🍎"), qwen3.encode("a \ufffd b")):   # valid text
        _, status = retokenize(ids, qwen3, llama32, 512)
        assert RetokStatus.INVALID_UTF8 not in status
    stats = RetokStats()
    stats.update(RetokStatus.INVALID_UTF8, 2, 2)
    assert stats.as_dict()["retok/invalid_utf8"] == 1


def _pool(responses, agents, lp_old):
    return StepPool(torch.tensor(agents), torch.zeros(len(agents), dtype=torch.long),
                    responses, ["" for _ in responses], [False] * len(agents),
                    [True] * len(agents), lp_old=torch.tensor(lp_old))


def test_learner_view_drops_invalid_utf8_like_unencodable(qwen3, llama32):
    src = SimpleNamespace(tokenizer=qwen3, max_len=512)
    learner = SimpleNamespace(tokenizer=llama32, max_len=512)
    prompts = [[llama32.prompt_ids("2+3?")], [qwen3.prompt_ids("2+3?")]]
    cut = qwen3.encode("I like 🍎")[:-1]
    pool = _pool([llama32.encode("5"), cut, qwen3.encode("I like 5")], [0, 1, 1],
                 [-1.0, -2.0, -2.0])
    ones = torch.ones(3)
    for drop in (True, False):
        stats = RetokStats()
        view = learner_view(pool, 0, torch.arange(3), ones, ones, [learner, src], prompts, 8,
                            stats, drop)
        assert stats.as_dict()["retok/invalid_utf8"] == 1
        assert view.dropped["unencodable"] == (1 if drop else 0)
        assert view.idx.tolist() == ([0, 2] if drop else [0, 1, 2])


def test_learner_view_fits_cross_samples_in_the_learners_positions(qwen3_reduced):
    """A cross sample longer in the learner's tokens than its positions leave after its own
    prompt is cut (and counted as truncated), instead of crashing the update with
    'prompt+response ... exceeds max_len'."""
    char = build_policy(PolicyConfig(name="c", kind="decoder", tokenizer="char", d_model=16,
                                     n_layers=1, n_heads=2, max_len=40))
    src = SimpleNamespace(tokenizer=qwen3_reduced, max_len=64)
    prompts = [[char.tokenizer.prompt_ids("2+3?")], [qwen3_reduced.prompt_ids("2+3?")]]
    max_new = 12
    resp = qwen3_reduced.encode(MATH_TEXTS[0])[:max_new]     # 33 characters
    assert len(prompts[1][0]) + max_new <= src.max_len       # the generator could sample it
    assert len(prompts[0][0]) + max_new <= char.max_len      # and the learner its own
    pool = _pool([char.tokenizer.encode("5"), resp], [0, 1], [-1.0, -2.0])
    stats, ones = RetokStats(), torch.ones(2)
    view = learner_view(pool, 0, torch.arange(2), ones, ones, [char, src], prompts, max_new,
                        stats, True)
    assert view.idx.tolist() == [0, 1] and stats.as_dict()["retok/truncated"] == 1
    assert all(len(p) + len(r) <= char.max_len
               for p, r in zip(view.prompt_ids, view.response_ids))
    assert len(prompts[0][0]) + len(view.response_ids[1]) == char.max_len
    tl, mask = char.response_logprobs(view.prompt_ids, view.response_ids)
    assert torch.isfinite(tl).all() and mask.sum() == 1 + char.max_len - len(prompts[0][0])


def test_learner_view_cuts_cross_samples_at_four_times_max_new_tokens_but_not_below_16():
    """With room to spare, a cross sample is cut to max(4 * max_new_tokens, 16) learner
    tokens: 16 for max_new_tokens=2 (not 8), 20 for 5; a shorter one is kept whole, its final
    EOS left out of the scored ids."""
    from hacpo.models.tokenizer import CharTokenizer
    src, tok = CharTokenizer(name="c0"), CharTokenizer()
    pols = [SimpleNamespace(tokenizer=tok, max_len=512), SimpleNamespace(tokenizer=src,
                                                                         max_len=512)]
    prompts = [[tok.prompt_ids("2+3?")], [src.prompt_ids("2+3?")]]
    long, short = "0123456789" * 3, "12 apples, 5"
    pool = _pool([src.encode(long), src.encode(short) + [src.eos_id]], [1, 1], [-1.0, -2.0])
    ones = torch.ones(2)
    for max_new, cut in ((2, 16), (5, 20)):
        stats = RetokStats()
        view = learner_view(pool, 0, torch.arange(2), ones, ones, pols, prompts, max_new,
                            stats, True)
        assert view.response_ids == [tok.encode(long[:cut]), tok.encode(short)], max_new
        assert stats.as_dict()["retok/truncated"] == 1


def test_status_ok_means_the_learner_spells_the_same_text(qwen3, llama32, qwen3_reduced):
    """Fuzzing found Llama text with a decomposed accent ("e" + U+0301) re-tokenized for Qwen3
    with status OK but decoding to "é" (U+00E9): Qwen3's NFC normalizer changed the text the
    learner scores. Text must come back exactly, for a reduced learner too (byte fallback)."""
    for text in ("cafe\u0301", "\u212b ok"):
        src = llama32.encode(text) + [llama32.eos_id]
        ids, status = retokenize(src, llama32, qwen3, 512)
        assert status == RetokStatus.OK and ids[-1] == qwen3.eos_id
        assert qwen3.decode(ids) == text
        ids, _ = retokenize(src, llama32, qwen3_reduced, 512)
        assert qwen3_reduced.decode(ids) == text


def test_a_learner_normalizer_that_changes_text_is_flagged(llama32, tmp_path):
    """A local tokenizer.json whose normalizer rewrites text (here: lowercasing) cannot spell
    the response: flagged UNENCODABLE instead of OK with other text."""
    import json

    spec = json.loads(llama32.hf.backend_tokenizer.to_str())
    spec["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    lower = load_tokenizer(str(tmp_path / "tokenizer.json"), eos_token="<|eot_id|>")
    src = llama32.encode("The Answer is 5") + [llama32.eos_id]
    ids, status = retokenize(src, llama32, lower, 512)
    assert status == RetokStatus.UNENCODABLE and ids[-1] == lower.eos_id
    ids, status = retokenize(llama32.encode("the answer is 5"), llama32, lower, 512)
    assert status == RetokStatus.OK and lower.decode(ids) == "the answer is 5"
