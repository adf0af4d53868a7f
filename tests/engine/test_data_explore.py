"""Exploratory audit of loading one's own dataset files: what a user's file met that the
loader got wrong (a bad first row fixing the detected layout, a float gold's digits, parquet
decimal and float32 answer columns)."""
import decimal

import pytest

from hacpo.engine.data import FieldMap, load_examples, parse_gold

from .test_data import _write_jsonl


def test_a_bad_first_row_does_not_fix_the_detected_layout(tmp_path):
    """The layout is detected from the first *good* row: a first row whose answer is null (read
    as GSM8K: not a number) was skipped, but its layout stayed, and every later row holding the
    answer itself was skipped as "no '####'" (the whole file lost with --skip-bad-rows)."""
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "answer": None},
                                                {"question": "b", "answer": 5},
                                                {"question": "c", "answer": "6"}])
    exs, stats = load_examples(path, skip_bad_rows=True)
    assert [(e.id, e.answer) for e in exs] == [("qa:2", "5"), ("qa:3", "6")]
    assert stats.bad_rows == ["line 1"] and stats.problems == [
        f"{path}:line 1: field 'answer': answer is null"]


def test_a_float_gold_keeps_the_digits_written():
    """An integral float past 2**53 read through int() gave its binary value's digits: 1e23
    (JSON, a parquet float64 column) was the gold 99999999999999991611392."""
    assert parse_gold(1e23, "raw") == "1" + "0" * 23
    assert parse_gold(-1e22, "raw") == "-1" + "0" * 22
    assert [parse_gold(v, "raw") for v in (18.0, -0.0, -3.0, 1e-05)] == ["18", "0", "-3",
                                                                          "0.00001"]


def test_a_float_gold_from_a_file(tmp_path):
    path = _write_jsonl(tmp_path / "f.jsonl", ['{"q": "a", "t": 1e23}', '{"q": "b", "t": 1.0}'])
    exs, _ = load_examples(path, FieldMap("q", "t", "raw"))
    assert [e.answer for e in exs] == ["1" + "0" * 23, "1"]


def test_a_parquet_decimal_answer_column_is_numbers(tmp_path):
    """A decimal128 column (a SQL or pandas Decimal export) read as Decimals: every row was
    "answer has type Decimal, expected a string or number", and auto-detection took the file
    for GSM8K."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    answers = [decimal.Decimal(v) for v in ("2.50", "3", "-0.00", "12345678901234567890.5")]
    pq.write_table(pa.table({"question": list("abcd"),
                             "answer": pa.array(answers, pa.decimal128(38, 2))}),
                   tmp_path / "dec.parquet")
    exs, _ = load_examples(tmp_path / "dec.parquet")
    assert [e.answer for e in exs] == ["2.5", "3", "0", "12345678901234567890.5"]
    with pytest.raises(ValueError, match=r"^answer is NaN, not a finite number$"):
        parse_gold(decimal.Decimal("NaN"), "raw")


def test_a_parquet_float32_answer_keeps_the_digits_written(tmp_path):
    """A float32 column's 0.1 reads as the double 0.10000000149011612, which was the gold
    (shown in eval samples, and no exact match for a response "0.1")."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"question": list("abc"),
                             "answer": pa.array([0.1, 2.5, 16777216.0], pa.float32())}),
                   tmp_path / "f32.parquet")
    exs, _ = load_examples(tmp_path / "f32.parquet")
    assert [e.answer for e in exs] == ["0.1", "2.5", "16777216"]
