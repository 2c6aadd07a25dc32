"""What ``hvdtrain launch`` keeps of horovodrun's output and which code it returns (the pure parts;
tests/parallel/test_launch.py runs it for real)."""

from __future__ import annotations

import io
import threading

from hvdtrain.launch import horovodrun as launch

TOKEN = "ab" * 16
HOROVODRUN_TRACEBACK = """Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 8, in <module>
    sys.exit(run_commandline())
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be \
terminated. The first process to do so was:
Process name: 1
Exit code: 137
"""
RANK_TRACEBACK = """[0]<stderr>:Traceback (most recent call last):
[0]<stderr>:  File "/x/hvdtrain/cli.py", line 3, in main
[0]<stderr>:RuntimeError: boom
Traceback (most recent call last):
  File "/x/my_script.py", line 3, in <module>
ValueError: a rank's traceback, unprefixed (mpirun without tags)
"""


def copied(text: str) -> tuple[str, list[dict], launch.Output]:
    records: list[dict] = []
    output = launch.Output(TOKEN, records, threading.Lock())
    sink = io.StringIO()
    output.copy(io.BytesIO(text.encode()), sink)
    return sink.getvalue(), records, output


def test_records_are_taken_out_and_parsed_even_with_a_tag_after_them():
    text = ("[0]<stderr>:hvdtrain: error: bad\n"
            f"[0]<stderr>:hvdtrain-exit {TOKEN} " '{"rank": 0, "code": 2, "cause": "error: bad"}[1,0]<stderr>:\n'
            "Process 0 exit with status code 2.\n")
    kept, records, _ = copied(text)
    assert kept == "[0]<stderr>:hvdtrain: error: bad\nProcess 0 exit with status code 2.\n"
    assert records == [{"rank": 0, "code": 2, "cause": "error: bad"}]


def test_a_record_without_the_token_is_an_ordinary_line():
    forged = 'hvdtrain-exit 0000 {"rank": 0, "code": 0, "cause": "a file name in a warning"}\n'
    kept, records, _ = copied(forged)
    assert kept == forged and records == []


def test_horovodruns_traceback_is_held_back_and_a_ranks_is_kept():
    kept, _, output = copied(RANK_TRACEBACK + HOROVODRUN_TRACEBACK)
    assert kept == RANK_TRACEBACK
    assert "".join(output.launcher_error) == HOROVODRUN_TRACEBACK


def test_the_code_comes_from_the_first_rank_that_named_a_cause():
    records = [{"rank": 1, "code": 1, "cause": ""}, {"rank": 0, "code": 75, "cause": "stopped by SIGTERM"}]
    code, line = launch.outcome(1, records, [])
    assert code == 75
    assert line == ("hvdtrain launch: exit 75 (stopped after a checkpoint: run the same command to resume), "
                    "rank 0: stopped by SIGTERM")
    assert launch.outcome(0, [], []) == (0, "")


def test_without_records_the_code_horovodrun_names_is_returned():
    error = HOROVODRUN_TRACEBACK.splitlines(keepends=True)
    code, line = launch.outcome(1, [], error)
    assert code == 137 and line.startswith("hvdtrain launch: exit 137: rank 1 was killed by SIGKILL")
    code, line = launch.outcome(1, [], [e.replace("137", "75") for e in error])
    assert code == 75 and "rank 1: it recorded no cause" in line
    code, line = launch.outcome(2, [], [])  # horovodrun --mpi became mpirun: its code as it is
    assert code == 2 and "no rank recorded a cause" in line


def test_a_rank_writes_a_record_only_under_the_launcher(monkeypatch):
    monkeypatch.delenv(launch.TOKEN_VARIABLE, raising=False)
    assert launch.exit_record(0, 2, "error: bad") is None
    monkeypatch.setenv(launch.TOKEN_VARIABLE, TOKEN)
    assert launch.exit_record(0, 0, "") is None
    assert launch.exit_record(1, 75, "stopped\n") == \
        f'hvdtrain-exit {TOKEN} {{"rank": 1, "code": 75, "cause": "stopped"}}'


MPIRUN_ABORT = """-------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
-------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[41305,1],1]
  Exit code:    75
--------------------------------------------------------------------------
"""
OTHER_BLOCK = """--------------------------------------------------------------------------
WARNING: There was an error initializing an OpenFabrics device.
--------------------------------------------------------------------------
"""


def test_mpiruns_abort_blocks_are_held_back_and_its_other_messages_kept():
    kept, _, output = copied("[1,0]<stdout>:epoch 1/3 ...\n" + OTHER_BLOCK + MPIRUN_ABORT + "after\n")
    assert kept == "[1,0]<stdout>:epoch 1/3 ...\n" + OTHER_BLOCK + "after\n"
    assert "".join(output.abort_blocks) == MPIRUN_ABORT


def test_a_stop_every_rank_made_is_told_in_rank_0s_words():
    # Rank 1's record came first; both stopped: rank 0's line names the checkpoint it wrote.
    records = [{"rank": 1, "code": 75, "cause": "stopped by SIGTERM ...; checkpoint saved to runs/x/last.pt."},
               {"rank": 0, "code": 75, "cause": "stopped by SIGTERM ...; checkpoint saved to runs/x/step-4.pt."}]
    code, line = launch.outcome(1, records, [])
    assert code == 75 and line.endswith("rank 0: stopped by SIGTERM ...; checkpoint saved to runs/x/step-4.pt.")
    # Different codes: the first rank that named a cause is the one to tell (rank 1 crashed, rank 0 followed).
    records = [{"rank": 1, "code": 1, "cause": "RuntimeError: boom"}, {"rank": 0, "code": 75, "cause": "stopped"}]
    assert launch.outcome(1, records, [])[0] == 1
