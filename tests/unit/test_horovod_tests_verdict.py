"""The verdict of `make test-horovod` (scripts/horovod_tests_verdict.py) on the JUnit reports of the
two ranks of Horovod's test_torch.py: the three Muon failures are expected and counted as such;
any other failure, one of them passing or failing otherwise, a rank without a report, or an abort
in the log fails the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "horovod_tests_verdict.py"
spec = importlib.util.spec_from_file_location("horovod_tests_verdict", SCRIPT)
verdict_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verdict_module)
MUON = "ValueError: Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([10])"


def case(name: str, outcome: str = "passed", message: str = "") -> str:
    inner = {"passed": "", "skipped": '<skipped message="no GPU"/>',
             "failed": f'<failure message="{message}">trace</failure>',
             "error": f'<error message="{message}">trace</error>'}[outcome]
    return f'<testcase classname="test_torch.TorchTests" name="{name}" time="0.1">{inner}</testcase>'


def write_run(folder: Path, cases: list[str], ranks=(0, 1), log: str = "[0]<stdout>:ok\n") -> Path:
    for rank in ranks:
        (folder / f"rank{rank}.xml").write_text(
            f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    (folder / "horovodrun.log").write_text(log)
    return folder


def expected_failures() -> list[str]:
    return [case(name, "failed", MUON) for name in verdict_module.EXPECTED_FAILURES]


def test_the_muon_failures_alone_pass_the_run(tmp_path):
    write_run(tmp_path, [case("test_a"), case("test_b"), case("test_gpu", "skipped"), *expected_failures()])
    assert verdict_module.verdict(tmp_path) == ("2 passed, 1 skipped, 3 failed as expected", [])
    assert verdict_module.main([str(tmp_path), "gloo", "12"]) == 0
    assert (tmp_path / "result.txt").read_text() == "gloo: ok: 2 passed, 1 skipped, 3 failed as expected (12 s)\n"


@pytest.mark.parametrize("cases, problem", [
    ([case("test_a", "failed", "assert 1 == 2")], "rank 0: test_a failed"),
    ([case("test_a", "error", "hvd.init() timed out")], "rank 0: test_a failed"),
    ([case("test_force_allreduce")], "rank 0: test_force_allreduce was expected to fail (Muon) and did not"),
    ([case("test_force_allreduce", "failed", "AssertionError: not equal")],
     "rank 0: test_force_allreduce failed, but not with 'Muon only supports 2D parameters'"),
])
def test_any_other_outcome_fails_the_run(tmp_path, cases, problem):
    names = {c.split('name="')[1].split('"')[0] for c in cases}
    rest = [c for c in expected_failures() if c.split('name="')[1].split('"')[0] not in names]
    write_run(tmp_path, [case("test_b"), *rest, *cases])
    _, problems = verdict_module.verdict(tmp_path)
    assert any(p.startswith(problem) for p in problems), problems
    assert verdict_module.main([str(tmp_path), "mpi", "5"]) == 1
    assert (tmp_path / "result.txt").read_text().startswith("mpi: FAILED: ")


def test_an_aborted_rank_fails_the_run(tmp_path):
    """Horovod's background thread dying takes the process with it: no report from that rank, and
    the C++ and Python lines in the log (both ranks' reports present still fails on the log)."""
    write_run(tmp_path, [case("test_b"), *expected_failures()], ranks=(0,),
              log="[1]<stderr>:terminate called after throwing an instance of 'gloo::IoException'\n"
                  "[1]<stderr>:Fatal Python error: Aborted\n")
    summary, problems = verdict_module.verdict(tmp_path)
    assert summary == "1 passed, 0 skipped, 3 failed as expected"
    assert problems[0].startswith("rank 1 wrote no report: it aborted or was killed")
    assert "the log shows 'Fatal Python error': a rank aborted" in problems
    assert "the log shows 'terminate called': a rank aborted" in problems
    (tmp_path / "horovodrun.log").unlink()
    assert verdict_module.verdict(tmp_path)[1] == [problems[0]]


def test_ranks_that_disagree_fail_the_run(tmp_path):
    write_run(tmp_path, [case("test_b"), *expected_failures()])
    (tmp_path / "rank1.xml").write_text((tmp_path / "rank1.xml").read_text().replace(
        case("test_b"), case("test_b", "skipped")))
    assert verdict_module.verdict(tmp_path)[1] == [
        "the ranks disagree: rank 0 1 passed, 0 skipped, 3 failed as expected; rank 1 0 passed, 1 skipped, "
        "3 failed as expected"]
