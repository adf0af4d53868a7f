"""What a user sees when the file system misbehaves: a full disk or a file-size limit while a
checkpoint is written, a run / eval / compare directory that cannot be made or written, a
warm-start cache that cannot take its file, a checkpoint cut short, and a training file
rewritten between a run and its --resume. Each is one error line naming the path and the cause
(or, for a cache, a warning), and the last good files stay usable."""
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from hacpo.engine import build, checkpoint as ckpt
from hacpo.engine.data import PromptSampler, load_examples
from hacpo.engine.errors import StorageError, is_user_error
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train
from hacpo.launch import cli


def _cfg(tmp_path, name="run", **over):
    base = {"out_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"),
            "threads": "1", "plots": False, "tensorboard": False}
    return load_config("tiny3", overrides={**base, **over})


# -- atomic writes --------------------------------------------------------------------------
def test_checkpoint_write_past_the_file_size_limit_names_the_path_and_keeps_the_last(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE, as `ulimit -f`; Python ignores SIGXFSZ): torch's zip writer
    turned it into "RuntimeError: unexpected pos", and closing the half-written temp file
    raised a second, bare "OSError: [Errno 27] File too large" naming no file. Now: one
    StorageError naming the checkpoint and the cause; the previous checkpoint and nothing
    else is left."""
    path = tmp_path / "checkpoint.pt"
    script = textwrap.dedent(f"""
        import resource, torch
        from hacpo.engine import checkpoint as ckpt
        ckpt.save_atomic({{"step": 1, "w": torch.ones(10)}}, {str(path)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        try:
            ckpt.save_atomic({{"step": 2, "w": torch.zeros(200_000)}}, {str(path)!r})
        except BaseException as e:
            print(type(e).__name__, getattr(e, "errno", None), "|", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    kind, _, msg = out.stdout.strip().partition(" | ")
    assert kind == f"StorageError {errno.EFBIG}", out.stdout
    assert msg.startswith(f"cannot write {path}: File too large (a file-size limit"), msg
    assert "unchanged" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]       # no temp file left
    state = ckpt.load(str(path))
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(10))


def test_atomic_files_get_the_mode_open_gives(tmp_path):
    """mkstemp makes 0600 files: checkpoint.pt, config.json, summary.json and the plots were
    unreadable to the run's group (metrics.jsonl, written with open(), was 0644)."""
    old = os.umask(0o022)
    try:
        ckpt.write_text_atomic(str(tmp_path / "a.json"), "{}")
        with open(tmp_path / "b.json", "w"):
            pass
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.json").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "b.json").st_mode & 0o777 == 0o644


def test_empty_checkpoint_says_so(tmp_path):
    """A checkpoint truncated to 0 bytes was 'cannot be read (EOFError: )'."""
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"checkpoint .*checkpoint\.pt cannot be read: the "
                                           r"file is empty"):
        ckpt.load(str(tmp_path / "checkpoint.pt"))


# -- a full disk while training -------------------------------------------------------------
def _full_disk_at(monkeypatch, nth: int):
    """torch.save of a training checkpoint: the ``nth`` call writes 4 KiB, then fails with
    ENOSPC (a disk that fills mid-write)."""
    real, calls = torch.save, []

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and {"step", "sampler", "agents"} <= set(obj):
            calls.append(1)
            if len(calls) == nth:
                f.write(b"\0" * 4096)
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", save)


def test_disk_full_at_a_checkpoint_is_one_line_and_resume_continues(tmp_path, monkeypatch,
                                                                     capsys):
    """The step-2 checkpoint meets a full disk: `hacpo train` ends with one line naming the
    file and the cause (it was a traceback of three chained errors), exit status 2; the step-1
    checkpoint and the metrics rows stay, and --resume (space freed) ends with the very
    checkpoint an uninterrupted run writes."""
    args = ["--preset", "tiny3", "--out-dir", str(tmp_path / "run"), "--set", "threads=1",
            "plots=false", "tensorboard=false", f"cache_dir={tmp_path / 'cache'}"]
    with monkeypatch.context() as m:
        _full_disk_at(m, 2)
        assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    ck = tmp_path / "run" / "checkpoint.pt"
    assert err[0].startswith(f"hacpo train: error: cannot write {ck}: No space left on "
                             f"device (the disk is full)"), err
    assert "unchanged" in err[0] and "--resume" in err[0] and len(err) == 2, err
    assert ckpt.load(str(ck))["step"] == 1
    assert not [p for p in os.listdir(tmp_path / "run") if p.startswith(".tmp-")]
    rows = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]

    assert cli.main(["train", *args, "--resume"]) == 0
    train(_cfg(tmp_path, "whole"), echo=lambda *_: None)
    resumed, whole = ckpt.load(str(ck)), ckpt.load(str(tmp_path / "whole" / "checkpoint.pt"))
    assert resumed["step"] == whole["step"] == 2
    for a, b in zip(resumed["agents"], whole["agents"]):
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), key
    rows = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]


def test_full_disk_on_another_write_is_one_line(tmp_path, monkeypatch, capsys):
    """A write that is not an atomic one (here the appended metrics row) failing for a full
    disk ended `hacpo train` with a traceback; it is one line naming the file and the cause."""
    from hacpo.engine import metrics

    def log(self, step, values):
        raise OSError(errno.ENOSPC, "No space left on device", self.path)
    monkeypatch.setattr(metrics.MetricsLogger, "log", log)
    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny3", "--out-dir", str(out), "--set", "threads=1",
                     "plots=false", "tensorboard=false", f"cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"hacpo train: error: {out / 'metrics.jsonl'}: No space left on "
                             f"device (the disk is full)"), err
    assert len(err) == 2 and "--resume" in err[0], err


def test_a_metrics_row_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """A full disk's error at the row's flush / fsync names no file (the test above gives it
    one): `hacpo train: error: No space left on device` said nothing of metrics.jsonl."""
    from hacpo.engine import metrics
    from hacpo.engine.errors import StorageError, is_user_error

    class FullDisk:            # os, whose fsync fails as a full disk's does: no filename
        def __getattr__(self, name):
            return getattr(os, name)

        def fsync(self, fd):
            raise OSError(errno.ENOSPC, "No space left on device")

    logger = metrics.MetricsLogger(str(tmp_path), tensorboard=False)
    logger.log(0, {"reward/a": 0.5})
    monkeypatch.setattr(metrics, "os", FullDisk())
    with pytest.raises(StorageError, match=rf"^cannot write {tmp_path / 'metrics.jsonl'}: No "
                                           rf"space left on device \(the disk is full\); the "
                                           rf"rows of the steps before are kept") as e:
        logger.log(1, {"reward/a": 0.5})
    assert is_user_error(e.value) and e.value.errno == errno.ENOSPC


def test_a_lock_file_that_cannot_be_written_leaves_no_new_run_dir(tmp_path, monkeypatch):
    """A full disk when the lock's holder is written (the first write of a new run) left the
    new run dir holding an empty .hacpo-run.lock, and named no file."""
    import socket

    from hacpo.engine.errors import StorageError

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(socket, "gethostname", full)     # the holder line's first call
    out = tmp_path / "new" / "run"
    with pytest.raises(StorageError, match=rf"cannot write {out / '.hacpo-run.lock'}: No space"):
        train(_cfg(tmp_path, out_dir=str(out)), echo=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


# -- directories that cannot be made or written ---------------------------------------------
def test_warm_start_cache_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    """A cache dir that cannot take the warm start (here a file in its place; a read-only
    shared cache or a full disk alike) ended the run after the warm-up had trained; the
    cache is an optimisation: the run goes on with the warm start it trained, logged."""
    (tmp_path / "blocker").write_text("a file")
    cfg = _cfg(tmp_path, cache_dir=str(tmp_path / "blocker" / "cache"))
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        warm = build.warm_start(cfg, data, policies, echo=lambda *_: None)
    assert [w["cached"] for w in warm] == [False] * len(cfg.agents)
    assert all(w["final_loss"] > 0 for w in warm)
    msgs = [r.getMessage() for r in caplog.records if "not cached" in r.getMessage()]
    assert len(msgs) == len(cfg.agents) and all(str(tmp_path / "blocker") in m for m in msgs)


def test_compare_into_a_dangling_link_is_a_user_error(tmp_path):
    """os.makedirs on a dangling symlink raised FileExistsError outside the checks: a
    traceback, exit status 1."""
    from hacpo.engine.compare import run_compare
    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(OSError, match="symbolic link to .*gone, which does not exist") as e:
        run_compare(_cfg(tmp_path), ["gspo"], [0], str(tmp_path / "link"),
                    echo=lambda *_: None)
    assert is_user_error(e.value) and not (tmp_path / "gone").exists()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("iofault_eval")
    cfg = _cfg(tmp, "one", steps=0)
    train(cfg, echo=lambda *_: None)
    (tmp / "two").mkdir()
    shutil.copy(tmp / "one" / "checkpoint.pt", tmp / "two" / "checkpoint.pt")
    bench = tmp / "b.jsonl"
    bench.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n")
    return tmp, f"b={bench}"


def test_eval_checks_every_output_dir_before_scoring(two_runs, capsys):
    """The second run's output dir cannot be made (a file named eval in its run dir; a
    read-only run dir alike): the error came after the first run was scored and written;
    now it comes first, naming the dir, and nothing is written (the first run's folder, made
    for it and left empty, goes too)."""
    tmp, bench = two_runs
    (tmp / "two" / "eval").write_text("not a dir")
    try:
        rc = cli.main(["eval", str(tmp / "one"), str(tmp / "two"), "--bench", bench])
    finally:
        os.unlink(tmp / "two" / "eval")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"hacpo eval: error: eval output dir {tmp / 'two' / 'eval'} is "
                               f"a file, not a directory (--out-dir chooses another)"), err
    assert not (tmp / "one" / "eval").exists()     # made, nothing scored into it: removed


def test_eval_into_a_dangling_link_names_it(two_runs, capsys):
    tmp, bench = two_runs
    os.symlink(tmp / "nowhere", tmp / "link")
    assert cli.main(["eval", str(tmp / "one"), "--bench", bench, "--out-dir",
                     str(tmp / "link")]) == 2
    err = capsys.readouterr().err
    assert "symbolic link to" in err and "nowhere, which does not exist" in err, err
    assert not (tmp / "nowhere").exists()


def test_storage_error_is_the_users():
    e = StorageError("cannot write x: no space left", errno.ENOSPC, "x")
    assert is_user_error(e) and str(e) == "cannot write x: no space left"
    assert e.errno == errno.ENOSPC and e.filename == "x"


# -- the training file rewritten between a run and its --resume -----------------------------
def test_sampler_refuses_the_same_rows_in_another_order(tmp_path):
    """Example ids are '<file>:<line>': a training file rewritten with its rows in another
    order (or other problems on the same lines) kept every id, so --resume went on with a
    cursor that points at other problems, silently. The state now records the content."""
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b" / "train.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[::-1]))
    first, _ = load_examples(tmp_path / "a" / "train.jsonl")
    again, _ = load_examples(tmp_path / "b" / "train.jsonl")
    assert [e.id for e in first] == [e.id for e in again]
    s = PromptSampler(first, seed=3)
    s.next_batch(3)
    state = json.loads(json.dumps(s.state_dict()))
    with pytest.raises(ValueError, match="other content"):
        PromptSampler(again, seed=3).load_state_dict(state)
    same = PromptSampler(list(first), seed=3)
    same.load_state_dict(state)                          # the same file: resumes
    assert same.next_batch(2) == s.next_batch(2)
    old = {k: v for k, v in state.items() if k != "content"}   # a checkpoint of older code
    PromptSampler(again, seed=3).load_state_dict(old)           # checked by ids, as then


# -- a run dir's own files ------------------------------------------------------------------
def test_run_dir_that_is_a_dangling_link_names_it(tmp_path, capsys):
    """`hacpo train --out-dir LINK` (LINK a symbolic link to nothing) said "[Errno 17] File
    exists: LINK"; now one line naming the link and its missing target, nothing created."""
    os.symlink(tmp_path / "gone", tmp_path / "link")
    assert cli.main(["train", "--preset", "tiny3", "--out-dir", str(tmp_path / "link"),
                     "--set", "threads=1", f"cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"hacpo train: error: run dir (out_dir) {tmp_path / 'link'} is a symbolic "
                      f"link to {tmp_path / 'gone'}, which does not exist: create its target "
                      f"or give another path"), err
    assert not (tmp_path / "gone").exists()


def test_results_without_a_checkpoint_are_not_overwritten(tmp_path):
    """A run dir that holds a run's metrics.jsonl and summary.json but no checkpoint.pt (the
    run stopped before its first checkpoint, or the checkpoint was removed): a new run there
    replaced them silently; now it is an error naming them, the files kept. --resume starts
    that run over there, and says that they are replaced."""
    train(_cfg(tmp_path, steps=2), echo=lambda *_: None)
    run = tmp_path / "run"
    os.remove(run / "checkpoint.pt")
    kept = {f: (run / f).read_bytes() for f in ("metrics.jsonl", "summary.json")}
    with pytest.raises(FileExistsError, match=r"holds the results of a run \(metrics\.jsonl, "
                                              r"summary\.json\) but no checkpoint\.pt") as e:
        train(_cfg(tmp_path, steps=2), echo=lambda *_: None)
    assert is_user_error(e.value)
    assert {f: (run / f).read_bytes() for f in kept} == kept
    said = []
    train(_cfg(tmp_path, steps=2), resume=True, echo=said.append)
    assert (f"[warn] no checkpoint.pt in {run}: starting a new run there (metrics.jsonl, "
            f"summary.json of the run before are replaced)") in said
    assert ckpt.load(str(run / "checkpoint.pt"))["step"] == 2


def test_resume_over_metrics_rows_lost_says_which(tmp_path, caplog):
    """metrics.jsonl deleted, or rows removed, while a run was stopped: the resume dropped
    nothing more and said nothing; those steps are never logged again, so it now names them."""
    from hacpo.engine.metrics import MetricsLogger
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 3, 4, 6)))
    with caplog.at_level(logging.WARNING):
        MetricsLogger(str(tmp_path), start_step=5, tensorboard=False).close()
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [0, 3, 4]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{path} holds no rows of steps 1-2 (of the 5 before this resume: deleted "
                    f"or cut short while the run was stopped); they are not logged again, the "
                    f"run goes on from step 5"], said
    caplog.clear()
    os.remove(path)
    with caplog.at_level(logging.WARNING):
        MetricsLogger(str(tmp_path), start_step=3, tensorboard=False).close()
    assert path.read_text() == ""
    assert [r.getMessage() for r in caplog.records][0].startswith(
        f"{path} holds no rows of steps 0-2 (of the 3 before")
    caplog.clear()
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    with caplog.at_level(logging.WARNING):
        MetricsLogger(str(tmp_path), start_step=3, tensorboard=False).close()
    assert not caplog.records


def test_a_data_file_that_cannot_be_read_names_its_key(tmp_path):
    """A missing data file (or a directory, no permission) was "[Errno 2] No such file or
    directory: 'PATH'", naming neither the config key nor which file of the two it was."""
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    for role, train_path, eval_path in (("train", tmp_path / "gone.jsonl", ok),
                                        ("eval", ok, tmp_path / "gone.jsonl")):
        cfg = _cfg(tmp_path, **{"data.task": "files", "data.train_path": str(train_path),
                                "data.eval_path": str(eval_path)})
        with pytest.raises(ValueError) as e:
            build.load_data(cfg)
        assert str(e.value) == (f"data.{role}_path {tmp_path / 'gone.jsonl'}: cannot be read: "
                                f"No such file or directory"), e.value
    (tmp_path / "d.parquet").mkdir()     # pyarrow reads it as an empty dataset: "no rows"
    cfg = _cfg(tmp_path, **{"data.task": "files", "data.train_path": str(tmp_path / "d.parquet"),
                            "data.eval_path": str(ok)})
    with pytest.raises(ValueError, match=r"^data\.train_path .*d\.parquet: is a directory, not "
                                         r"a \.jsonl or \.parquet file$"):
        build.load_data(cfg)


def test_tensorboard_events_that_cannot_be_written_are_a_warning(tmp_path, caplog):
    """TensorBoard's writer thread fails on a full disk and its error (no file named) came back
    from the next add_scalar, ending the run with "No space left on device"; the events are
    a convenience: a warning naming the folder, and the run's rows go on."""
    from hacpo.engine import metrics

    logger = metrics.MetricsLogger(str(tmp_path), tensorboard=True)

    class Full:
        closed = False

        def add_scalar(self, *a):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            Full.closed = True
    logger.tb.close()
    logger.tb = Full()
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        logger.log(0, {"reward/a": 0.5})
        logger.log(1, {"reward/a": 0.25})
        logger.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"TensorBoard events in {tmp_path / 'tensorboard'} cannot be " \
        f"written (No space left on device (the disk is full))" in said[0], said
    assert Full.closed and logger.tb is None
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 1]


def test_a_run_dir_named_in_another_encoding_runs_without_tensorboard(tmp_path, caplog):
    """A run dir whose name is not UTF-8 (a latin-1 "café", surrogate-escaped by Python)
    works for every file of the run, but TensorBoard's writer cannot encode it: it ended the
    run (UnicodeEncodeError) after the warm-up; now the warning an unwritable folder gets."""
    from hacpo.engine import metrics

    out = tmp_path / os.fsdecode(b"caf\xe9")
    out.mkdir()
    logger = metrics.MetricsLogger(str(out), tensorboard=True)
    with caplog.at_level(logging.WARNING, logger="hacpo"):
        logger.log(0, {"reward/a": 0.5})
        logger.log(1, {"reward/a": 0.25})
        logger.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cannot be written (its path is not valid UTF-8" in said[0], said
    assert [r["step"] for r in metrics.read_metrics(str(out / "metrics.jsonl"))] == [0, 1]


@pytest.mark.parametrize("files, named", [
    ({"config.json": '{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": "w",
      "hacpo_export.json": "{}"},
     "hacpo_export.json, model.safetensors, a config.json that is not a run's"),
    ({"config.json": "[1]"}, "a config.json that is not a run's"),
    ({"pytorch_model.bin": "w"}, "pytorch_model.bin"),
])
def test_a_model_folder_as_the_run_dir_is_refused_before_its_config_is_overwritten(
        tmp_path, capsys, files, named):
    """`--out-dir` given an export (or a Hugging Face model folder, mixed up with a policy
    path): the run replaced its transformers config.json with the run's, and the model no
    longer loaded. Refused, also with --resume (no checkpoint: it would start a run there),
    the folder untouched."""
    from hacpo.engine.trainer import check_run_dir
    run = tmp_path / "run"
    run.mkdir()
    for name, text in files.items():
        (run / name).write_text(text)
    for resume in (False, True):
        with pytest.raises(FileExistsError, match=rf"{run} is not a run dir: it holds "
                                                  rf"{named} \(a model folder\?"):
            check_run_dir(_cfg(tmp_path), resume)
    argv = ["train", "--preset", "tiny3", "--out-dir", str(run), "--set", "threads=1",
            f"cache_dir={tmp_path / 'cache'}"]
    assert cli.main(argv) == 2
    assert "is not a run dir" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in run.iterdir()} == files


def test_a_run_killed_before_its_first_checkpoint_is_no_model_folder(tmp_path):
    """Its own config.json (written once the run's checks passed) does not refuse a new
    run there."""
    from hacpo.engine.trainer import check_run_dir
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(_cfg(tmp_path).to_dict()))
    check_run_dir(_cfg(tmp_path), False)


def test_a_run_dir_removed_mid_run_is_said_so(tmp_path):
    """`rm -rf` of the run dir while the run goes on: the next row's error said "No such file
    or directory; the rows of the steps before are kept (... --resume ...)": nothing is kept
    and nothing can be resumed."""
    from hacpo.engine import metrics
    run = tmp_path / "run"
    run.mkdir()
    logger = metrics.MetricsLogger(str(run), tensorboard=False)
    logger.log(0, {"reward/a": 0.5})
    shutil.rmtree(run)
    with pytest.raises(StorageError) as e:
        logger.log(1, {"reward/a": 0.25})
    assert isinstance(e.value, FileNotFoundError) and is_user_error(e.value)
    assert str(e.value) == (f"cannot write {run / 'metrics.jsonl'}: the run dir {run} no longer "
                            f"exists (removed or moved while the run went on)")
    logger.close()


def test_a_folder_that_held_no_run_keeps_files_named_as_a_runs_plots(tmp_path):
    """`--out-dir .` in a project folder with its own reward_curves.png: the run deleted it
    (the plots of "a run before"), with plots=false writing none of its own."""
    from hacpo.engine.trainer import _write_config
    cfg = _cfg(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "reward_curves.png").write_text("mine")
    _write_config(cfg)
    assert (run / "reward_curves.png").read_text() == "mine"
    (run / "summary.json").write_text("{}")      # now a run's: a run over it replaces them
    _write_config(cfg)
    assert not (run / "reward_curves.png").exists() and not (run / "summary.json").exists()
    (run / "config.json").unlink()               # a run's results or checkpoint mark it too
    for marks in ("summary.json", "checkpoint.pt"):
        (run / "reward_curves.png").write_text("the run's")
        (run / marks).write_text("x")
        _write_config(cfg)
        assert not (run / "reward_curves.png").exists(), marks
        (run / "config.json").unlink()
        (run / marks).unlink(missing_ok=True)


def test_a_run_an_older_hacpo_made_in_a_folder_named_tilde_is_not_started_over(
        tmp_path, monkeypatch, capsys):
    """`--out-dir=~/r` made ./~/r before `~` meant the home directory: `--resume` of it now
    looks in $HOME/r, and started a new run there, the old run left where it was."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "~" / "r"
    old.mkdir(parents=True)
    (old / "checkpoint.pt").write_text("x")
    argv = ["train", "--preset", "tiny3", "--out-dir=~/r", "--resume", "--set", "threads=1",
            f"cache_dir={tmp_path / 'cache'}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (f"no checkpoint.pt in {tmp_path}/home/r, but {old} holds a run: a '~' in the run "
            f"dir is the home directory now") in err, err
    assert not (tmp_path / "home" / "r").exists()
