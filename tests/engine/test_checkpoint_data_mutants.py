"""Behaviours of hacpo.engine.checkpoint, .data and .validation that a mutation audit found no
test pinning: the order of an atomic write (file fsync before the rename, directory fsync
after), the writer's lock on its temp file, temp-file cleanup on a file system without locks,
a second error on closing a half-written file, a checkpoint cut short (a truncated file, not an
I/O error), the messages of a failed first write, of a directory or unwritable target, and
HACPO_TRUSTED_CHECKPOINTS=0; for data: the other file extensions, ``limit`` (0, and rows
counted), bad prompts and ids named by line and field, one layout detection per file, the cap
on kept problems, gold-answer edge cases, the content digest over prompts and order,
sampler/template/FieldMap argument checks; input checks' types."""
import errno
import os
import re
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from hacpo.engine import checkpoint as ckpt
from hacpo.engine import data as data_mod
from hacpo.engine.data import (DataError, Example, FieldMap, PromptSampler, load_examples,
                               parse_gold, register_prompt_template)
from hacpo.engine.errors import StorageError
from hacpo.engine.validation import check_agents, check_rewards, check_same_length

from .test_checkpoint import _Plain
from .test_data import GSM_ROWS, _examples, _write_jsonl


def _age(path, seconds=None):
    old = time.time() - (seconds or 2 * ckpt.FRESH_S)
    os.utime(path, (old, old))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- checkpoint: the atomic write ------------------------------------------------------------
def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path,
                                                                                 monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = str(tmp_path / "checkpoint.pt")
    ckpt._write_atomic(path, lambda f: (events.append("write"), f.write(b"abc")))
    assert events == ["write", "fsync-file", "replace", "fsync-dir"]
    assert open(path, "rb").read() == b"abc"


_CHECK_TEMP = r"""
import sys
from hacpo.engine import checkpoint as ckpt
print(ckpt.writer_dead(sys.argv[1]), ckpt.remove_stale_temps(sys.argv[2]))
"""


def test_a_writer_holds_the_lock_on_its_temp_file_until_the_rename(tmp_path):
    """Mid-save, another process finds the writer's temp file locked: not dead, not removed,
    even once older than FRESH_S (a save that takes long)."""
    path = tmp_path / "checkpoint.pt"
    seen = []

    def write(f):
        f.write(b"x" * 100)
        f.flush()
        tmp, = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-checkpoint.pt.")]
        _age(tmp_path / tmp)
        out = subprocess.run([sys.executable, "-c", _CHECK_TEMP, str(tmp_path / tmp), str(path)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        seen.append(out.stdout.strip() or out.stderr)
        assert (tmp_path / tmp).exists()

    ckpt._write_atomic(str(path), write)
    assert seen == ["False []"]
    assert path.read_bytes() == b"x" * 100 and os.listdir(tmp_path) == ["checkpoint.pt"]


def test_this_process_s_own_temp_files_are_never_removed(tmp_path):
    """Another thread of this process may be writing it (its lock is this process's own)."""
    own = tmp_path / f".tmp-checkpoint.pt.{socket.gethostname()}.{os.getpid()}.abc"
    own.write_bytes(b"x")
    _age(own)
    assert ckpt.remove_stale_temps(str(tmp_path / "checkpoint.pt")) == []
    assert own.exists()


def test_without_locks_only_this_host_s_dead_pids_are_stale(tmp_path, monkeypatch):
    """A file system without POSIX locks (ENOLCK): saves still work; a temp file counts as a
    dead writer's only if it names this host and a pid that no longer runs (not a live pid,
    not another user's live process, not another host's pid, not this process)."""
    def no_locks(fd, cmd, *a):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(ckpt.fcntl, "lockf", no_locks)
    host, dead, others = socket.gethostname(), _dead_pid(), 4_000_000
    real_kill = os.kill

    def kill(pid, sig):
        if pid == others:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_kill(pid, sig)
    monkeypatch.setattr(os, "kill", kill)
    names = {"dead": f".tmp-checkpoint.pt.{host}.{dead}.a1",
             "live": f".tmp-checkpoint.pt.{host}.{os.getppid()}.a2",
             "other_user": f".tmp-checkpoint.pt.{host}.{others}.a3",
             "other_host": f".tmp-checkpoint.pt.not-{host}.{dead}.a4",
             "own": f".tmp-checkpoint.pt.{host}.{os.getpid()}.a5"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
        _age(tmp_path / n)
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"step": 1}, str(path))       # no lock taken: still saved
    assert ckpt.load(str(path))["step"] == 1
    left = set(os.listdir(tmp_path))
    assert left == {"checkpoint.pt"} | (set(names.values()) - {names["dead"]}), left


def _failing_save(monkeypatch):
    real = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("fail"):
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", save)


def test_a_failed_first_write_says_the_file_was_not_written(tmp_path, monkeypatch):
    _failing_save(monkeypatch)
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(StorageError) as e:
        ckpt.save_atomic({"fail": True}, str(path))
    assert str(e.value).startswith(f"cannot write {path}: No space left on device")
    assert str(e.value).endswith(f"; {path} was not written (the write went to a temporary "
                                 f"file, removed)")
    assert os.listdir(tmp_path) == []
    ckpt.save_atomic({"step": 1}, str(path))
    with pytest.raises(StorageError, match=rf"; {path} is unchanged \(the write went"):
        ckpt.save_atomic({"fail": True}, str(path))
    assert ckpt.load(str(path)) == {"step": 1} and os.listdir(tmp_path) == ["checkpoint.pt"]


_FILE_SIZE_LIMIT = r"""
import resource, sys
from hacpo.engine import checkpoint as ckpt
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:     # the last write fails with bytes left in the file's buffer: closing it fails again
    ckpt._write_atomic(sys.argv[1], lambda f: (f.write(b"a" * 100), f.write(b"b" * 99_950),
                                               f.write(b"c" * 5000)))
except BaseException as e:
    print(type(e).__name__, "|", e)
"""


def test_a_write_past_the_size_limit_with_bytes_still_buffered_is_one_storage_error(tmp_path):
    """The close of the temp file after a failed write raises the same error again (the
    buffered bytes): that second error is not the one reported."""
    path = tmp_path / "out.bin"
    out = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(path)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.startswith(f"StorageError | cannot write {path}: File too large"), \
        out.stdout + out.stderr
    assert f"{path} was not written" in out.stdout and os.listdir(tmp_path) == []


def test_directory_checks_name_the_path(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(NotADirectoryError, match=rf"run dir {tmp_path}/afile is a file, not a "
                                                 rf"directory"):
        ckpt.ensure_dir(str(tmp_path / "afile"), "run dir")
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw:
                        str(p) != str(ro) and real_access(p, mode, **kw))
    with pytest.raises(StorageError, match=rf"^out dir {ro} is not writable \("):
        ckpt.ensure_dir(str(ro), "out dir")
    with pytest.raises(StorageError, match=rf"^cannot write {ro}/c\.pt: directory {ro} is not "
                                            rf"writable \(permission denied\)$"):
        ckpt.save_atomic({}, str(ro / "c.pt"))
    with pytest.raises(IsADirectoryError, match=rf"checkpoint {ro} is a directory, not a "
                                                rf"checkpoint file"):
        ckpt.load(str(ro))


def test_only_the_value_1_trusts_a_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    torch.save({"a": _Plain(3)}, path)
    for value in ("0", "", "yes"):
        monkeypatch.setenv(ckpt.TRUST_ENV, value)
        with pytest.raises(RuntimeError, match="holds Python objects other than tensors"):
            ckpt.load(path)
    monkeypatch.setenv(ckpt.TRUST_ENV, "1")
    assert ckpt.load(path)["a"].value == 3


@pytest.mark.parametrize("cut", [1, 10, 300, "half"])
def test_a_checkpoint_cut_short_says_it_is_truncated(tmp_path, cut):
    # A cut in the last ~1.4 KB (the zip directory) made torch raise a bare "[Errno 22]
    # Invalid argument", reported as an I/O error; a cut earlier gave torch's "failed finding
    # central directory. This is an internal miniz error". Both: a truncated file.
    path = str(tmp_path / "c.pt")
    ckpt.save_atomic({"step": 3, "w": torch.arange(1000.0)}, path)
    data = open(path, "rb").read()
    keep = len(data) // 2 if cut == "half" else len(data) - cut
    with open(path, "wb") as f:
        f.write(data[:keep])
    with pytest.raises(RuntimeError, match=r"not the zip archive torch.save writes \(a "
                                           r"truncated file") as e:
        ckpt.load(path)
    assert path in str(e.value) and "Invalid argument" not in str(e.value)
    assert "miniz" not in str(e.value)


def test_a_damaged_checkpoint_fails_its_crc_check(tmp_path):
    """torch.load does not check the CRC-32 of the parts of its archive: a byte flipped in a
    tensor loaded as a wrong weight, one in the pickle as a wrong config value or a message
    to trust the file with HACPO_TRUSTED_CHECKPOINTS; both are named as damage now."""
    import zipfile
    path = str(tmp_path / "c.pt")
    ckpt.save_atomic({"step": 3, "cfg": {"lr": 0.5}, "w": torch.arange(1000.0)}, path)
    data = open(path, "rb").read()
    with zipfile.ZipFile(path) as z:
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
    for part in ("data/0", "data.pkl"):
        info = infos[part]
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        at = start + info.file_size // 2
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(damaged))
        with pytest.raises(RuntimeError, match=rf"checkpoint {re.escape(path)} is corrupted: "
                                               rf"its part '.*{re.escape(part)}' fails its CRC "
                                               rf"check"):
            ckpt.load(path)
    with open(path, "wb") as f:
        f.write(data)
    assert ckpt.load(path)["step"] == 3


# -- data: files and rows --------------------------------------------------------------------
def test_ndjson_and_pq_extensions_load(tmp_path):
    exs, _ = load_examples(_write_jsonl(tmp_path / "g.ndjson", GSM_ROWS))
    assert [e.answer for e in exs] == ["7", "1000", "-3"] and exs[0].id == "g:1"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"problem": ["A?"], "answer": ["4"]}), tmp_path / "m.pq")
    exs, _ = load_examples(tmp_path / "m.pq")
    assert [(e.id, e.answer) for e in exs] == [("m:0", "4")]


def test_limit_zero_loads_nothing_and_rows_count_only_what_was_read(tmp_path):
    path = _write_jsonl(tmp_path / "g.jsonl", GSM_ROWS)
    exs, stats = load_examples(path, limit=0)
    assert exs == [] and (stats.rows, stats.loaded) == (0, 0)
    exs, stats = load_examples(path, limit=2)
    assert len(exs) == 2 and (stats.rows, stats.loaded, stats.skipped) == (2, 2, 0)


@pytest.mark.parametrize("prompt", [5, None, ["q"], "", "  \n "])
def test_a_prompt_that_is_no_text_names_line_and_field(tmp_path, prompt):
    path = _write_jsonl(tmp_path / "p.jsonl", [GSM_ROWS[0], {"question": prompt,
                                                             "answer": "#### 1"}])
    with pytest.raises(DataError, match=r"p\.jsonl:line 2: field 'question' must be a "
                                        r"non-empty string$"):
        load_examples(path)
    exs, stats = load_examples(path, skip_bad_rows=True)
    assert len(exs) == 1 and stats.bad_rows == ["line 2"]


def test_prompt_is_stripped_and_invalid_json_names_the_column(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [{"question": "  Q?\n", "answer": "#### 2"}])
    assert load_examples(path)[0][0].prompt == "Q?"
    bad = _write_jsonl(tmp_path / "j.jsonl", ['{"question": "q" "answer": 1}'])
    with pytest.raises(DataError, match=r"j\.jsonl:line 1: invalid JSON \(Expecting ',' "
                                        r"delimiter at column 18\)"):
        load_examples(bad)


def test_a_null_or_missing_id_field_is_a_bad_row(tmp_path):
    fm = FieldMap("q", "a", "raw", id="uid")
    for row in ({"q": "Q", "a": 1, "uid": None}, {"q": "Q", "a": 1}):
        path = _write_jsonl(tmp_path / "i.jsonl", [{"q": "Q", "a": 1, "uid": 7}, row])
        with pytest.raises(DataError, match=r"i\.jsonl:line 2: missing field 'uid'$"):
            load_examples(path, fm)
    assert load_examples(path, fm, skip_bad_rows=True)[0][0].id == "7"


def test_the_layout_is_detected_once_from_the_first_good_row(tmp_path):
    """A later row of another known layout is a bad row, not a second detection."""
    path = _write_jsonl(tmp_path / "mix.jsonl", ["{bad", GSM_ROWS[0],
                                                 {"problem": "P?", "solution": r"\boxed{2}"}])
    with pytest.raises(DataError, match=r"mix\.jsonl:line 1: invalid JSON"):
        load_examples(path)
    exs, stats = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in exs] == ["7"] and stats.bad_rows == ["line 1", "line 3"]
    assert stats.problems[1].startswith(f"{path}:line 3: missing field 'question'")


def test_skipped_rows_keep_only_the_first_messages(tmp_path):
    rows = [{"question": f"q{i}"} for i in range(25)] + [GSM_ROWS[0]]
    exs, stats = load_examples(_write_jsonl(tmp_path / "many.jsonl", rows), skip_bad_rows=True)
    assert len(exs) == 1 and stats.skipped == 25 and stats.rows == 26
    assert len(stats.problems) == len(stats.bad_rows) == data_mod.LoadStats.MAX_KEPT == 20
    assert stats.bad_rows[0] == "line 1" and stats.bad_rows[-1] == "line 20"


def test_gold_answer_edge_cases(tmp_path):
    with pytest.raises(ValueError, match="answer has type bool"):
        parse_gold(True, "raw")
    assert parse_gold("so #### 3.", "gsm8k") == "3"
    assert parse_gold("#### 2.5.", "gsm8k") == "2.5"
    for value, fmt in (("#### ", "gsm8k"), ("####", "gsm8k"), ("  ", "raw"),
                       (r"\boxed{ }", "boxed")):
        with pytest.raises(ValueError, match="^the answer is empty$"):
            parse_gold(value, fmt)
    path = _write_jsonl(tmp_path / "b.jsonl", [{"q": "Q", "t": False}])
    with pytest.raises(DataError, match=r"b\.jsonl:line 1: field 't': answer has type bool"):
        load_examples(path, FieldMap("q", "t", "raw"))
    with pytest.raises(ValueError, match="answer_format must be"):
        FieldMap("q", "t", "latex")


# -- data: sampler and templates -------------------------------------------------------------
def test_sampler_refuses_other_prompts_a_negative_position_and_an_empty_batch():
    exs = _examples(4)
    state = PromptSampler(exs, seed=1).state_dict()
    other_prompt = exs[:3] + [Example(id="3", prompt="other", answer="3", source="t")]
    with pytest.raises(ValueError, match="other content"):
        PromptSampler(other_prompt, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid sampler position -1"):
        PromptSampler(exs, seed=1).load_state_dict({**state, "position": -1})
    with pytest.raises(ValueError, match="batch_size must be > 0, got 0"):
        PromptSampler(exs, seed=1).next_batch(0)
    # the digest is over the examples in order (documented), not over a set of them
    assert data_mod.content_digest(exs) != data_mod.content_digest(exs[::-1])


def test_register_prompt_template_refuses_to_replace_silently(monkeypatch):
    monkeypatch.setattr(data_mod, "PROMPT_TEMPLATES", dict(data_mod.PROMPT_TEMPLATES))
    register_prompt_template("mut_t", "A {question}")
    register_prompt_template("mut_t", "A {question}")          # the same again: fine
    with pytest.raises(ValueError, match="prompt template 'mut_t' already exists"):
        register_prompt_template("mut_t", "B {question}")
    assert data_mod.apply_prompt_template("mut_t", "q") == "A q"
    register_prompt_template("mut_t", "B {question}", overwrite=True)
    assert data_mod.apply_prompt_template("mut_t", "q") == "B q"


# -- validation ------------------------------------------------------------------------------
def test_input_checks_refuse_wrong_dims_and_dtypes():
    with pytest.raises(ValueError, match=r"x must be 1-D \[N\], got shape \(2, 2\)"):
        check_same_length(x=torch.zeros(2, 2))
    assert check_same_length(a=torch.zeros(3), b=torch.zeros(3)) == 3
    with pytest.raises(TypeError, match="rewards must be a floating tensor, got torch.int64"):
        check_rewards(torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="agent must be an integer tensor, got torch.float32"):
        check_agents(torch.tensor([0.0, 1.0]), 2)
    with pytest.raises(ValueError, match=r"agent index -1 of sample 1 is out of range 0\.\.1"):
        check_agents(torch.tensor([0, -1]), 2)
    check_rewards(torch.tensor([0.0, 1.0]))                         # the bounds are allowed
