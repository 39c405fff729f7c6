"""megatron-core distributed checkpoints (torch_dist) of each family save and load back bit-exactly,
also at another parallel layout. Real processes under torchrun on gloo."""

import json

import pytest

from conftest import run_workers


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "save, load",
    [(("--save-tp", "2"), ("--load-tp", "1")), (("--save-pp", "2", "--save-tp", "1"), ("--load-tp", "2"))],
    ids=["tp2_to_tp1", "pp2_to_tp2"],
)
def test_distributed_checkpoint_round_trip(save, load, tmp_path):
    output = run_workers("checkpoint_worker.py", *save, *load, "--dir", str(tmp_path))
    results = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["family"] for r in results) == ["angpt", "gptplus", "ngpt"]
    for result in results:
        assert len(result["loads"]) == 2
        for layout, outcome in result["loads"].items():
            print(result["family"], result["save"], "->", layout, outcome)
            assert outcome["exact"], (result["family"], layout)
            # Every parameter differed before loading, so the equality comes from the checkpoint.
            assert outcome["differed_before_load"] == outcome["parameters"]
