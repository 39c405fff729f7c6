"""megatron-core distributed checkpoints (torch_dist) of each family save and load back bit-exactly,
also at another parallel layout. Real processes under torchrun on gloo."""

import json

import pytest

from conftest import run_workers

ROUND_TRIPS = {"tp2_to_tp1": "tp2pp1:tp1pp1", "pp2_to_tp2": "tp1pp2:tp2pp1"}


# Over the suite's budget of 60 s: every family's round trips (6 saves, 12 loads at other layouts)
# share one warm job of two ranks; megatron-core's distributed checkpointing is most of the time.
@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> list[dict]:
    """Every round trip of every family, in one torchrun job."""
    output = run_workers("checkpoint_worker.py", "--round-trips", ",".join(ROUND_TRIPS.values()),
                         "--dir", str(tmp_path_factory.mktemp("round_trips")))
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("trip", ROUND_TRIPS)
def test_distributed_checkpoint_round_trip(trip, round_trips):
    results = [result for result in round_trips if result["round_trip"] == ROUND_TRIPS[trip]]
    assert sorted(r["family"] for r in results) == ["angpt", "gptplus", "ngpt"]
    for result in results:
        assert len(result["loads"]) == 2
        for layout, outcome in result["loads"].items():
            print(result["family"], result["save"], "->", layout, outcome)
            assert outcome["exact"], (result["family"], layout)
            # Every parameter differed before loading, so the equality comes from the checkpoint.
            assert outcome["differed_before_load"] == outcome["parameters"]
