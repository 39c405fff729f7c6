"""How --num-layers splits over the pipeline stages, with Megatron-LM's flags and megatron-core's rules
(TransformerConfig, which builds each stage's share): evenly by default; with
--decoder-first-pipeline-num-layers and/or --decoder-last-pipeline-num-layers, those on the first and last
stage and the rest evenly over the others; with --account-for-embedding-in-pipeline-split and/or
--account-for-loss-in-pipeline-split, the embedding and/or the loss counted as one layer of the first and last
stage; with --pipeline-model-parallel-layout, each layer where the layout string puts it ("Et|tt|ttL": the
embedding and a layer, two layers, two layers and the loss). With virtual stages (the interleaved schedule), each
rank's share is cut into that many equal chunks, the embedding and loss taken from the first and last (megatron-core's
get_num_layers_to_build); a layout string with virtual stages is not built here."""

from __future__ import annotations

from typing import Optional

UNEVEN_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                "pipeline_model_parallel_layout")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def uneven(parallel) -> list[str]:
    """The uneven-split flags given (`parallel`: the parallel section, or the parsed flags)."""
    return [_flag(dest) for dest in UNEVEN_FLAGS if getattr(parallel, dest)]


def stage_layers(num_layers: int, parallel, mtp_num_layers: Optional[int] = None) -> list[int]:
    """The decoder layers of each pipeline stage (`parallel`: the parallel section, or the parsed flags; a layout holds
    the `mtp_num_layers` MTP layers too, m); ValueError, naming the flags, for a split that does not work."""
    layers, stages = num_layers, parallel.pipeline_model_parallel_size
    args = parallel
    given = uneven(args)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    if args.pipeline_model_parallel_layout:
        if len(given) > 1:
            raise ValueError(f"--pipeline-model-parallel-layout places every layer: leave out {given[1]}")
        return _layout_layers(args.pipeline_model_parallel_layout, layers, stages, mtp_num_layers)
    split = _split(layers, stages, given, first, last, embedding, loss)
    virtual = virtual_stages(num_layers, args)
    if given and virtual:
        if args.num_layers_per_virtual_pipeline_stage and (first or last):
            raise ValueError(f"{' and '.join(given)} with --num-layers-per-virtual-pipeline-stage: give the virtual "
                             "stages as --num-virtual-stages-per-pipeline-rank (Megatron-LM's check)")
        shares = [count + (embedding and stage == 0) + (loss and stage == stages - 1)
                  for stage, count in enumerate(split)]
        if any(share % virtual for share in shares):
            raise ValueError(f"{' and '.join(given)}: the pipeline stages' shares {shares} (the embedding and loss "
                             f"counted) are not divisible by the {virtual} virtual stages per pipeline rank")
    return split


def virtual_stages(num_layers: int, args) -> Optional[int]:
    """The virtual stages per pipeline rank (`args`: the parallel section, or the parsed flags), as Megatron-LM
    derives them; None for one (no interleaved schedule then). From --num-layers-per-virtual-pipeline-stage: a
    rank's share of the layers (the embedding and loss counted where the split counts them) over it."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    stages = args.num_virtual_stages_per_pipeline_rank
    if not stages and per_stage:
        layers = (num_layers + bool(args.account_for_embedding_in_pipeline_split)
                  + bool(args.account_for_loss_in_pipeline_split))
        stages = layers // args.pipeline_model_parallel_size // per_stage
    return stages if stages and stages > 1 else None


def _split(layers: int, stages: int, given: list[str], first, last, embedding, loss) -> list[int]:
    if (first or last) and (embedding or loss):
        raise ValueError("--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
                         "are two ways to unbalance the stages: give one")
    if first or last:
        ends = [count for count in (first, last) if count]
        if stages == 1:
            raise ValueError(f"{' and '.join(given)} need --pipeline-model-parallel-size > 1")
        middle_layers, middle_stages = layers - sum(ends), stages - len(ends)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and middle_layers % middle_stages):
            raise ValueError(f"--num-layers {layers} leaves {middle_layers} layers after {' and '.join(given)}, which "
                             f"do not split evenly over the other {middle_stages} pipeline stages")
        middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
        return [*([first] if first else []), *middle, *([last] if last else [])]
    total = layers + bool(embedding) + bool(loss)
    if total % stages:
        if not given:
            raise ValueError(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {stages}")
        raise ValueError(f"--num-layers with {' and '.join(given)}: {total} layers do not split evenly over "
                         f"--pipeline-model-parallel-size {stages}")
    split = [total // stages] * stages
    split[0] -= bool(embedding)
    split[-1] -= bool(loss)
    if min(split) < (0 if given else 1):
        raise ValueError(f"--num-layers {layers} leaves a pipeline stage without layers")
    return split


def _layout_layers(layout: str, layers: int, stages: int, mtp_num_layers: Optional[int]) -> list[int]:
    from megatron.core.transformer.enums import LayerType  # noqa: PLC0415 (only with a layout: --help stays quick)
    from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: PLC0415
        PipelineParallelLayerLayout,
    )

    try:
        parsed = PipelineParallelLayerLayout(layout, stages)
        standalone = parsed.validate_layer_layout(layers, mtp_num_layers=mtp_num_layers or None)
    except (AssertionError, ValueError, NotImplementedError) as error:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {error} (E: the embedding, t: a layer, m: an "
                         f"MTP layer, L: the loss, | between stages; {layers} layers, {mtp_num_layers or 0} MTP "
                         f"layers over {stages} stages)") from None
    if standalone:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} puts the MTP layers (m) on a stage before the "
                         "last (megatron-core's mtp_standalone): not built here, that stage's copy of the word "
                         "embedding needs Megatron-LM's embedding group with it (get_embedding_ranks); put m on the "
                         "last stage")
    virtual = parsed.virtual_pipeline_model_parallel_size
    if virtual > 1:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} has {virtual} virtual stages per pipeline "
                         "rank: virtual stages of an uneven split are not built yet")
    return [parsed.layout[rank][0].count(LayerType.decoder) for rank in range(stages)]


def stage_of_layer(split: list[int], layer: int) -> Optional[int]:
    """The pipeline stage that holds decoder layer `layer` (0-based over the whole model)."""
    end = 0
    for stage, count in enumerate(split):
        end += count
        if layer < end:
            return stage
    return None
