"""The one state protocol: a component registered with RunState round-trips through a checkpoint,
the resume broadcast and the elastic commit/rollback/sync, on 2 really launched ranks."""

from __future__ import annotations

import json

from tests.helpers import REPO, launch

STATE_PROBE = REPO / "tests" / "parallel" / "state_probe.py"


def test_a_new_state_component_round_trips_everywhere(tmp_path):
    out = tmp_path / "out"
    launch("horovodrun-gloo", 2, [str(STATE_PROBE), str(out)], tmp_path)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # Broadcast: rank 0's counter (total 1, seen 10) and position on both ranks, not rank 1's (2, 20).
    assert [r["broadcast"] for r in ranks] == [[[1.0] * 3, 10, 7]] * 2
    assert ranks[0]["model_after_broadcast"] == ranks[1]["model_after_broadcast"]
    # Checkpoint: the fresh state read the component, the position and the optimizer's momentum.
    assert [r["checkpoint"] for r in ranks] == [[[2.0] * 3, 11, 7]] * 2
    assert all(r["checkpoint_momentum_equal"] for r in ranks)
    # Elastic: a rollback returns to the commit; a sync makes every rank equal to the rank that has
    # trained furthest (rank 1 here, one step ahead, with its own counter).
    assert all(r["restored_equals_committed"] for r in ranks)
    assert [r["restored"] for r in ranks] == [[[2.0] * 3, 11]] * 2
    assert [r["synced"] for r in ranks] == [[[2.0] * 3, 111, 8]] * 2
    assert ranks[0]["model_after_sync"] == ranks[1]["model_after_sync"]
    assert [round(r["bias_moved"], 5) for r in ranks] == [3.0, 3.0]  # rank 1's parameters won
