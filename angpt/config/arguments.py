"""The flags of `angpt.pretrain`: Megatron-LM's names and meanings for everything shared with Megatron,
`--model-family` and the `--angpt-*` switches, and `--config file.yaml` whose keys are the same names.

Impossible combinations are refused here, before any process-group work, by a message naming the flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import signal
from typing import Optional

import yaml

from angpt.config import megatron_lm, pipeline_split, transformer_engine_support
from angpt.config.choices import (
    FACTOR_MODES,
    MODEL_FAMILIES,
    NU_P_READINGS,
    POST_NORMS,
    RECOMPUTE_MODULES,
    RESIDUALS,
    TRANSFORMER_IMPLS,
    recompute_module_refusal,
)
from angpt.data.blend import parse_blend
from angpt.data.tiktoken_layout import TIKTOKEN_NUM_SPECIAL_TOKENS, TIKTOKEN_PATTERNS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# On/off settings a --config file may switch on get a --no-... form to switch them off again.
SWITCH = argparse.BooleanOptionalAction
# Megatron-LM's; a2a+p2p needs --hierarchical-context-parallel-sizes, which is refused (angpt.config.megatron_lm).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8")
FP8_AMAX_ALGOS = ("max", "most_recent")
# Megatron-LM's values (megatron/training/resilience_config.py); angpt.training.rerun maps them to megatron-core's.
RERUN_MODES = ("disabled", "validate_results", "report_stats")
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
# Megatron-LM's defaults of the FP8 details; they apply only with --fp8-format (None here = not given).
FP8_DEFAULTS = dict(fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
# The range of every numeric flag (a test holds the parser to it), checked before anything divides by one:
# (what the error says, the test, the flags). A flag left unset (None) is not checked; floats must be finite.
NUMERIC_RANGES = (
    ("must be at least 1", lambda value: value >= 1, (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "seq_length", "max_position_embeddings", "rotary_base", "recompute_num_layers", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "context_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers", "micro_batch_size",
        "global_batch_size", "train_iters", "train_samples", "lr_decay_iters", "lr_wsd_decay_iters",
        "lr_decay_samples", "lr_wsd_decay_samples",
        "fp8_amax_history_len", "vocab_size", "make_vocab_size_divisible_by", "save_interval",
        "keep_last_n_checkpoints", "eval_interval", "log_interval", "exit_interval", "ddp_bucket_size",
        "loss_scale_window", "hysteresis", "tiktoken_num_special_tokens", "flight_recorder_trace_buffer_size",
        "straggler_minmax_count")),
    ("cannot be negative", lambda value: value >= 0, (
        "angpt_alpha_init", "timing_log_level", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init",
        "weight_decay",
        "clip_grad", "seed", "fp8_margin", "eval_iters", "max_skipped_steps", "dry_run", "cuda_graph_warmup_steps",
        "megatron_local_rank", "rampup_batch_size", "manual_gc_interval", "empty_unused_memory_level",
        "num_workers", "decoupled_min_lr", "profile_step_start", "profile_step_end", "profile_ranks",
        "straggler_ctrlr_port", "error_injection_rate")),
    ("must be positive", lambda value: value > 0, (
        "init_method_std", "norm_epsilon", "angpt_constant_factor_multiplier", "angpt_nu_alpha_multiplier",
        "distributed_timeout_minutes", "hang_timeout_minutes", "lr", "adam_eps", "exit_duration_in_mins",
        "megatron_rotary_percent", "loss_scale", "initial_loss_scale", "min_loss_scale", "decoupled_lr",
        "gpu_memory_gib")),
    ("must be in [0, 1)", lambda value: 0 <= value < 1, (
        "attention_dropout", "hidden_dropout", "lr_warmup_fraction", "adam_beta1", "adam_beta2")),
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with failures of one line: what is wrong with which flag, then "see --help",
    printed by one process of a torchrun job (rank 0); every process exits with status 2."""

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        self.exit(2)


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's default in --help (argparse's ArgumentDefaultsHelpFormatter would also print the
    defaults that are None or False, and none for flags without a help text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if not _shows_default(action) or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    # By identity: a default of 0 or 0.0 is shown (it equals False).
    return not any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS))


def flag_actions(parser: Optional[argparse.ArgumentParser] = None) -> dict[str, argparse.Action]:
    """{dest: action} of angpt.pretrain's flags (of `parser`, default build_parser()), --help and --config aside."""
    parser = parser or build_parser()
    return {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="angpt.pretrain",
        description="Pretrain anGPT, GPT+ or nGPT with Megatron-style flags, under torchrun. Required: the "
                    "length of training (--train-iters or --train-samples) and the data (--data-path, "
                    "--train-data-path or --mock-data with --vocab-size).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of flag names (dashes or underscores) to values; "
                        "flags on the command line override it")
    parser.add_argument("--dry-run", nargs="?", type=int, const=0, metavar="WORLD_SIZE",
                        help="check the configuration for WORLD_SIZE processes (default: $WORLD_SIZE, else 1) and "
                        "its data, print the parallel layout, batch arithmetic and parameter count, and exit "
                        "without training")
    parser.add_argument("--gpu-memory-gib", type=float, help="with --dry-run: the memory of one GPU the estimate "
                        "is checked against (default: this machine's GPU, else 80)")
    parser.add_argument("--suggest-layout", action="store_true", help="with --dry-run WORLD_SIZE: rank the "
                        "tensor, pipeline, context and data parallel sizes and recompute choices that fit the GPU's "
                        "memory by an estimate of step time (docs/scaling.md)")

    model = parser.add_argument_group("model")
    model.add_argument("--model-family", choices=MODEL_FAMILIES, default="angpt")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    model.add_argument("--ffn-hidden-size", type=int, help="width of each SwiGLU half (default 4 x hidden)")
    model.add_argument("--kv-channels", type=int, help="head dim (default hidden / heads)")
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--max-position-embeddings", type=int,
                       help="accepted for Megatron-LM scripts; RoPE needs only --seq-length (must not be below it)")
    model.add_argument("--rotary-base", type=int, default=10000)
    model.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of GPT+'s RMSNorms (anGPT and "
                       "nGPT replace them by their own normalization)")
    model.add_argument("--init-method-std", type=float, default=0.02, help="GPT+ weight init (anGPT and nGPT "
                       "put every row on the unit sphere instead)")
    tying = model.add_mutually_exclusive_group()
    tying.add_argument("--tie-embeddings-and-output-weights", action="store_true",
                       help="use the embedding as the output head (default: untied, as in docs/model.md)")
    tying.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="accepted for Megatron-LM scripts; untied is already the default")
    # Megatron-LM defaults both to 0.1; the paper trains all three families without dropout.
    model.add_argument("--attention-dropout", type=float, default=0.0, help="dropout on the attention "
                       "probabilities, all families (default 0: no dropout, as in the paper; Megatron-LM's is 0.1)")
    model.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout on the embeddings and on "
                       "each sub-block output before its residual add, GPT+ only (default 0: no dropout, as in "
                       "the paper; Megatron-LM's is 0.1)")
    model.add_argument("--recompute-granularity", choices=("full", "selective"), help="recompute activations in "
                       "the backward pass: whole layers (full, with --recompute-method and --recompute-num-layers) or "
                       "the parts named by --recompute-modules (selective); docs/guide.md, Activation recompute")
    model.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform",
                       help="full recompute only")
    model.add_argument("--recompute-num-layers", type=int, default=1, help="full recompute only")
    model.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, help="what --recompute-granularity "
                       "selective recomputes (default: core_attn, as Megatron-LM): core_attn, mlp, layernorm (GPT+'s "
                       "pre-norms), qk_norm (the normalization of q and k), residual_update (anGPT's and nGPT's "
                       "normalized residual update)")
    model.add_argument("--recompute-activations", action="store_true", help="Megatron-LM's alias of "
                       "--recompute-granularity selective")

    switches = parser.add_argument_group("anGPT switches (docs/model.md, Families and switches)")
    switches.add_argument("--angpt-post-norm", choices=POST_NORMS, default="l2")
    switches.add_argument("--angpt-nu-p", choices=NU_P_READINGS, default="one")
    switches.add_argument("--angpt-alpha-init", type=float, help="default 0.01 (anGPT), 0.05 (nGPT)")
    switches.add_argument("--angpt-constant-factors", choices=FACTOR_MODES, default="analytic")
    switches.add_argument("--angpt-constant-factor-multiplier", type=float, default=1.0)
    switches.add_argument("--angpt-nu-alpha", choices=FACTOR_MODES, default="analytic")
    switches.add_argument("--angpt-nu-alpha-multiplier", type=float, default=1.0)
    switches.add_argument("--angpt-no-nu-alpha-grad", action="store_true", help="treat nu(alpha) as a constant")
    switches.add_argument("--angpt-residual", choices=RESIDUALS, default="lerp")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    parallel.add_argument("--decoder-first-pipeline-num-layers", type=int, help="layers of the first pipeline "
                          "stage (the rest split evenly over the others; angpt.config.pipeline_split)")
    parallel.add_argument("--decoder-last-pipeline-num-layers", type=int, help="layers of the last pipeline stage")
    parallel.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                          help="count the embedding as a layer of the first stage when splitting the layers")
    parallel.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                          help="count the output layer and loss as a layer of the last stage")
    parallel.add_argument("--pipeline-model-parallel-layout", help="each stage's layers, as Megatron-LM writes "
                          "them: E the embedding, t a layer, L the loss, | between stages (\"Et|tt|ttL\"; "
                          "(tt|)*3 repeats)")
    parallel.add_argument("--sequence-parallel", action=SWITCH, default=False)
    parallel.add_argument("--context-parallel-size", type=int, default=1, help="split each sequence over this "
                          "many ranks (Megatron-LM's 2 x CP chunks, rank i holding chunks i and 2 CP - 1 - i); "
                          "world size = TP x PP x CP x DP")
    parallel.add_argument("--cp-comm-type", nargs="+", choices=CP_COMM_TYPES, default=["p2p"],
                          help="how attention exchanges keys and values under context parallelism (one value for "
                          "all layers): all_gather on --transformer-impl local (the only one built there); p2p, "
                          "all_gather or a2a on Transformer Engine")
    parallel.add_argument("--use-distributed-optimizer", action=SWITCH, default=False)
    parallel.add_argument("--overlap-grad-reduce", action=SWITCH, default=False)
    parallel.add_argument("--overlap-param-gather", action=SWITCH, default=False)
    parallel.add_argument("--distributed-timeout-minutes", type=float, default=10, help="how long a collective "
                          "waits for the other ranks before the job fails (every process group)")
    parallel.add_argument("--hang-timeout-minutes", type=float, help="angpt's: when one iteration (its step, "
                          "evaluation and save) runs longer than this, every thread's Python stack of each rank is "
                          "written to its log, again each time it passes, so that a hang shows where each rank waits "
                          "before --distributed-timeout-minutes ends the job (default: off)")
    # Megatron-LM's flight recorder flags (its main, after core_v0.16.1: megatron/training/initialize.py).
    parallel.add_argument("--flight-recorder-dump-path", help="NCCL's flight recorder (CUDA): the last "
                          "collectives of each rank, written when a collective times out to this file prefix, one "
                          "file per rank (a directory: <dir>/_dump_<rank>), for `torchfrtrace`; sets torch's "
                          "TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_* variables before the process group is created, "
                          "as Megatron-LM does (ones already in the environment win) (default: off)")
    parallel.add_argument("--flight-recorder-trace-buffer-size", type=int, default=2000, help="with "
                          "--flight-recorder-dump-path: the collectives the recorder keeps per rank "
                          "(TORCH_NCCL_TRACE_BUFFER_SIZE)")
    parallel.add_argument("--ddp-bucket-size", type=int, help="elements per gradient bucket of data-parallel "
                          "reduction (default: megatron-core's, at least 40M and 1M per data-parallel rank)")

    batch = parser.add_argument_group("batch and length of training")
    batch.add_argument("--micro-batch-size", type=int, default=4)
    batch.add_argument("--global-batch-size", type=int, default=8)
    length = batch.add_mutually_exclusive_group()
    length.add_argument("--train-iters", type=int, help="required, or --train-samples")
    length.add_argument("--train-samples", type=int, help="train for this many samples (as Megatron-LM: whole "
                        "global batches, the rest left out); required, or --train-iters. The lr schedule then counts "
                        "samples: --lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples")
    batch.add_argument("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT up to --global-batch-size over the first "
                       "SAMPLES samples, in equal steps (Megatron-LM's ramp-up, megatron-core's calculator); needs "
                       "--train-samples")

    lr = parser.add_argument_group("learning rate and optimizer (defaults: the family's recipe, docs/model.md)")
    lr.add_argument("--lr", type=float, default=3e-3)
    lr.add_argument("--min-lr", type=float, help="default: the family's (0.1 lr; 0 for nGPT)")
    lr.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    lr.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    warmup = lr.add_mutually_exclusive_group()
    warmup.add_argument("--lr-warmup-iters", type=int, help="default: the family's (none; 1%% for GPT+)")
    warmup.add_argument("--lr-warmup-fraction", type=float, help="warm-up as a fraction of --lr-decay-iters")
    lr.add_argument("--lr-warmup-init", type=float, default=0.0, help="lr at the start of warm-up")
    lr.add_argument("--lr-wsd-decay-iters", type=int, help="length of WSD's final decay")
    # With --train-samples, Megatron-LM counts the schedule in samples (megatron/training/training.py,
    # get_optimizer_param_scheduler): these replace the iteration flags above.
    lr.add_argument("--lr-decay-samples", type=int, help="with --train-samples: decay over this many samples "
                    "(default: --train-samples)")
    lr.add_argument("--lr-warmup-samples", type=int, help="with --train-samples: warm up over this many samples "
                    "(default: the family's fraction of the decay)")
    lr.add_argument("--lr-wsd-decay-samples", type=int, help="with --train-samples: length of WSD's final decay")
    lr.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential")
    lr.add_argument("--weight-decay", type=float, help="default: the family's (0; 0.1 for GPT+)")
    lr.add_argument("--decoupled-lr", type=float, help="max lr of the input and output layers (the embedding and "
                    "the output head), decoupled from --lr; the same schedule")
    lr.add_argument("--decoupled-min-lr", type=float, help="min lr of the input and output layers (with "
                    "--decoupled-lr; default --min-lr's)")
    lr.add_argument("--calculate-per-token-loss", action="store_true", help="the loss and its gradients as the mean "
                    "over all the tokens of the global batch, not the mean of each micro-batch's mean (they differ "
                    "when micro-batches count different tokens, e.g. with --eod-mask-loss)")
    lr.add_argument("--clip-grad", type=float, default=1.0)
    lr.add_argument("--adam-beta1", type=float, default=0.9)
    lr.add_argument("--adam-beta2", type=float, default=0.95)
    lr.add_argument("--adam-eps", type=float, default=1e-8)
    lr.add_argument("--seed", type=int, default=1234)

    precision = parser.add_argument_group("precision")
    precision.add_argument("--bf16", action=SWITCH, default=False,
                           help="bf16 weights and activations, fp32 main weights in the optimizer (learnable scales "
                           "stay fp32)")
    precision.add_argument("--fp16", action="store_true", help="fp16 weights and activations, fp32 main weights in "
                           "the optimizer (learnable scales stay fp32), the loss scaled (dynamically unless "
                           "--loss-scale); a step whose gradients overflow is skipped and the scale lowered")
    precision.add_argument("--loss-scale", type=float, help="with --fp16: a constant loss scale (default: dynamic)")
    precision.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                           help="with --fp16: the dynamic scale's start")
    precision.add_argument("--min-loss-scale", type=float, default=1.0, help="with --fp16: the dynamic scale's floor")
    precision.add_argument("--loss-scale-window", type=int, default=1000,
                           help="with --fp16: steps without overflow before the dynamic scale doubles")
    precision.add_argument("--hysteresis", type=int, default=2,
                           help="with --fp16: overflows in a row before the dynamic scale halves")
    precision.add_argument("--grad-reduce-in-bf16", action="store_true", help="with --bf16: accumulate and "
                           "reduce gradients in bf16 (default fp32, as Megatron-LM's)")
    precision.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                           help="megatron-core's own layers (default; CPU and GPU) or NVIDIA Transformer Engine's "
                           "(GPU; needed for FP8)")
    precision.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"),
                           default="auto", help="core attention: auto = FlashAttention on GPUs (torch's kernels with "
                           "the local implementation, TE's with Transformer Engine) and megatron's unfused "
                           "attention on CPU; flash forces the fused kernels, unfused/local megatron's path")
    precision.add_argument("--cross-entropy-loss-fusion", action=SWITCH, default=None,
                           help="megatron-core's fused cross-entropy (compiled kernels over the logits). Default: on "
                           "with --bf16 on a GPU, where it gives the unfused loss and gradients; off on CPU, where "
                           "compiling it costs 4-30 s per process for little gain. Needs --bf16: it rounds the "
                           "logits' gradient to bf16, which the bf16 logits are anyway")
    precision.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native",
                           help="the fused cross-entropy's implementation: megatron-core's own (torch.compile) or "
                           "Transformer Engine's")
    precision.add_argument("--fp8-format", choices=FP8_FORMATS, help="FP8 GEMMs in the transformer layers "
                           "(Transformer Engine): e4m3 everywhere, or hybrid (e5m2 for gradients); docs/fp8.md")
    precision.add_argument("--fp8-recipe", choices=FP8_RECIPES, help="scaling recipe (default delayed); mxfp8 "
                           "needs Blackwell (compute capability 10) and a Transformer Engine that has it")
    precision.add_argument("--fp8-margin", type=int, help="delayed scaling: scale margin, a power of 2 (default 0)")
    precision.add_argument("--fp8-amax-history-len", type=int, help="delayed scaling: amax history window "
                           "(default 1)")
    precision.add_argument("--fp8-amax-compute-algo", choices=FP8_AMAX_ALGOS,
                           help="delayed scaling: amax of the window (max) or the latest (most_recent, default)")

    speed = parser.add_argument_group("fusions and CUDA graphs (GPU)")
    speed.add_argument("--rope-fusion", dest="apply_rope_fusion", action=SWITCH, default=None,
                       help="RoPE as one kernel forward and one backward (Transformer Engine's where installed, "
                       "else a torch.compile'd one; cos and sin inside it). Default: on with a GPU, off on CPU "
                       "(compiling costs seconds per process there)")
    speed.add_argument("--bias-swiglu-fusion", action=SWITCH, default=None,
                       help="GPT+'s SwiGLU as megatron-core's compiled kernels (anGPT and nGPT always use their "
                       "own nu-scaled SwiGLU kernel). Default: on with a GPU, off on CPU")
    speed.add_argument("--cuda-graph-impl", choices=("none", "local"), default="none",
                       help="local: capture each transformer layer's forward and backward as CUDA graphs "
                       "(megatron-core's own implementation; no Transformer Engine needed) after the first step, "
                       "and replay them: for launch-bound steps (small micro-batches). Needs a GPU. NOT VERIFIED: "
                       "its gradients were wrong on an H200, the fix has not run on a GPU since (docs/gpu.md); for "
                       "speed measurements")
    speed.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                       help="eager runs of each layer inside the capture, before it is recorded")

    data = parser.add_argument_group("data")
    data.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    data.add_argument("--split", default="969,30,1", help="train,valid,test weights of --data-path")
    data.add_argument("--train-data-path", nargs="+")
    data.add_argument("--valid-data-path", nargs="+")
    data.add_argument("--test-data-path", nargs="+")
    data.add_argument("--data-cache-path", help="where GPTDataset caches its indices")
    data.add_argument("--mock-data", action="store_true", help="megatron-core's synthetic sequences")
    data.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank that read "
                      "the training samples ahead of the step (0: read in the training process, at each step; "
                      "Megatron-LM's default is 2); evaluations read in the training process")
    data.add_argument("--eod-mask-loss", action="store_true", help="leave the end-of-document tokens out of the "
                      "loss (megatron-core's GPTDataset masks them)")
    data.add_argument("--reset-position-ids", action="store_true", help="restart the position ids after each "
                      "end-of-document token; RoPE rotates each token by its position id")
    data.add_argument("--reset-attention-mask", action="store_true", help="attend within each document only (a "
                      "[seq, seq] mask per sample, from megatron-core's GPTDataset; not with --transformer-impl "
                      "transformer_engine)")
    data.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                      help="read the .bin files by file reads rather than through a memory map")
    data.add_argument("--vocab-size", type=int, help="vocabulary of --mock-data, NullTokenizer's ids (its "
                      "end-of-document id comes after them), or TikTokenizer's with a Megatron-LM .json vocabulary "
                      "(default 131072, as Megatron-LM); with a dataset's .json, it must be the vocab_size it "
                      "records")
    # Megatron-LM's tokenizer flags: the vocabulary of datasets without our .json, as its tools/preprocess_data.py
    # writes them (angpt.data.gpt_datasets.flag_vocabulary); with a .json, they must agree with it.
    data.add_argument("--tokenizer-type", help="HuggingFaceTokenizer, TikTokenizer, GPT2BPETokenizer, "
                      "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer or NullTokenizer (with "
                      "--vocab-size)")
    data.add_argument("--tokenizer-model", help="tokenizer.json or its directory, a Megatron-LM tiktoken .json "
                      "vocabulary or a .tiktoken ranks file (TikTokenizer), or a SentencePiece .model")
    data.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS, help="TikTokenizer's split pattern with a "
                      "Megatron-LM .json vocabulary (v2 when not given, as Megatron-LM)")
    data.add_argument("--tiktoken-num-special-tokens", type=int, default=TIKTOKEN_NUM_SPECIAL_TOKENS,
                      help="the special tokens before the ranks of TikTokenizer's Megatron-LM .json vocabulary")
    data.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    data.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    data.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                      help="pad the vocabulary to a multiple of this times the tensor-parallel size")

    checkpoints = parser.add_argument_group("checkpoints (megatron-core distributed checkpoints, torch_dist)")
    checkpoints.add_argument("--save", help="directory of checkpoints: iter_XXXXXXX/ and "
                             "latest_checkpointed_iteration.txt")
    checkpoints.add_argument("--load", help="resume from the latest complete checkpoint in this directory "
                             "(nothing there: start from scratch)")
    checkpoints.add_argument("--load-fallback-to-intact", action="store_true",
                             help="when the latest checkpoint fails its digests (a damaged, truncated or missing "
                             "file) or the latest file is missing, resume from the newest intact checkpoint "
                             "before it instead of stopping")
    checkpoints.add_argument("--save-interval", type=int, help="save every this many iterations")
    checkpoints.add_argument("--keep-last-n-checkpoints", type=int,
                             help="delete older checkpoints once a newer one is complete")
    checkpoints.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    checkpoints.add_argument("--async-save", action=SWITCH, default=False,
                             help="write checkpoints from a background process while training goes on "
                             "(megatron-core's async save); committed at a later step")
    checkpoints.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    checkpoints.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    checkpoints.add_argument("--finetune", action="store_true",
                             help="load the model only and start at iteration 0")

    logs = parser.add_argument_group("evaluation and logging")
    logs.add_argument("--eval-interval", type=int, default=1000)
    logs.add_argument("--eval-iters", type=int, default=100,
                      help="global batches of the validation split per evaluation (0: no evaluation)")
    logs.add_argument("--log-interval", type=int, default=100)
    logs.add_argument("--log-params-norm", action="store_true", help="the L2 norm of all the weights in the log "
                      "line and metrics.jsonl (each weight once over the tensor and pipeline ranks, as Megatron-LM)")
    logs.add_argument("--log-num-zeros-in-grad", action="store_true", help="the number of zero gradient elements "
                      "of the logged step, over the model")
    logs.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0, help="megatron-core's timers, "
                      "per step in the log line and metrics.jsonl every --log-interval: 0 saves and loads, 1 also the "
                      "forward-backward pass, the optimizer (and its parts, anGPT's bounding), evaluation, gradient "
                      "reductions; 2 also data reads and each micro-batch's forward and backward")
    logs.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax",
                      help="each timer over the ranks: the slowest, the fastest and slowest, or every rank's")
    logs.add_argument("--log-timers-to-tensorboard", action="store_true",
                      help="the timers (the slowest rank's) as TensorBoard scalars timers/<name>-time")
    logs.add_argument("--no-barrier-with-level-1-timing", dest="barrier_with_l1_time", action="store_false",
                      help="start the forward-backward and optimizer timers without a barrier (which makes them "
                      "time the step, not the wait for the slowest rank)")
    logs.add_argument("--tensorboard-dir", help="TensorBoard scalars (default: <save>/tensorboard)")
    logs.add_argument("--profile", action="store_true", help="profile the steps from --profile-step-start to "
                      "--profile-step-end on --profile-ranks: an Nsight Systems capture range (run under `nsys "
                      "profile --capture-range=cudaProfilerApi`; needs CUDA), or with --use-pytorch-profiler "
                      "PyTorch profiler traces in the TensorBoard directory")
    logs.add_argument("--profile-step-start", type=int, default=10, help="with --profile: the first step profiled "
                      "(counted from 0, as Megatron-LM counts it)")
    logs.add_argument("--profile-step-end", type=int, default=12, help="with --profile: the step the range ends "
                      "before")
    logs.add_argument("--use-pytorch-profiler", action="store_true", help="with --profile: the PyTorch profiler")
    logs.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="with --profile: the ranks "
                      "profiled")
    logs.add_argument("--log-straggler", action="store_true", help="each rank's time in its forward passes, "
                      "compared over the ranks every --log-interval: the fastest and slowest ranks, and the "
                      "stragglers (over their pipeline stage's median by more than 10%%), in the log line and "
                      "metrics.jsonl (megatron-core's StragglerDetector times them on CUDA)")
    logs.add_argument("--straggler-minmax-count", type=int, default=1, help="with --log-straggler: how many of "
                      "the fastest, slowest and straggling ranks are named")
    logs.add_argument("--straggler-ctrlr-port", type=int, default=65535, help="with --log-straggler on CUDA: the "
                      "port of megatron-core's controller on rank 0; a connection to it (`curl host:port`) turns "
                      "the timing off or on from the next --log-interval")
    logs.add_argument("--disable-straggler-on-startup", action="store_true", help="with --log-straggler on "
                      "CUDA: start with the timing off (turned on through --straggler-ctrlr-port)")
    logs.add_argument("--metrics-file", help="JSON lines of every logged figure (default: <save or "
                      "tensorboard dir>/metrics.jsonl)")
    # Megatron-LM's W&B flags (megatron/training/global_vars.py: _set_wandb_writer), with its defaults.
    logs.add_argument("--wandb-project", help="also log the TensorBoard scalars (same names and steps) and "
                      "these settings to this Weights & Biases project, from rank 0; needs `pip install wandb`; "
                      "WANDB_MODE=offline keeps the run on disk for `wandb sync` (default: no W&B)")
    logs.add_argument("--wandb-exp-name", help="the W&B run's name (default: one W&B makes up)")
    logs.add_argument("--wandb-entity", help="the W&B team or user that holds the project (default: W&B's "
                      "default entity of the logged-in user)")
    logs.add_argument("--wandb-save-dir", help="where W&B writes its local files, in a wandb/ folder inside it "
                      "(default: <save>/wandb)")

    memory = parser.add_argument_group("memory")
    memory.add_argument("--manual-gc", action="store_true", help="turn Python's garbage collector off and collect "
                        "at chosen steps, the same on every rank (a collection on one rank stalls the others)")
    memory.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every this "
                        "many steps (0: only around evaluations)")
    memory.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                        help="with --manual-gc: no collection before and after each evaluation")
    memory.add_argument("--record-memory-history", action="store_true", help="CUDA: record the caching "
                        "allocator's allocations and frees with their stacks (the last 100,000), as Megatron-LM: the "
                        "last rank writes a snapshot to --memory-snapshot-path every --log-interval, and every rank "
                        "one to oom_rank-<rank>_<path> when it runs out of memory; open them at "
                        "https://pytorch.org/memory_viz")
    memory.add_argument("--memory-snapshot-path", default="snapshot.pickle", help="with --record-memory-history: "
                        "the snapshot's file")
    memory.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                        help="release the CUDA caching allocator's unused memory: 1 after each forward-backward and "
                        "evaluation step, 2 also after each optimizer step (slower; for fragmentation)")

    checks = parser.add_argument_group(
        "result validation (megatron-core's rerun state machine; docs/guide.md, A loss spike, a NaN, or a suspect GPU)")
    checks.add_argument("--rerun-mode", choices=RERUN_MODES, default="validate_results",
                        help="validate_results: rerun a step whose loss or grads fail a check, to tell a hardware "
                        "fault (exit code 17) from the data (a checkpoint, exit code 16); report_stats: rerun "
                        "every step and report how much the results vary; disabled: no reruns, a NaN/Inf step "
                        "is skipped (--max-skipped-steps)")
    checks.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                        action="store_false",
                        help="do not check each micro-batch's loss and the local grads for NaN/Inf (off by itself "
                        "with --fp16's dynamic loss scale, whose overflows are expected)")
    checks.add_argument("--check-for-spiky-loss", action="store_true",
                        help="check for a micro-batch loss 10x the largest of the first 100 (not fatal)")
    checks.add_argument("--check-for-large-grads", action="store_true",
                        help="check for local grads 10x the largest of the first 100 (not fatal)")
    checks.add_argument("--error-injection-rate", type=int, default=0,
                        help="for testing: inject a failed check once in this many (0: never)")
    checks.add_argument("--error-injection-type", choices=ERROR_INJECTION_TYPES, default="transient_error",
                        help="for testing: what the rerun of an injected failure finds")
    checks.add_argument("--result-rejected-tracker-filename",
                        help="append a line for each failed check and rerun outcome to this file")

    exits = parser.add_argument_group("exiting")
    exits.add_argument("--exit-signal-handler", action="store_true",
                       help="also save and exit on --exit-signal (SIGTERM always does when --save is set)")
    exits.add_argument("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM")
    exits.add_argument("--exit-interval", type=int, help="save and exit when the iteration is a multiple of this")
    exits.add_argument("--exit-duration-in-mins", type=float, help="save and exit after this many minutes")
    exits.add_argument("--max-skipped-steps", type=int, default=10,
                       help="stop when more than this many steps in a row have a NaN/Inf loss or grad norm")
    megatron_lm.add_megatron_lm_flags(parser)
    for action in parser._actions:
        if action.help is None and _shows_default(action):
            action.help = "default: %(default)s"  # argparse shows no default where there is no help text
    return parser


def parse_args(argv: Optional[list[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    parser = build_parser()
    known, _ = _config_only_parser().parse_known_args(argv)
    if known.config:
        parser.set_defaults(**read_config(parser, known.config))
    args = parser.parse_args(argv)
    if world_size is None:  # --dry-run 0 (--dry-run alone) is this job's world size
        world_size = max(args.dry_run or 0, 0) or int(os.environ.get("WORLD_SIZE", 1))
    validate(parser, args, world_size)
    megatron_lm.check_implied(parser, args)
    args.world_size = world_size
    return args


def _config_only_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    return parser


def read_config(parser: argparse.ArgumentParser, path: str) -> dict:
    """{dest: value} of a YAML file of flag names, each checked against the parser."""
    try:
        with open(path) as file:
            values = yaml.safe_load(file) or {}
    except OSError as error:
        parser.error(f"--config {path}: {error.strerror}")
    except yaml.YAMLError as error:
        parser.error(f"--config {path}: not valid YAML: {error}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = flag_actions(parser)
    # A key is a flag's destination or the flag itself (Megatron-LM's flags here have destinations of their own).
    actions.update({action.option_strings[0].lstrip("-").replace("-", "_"): action for action in actions.values()
                    if action.dest.startswith("megatron_")})
    defaults = {}
    for key, value in values.items():
        action = actions.get(str(key).lstrip("-").replace("-", "_"))
        if action is None:
            parser.error(f"--config {path}: unknown key {key!r} (not a flag of angpt.pretrain)")
        if isinstance(action, megatron_lm.Refuse):
            why = action.refusal(value)
            if why is None:
                continue
            parser.error(f"--config {path}: {key}: not supported: {why}")
        try:
            defaults[action.dest] = setting_value(action, value)
        except ValueError as error:
            parser.error(f"--config {path}: {key}: {error}")
    return defaults


def setting_value(action: argparse.Action, value):
    """A flag's value given in YAML (a --config file, a sweep's settings), checked and converted as the
    command line would convert it; a ValueError names the flag."""
    flag = action.option_strings[0]
    if action.nargs == "+":
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, (dict, list)) or v is None for v in values):
            raise ValueError(f"expected a value or a list of values ({flag})")
        return [str(v) for v in values]
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false ({flag})")
        return value
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)} ({flag})")
    if isinstance(value, (dict, list, bool)) or value is None:
        raise ValueError(f"expected a single {getattr(action.type, '__name__', 'value')} ({flag})")
    if action.type is not None:
        if action.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a valid int ({flag})")
        try:
            return action.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a valid {action.type.__name__} ({flag})") from None
    return value


def settings_to_argv(values: dict) -> list[str]:
    """The command line of angpt.pretrain that sets `values` ({dest: value}, as setting_value returns them)."""
    actions = flag_actions()
    argv = []
    for dest, value in values.items():
        action = actions[dest]
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv += [flag, str(value)]
    return argv


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> None:
    """Refuse impossible settings before any process-group work, naming the flags."""
    _validate_ranges(parser, args)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        parser.error(f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp} "
                     f"x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    dp = world_size // (tp * pp * cp)
    _validate_context_parallel(parser, args)
    if args.num_attention_heads % tp:
        parser.error(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups and (args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp):
        parser.error(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                     f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    try:
        pipeline_split.stage_layers(args)
    except ValueError as error:
        parser.error(str(error))
    if args.num_layers_per_virtual_pipeline_stage:
        if pp == 1:
            parser.error("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if (args.num_layers // pp) % args.num_layers_per_virtual_pipeline_stage:
            parser.error("--num-layers / --pipeline-model-parallel-size is not divisible by "
                         "--num-layers-per-virtual-pipeline-stage")
    if args.global_batch_size % (args.micro_batch_size * dp):
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                     f"{args.micro_batch_size} x data-parallel size {dp}")
    if args.sequence_parallel and tp == 1:
        # As Megatron-LM: sequence parallelism is within the tensor-parallel group, and off without one
        # (said in one line, angpt.config.megatron_lm.notes).
        args.sequence_parallel, args.sequence_parallel_disabled = False, True
    for half in ("bf16", "fp16"):
        if getattr(args, half) and not args.use_distributed_optimizer:
            # Its state-dict mapping skips fp32 parameters inside a 16-bit model, which the learnable scales are.
            parser.error(f"--{half} needs --use-distributed-optimizer (megatron-core's other 16-bit optimizer "
                         "cannot checkpoint the fp32 learnable scales)")
    if args.bf16 and args.fp16:
        parser.error("give one of --bf16 and --fp16")
    _validate_dependent_flags(parser, args)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        parser.error("--overlap-param-gather needs --use-distributed-optimizer")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        parser.error(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                     f"{args.seq_length}")
    _validate_dropout(parser, args)
    _validate_recompute(parser, args)
    _validate_switches(parser, args)
    _validate_schedule(parser, args, dp)
    _validate_precision(parser, args)
    _validate_checkpoints(parser, args)
    _validate_hang_timeout(parser, args)
    _validate_dry_run(parser, args)
    _validate_result_checks(parser, args)
    _validate_data(parser, args)
    _validate_wandb(parser, args)


def _validate_context_parallel(parser, args) -> None:
    """Megatron-LM's checks of --context-parallel-size, and the local spec's one exchange (all_gather)."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        parser.error(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp} (each "
                     "rank holds two of 2 x CP chunks)")
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp:
        parser.error(f"--sequence-parallel: --seq-length {args.seq_length} / --context-parallel-size {cp} is not "
                     f"divisible by --tensor-model-parallel-size {tp}")
    kinds = args.cp_comm_type
    if len(kinds) > 1:
        # Megatron-LM's per-layer form: megatron-core 0.16.1 reads the list at the 1-based layer number, so each
        # layer would take the next layer's value and the last one none.
        parser.error(f"--cp-comm-type takes one value here (got {len(kinds)}): megatron-core 0.16.1 misreads a list "
                     "of one per layer")
    if args.transformer_impl == "local" and kinds != ["all_gather"]:
        parser.error(f"--cp-comm-type {kinds[0]}: context parallelism on --transformer-impl local is all_gather "
                     "only: pass --cp-comm-type all_gather (or use --transformer-impl transformer_engine)")


def _validate_ranges(parser, args) -> None:
    for requirement, holds, dests in NUMERIC_RANGES:
        for dest in dests:
            given = getattr(args, dest)
            flag = "--" + dest.removeprefix("megatron_").replace("_", "-")
            for value in given if isinstance(given, list) else [] if given is None else [given]:
                if isinstance(value, float) and not math.isfinite(value):
                    parser.error(f"{flag} {value} must be a finite number")
                if not holds(value):
                    parser.error(f"{flag} {value} {requirement}")


# The anGPT switches each other family reads (docs/model.md, Families and switches); the rest would be
# ignored there, so they are refused: GPT+ has none of the normalized blocks, and nGPT normalizes exactly
# (no constant factors, no nu(alpha)) but has the post-norm, alpha and the residual update.
FAMILY_SWITCHES = {
    "gptplus": (),
    "ngpt": ("angpt_post_norm", "angpt_alpha_init", "angpt_residual"),
}


def _validate_switches(parser, args) -> None:
    if args.model_family not in FAMILY_SWITCHES:
        return
    for action in parser._actions:
        dest = action.dest
        if dest.startswith("angpt_") and dest not in FAMILY_SWITCHES[args.model_family] \
                and getattr(args, dest) != action.default:
            parser.error(f"{action.option_strings[0]} does not apply to --model-family {args.model_family} "
                         "(docs/model.md, Families and switches)")


def _validate_dropout(parser, args) -> None:
    if args.hidden_dropout and args.model_family != "gptplus":
        # Their layers have no bias-dropout-add; megatron-core would drop out only the embeddings.
        parser.error(f"--hidden-dropout is not supported for --model-family {args.model_family} (its normalized "
                     "residual has no hidden dropout; GPT+ only); use --attention-dropout")


def _validate_recompute(parser, args) -> None:
    """--recompute-activations becomes --recompute-granularity selective (Megatron-LM's alias); each flag of the
    other granularity is refused, and each module the family or implementation lacks."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            parser.error("--recompute-activations is --recompute-granularity selective: give one of them")
        args.recompute_granularity = "selective"
    declared = build_parser()
    if args.recompute_granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) != declared.get_default(dest):
                parser.error(f"--{dest.replace('_', '-')} needs --recompute-granularity full")
    if args.recompute_granularity != "selective":
        if args.recompute_modules is not None:
            parser.error("--recompute-modules needs --recompute-granularity selective (or --recompute-activations)")
        return
    for module in args.recompute_modules or ["core_attn"]:
        refusal = recompute_module_refusal(module, args.model_family, args.transformer_impl)
        if refusal:
            parser.error(f"--recompute-modules {module} with --model-family {args.model_family}: {refusal}")


# Flags that act only with another (its destination): (their destinations, that one, the error; None: "--FLAG
# needs --THAT"). Each is refused when given a value other than its default without the one it needs.
DEPENDENT_FLAGS = (
    (("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"), "fp16",
     "{flag} needs --fp16 (loss scaling is for fp16)"),
    (("decoupled_min_lr",), "decoupled_lr", None),
    (("grad_reduce_in_bf16",), "bf16", None),
    (("manual_gc_interval", "manual_gc_eval"), "manual_gc", None),
    (("use_pytorch_profiler", "profile_ranks", "profile_step_start", "profile_step_end"), "profile",
     "--use-pytorch-profiler, --profile-ranks, --profile-step-start and --profile-step-end need --profile"),
    (("straggler_minmax_count", "straggler_ctrlr_port", "disable_straggler_on_startup"), "log_straggler", None),
    (("memory_snapshot_path",), "record_memory_history", None),
    (("flight_recorder_trace_buffer_size",), "flight_recorder_dump_path", None),
)


def _validate_dependent_flags(parser, args) -> None:
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    declared = build_parser()  # the flags' own defaults: a --config file's values are `parser`'s defaults
    for dests, needed, error in DEPENDENT_FLAGS:
        given = [dest for dest in dests if getattr(args, dest) != declared.get_default(dest)]
        if given and not getattr(args, needed):
            parser.error((error or "{flag} needs {needed}").format(flag=flags[given[0]], needed=flags[needed]))


def _validate_rampup(parser, args, dp: int) -> None:
    """What megatron-core's ramp-up calculator asserts (or divides by zero on), as errors naming the flags: every
    batch of the ramp-up must split into micro-batches on every data-parallel rank."""
    start, increment, samples = args.rampup_batch_size
    shown = f"--rampup-batch-size {start} {increment} {samples}"
    if args.train_samples is None:
        parser.error(f"{shown} needs --train-samples (the ramp-up is counted in samples)")
    if min(start, increment, samples) < 1:  # SAMPLES 0: megatron-core divides by zero
        parser.error(f"{shown}: START, INCREMENT and SAMPLES must be at least 1")
    if start >= args.global_batch_size or (args.global_batch_size - start) % increment:
        parser.error(f"{shown}: START must be below --global-batch-size {args.global_batch_size} and reach it in "
                     "whole INCREMENTs")
    if start % (args.micro_batch_size * dp) or increment % (args.micro_batch_size * dp):
        parser.error(f"{shown}: START and INCREMENT must be multiples of --micro-batch-size {args.micro_batch_size} "
                     f"x data-parallel size {dp}")


def _validate_schedule(parser, args, dp: int) -> None:
    if args.train_iters is None and args.train_samples is None:
        parser.error("give the length of training: --train-iters or --train-samples")
    # As Megatron-LM (megatron/training/arguments.py): a run counts iterations or samples, not both.
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for name in ("lr_decay", "lr_warmup", "lr_wsd_decay"):
        if getattr(args, f"{name}_{other}") is not None:
            parser.error(f"--{name.replace('_', '-')}-{other} needs --train-{other} (this run gives --train-{unit}: "
                         f"use --{name.replace('_', '-')}-{unit})")
    if args.lr_warmup_fraction is not None and getattr(args, f"lr_warmup_{unit}") is not None:
        parser.error(f"give one of --lr-warmup-fraction and --lr-warmup-{unit}")
    if args.rampup_batch_size is not None:
        _validate_rampup(parser, args, dp)
    if by_samples and args.rampup_batch_size is None:
        if args.train_samples < args.global_batch_size:
            parser.error(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                         f"{args.global_batch_size}")
        # Whole global batches; the samples of a last, partial one are left out, as in Megatron-LM.
        args.train_iters = args.train_samples // args.global_batch_size
    if args.lr_decay_style == "WSD" and getattr(args, f"lr_wsd_decay_{unit}") is None:
        parser.error(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
    if args.min_lr is not None and args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is above --lr {args.lr}")


def _validate_precision(parser, args) -> None:
    """--transformer-impl, the fused cross-entropy and the FP8 flags (Megatron-LM's names); fills in the FP8
    defaults."""
    if args.cuda_graph_impl == "local" and args.recompute_granularity == "full":
        parser.error("--cuda-graph-impl local cannot capture layers that --recompute-granularity full recomputes "
                     "(megatron-core supports that only for whole-iteration graphs); drop one of them")
    if args.cuda_graph_impl == "local" and args.recompute_granularity == "selective":
        parser.error("--cuda-graph-impl local with --recompute-granularity selective is not built: the recomputed "
                     "parts run inside each layer's captured graph, which no test has checked on a GPU; drop one of "
                     "them")
    if args.cross_entropy_loss_fusion and not args.bf16:
        parser.error("--cross-entropy-loss-fusion needs --bf16 (the fused cross-entropy rounds the logits' gradient "
                     "to bf16; in fp32 the unfused one is exact)")
    if args.cross_entropy_fusion_impl == "te" and transformer_engine_support.transformer_engine_error() is not None:
        parser.error(f"--cross-entropy-fusion-impl te needs NVIDIA Transformer Engine, which is not importable here "
                     f"({transformer_engine_support.transformer_engine_error()}); use --cross-entropy-fusion-impl "
                     "native (the default)")
    fp8 = args.fp8_format is not None
    if not fp8:
        for flag in ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"):
            if getattr(args, flag) not in (None, False):
                parser.error(f"--{flag.replace('_', '-')} needs --fp8-format (FP8 is off without it)")
    for flag, default in FP8_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    if fp8:
        if args.transformer_impl != "transformer_engine":
            parser.error(f"--fp8-format {args.fp8_format} needs --transformer-impl transformer_engine (FP8 GEMMs "
                         f"are Transformer Engine's; got --transformer-impl {args.transformer_impl})")
        if not args.bf16:
            parser.error(f"--fp8-format {args.fp8_format} needs --bf16 (the weights and activations FP8 does not "
                         "cover stay bf16)")
        if args.fp8_recipe != "delayed":
            for flag in ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"):
                if getattr(args, flag) != FP8_DEFAULTS[flag]:
                    parser.error(f"--{flag.replace('_', '-')} applies to --fp8-recipe delayed only (got "
                                 f"--fp8-recipe {args.fp8_recipe})")
        multiple = 32 if args.fp8_recipe == "mxfp8" else 16
        ffn = args.ffn_hidden_size or 4 * args.hidden_size
        if args.hidden_size % multiple or ffn % multiple:
            parser.error(f"FP8 GEMMs (--fp8-recipe {args.fp8_recipe}) need --hidden-size {args.hidden_size} and "
                         f"--ffn-hidden-size {ffn} to be multiples of {multiple}")
    if args.transformer_impl == "transformer_engine":
        if transformer_engine_support.transformer_engine_error() is not None:
            parser.error(transformer_engine_support.unavailable_message())
        if fp8:
            problem = transformer_engine_support.fp8_recipe_problem(args.fp8_recipe)
            if problem:
                parser.error(f"--fp8-recipe {args.fp8_recipe}: {problem}")


def _validate_dry_run(parser, args) -> None:
    for flag in ("suggest_layout", "gpu_memory_gib"):
        if getattr(args, flag) not in (None, False) and args.dry_run is None:
            parser.error(f"--{flag.replace('_', '-')} is part of the dry run's report: add --dry-run WORLD_SIZE")


def nan_checks_on(args: argparse.Namespace) -> bool:
    """Whether the rerun state machine checks losses and local grads for NaN/Inf (angpt.training.rerun): not with
    --rerun-mode disabled (angpt's skip instead; megatron-core would raise), nor with --fp16's dynamic loss scale,
    whose overflows are the scaler's signal (Megatron-LM's validate_args turns the check off there too)."""
    return (args.check_for_nan_in_loss_and_grad and args.rerun_mode != "disabled"
            and not (args.fp16 and not args.loss_scale))


def _validate_result_checks(parser, args) -> None:
    if args.error_injection_type != "transient_error" and not args.error_injection_rate:
        parser.error("--error-injection-type needs --error-injection-rate")
    checked = nan_checks_on(args) or args.check_for_spiky_loss or args.check_for_large_grads
    if args.error_injection_rate and not (args.rerun_mode == "validate_results" and checked):
        parser.error("--error-injection-rate makes checks of --rerun-mode validate_results fail, and this run has "
                     "none (the NaN check is off with --no-check-for-nan-in-loss-and-grad and with --fp16's dynamic "
                     "loss scale)")


def _validate_hang_timeout(parser, args) -> None:
    if args.hang_timeout_minutes is not None and args.hang_timeout_minutes >= args.distributed_timeout_minutes:
        parser.error(f"--hang-timeout-minutes {args.hang_timeout_minutes} must be below --distributed-timeout-minutes "
                     f"{args.distributed_timeout_minutes}: the stacks are for before the collective times out")


def _validate_checkpoints(parser, args) -> None:
    for flag in ("save_interval", "keep_last_n_checkpoints", "async_save"):
        if getattr(args, flag) and not args.save:
            parser.error(f"--{flag.replace('_', '-')} needs --save")
    if (args.exit_signal_handler or args.exit_interval or args.exit_duration_in_mins) and not args.save:
        # Megatron-LM exits without saving then; a user who asks for a graceful exit wants the state.
        parser.error("--exit-signal-handler, --exit-interval and --exit-duration-in-mins need --save")
    for flag in ("finetune", "load_fallback_to_intact"):
        if getattr(args, flag) and not args.load:
            parser.error(f"--{flag.replace('_', '-')} needs --load")


def _validate_wandb(parser, args) -> None:
    if not args.wandb_project:
        for flag in ("wandb_exp_name", "wandb_entity", "wandb_save_dir"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} needs --wandb-project (W&B is off without it)")
        return
    if not (args.wandb_save_dir or args.save):
        parser.error("--wandb-project needs --wandb-save-dir or --save (W&B's files go to <save>/wandb)")
    # Found, not imported: importing wandb takes a second, and only rank 0 uses it.
    if importlib.util.find_spec("wandb") is None:
        parser.error("--wandb-project needs the wandb package: pip install wandb")


def _validate_data(parser, args) -> None:
    if not (args.data_path or args.train_data_path or args.mock_data):
        parser.error("no training data: give --data-path, --train-data-path or --mock-data")
    given = [f"--{flag.replace('_', '-')}" for flag in ("data_path", "train_data_path", "mock_data")
             if getattr(args, flag)]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} both name the training data: give one")
    if args.data_path and (args.valid_data_path or args.test_data_path):
        parser.error("--data-path splits one blend into train, validation and test (--split); "
                     "--valid-data-path and --test-data-path go with --train-data-path")
    if args.mock_data and not args.vocab_size:
        parser.error("--mock-data needs --vocab-size")
    if args.reset_attention_mask and args.transformer_impl == "transformer_engine":
        parser.error("--reset-attention-mask: Transformer Engine's attention here is causal by its mask type and "
                     "takes no document mask; use --transformer-impl local")
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        values = getattr(args, flag)
        if not values:
            continue
        name = f"--{flag.replace('_', '-')}"
        try:
            prefixes, _ = parse_blend(values)
        except ValueError as error:
            parser.error(str(error).replace("--data-path", name))
        # A prefix written as one of its files (`corpus_text_document.bin`) means that prefix.
        for index, value in enumerate(values):
            if value in prefixes and value.endswith((".bin", ".idx")):
                values[index] = value[:-len(".bin")]
        prefixes, _ = parse_blend(values)
        for prefix in prefixes:
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                parser.error(f"{name} {prefix}: no {' or '.join(prefix + e for e in missing)}")


def exit_signals(args: argparse.Namespace) -> list[signal.Signals]:
    """The signals that save a checkpoint and exit: SIGTERM whenever there is somewhere to save, and
    --exit-signal with --exit-signal-handler (SIGUSR1 on clusters that warn before a time limit)."""
    if not args.save:
        return []
    chosen = {signal.SIGTERM}
    if args.exit_signal_handler:
        chosen.add(getattr(signal, args.exit_signal))
    return sorted(chosen)
