"""Megatron-LM's uneven pipeline splits (angpt.config.pipeline_split): each stage's layers, worked out by hand from
megatron-core's rules, and the splits that cannot work refused in one line naming the flags, at their edges."""

import pytest

from angpt.config.arguments import parse_args
from angpt.config.pipeline_split import stage_layers
from angpt.training import distributed
from angpt.training.megatron_configs import transformer_config

BASE = ["--mock-data", "--vocab-size", "64", "--hidden-size", "32", "--num-attention-heads", "4", "--train-iters", "2"]


def split(num_layers: int, stages: int, *flags: str) -> list[int]:
    config = parse_args([*BASE, "--num-layers", str(num_layers), "--pipeline-model-parallel-size", str(stages),
                         *flags], world_size=stages)
    return stage_layers(config.model.num_layers, config.parallel)


@pytest.mark.parametrize("num_layers,stages,flags,expected", [
    (8, 4, [], [2, 2, 2, 2]),
    (4, 2, ["--decoder-first-pipeline-num-layers", "1"], [1, 3]),
    (7, 3, ["--decoder-first-pipeline-num-layers", "1"], [1, 3, 3]),
    (7, 3, ["--decoder-last-pipeline-num-layers", "1"], [3, 3, 1]),
    (8, 4, ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"], [1, 2, 2, 3]),
    (2, 2, ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"], [1, 1]),
    # The embedding and the loss count as a layer each: 6 + 2 = 8 over 4 stages.
    (6, 4, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], [1, 2, 2, 1]),
    (7, 4, ["--account-for-embedding-in-pipeline-split"], [1, 2, 2, 2]),
    (5, 3, ["--pipeline-model-parallel-layout", "Et|tt|ttL"], [1, 2, 2]),
    (6, 2, ["--pipeline-model-parallel-layout", "E(t)*4|ttL"], [4, 2]),
    # With virtual stages each rank's share (8 / 4 = 2) is cut in 2: rank 0 holds [E] and [t], rank 3 [t] and [L]
    # (Megatron-LM's gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split).
    (6, 4, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank", "2"], [1, 2, 2, 1]),
    (2, 2, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank", "2"], [1, 1]),
    (7, 4, ["--account-for-embedding-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "1"],
     [1, 2, 2, 2]),
    (8, 2, ["--decoder-first-pipeline-num-layers", "2", "--num-virtual-stages-per-pipeline-rank", "2"], [2, 6]),
    # A layout of 4 stages over 2 ranks: stage i on rank i mod 2, rank 0 holding Et and t, rank 1 tt and L.
    (4, 2, ["--pipeline-model-parallel-layout", "Et|tt|t|L"], [2, 2]),
    (5, 2, ["--pipeline-model-parallel-layout", "E|ttt|t|tL"], [1, 4]),
])
def test_each_stage_gets_the_layers_megatron_core_gives_it(num_layers, stages, flags, expected):
    assert split(num_layers, stages, *flags) == expected
    assert sum(expected) == num_layers


@pytest.mark.parametrize("num_layers,stages,flags,message", [
    (4, 3, [], "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    # First and last take every layer: the middle stage would have none.
    (4, 3, ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     "leaves 0 layers after --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers"),
    (8, 3, ["--decoder-first-pipeline-num-layers", "1"], "leaves 7 layers after --decoder-first-pipeline-num-layers"),
    (4, 2, ["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers 0 must be at least 1"),
    (4, 1, ["--decoder-first-pipeline-num-layers", "4"], "need --pipeline-model-parallel-size > 1"),
    (6, 4, ["--account-for-embedding-in-pipeline-split"],
     "--num-layers with --account-for-embedding-in-pipeline-split: 7 layers do not split evenly"),
    (4, 2, ["--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"],
     "two ways to unbalance the stages"),
    (4, 2, ["--pipeline-model-parallel-layout", "Ett|tL"], "--pipeline-model-parallel-layout 'Ett|tL': "),
    # 3 stages over 2 ranks (megatron-core's message); the layout gives the virtual stages: no other flag for them.
    (4, 2, ["--pipeline-model-parallel-layout", "Et|tt|tL"], "must be divisible by pipeline_model_parallel_size"),
    (4, 2, ["--pipeline-model-parallel-layout", "Et|t|t|tL", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--pipeline-model-parallel-layout places every layer: leave out --num-virtual-stages-per-pipeline-rank"),
    (4, 2, ["--pipeline-model-parallel-layout", "Et|tt|tL", "--num-layers-per-virtual-pipeline-stage", "1"],
     "leave out --num-layers-per-virtual-pipeline-stage"),
    (4, 2, ["--pipeline-model-parallel-layout", "Ett|tL", "--decoder-first-pipeline-num-layers", "2"],
     "leave out --decoder-first-pipeline-num-layers"),
    # Its virtual stages are the interleaved schedule's, with its checks (Megatron-LM's at PP 2).
    (4, 2, ["--pipeline-model-parallel-layout", "Et|t|t|tL", "--no-overlap-p2p-communication"],
     "--no-overlap-p2p-communication with the interleaved schedule needs --pipeline-model-parallel-size > 2"),
    (8, 2, ["--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "give the virtual stages as --num-virtual-stages-per-pipeline-rank (Megatron-LM's check)"),
    # Each rank's share must cut into its virtual stages: 4 + 2 = 6, 3 a rank, not in 2; 1 + 7 not either.
    (4, 2, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank", "2"], "shares [3, 3] (the embedding and loss counted) are not "
                                                            "divisible by the 2 virtual stages per pipeline rank"),
    (8, 2, ["--decoder-first-pipeline-num-layers", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
     "shares [1, 7]"),
])
def test_a_split_that_cannot_work_is_refused_naming_the_flags(num_layers, stages, flags, message, capsys):
    with pytest.raises(SystemExit):
        split(num_layers, stages, *flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("layout,virtual", [("Et|t|t|tL", 2), ("E|t|t|t|t|L", 3),
                                            # One stage a rank: no virtual stages, the path of a layout before them.
                                            ("Ettt|tL", None), ("E(t)*4L", None)])
def test_a_layout_of_more_stages_than_ranks_gives_the_virtual_stages(layout, virtual):
    """Megatron-LM's validate_args: the layout's stages over --pipeline-model-parallel-size, None for one."""
    stages = 1 if "|" not in layout else 2
    config = parse_args([*BASE, "--num-layers", "4", "--pipeline-model-parallel-size", str(stages),
                         "--pipeline-model-parallel-layout", layout], world_size=stages)
    assert config.parallel.virtual_pipeline_stages == virtual
    assert transformer_config(config).virtual_pipeline_model_parallel_size == virtual


def test_the_dry_run_follows_the_split(single_process):
    from angpt.training.dry_run import describe  # noqa: PLC0415 (builds a model on the meta device)

    config = parse_args([*BASE, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                         "--decoder-first-pipeline-num-layers", "1"], world_size=2)
    distributed.destroy_model_parallel()  # describe builds its own one-process groups
    try:
        report = describe(config)
    finally:
        distributed.destroy_model_parallel()
        distributed.initialize()
    assert "  4 layers: by pipeline stage 1, 3 (--decoder-first-pipeline-num-layers)" in report
