"""Prompt data: math examples from user-provided JSONL/parquet files, prompt templates, and a
resumable, deterministic prompt sampler.

Files in GSM8K style (``question``, ``answer`` ending in ``#### 42``) and MATH style
(``problem``, ``solution`` with ``\\boxed{...}``, or a plain ``answer`` field) load with
:func:`load_examples`; other layouts with a :class:`FieldMap`. Nothing is downloaded.

Every bad row (not UTF-8, malformed JSON, not an object, missing field, no extractable or a
non-finite answer) is an error naming the file and the 1-based line (JSONL) or 0-based row
(parquet), unless ``skip_bad_rows=True``: then it is skipped and counted in :class:`LoadStats`.
A file that is not parquet at all is an error naming it.
"""
from __future__ import annotations

import codecs
import dataclasses
import decimal
import hashlib
import json
import math
import os
import random
import re
import struct
from typing import Iterable, Iterator, Optional, Sequence, Union

from hacpo.engine.errors import require
from hacpo.engine.rewards import extract_boxed

__all__ = [
    "Example", "FieldMap", "GSM8K_FIELDS", "MATH_FIELDS", "MATH_ANSWER_FIELDS",
    "QUESTION_ANSWER_FIELDS", "FIELD_MAPS", "DataError",
    "LoadStats", "load_examples", "parse_gold", "PROMPT_TEMPLATES", "register_prompt_template",
    "apply_prompt_template", "PromptSampler",
]


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its gold answer. ``prompt`` is the raw question (no template)."""

    id: str
    prompt: str
    answer: str
    source: str


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Which fields hold the prompt and the answer, and how to read the gold from the answer.

    answer_format: ``"gsm8k"`` (text after the last ``####``), ``"boxed"`` (content of the
    last ``\\boxed{}``) or ``"raw"`` (the field itself, stripped).
    id: optional field holding a row id; otherwise ids are ``<source>:<line or row>``.
    """

    prompt: str = "question"
    answer: str = "answer"
    answer_format: str = "gsm8k"
    id: Optional[str] = None

    def __post_init__(self):
        if self.answer_format not in ("gsm8k", "boxed", "raw"):
            raise ValueError(f"answer_format must be 'gsm8k', 'boxed' or 'raw', "
                             f"got {self.answer_format!r}")


GSM8K_FIELDS = FieldMap("question", "answer", "gsm8k")
MATH_FIELDS = FieldMap("problem", "solution", "boxed")
MATH_ANSWER_FIELDS = FieldMap("problem", "answer", "raw")
# question + the final answer itself ({"question": ..., "answer": 42}: SVAMP-, GSM-hard-style)
QUESTION_ANSWER_FIELDS = FieldMap("question", "answer", "raw")
# data.field_map's names ("auto": the layout detected from the first good row)
FIELD_MAPS = {"gsm8k": GSM8K_FIELDS, "math": MATH_FIELDS, "math_answer": MATH_ANSWER_FIELDS,
              "question_answer": QUESTION_ANSWER_FIELDS}


def _detect_field_map(row: dict) -> Optional[FieldMap]:
    if "question" in row and "answer" in row:
        # GSM8K answers are worked solutions ending "#### x"; an answer without one is the
        # answer itself (a row of GSM8K without it, read this way, is caught: _to_example)
        a = row["answer"]
        return GSM8K_FIELDS if not isinstance(a, _ANSWER_TYPES) or isinstance(a, bool) \
            or "####" in str(a) else QUESTION_ANSWER_FIELDS
    if "problem" in row and "answer" in row:
        return MATH_ANSWER_FIELDS
    if "problem" in row and "solution" in row:
        return MATH_FIELDS
    return None


class DataError(ValueError):
    """A bad row or file; the message starts with ``path:line N`` or ``path:row N``."""


@dataclasses.dataclass
class LoadStats:
    """What :func:`load_examples` read. ``problems`` and ``bad_rows`` hold the first
    ``MAX_KEPT`` skipped rows' messages and places (``"line N"``, 1-based, in JSONL;
    ``"row N"``, 0-based, in parquet)."""

    rows: int = 0       # non-blank rows read
    loaded: int = 0
    skipped: int = 0
    problems: list = dataclasses.field(default_factory=list)  # first messages of skipped rows
    bad_rows: list = dataclasses.field(default_factory=list)  # their places: "line 3", "row 0"

    MAX_KEPT = 20


# (a parquet decimal column's values are Decimals)
_ANSWER_TYPES = (str, int, float, decimal.Decimal)
_GSM8K_RE = re.compile(r"####\s*((?:(?!####)[^\n])*)")   # up to the next marker or line end
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def parse_gold(value, answer_format: str) -> str:
    """The gold answer string of an answer field; ValueError if there is none."""
    if value is None:
        raise ValueError("answer is null")
    if isinstance(value, bool) or not isinstance(value, _ANSWER_TYPES):
        raise ValueError(f"answer has type {type(value).__name__}, expected a string or number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer is {value!r}, not a finite number")
        # A float column (e.g. parquet float64): 18.0 -> "18", 1e-05 -> "0.00001", never an
        # exponent, which the verifier would read as Euler's e. repr's digits, not the binary
        # value's: 1e23 -> "1" and 23 zeros (int(1e23) is 99999999999999991611392).
        text = format(decimal.Decimal(repr(value)), "f").removesuffix(".0")
        text = "0" if text == "-0" else text
    elif isinstance(value, decimal.Decimal):     # a parquet decimal column: 2.50 -> "2.5"
        if not value.is_finite():
            raise ValueError(f"answer is {value}, not a finite number")
        text = format(value, "f")
        text = text.rstrip("0").rstrip(".") if "." in text else text
        text = "0" if text == "-0" else text
    else:
        text = str(value)
    if answer_format == "gsm8k":
        found = [f for f in _GSM8K_RE.findall(text) if f.strip()] or _GSM8K_RE.findall(text)
        if not found:
            raise ValueError("no '#### <answer>' in the answer")
        gold = found[-1].strip().rstrip(".").strip()
    elif answer_format == "boxed":
        boxed = extract_boxed(text)
        if boxed is None:
            raise ValueError("no \\boxed{...} in the answer")
        gold = boxed.strip()
    else:
        gold = text.strip()
    if _THOUSANDS_RE.match(gold):
        gold = gold.replace(",", "")
    if not gold:
        raise ValueError("the answer is empty")
    return gold


def _iter_jsonl(path: str) -> Iterator[tuple[str, object]]:
    """Yields (location, parsed row or the exception) for non-blank lines.

    Lines end at ``\\n`` (JSON Lines; a ``\\r`` before it is JSON whitespace); the file is UTF-8,
    with or without a byte-order mark. A line that is not UTF-8 is a bad row, like bad JSON.
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            loc = f"{path}:line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield loc, DataError(f"{loc}: not valid UTF-8 ({e.reason} at byte {e.start + 1} "
                                     f"of the line){_utf16_hint(raw)}")
                continue
            if not line.strip():
                continue
            try:
                yield loc, json.loads(line)
            except json.JSONDecodeError as e:   # (some of json's messages end in "at")
                yield loc, DataError(f"{loc}: invalid JSON ({e.msg.removesuffix(' at')} at "
                                     f"column {e.colno}){_utf16_hint(raw)}")
            except (ValueError, RecursionError) as e:   # a number past Python's digit limit,
                yield loc, DataError(f"{loc}: unreadable JSON ({e})")   # nesting too deep


def _utf16_hint(raw: bytes) -> str:
    """What to say of a line that is not UTF-8 JSON because its file is UTF-16 (NUL bytes
    between the characters, or its byte-order mark)."""
    body = raw.rstrip(b"\r\n\x00")
    # every other byte NUL, the others not (ASCII text in UTF-16): not a tail of NULs a
    # crash left, nor a NUL inside text
    halves = (body[0::2], body[1::2])
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or (
            len(body) > 1 and any(not h.strip(b"\x00") and b"\x00" not in o
                                  for h, o in (halves, halves[::-1]))):
        return " (the file looks like UTF-16: save it as UTF-8)"
    return ""


PARQUET_BATCH_ROWS = 4096


def _iter_parquet(path: str) -> Iterator[tuple[str, object]]:
    """The file's rows, read in batches: a ``limit`` (``data.eval_size``, ``hacpo eval
    --limit``) reads what it keeps, not the whole file (whose rows as Python dicts took 1 GB
    for 1M rows)."""
    pq = require("pyarrow.parquet", f"reading {path}", "or give the data as .jsonl")
    pa = require("pyarrow", f"reading {path}", "or give the data as .jsonl")
    i = 0
    try:     # (what the consumer raises is not raised here: only reading the file is caught)
        pf = pq.ParquetFile(path)
        f32 = [f.name for f in pf.schema_arrow if pa.types.is_float32(f.type)]
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                for k in f32:
                    if isinstance(row.get(k), float):
                        row[k] = _float32_digits(row[k])
                yield f"{path}:row {i}", row
                i += 1
    except FileNotFoundError:
        raise
    except Exception as e:  # not a parquet file, truncated, ...: a bad file, named
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from e


def _float32_digits(x: float) -> float:
    """The shortest decimal that reads back as the float32 ``x``, as a Python float: a float32
    column's 0.1 reads as the double 0.10000000149011612, whose digits were the gold."""
    for digits in range(1, 10):       # 9 significant digits round-trip every float32
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x      # nan


def load_examples(path: Union[str, os.PathLike], field_map: Union[FieldMap, str] = "auto", *,
                  skip_bad_rows: bool = False, source: Optional[str] = None,
                  limit: Optional[int] = None) -> tuple[list[Example], LoadStats]:
    """Load a ``.jsonl``/``.ndjson`` or ``.parquet`` file of math problems.

    field_map: a :class:`FieldMap`, or ``"auto"`` (detected from the first good row:
        ``question``+``answer`` -> GSM8K, or the answer itself when the first good row's answer
        has no ``####``; ``problem``+``answer`` -> raw answer;
        ``problem``+``solution`` -> boxed).
    source: the examples' ``source`` (default: the file name without extension).
    limit: stop after this many examples.
    """
    path = os.fspath(path)
    name = os.path.basename(path)
    stem, ext = os.path.splitext(name)
    ext = ext.lower()                   # data.JSONL too
    if ext in (".jsonl", ".ndjson"):
        rows: Iterable = _iter_jsonl(path)
    elif ext in (".parquet", ".pq"):
        rows = _iter_parquet(path)
    elif path.endswith(("/", os.sep)) and os.path.splitext(path.rstrip("/" + os.sep))[1]:
        raise DataError(f"{path}: a file's path ends without '/' (a trailing '/' names a "
                        f"directory)")
    else:
        raise DataError(f"{path}: unsupported file type {ext!r} (use .jsonl or .parquet)")
    source = stem if source is None else source
    fm = None if field_map == "auto" else field_map
    if fm is not None and not isinstance(fm, FieldMap):
        raise TypeError(f"field_map must be a FieldMap or 'auto', got {field_map!r}")
    stats = LoadStats()
    out: list[Example] = []
    for loc, row in rows:
        if limit is not None and len(out) >= limit:
            break
        stats.rows += 1
        try:
            if isinstance(row, Exception):
                raise row
            if not isinstance(row, dict):
                raise DataError(f"{loc}: expected a JSON object, got {type(row).__name__}")
            row_fm = fm
            if row_fm is None:      # detected again until a row loads (the first good row)
                row_fm = _detect_field_map(row)
                if row_fm is None:
                    raise DataError(
                        f"{loc}: cannot detect the fields (keys {sorted(row)}): auto-detection "
                        f"knows question/answer (gsm8k: an answer with '#### x'; "
                        f"question_answer: the answer itself), problem/answer (math_answer) "
                        f"and problem/solution (math); name the layout (data.field_map, hacpo "
                        f"eval's NAME=PATH:FIELDMAP) or pass a FieldMap")
            out.append(_to_example(row, row_fm, loc, source))
            fm = row_fm
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.skipped += 1
            if len(stats.problems) < stats.MAX_KEPT:
                stats.problems.append(str(e))
                stats.bad_rows.append(loc.rsplit(":", 1)[-1].strip())
    stats.loaded = len(out)
    return out, stats


def _to_example(row: dict, fm: FieldMap, loc: str, source: str) -> Example:
    for key in (fm.prompt, fm.answer):
        if key not in row:
            raise DataError(f"{loc}: missing field {key!r} (keys {sorted(row)})")
        _check_unicode(row[key], loc, key)
    prompt = row[fm.prompt]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{loc}: field {fm.prompt!r} must be a non-empty string")
    try:
        gold = parse_gold(row[fm.answer], fm.answer_format)
    except ValueError as e:
        hint = " (data.field_map=question_answer, or `hacpo eval --bench NAME=PATH:" \
            "question_answer`, reads answers that are the answer itself)" \
            if fm == GSM8K_FIELDS and "####" in str(e) else ""
        raise DataError(f"{loc}: field {fm.answer!r}: {e}{hint}") from None
    if fm == QUESTION_ANSWER_FIELDS and "####" in gold:
        raise DataError(f"{loc}: field {fm.answer!r}: a GSM8K solution ('#### x') where the "
                        f"answer itself was expected (field map question_answer: auto-detected "
                        f"when a file's first good row has no '####'); data.field_map=gsm8k "
                        f"(`hacpo eval --bench NAME=PATH:gsm8k`) reads GSM8K answers")
    if fm.id is not None:
        if row.get(fm.id) is None:
            raise DataError(f"{loc}: missing field {fm.id!r}")
        ex_id = str(row[fm.id])
    else:
        ex_id = f"{source}:{loc.rsplit(':', 1)[-1].split()[-1]}"
    return Example(id=ex_id, prompt=prompt.strip(), answer=gold, source=source)


def _check_unicode(value, loc: str, key: str) -> None:
    """A string field that is not text: JSON's ``"\\ud800"`` escape (half of an emoji's
    surrogate pair, cut by a truncation) reads as a lone surrogate, which no tokenizer encodes
    (the HF ones raised a TypeError deep in a run)."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{loc}: field {key!r}: a lone surrogate U+{ord(value[e.start]):04X} at "
                        f"character {e.start + 1} (half of a UTF-16 surrogate pair, e.g. an "
                        f"escape '\\u{ord(value[e.start]):04x}' of a cut emoji): not text "
                        f"any tokenizer encodes") from None


# --------------------------------------------------------------------------------------------
# Prompt templates
# --------------------------------------------------------------------------------------------

PROMPT_TEMPLATES: dict[str, str] = {
    "plain": "{question}",
    "boxed": "{question}\nPut the final answer in \\boxed{}.",
    "short": "Q: {question}\nA:",
}


def register_prompt_template(name: str, template: str, *, overwrite: bool = False) -> None:
    """Add a template; ``{question}`` is replaced by the question (other braces are literal)."""
    if "{question}" not in template:
        raise ValueError("a prompt template must contain '{question}'")
    if name in PROMPT_TEMPLATES and not overwrite and PROMPT_TEMPLATES[name] != template:
        raise ValueError(f"prompt template {name!r} already exists")
    PROMPT_TEMPLATES[name] = template


def apply_prompt_template(name: str, question: str) -> str:
    try:
        template = PROMPT_TEMPLATES[name]
    except KeyError:
        raise KeyError(f"unknown prompt template {name!r}; known: {sorted(PROMPT_TEMPLATES)}") \
            from None
    return template.replace("{question}", question)


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------

def content_digest(examples: Sequence[Example]) -> str:
    """16 hex digits of sha256 over the examples in order: each one's id, prompt and answer
    (a file rewritten in another order, or with other problems on the same lines, differs)."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.id, e.prompt, e.answer]).encode())
    return h.hexdigest()[:16]


class PromptSampler:
    """Deterministic shuffled iteration over examples, epoch after epoch.

    Epoch ``e`` visits the examples in a permutation seeded by ``(seed, e)``; a batch that
    crosses an epoch boundary finishes one epoch and starts the next. ``state_dict()`` holds
    the epoch and position, so a sampler restored with ``load_state_dict`` (over the same
    examples and seed) yields exactly the batches the original would have; over other
    examples (their ids, or, for states that record it, their content) it is a ValueError.
    """

    def __init__(self, examples: Sequence[Example], *, seed: int = 0, shuffle: bool = True):
        if not examples:
            raise ValueError("PromptSampler needs at least one example")
        self.examples = list(examples)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []
        self._fingerprint = hashlib.sha256(
            "\x00".join(e.id for e in self.examples).encode()).hexdigest()[:16]
        # the ids alone ("<file>:<line>") miss a file rewritten in another order or with
        # other problems on the same lines: the cursor would then point at other problems
        self._content = content_digest(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"hacpo.PromptSampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, batch_size: int) -> list[Example]:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        batch: list[Example] = []
        while len(batch) < batch_size:
            order = self._epoch_order()
            take = min(batch_size - len(batch), len(order) - self.position)
            batch.extend(self.examples[j] for j in order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "shuffle": self.shuffle, "num_examples": len(self.examples),
                "fingerprint": self._fingerprint, "content": self._content}

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor; ValueError if it was saved over other examples."""
        if state["num_examples"] != len(self.examples) or \
                state["fingerprint"] != self._fingerprint:
            raise ValueError("PromptSampler state was saved over different examples "
                             f"({state['num_examples']} examples, fingerprint "
                             f"{state['fingerprint']}; now {len(self.examples)}, "
                             f"{self._fingerprint})")
        if "content" in state and state["content"] != self._content:   # older states: ids
            raise ValueError("PromptSampler state was saved over examples with other "
                             "content: the same rows in another order, or other problems or "
                             f"answers (content {state['content']}; now {self._content})")
        if not 0 <= state["position"] < len(self.examples):
            raise ValueError(f"invalid sampler position {state['position']}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order_epoch = -1
