"""Data loaders (JSONL/parquet files written here), prompt templates, PromptSampler resume."""
import codecs
import json

import pytest

from hacpo.engine.data import (GSM8K_FIELDS, QUESTION_ANSWER_FIELDS, DataError, Example,
                               FieldMap, PromptSampler, apply_prompt_template, load_examples,
                               register_prompt_template)


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


GSM_ROWS = [
    {"question": "Tom has 3 apples and gets 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A shop sells 1,000 pens.", "answer": "It sells 1,000 pens.\n#### 1,000"},
    {"question": "Negative?", "answer": "#### -3"},
]


def test_gsm8k_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    examples, stats = load_examples(path)
    assert [e.answer for e in examples] == ["7", "1000", "-3"]
    assert examples[0] == Example(id="gsm:1", prompt=GSM_ROWS[0]["question"], answer="7",
                                  source="gsm")
    assert (stats.rows, stats.loaded, stats.skipped) == (3, 3, 0)


def test_math_style_boxed_and_answer_field(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Half of 1?", "solution": r"It is $\boxed{\frac{1}{2}}$."},
        {"problem": "Set?", "solution": r"So \boxed{\{1, 2\}}"},
    ])
    examples, _ = load_examples(path)
    assert [e.answer for e in examples] == [r"\frac{1}{2}", r"\{1, 2\}"]
    path2 = _write_jsonl(tmp_path / "math500.jsonl", [
        {"problem": "P", "solution": r"\boxed{wrong}", "answer": r"\frac{1}{2}", "uid": "x1"}])
    examples, _ = load_examples(path2)  # "answer" field preferred when present
    assert examples[0].answer == r"\frac{1}{2}" and examples[0].id == "math500:1"
    examples, _ = load_examples(path2, FieldMap("problem", "answer", "raw", id="uid"),
                                source="m")
    assert examples[0].id == "x1" and examples[0].source == "m"


def test_field_mapping(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", [
        {"q": "2+2?", "target": 4}, {"q": "Ten?", "target": "10"}])
    examples, _ = load_examples(path, FieldMap(prompt="q", answer="target", answer_format="raw"))
    assert [(e.prompt, e.answer) for e in examples] == [("2+2?", "4"), ("Ten?", "10")]
    # the error names the layouts auto-detection knows and where to name one
    with pytest.raises(DataError, match=r"custom.jsonl:line 1: cannot detect the fields \(keys "
                                        r"\['q', 'target'\]\): auto-detection knows "
                                        r"question/answer \(gsm8k: an answer with '#### x'; "
                                        r"question_answer: the answer itself\).*data.field_map"):
        load_examples(path)


def test_bad_rows_name_file_and_line(tmp_path):
    rows = [GSM_ROWS[0], "", "{not json", {"question": "no answer"},
            {"question": "no marker", "answer": "just text"}, [1, 2], GSM_ROWS[1]]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    # Line numbers are 1-based and count the blank line (line 2).
    with pytest.raises(DataError, match=r"bad.jsonl:line 3: invalid JSON"):
        load_examples(path)
    ok = _write_jsonl(tmp_path / "bad2.jsonl", [GSM_ROWS[0], {"question": "q"}])
    with pytest.raises(DataError, match=r"bad2.jsonl:line 2: missing field 'answer'"):
        load_examples(ok)
    nomark = _write_jsonl(tmp_path / "bad3.jsonl", [{"question": "q", "answer": "text"}])
    with pytest.raises(DataError, match=r"bad3.jsonl:line 1: field 'answer': no '####.*"
                                        r"data.field_map=question_answer, or `hacpo eval "
                                        r"--bench NAME=PATH:question_answer`, reads answers"):
        load_examples(nomark, GSM8K_FIELDS)
    examples, stats = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in examples] == ["7", "1000"]
    assert (stats.rows, stats.loaded, stats.skipped) == (6, 2, 4)
    assert any("line 6" in p and "expected a JSON object" in p for p in stats.problems)


def test_question_and_the_answer_itself_is_detected(tmp_path):
    """{"question": ..., "answer": 42} (the answer itself, no worked solution) loads: before,
    auto-detection read question/answer as GSM8K and every row was "no '####'". A GSM8K row
    further down such a file is an error naming it, not a worked solution taken as a gold."""
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": 4},
                                                {"question": "Half?", "answer": "1/2"},
                                                {"question": "Ten?", "answer": "1,000"}])
    examples, _ = load_examples(path)
    assert [(e.prompt, e.answer) for e in examples] == [("2+2?", "4"), ("Half?", "1/2"),
                                                         ("Ten?", "1000")]
    assert load_examples(path, QUESTION_ANSWER_FIELDS)[0] == examples
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [{"question": "2+2?", "answer": 4},
                                                    {"question": "3+3?", "answer": "3+3=6\n#### 6"}])
    with pytest.raises(DataError, match=r"mixed.jsonl:line 2: field 'answer': a GSM8K solution "
                                        r"\('#### x'\) where the answer itself was expected.*"
                                        r"data.field_map=gsm8k \(`hacpo eval --bench "
                                        r"NAME=PATH:gsm8k`\)"):
        load_examples(mixed)
    # a GSM8K file is still GSM8K (its first row's answer has the marker)
    gsm = _write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    assert [e.answer for e in load_examples(gsm)[0]] == ["7", "1000", "-3"]


def test_unreadable_json_rows_name_their_line_and_can_be_skipped(tmp_path):
    """A number past Python's int-digit limit and nesting deeper than the decoder's recursion
    limit escaped as bare ValueError / RecursionError (no file, no line, not skippable)."""
    path = tmp_path / "odd.JSONL"                      # the extension's case does not matter
    path.write_text(json.dumps(GSM_ROWS[0]) + "\n" + '{"question": "q", "answer": "#### '
                    + "9" * 5000 + '", "n": ' + "9" * 5000 + "}\n" + "[" * 200_000 + "\n"
                    + json.dumps(GSM_ROWS[1]) + "\n")
    with pytest.raises(DataError, match=r"odd.JSONL:line 2: unreadable JSON \(.*digits"):
        load_examples(path)
    examples, stats = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in examples] == ["7", "1000"]
    assert stats.bad_rows == ["line 2", "line 3"] and "recursion" in stats.problems[1]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"problem": ["One half?", "Missing", "Two?"],
                      "solution": [r"\boxed{\frac{1}{2}}", None, r"so \boxed{2}"]})
    path = tmp_path / "math.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"math.parquet:row 1: field 'solution': answer is null"):
        load_examples(path)
    examples, stats = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in examples] == [r"\frac{1}{2}", "2"]
    assert [e.id for e in examples] == ["math:0", "math:2"]
    assert stats.skipped == 1


def test_a_parquet_limit_reads_batches_not_the_whole_file(tmp_path, monkeypatch):
    """load_examples(limit=N) on parquet turned the whole file into Python rows first
    (pq.read_table + to_pylist: 1 GB and 5.6 s for 500 of 1M rows); it reads batches now,
    and the rows and their order across batch edges are those of the JSONL file."""
    import json

    import hacpo.engine.data as data_mod
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 25
    rows = [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=7)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(data_mod, "PARQUET_BATCH_ROWS", 4, raising=False)   # several batches
    decoded = []                        # the rows of each batch read from the file
    real = pq.ParquetFile

    class Counting(real):
        def iter_batches(self, *a, **k):
            for batch in super().iter_batches(*a, **k):
                decoded.append(batch.num_rows)
                yield batch
    monkeypatch.setattr(pq, "ParquetFile", Counting)
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read the whole file"))
    for limit in (None, 1, 4, 5, 9, n):
        decoded.clear()
        got, _ = load_examples(tmp_path / "d.parquet", limit=limit, source="d")
        want, _ = load_examples(tmp_path / "d.jsonl", limit=limit, source="d")
        assert [(e.prompt, e.answer) for e in got] == [(e.prompt, e.answer) for e in want]
        assert [e.id for e in got] == [f"d:{i}" for i in range(len(got))]   # row numbers
        assert len(got) == (n if limit is None else limit)
        assert sum(decoded) <= len(got) + 4                         # at most one batch more


def test_corrupt_parquet_is_a_data_error(tmp_path):
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read as parquet"):
        load_examples(path)
    with pytest.raises(FileNotFoundError):
        load_examples(tmp_path / "missing.parquet")


def test_bom_crlf_and_invalid_utf8(tmp_path):
    rows = (b'{"question": "Q1", "answer": "#### 5"}\r\n'
            b'{"question": "Q2", "answer": "#### 6"}\r\n')
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(codecs.BOM_UTF8 + rows)
    examples, stats = load_examples(bom)   # a byte-order mark is UTF-8, not a bad first row
    assert [e.answer for e in examples] == ["5", "6"] and stats.skipped == 0
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(rows + b'{"question": "caf\xe9?", "answer": "#### 7"}\n'
                    + b'{"question": "Q4", "answer": "#### 8"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:line 3: not valid UTF-8"):
        load_examples(bad)
    examples, stats = load_examples(bad, skip_bad_rows=True)
    assert [e.answer for e in examples] == ["5", "6", "8"]
    assert stats.bad_rows == ["line 3"] and stats.skipped == 1
    # "\r" is JSON whitespace: it does not end a JSON Lines record.
    cr = tmp_path / "cr.jsonl"
    cr.write_bytes(b'{"question": "Q",\r "answer": "#### 9"}\n')
    assert [e.answer for e in load_examples(cr)[0]] == ["9"]


def test_float_answers(tmp_path):
    fm = FieldMap("q", "target", "raw")
    path = _write_jsonl(tmp_path / "floats.jsonl", [
        {"q": "a", "target": 18.0}, {"q": "b", "target": 1e-05}, {"q": "c", "target": 2.5},
        {"q": "d", "target": 1e16}])
    examples, _ = load_examples(path, fm)
    # No exponent (math-verify reads "1e-05" as e - 5), integral floats as integers.
    assert [e.answer for e in examples] == ["18", "0.00001", "2.5", "10000000000000000"]
    for name, row in (("nan", '{"q": "a", "target": NaN}'),
                      ("inf", '{"q": "a", "target": Infinity}')):
        bad = _write_jsonl(tmp_path / f"{name}.jsonl", [row])
        with pytest.raises(DataError, match=rf"{name}.jsonl:line 1: field 'target': .*not a "
                                            "finite number"):
            load_examples(bad, fm)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_examples(path)


def test_prompt_templates():
    assert apply_prompt_template("plain", "What is 2+2?") == "What is 2+2?"
    assert apply_prompt_template("boxed", "Q?").endswith("Put the final answer in \\boxed{}.")
    assert apply_prompt_template("short", "Q?") == "Q: Q?\nA:"
    register_prompt_template("test_cot", "{question} Think step by step {braces}.")
    assert apply_prompt_template("test_cot", "Q?") == "Q? Think step by step {braces}."
    with pytest.raises(KeyError, match="unknown prompt template"):
        apply_prompt_template("nope", "Q?")
    with pytest.raises(ValueError, match="{question}"):
        register_prompt_template("bad", "no placeholder")


def _examples(n):
    return [Example(id=str(i), prompt=f"p{i}", answer=str(i), source="t") for i in range(n)]


def test_prompt_sampler_epochs_and_determinism():
    exs = _examples(7)
    s = PromptSampler(exs, seed=3)
    first_epoch = [e.id for e in s.next_batch(7)]
    assert sorted(first_epoch, key=int) == [str(i) for i in range(7)]  # a permutation
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 0
    second_epoch = [e.id for e in s.next_batch(7)]
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    again = PromptSampler(exs, seed=3)
    assert [e.id for e in again.next_batch(14)] == first_epoch + second_epoch
    other = PromptSampler(exs, seed=4)
    assert [e.id for e in other.next_batch(7)] != first_epoch


def test_prompt_sampler_resume_is_exact():
    exs = _examples(10)
    ref = PromptSampler(exs, seed=11)
    full = [[e.id for e in ref.next_batch(4)] for _ in range(8)]  # crosses several epochs

    run = PromptSampler(exs, seed=11)
    got = [[e.id for e in run.next_batch(4)] for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # serializable
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = PromptSampler(exs, seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    got += [[e.id for e in resumed.next_batch(4)] for _ in range(5)]
    assert got == full

    with pytest.raises(ValueError, match="different examples"):
        PromptSampler(_examples(9), seed=11).load_state_dict(state)


def test_skipped_rows_record_their_places(tmp_path):
    """LoadStats.bad_rows: where each skipped row is (1-based JSONL line, 0-based parquet row),
    next to its message in problems."""
    path = _write_jsonl(tmp_path / "bad.jsonl",
                        [GSM_ROWS[0], "", "{not json", {"question": "q"}, GSM_ROWS[1]])
    examples, stats = load_examples(path, skip_bad_rows=True)
    assert len(examples) == 2 and stats.bad_rows == ["line 3", "line 4"]
    assert [p.split(": ", 1)[0].rsplit(":", 1)[-1] for p in stats.problems] == stats.bad_rows
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"problem": ["A?", "B?"], "solution": [None, r"\boxed{2}"]}),
                   tmp_path / "m.parquet")
    _, stats = load_examples(tmp_path / "m.parquet", skip_bad_rows=True)
    assert stats.bad_rows == ["row 0"] and stats.skipped == 1


def test_lone_surrogates_are_a_data_error_naming_the_field(tmp_path):
    """JSON's "\\ud800" escape (half of a cut emoji's surrogate pair) reads as a lone
    surrogate no tokenizer encodes: the HF tokenizers raised a TypeError deep in the run, and
    --skip-bad-rows did not skip the row."""
    path = tmp_path / "surr.jsonl"
    path.write_text('{"question": "What is 2+2? \\ud800", "answer": "#### 4"}\n'
                    '{"question": "What is 1+1?", "answer": "#### \\udc00 2"}\n'
                    '{"question": "What is 3+3? \\ud83d\\ude00", "answer": "#### 6"}\n')
    with pytest.raises(DataError, match=r"surr\.jsonl:line 1: field 'question': a lone "
                                        r"surrogate U\+D800 at character 14"):
        load_examples(path)
    examples, stats = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in examples] == ["6"]         # a whole pair is an emoji: kept
    assert examples[0].prompt == "What is 3+3? \U0001F600"
    assert stats.bad_rows == ["line 1", "line 2"]
    assert "field 'answer': a lone surrogate U+DC00 at character 6" in stats.problems[1]


def test_utf16_files_and_json_messages_say_what_is_wrong(tmp_path):
    row = '{"question": "Q1", "answer": "#### 5"}\n'
    for bom in (b"", codecs.BOM_UTF16_LE):
        path = tmp_path / "u16.jsonl"
        path.write_bytes(bom + row.encode("utf-16-le"))
        with pytest.raises(DataError, match=r"u16\.jsonl:line 1: .*\(the file looks like "
                                            r"UTF-16: save it as UTF-8\)"):
            load_examples(path)
    nul = tmp_path / "nul.jsonl"      # a tail of NULs (a crash mid-write): no UTF-16 hint
    nul.write_bytes(row.encode() + b"\x00" * 64 + b"\n")
    with pytest.raises(DataError) as e:
        load_examples(nul)
    assert "line 2: invalid JSON" in str(e.value) and "UTF-16" not in str(e.value)
    tab = _write_jsonl(tmp_path / "tab.jsonl", ['{"question": "a\tb", "answer": "#### 5"}'])
    with pytest.raises(DataError) as e:
        load_examples(tab)
    # json's "Invalid control character at" + " at column": one "at", no UTF-16 hint
    assert str(e.value).endswith("line 1: invalid JSON (Invalid control character at column "
                                 "16)")


def test_a_file_path_with_a_trailing_slash_says_so(tmp_path):
    """"unsupported file type ''" named no cause."""
    path = _write_jsonl(tmp_path / "t.jsonl", GSM_ROWS)
    with pytest.raises(DataError, match=r"t\.jsonl/: a file's path ends without '/'"):
        load_examples(f"{path}/")
    with pytest.raises(DataError, match=r"unsupported file type ''"):
        load_examples(tmp_path / "README")
