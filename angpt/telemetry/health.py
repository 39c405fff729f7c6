"""anGPT's norm-health signals (docs/model.md, What the paper reports): per-layer residual-stream norms,
alpha, the fraction of weight rows at the bound, measured by HealthProbe during logged steps; and, under FP8
with delayed scaling, the absolute maximum behind each FP8 GEMM operand's scale (docs/fp8.md).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import unwrap_model
from torch.distributed.tensor import DTensor

from angpt.models.bounding import all_reduce_in_place, constrained_parameters, split_over_tp
from angpt.models.gpt import WEIGHT_CONSTRAINTS
from angpt.models.layers import NormalizedResidual

# A row counts as "at the bound" when its norm is within this of 1 (docs/model.md, Bounding: rows are projected to
# norm <= 1, so rows the optimizer pushes outward sit at exactly 1 up to round-off).
BOUND_TOLERANCE = 1e-3

# Transformer Engine's delayed-scaling state (module.fp8_meta["scaling_fwd" / "scaling_bwd"].scale) has, per
# GEMM, 3 forward tensors (input, weight, output) and 2 backward ones (grad_output, grad_input); the operands
# reported are these. E4M3 is used forward, and backward too except in the hybrid format, which uses E5M2.
FP8_OPERANDS = {"scaling_fwd": (3, {0: "input", 1: "weight"}), "scaling_bwd": (2, {0: "grad_output"})}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}




# ---------------------------------------------------------------------------------------------------------
# anGPT's health signals (docs/model.md, What the paper reports)


class HealthProbe:
    """Residual-stream norms after every layer, the post-norm input norms, the mean of each alpha and the
    fraction of weight rows at the bound, for the model chunks of this rank.

    Wrap forward passes in `capture()`: hooks exist only inside it, so other passes pay nothing. Under
    activation recomputation a capture spanning the backward pass sees recomputed layers twice, which
    leaves the means unchanged. `summary()` is collective over the default group.
    """

    def __init__(self, model_chunks: list[torch.nn.Module]):
        self._models = unwrap_model(list(model_chunks))
        config = self._models[0].config
        width = max(2, len(str(config.num_layers)))
        self._alpha_abs = config.alpha_abs
        # (layer name, layer) for every layer of every chunk; layer_number counts from 1 over the model.
        self._layers = [
            (f"layer_{layer.layer_number:0{width}d}", layer)
            for model in self._models
            for layer in model.decoder.layers
        ]
        self._bounded = WEIGHT_CONSTRAINTS[config.model_family] == "bound"
        self._fp8_max = {
            "scaling_fwd": FP8_MAX["e4m3"],
            "scaling_bwd": FP8_MAX["e5m2" if config.fp8 == "hybrid" else "e4m3"],
        }
        self._fp8_margin = config.fp8_margin or 0
        self._norm_sums: dict[str, torch.Tensor] = {}
        self._token_counts: dict[str, int] = {}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        handles = []
        for layer_name, layer in self._layers:
            record_output = partial(self._record_output, f"residual_norm/{layer_name}")
            handles.append(layer.register_forward_hook(record_output))
            for child_name, child in layer.named_children():
                # The residual update applies the post-norm to its second input, the sub-block's output.
                if isinstance(child, NormalizedResidual) and child.post_norm:
                    sub_block = child_name.removesuffix("_residual")
                    name = f"post_norm_input/{sub_block}/{layer_name}"
                    handles.append(child.register_forward_pre_hook(partial(self._record_input, name)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record_input(self, name, module, inputs):
        self._accumulate(name, inputs[1])

    def _record_output(self, name, module, inputs, output):
        # Transformer layers return (hidden_states, context).
        self._accumulate(name, output[0] if isinstance(output, tuple) else output)

    def _accumulate(self, name: str, hidden: torch.Tensor) -> None:
        # Sums and token counts, not means: under sequence parallelism each TP rank holds other tokens,
        # without it every TP rank holds the same ones; sum over sum of counts is the mean in both cases.
        norms = hidden.detach().float().norm(dim=-1)
        total = norms.sum(dtype=torch.float64)
        self._norm_sums[name] = self._norm_sums[name] + total if name in self._norm_sums else total
        self._token_counts[name] = self._token_counts.get(name, 0) + norms.numel()

    @torch.no_grad()
    def _alpha_means(self) -> dict[str, float]:
        means = {}
        for layer_name, layer in self._layers:
            for child_name, child in layer.named_children():
                if isinstance(child, NormalizedResidual) and child.lerp:
                    alpha = child.alpha()
                    # nGPT's LERP uses |alpha| (NormalizedResidual.forward).
                    alpha = alpha.abs() if self._alpha_abs else alpha
                    means[f"alpha_{child_name.removesuffix('_residual')}/{layer_name}"] = _whole(alpha).mean()
        return {name: value.item() for name, value in means.items()}

    @torch.no_grad()
    def _rows_at_bound(self) -> tuple[int, int]:
        """(rows at the bound, rows) that this rank counts, so that over all ranks each row counts once:
        on data-parallel rank 0, and on TP rank 0 for weights replicated over TP and rows split over it."""
        if not self._bounded:
            return 0, 0
        # Looked up now: Megatron-FSDP swaps its model's parameter objects (angpt.training.step.weights_gathered).
        # The last stage's copy of a tied embedding (`shared`) would count the embedding twice.
        weights = [p for p in constrained_parameters(self._models) if not getattr(p, "shared", False)]
        tp_group = parallel_state.get_tensor_model_parallel_group()
        # FSDP2's row shards are gathered whole (every rank, in the same order: a collective each).
        squared = [_whole(p).detach().float().pow(2).sum(dim=p.unit_norm_dim) for p in weights]
        split = [split_over_tp(p) for p in weights]
        if tp_group.size() > 1:
            # Row-parallel weights hold a part of each row on each TP rank: sum the partial squared norms.
            all_reduce_in_place([sq for sq, is_split in zip(squared, split) if is_split], tp_group)
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
            return 0, 0
        counted = [
            sq
            for sq, param, is_split in zip(squared, weights, split)
            if (tp_group.rank() == 0 if is_split else param_is_not_tensor_parallel_duplicate(param))
        ]
        if not counted:
            return 0, 0
        norms = torch.cat(counted).sqrt()
        return int((norms >= 1 - BOUND_TOLERANCE).sum().item()), norms.numel()

    @torch.no_grad()
    def _fp8_amaxes(self) -> dict[str, float]:
        """Per layer, TE module and operand: the absolute maximum its current FP8 scale was set from,
        fp8_max / (scale * 2^margin) (delayed scaling; other recipes keep no such state and report nothing).
        Read from the scales rather than the amax histories, which TE rolls and zeroes after each update."""
        figures = {}
        for layer_name, layer in self._layers:
            for module_name, module in layer.named_modules():
                meta = getattr(module, "fp8_meta", None)
                if not isinstance(meta, dict):
                    continue
                for key, (per_gemm, operands) in FP8_OPERANDS.items():
                    scale = getattr(meta.get(key), "scale", None)
                    if scale is None:
                        continue
                    gemms = scale.numel() // per_gemm
                    amax = self._fp8_max[key] / (scale.float() * 2.0**self._fp8_margin)
                    for column, value in enumerate(amax.tolist()):
                        gemm, operand = divmod(column, per_gemm)
                        if operand in operands:
                            suffix = f"/gemm_{gemm + 1}" if gemms > 1 else ""
                            figures[f"fp8_amax_{operands[operand]}/{layer_name}/{module_name}{suffix}"] = value
        return figures

    def summary(self) -> dict[str, float]:
        """{"health/...": value} over the whole model, on every rank (collective over the default group),
        then forgets what was captured. Norms are means over all tokens captured by any rank since the
        previous summary, so with data parallelism they cover every data-parallel rank's micro-batches."""
        sums = {name: total.item() for name, total in self._norm_sums.items()}
        local = (sums, dict(self._token_counts), self._alpha_means(), self._rows_at_bound(), self._fp8_amaxes())
        self._norm_sums.clear()
        self._token_counts.clear()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)

        norm_sums, token_counts, figures = {}, {}, {}
        at_bound = rows = 0
        for rank_sums, rank_counts, rank_alphas, (rank_at_bound, rank_rows), rank_fp8 in everyone:
            for name, total in rank_sums.items():
                norm_sums[name] = norm_sums.get(name, 0.0) + total
                token_counts[name] = token_counts.get(name, 0) + rank_counts[name]
            figures.update(rank_alphas)  # alpha is replicated over TP and DP ranks
            for name, amax in rank_fp8.items():  # TE reduces amaxes over TP; pipeline stages hold other layers
                figures[name] = max(amax, figures.get(name, 0.0))
            at_bound += rank_at_bound
            rows += rank_rows
        figures.update({name: norm_sums[name] / token_counts[name] for name in norm_sums})
        if rows:
            figures["rows_at_bound"] = at_bound / rows
        return {f"health/{name}": figures[name] for name in sorted(figures)}




def params_l2_norm(chunks) -> float:
    """Collective over the model-parallel group (and the data-parallel one under FSDP2): the L2 norm of all the
    model's weights, as Megatron-LM's calc_params_l2_norm sums it (--log-params-norm): each weight once (a
    tensor-parallel duplicate on its first rank only, a weight shared between stages once, FSDP2's shards each on
    its rank), in fp32."""
    squares = torch.zeros((), dtype=torch.float64, device=next(chunks[0].parameters()).device)
    sharded = False
    for chunk in chunks:
        for param in chunk.parameters():
            if param_is_not_tensor_parallel_duplicate(param) and not getattr(param, "shared", False):
                if isinstance(param, DTensor):
                    param, sharded = param.to_local(), True
                squares += param.detach().float().square().sum().double()
    if sharded:
        dist.all_reduce(squares, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return squares.sqrt().item()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective), or the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
