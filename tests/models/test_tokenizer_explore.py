"""Found by using the tokenizers as a user would: a reduced vocabulary meeting an unseen added
token that holds a space, tokenizer files that cannot be read or hold no vocabulary, an
eos_token= that is no token."""
import json
import os
import re

import pytest

from hacpo.models.retokenize import RetokStatus, retokenize
from hacpo.models.tokenizer import (HFTokenizer, UnencodableTextError, load_tokenizer,
                                    tokenizer_path)
from tests.models.conftest import MATH_TEXTS


def test_a_reduced_vocabulary_spells_an_unseen_added_token_by_its_text(llama32):
    """An added, non-special token whose content is not byte-level pieces ("two words", or
    the runs of spaces GPT-NeoX adds) is spelled with the byte tokens of its text. Its content
    was read as byte-level pieces: KeyError ' ', raised by retokenize (which never raises for
    text the learner cannot represent) and so by the trainer's step."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_path('qwen3')}/tokenizer.json")
    assert hf.add_tokens(["two words", "   "]) == 2
    red = HFTokenizer(hf, name="q-added", eos_token="<|im_end|>", corpus=MATH_TEXTS)
    text = "Tom has two words and x   y"
    with pytest.raises(UnencodableTextError, match="not in the reduction corpus"):
        red.encode(text)
    ids = red.encode(text, errors="fallback")
    assert red.decode(ids) == text and red.valid_text(ids)
    src = llama32.response_ids(text, add_eos=True)
    out, status = retokenize(src, llama32, red, max_len=100)
    assert status == RetokStatus.UNENCODABLE        # the fallback: flagged, text unchanged
    assert out == ids + [red.eos_id] and red.decode(out) == text


def test_a_tokenizer_folder_without_its_vocabulary_is_refused(tmp_path):
    """A folder with its tokenizer_config.json but not its tokenizer.json (a model folder
    copied in part) loaded as a tokenizer of its 3 special tokens: every text encoded to no
    ids, and a run trained on empty prompts and targets (warm-up loss 0.000) without a word."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class":
                                                              "LlamaTokenizer"}))
    where = re.escape(str(folder))
    with pytest.raises(ValueError, match=f"tokenizer files in '{where}' define no vocabulary "
                                         f".*tokenizer.json missing"):
        load_tokenizer(str(folder))


@pytest.mark.parametrize("what", ["tokenizer.model", "corrupt tokenizer.json"])
def test_tokenizer_files_that_cannot_be_read_are_named(tmp_path, what):
    """A tokenizer.model (tiktoken or SentencePiece) given as the tokenizer file, or a cut
    tokenizer.json: the tokenizers library raised a bare Exception ("expected value at line 1
    column 1") naming no file, which `hacpo train` showed as a traceback, not as a setup
    error."""
    if what == "tokenizer.model":
        path = os.path.join(tokenizer_path("llama3.2"), "tokenizer.model")
    else:
        with open(os.path.join(tokenizer_path("qwen3"), "tokenizer.json")) as f:
            (tmp_path / "tokenizer.json").write_text(f.read(1000))
        path = str(tmp_path)
    with pytest.raises(ValueError, match=f"tokenizer files in '{re.escape(path)}' cannot be "
                                         f"read as a Hugging Face tokenizer"):
        load_tokenizer(path)


def test_an_eos_token_outside_the_vocabulary_is_refused():
    """eos_token= naming no token of the vocabulary: Llama 3.2 and Qwen3 took None as their
    EOS (response_ids(add_eos=True) ended with None; decode raised a TypeError); GPT-2
    silently took its unk token, <|endoftext|>."""
    for spec in ("llama3.2", "qwen3"):
        with pytest.raises(ValueError, match=f"tokenizer '{re.escape(spec)}': its eos token "
                                             f"'<eos>' is not a token of its vocabulary"):
            load_tokenizer(spec, eos_token="<eos>")
    assert load_tokenizer("llama3.2", eos_token="<|end_of_text|>").eos_id == 128001


DATED_TEMPLATE = (
    '{%- if not date_string is defined %}{%- if strftime_now is defined %}'
    '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}'
    '{%- set date_string = "1 Jan 2000" %}{%- endif %}{%- endif %}'
    'Today Date: {{ date_string }}\n{% for m in messages %}{{ m["content"] }}\n{% endfor %}'
    '{% if add_generation_prompt %}A: {% endif %}')


def test_a_chat_template_that_writes_todays_date_is_given_a_fixed_one():
    """A model folder whose chat template writes today's date (Llama 3.x Instruct's system
    header, through transformers' strftime_now): every prompt changed from day to day, so a
    run resumed or evaluated on another day read another encoding (refused as an encoding
    change). It gets a fixed date_string; one the caller gives wins."""
    from transformers import PreTrainedTokenizerFast

    from hacpo.models.tokenizer import CHAT_TEMPLATE_DATE
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_path('llama3.2')}/tokenizer.json",
                                 eos_token="<|eot_id|>")
    hf.chat_template = DATED_TEMPLATE
    tok = HFTokenizer(hf, name="dated")
    assert tok.prompt_text("2+2?") == f"Today Date: {CHAT_TEMPLATE_DATE}\n2+2?\nA: "
    assert tok._prompt_texts(["2+2?", "3+3?"])[1] == f"Today Date: {CHAT_TEMPLATE_DATE}\n3+3?\nA: "
    given = HFTokenizer(hf, name="dated", template_kwargs={"date_string": "5 May 2025"})
    assert given.prompt_text("2+2?") == "Today Date: 5 May 2025\n2+2?\nA: "
