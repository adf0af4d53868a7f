"""``hacpo launch slurm`` inputs found wrong by an exploratory audit of its options (dry runs
and a stand-in sbatch only): #SBATCH values that a line cannot carry, a requeued job's
``--resume`` read from the driver's own words, and names whose bytes are not UTF-8."""
from __future__ import annotations

import os

import pytest

from .test_slurm import _driver_after_requeue
from .test_slurm_mutants import _fake_slurm, _launch


@pytest.mark.parametrize("args,flag", [
    # a newline ended the #SBATCH block: sbatch ignored --nodes, --output, --chdir after it
    # and bash read the rest of the value as a command (the script did not even parse)
    (["--job-name", "run\ntouch /tmp/x"], "--job-name 'run\\ntouch /tmp/x'"),
    (["--partition", "gpu\nx"], "--partition 'gpu\\nx'"),
    (["--time", "1:00:00\n"], "--time '1:00:00\\n'"),
    (["--sbatch-arg=--comment=a\nb"], "--sbatch-arg '--comment=a\\nb'"),
    # sbatch reads '\' as an escape, quoted or not: the value reached Slurm without it
    (["--sbatch-arg=--comment=C:\\runs"], "--sbatch-arg '--comment=C:\\\\runs'"),
    (["--job-name", "a\\b"], "--job-name 'a\\\\b'"),
])
def test_sbatch_values_an_sbatch_line_cannot_carry_are_refused(tmp_path, capsys, monkeypatch,
                                                               args, flag):
    """Each is an error naming the option, exit 2, before anything is written or submitted
    (before: exit 0 and a broken script, or a value changed silently)."""
    _fake_slurm(tmp_path, monkeypatch)
    rc, out, err = _launch(tmp_path, capsys, *args)
    assert rc == 2, (out, err)
    assert (f"hacpo launch: error: {flag} holds a backslash or a newline, which an #SBATCH "
            f"line cannot carry") in err, err
    assert not (tmp_path / "sbatch-calls").exists() and not (tmp_path / "run").exists()
    rc, out, err = _launch(tmp_path, capsys, "--dry-run", *args)
    assert rc == 2 and out == "", (out, err)


def test_a_requeued_job_resumes_whatever_its_paths_say(tmp_path, capsys):
    """A job Slurm requeued resumes unless it was launched with --resume (which it then
    passes once): a run dir or --set value holding " --resume " does not count as the option
    (before: the requeued driver started the run afresh and was refused its own checkpoint)."""
    run = tmp_path / "a --resume b"
    rc, script, err = _launch(tmp_path, capsys, "--dry-run", out_dir=run)
    assert rc == 0, err
    first = _driver_after_requeue(script, None)
    assert "--resume" not in first and first[first.index("--out-dir") + 1] == str(run)
    assert _driver_after_requeue(script, 1) == first + ["--resume"]
    rc, script, err = _launch(tmp_path, capsys, "--dry-run", "--resume", out_dir=run)
    assert rc == 0, err
    resumed = _driver_after_requeue(script, None)
    assert resumed.count("--resume") == 1
    assert _driver_after_requeue(script, 1) == resumed


def test_names_not_in_utf8_reach_the_script_as_given(tmp_path, capsys, monkeypatch):
    """A run dir, job name or --set value whose bytes are not UTF-8 (Python reads byte 0xff of
    argv as '\\udcff') is written as those bytes (before: UnicodeEncodeError, a traceback, and
    an empty job.sbatch left in the run dir)."""
    _fake_slurm(tmp_path, monkeypatch)
    run = tmp_path / "run\udcfd"
    rc, out, err = _launch(tmp_path, capsys, "--job-name", "j\udcff", "--set",
                           f"cache_dir={tmp_path}/c\udcfe", out_dir=run)
    assert rc == 0, err
    script = (run / "slurm" / "job.sbatch").read_bytes()
    assert script.startswith(b"#!/bin/bash\n#SBATCH --job-name='j\xff'\n")
    assert b" --out-dir '" + os.fsencode(str(run)) + b"' " in script
    assert b" 'cache_dir=" + os.fsencode(str(tmp_path)) + b"/c\xfe' " in script
