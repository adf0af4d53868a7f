"""Tokenizer contracts the round-trip tests do not pin down: special ids agree with what
decode drops, BOS only where the template lacks one, a reduced vocabulary in original-id
order, bad constructions refused, added (non-special) tokens in valid_text."""
import pytest

from hacpo.models.tokenizer import (CHAR_SET, LLAMA3_TEMPLATE, CharTokenizer, HFTokenizer,
                                    load_tokenizer, tokenizer_path)


def test_char_special_ids_are_exactly_the_ids_decode_drops():
    tok = CharTokenizer()
    dropped = {i for i in range(tok.vocab_size) if tok.decode([i]) == ""}
    assert dropped == {tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}
    assert tok.special_ids() == frozenset(dropped)
    assert tok.decode([tok.unk_id], skip_special=False) == "<unk>"


def test_char_charset_with_a_repeated_character_is_refused():
    with pytest.raises(ValueError, match="repeated characters"):
        CharTokenizer(charset="abca")
    assert CharTokenizer(charset="abc").vocab_size == 4 + 3


def test_char_tokenizer_takes_no_corpus():
    with pytest.raises(ValueError, match="fixed vocabulary; corpus= is for HF"):
        load_tokenizer("char", corpus=["abc"])
    assert load_tokenizer("char").vocab_size == 4 + len(CHAR_SET)


def test_a_template_that_has_its_bos_gets_no_second_one(llama32):
    """The Llama 3 template starts with <|begin_of_text|>: the prompt holds it once (a BOS is
    prepended only to the plain fallback template)."""
    q = "What is 2+3?"
    ids = llama32.prompt_ids(q)
    assert ids.count(llama32.bos_id) == 1 and ids[0] == llama32.bos_id
    assert llama32.decode(ids, skip_special=False) == LLAMA3_TEMPLATE.format(question=q)


def test_plain_template_gets_the_tokenizers_bos(llama32):
    """A tokenizer without a chat template nor a template of its own: PLAIN_TEMPLATE, BOS
    first (Llama 3.2 has one)."""
    plain = HFTokenizer(llama32.hf, name="plain")
    ids = plain.prompt_ids("Hi")
    assert ids[0] == plain.bos_id == 128000 and ids.count(plain.bos_id) == 1
    assert plain.decode(ids, skip_special=False) == "<|begin_of_text|>Question: Hi\nAnswer: "


def test_reduced_ids_follow_the_original_id_order(qwen3_reduced):
    red = qwen3_reduced
    orig = red.hf.convert_tokens_to_ids(red.token_strings())
    assert len(orig) == red.vocab_size
    assert all(a < b for a, b in zip(orig, orig[1:]))
    assert orig[red.eos_id] == red.hf.convert_tokens_to_ids("<|im_end|>")


def test_valid_text_reads_an_added_token_as_its_content(tmp_path):
    """An added, non-special token whose content is not byte-level pieces (here "two words"):
    ids spelling a real U+FFFD character and that token are valid text (nothing was cut)."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_path('qwen3')}/tokenizer.json")
    assert hf.add_tokens(["two words"]) == 1
    tok = HFTokenizer(hf, name="q-added", eos_token="<|im_end|>")
    added = hf.convert_tokens_to_ids("two words")
    assert added not in tok.special_ids()
    ids = tok.encode("a \ufffd b") + [added]
    assert tok.decode(ids) == "a \ufffd btwo words"
    assert tok.valid_text(ids)
    assert not tok.valid_text(tok.encode("I like 🍎")[:-1] + [added])   # a cut character


def test_an_eos_that_the_file_does_not_mark_special_is_still_special(tmp_path):
    """A tokenizer.json whose "<eos>" is an ordinary vocabulary entry (no added-token entry,
    so transformers knows nothing special about it): chosen as eos_token, it is still never
    content, so decode drops it like any EOS."""
    import json
    vocab = {"[UNK]": 0, "<eos>": 1, "five": 2, "is": 3}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"), eos_token="<eos>")
    assert tok.eos_id == tok.pad_id == 1
    assert tok.eos_id in tok.special_ids()
    assert tok.decode(tok.response_ids("is five", add_eos=True)) == "is five"
