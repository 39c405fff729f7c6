"""The configuration of a run, in typed sections: one frozen dataclass per concern, composed into `RunConfig`.

Each field is a flag of `angpt.pretrain` (its name is the flag's destination, `--num-layers` for `num_layers`):
`flag()` holds its default, help and what argparse needs beyond the type, and `angpt.config.parser` builds the
command line from the sections, so that a flag is declared in one place. Fields made with `derived()` are not
flags: `angpt.config.validation` computes them once from the others (the world size and data-parallel size, the
length of training from samples or a ramp-up, ...). Nothing rewrites a configuration after validation returns it.

This module imports nothing heavy, so that `--help` and flag errors are instant.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional

from angpt.config.blend import parse_blend
from angpt.config.choices import (
    CUDA_GRAPH_SCOPES,
    FACTOR_MODES,
    MODEL_FAMILIES,
    NORMALIZATIONS,
    NU_P_READINGS,
    OFFLOAD_MODULES,
    POSITION_EMBEDDING_TYPES,
    POST_NORMS,
    RECOMPUTE_MODULES,
    RESIDUALS,
    TRANSFORMER_IMPLS,
)
from angpt.config.tiktoken_layout import TIKTOKEN_NUM_SPECIAL_TOKENS, TIKTOKEN_PATTERNS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# Megatron-LM's; a2a+p2p needs --hierarchical-context-parallel-sizes.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8")
FP8_AMAX_ALGOS = ("max", "most_recent")
# Megatron-LM's values (megatron/training/resilience_config.py); angpt.training.rerun maps them to megatron-core's.
RERUN_MODES = ("disabled", "validate_results", "report_stats")
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
# megatron-core's StrictHandling values (megatron/core/dist_checkpointing/validation.py; a test holds them equal).
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all")
# Megatron-LM's choices of --non-persistent-ckpt-type; validation refuses local and in_memory, saying why.
NON_PERSISTENT_CKPT_TYPES = ("global", "local", "in_memory")


def no_rope_freq_type(value: str) -> int | tuple[int, ...]:
    """--no-rope-freq, read as Megatron-LM reads it (its no_rope_freq_type): N, RoPE skipped on every N-th layer, or
    a Python list expression of one 0 or 1 per layer (1: no RoPE), of digits, commas, brackets, + and * only
    ("([0]*3+[1])*2")."""
    if "[" not in value:
        return int(value)
    if re.search(r"[^,\d\[\]()+*]", value):
        raise ValueError(f"invalid pattern: {value}")
    return tuple(eval(value, {"__builtins__": {}}))  # noqa: S307 (digits, brackets, commas, + and * only)


def flag(default=None, help: Optional[str] = None, *, option: Optional[str] = None, switch: bool = False,
         exclusive: Optional[str] = None, **argparse_kwargs):
    """A field that is a flag. `option`: its name when not the field's (`--rope-fusion` for apply_rope_fusion; a
    `--no-...` name for a field that defaults to True); `switch`: on/off with a `--no-...` form as well, so that
    a --config file's value can be switched off again; `exclusive`: the name of a group of flags of which one
    may be given; the rest (choices, metavar, nargs, const) go to argparse as they are. The type comes from the
    annotation: bool is an on/off flag, tuple[...] takes one or more values."""
    return field(default=default, metadata={"flag": dict(help=help, option=option, switch=switch,
                                                         exclusive=exclusive, argparse=argparse_kwargs)})


def derived(default=None):
    """A field computed by validation from the flags (not a flag itself)."""
    return field(default=default, metadata={"derived": True})


@dataclass(frozen=True)
class DryRunSection:
    """--dry-run: check the configuration and its data, report, and exit without training."""

    GROUP: ClassVar[str] = "dry run"

    dry_run: Optional[int] = flag(None, "check the configuration for WORLD_SIZE processes (default: $WORLD_SIZE, "
        "else 1) and its data, print the parallel layout, batch arithmetic and parameter count, and exit without "
        "training", metavar="WORLD_SIZE", nargs="?", const=0)
    gpu_memory_gib: Optional[float] = flag(None, "with --dry-run: the memory of one GPU the estimate is checked "
        "against (default: this machine's GPU, else 80)")
    suggest_layout: bool = flag(False, "with --dry-run WORLD_SIZE: rank the tensor, pipeline, context and data "
        "parallel sizes and recompute choices that fit the GPU's memory by an estimate of step time "
        "(docs/scaling.md)")


@dataclass(frozen=True)
class ModelSection:
    """The model: its family, shape, dropout and activation recompute."""

    GROUP: ClassVar[str] = "model"

    model_family: str = flag("angpt", choices=MODEL_FAMILIES)
    num_layers: int = flag(4)
    hidden_size: int = flag(128)
    num_attention_heads: int = flag(4)
    num_query_groups: Optional[int] = flag(None, "key/value heads (grouped-query attention); with --model-family "
        "gpt it needs --group-query-attention, as in Megatron-LM")
    ffn_hidden_size: Optional[int] = flag(None, "width of the MLP, of each half of a gated one (default 4 x hidden; "
        "gpt with --swiglu: Megatron-LM's 8/3 x hidden, rounded down to a multiple of 64)")
    kv_channels: Optional[int] = flag(None, 'head dim (default hidden / heads)')
    seq_length: int = flag(128)
    max_position_embeddings: Optional[int] = flag(None, "gpt: the rows of the learned position embeddings (default "
        "--seq-length; Megatron-LM requires it); the other families' RoPE needs only --seq-length (it must not be "
        "below it)")
    rotary_base: int = flag(10000)
    norm_epsilon: float = flag(1e-05, "epsilon of GPT+'s RMSNorms and GPT's norms (anGPT and nGPT replace them by "
        "their own normalization)")
    init_method_std: float = flag(0.02, "GPT+ and GPT weight init (anGPT and nGPT put every row on the unit sphere "
        "instead)")
    perform_initialization: bool = flag(True, "skip the weights' initialization when building the model, to start "
        "sooner from the checkpoint --load gives them (megatron-core's perform_initialization; refused without a "
        "checkpoint to load, whose weights would be uninitialized memory)", option="--no-initialization")
    tie_embeddings_and_output_weights: bool = flag(False, "use the embedding as the output head (default: untied, "
        "as in docs/model.md; gpt: tied, as in Megatron-LM)", exclusive="tying")
    untie_embeddings_and_output_weights: bool = flag(False, "a separate output head: gpt's (tied without it, as in "
        "Megatron-LM); already the other families' default", exclusive="tying")
    attention_dropout: float = flag(0.0, "dropout on the attention probabilities, all families (default 0: no "
        "dropout, as in the paper; Megatron-LM's is 0.1)")
    hidden_dropout: float = flag(0.0, "dropout on the embeddings and on each sub-block output before its residual "
        "add, GPT+ and GPT only (default 0: no dropout, as in the paper; Megatron-LM's is 0.1)")
    recompute_granularity: Optional[str] = flag(None, "recompute activations in the backward pass: whole layers "
        "(full, with --recompute-method and --recompute-num-layers) or the parts named by --recompute-modules "
        "(selective); docs/guide.md, Activation recompute", choices=("full", "selective"))
    recompute_method: str = flag("uniform", "full recompute only", choices=("uniform", "block"))
    recompute_num_layers: int = flag(1, "full recompute only")
    recompute_modules: Optional[tuple[str, ...]] = flag(None, "what --recompute-granularity selective recomputes "
        "(default: core_attn, as Megatron-LM): core_attn, mlp, layernorm (GPT+'s pre-norms), qk_norm (the "
        "normalization of q and k), residual_update (anGPT's and nGPT's normalized residual update)",
        choices=RECOMPUTE_MODULES)
    recompute_activations: bool = flag(False, "Megatron-LM's alias of --recompute-granularity selective")
    distribute_saved_activations: bool = flag(False, "with --recompute-granularity full and "
        "--tensor-model-parallel-size > 1 (not --sequence-parallel): each recomputed chunk keeps 1 / TP of its input "
        "per tensor-parallel rank and gathers it for the recompute (megatron-core's CheckpointFunction)")


@dataclass(frozen=True)
class ArchitectureSection:
    """Megatron-LM's architecture flags of a dense GPT, with its names, meanings and defaults: what `--model-family
    gpt` builds (megatron-core's GPTModel as Megatron-LM's pretrain_gpt.py builds it; docs/model.md, GPT). The
    other families fix their own architecture: with them Megatron-LM's default and the family's own value are
    accepted, any other value is refused (angpt.config.validation, PAPER_ARCHITECTURE). The two that name a kind
    (--normalization, --position-embedding-type) default to None, so that a value given is told from one not: gpt
    then takes Megatron-LM's (choices.GPT_DEFAULTS; validation derives it), the other families their own."""

    GROUP: ClassVar[str] = "architecture of --model-family gpt (Megatron-LM's flags; docs/model.md, GPT)"

    normalization: Optional[str] = flag(None, "the pre-norms, the final norm and --qk-layernorm (default: LayerNorm, "
        "Megatron-LM's; RMSNorm in GPT+)", choices=NORMALIZATIONS)
    layernorm_zero_centered_gamma: bool = flag(False, "each norm's gain as 1 + w, w starting at 0",
                                               option="--apply-layernorm-1p")
    add_bias_linear: bool = flag(True, "no biases in the linear layers", option="--disable-bias-linear")
    add_qkv_bias: bool = flag(False, "a bias in the QKV projection (always there while the linear layers have "
        "biases)")
    qk_layernorm: bool = flag(False, "--normalization on each head's queries and keys")
    qk_l2_norm: bool = flag(False, "Llama 4's L2 norm of queries and keys (Megatron-LM builds it with "
        "--transformer-impl transformer_engine only)")
    apply_query_key_layer_scaling: bool = flag(False, "scale the attention scores down by the layer number before "
        "the softmax and back up inside it (then in fp32)")
    attention_softmax_in_fp32: bool = flag(False, "the unfused attention's softmax in fp32 under --bf16 or --fp16")
    position_embedding_type: Optional[str] = flag(None, "learned_absolute: an embedding of each position up to "
        "--max-position-embeddings; rope: rotary embeddings; none (default: learned_absolute, Megatron-LM's; rope in "
        "the other families)", choices=POSITION_EMBEDDING_TYPES)
    use_rotary_position_embeddings: bool = flag(False, "Megatron-LM's deprecated spelling of "
        "--position-embedding-type rope")
    rotary_percent: float = flag(1.0, "with rope: the fraction of each head's channels rotated")
    rotary_interleaved: bool = flag(False, "with rope: rotate pairs of neighbouring channels, not the two halves")
    use_rope_scaling: bool = flag(False, "with rope: Llama 3.x's scaling of the frequencies (megatron-core's "
        "factor, 8)")
    swiglu: bool = flag(False, "a SwiGLU MLP (gated, SiLU) instead of GELU", exclusive="activation")
    squared_relu: bool = flag(False, "squared ReLU instead of GELU", exclusive="activation")
    quick_geglu: bool = flag(False, "a gated MLP with quick GELU (x sigmoid(1.702 x)) instead of GELU",
                             exclusive="activation")
    group_query_attention: bool = flag(False, "grouped-query attention with --num-query-groups (default 1)")
    embedding_init_method_std: Optional[float] = flag(None, "the standard deviation of the embeddings' normal "
        "initialization (default --init-method-std)")
    glu_linear_offset: float = flag(0.0, "a gated MLP (--swiglu, --quick-geglu) multiplies by its linear half plus "
        "this")
    activation_func_clamp_value: Optional[float] = flag(None, "a gated MLP clamps its gate's input to at most this "
        "and its linear half to [-this, this]")
    no_rope_freq: Optional[Any] = flag(None, "with rope: the layers without RoPE: N (every N-th layer) or a list "
        "expression of one 0 or 1 per layer, 1 without (\"([0]*3+[1])*2\")", type=no_rope_freq_type,
        metavar="N_OR_PATTERN")
    mtp_num_layers: Optional[int] = flag(None, "multi-token prediction (DeepSeek-V3's, megatron-core's "
        "MultiTokenPredictionBlock): this many MTP layers after the last stage's decoder, the k-th predicting the "
        "token k + 1 ahead; their mean loss times --mtp-loss-scaling-factor is added to the LM loss's gradients and "
        "logged as mtp_k loss (default: none)")
    mtp_loss_scaling_factor: float = flag(0.1, "the weight of the MTP layers' mean loss")
    mtp_standalone: bool = flag(False, "megatron-core's field, which a --pipeline-model-parallel-layout sets "
        "(m on a stage before the last): the pipeline's sends exchange their shapes first")


@dataclass(frozen=True)
class SwitchesSection:
    """anGPT's ablation switches; nGPT reads three of them, GPT+ none (angpt.config.validation)."""

    GROUP: ClassVar[str] = "anGPT switches (docs/model.md, Families and switches)"

    angpt_post_norm: str = flag("l2", choices=POST_NORMS)
    angpt_nu_p: str = flag("one", choices=NU_P_READINGS)
    angpt_alpha_init: Optional[float] = flag(None, "default 0.01 (anGPT), 0.05 (nGPT)")
    angpt_constant_factors: str = flag("analytic", choices=FACTOR_MODES)
    angpt_constant_factor_multiplier: float = flag(1.0)
    angpt_nu_alpha: str = flag("analytic", choices=FACTOR_MODES)
    angpt_nu_alpha_multiplier: float = flag(1.0)
    angpt_no_nu_alpha_grad: bool = flag(False, "treat nu(alpha) as a constant")
    angpt_residual: str = flag("lerp", choices=RESIDUALS)


@dataclass(frozen=True)
class ParallelSection:
    """The parallel layout, data-parallel gradient reduction and the process groups' timeouts."""

    GROUP: ClassVar[str] = "parallelism"

    tensor_model_parallel_size: int = flag(1)
    pipeline_model_parallel_size: int = flag(1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(None)
    decoder_first_pipeline_num_layers: Optional[int] = flag(None, "layers of the first pipeline stage (the rest "
        "split evenly over the others; angpt.config.pipeline_split)")
    decoder_last_pipeline_num_layers: Optional[int] = flag(None, "layers of the last pipeline stage")
    account_for_embedding_in_pipeline_split: bool = flag(False, "count the embedding as a layer of the first stage "
        "when splitting the layers")
    account_for_loss_in_pipeline_split: bool = flag(False, "count the output layer and loss as a layer of the last "
        "stage")
    pipeline_model_parallel_layout: Optional[str] = flag(None, "each stage's layers, as Megatron-LM writes them: E "
        "the embedding, t a layer, m an MTP layer (gpt), L the loss, | between stages (\"Et|tt|ttL\"; (tt|)*3 "
        "repeats); more stages than --pipeline-model-parallel-size are virtual stages, stage i on rank i mod PP")
    sequence_parallel: bool = flag(False, switch=True)
    clone_scatter_output_in_embedding: bool = flag(True, "with --sequence-parallel: keep the embeddings' scattered "
        "output a view of the whole one (megatron-core clones it by default, so that the whole one can be freed)",
        option="--no-clone-scatter-output-in-embedding")
    context_parallel_size: int = flag(1, "split each sequence over this many ranks (Megatron-LM's 2 x CP chunks, "
        "rank i holding chunks i and 2 CP - 1 - i); world size = TP x PP x CP x DP")
    cp_comm_type: Optional[tuple[str, ...]] = flag(None, "how attention exchanges keys and values under context "
        "parallelism (one value for all layers): all_gather on --transformer-impl local (the only one built "
        "there, its default); p2p (default), all_gather, a2a or a2a+p2p (with --hierarchical-context-parallel-sizes) "
        "on Transformer Engine", choices=CP_COMM_TYPES)
    hierarchical_context_parallel_sizes: Optional[tuple[int, ...]] = flag(None, "with --cp-comm-type a2a+p2p: the "
        "context-parallel group as nested groups of these sizes (their product: --context-parallel-size), a2a "
        "within the first, p2p across the others (Transformer Engine)")
    expert_tensor_parallel_size: Optional[int] = flag(None, "the tensor-parallel size of megatron-core's expert "
        "groups (Megatron-LM's; default: --tensor-model-parallel-size): the families are dense, without experts, so "
        "it builds those groups and nothing uses them; the world size must be divisible by it x "
        "--pipeline-model-parallel-size, as megatron-core asserts")
    use_tp_pp_dp_mapping: bool = flag(False, "order the ranks tensor, context, pipeline, then data parallel "
        "(megatron-core's tp-cp-ep-pp-dp): a model replica's pipeline stages on neighbouring ranks, its "
        "data-parallel peers far apart (default: tp-cp-ep-dp-pp)")
    use_distributed_optimizer: bool = flag(False, switch=True)
    num_distributed_optimizer_instances: int = flag(1, "with --use-distributed-optimizer: split the data-parallel "
        "(x context-parallel) ranks into this many groups, each sharding the optimizer over its own ranks; gradients "
        "are reduce-scattered within a group, then all-reduced between the groups (megatron-core's partial "
        "distributed optimizer)")
    use_torch_fsdp2: bool = flag(False, "shard every weight, its gradient and Adam's state over the data-parallel "
        "ranks (PyTorch's FSDP2, megatron-core's TorchFullyShardedDataParallel): each layer's weights gathered for its "
        "forward and backward, the gradients reduce-scattered at the weights' dtype (not with pipeline "
        "parallelism, the distributed optimizer, fp16 or tied embeddings)")
    torch_fsdp2_reshard_after_forward: bool = flag(True, "with --use-torch-fsdp2: keep each layer's gathered weights "
        "from its forward to its backward (more memory, one all-gather fewer)",
        option="--torch-fsdp2-no-reshard-after-forward")
    use_megatron_fsdp: bool = flag(False, "shard Adam's state, and by --data-parallel-sharding-strategy the gradients "
        "and weights, over the data-parallel ranks with megatron-core's Megatron-FSDP (Megatron-LM's; with "
        "--use-distributed-optimizer and --ckpt-format fsdp_dtensor)")
    data_parallel_sharding_strategy: str = flag("no_shard", "with --use-megatron-fsdp, what is sharded: optim (Adam's "
        "state and fp32 weights), optim_grads (and the gradients) or optim_grads_params (and the weights, gathered for "
        "each layer's forward and backward) or nothing (no_shard, Megatron-LM's default: gradients all-reduced)",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    gradient_reduce_div_fusion: bool = flag(True, "with --use-megatron-fsdp: divide the gradients by the "
        "data-parallel size in their reduction (NCCL's PREMUL_SUM; without CUDA, gloo's sum of the premultiplied "
        "gradients)", option="--no-gradient-reduce-div-fusion")
    overlap_grad_reduce: bool = flag(False, switch=True)
    overlap_param_gather: bool = flag(False, switch=True)
    overlap_param_gather_with_optimizer_step: bool = flag(False, "with --overlap-param-gather and the interleaved "
        "schedule: the first model chunk's own distributed optimizer starts that chunk's parameter all-gather as soon "
        "as it has stepped, while the others step (megatron-core's; every chunk in one bucket group; --ckpt-format "
        "torch, as in Megatron-LM)")
    enable_gloo_process_groups: bool = flag(True, "build no gloo process groups beside the NCCL ones (megatron-core "
        "builds them for the distributed optimizer's legacy checkpoints, which angpt does not write; on a machine "
        "without CUDA every group is gloo)", option="--disable-gloo-process-groups")
    fake_process_group: bool = flag(False, "this process alone stands for rank $RANK of $WORLD_SIZE, every "
        "collective skipped (torch's fake process group), to see one rank's memory and step time at a layout without "
        "the others: its losses and norms are its own; no NaN checks and no gloo groups (as Megatron-LM sets them), "
        "no --save")
    create_all_gather_group: bool = flag(False, "a data-parallel (x context-parallel) process group of its own for "
        "Megatron-FSDP's weight all-gathers, so that they overlap its gradient reduce-scatters (megatron-core's; "
        "without --use-megatron-fsdp nothing uses it)")
    distributed_timeout_minutes: float = flag(10, "how long a collective waits for the other ranks before the job "
        "fails (every process group)")
    distributed_timeout_seconds_after_init: Optional[int] = flag(None, "from the end of this run's first iteration "
        "(which builds and warms up everything), how long a collective waits instead (every process group; "
        "megatron-core's update_pg_timeout)")
    hang_timeout_minutes: Optional[float] = flag(None, "angpt's: when one iteration (its step, evaluation and "
        "save) runs longer than this, every thread's Python stack of each rank is written to its log, again each "
        "time it passes, so that a hang shows where each rank waits before --distributed-timeout-minutes ends the "
        "job (default: off)")
    flight_recorder_dump_path: Optional[str] = flag(None, "NCCL's flight recorder (CUDA): the last collectives of "
        "each rank, written when a collective times out to this file prefix, one file per rank (a directory: "
        "<dir>/_dump_<rank>), for `torchfrtrace`; sets torch's TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_* variables "
        "before the process group is created, as Megatron-LM does (ones already in the environment win) (default: "
        "off)")
    flight_recorder_trace_buffer_size: int = flag(2000, "with --flight-recorder-dump-path: the collectives the "
        "recorder keeps per rank (TORCH_NCCL_TRACE_BUFFER_SIZE)")
    average_in_collective: bool = flag(False, "average the gradients in the data-parallel collective itself "
        "instead of dividing them by the data-parallel size before a sum", option="--ddp-average-in-collective")
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(None, "the interleaved schedule's virtual stages "
        "on each pipeline rank (or give --num-layers-per-virtual-pipeline-stage)")
    microbatch_group_size_per_vp_stage: Optional[int] = flag(None, "the interleaved schedule: micro-batches run "
        "in a row on each virtual stage (default: --pipeline-model-parallel-size)",
        option="--microbatch-group-size-per-virtual-pipeline-stage")
    overlap_p2p_comm: bool = flag(True, "the interleaved schedule: exchange activations between pipeline stages "
        "one send or receive at a time, waited for when needed, instead of overlapped with the computation "
        "(Megatron-LM's default overlaps; batched exchanges then, which need --pipeline-model-parallel-size > 2)",
        option="--no-overlap-p2p-communication")
    overlap_p2p_comm_warmup_flush: bool = flag(False, "the interleaved schedule: overlap the exchanges of the "
        "warm-up and flush phases too (megatron-core's tunable overlap)",
        option="--overlap-p2p-communication-warmup-flush")
    defer_embedding_wgrad_compute: bool = flag(False, "with pipeline parallelism: the output layer's weight "
        "gradients (the embedding's, when tied) are computed in the pipeline's flush, after the last micro-batch's "
        "backward, instead of in each backward (megatron-core's; it turns on gradient-accumulation fusion, apex's "
        "kernel where installed, torch's addmm otherwise)")
    wgrad_deferral_limit: int = flag(0, "with --defer-embedding-wgrad-compute: defer at most this many "
        "micro-batches' output-layer weight gradients, compute the later ones at once (0: all)")
    ddp_bucket_size: Optional[int] = flag(None, "elements per gradient bucket of data-parallel reduction (default: "
        "megatron-core's, at least 40M and 1M per data-parallel rank)")
    ddp_num_buckets: Optional[int] = flag(None, "with --overlap-grad-reduce: gradient buckets of about this rank's "
        "parameters / N elements each (Megatron-LM's; instead of --ddp-bucket-size)")
    pad_buckets_for_high_nccl_busbw: bool = flag(False, "with --use-distributed-optimizer: pad each gradient bucket "
        "to a multiple of 2^16 elements (and of the data-parallel size), for NCCL's bus bandwidth at large "
        "data-parallel sizes", option="--ddp-pad-buckets-for-high-nccl-busbw")
    reduce_scatter_with_fp32_accumulation: bool = flag(False, "with --use-distributed-optimizer: reduce-scatter the "
        "gradients as an all-to-all of their own dtype, summed locally in fp32 (megatron-core's)",
        option="--ddp-reduce-scatter-with-fp32-accumulation")
    align_grad_reduce: bool = flag(True, "with --overlap-grad-reduce and pipeline parallelism: each stage starts its "
        "gradient reduction when its own backward is done, instead of all stages at once in the pipeline's flush",
        option="--no-align-grad-reduce")
    align_param_gather: bool = flag(True, "with --overlap-param-gather and the interleaved schedule: each stage "
        "all-gathers a model chunk's weights as its forward needs them, instead of all stages at once",
        option="--no-align-param-gather")
    world_size: int = derived(1)  # the processes of the job (of --dry-run's WORLD_SIZE)
    data_parallel_size: int = derived(1)  # world size / (TP x PP x CP)
    # Of --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank; None for one, as
    # Megatron-LM (the interleaved schedule needs two or more).
    virtual_pipeline_stages: Optional[int] = derived(None)
    # --sequence-parallel given with TP 1, where Megatron-LM turns it off (and a log line says so).
    sequence_parallel_disabled: bool = derived(False)
    # --context-parallel-size without --cp-comm-type on --transformer-impl local, where all_gather stands in for
    # Megatron-LM's default p2p (and a log line says so).
    cp_comm_type_all_gather_default: bool = derived(False)


@dataclass(frozen=True)
class TrainingSection:
    """The batch of each step, the length of training and the seed."""

    GROUP: ClassVar[str] = "batch and length of training"

    micro_batch_size: int = flag(4)
    global_batch_size: int = flag(8)
    train_iters: Optional[int] = flag(None, "required, or --train-samples", exclusive="length")
    train_samples: Optional[int] = flag(None, "train for this many samples (as Megatron-LM: whole global batches, "
        "the rest left out); required, or --train-iters. The lr schedule then counts samples: --lr-decay-samples, "
        "--lr-warmup-samples, --lr-wsd-decay-samples", exclusive="length")
    rampup_batch_size: Optional[tuple[int, ...]] = flag(None, "grow the global batch from START by INCREMENT up to "
        "--global-batch-size over the first SAMPLES samples, in equal steps (Megatron-LM's ramp-up, "
        "megatron-core's calculator); needs --train-samples", nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    decrease_batch_size_if_needed: bool = flag(False, "when --micro-batch-size x data-parallel size does not divide "
        "the global batch (of a ramp-up, or --global-batch-size), take the largest multiple of it below instead of "
        "refusing: the samples left out are counted as skipped (megatron-core's calculator)")
    iterations_to_skip: Optional[tuple[int, ...]] = flag(None, "the iterations, counted from 0 as Megatron-LM counts "
        "them (the one the log then numbers N + 1), whose global batch is read and left out: no forward, backward "
        "or optimizer step")
    phase_transition_iterations: Optional[str] = flag(None, "comma-separated iterations that end a phase of "
        "training: the run saves and exits there, and each phase reads the training data of its own run "
        "(--data-path may change between phases) from its start; needs --train-samples, a constant batch")
    seed: int = flag(1234)
    train_sync_interval: Optional[int] = flag(None, "wait for the GPU every this many steps, so that the CPU does "
        "not run far ahead of it (without CUDA there is nothing to wait for)")
    deterministic_mode: bool = flag(False, "bitwise reproducible steps on GPUs, as Megatron-LM: torch's "
        "deterministic algorithms, megatron-core's deterministic embedding; needs NCCL_ALGO (Tree, Ring, "
        "CollnetDirect, CollnetChain or ^NVLS) with CUDA, and turns off the fused cross-entropy's default")
    batch_invariant_mode: bool = flag(False, "megatron-core's batch-invariant kernels (Triton's, CUDA only) for "
        "aten's mm, addmm, _log_softmax and mean.dim: each sample's results do not depend on the batch around it; "
        "slower. Needs --attention-backend flash (megatron-core's check); --model-family gpt only (the other "
        "families normalize with their own reductions, which those kernels do not replace)")
    # --phase-transition-iterations as sorted iterations (Megatron-LM's validate_args reads them so).
    phase_transitions: tuple[int, ...] = derived(())


@dataclass(frozen=True)
class OptimizerSection:
    """Adam(W), its learning-rate schedule and the loss's averaging; unset values are the family's recipe."""

    GROUP: ClassVar[str] = "learning rate and optimizer (defaults: the family's recipe, docs/model.md)"

    lr: float = flag(0.003)
    min_lr: Optional[float] = flag(None, "default: the family's (0.1 lr; 0 for nGPT)")
    lr_decay_style: str = flag("cosine", choices=LR_DECAY_STYLES)
    lr_decay_iters: Optional[int] = flag(None, "default: --train-iters")
    lr_warmup_iters: Optional[int] = flag(None, "default: the family's (none; 1%% for GPT+)", exclusive="warmup")
    lr_warmup_fraction: Optional[float] = flag(None, "warm-up as a fraction of --lr-decay-iters", exclusive="warmup")
    lr_warmup_init: float = flag(0.0, "lr at the start of warm-up")
    lr_wsd_decay_iters: Optional[int] = flag(None, "length of WSD's final decay")
    lr_decay_samples: Optional[int] = flag(None, "with --train-samples: decay over this many samples (default: "
        "--train-samples)")
    lr_warmup_samples: Optional[int] = flag(None, "with --train-samples: warm up over this many samples (default: "
        "the family's fraction of the decay)")
    lr_wsd_decay_samples: Optional[int] = flag(None, "with --train-samples: length of WSD's final decay")
    lr_wsd_decay_style: str = flag("exponential", choices=WSD_DECAY_STYLES)
    weight_decay: Optional[float] = flag(None, "default: the family's (0; 0.1 for GPT+)")
    start_weight_decay: Optional[float] = flag(None, "with --weight-decay-incr-style linear or cosine: the weight "
        "decay at the first step")
    end_weight_decay: Optional[float] = flag(None, "with --weight-decay-incr-style linear or cosine: the weight decay "
        "at the last step (--train-iters or --train-samples)")
    weight_decay_incr_style: str = flag("constant", "from --start-weight-decay to --end-weight-decay over the training "
        "(constant: --weight-decay throughout)", choices=("constant", "linear", "cosine"))
    decoupled_lr: Optional[float] = flag(None, "max lr of the input and output layers (the embedding and the "
        "output head), decoupled from --lr; the same schedule")
    decoupled_min_lr: Optional[float] = flag(None, "min lr of the input and output layers (with --decoupled-lr; "
        "default --min-lr's)")
    override_opt_param_scheduler: bool = flag(False, "on resuming, take the learning-rate schedule of these flags "
        "(--lr, --min-lr, warm-up and decay lengths and styles) instead of the checkpoint's")
    no_weight_decay_cond_type: Optional[str] = flag(None, "Megatron-LM's deprecated spelling of "
        "--apply-wd-to-qk-layernorm (its one value)", choices=("apply_wd_to_qk_layernorm",))
    apply_wd_to_qk_layernorm: bool = flag(False, "decay the q and k norms' gains too (megatron-core's parameter "
        "groups; other norm gains, biases and scales stay undecayed)")
    calculate_per_token_loss: bool = flag(False, "the loss and its gradients as the mean over all the tokens of "
        "the global batch, not the mean of each micro-batch's mean (they differ when micro-batches count different "
        "tokens, e.g. with --eod-mask-loss)")
    clip_grad: float = flag(1.0)
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.95)
    adam_eps: float = flag(1e-08)
    dump_param_to_param_group_map: Optional[str] = flag(None, "write which optimizer parameter group each weight is "
        "in (megatron-core's map, a torch distributed checkpoint of {name: group}) to this directory")


@dataclass(frozen=True)
class PrecisionSection:
    """The dtypes, the loss scaling of fp16, FP8, the layers' implementation and the fused cross-entropy."""

    GROUP: ClassVar[str] = "precision"

    bf16: bool = flag(False, "bf16 weights and activations, fp32 main weights in the optimizer (learnable scales "
        "stay fp32)", switch=True)
    fp16: bool = flag(False, "fp16 weights and activations, fp32 main weights in the optimizer (learnable scales "
        "stay fp32), the loss scaled (dynamically unless --loss-scale); a step whose gradients overflow is skipped "
        "and the scale lowered")
    loss_scale: Optional[float] = flag(None, "with --fp16: a constant loss scale (default: dynamic)")
    initial_loss_scale: float = flag(4294967296.0, "with --fp16: the dynamic scale's start")
    min_loss_scale: float = flag(1.0, "with --fp16: the dynamic scale's floor")
    loss_scale_window: int = flag(1000, "with --fp16: steps without overflow before the dynamic scale doubles")
    hysteresis: int = flag(2, "with --fp16: overflows in a row before the dynamic scale halves")
    grad_reduce_in_bf16: bool = flag(False, "with --bf16: accumulate and reduce gradients in bf16 (default fp32, "
        "as Megatron-LM's)")
    fp32_residual_connection: bool = flag(False, "with --bf16 or --fp16: the embeddings' output in fp32 "
        "(megatron-core 0.16.1's meaning: the first residual add casts it to the sub-block output's dtype); GPT+ and "
        "GPT (not on gpt's torch norms)")
    disable_bf16_reduced_precision_matmul: bool = flag(False, "with --bf16: cuBLAS's bf16 GEMMs reduce in fp32 only "
        "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction off, as megatron-core sets it)")
    transformer_impl: str = flag("local", "megatron-core's own layers (default; CPU and GPU) or NVIDIA Transformer "
        "Engine's (GPU; needed for FP8)", choices=TRANSFORMER_IMPLS)
    attention_backend: str = flag("auto", "core attention: auto = FlashAttention on GPUs (torch's kernels with the "
        "local implementation, TE's with Transformer Engine) and megatron's unfused attention on CPU; flash forces "
        "the fused kernels, unfused/local megatron's path", choices=("auto", "flash", "fused", "unfused", "local"))
    cross_entropy_loss_fusion: Optional[bool] = flag(None, "megatron-core's fused cross-entropy (compiled kernels "
        "over the logits). Default: on with --bf16 on a GPU, where it gives the unfused loss and gradients; off on "
        "CPU, where compiling it costs 4-30 s per process for little gain. Needs --bf16: it rounds the logits' "
        "gradient to bf16, which the bf16 logits are anyway", switch=True)
    cross_entropy_fusion_impl: str = flag("native", "the fused cross-entropy's implementation: megatron-core's own "
        "(torch.compile) or Transformer Engine's", choices=("native", "te"))
    fp8_format: Optional[str] = flag(None, "FP8 GEMMs in the transformer layers (Transformer Engine): e4m3 "
        "everywhere, or hybrid (e5m2 for gradients); docs/fp8.md", choices=FP8_FORMATS)
    fp8_recipe: Optional[str] = flag(None, "scaling recipe (default delayed); mxfp8 needs Blackwell (compute "
        "capability 10) and a Transformer Engine that has it", choices=FP8_RECIPES)
    fp8_margin: Optional[int] = flag(None, "delayed scaling: scale margin, a power of 2 (default 0)")
    fp8_amax_history_len: Optional[int] = flag(None, "delayed scaling: amax history window (default 1)")
    first_last_layers_bf16: bool = flag(False, "with --fp8-format: keep the first and last transformer layers' GEMMs "
        "in BF16 (megatron-core's choice per layer; not with --fp8-recipe delayed)")
    num_layers_at_start_in_bf16: int = flag(1, "with --first-last-layers-bf16: the layers kept in BF16 at the start")
    num_layers_at_end_in_bf16: int = flag(1, "with --first-last-layers-bf16: the layers kept in BF16 at the end")
    fp8_amax_compute_algo: Optional[str] = flag(None, "delayed scaling: amax of the window (max) or the latest "
        "(most_recent, default)", choices=FP8_AMAX_ALGOS)
    fp8_wgrad: bool = flag(True, "with --fp8-format: the weight-gradient GEMMs in BF16, not FP8 (megatron-core's "
        "override in Transformer Engine's recipe)", option="--no-fp8-wgrad")


@dataclass(frozen=True)
class FusionSection:
    """Fused kernels and CUDA graphs; None: on with a GPU, off on the CPU."""

    GROUP: ClassVar[str] = "fusions and CUDA graphs (GPU)"

    apply_rope_fusion: Optional[bool] = flag(None, "RoPE as one kernel forward and one backward (Transformer "
        "Engine's where installed, else a torch.compile'd one; cos and sin inside it). Default: on with a GPU, off "
        "on CPU (compiling costs seconds per process there)", option="--rope-fusion", switch=True)
    bias_swiglu_fusion: Optional[bool] = flag(None, "GPT+'s SwiGLU (GPT's with --swiglu) as megatron-core's compiled "
        "kernels (anGPT and nGPT always use their own nu-scaled SwiGLU kernel). Default: on with a GPU, off on CPU",
        switch=True)
    bias_gelu_fusion: Optional[bool] = flag(None, "GPT's GELU or quick GeGLU with its bias as megatron-core's "
        "compiled kernels (GELU needs the biases; no fusion of --squared-relu). Default: on with a GPU where "
        "megatron-core fuses the activation, off on CPU", switch=True)
    cuda_graph_impl: str = flag("none", "local: capture each transformer layer's forward and backward as CUDA "
        "graphs (megatron-core's own implementation; no Transformer Engine needed) after the first step, and "
        "replay them: for launch-bound steps (small micro-batches). Needs a GPU. NOT VERIFIED: its gradients were "
        "wrong on an H200, the fix has not run on a GPU since (docs/gpu.md); for speed measurements",
        choices=("none", "local"))
    cuda_graph_warmup_steps: int = flag(3, "eager runs of each layer inside the capture, before it is recorded "
        "(with --cuda-graph-scope full_iteration: eager steps before the iteration is captured)")
    cuda_graph_scope: Optional[tuple[str, ...]] = flag(None, "with --cuda-graph-impl local (megatron-core's "
        "meaning): full_iteration captures each step's whole forward and backward over its micro-batches as one "
        "graph (megatron-core's FullCudaGraphWrapper; the optimizer runs eagerly; needs "
        "--no-check-for-nan-in-loss-and-grad); attn or mlp graph each whole layer, as no scope does (megatron-core's "
        "local graphs do not split a layer); mamba graphs Mamba layers only, of which these models have none; the "
        "moe scopes need MoE layers; full is Megatron-LM's deprecated name of no scope. Without --cuda-graph-impl "
        "it changes nothing, as in Megatron-LM", nargs="+", choices=CUDA_GRAPH_SCOPES)


@dataclass(frozen=True)
class DataSection:
    """Megatron-LM's data and tokenizer flags."""

    GROUP: ClassVar[str] = "data"

    data_path: Optional[tuple[str, ...]] = flag(None, "PREFIX ... (several are blended by their "
        "sizes), or W1 PREFIX1 W2 PREFIX2 ... (blended by weight), as Megatron-LM reads it")
    split: str = flag("969,30,1", "train,valid,test weights of --data-path")
    train_data_path: Optional[tuple[str, ...]] = flag(None, "the training split's blend, as --data-path")
    valid_data_path: Optional[tuple[str, ...]] = flag(None, "the validation split's blend, as --data-path")
    test_data_path: Optional[tuple[str, ...]] = flag(None, "the test split's blend, as --data-path")
    data_cache_path: Optional[str] = flag(None, "where GPTDataset caches its indices")
    object_storage_cache_path: Optional[str] = flag(None, "the local directory where megatron-core keeps the .idx of "
        "each dataset prefix in object storage (s3://bucket/key, or msc://profile/key with multistorageclient), whose "
        ".bin it reads by ranged GETs; needed with such a prefix")
    mock_data: bool = flag(False, "megatron-core's synthetic sequences, over the vocabulary of --tokenizer-type "
        "where given, else of --vocab-size")
    num_workers: int = flag(0, "DataLoader worker processes per rank that read the training samples ahead of the "
        "step (0: read in the training process, at each step; Megatron-LM's default is 2); evaluations read in the "
        "training process")
    eod_mask_loss: bool = flag(False, "leave the end-of-document tokens out of the loss (megatron-core's "
        "GPTDataset masks them)")
    allow_ambiguous_pad_tokens: bool = flag(False, "mask the tokenizer's pad id also where it is another special "
        "token's (the end of document): megatron-core's GPTDataset leaves the labels equal to the pad id out of the "
        "loss, but, without this flag, not when the pad id is ambiguous")
    reset_position_ids: bool = flag(False, "restart the position ids after each end-of-document token; RoPE "
        "rotates each token by its position id")
    reset_attention_mask: bool = flag(False, "attend within each document only (a [seq, seq] mask per sample, from "
        "megatron-core's GPTDataset; not with --transformer-impl transformer_engine)")
    mmap_bin_files: bool = flag(True, "read the .bin files by file reads rather than through a memory map",
        option="--no-mmap-bin-files")
    vocab_size: Optional[int] = flag(None, "vocabulary of --mock-data (without --tokenizer-type), NullTokenizer's ids "
        "(its end-of-document id comes after them), or TikTokenizer's with a Megatron-LM .json vocabulary (default "
        "131072, as Megatron-LM); with a dataset's .json, it must be the vocab_size it records")
    tokenizer_type: Optional[str] = flag(None, "HuggingFaceTokenizer, TikTokenizer, GPT2BPETokenizer, "
        "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, BertWordPieceLowerCase, "
        "BertWordPieceCase (with --vocab-file) or NullTokenizer (with --vocab-size)")
    tokenizer_model: Optional[str] = flag(None, "tokenizer.json or its directory, a Megatron-LM tiktoken .json "
        "vocabulary or a .tiktoken ranks file (TikTokenizer), or a SentencePiece .model")
    tiktoken_pattern: Optional[str] = flag(None, "TikTokenizer's split pattern with a Megatron-LM .json vocabulary "
        "(v2 when not given, as Megatron-LM)", choices=TIKTOKEN_PATTERNS)
    tiktoken_num_special_tokens: int = flag(TIKTOKEN_NUM_SPECIAL_TOKENS, "the special tokens before the ranks of "
        "TikTokenizer's Megatron-LM .json vocabulary")
    tokenizer_special_tokens: Optional[tuple[str, ...]] = flag(None, "special tokens, as megatron-core's tokenizer "
        "library takes them: HuggingFaceTokenizer and GPT2BPETokenizer (vocab/merges) add each as a special token "
        "(matched whole in the text; the vocabulary grows by those it lacks); TikTokenizer's Megatron-LM .json "
        "vocabulary puts them first, in place of <unk> <s> </s> <mask> <pad> <cls> <sep> (which they must hold)")
    tiktoken_special_tokens: Optional[tuple[str, ...]] = flag(None, "Megatron-LM's deprecated spelling of "
        "--tokenizer-special-tokens, read when that is not given")
    tokenizer_hf_include_special_tokens: bool = flag(False, "HuggingFaceTokenizer and GPT2BPETokenizer: encode with "
        "the tokenizer's post-processor too (transformers' tokenizer(text), e.g. <s> before each document)")
    tokenizer_metadata: Optional[str] = flag(None, "the JSON file of megatron-core's tokenizer metadata that "
        "Megatron-LM reads in place of the tokenizer type's library; checked to name that library")
    vocab_file: Optional[str] = flag(None, "GPT2BPETokenizer's vocab.json")
    merge_file: Optional[str] = flag(None, "GPT2BPETokenizer's merges.txt")
    make_vocab_size_divisible_by: int = flag(128, "pad the vocabulary to a multiple of this times the "
        "tensor-parallel size")
    data_args_path: Optional[str] = flag(None, "a file holding --data-path's values, separated by white space (for "
        "a blend too long for the command line)")
    per_split_data_args_path: Optional[str] = flag(None, "a JSON file of the keys train, valid and test, each holding "
        "the values of --train-data-path, --valid-data-path or --test-data-path (a list, a string separated by "
        "white space, or null)")
    per_dataset_sequences_path: Optional[str] = flag(None, "a JSON file of each dataset prefix's [sequences, "
        "documents], as its .idx header counts them (Megatron-LM's tools/build_sequences_per_dataset.py writes it): "
        "megatron-core then reads no .idx header for them")
    dataloader_fast_cache_load: bool = flag(False, "build the datasets from the index caches in --data-cache-path "
        "without checking them or synchronizing the ranks (every cache must be built; per-split paths only)")
    dataloader_defer_npy_index_mmap: bool = flag(False, "map the index caches in --data-cache-path into memory at "
        "their first read, not when the datasets are built (every cache must be built)")
    num_dataset_builder_threads: int = flag(1, "threads that build a blend's datasets on each rank")
    fim_data: bool = flag(False, "fill-in-the-middle training data: Megatron-LM's GPTFIMDataset (vendored, "
        "angpt/data/fim_dataset.py) decodes each document of a sample to text, cuts it at two random places and "
        "reorders the pieces around the FIM tokens, which must be tokens of the datasets' tokenizer")
    fim_rate: float = flag(0.5, "with --fim-data: the probability that a document (or, with --fim-split-sample, a "
        "sample's document) is reordered")
    fim_spm_rate: float = flag(0.5, "with --fim-data: the probability that a reordered document is in SPM order "
        "(prefix and suffix tokens, suffix, middle token, prefix, middle) rather than PSM (prefix token, prefix, "
        "suffix token, suffix, middle token, middle)")
    fim_split_sample: Optional[str] = flag(None, "with --fim-data: a token that splits documents into fragments "
        "(e.g. files of a repository), each reordered with --fim-fragment-rate")
    fim_fragment_rate: Optional[float] = flag(None, "with --fim-split-sample: the probability that a fragment is "
        "reordered")
    fim_no_prefix: Optional[str] = flag(None, "with --fim-data: documents and fragments whose text starts with this "
        "are not reordered")
    fim_prefix_token: str = flag("<fim_prefix>", "with --fim-data: the token before the prefix")
    fim_middle_token: str = flag("<fim_middle>", "with --fim-data: the token before the middle")
    fim_suffix_token: str = flag("<fim_suffix>", "with --fim-data: the token before the suffix")
    fim_pad_token: str = flag("<fim_pad>", "with --fim-data: pads a sample that the reordering shortened")
    fim_eod_token: str = flag("<|endoftext|>", "with --fim-data: the token between the documents that are "
        "reordered one by one")
    mid_level_dataset_surplus: float = flag(0.005, "the fraction of samples each dataset of a weighted blend builds "
        "beyond its share")

    def prefixes(self) -> list[str]:
        """The dataset prefixes of every split's blend."""
        paths = [self.data_path, self.train_data_path, self.valid_data_path, self.test_data_path]
        return [prefix for path in paths if path for prefix in parse_blend(list(path))[0]]


@dataclass(frozen=True)
class CheckpointSection:
    """Saving and loading megatron-core distributed checkpoints, or Megatron-LM's torch format."""

    GROUP: ClassVar[str] = "checkpoints (megatron-core's distributed torch_dist, or Megatron-LM's torch format)"

    save: Optional[str] = flag(None, "directory of checkpoints: iter_XXXXXXX/ and latest_checkpointed_iteration.txt")
    load: Optional[str] = flag(None, "resume from the latest complete checkpoint in this directory (nothing there: "
        "start from scratch)")
    load_fallback_to_intact: bool = flag(False, "when the latest checkpoint fails its digests (a damaged, "
        "truncated or missing file) or the latest file is missing, resume from the newest intact checkpoint before "
        "it instead of stopping")
    ckpt_step: Optional[int] = flag(None, "resume from the checkpoint of this iteration in --load, not the latest")
    save_interval: Optional[int] = flag(None, "save every this many iterations")
    save_wgrads_interval: Optional[int] = flag(None, "every this many iterations, save each weight's reduced "
        "gradient (main_grad, before clipping) to <save>/wgrads/iter_XXXXXXX/mp_rank_TT[_PPP].pth, as Megatron-LM")
    save_dgrads_interval: Optional[int] = flag(None, "every this many iterations, save the gradients of the inputs "
        "and outputs of every linear and embedding layer (the last micro-batch's) to "
        "<save>/dgrads/iter_XXXXXXX/mp_rank_TT[_PPP].pth, as Megatron-LM")
    keep_last_n_checkpoints: Optional[int] = flag(None, "delete older checkpoints once a newer one is complete")
    save_retain_interval: Optional[int] = flag(None, "never delete the checkpoints of multiples of this many "
        "iterations (a multiple of --save-interval); without --keep-last-n-checkpoints the others are deleted once "
        "a newer one is complete, as in Megatron-LM")
    ckpt_format: str = flag("torch_dist", "the format saves write: torch_dist, megatron-core's distributed "
        "checkpoints (load at any layout), or torch, Megatron-LM's legacy format (a model_optim_rng.pt per tensor and "
        "pipeline rank, distrib_optim.pt beside it with the distributed optimizer; loads at its own TP and PP only, "
        "no --async-save), or fsdp_dtensor, Megatron-FSDP's (torch's distributed checkpoint of its shards; with "
        "--use-megatron-fsdp, which takes no other); a load reads either of the first two (with torch: torch only, "
        "unless --auto-detect-ckpt-format)",
        choices=("torch_dist", "torch", "fsdp_dtensor"))
    auto_detect_ckpt_format: bool = flag(False, "with --ckpt-format torch: load a distributed checkpoint too (a load "
        "reads the format on disk; Megatron-LM's)")
    async_save: bool = flag(False, "write checkpoints from a background process while training goes on "
        "(megatron-core's async save); committed at a later step", switch=True)
    use_persistent_ckpt_worker: bool = flag(False, "with --async-save: one background writer process per rank for "
        "the whole run (megatron-core's persistent worker, spawned at the first save) instead of one forked per save")
    exit_on_missing_checkpoint: bool = flag(False, "with --load: exit (status 0, as Megatron-LM) when it holds no "
        "checkpoint, instead of starting from scratch")
    use_checkpoint_args: bool = flag(False, "take the model's flags from those the checkpoint the run "
        "resumes from recorded (--load's, or the newer non-persistent one), as Megatron-LM's "
        "load_args_from_checkpoint (angpt.config.saved, CHECKPOINT_ARGS), validated as given ones")
    use_mp_args_from_checkpoint_args: bool = flag(False, "with --use-checkpoint-args: take the tensor- and "
        "pipeline-parallel sizes (and, unless given, --num-layers-per-virtual-pipeline-stage) from it too")
    use_tokenizer_model_from_checkpoint_args: bool = flag(True, "with --use-checkpoint-args: keep the --tokenizer-type "
        "and --tokenizer-model given, not the checkpoint's", option="--no-use-tokenizer-model-from-checkpoint-args")
    no_save_optim: bool = flag(False, "save no optimizer state nor learning-rate schedule: a resume from such a "
        "checkpoint needs --no-load-optim or --finetune")
    no_save_rng: bool = flag(False, "save no RNG states: a resume from such a checkpoint needs --no-load-rng or "
        "--finetune")
    no_load_optim: bool = flag(False, "do not load the optimizer state (nor the learning-rate schedule)")
    no_load_rng: bool = flag(False, "do not load the RNG states")
    load_main_params_from_ckpt: bool = flag(False, "with --no-load-optim, --bf16 or --fp16 and "
        "--use-distributed-optimizer: the fp32 main weights from the checkpoint's model state as read, not from the "
        "model's 16-bit weights (Megatron-LM's: a torch-format checkpoint saved in fp32 gives them exactly; "
        "torch_dist reads its weights into the model's 16-bit ones first)")
    finetune: bool = flag(False, "load the model only and start at iteration 0")
    distrib_optim_fully_reshardable_mem_efficient: bool = flag(False, "with --use-distributed-optimizer and "
        "--ckpt-format torch_dist: gather the optimizer state on data-parallel rank 0 over gloo to save it (less "
        "memory, no parallel write; megatron-core's); needs the gloo process groups")
    non_persistent_save_interval: Optional[int] = flag(None, "with --save and --non-persistent-ckpt-type global: "
        "save every this many iterations (but at --save-interval's) to the non-persistent directory, where each "
        "replaces the one before")
    non_persistent_ckpt_type: Optional[str] = flag(None, "global: non-persistent checkpoints are ordinary ones in "
        "--non-persistent-global-ckpt-dir, and a --load resumes from the newest there if it is at least as new as "
        "--load's (local and in_memory are refused)", choices=NON_PERSISTENT_CKPT_TYPES)
    non_persistent_global_ckpt_dir: Optional[str] = flag(None, "the directory of the non-persistent checkpoints "
        "(default: non_persistent/ in --save, and in --load to resume)")
    ckpt_fully_parallel_save: bool = flag(True, "write each tensor of a checkpoint once, from one data-parallel rank "
        "(as Megatron-LM, the default), not from each rank of a data-parallel group's first",
        option="--no-ckpt-fully-parallel-save")
    ckpt_assume_constant_structure: bool = flag(False, "the model and optimizer state keep their structure from "
        "one save to the next: megatron-core caches the first save's plan and metadata (and, with the fully parallel "
        "save, who writes what) and skips the later saves' checks of them")
    ckpt_fully_parallel_load: bool = flag(False, "read each tensor of a checkpoint once, spread over the "
        "data-parallel ranks, and exchange it between them (megatron-core's FullyParallelLoadStrategyWrapper)")
    dist_ckpt_strictness: str = flag("assume_ok_unexpected", "what a load does with tensors this run asks for that "
        "the checkpoint lacks (unexpected) and ones it holds that the run does not ask for (missing): megatron-core's "
        "StrictHandling; return_* logs them", choices=DIST_CKPT_STRICTNESS)
    # --use-checkpoint-args: what it took from which checkpoint (angpt.config.arguments), said in one line.
    flags_from_checkpoint: Optional[str] = derived(None)


@dataclass(frozen=True)
class EvaluationSection:
    """Evaluation on the validation and test splits."""

    GROUP: ClassVar[str] = "evaluation and logging"

    eval_interval: int = flag(1000)
    eval_iters: int = flag(100, "global batches of the validation split per evaluation (0: no evaluation)")
    skip_train: bool = flag(False, "evaluate the validation and test splits at the loaded checkpoint and exit, "
        "without training (the optimizer state is not loaded, nothing is saved, TensorBoard is not written)")
    full_validation: bool = flag(False, "each evaluation reads the whole validation split (one epoch of it, every "
        "whole global batch), not --eval-iters global batches")
    multiple_validation_sets: bool = flag(False, "evaluate each dataset of --valid-data-path by itself, reported as "
        "validation-0, validation-1, ... in its order (with --full-validation, or --skip-train)")


@dataclass(frozen=True)
class LoggingSection:
    """What a run reports: the log line, timers, TensorBoard, W&B, profiles and stragglers."""

    GROUP: ClassVar[str] = "evaluation and logging"

    log_interval: int = flag(100)
    log_params_norm: bool = flag(False, "the L2 norm of all the weights in the log line and metrics.jsonl (each "
        "weight once over the tensor and pipeline ranks, as Megatron-LM)")
    log_num_zeros_in_grad: bool = flag(False, "the number of zero gradient elements of the logged step, over the model")
    timing_log_level: int = flag(0, "megatron-core's timers, per step in the log line and metrics.jsonl every "
        "--log-interval: 0 saves and loads, 1 also the forward-backward pass, the optimizer (and its parts, "
        "anGPT's bounding), evaluation, gradient reductions; 2 also data reads and each micro-batch's forward and "
        "backward", choices=(0, 1, 2))
    timing_log_option: str = flag("minmax", "each timer over the ranks: the slowest, the fastest and slowest, or "
        "every rank's", choices=("max", "minmax", "all"))
    log_timers_to_tensorboard: bool = flag(False, "the timers (the slowest rank's) as TensorBoard scalars "
        "timers/<name>-time")
    barrier_with_l1_time: bool = flag(True, "start the forward-backward and optimizer timers without a barrier "
        "(which makes them time the step, not the wait for the slowest rank)",
        option="--no-barrier-with-level-1-timing")
    tensorboard_dir: Optional[str] = flag(None, "TensorBoard scalars (default: <save>/tensorboard)")
    tensorboard_log_interval: int = flag(1, "every this many iterations, TensorBoard and W&B get the step's own "
        "figures (train/lm_loss, lr, grad_norm, global_batch_size, consumed_samples, consumed_tokens, loss_scale with "
        "--fp16), as Megatron-LM writes them; a record's other figures (speed, memory, health, timers) go every "
        "--log-interval")
    tensorboard_queue_size: int = flag(1000, "TensorBoard events held before the writer waits for its file "
        "(SummaryWriter's max_queue; 0 or less: no bound)")
    log_loss_scale_to_tensorboard: bool = flag(True, "with --fp16: leave the loss scale out of TensorBoard and W&B "
        "(metrics.jsonl and the log line keep it)", option="--no-log-loss-scale-to-tensorboard")
    log_world_size_to_tensorboard: bool = flag(False, "the world size as train/world_size in TensorBoard and W&B, "
        "with the step's figures")
    log_memory_interval: Optional[int] = flag(None, "CUDA: every this many iterations (a multiple of "
        "--log-interval), each data-parallel rank 0 prints its CUDA memory in MB (allocated, max allocated, reserved, "
        "max reserved), as Megatron-LM's report_memory")
    log_device_memory_used: bool = flag(False, "CUDA: the --log-memory-interval reports add the device's total "
        "memory in use, of every process (torch.cuda.device_memory_used, from NVML)")
    logging_level: Optional[int] = flag(None, "the level of Python's root logger (megatron-core's loggers) and of "
        "angpt's, as a number (10 debug, 20 info, 30 warning); default: MEGATRON_LOGGING_LEVEL, else angpt's at 20 "
        "and the others at 30")
    log_progress: bool = flag(False, "append to <save>/progress.txt, in Megatron-LM's format, a line when the job "
        "starts and one after each save: the job's and the cumulative throughput (TFLOP/s/GPU), the floating-point "
        "operations and the tokens so far")
    log_energy: bool = flag(False, "CUDA, with nvidia-ml-py: the GPUs' energy (J/iter/GPU) and power (W/GPU) in the "
        "log line, metrics.jsonl and TensorBoard, and the total at the end (megatron-core's EnergyMonitor)")
    config_logger_dir: str = flag("", "megatron-core's config logger writes here, per rank: the model's, the DDP "
        "wrapper's and the optimizer's constructor arguments (JSON), the initial weights and every forward pass's "
        "inputs and logits (.pth) (default: off)")
    profile: bool = flag(False, "profile the steps from --profile-step-start to --profile-step-end on "
        "--profile-ranks: an Nsight Systems capture range (run under `nsys profile "
        "--capture-range=cudaProfilerApi`; needs CUDA), or with --use-pytorch-profiler PyTorch profiler traces in "
        "the TensorBoard directory")
    profile_step_start: int = flag(10, "with --profile: the first step profiled (counted from 0, as Megatron-LM "
        "counts it)")
    profile_step_end: int = flag(12, "with --profile: the step the range ends before")
    use_pytorch_profiler: bool = flag(False, "with --profile: the PyTorch profiler")
    profile_ranks: tuple[int, ...] = flag((0,), "with --profile: the ranks profiled")
    log_straggler: bool = flag(False, "each rank's time in its forward passes, compared over the ranks every "
        "--log-interval: the fastest and slowest ranks, and the stragglers (over their pipeline stage's median by "
        "more than 10%%), in the log line and metrics.jsonl (megatron-core's StragglerDetector times them on CUDA)")
    straggler_minmax_count: int = flag(1, "with --log-straggler: how many of the fastest, slowest and straggling "
        "ranks are named")
    straggler_ctrlr_port: int = flag(65535, "with --log-straggler on CUDA: the port of megatron-core's controller "
        "on rank 0; a connection to it (`curl host:port`) turns the timing off or on from the next --log-interval")
    disable_straggler_on_startup: bool = flag(False, "with --log-straggler on CUDA: start with the timing off "
        "(turned on through --straggler-ctrlr-port)")
    metrics_file: Optional[str] = flag(None, "JSON lines of every logged figure (default: <save or tensorboard "
        "dir>/metrics.jsonl)")
    wandb_project: Optional[str] = flag(None, "also log the TensorBoard scalars (same names and steps) and these "
        "settings to this Weights & Biases project, from rank 0; needs `pip install wandb`; WANDB_MODE=offline "
        "keeps the run on disk for `wandb sync` (default: no W&B)")
    wandb_exp_name: Optional[str] = flag(None, "the W&B run's name (default: one W&B makes up)")
    wandb_entity: Optional[str] = flag(None, "the W&B team or user that holds the project (default: W&B's default "
        "entity of the logged-in user)")
    wandb_save_dir: Optional[str] = flag(None, "where W&B writes its local files, in a wandb/ folder inside it "
        "(default: <save>/wandb)")


@dataclass(frozen=True)
class MemorySection:
    """Python's garbage collection, CUDA memory history and the caching allocator."""

    GROUP: ClassVar[str] = "memory"

    manual_gc: bool = flag(False, "turn Python's garbage collector off and collect at chosen steps, the same on "
        "every rank (a collection on one rank stalls the others)")
    manual_gc_interval: int = flag(0, "with --manual-gc: collect every this many steps (0: only around evaluations)")
    manual_gc_eval: bool = flag(True, "with --manual-gc: no collection before and after each evaluation",
        option="--no-manual-gc-eval")
    record_memory_history: bool = flag(False, "CUDA: record the caching allocator's allocations and frees with "
        "their stacks (the last 100,000), as Megatron-LM: the last rank writes a snapshot to "
        "--memory-snapshot-path every --log-interval, and every rank one to oom_rank-<rank>_<path> when it runs "
        "out of memory; open them at https://pytorch.org/memory_viz")
    memory_snapshot_path: str = flag("snapshot.pickle", "with --record-memory-history: the snapshot's file")
    empty_unused_memory_level: int = flag(0, "release the CUDA caching allocator's unused memory: 1 after each "
        "forward-backward and evaluation step, 2 also after each optimizer step (slower; for fragmentation)",
        choices=(0, 1, 2))
    cpu_offloading_num_layers: int = flag(0, "CUDA and Transformer Engine: offload the activations of this many "
        "layers to the host during the forward pass and bring them back for the backward pass (megatron-core's "
        "cpu_offloading, on Transformer Engine's get_cpu_offload_context: what it offloads are the inputs the "
        "linear layers keep); fewer than --num-layers, without pipeline parallelism or recompute")
    fine_grained_activation_offloading: bool = flag(False, "CUDA, --transformer-impl transformer_engine: offload "
        "the inputs of the --offload-modules of each layer to the host (megatron-core's fine-grained activation "
        "offloading, on CUDA streams); GPT and GPT+ (megatron-core's layers)")
    offload_modules: Optional[tuple[str, ...]] = flag(None, "with --fine-grained-activation-offloading: the "
        "modules whose input is offloaded", choices=OFFLOAD_MODULES, nargs="+")
    min_offloaded_tensor_size: int = flag(1024 * 1024, "with --fine-grained-activation-offloading: the fewest "
        "elements an offloaded tensor has")


@dataclass(frozen=True)
class RerunSection:
    """megatron-core's rerun state machine: the checks of each step's results (Megatron-LM's
    RerunStateMachineConfig)."""

    GROUP: ClassVar[str] = ("result validation (megatron-core's rerun state machine; docs/guide.md, A loss spike, "
                            "a NaN, or a suspect GPU)")

    rerun_mode: str = flag("validate_results", "validate_results: rerun a step whose loss or grads fail a check, "
        "to tell a hardware fault (exit code 17) from the data (a checkpoint, exit code 16); report_stats: rerun "
        "every step and report how much the results vary; disabled: no reruns, a NaN/Inf step is skipped "
        "(--max-skipped-steps)", choices=RERUN_MODES)
    check_for_nan_in_loss_and_grad: bool = flag(True, "do not check each micro-batch's loss and the local grads "
        "for NaN/Inf (off by itself with --fp16's dynamic loss scale, whose overflows are expected)",
        option="--no-check-for-nan-in-loss-and-grad")
    check_for_spiky_loss: bool = flag(False, "check for a micro-batch loss 10x the largest of the first 100 (not "
        "fatal)")
    check_for_large_grads: bool = flag(False, "check for local grads 10x the largest of the first 100 (not fatal)")
    error_injection_rate: int = flag(0, "for testing: inject a failed check once in this many (0: never)")
    error_injection_type: str = flag("transient_error", "for testing: what the rerun of an injected failure finds",
        choices=ERROR_INJECTION_TYPES)
    result_rejected_tracker_filename: Optional[str] = flag(None, "append a line for each failed check and rerun "
        "outcome to this file; the iterations it records as failing twice on one rank are skipped (added to "
        "--iterations-to-skip, as in Megatron-LM)")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag(None, "every this many iterations, check "
        "that each weight is the same on every data-parallel replica (SHA-1 hashes, megatron-core's check); a "
        "difference stops the run naming the weights (default: never)")
    test_mode: bool = flag(False, "megatron-core's real-time test: each attention's forward checks that its q and k "
        "layer norms' weights and biases are the same on every data-parallel and tensor-parallel rank (--model-family "
        "gpt with --qk-layernorm and LayerNorm; the paper's families have no such norms to check)")
    # Whether the state machine checks losses and local grads for NaN/Inf: not with --rerun-mode disabled
    # (angpt's skip instead; megatron-core would raise), nor with --fp16's dynamic loss scale, whose overflows
    # are the scaler's signal (Megatron-LM's validate_args turns the check off there too).
    nan_checks: bool = derived(True)


@dataclass(frozen=True)
class ExitSection:
    """When a run saves and exits before its end, and when it gives up."""

    GROUP: ClassVar[str] = "exiting"

    exit_signal_handler: bool = flag(False, "also save and exit on --exit-signal (SIGTERM always does when --save "
        "is set)")
    exit_signal: str = flag("SIGTERM", choices=EXIT_SIGNALS)
    exit_interval: Optional[int] = flag(None, "save and exit when the iteration is a multiple of this")
    exit_duration_in_mins: Optional[float] = flag(None, "save and exit after this many minutes")
    max_skipped_steps: int = flag(10, "stop when more than this many steps in a row have a NaN/Inf loss or grad norm")
    # The signals that save a checkpoint and exit: SIGTERM whenever there is somewhere to save, and --exit-signal
    # with --exit-signal-handler (SIGUSR1 on clusters that warn before a time limit).
    save_and_exit_signals: tuple[str, ...] = derived(())


SECTIONS = {
    "dry_run": DryRunSection,
    "model": ModelSection,
    "architecture": ArchitectureSection,
    "switches": SwitchesSection,
    "parallel": ParallelSection,
    "training": TrainingSection,
    "optimizer": OptimizerSection,
    "precision": PrecisionSection,
    "fusion": FusionSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "evaluation": EvaluationSection,
    "logging": LoggingSection,
    "memory": MemorySection,
    "rerun": RerunSection,
    "exits": ExitSection,
}
MEGATRON_PREFIX = "megatron_"  # the destinations of the Megatron-LM flags that the families imply (megatron_lm)


@dataclass(frozen=True)
class RunConfig:
    """One run's configuration: every section, the Megatron-LM flags the family implies (as given), and the
    --config file the flags came from. `flags()` is its flat form, {destination: value}: what checkpoints record
    and W&B shows."""

    dry_run: DryRunSection = field(default_factory=DryRunSection)
    model: ModelSection = field(default_factory=ModelSection)
    architecture: ArchitectureSection = field(default_factory=ArchitectureSection)
    switches: SwitchesSection = field(default_factory=SwitchesSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    fusion: FusionSection = field(default_factory=FusionSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    rerun: RerunSection = field(default_factory=RerunSection)
    exits: ExitSection = field(default_factory=ExitSection)
    # {megatron_<flag>: value} of the implied Megatron-LM flags given (angpt.config.megatron_lm).
    megatron: Mapping[str, Any] = field(default_factory=dict)
    config: Optional[str] = None  # the --config file

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> "RunConfig":
        """The configuration of {destination: value}; fields not given keep their defaults. Lists become tuples.
        A key that is no field is an error (angpt.config.saved reads older checkpoints' flags)."""
        unknown = set(flags) - set(FIELD_SECTIONS) - {"config"}
        unknown = {key for key in unknown if not key.startswith(MEGATRON_PREFIX)}
        if unknown:
            raise KeyError(f"not a field of the run configuration: {', '.join(sorted(unknown))}")
        values: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in flags.items():
            if key in FIELD_SECTIONS:
                values[FIELD_SECTIONS[key]][key] = tuple(value) if isinstance(value, list) else value
        return cls(**{name: SECTIONS[name](**values[name]) for name in SECTIONS},
                   megatron={key: value for key, value in flags.items() if key.startswith(MEGATRON_PREFIX)},
                   config=flags.get("config"))

    def flags(self) -> dict[str, Any]:
        """{destination: value} of every field (tuples as lists, as argparse gives them)."""
        flat: dict[str, Any] = {"config": self.config}
        for name in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                flat[key] = list(value) if isinstance(value, tuple) else value
        return {**flat, **self.megatron}

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Megatron-LM's padding of the vocabulary, so that the output head splits evenly over tensor-parallel
        ranks: a multiple of --make-vocab-size-divisible-by x TP."""
        multiple = self.data.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return -(-vocab_size // multiple) * multiple

    def replace(self, **sections_fields: Mapping[str, Any]) -> "RunConfig":
        """A copy with fields of some sections replaced: replace(parallel=dict(tensor_model_parallel_size=1))."""
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **changes)
                                            for name, changes in sections_fields.items()})


# The section of each field, by the field's name (names are unique over the sections: they are destinations).
FIELD_SECTIONS = {f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)}


def option_of(name: str) -> str:
    """The flag of a flag field (`--apply-layernorm-1p` for layernorm_zero_centered_gamma)."""
    spec = SECTIONS[FIELD_SECTIONS[name]].__dataclass_fields__[name].metadata["flag"]
    return spec["option"] or "--" + name.replace("_", "-")
