"""How --num-layers splits over the pipeline stages, with Megatron-LM's flags and megatron-core's rules
(TransformerConfig, which builds each stage's share): evenly by default; with
--decoder-first-pipeline-num-layers and/or --decoder-last-pipeline-num-layers, those on the first and last
stage and the rest evenly over the others; with --account-for-embedding-in-pipeline-split and/or
--account-for-loss-in-pipeline-split, the embedding and/or the loss counted as one layer of the first and last
stage; with --pipeline-model-parallel-layout, each layer where the layout string puts it ("Et|tt|ttL": the
embedding and a layer, two layers, two layers and the loss). With virtual stages (the interleaved schedule), each
rank's share is cut into that many equal chunks, the embedding and loss taken from the first and last (megatron-core's
get_num_layers_to_build); a layout string of more stages than pipeline ranks gives the virtual stages itself, stage i
on rank i mod PP (Megatron-LM's validate_args), each as uneven as the string writes it."""

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
        virtual_flags = (("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
                         ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank))
        others = [flag for flag in given if flag != "--pipeline-model-parallel-layout"] + [
            flag for flag, value in virtual_flags if value is not None]
        if others:  # Megatron-LM's checks: the layout sets the virtual stages too
            raise ValueError(f"--pipeline-model-parallel-layout places every layer: leave out {others[0]}")
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
    """The virtual stages per pipeline rank (`args`: the parallel section, or the parsed flags, a layout already
    checked by `stage_layers`), as Megatron-LM derives them; None for one (no interleaved schedule then). From
    --pipeline-model-parallel-layout: its stages over the pipeline ranks. From --num-layers-per-virtual-pipeline-stage:
    a rank's share of the layers (the embedding and loss counted where the split counts them) over it."""
    if args.pipeline_model_parallel_layout:
        stages = parsed_layout(args.pipeline_model_parallel_layout,
                               args.pipeline_model_parallel_size).virtual_pipeline_model_parallel_size
        return stages if stages > 1 else None
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


def parsed_layout(layout: str, stages: int):
    """megatron-core's PipelineParallelLayerLayout of the string over `stages` pipeline ranks (TransformerConfig's)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: PLC0415 (only with a layout:
        PipelineParallelLayerLayout,  # --help stays quick)
    )

    return PipelineParallelLayerLayout(layout, stages)


def _layout_layers(layout: str, layers: int, stages: int, mtp_num_layers: Optional[int]) -> list[int]:
    from megatron.core.transformer.enums import LayerType  # noqa: PLC0415 (as parsed_layout)

    try:
        parsed = parsed_layout(layout, stages)
        parsed.validate_layer_layout(layers, mtp_num_layers=mtp_num_layers or None)
    except (AssertionError, ValueError, NotImplementedError) as error:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {error} (E: the embedding, t: a layer, m: an "
                         f"MTP layer, L: the loss, | between stages; {layers} layers, {mtp_num_layers or 0} MTP "
                         f"layers over {stages} stages)") from None
    if parsed.virtual_pipeline_model_parallel_size > 1 and LayerType.mtp in parsed.layout[0][-1]:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} puts the MTP layers (m) in the first pipeline "
                         "rank's last virtual stage, beside its embedding: megatron-core 0.16.1 keeps one copy of the "
                         "word embedding per rank of its embedding group, so that stage's second copy is never made "
                         "equal to the first (the ranks' initial all-reduces do not pair: Megatron-LM hangs there too) "
                         "nor its gradients reduced; put m on a later rank")
    # A rank's layers over all its virtual stages.
    return [sum(chunk.count(LayerType.decoder) for chunk in parsed.layout[rank]) for rank in range(stages)]


def mtp_stage(parallel) -> int:
    """The pipeline stage that holds the MTP layers (`parallel`: the parallel section, or the parsed flags): where a
    layout puts m, the last stage otherwise (megatron-core's get_mtp_ranks)."""
    stages = parallel.pipeline_model_parallel_size
    if not parallel.pipeline_model_parallel_layout:
        return stages - 1
    from megatron.core.transformer.enums import LayerType  # noqa: PLC0415 (as parsed_layout)

    parsed = parsed_layout(parallel.pipeline_model_parallel_layout, stages)
    return next((rank for rank in range(stages) if any(LayerType.mtp in chunk for chunk in parsed.layout[rank])),
                stages - 1)


def stage_of_layer(split: list[int], layer: int) -> Optional[int]:
    """The pipeline stage that holds decoder layer `layer` (0-based over the whole model)."""
    end = 0
    for stage, count in enumerate(split):
        end += count
        if layer < end:
            return stage
    return None
