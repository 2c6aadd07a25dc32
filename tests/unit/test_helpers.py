"""The suite's own waiting helpers keep their deadlines."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import wait_for_line


def _job(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_wait_for_line_gives_up_at_its_deadline_while_the_job_prints_nothing():
    job = _job("import sys, time; print('started', flush=True); time.sleep(600)")
    try:
        lines = wait_for_line(job, "started", timeout=60)
        began = time.monotonic()
        with pytest.raises(AssertionError, match="did not appear within 1 s"):
            wait_for_line(job, "never printed", timeout=1, lines=lines)
        # A blocking readline would still be waiting here; the deadline ended the wait.
        assert time.monotonic() - began < 60
    finally:
        job.kill()
        job.wait()


def test_wait_for_line_says_when_the_output_ended_first():
    job = _job("print('one'); print('two')")
    with pytest.raises(AssertionError, match="before the output ended") as error:
        wait_for_line(job, "three", timeout=60)
    assert "one\ntwo" in str(error.value)
    job.wait()


def test_lines_after_the_awaited_one_stay_readable():
    job = _job("print('a'); print('b'); print('c')")
    assert wait_for_line(job, "a", timeout=60) == ["a\n"]
    assert wait_for_line(job, "c", timeout=60) == ["b\n", "c\n"]
    job.wait()


def _run_pytest(tmp_path, env_value: str | None) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    test = tmp_path / "test_needs_an_extra.py"
    test.write_text("import pytest\n\npytest.importorskip('hvdtrain_no_such_extra')\n\n\ndef test_it():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "HVDTRAIN_REQUIRE_EXTRAS"}
    if env_value is not None:
        env["HVDTRAIN_REQUIRE_EXTRAS"] = env_value
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           str(test)], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_missing_extra_skips_by_default_and_fails_where_extras_are_required(tmp_path):
    skipped = _run_pytest(tmp_path, None)
    assert skipped.returncode == 5 and "1 skipped" in skipped.stdout, skipped.stdout  # 5: no test ran
    failed = _run_pytest(tmp_path, "1")
    assert failed.returncode != 0, failed.stdout
    assert "hvdtrain_no_such_extra is required (HVDTRAIN_REQUIRE_EXTRAS=1)" in failed.stdout, failed.stdout
