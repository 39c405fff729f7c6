"""Every place where angpt works around megatron-core, written for megatron-core 0.16.1 (`WRITTEN_FOR`).

Another megatron-core version may have fixed what a workaround fixes, or moved what it patches:
`patches.install()` logs a warning when the installed version differs, and `make test` is the check.

Each workaround, where it is, and what breaks without it under megatron-core 0.16.1:
- CUDA device calls sent to the CPU (`cpu.py`): on a machine without CUDA, building a model, the optimizer
  or a schedule raises "Torch not compiled with CUDA enabled", and model-parallel RNG is never seeded; the
  persistent checkpoint writer (--use-persistent-ckpt-worker) dies at its start and training waits for it forever.
  That writer, a spawned interpreter, also watches its training process (`cpu.persistent_writer_loop`, on every
  device): a training process SIGKILLed left it running. On gloo a bucket group of several dtypes is split into
  one per dtype: gloo's coalesced all-gather wrote a 16-bit group's fp32 scales wrong (the first chunk under
  --overlap-param-gather-with-optimizer-step).
- wandb's import skipped in runs that do not log to W&B (`skip_wandb_import` below): 1.2 CPU-s at each
  process's start, which megatron-core spends importing it for its inference logging.
- Known warnings ignored (`quiet_known_warnings` below): six `UserWarning`s at every start and first save,
  `FutureWarning`s at every load, in every process.
- "Unknown MLP type" log filtered (`patches.py`): `TransformerLayer` logs it once per layer for any MLP
  class but its own (our `ScaledSwiGLUMLP`).
- The save's results queue (`results_queue.py`): SIGTERM or SIGINT to torchrun's process group kills the
  queue's Manager, and the save the signal asked for fails; the Manager imports torch (2 CPU-s and 300 MB a
  rank) to unpickle results it only passes on.
- The save's helper processes end with their parent (`parent_watch.py`): a training process SIGKILLed during
  a save leaves the results queue's Manager behind for good (it must ignore the exit signals), and the async
  save's writer and write workers writing a checkpoint nobody will commit.
- PyTorch's FSDP2 through megatron-core (`fsdp2.py`): without CUDA its device mesh asks CUDA for the device; its
  `finish_grad_sync` refuses the argument megatron-core's `finalize_model_grads` passes (a TypeError at the first
  step, GPUs too); its checkpoints: the optimizer's state found no parameter under torch 2.13, loaded as local
  tensors Adam cannot mix with DTensors, and a gated MLP's fc1 was saved with rows of W and V swapped; at bf16 a
  layer's fp32 learnable scales beside its bf16 weights (one dtype a unit), and megatron-core's 16-bit optimizer
  takes an fp32 parameter's gradient from a DDP buffer FSDP2 has none of.
- Gradient-accumulation fusion without apex (`wgrad_fusion.py`): megatron-core's linear layers refuse to build
  with `gradient_accumulation_fusion` (RuntimeError: "fused_weight_gradient_mlp_cuda module is not found"), so
  --defer-embedding-wgrad-compute, which needs it, could not run without apex; torch's addmm stands in.
- The deferred weight gradient on the output layer only (`angpt/models/gpt.py`, `_defer_only_the_output_layers_wgrad`):
  with --defer-embedding-wgrad-compute megatron-core's local ColumnParallelLinear layers all defer into a buffer that
  only the output layer has (TypeError at the first forward; Transformer Engine's layers never defer).
- Megatron-FSDP through megatron-core (`megatron_fsdp.py`, installed when a model is wrapped in it): without CUDA
  its device string is "cuda:cpu" and its streams lack `current_stream` and events; on every device a gradient
  bucket was reduce-scattered twice in anGPT and nGPT (1.5 times every gradient at DP 2: its root hook sat on the
  model's last submodule, fixed upstream after 0.16.1), `unwrap_model` stopped at it, and the first fsdp_dtensor
  save hangs when a rank holds an empty shard (Adam has no state for it).
- Megatron-FSDP's model whole between steps (`angpt/training/step.py`, `whole_weights_between_steps`): its
  parameters stay the optimizer's shards from the gradients' sync to the next forward, and the health probe's read of
  nGPT's alphas (their modules called outside the forward) failed with a KeyError in its hooks at the first logged
  step; under optim_grads_params (`gather_whole_weights`) the log line waits for the gather its step started, whose
  release and regather from outside crashed gloo's next coalesced all-gather about one run in six.
- Checkpoints loaded as data (`checkpoint_unpickling.py`): torch's distributed checkpoint unpickles its
  `.metadata` and its non-tensor items (the RNG states) with Python's unrestricted unpickler, so a crafted
  checkpoint runs code when `--load` or the export reads it; megatron-core reads `common.pt` weights-only only
  while `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` is unset, and torch's refusal is paragraphs that suggest turning it off.
- The distributed optimizer loading torch's Adam (`patches.py`): without apex or Transformer Engine there
  is no sharded state dict to load into, then `KeyError: 'step'`, then Adam's bias correction restarts.
- The 16-bit optimizer's checkpoints (`patches.py`, `float16_optimizer_sharded_state_dict`, `main_params_by_group`):
  --bf16 or --fp16 without --use-distributed-optimizer (megatron-core's Float16OptimizerWithFloat16Params): every
  save of anGPT or nGPT raises "Param id 10 does not match any model sharded param" (the fp32 learnable scales' Adam
  state), and once that is fixed every load "Cannot merge two lists with different lengths" (the scales' group has
  no 16-bit weight to keep a main copy of); in every family a save before Adam's first applied step (fp16's first
  steps overflow) cannot be loaded (KeyError: optimizer.state.exp_avg...).
- The distributed optimizer's save before Adam's first applied step (`patches.py`, `saved_from_adams_start`):
  with --fp16 --use-distributed-optimizer, whose first steps overflow (the dynamic loss scale starts at 2^32),
  a save before Adam's first applied step raises AssertionError (`assert len(steps) == 1`, torch's Adam) and ends
  the run.
- The --decoupled-lr groups marked (`patches.py`, `mark_decoupled_lr_groups`): without it their saved state loads
  into the other weights' group (a resumed run differs; the plain optimizer refuses the load).
- The grad norm and clipping in foreach ops (`patches.py`, `foreach_l2_norm`): without apex or Transformer
  Engine, megatron's fallback syncs the host once per parameter for the grad norm of every step.
- A fused RoPE without Transformer Engine (`patches.py`, `angpt.models.attention.fused_rotary_pos_emb`):
  `apply_rope_fusion` (`--rope-fusion`) is refused ("apply_rope_fusion is not available"), and RoPE runs
  as five eager kernels forward and more backward for each of q and k, cos and sin recomputed every call.
- A graph's input buffer kept for its backward (`patches.py`, `_insert_unless_saved_for_backward`): with
  `--cuda-graph-impl local`, the last layer's replayed backward overwrites the first layer's saved input, so
  the first layer's gradients (and, after a pre-norm, the embedding's) are wrong from the second step on.
- CheckpointWithoutOutput without Transformer Engine (`patches.py`, `_checkpoint_without_output_without_fp8`):
  selective recompute of GPT+'s `layernorm` raises NameError: FP8GlobalStateManager (its default fp8=False
  takes Transformer Engine's FP8 path).
- CUDA graphs freed (`patches.py`, `delete_cuda_graphs`): megatron-core's own keeps every graph's input and
  output buffers alive, so a second micro-batch shape or model in the same process runs out of memory; its
  FullCudaGraphWrapper (`--cuda-graph-scope full_iteration`) keeps its graphs and step counts for the process, so a
  second run in it would replay the first's graph.
- The rerun state machine's stats report (`angpt/training/rerun.py`, `_Machine._maybe_report_stats`): megatron-core's
  names each check by `Caller.filename` and `lineno`, which `Caller` lacks: `--rerun-mode report_stats` raises
  AttributeError at its second step. (Megatron-LM's `RerunMode(args.rerun_mode)` also refuses "report_stats", whose
  enum value is report_determinism_stats: `rerun.MODES` maps the flag's values.)
- The loss the rerun state machine keeps (`angpt/training/step.py`, `language_model_loss`): a copy, because the
  schedule divides the returned loss in place, and the machine then compares the initial result, divided, with
  the rerun's, undivided: every rerun of a real failure would read as a transient fault.
- The cached loss mask kept whole (`patches.py`, `_loss_mask_cached_unmasked`): without --eod-mask-loss or the
  resets, GPTDataset caches the first sample's loss mask and then masks it in place at that sample's pad labels, so
  every later sample also leaves out the first one's pad positions (with --allow-ambiguous-pad-tokens and a pad that
  is the end of document, its EOD positions: tokens that are no padding). Megatron-LM's main still has it.
- The optimizer step composed from its parts (`angpt/training/step.py`, `step_unless_not_finite`): `optimizer.step()`
  skips only on an fp16 overflow, so a NaN or Inf loss in bf16 or fp32 would update the weights.
- The tied output layer's unused weight dropped on an MTP stage without the embedding (`angpt/models/gpt.py`,
  `build_model`): with --mtp-num-layers and pipeline parallelism, megatron-core's GPTModel allocates it, computes the
  logits with that stage's copy of the embedding, and asserts at the save that the output layer has no weight
  (AssertionError at every save of the last stage).
- The output layer converted in place (`angpt/models/layers.py`, `ScaledOutputLayer.attach`): `GPTModel`
  builds its output layer inline, with no spec to give it the logit scale s_Z.
- The optimizer state saved per parameter (`angpt/training/checkpointing.py`, `OPTIMIZER_SHARDING`): the default
  per-parameter "fully_sharded_model_space" format no longer validates on load.

The folder imports `angpt.config` (the exit signals) and `angpt.models` (the fused RoPE it installs), never
training. This module imports neither torch nor megatron-core: entry points call `quiet_known_warnings` before they
import them, so that `--help` stays instant and import-time warnings are caught.
"""

from __future__ import annotations

import sys
import warnings

WRITTEN_FOR = "0.16.1"

# (category, the start of the message), as megatron-core 0.16.1 and torch 2.11-2.13 word them. Each is for
# something this project already decided or cannot change: CPU and GPU runs without Transformer Engine or
# apex fall back to torch on purpose (angpt.training.optimizer logs which back end runs), and the deprecations are
# inside megatron-core's own checkpointing. Anything else still shows.
KNOWN_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    (UserWarning, "full scope is deprecated"),  # TransformerConfig's cuda_graph_scope default
    (FutureWarning, "`load_state_dict` is deprecated"),  # dist_checkpointing's torch strategy
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
    # torch 2.13's deprecations of the collectives the distributed optimizer calls, at its every step.
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
    # The distributed optimizer's zero_grad reads .grad of its fp32 shards, views (megatron-core's own comment:
    # "throws grad-access warning"), at the first step.
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
)


def quiet_known_warnings() -> None:
    """Ignore KNOWN_WARNINGS in this process; called by each entry point before it imports megatron-core."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def skip_wandb_import() -> None:
    """megatron-core imports wandb when it is installed, for its inference engine's and its timers' W&B logging
    (1.2 CPU-s a process here): a run that does not log to W&B calls this before it imports megatron-core, and
    the import fails as if wandb were not installed (megatron-core then goes without)."""
    sys.modules.setdefault("wandb", None)
