"""megatron-core distributed checkpoints (torch_dist) of each family save and load back bit-exactly,
also at another parallel layout. Real processes under torchrun on gloo; the bf16 checkpoints of the optimizer
without --use-distributed-optimizer saved there are loaded here, in one process."""

import json
import os
import sys

import pytest
import torch

from angpt.models.bounding import constrained_parameters
from angpt.training import checkpointing, distributed
from angpt.training.step import build_model_chunks

from conftest import ROOT, run_workers

sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
from checkpoint_worker import BF16, EXPECTED, full_state, sixteen_bit_optimizer  # noqa: E402

from common import S, V, small_config  # noqa: E402

ROUND_TRIPS = {"tp2_to_tp1": "tp2pp1:tp1pp1", "pp2_to_tp2": "tp1pp2:tp2pp1"}
# Saved by 2 processes: at TP 2, and at TP 1 (data-parallel replicas).
SIXTEEN_BIT_SAVES = ("tp2pp1", "tp1pp1")


# Over the suite's budget of 60 s: every family's round trips (6 saves, 12 loads at other layouts) and the
# 16-bit optimizer's saves (6) share one warm job of two ranks; megatron-core's distributed checkpointing is most
# of the time.
@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> list[dict]:
    """Every round trip and 16-bit save of every family, in one torchrun job."""
    output = run_workers("checkpoint_worker.py", "--round-trips", ",".join(ROUND_TRIPS.values()),
                         "--sixteen-bit-saves", ",".join(SIXTEEN_BIT_SAVES),
                         "--dir", str(tmp_path_factory.mktemp("round_trips")))
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("trip", ROUND_TRIPS)
def test_distributed_checkpoint_round_trip(trip, round_trips):
    results = [result for result in round_trips if result.get("round_trip") == ROUND_TRIPS[trip]]
    assert sorted(r["family"] for r in results) == ["angpt", "gptplus", "ngpt"]
    for result in results:
        assert len(result["loads"]) == 2
        for layout, outcome in result["loads"].items():
            print(result["family"], result["save"], "->", layout, outcome)
            assert outcome["exact"], (result["family"], layout)
            # Every parameter differed before loading, so the equality comes from the checkpoint.
            assert outcome["differed_before_load"] == outcome["parameters"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved_at", SIXTEEN_BIT_SAVES)
def test_a_16_bit_checkpoint_without_the_distributed_optimizer_loads_in_one_process(saved_at, round_trips,
                                                                                   single_process):
    """bf16 without --use-distributed-optimizer, saved by 2 processes after a step, loads at TP 1 PP 1 in one:
    every weight, fp32 main copy and Adam moment (the fp32 scales' included) equals the saving run's, gathered
    whole, bit for bit."""
    results = [result for result in round_trips if result.get("sixteen_bit_save") == saved_at]
    assert sorted(r["family"] for r in results) == ["angpt", "gptplus", "ngpt"]
    for result in results:
        expected = torch.load(os.path.join(result["path"], EXPECTED))
        distributed.set_random_seed(2)
        chunks = build_model_chunks(small_config(result["family"], **BF16), V, S)
        optimizer, scheduler = sixteen_bit_optimizer(chunks, result["family"])
        fresh = full_state(chunks, optimizer)
        state = checkpointing.load_checkpoint(checkpointing.checkpoint_dir(result["path"], 1), chunks, optimizer,
                                              scheduler)
        loaded = full_state(chunks, optimizer)
        assert state.iteration == 1 and loaded.keys() == expected.keys()
        assert [key for key in expected if not torch.equal(loaded[key], expected[key])] == [], result["family"]
        # Every weight and main copy differed before loading, so the equality comes from the checkpoint.
        weights = [key for key in expected if key.startswith(("param.", "main."))]
        assert [key for key in weights if torch.equal(fresh[key], expected[key])] == [], result["family"]
        # The saving run bounded its fp32 main copies whole, rows split over TP 2 included: anGPT's rows in the
        # unit ball, nGPT's on the sphere (each element rounded once to fp32, the factor too).
        names = {param: name for name, param in chunks[0].module.named_parameters()}
        for weight in constrained_parameters(chunks):
            norms = expected[f"main.{names[weight]}"].double().norm(dim=weight.unit_norm_dim)
            ok = norms.max() <= 1 + 2**-22 if result["family"] == "angpt" else (norms - 1).abs().max() <= 2**-22
            assert ok, (result["family"], names[weight])
