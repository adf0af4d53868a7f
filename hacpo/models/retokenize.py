"""Re-tokenize another agent's response into the learner's tokenization (cross samples).

``retokenize(response_ids, source_tok, learner_tok, max_len) -> (ids, status)``:
decode with the source tokenizer (special tokens, including EOS, dropped), encode the text as
a response with the learner's tokenizer, and append the learner's EOS iff the source response
ended with the source EOS. Never raises for text the learner cannot represent: it flags it.

Status flags (:class:`RetokStatus`, combinable):

- ``EMPTY``: the decoded text is empty (ids are ``[]`` or ``[learner EOS]``).
- ``EOS_ONLY``: the source response was exactly ``[EOS]`` (ids are ``[learner EOS]``).
- ``TRUNCATED``: longer than ``max_len`` learner tokens; the first ``max_len`` are kept
  (so a truncated response loses its EOS).
- ``UNENCODABLE``: the text has pieces outside the learner's vocabulary; ``ids`` come from
  the tokenizer's deterministic fallback (byte tokens or ``<unk>``), or are ``[]`` where there
  is none. Also where the learner's encoding does not decode to the text (a tokenizer whose
  normalizer rewrites it, e.g. lowercasing); ``ids`` are that encoding. The trainer decides
  whether to keep or drop such samples.
- ``INVALID_UTF8``: the source ids are not valid text (byte pieces that do not form whole
  characters, e.g. a multi-byte character cut at ``max_new_tokens``), so the decoded text has
  U+FFFD where the source had those bytes; ``ids`` encode that text. No tokenization of the
  learner's spells the generator's response: the trainer treats these samples as
  ``UNENCODABLE`` ones (``drop_unencodable``), whatever the learner's vocabulary.

Without ``UNENCODABLE`` (and before ``TRUNCATED`` cuts them), the ids decode with the learner's
tokenizer to exactly the text the source ids decode to.

Special-token strings in the decoded text (e.g. a Llama response that writes out
``"<|im_end|>"``) are encoded as text by the learner (:meth:`Tokenizer.encode`), never as the
learner's special tokens.

The prompt is not re-tokenized here: the learner builds its own with
``learner_tok.prompt_ids(question)`` (its own chat template).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from hacpo.models.tokenizer import Tokenizer, UnencodableTextError


class RetokStatus(enum.Flag):
    OK = 0
    EMPTY = enum.auto()
    EOS_ONLY = enum.auto()
    TRUNCATED = enum.auto()
    UNENCODABLE = enum.auto()
    INVALID_UTF8 = enum.auto()


def retokenize(response_ids: Sequence[int], source_tok: Tokenizer, learner_tok: Tokenizer,
               max_len: int) -> tuple[list[int], RetokStatus]:
    """Map a response from ``source_tok`` ids to ``learner_tok`` ids.

    Args:
        response_ids: the source response (EOS included as last id iff it was produced).
        source_tok: tokenizer of the agent that generated it.
        learner_tok: tokenizer of the learner.
        max_len: most learner tokens to return (EOS included).

    Returns:
        (ids, status): learner ids and the :class:`RetokStatus` flags.
    """
    ids = list(response_ids)
    status = RetokStatus.OK
    ended_eos = bool(ids) and ids[-1] == source_tok.eos_id
    if ids == [source_tok.eos_id]:
        status |= RetokStatus.EOS_ONLY
    body = ids[:-1] if ended_eos else ids
    text = source_tok.decode(body, skip_special=True)
    if not text:
        status |= RetokStatus.EMPTY
    if "\ufffd" in text and not source_tok.valid_text(body):
        status |= RetokStatus.INVALID_UTF8
    try:
        out = learner_tok.response_ids(text, add_eos=ended_eos)
        if learner_tok.decode(out) != text:         # a normalizer changed the text
            status |= RetokStatus.UNENCODABLE
    except UnencodableTextError:
        status |= RetokStatus.UNENCODABLE
        try:
            out = learner_tok.response_ids(text, add_eos=ended_eos, errors="fallback")
        except UnencodableTextError:
            out = []
    if len(out) > max_len:
        status |= RetokStatus.TRUNCATED
        out = out[:max_len]
    return out, status


@dataclass
class RetokStats:
    """Counts for metrics: ``stats.update(status, n_source, n_learner)``; ``as_dict()``."""

    samples: int = 0
    source_tokens: int = 0
    learner_tokens: int = 0
    flags: dict[str, int] = field(default_factory=lambda: {
        f.name.lower(): 0 for f in RetokStatus if f.name != "OK"})

    def update(self, status: RetokStatus, source_len: int, learner_len: int) -> None:
        self.samples += 1
        self.source_tokens += source_len
        self.learner_tokens += learner_len
        for f in RetokStatus:
            if f.value and f in status:
                self.flags[f.name.lower()] += 1

    def as_dict(self, prefix: str = "retok/") -> dict[str, float]:
        out = {f"{prefix}samples": float(self.samples),
               f"{prefix}token_ratio": self.learner_tokens / max(self.source_tokens, 1)}
        out.update({f"{prefix}{k}": float(v) for k, v in self.flags.items()})
        return out
