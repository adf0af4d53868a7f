"""Tokenizer and re-tokenization contracts that a mutation audit found no test pinning down:
the char tokenizer's special ids against its strings and its transformers export, its error's
position, one BOS; the added special tokens of a tokenizer (Llama's turn headers) dropped like
EOS; Unicode forms stripped inside a normalizer Sequence; kept= refused at its edges; the
encoding probe's BOS; eos_token= and template= given to a known or char tokenizer; the
tokenizer digest's special ids."""
import pytest

from hacpo.models.retokenize import RetokStatus, retokenize
from hacpo.models.tokenizer import (CharTokenizer, HFTokenizer, UnencodableTextError,
                                    _without_unicode_forms, load_tokenizer)


def test_char_special_ids_name_their_tokens_here_and_in_its_hf_export():
    """The char tokenizer's ids 0-3 are the strings "<pad>" ... "<unk>" it names, and its
    transformers export (`hacpo export`) has the same special ids and puts the same BOS first:
    else an exported model stops at another token than the EOS it was trained to end with."""
    tok = CharTokenizer()
    names = {tok.pad_id: "<pad>", tok.bos_id: "<bos>", tok.eos_id: "<eos>", tok.unk_id: "<unk>"}
    assert {i: tok.decode([i], skip_special=False) for i in names} == names
    hf = tok.to_hf()
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == \
        (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id)
    q = "What is 2+3?"
    assert hf(tok.prompt_text(q))["input_ids"] == tok.prompt_ids(q)


def test_char_prompt_is_one_bos_then_the_template_and_errors_name_the_position():
    tok = CharTokenizer()
    q = "What is 2+3?"
    assert tok.prompt_ids(q) == [tok.bos_id] + tok.encode("Q: What is 2+3?\nA: ")
    with pytest.raises(UnencodableTextError, match="character 'é' at position 3 is not in"):
        tok.encode("café")
    own = load_tokenizer("char", template="Question {question} =")     # template= kept
    assert own.prompt_ids(q) == [tok.bos_id] + tok.encode("Question What is 2+3? =")


def test_added_special_tokens_are_special_ids_dropped_like_eos(llama32, qwen3):
    """Llama 3.2's turn headers are added special tokens that transformers' all_special_ids
    does not list: a response that runs on into another turn decodes without them, and
    re-tokenized for Qwen3 does not spell "<|start_header_id|>" as text."""
    hdr = [llama32.hf.convert_tokens_to_ids(t) for t in (
        "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_0|>")]
    assert set(hdr) <= llama32.special_ids()
    src = llama32.encode("5") + hdr + llama32.encode(" more")
    assert llama32.decode(src) == "5 more"
    ids, status = retokenize(src + [llama32.eos_id], llama32, qwen3, 64)
    assert (ids, status) == (qwen3.response_ids("5 more", add_eos=True), RetokStatus.OK)


def test_unicode_forms_are_dropped_inside_a_normalizer_sequence():
    """encode's text backend drops NFC/NFD/NFKC/NFKD wherever they sit (a Sequence of them with
    other normalizers too), keeping the other normalizers (which retokenize flags)."""
    low = {"type": "Lowercase"}
    seq = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, low, {"type": "NFC"}]}
    assert _without_unicode_forms(seq) == {"type": "Sequence", "normalizers": [low]}
    assert _without_unicode_forms({"type": "Sequence", "normalizers": [{"type": "NFD"}]}) is None
    assert _without_unicode_forms(low) == low and _without_unicode_forms(None) is None


def test_kept_ids_are_refused_at_the_edges(qwen3, qwen3_reduced):
    """kept= (a checkpoint's record) refuses the first id past the vocabulary, a repeated id
    (the model's embedding rows would not be the tokenizer's ids) and one that lacks a special
    token although it has every byte token; kept_ids() is a copy."""
    kept = qwen3_reduced.kept_ids()
    no_start = [i for i in kept if i != qwen3.hf.convert_tokens_to_ids("<|im_start|>")]
    bad = {"outside this tokenizer's 0..": kept + [len(qwen3.hf)],
           "distinct ids in increasing order": kept[:1] + kept,
           "lacks ids every reduction keeps": no_start}
    for msg, ids in bad.items():
        with pytest.raises(ValueError, match=msg):
            load_tokenizer("qwen3", kept=ids)
    again = load_tokenizer("qwen3", kept=kept)
    again.kept_ids().append(0)          # the caller's copy: the tokenizer's own is unchanged
    assert again.kept_ids() == kept and again.decode(again.encode("Tom")) == "Tom"


def test_the_encoding_probe_has_the_prompts_bos(llama32):
    """A tokenizer that stops putting its BOS before the plain template (its bos_token unset)
    renders the same prompts and encodes the same texts, but its prompt ids differ: its
    probe (a resume's check) differs."""
    import copy
    hf = copy.deepcopy(llama32.hf)
    hf.bos_token = None
    with_bos, without = HFTokenizer(llama32.hf, name="p"), HFTokenizer(hf, name="p")
    assert with_bos.prompt_ids("Hi") == [llama32.bos_id] + without.prompt_ids("Hi")
    assert with_bos.encoding_probe() != without.encoding_probe()


def test_a_known_tokenizer_takes_the_eos_token_given(llama32):
    """eos_token= overrides a known tokenizer's default (<|eot_id|> for llama3.2), and the
    tokenizer digest (what a checkpoint's ids mean) tells the two apart."""
    from hacpo.engine.build import tokenizer_digest
    other = load_tokenizer("llama3.2", eos_token="<|end_of_text|>")
    assert (other.eos_id, llama32.eos_id) == (128001, 128009)
    assert other.response_ids("5", add_eos=True)[-1] == 128001
    assert tokenizer_digest(other) != tokenizer_digest(llama32)


def test_valid_text_of_a_reduced_vocabulary_reads_its_own_ids(qwen3):
    """A reduced vocabulary's ids are not the original ones (past the 256 byte tokens):
    valid_text finds a character cut at the same places the full tokenizer does."""
    text = "I like 🍎 apples"
    red = load_tokenizer("qwen3", corpus=[text])
    ids, full = red.encode(text), qwen3.encode(text)
    cuts = [n for n in range(1, len(ids) + 1) if not red.valid_text(ids[:n])]
    assert cuts and cuts == [n for n in range(1, len(full) + 1) if not qwen3.valid_text(full[:n])]


def test_the_encoding_probe_has_the_ids_encode_gives(qwen3):
    """A merge removed that only encode's spelling of a special token's string uses ("Ġ<" "|",
    in " <|endoftext|>" written out): the prompts' ids are the same, a re-tokenized response's
    ids are not, and the probe differs."""
    import json

    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    from hacpo.models.tokenizer import ENCODING_PROBES
    spec = json.loads(qwen3.hf.backend_tokenizer.to_str())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = [m for m in merges if m != ["Ġ<", "|"]]
    assert len(spec["model"]["merges"]) == len(merges) - 1
    hf = PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(json.dumps(spec)),
                                 eos_token="<|im_end|>", chat_template=qwen3.hf.chat_template)
    other = HFTokenizer(hf, name="qwen3")
    assert [other.prompt_ids(q) for q in ENCODING_PROBES] == \
        [qwen3.prompt_ids(q) for q in ENCODING_PROBES]
    assert other.encode(ENCODING_PROBES[-1]) != qwen3.encode(ENCODING_PROBES[-1])
    assert other.encoding_probe() != qwen3.encoding_probe()
