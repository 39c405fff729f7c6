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
from angpt.config.sections import RunConfig
from angpt.megatron_compat import patches
from angpt.models import WEIGHT_CONSTRAINTS
from angpt.models.bounding import attach_weight_constraint
from angpt.models.specs import gpt_layer_spec
from angpt.training.megatron_configs import by_name
from angpt.training.step import whole_weights_between_steps

logger = logging.getLogger("angpt.optimizer")

@dataclass(frozen=True)
class Recipe:
    weight_decay: float
    warmup_fraction: float
    min_lr_ratio: float


# anGPT: Adam without weight decay or warm-up, cosine to 0.1 lr. nGPT: the same, decaying to 0.
# GPT+: AdamW with weight decay 0.1 on 2-D weights only and 1% warm-up.
# GPT: Megatron-LM's defaults (megatron/training/arguments.py): weight decay 0.01, no warm-up, min lr 0.
RECIPES = {
    "angpt": Recipe(weight_decay=0.0, warmup_fraction=0.0, min_lr_ratio=0.1),
    "ngpt": Recipe(weight_decay=0.0, warmup_fraction=0.0, min_lr_ratio=0.0),
    "gptplus": Recipe(weight_decay=0.1, warmup_fraction=0.01, min_lr_ratio=0.1),
    "gpt": Recipe(weight_decay=0.01, warmup_fraction=0.0, min_lr_ratio=0.0),
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
    if config.model_family == "gpt":
        if config.transformer_impl == "transformer_engine":
            return (f"Transformer Engine {config.normalization}, fused into the QKV and fc1 GEMMs "
                    "(TELayerNormColumnParallelLinear)")
        # The class megatron-core's local spec picks: apex's FusedLayerNorm where installed, else torch's norms.
        norm = gpt_layer_spec(config).submodules.input_layernorm
        return f"{config.normalization} by megatron-core's {getattr(norm, 'module', norm).__name__}"
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


def optimizer_config(config: RunConfig) -> OptimizerConfig:
    """megatron-core's Adam(W) settings (Megatron-LM's `OptimizerConfig` from the flags), with the family's recipe
    where --min-lr and --weight-decay are not given."""
    schedule, recipe = config.optimizer, RECIPES[config.model.model_family]
    return OptimizerConfig(**{
        **by_name(config, OptimizerConfig),
        "optimizer": "adam",
        "min_lr": recipe.min_lr_ratio * schedule.lr if schedule.min_lr is None else schedule.min_lr,
        "weight_decay": recipe.weight_decay if schedule.weight_decay is None else schedule.weight_decay,
        # Counted by angpt.telemetry.monitoring at the logged steps only, not by the optimizer at every step.
        "log_num_zeros_in_grad": False,
    })


def build_optimizer(model_chunks, config: RunConfig, fused_adam: Optional[bool] = None):
    """megatron-core's Adam(W) with the family's defaults (each overridable by a flag), the family's post-step
    weight projection attached, and its lr schedule (megatron-core's: constant, linear, cosine or WSD, over
    --lr-decay-iters, default --train-iters). Returns (optimizer, scheduler).

    With --train-samples the schedule counts samples, as Megatron-LM's does then (--lr-decay-samples, default
    --train-samples; --lr-warmup-samples, else the warm-up fraction of the decay, not rounded): step the
    scheduler by each step's global batch. Otherwise it counts iterations: step it by 1.

    Weight decay reaches 2-D weights only: megatron-core exempts 1-D parameters (norms and scales).
    `fused_adam`: see `use_fused_adam`; default on with CUDA. With --fp16, megatron-core's loss scaler (a
    constant --loss-scale, else dynamic), as Megatron-LM builds it."""
    family, schedule, training = config.model.model_family, config.optimizer, config.training
    megatron_config = optimizer_config(config)
    lr, min_lr, weight_decay = megatron_config.lr, megatron_config.min_lr, megatron_config.weight_decay
    fraction = RECIPES[family].warmup_fraction if schedule.lr_warmup_fraction is None else schedule.lr_warmup_fraction
    if training.train_samples is not None:
        decay_steps = schedule.lr_decay_samples or training.train_samples
        wsd_decay_steps = schedule.lr_wsd_decay_samples
        warmup_given = schedule.lr_warmup_samples
        warmup = warmup_given if warmup_given is not None else fraction * decay_steps
    else:
        decay_steps, wsd_decay_steps = schedule.lr_decay_iters or training.train_iters, schedule.lr_wsd_decay_iters
        # The warm-up: --lr-warmup-iters, else --lr-warmup-fraction of the decay, else the family's fraction.
        warmup_given = schedule.lr_warmup_iters
        warmup = warmup_given if warmup_given is not None else round(fraction * decay_steps)
    model_config = get_model_config(model_chunks[0])
    log_backends(model_config, recipe_departures(family, schedule.weight_decay, warmup_given,
                                                 schedule.lr_warmup_fraction,
                                                 "samples" if training.train_samples is not None else "iters"))
    optimizer = get_megatron_optimizer(megatron_config, model_chunks,
                                       use_gloo_process_groups=config.parallel.enable_gloo_process_groups,
                                       dump_param_to_param_group_map=schedule.dump_param_to_param_group_map)
    whole_weights_between_steps(model_chunks)  # Megatron-FSDP's optimizer took its shards
    if schedule.decoupled_lr is not None:
        decoupled = (schedule.decoupled_lr, min_lr if schedule.decoupled_min_lr is None else schedule.decoupled_min_lr)
        if decoupled == (lr, min_lr):
            raise ValueError(f"--decoupled-lr {schedule.decoupled_lr} with the min lr {decoupled[1]} decouples "
                             "nothing: they are --lr's and --min-lr's; leave them out")
        patches.mark_decoupled_lr_groups(optimizer, *decoupled)
    if torch.cuda.is_available() if fused_adam is None else fused_adam:
        use_fused_adam(optimizer)
    constraint = WEIGHT_CONSTRAINTS[family]
    if constraint is not None:
        attach_weight_constraint(optimizer, constraint)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.lr_warmup_init if warmup else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.lr_decay_style,
        # Megatron-LM's: the weight decay goes from start to end over the whole training.
        start_wd=weight_decay if schedule.weight_decay_incr_style == "constant" else schedule.start_weight_decay,
        end_wd=weight_decay if schedule.weight_decay_incr_style == "constant" else schedule.end_weight_decay,
        wd_incr_steps=training.train_iters if training.train_samples is None else training.train_samples,
        wd_incr_style=schedule.weight_decay_incr_style,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=schedule.lr_wsd_decay_style,
        # megatron-core's default keeps the checkpoint's schedule; overriding it excludes that.
        use_checkpoint_opt_param_scheduler=not schedule.override_opt_param_scheduler,
        override_opt_param_scheduler=schedule.override_opt_param_scheduler,
    )
    return optimizer, scheduler
