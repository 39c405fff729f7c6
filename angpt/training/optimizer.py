"""Each family's optimizer and learning-rate schedule (docs/model.md, Optimizer and schedule), on
megatron-core's optimizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import optimizer as megatron_optimizer
from megatron.core.fusions.fused_layer_norm import HAVE_FUSED_LAYER_NORM
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from angpt.config.choices import FAMILY_NAMES
from angpt.megatron_compat import patches
from angpt.models import WEIGHT_CONSTRAINTS
from angpt.models.bounding import attach_weight_constraint

logger = logging.getLogger("angpt.optimizer")

@dataclass(frozen=True)
class Recipe:
    weight_decay: float
    warmup_fraction: float
    min_lr_ratio: float


# anGPT: Adam without weight decay or warm-up, cosine to 0.1 lr. nGPT: the same, decaying to 0.
# GPT+: AdamW with weight decay 0.1 on 2-D weights only and 1% warm-up.
RECIPES = {
    "angpt": Recipe(weight_decay=0.0, warmup_fraction=0.0, min_lr_ratio=0.1),
    "ngpt": Recipe(weight_decay=0.0, warmup_fraction=0.0, min_lr_ratio=0.0),
    "gptplus": Recipe(weight_decay=0.1, warmup_fraction=0.01, min_lr_ratio=0.1),
}


def recipe_departures(model_family: str, weight_decay: Optional[float], warmup: Optional[int],
                      warmup_fraction: Optional[float], unit: str = "iters") -> list[str]:
    """A line for each flag given a value other than the family's recipe (a Megatron-LM script's
    `--weight-decay 0.1` with anGPT, say): honoured, and said."""
    recipe, name = RECIPES[model_family], FAMILY_NAMES[model_family]
    lines = []
    if weight_decay is not None and weight_decay != recipe.weight_decay:
        paper = f"weight decay {recipe.weight_decay:g}" if recipe.weight_decay else "no weight decay"
        lines.append(f"--weight-decay {weight_decay:g} departs from {name}'s recipe, {paper} (docs/model.md)")
    warmup = [(f"--lr-warmup-{unit} {warmup}", warmup and recipe.warmup_fraction == 0),
              (f"--lr-warmup-fraction {warmup_fraction}", warmup_fraction is not None
               and warmup_fraction != recipe.warmup_fraction)]
    paper = f"a warm-up of {recipe.warmup_fraction:g} of the decay" if recipe.warmup_fraction else "no warm-up"
    lines += [f"{flag} departs from {name}'s recipe, {paper} (docs/model.md)" for flag, departs in warmup if departs]
    return lines


def optimizer_backend() -> str:
    """The Adam megatron-core's optimizer runs: Transformer Engine's FusedAdam, else apex's, else torch's
    AdamW (megatron-core picks it at import; nothing here requires apex or TE)."""
    adam = megatron_optimizer.Adam
    name = f"{adam.__module__.split('.')[0]}'s {adam.__name__}"
    if adam.__module__.startswith("transformer_engine"):
        return f"{name} (Transformer Engine)"
    if adam.__module__.startswith("apex"):
        return f"{name} (apex; Transformer Engine not installed)"
    return f"torch.optim.{adam.__name__} (neither Transformer Engine nor apex installed)"


def norm_backend(config) -> str:
    """What normalizes activations in the config's family and implementation."""
    if config.normalized:
        return "exact L2 norms in torch ops (post-norms and QK-norm; anGPT/nGPT have no norm layers)"
    if config.transformer_impl == "transformer_engine":
        return ("Transformer Engine RMSNorm, fused into the QKV and fc1 GEMMs (TELayerNormColumnParallelLinear); "
                "TENorm for QK-norm and the final norm")
    why = ("apex's FusedLayerNorm, which megatron-core selects when apex is installed, is LayerNorm only"
           if HAVE_FUSED_LAYER_NORM else "apex not installed")
    return f"torch.nn.RMSNorm ({why})"


_logged_backends = False


def log_backends(config, departures: list[str]) -> None:
    """One log line each for the optimizer, the norms and each departure from the family's recipe, once per
    process (rank 0 only when distributed)."""
    global _logged_backends
    if _logged_backends or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _logged_backends = True
    logger.info("optimizer: %s", optimizer_backend())
    logger.info("norms: %s", norm_backend(config))
    for line in departures:
        logger.warning("%s", line)


def use_fused_adam(optimizer) -> None:
    """Switch megatron-core's fallback to torch's Adam(W) (no Transformer Engine or apex, whose FusedAdam it
    would use) from torch's foreach implementation to its fused one: one kernel per step and dtype instead of
    a dozen foreach kernels over every tensor, and no host read of the step counters. megatron-core builds
    torch's optimizer without a `fused` argument, so it is set on the param groups, and again after every
    load of a state dict, which restores the saved groups' settings (a checkpoint of a foreach run, or of one
    before this switch). Fused needs the step counters on the parameters' device, foreach keeps them on the
    CPU: moved on load. Off by default on CPU: torch's fused CPU kernel differs from foreach in the last bit
    of a few elements per step (both in fp32), and CPU runs keep their results."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner.optimizer, torch.optim.Adam):
            _fuse(inner.optimizer)
            inner.optimizer.register_load_state_dict_post_hook(_fuse)


def _fuse(adam: torch.optim.Adam) -> None:
    for group in adam.param_groups:
        group.update(fused=True, foreach=False)
        for param in group["params"]:
            state = adam.state.get(param, {})
            if "step" in state:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def build_optimizer(
    model_chunks,
    model_family: str,
    lr: float,
    train_iters: int,
    min_lr: Optional[float] = None,
    weight_decay: Optional[float] = None,
    lr_warmup_iters: Optional[int] = None,
    lr_warmup_fraction: Optional[float] = None,
    lr_warmup_init: float = 0.0,
    lr_decay_style: str = "cosine",
    lr_decay_iters: Optional[int] = None,
    lr_wsd_decay_iters: Optional[int] = None,
    lr_wsd_decay_style: str = "exponential",
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
    train_samples: Optional[int] = None,
    lr_decay_samples: Optional[int] = None,
    lr_warmup_samples: Optional[int] = None,
    lr_wsd_decay_samples: Optional[int] = None,
    clip_grad: float = 1.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    use_distributed_optimizer: bool = False,
    bf16: bool = False,
    loss_scaling: Optional[dict] = None,
    fused_adam: Optional[bool] = None,
):
    """megatron-core's Adam(W) with the family's defaults (each overridable), the family's post-step
    weight projection attached, and its lr schedule (megatron-core's: constant, linear, cosine or WSD,
    over `lr_decay_iters`, default `train_iters`). Returns (optimizer, scheduler).

    With `train_samples` the schedule counts samples, as Megatron-LM's does then (`lr_decay_samples`, default
    `train_samples`; `lr_warmup_samples`, else the warm-up fraction of the decay, not rounded): step the
    scheduler by each step's global batch. Otherwise it counts iterations: step it by 1.

    Weight decay reaches 2-D weights only: megatron-core exempts 1-D parameters (norms and scales).
    `fused_adam`: see `use_fused_adam`; default on with CUDA. `loss_scaling`: the loss scaler's settings
    (OptimizerConfig's loss_scale, initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis) of an fp16
    model."""
    recipe = RECIPES[model_family]
    min_lr = recipe.min_lr_ratio * lr if min_lr is None else min_lr
    weight_decay_given = weight_decay
    weight_decay = recipe.weight_decay if weight_decay is None else weight_decay
    fraction = recipe.warmup_fraction if lr_warmup_fraction is None else lr_warmup_fraction
    if train_samples is not None:
        decay_steps, wsd_decay_steps = lr_decay_samples or train_samples, lr_wsd_decay_samples
        warmup = lr_warmup_samples if lr_warmup_samples is not None else fraction * decay_steps
        warmup_given = lr_warmup_samples
    else:
        decay_steps, wsd_decay_steps = lr_decay_iters or train_iters, lr_wsd_decay_iters
        # The warm-up: --lr-warmup-iters, else --lr-warmup-fraction of the decay, else the family's fraction.
        warmup = lr_warmup_iters if lr_warmup_iters is not None else round(fraction * decay_steps)
        warmup_given = lr_warmup_iters
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        # The embedding and output head's own max and min lr (megatron-core's param groups).
        decoupled_lr=decoupled_lr,
        decoupled_min_lr=decoupled_min_lr,
        bf16=bf16,
        # fp16: megatron-core's loss scaler (a constant --loss-scale, else dynamic), as Megatron-LM builds it.
        **({} if loss_scaling is None else dict(fp16=True, **loss_scaling)),
        use_distributed_optimizer=use_distributed_optimizer,
    )
    model_config = get_model_config(model_chunks[0])
    log_backends(model_config, recipe_departures(model_family, weight_decay_given, warmup_given, lr_warmup_fraction,
                                                 "samples" if train_samples is not None else "iters"))
    optimizer = get_megatron_optimizer(config, model_chunks)
    if decoupled_lr is not None:
        decoupled = (decoupled_lr, min_lr if decoupled_min_lr is None else decoupled_min_lr)
        if decoupled == (lr, min_lr):
            raise ValueError(f"--decoupled-lr {decoupled_lr} with the min lr {decoupled[1]} decouples nothing: they "
                             "are --lr's and --min-lr's; leave them out")
        patches.mark_decoupled_lr_groups(optimizer, *decoupled)
    if torch.cuda.is_available() if fused_adam is None else fused_adam:
        use_fused_adam(optimizer)
    constraint = WEIGHT_CONSTRAINTS[model_family]
    if constraint is not None:
        attach_weight_constraint(optimizer, constraint)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr_warmup_init if warmup else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=lr_decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=lr_wsd_decay_style,
    )
    return optimizer, scheduler
