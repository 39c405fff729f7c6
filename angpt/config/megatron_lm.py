"""Every flag of Megatron-LM's pretraining parser (`megatron_lm_flags.GROUPS`, read from its
`megatron/training/arguments.py`) decided here, so that a Megatron-LM launch script runs with `--model-family`
added, or stops at its first flag that cannot be honoured with one line saying why:

- implemented: `angpt.config.arguments` defines the flag, with Megatron-LM's meaning (docs/megatron.md notes
  where our default differs); the architecture flags that `--model-family gpt` takes are checked against the
  other families by angpt.config.validation (with GPT+, `--normalization RMSNorm` is its own and Megatron-LM's
  default LayerNorm asks for nothing; `--squared-relu` is refused);
- implied: the family implies or replaces what the flag asks for; accepted, and checked against the family
  where a value could ask for something else (`--optimizer sgd` is refused);
- ignored: Megatron-LM accepts it and ignores it (deprecated there); accepted, and a run given it says so in
  one log line (`notes`);
- refused: asks for something angpt does not build; giving it Megatron-LM's default value asks for nothing
  and is accepted (`--context-parallel-size 1`).

`docs/megatron.md` is written from this table and the parser by tools/megatron_flags_doc.py; a test holds
the table to every flag of `megatron_lm_flags`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Callable, NamedTuple, Optional

from angpt.config.choices import FAMILY_NAMES, NORMALIZED_FAMILIES
from angpt.config.megatron_lm_flags import GROUPS, SOURCE
from angpt.config.object_storage import is_object_storage_path
from angpt.config.sections import RunConfig, option_of
from angpt.config.tiktoken_layout import BERT_TYPES, SENTENCEPIECE_TYPES

IMPLEMENTED, IMPLIED, IGNORED, REFUSED = "implemented", "implied", "ignored", "refused"


class Decision(NamedTuple):
    status: str
    why: str
    # For an implied flag: the refusal for a value or family that asks for something else, else None.
    check: Optional[Callable[[argparse.Namespace, object], Optional[str]]] = None


def implied(why: str, check=None) -> Decision:
    return Decision(IMPLIED, why, check)


def ignored(why: str) -> Decision:
    """A flag Megatron-LM accepts without effect: accepted, and said in one log line."""
    return Decision(IGNORED, why)


def refused(why: str) -> Decision:
    return Decision(REFUSED, why)


def only(expected, why: str):
    """A check that refuses any value but `expected`."""
    return lambda args, value: None if value == expected else why


FSDP = ("not built with Megatron-FSDP: --use-megatron-fsdp runs with megatron-core's defaults of its other settings "
        "(docs/reference.md, Megatron-FSDP)")
# Verified: HybridDeviceOptimizer's constructor takes torch.cuda.current_stream() (AssertionError without CUDA).
OPTIMIZER_OFFLOAD = ("megatron-core's HybridDeviceOptimizer, which runs Adam on the host, needs CUDA (it takes CUDA "
                     "streams when built; without CUDA there is no device memory to offload from), and Megatron-LM "
                     "runs it only with --use-precision-aware-optimizer (its check), refused here; on CUDA not built: "
                     "that optimizer keeps fp32 copies of the weights of its own, which anGPT's and nGPT's post-step "
                     "projection of the main weights (angpt.models.bounding) does not reach, and it has not run on a "
                     "GPU here")
TE_OVERLAP = "Transformer Engine's userbuffer overlap of tensor-parallel communication is not built"
INFERENCE = "an inference setting: angpt pretrains; generate with the Hugging Face export (tools/convert_to_hf.py)"
LEGACY = "Megatron-LM's legacy models are not part of angpt; the families are megatron-core models"
DENSE = "angpt trains dense GPTs of its families"
ATTENTION = f"{DENSE}; their attention is softmax attention (docs/model.md)"
QK_CLIP = "Transformer Engine's attention (>= 2.9) alone records (Megatron-LM's check)"
NCCL_ONLY = ("NCCL's, on CUDA GPUs only: not built (no GPU here to check it on; without CUDA every process group is "
             "gloo's)")
PRECISION_AWARE = ("megatron-core's precision-aware optimizer needs Transformer Engine's FusedAdam (CUDA only; "
                   "megatron-core raises without it): not built (docs/fp8.md: Transformer Engine has not run on a GPU "
                   "here to check it)")
CHECKPOINT_FORMAT = ("angpt reads either checkpoint format (--auto-detect-ckpt-format) and writes --ckpt-format "
                     "torch_dist or torch; a run continues a checkpoint in the other format")
# Megatron-LM builds them on nvidia_resiliency_ext's LocalCheckpointManager, which is not installed here.
LOCAL_CHECKPOINTS = ("local non-persistent checkpoints (--non-persistent-ckpt-type local), which need "
                     "nvidia_resiliency_ext, not installed here")
ONLY_LOCAL = f"only {LOCAL_CHECKPOINTS}, read it"
ONLY_REPLICATION = f"only --replication reads it, of {LOCAL_CHECKPOINTS}"


# What Megatron-LM 0.16.1's legacy tokenizers (megatron/training/tokenizer/tokenizer.py) give a run of preprocessed
# data, its vocabulary size, end of document and pad id (megatron-core's GPTDataset takes a pad that raises as
# none),
# where they differ from megatron-core's (tests/test_legacy_tokenizer.py builds both).
LEGACY_TOKENIZER_DIFFERENCES = {
    "SentencePieceTokenizer": ("Megatron-LM's legacy SentencePieceTokenizer adds <CLS>, <SEP>, <EOD>, <MASK> after the "
                               "model's pieces (and <PAD>, <BOS>, <EOS> where the model has none, then "
                               "--vocab-extra-ids <extra_id_N>) and ends documents with <EOD>: a vocabulary of "
                               "pieces + 4 to 7, where megatron-core's is the pieces and ends documents with the "
                               "model's EOS"),
    "TikTokenizer": ("Megatron-LM's legacy TikTokenizer has no pad id (it never sets one, so no padding is masked) "
                     "where megatron-core's pads with <pad> (id 4), names ids 3 to 6 <SPECIAL_3> ... <SPECIAL_6> where "
                     "megatron-core's are <mask> <pad> <cls> <sep>, and asserts --tiktoken-pattern is given"),
    **dict.fromkeys(BERT_TYPES, (
        "Megatron-LM's legacy BERT tokenizer adds [BOS] and [EOS] after vocab.txt (then --vocab-extra-ids "
        "<extra_id_N>) and ends documents with [EOS], where megatron-core's (transformers' BertTokenizer) ends them "
        "with [SEP] and BertWordPieceCase adds 100 <extra_id_N>")),
}


def _legacy_tokenizer(args: argparse.Namespace) -> Optional[str]:
    """Megatron-LM's legacy build_tokenizer raises NotImplementedError for a type it lacks (None among them); a
    type whose legacy tokenizer gives another vocabulary, end of document or pad id is refused with the
    difference. The others give a run what megatron-core's gives (_tokenizer_notes says so)."""
    kind = args.tokenizer_type
    if kind is None:
        return ("Megatron-LM's legacy build_tokenizer builds no tokenizer without --tokenizer-type "
                "(NotImplementedError there): give --tokenizer-type")
    if kind in LEGACY_TOKENIZER_DIFFERENCES:
        return f"{LEGACY_TOKENIZER_DIFFERENCES[kind]}: not built"
    if kind == "HuggingFaceTokenizer" and (args.tokenizer_special_tokens or args.tiktoken_special_tokens):
        return ("Megatron-LM's legacy HuggingFaceTokenizer adds no --tokenizer-special-tokens (megatron-core's adds "
                "them to the vocabulary): not built")
    if kind == "Llama2Tokenizer" and args.tokenizer_model and os.path.isfile(args.tokenizer_model):
        import sentencepiece  # noqa: PLC0415 (so that --help imports no tokenizer library)

        pad = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model).pad_id()
        if pad >= 0:  # its pad property reads an attribute it never sets
            return (f"Megatron-LM's legacy Llama2Tokenizer has no pad id (no padding masked), where megatron-core's "
                    f"pads with the model's pad piece, id {pad}: not built")
    return None


def _sentencepiece_legacy(args: argparse.Namespace) -> Optional[str]:
    """--tokenizer-sentencepiece-legacy with a SentencePiece type: megatron-core's legacy wrapper, given the list of
    special tokens Megatron-LM passes (or none), sets no eos_token, so its .eod raises AttributeError, and
    Megatron-LM's GPTDataset reads it for every sample (preprocess_data.py with --append-eod too)."""
    if args.tokenizer_type is None:
        return "it chooses megatron-core's legacy wrapper of a SentencePiece --tokenizer-type: give --tokenizer-type"
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        return ("Megatron-LM 0.16.1 fails with it: megatron-core's legacy SentencePiece wrapper has no end-of-document "
                "id (AttributeError: SentencePieceTokenizer has no attribute 'eod'), which GPTDataset reads for every "
                "sample")
    return None


# By flag (every spelling of it is looked up).
FLAGS: dict[str, Decision] = {
    # -- transformer configuration
    "--pipeline-model-parallel-comm-backend": refused("the pipeline's communication backend follows the device "
                                                      "(NCCL with CUDA, gloo without)"),
    "--max-seqlen-per-dp-cp-rank": refused("it goes with --hybrid-context-parallel (refused here)"),
    "--hybrid-context-parallel": refused("needs CUDA and Transformer Engine: megatron-core 0.16.1's hybrid CP data "
                                         "schedule moves its sequence lengths and batches to CUDA "
                                         "(datasets/data_schedule.py, utils.get_batch_on_this_hybrid_cp_rank), and "
                                         "gives attention each sample's CP group in PackedSeqParams, which its local "
                                         "DotProductAttention refuses; --context-parallel-size splits every sequence "
                                         "alike"),
    "--expert-model-parallel-size": refused(f"expert parallelism: {DENSE}"),
    "--use-cpu-initialization": implied("weights are initialized on the CPU where there is no GPU, on the GPU "
                                        "otherwise (megatron-core's choice)", only(False, "not built on a GPU")),
    "--no-async-tensor-model-parallel-allreduce": ignored("deprecated in megatron-core 0.16 and ignored there"),
    "--tp-comm-overlap-rs-dgrad": refused(TE_OVERLAP),
    "--overlap-moe-expert-parallel-comm": refused(f"MoE: {DENSE}"),
    "--delay-wgrad-compute": refused(f"MoE: it goes with --overlap-moe-expert-parallel-comm (megatron-core's check); "
                                     f"{DENSE}"),
    "--ep-overlap-early-attn-memory-release": refused(f"MoE: {DENSE}"),
    "--use-ring-exchange-p2p": refused("megatron-core calls torch.distributed.ring_exchange, which PyTorch's releases "
                                       "lack (NVIDIA's PyTorch builds have it): pipeline stages exchange with "
                                       "megatron-core's batched p2p"),
    "--softmax-type": refused(ATTENTION),
    "--apply-residual-connection-post-layernorm": ignored("megatron-core 0.16's TransformerConfig has the field and "
                                                          "its layers never read it (Megatron-LM's legacy models "
                                                          "did): the residual adds each sub-block to its input"),
    "--attention-output-gate": refused(ATTENTION),
    "--multi-latent-attention": refused(ATTENTION),
    "--experimental-attention-variant": refused(ATTENTION),
    "--init-model-with-meta-device": refused("without --use-megatron-fsdp or --use-torch-fsdp2, Megatron-LM 0.16.1 "
                                             "builds the model on the meta device and materializes it with "
                                             "torch.empty_like: its weights are left uninitialized; with them it is "
                                             "not built"),
    "--use-fused-weighted-squared-relu": refused(f"MoE: {DENSE}"),
    "--fp8-quantizer-factory": refused("custom FP8 quantizers are not built (docs/fp8.md)"),
    "--fp8-interval": ignored("deprecated since Transformer Engine 1.8 and ignored by megatron-core"),
    "--use-kitchen-attention": refused("NVIDIA Kitchen is not built"),
    "--enable-cuda-graph": refused("deprecated in Megatron-LM: use --cuda-graph-impl local"),
    "--external-cuda-graph": refused("deprecated in Megatron-LM: use --cuda-graph-impl local"),
    "--flash-decode": refused(INFERENCE),
    "--use-te-activation-func": refused("the MLP's activation is angpt's own kernel (anGPT, nGPT) or "
                                        "megatron-core's"),
    "--symmetric-ar-type": refused(INFERENCE),
    "--mrope-section": refused(ATTENTION),
    "--mlp-chunks-for-prefill": refused(INFERENCE),
    "--is-hybrid-model": refused(f"hybrid (Mamba) models: {DENSE}"),
    "--disable-mamba-mem-eff-path": refused(f"hybrid (Mamba) models: {DENSE}"),
    # -- network size
    "--encoder-num-layers": refused("use --num-layers"),
    "--decoder-num-layers": refused("use --num-layers"),
    "--window-size": refused(ATTENTION),
    "--window-attn-skip-freq": refused(ATTENTION),
    "--relative-attention-num-buckets": refused("T5's relative position embeddings: megatron-core's GPTModel has none "
                                                "(T5Model's)"),
    "--relative-attention-max-distance": refused("T5's relative position embeddings: megatron-core's GPTModel has none "
                                                 "(T5Model's)"),
    "--rotary-seq-len-interpolation-factor": refused("Megatron-LM's pretrain_gpt.py does not hand it to GPTModel: "
                                                     "it changes nothing there"),
    "--rope-scaling-factor": refused("Megatron-LM's pretrain_gpt.py does not hand it to GPTModel, whose factor with "
                                     "--use-rope-scaling is 8"),
    "--no-position-embedding": refused("deprecated in Megatron-LM (an error there but with rope, where it does "
                                       "nothing): use --position-embedding-type none with --model-family gpt"),
    "--openai-gelu": refused("Megatron-LM's legacy models only: megatron-core's GPT does not read it"),
    "--onnx-safe": refused("an export setting of Megatron-LM's legacy models"),
    "--bert-no-binary-head": refused(f"BERT: {DENSE}"),
    # -- regularization
    "--sgd-momentum": refused("the families train with Adam"),
    # -- training
    "--exit-signal-handler-for-dataloader": implied("the DataLoader workers inherit the training process's "
                                                    "handlers of the exit signals: a signal to the group does not "
                                                    "kill them"),
    "--batch-size": refused("deprecated in Megatron-LM: use --micro-batch-size"),
    "--checkpoint-activations": refused("deprecated in Megatron-LM: use --recompute-granularity full"),
    "--tp-comm-overlap-cfg": refused(TE_OVERLAP),
    "--no-masked-softmax-fusion": implied("the masked-softmax fusion is never used here (FlashAttention or "
                                          "megatron-core's unfused attention)"),
    "--no-bias-dropout-fusion": implied("the bias-dropout-add is not fused here (megatron-core's default; "
                                        "Megatron-LM's fuses it)"),
    "--rope-type": refused("every family uses megatron-core's RoPE (docs/model.md)"),
    "--use-flash-attn": refused("deprecated in Megatron-LM: use --attention-backend flash"),
    "--optimizer": implied("every family trains with Adam with decoupled weight decay, as Megatron-LM's adam",
                           only("adam", "the families train with Adam (--optimizer adam)")),
    "--optimizer-cpu-offload": refused(OPTIMIZER_OFFLOAD),
    "--optimizer-offload-fraction": refused(OPTIMIZER_OFFLOAD),
    "--use-torch-optimizer-for-cpu-offload": refused(OPTIMIZER_OFFLOAD),
    "--overlap-cpu-optimizer-d2h-h2d": refused(OPTIMIZER_OFFLOAD),
    "--no-pin-cpu-grads": refused(OPTIMIZER_OFFLOAD),
    "--no-pin-cpu-params": refused(OPTIMIZER_OFFLOAD),
    "--dataloader-type": implied("samples are read in order of megatron-core's GPTDataset shuffle (Megatron-LM's "
                                 "single)", only("single", "only --dataloader-type single is built")),
    "--no-persist-layer-norm": implied("the persistent layer-norm kernel (apex) is never used here"),
    "--no-gradient-accumulation-fusion": implied("gradient-accumulation fusion is off here but for "
                                                 "--defer-embedding-wgrad-compute, which needs it"),
    "--use-mcore-models": implied("the families are megatron-core models"),
    "--use-legacy-models": refused(LEGACY),
    "--high-priority-stream-groups": refused(f"high-priority CUDA streams for NCCL's communicators: {NCCL_ONLY}"),
    "--disable-jit-fuser": ignored("Megatron-LM 0.16.1 swaps megatron.core.jit.jit_fuser after megatron-core's "
                                   "fusions took it at import (pretrain_gpt.py imports them first): they stay "
                                   "compiled; each fusion has a flag of its own (--rope-fusion, --bias-swiglu-fusion, "
                                   "--bias-gelu-fusion, --cross-entropy-loss-fusion)"),
    # -- RNG and initialization
    "--te-rng-tracker": refused("Transformer Engine's RNG tracker is not used (dropout is off by default)"),
    "--inference-rng-tracker": refused(INFERENCE),
    "--data-parallel-random-init": refused("data-parallel replicas start equal, as the optimizer assumes"),
    "--init-method-xavier-uniform": refused("Megatron-LM 0.16.1 fails with it: its core_transformer_config_from_args "
                                            "passes scaled_init_method, which megatron-core's TransformerConfig has "
                                            "not (TypeError: TransformerConfig.__init__() got an unexpected keyword "
                                            "argument 'scaled_init_method')"),
    # -- learning rate and weight decay
    "--use-checkpoint-opt_param-scheduler": implied("a resumed run keeps the checkpoint's schedule (unless "
                                                    "--override-opt_param-scheduler)"),
    "--warmup": refused("deprecated in Megatron-LM: use --lr-warmup-iters or --lr-warmup-fraction"),
    # -- checkpointing
    "--pretrained-checkpoint": refused("use --load with --finetune"),
    "--no-strict-fsdp-dtensor-load": refused(FSDP),
    "--dist-ckpt-save-pre-mcore-014": refused(CHECKPOINT_FORMAT + ", as megatron-core 0.16 writes them"),
    "--dist-ckpt-optim-fully-reshardable": implied("the optimizer state is saved per parameter and loads at "
                                                   "another layout"),
    # Local non-persistent checkpoints' (--non-persistent-ckpt-type local, refused by angpt.config.validation).
    "--non-persistent-local-ckpt-dir": ignored(ONLY_LOCAL),
    "--non-persistent-local-ckpt-algo": ignored(ONLY_LOCAL),
    "--replication": refused(f"replication is of {LOCAL_CHECKPOINTS}"),
    "--replication-jump": ignored(ONLY_REPLICATION),
    "--replication-factor": ignored(ONLY_REPLICATION),
    "--use-dist-ckpt": ignored("deprecated in Megatron-LM and without effect there: --ckpt-format decides"),
    "--dist-ckpt-format": ignored("deprecated in Megatron-LM and without effect there: --ckpt-format decides"),
    "--ckpt-fully-parallel-save": ignored("deprecated in Megatron-LM and without effect there: fully parallel "
                                          "saving is the default (--no-ckpt-fully-parallel-save turns it off)"),
    # -- mixed precision
    "--accumulate-allreduce-grads-in-fp32": implied("gradients are accumulated and reduced in fp32"),
    "--fp16-lm-cross-entropy": ignored("megatron-core 0.16's GPTModel keeps it and never reads it: its cross-entropy "
                                       "casts the fp16 logits to fp32, as here (needs --fp16, Megatron-LM's check)"),
    "--reuse-grad-buf-for-mxfp8-param-ag": refused("FP8 parameters are not built (docs/fp8.md)"),
    "--fp8-param-gather": refused("FP8 parameters are not built (Transformer Engine's): what reads the weights here "
                                  "(anGPT's and nGPT's projections onto the unit ball, checkpoint digests, the "
                                  "weight-hash and health checks, the Hugging Face export) takes them in high "
                                  "precision, and Transformer Engine has not run on a GPU here to check otherwise "
                                  "(docs/fp8.md); leave it out (the FP8 casts then happen in each GEMM)"),
    # -- distributed
    "--model-parallel-size": refused("deprecated in Megatron-LM: use --tensor-model-parallel-size"),
    "--distributed-backend": refused("the backend follows the device: NCCL with CUDA, gloo without"),
    "--no-scatter-gather-tensors-in-pipeline": ignored("nothing reads it in Megatron-LM core_v0.16.1 or "
                                                       "megatron-core 0.16.1"),
    "--local-rank": implied("torchrun's LOCAL_RANK is read from the environment"),
    "--lazy-mpu-init": refused("an external launcher's setting of Megatron-LM: launch with torchrun"),
    "--use-nccl-ub": refused(f"NCCL user buffers for the gradient and weight buffers: {NCCL_ONLY}"),
    "--disable-symmetric-registration": ignored("it changes only how --use-nccl-ub, refused here as NCCL-only, "
                                                "registers NCCL user buffers"),
    "--use-sharp": refused(f"InfiniBand SHARP through NCCL's CollNet: {NCCL_ONLY}"),
    "--sharp-enabled-group": refused("it needs --use-sharp (megatron-core asserts so), which is refused here: "
                                     f"{NCCL_ONLY}"),
    "--outer-dp-sharding-strategy": refused(FSDP),
    "--suggested-communication-unit-size": refused(FSDP),
    "--keep-fp8-transpose-cache": refused(FSDP),
    "--enable-full-sharding-in-hsdp": refused(FSDP),
    "--nccl-communicator-config-path": refused(f"NCCL's per-group communicator settings: {NCCL_ONLY}"),
    # -- validation
    # -- data and dataloader
    "--encoder-seq-length": refused("use --seq-length"),
    "--decoder-seq-length": refused("use --seq-length"),
    "--sample-rate": ignored("read by Megatron-LM's legacy ORQA (retrieval) dataset only: pretrain_gpt.py's "
                             "datasets do not subsample"),
    "--mask-prob": refused(f"masked language modelling (BERT): {DENSE}"),
    "--short-seq-prob": refused(f"masked language modelling (BERT): {DENSE}"),
    "--no-create-attention-mask-in-dataloader": implied(
        "the dataset builds an attention mask only for --reset-attention-mask: the attention is causal by itself",
        lambda args, value: "--reset-attention-mask needs the dataset's mask (Megatron-LM would silently not reset "
        "it)" if args.reset_attention_mask else None),
    # -- tokenizer
    "--padded-vocab-size": refused("the padded vocabulary follows --make-vocab-size-divisible-by"),
    "--vocab-extra-ids": ignored("read by Megatron-LM's legacy BERT and SentencePiece tokenizers only (T5's span "
                                 "masking): neither megatron-core's tokenizers, which Megatron-LM 0.16 builds, nor "
                                 "the legacy GPT2BPETokenizer (--legacy-tokenizer) add tokens for it"),
    "--legacy-tokenizer": implied("Megatron-LM's legacy GPT2BPETokenizer, GPTSentencePieceTokenizer, "
                                  "Llama2Tokenizer (a model without a pad piece), HuggingFaceTokenizer (without "
                                  "--tokenizer-special-tokens) and NullTokenizer give the same vocabulary size, end "
                                  "of document and pad id as megatron-core's, which is all a run of preprocessed data "
                                  "reads of them (said in one line); the others are refused with the difference",
                                  lambda args, value: _legacy_tokenizer(args)),
    "--tokenizer-sentencepiece-legacy": implied("read by megatron-core's SentencePiece library only (the "
                                                "SentencePiece types): with another --tokenizer-type Megatron-LM "
                                                "ignores it, and so does angpt, saying so in one line; with a "
                                                "SentencePiece type it is refused, as Megatron-LM 0.16.1 fails with "
                                                "it (megatron-core's legacy wrapper has no end-of-document id)",
                                                lambda args, value: _sentencepiece_legacy(args)),
    "--tokenizer-hf-use-fast": implied("Hugging Face tokenizers are read with the `tokenizers` library (fast)"),
    "--trust-remote-code": refused("tokenizers are read from tokenizer.json; no remote code is run"),
    # -- logging
    "--log-throughput": implied("every log line gives the throughput (tokens/s) and MFU"),
    "--log-validation-ppl-to-tensorboard": implied("every evaluation writes its perplexity to TensorBoard "
                                                   "(validation/lm_loss_ppl, test/lm_loss_ppl), with or without it"),
    "--log-memory-to-tensorboard": implied("every record's memory figures (GPU peak allocation, or the process RSS on "
                                           "CPU) go to TensorBoard as train/memory_*"),
    "--log-max-attention-logit": refused(f"it logs each head's largest attention logit, which {QK_CLIP}: the local "
                                         "layers have none, and angpt's Transformer Engine runs do not log it"),
    # -- Transformer Engine, experimental
    "--te-precision-config-file": refused("per-layer precision configs are not built (docs/fp8.md)"),
    "--enable-experimental": refused("Megatron-LM's experimental features are not built"),
    "--spec": refused("the layer spec follows --model-family"),
    "--yaml-cfg": refused("use --config (a YAML file of angpt.pretrain's flags)"),
    "--use-precision-aware-optimizer": refused(PRECISION_AWARE),
    "--main-grads-dtype": refused(f"other than fp32 it needs --use-precision-aware-optimizer (megatron-core asserts "
                                  f"so): {PRECISION_AWARE}"),
    "--main-params-dtype": refused(f"other than fp32 it needs --use-precision-aware-optimizer (megatron-core asserts "
                                   f"so): {PRECISION_AWARE}"),
    "--exp-avg-dtype": refused(f"other than fp32 it needs --use-precision-aware-optimizer (megatron-core asserts "
                               f"so): {PRECISION_AWARE}"),
    "--exp-avg-sq-dtype": refused(f"other than fp32 it needs --use-precision-aware-optimizer (megatron-core asserts "
                                  f"so): {PRECISION_AWARE}"),
}

# By the start of the flag, for families of flags that share one reason.
PREFIXES: tuple[tuple[str, Decision], ...] = (
    ("--moe-", refused(f"mixture of experts: {DENSE}")),
    ("--fp4-", refused("FP4 is not built (docs/fp8.md)")),
    ("--mamba-", refused(f"hybrid (Mamba) models: {DENSE}")),
    ("--tp-comm-", refused(TE_OVERLAP)),
    ("--no-tp-comm-", refused(TE_OVERLAP)),
    ("--kitchen-", refused("NVIDIA Kitchen is not built")),
    ("--dsa-", refused(ATTENTION)),
    ("--linear-", refused(ATTENTION)),
    ("--qk-clip", refused(f"QK-clip scales W_q and W_k after each step by each head's largest attention logit, which "
                          f"{QK_CLIP}: the local layers have none, and angpt's Transformer Engine runs do not clip")),
    ("--muon-", refused("the families train with Adam (docs/model.md)")),
    ("--ckpt-convert-", refused(CHECKPOINT_FORMAT)),
    ("--fsdp-", refused(FSDP)),
    ("--hybrid-", refused(f"hybrid (Mamba) models: {DENSE}")),
    ("--inference-", refused(INFERENCE)),
)

# By Megatron-LM's argument group, for groups that do not apply to pretraining a dense GPT.
GROUP_DECISIONS: dict[str, Decision] = {
    "moe": refused(f"mixture of experts: {DENSE}"),
    "mla": refused(f"multi-latent attention: {ATTENTION}"),
    "experimental_attention_variant": refused(ATTENTION),
    "heterogeneous architecture": refused(f"heterogeneous layers: {DENSE}"),
    "rl": refused("reinforcement learning is not part of angpt (pretraining)"),
    "sft": refused("supervised fine-tuning data is not built: --finetune continues pretraining from a checkpoint"),
    "inference": refused(INFERENCE),
    "biencoder": refused(f"retrieval (biencoder) models: {DENSE}"),
    "vision": refused(f"vision models: {DENSE}"),
    "autoresume": refused("ADLR autoresume is NVIDIA-internal: on Slurm, use examples/pretrain.slurm (saves on "
                          "SIGUSR1 and requeues)"),
    "one logger": refused("NVIDIA's one logger is not used: metrics go to metrics.jsonl, TensorBoard and W&B"),
    "ft_package": refused("NVIDIA's fault-tolerance package is not used: torchrun and Slurm restart a run, "
                          "which resumes from --load"),
    "In-process restart": refused("in-process restart is not built: torchrun and Slurm restart a run, which "
                                  "resumes from --load"),
    "workload inspector": refused("NVIDIA's workload inspector is not used"),
    "msc": refused("the multi-storage client is not used: checkpoints and data are on a file system"),
    # pretrain_gpt.py adds these only where nvidia-modelopt is installed.
    "modelopt-generic": refused("ModelOpt's post-training (quantization, knowledge distillation, speculative "
                                "decoding, its export formats) is not part of angpt (pretraining)"),
}


def megatron_lm_flags() -> list[tuple[str, tuple]]:
    """[(group, (flag, other spellings, nargs, type, default))] of Megatron-LM's parser, in its order."""
    return [(group, row) for group, rows in GROUPS.items() for row in rows]


def decide(group: str, flag: str, spellings: tuple[str, ...] = ()) -> Optional[Decision]:
    """The decision of this table for a Megatron-LM flag that angpt.pretrain does not define (None: undecided)."""
    for name in (flag, *spellings):
        if name in FLAGS:
            return FLAGS[name]
    for prefix, decision in PREFIXES:
        if any(name.startswith(prefix) for name in (flag, *spellings)):
            return decision
    return GROUP_DECISIONS.get(group)


def _convert(kind: Optional[str], value: str):
    try:
        return {"int": int, "float": float}.get(kind, str)(value)
    except ValueError:
        return value


class Refuse(argparse.Action):
    """A Megatron-LM flag angpt does not build: an error of one line saying why, unless its value is
    Megatron-LM's default (it then asks for nothing)."""

    def __init__(self, option_strings, dest, why: str, kind: Optional[str], megatron_default, **kwargs):
        self.why, self.kind, self.megatron_default = why, kind, megatron_default
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def refusal(self, value) -> Optional[str]:
        """Why `value` (True for a flag without a value given) cannot be honoured; None if it asks for nothing."""
        if self.nargs == 0:
            return self.why if value else None
        if isinstance(value, list):
            value = [_convert(self.kind, v) for v in value]
        elif isinstance(value, str):
            value = _convert(self.kind, value)
        return None if value == self.megatron_default else self.why

    def __call__(self, parser, namespace, values, option_string=None):
        why = self.refusal(True if self.nargs == 0 else values)
        if why is not None:
            raise argparse.ArgumentError(self, f"not supported: {why}")


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every Megatron-LM flag the parser does not define: the implied ones (shown in --help) and the
    refused ones (in docs/megatron.md)."""
    defined = {name: action for action in parser._actions for name in action.option_strings}
    group = parser.add_argument_group(f"Megatron-LM flags ({SOURCE}) that the family implies or replaces, or that "
                                      "Megatron-LM ignores (docs/megatron.md lists every Megatron-LM flag)")
    for megatron_group, (flag, spellings, nargs, kind, default) in megatron_lm_flags():
        names = [name for name in (flag, *spellings) if name not in defined]
        ours = next((defined[name] for name in (flag, *spellings) if name in defined), None)
        if ours is not None:  # implemented; Megatron-LM's other spellings of it become ours too
            for name in names:
                ours.option_strings.append(name)
                parser._option_string_actions[name] = ours
            continue
        decision = decide(megatron_group, flag, spellings)
        if decision is None:
            raise KeyError(f"Megatron-LM's {flag} is not decided in angpt.config.megatron_lm")
        dest = "megatron_" + flag.lstrip("-").replace("-", "_")
        if decision.status == REFUSED:
            parser.add_argument(*names, dest=dest, action=Refuse, nargs=nargs, why=decision.why, kind=kind,
                                megatron_default=default)
        elif nargs == 0:
            group.add_argument(*names, dest=dest, action="store_true", help=decision.why)
        else:
            converter = {"int": int, "float": float}.get(kind, str)
            group.add_argument(*names, dest=dest, nargs=nargs, type=converter, help=decision.why,
                               metavar=flag.lstrip("-").upper().replace("-", "_"))
        defined.update(dict.fromkeys(names))


def check_implied(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an implied flag given a value (or with a family) that asks for something else."""
    for action in parser._actions:
        if not action.dest.startswith("megatron_") or isinstance(action, Refuse):
            continue
        value = getattr(args, action.dest, None)
        if value in (None, False):
            continue
        decision = decide("", action.option_strings[0])
        reason = decision.check(args, value) if decision.check else None
        if reason is not None:
            shown = "" if action.nargs == 0 else f" {value}"
            parser.error(f"{action.option_strings[0]}{shown} with --model-family {args.model_family}: {reason}")


# The norm flags anGPT and nGPT replace by their own normalization: accepted, and said (angpt.config.validation).
NORM_FLAGS = ("normalization", "layernorm_zero_centered_gamma", "qk_layernorm", "qk_l2_norm", "norm_epsilon")
NORM_EPSILON = 1e-5  # Megatron-LM's default of --norm-epsilon, and angpt's


def _ignored(config: RunConfig) -> list[str]:
    """A line for each given flag that Megatron-LM ignores."""
    lines = []
    for dest, value in config.megatron.items():
        flag = "--" + dest[len("megatron_"):].replace("_", "-")
        decision = decide("", flag)
        if decision is not None and decision.status == IGNORED and value not in (None, False):
            lines.append(f"{flag}: ignored, as in Megatron-LM ({decision.why})")
    return lines


def family_has_qk_norms(config: RunConfig) -> bool:
    """Whether the model normalizes queries and keys with norm layers of their own (GPT+ always; GPT with
    --qk-layernorm; anGPT and nGPT normalize them without gains of a norm layer)."""
    family = config.model.model_family
    return family == "gptplus" or (family == "gpt" and config.architecture.qk_layernorm)


def _gated_mlp_notes(config: RunConfig) -> list[str]:
    """--glu-linear-offset and --activation-func-clamp-value where megatron-core's MLP does not read them (gpt)."""
    architecture = config.architecture
    clamp = architecture.activation_func_clamp_value is not None
    given = [flag for flag, value in (("--glu-linear-offset", architecture.glu_linear_offset),
                                      ("--activation-func-clamp-value", clamp)) if value]
    if config.model.model_family != "gpt" or not given:
        return []
    if not (architecture.swiglu or architecture.quick_geglu):
        return [f"{' and '.join(given)}: megatron-core applies {'them' if len(given) > 1 else 'it'} in a gated MLP "
                "(--swiglu, --quick-geglu) only (as in Megatron-LM, nothing changes)"]
    fused = config.fusion.bias_swiglu_fusion if architecture.swiglu else config.fusion.bias_gelu_fusion
    if fused and clamp:
        return ["--activation-func-clamp-value: megatron-core's fused activation does not clamp (as in Megatron-LM, "
                "nothing changes)"]
    return []


def _tokenizer_notes(config: RunConfig) -> list[str]:
    """The tokenizer flags that Megatron-LM 0.16's build_tokenizer (megatron-core's library) does not pass to the
    tokenizer of --tokenizer-type."""
    data, lines = config.data, []
    kind = data.tokenizer_type
    if config.megatron.get("megatron_tokenizer_sentencepiece_legacy") and kind not in SENTENCEPIECE_TYPES:
        lines.append(f"--tokenizer-sentencepiece-legacy: {kind} is not a SentencePiece tokenizer (as in Megatron-LM, "
                     "nothing changes)")
    if data.tiktoken_special_tokens and data.tokenizer_special_tokens == data.tiktoken_special_tokens:
        lines.append("--tiktoken-special-tokens: deprecated in Megatron-LM, which takes it as "
                     "--tokenizer-special-tokens (so here)")
    elif data.tiktoken_special_tokens:
        lines.append("--tiktoken-special-tokens: ignored, as in Megatron-LM, where --tokenizer-special-tokens is given")
    if data.tokenizer_hf_include_special_tokens and kind not in ("HuggingFaceTokenizer", "GPT2BPETokenizer",
                                                                 *BERT_TYPES):
        lines.append(f"--tokenizer-hf-include-special-tokens: read by the Hugging Face, GPT-2 and BERT tokenizers "
                     f"only, not {kind} (as in Megatron-LM, nothing changes)")
    if kind == "BertWordPieceCase" and data.tokenizer_special_tokens:
        lines.append("--tokenizer-special-tokens: BertWordPieceCase takes <extra_id_0> ... <extra_id_99> in their "
                     "place (as in Megatron-LM, ignored)")
    if config.megatron.get("megatron_legacy_tokenizer"):
        lines.append(f"--legacy-tokenizer: Megatron-LM's legacy {kind} gives the vocabulary size, end of document and "
                     "pad id of megatron-core's (as in Megatron-LM, nothing changes for preprocessed data)")
    if kind == "NullTokenizer":
        given = [flag for flag, value in (("--tokenizer-special-tokens", data.tokenizer_special_tokens),
                                          ("--tokenizer-metadata", data.tokenizer_metadata)) if value]
        if given:
            lines.append(f"{' and '.join(given)}: NullTokenizer does not read {'them' if len(given) > 1 else 'it'} "
                         "(as in Megatron-LM, nothing changes)")
    return lines


def _fim_notes(config: RunConfig) -> list[str]:
    """The FIM flags where Megatron-LM reads them otherwise or not at all, and how its GPTFIMDataset draws."""
    data = config.data
    defaults = RunConfig().data
    given = [option_of(name) for name in vars(data) if name.startswith("fim_") and name != "fim_data"
             and getattr(data, name) != getattr(defaults, name)]
    if not data.fim_data:
        return [f"{', '.join(given)}: without --fim-data there is no FIM data (as in Megatron-LM, nothing changes)"] \
            if given else []
    lines = ["--fim-data: as in Megatron-LM, GPTFIMDataset draws its choices from one random generator per dataset "
             "(and DataLoader worker, --num-workers), seeded with --seed when the datasets are built, in the order the "
             "samples are read: a resumed run draws afresh from the seed, so its samples after the resume differ "
             "from an uninterrupted run's"]
    if data.fim_fragment_rate is not None and not data.fim_split_sample:
        lines.append("--fim-fragment-rate: without --fim-split-sample no document is split into fragments (as in "
                     "Megatron-LM, nothing changes)")
    return lines


def _mtp_notes(config: RunConfig) -> list[str]:
    """The multi-token prediction flags where Megatron-LM reads them otherwise or not at all (gpt)."""
    architecture, parallel, lines = config.architecture, config.parallel, []
    if not architecture.mtp_num_layers and architecture.mtp_loss_scaling_factor != 0.1:
        lines.append("--mtp-loss-scaling-factor: without --mtp-num-layers there is no MTP loss to weigh (as in "
                     "Megatron-LM, nothing changes)")
    if architecture.mtp_num_layers and config.model.recompute_granularity == "full" \
            and config.model.recompute_method == "block":
        lines.append("--recompute-method block: megatron-core does not recompute the MTP layers (its warning: not "
                     "supported for MTP yet), as in Megatron-LM")
    if architecture.mtp_standalone:
        if parallel.pipeline_model_parallel_layout:
            lines.append("--mtp-standalone: megatron-core sets it from --pipeline-model-parallel-layout (on where m "
                         "sits on a stage before the last), whatever the flag says (as in Megatron-LM)")
        elif parallel.pipeline_model_parallel_size == 1:
            lines.append("--mtp-standalone: without pipeline parallelism no stage sends to another (as in "
                         "Megatron-LM, nothing changes)")
        else:
            lines.append("--mtp-standalone: the pipeline stages exchange the shapes of what they send first "
                         "(megatron-core's p2p); the MTP layers stay on the last stage, where no "
                         "--pipeline-model-parallel-layout places them (as in Megatron-LM)")
    return lines


def _logging_notes(config: RunConfig, cuda: bool) -> list[str]:
    logging, lines = config.logging, []
    if logging.tensorboard_log_interval == 0:
        lines.append("--tensorboard-log-interval 0: no step's own figures go to TensorBoard or W&B, only the other "
                     "figures of each --log-interval record (Megatron-LM writes no TensorBoard without "
                     "--tensorboard-dir)")
    if not logging.log_loss_scale_to_tensorboard and not config.precision.fp16:
        lines.append("--no-log-loss-scale-to-tensorboard: without --fp16 there is no loss scale to log (nothing "
                     "changes)")
    for given, flag in ((logging.log_memory_interval is not None, "--log-memory-interval"),
                        (logging.log_device_memory_used, "--log-device-memory-used")):
        if given and not cuda:
            lines.append(f"{flag}: without CUDA there is no CUDA memory to report (nothing changes)")
    if logging.log_device_memory_used and cuda and logging.log_memory_interval is None:
        lines.append("--log-device-memory-used: its figure goes into the reports of --log-memory-interval, not given "
                     "(angpt makes no report after the first iterations, as Megatron-LM does: the log line's mem is "
                     "the peak allocation)")
    if logging.log_progress and not config.checkpoint.save:
        lines.append("--log-progress: without --save there is no progress.txt (as in Megatron-LM, nothing is "
                     "written)")
    if logging.log_energy and not cuda:
        lines.append("--log-energy: without CUDA there is no GPU energy counter to read (nothing changes)")
    elif logging.log_energy and importlib.util.find_spec("pynvml") is None:
        lines.append("--log-energy: reading the GPUs' energy needs nvidia-ml-py (pynvml), which is not installed: "
                     "nothing is measured (Megatron-LM logs 0 J then)")
    return lines


def _checkpoint_notes(config: RunConfig) -> list[str]:
    """notes' lines of the checkpoint flags: what --use-checkpoint-args took, what a checkpoint saved without the
    optimizer or RNG states needs to resume, and the flags that change nothing in the run given them."""
    checkpoint, precision = config.checkpoint, config.precision
    lines = [f"--use-checkpoint-args: {checkpoint.flags_from_checkpoint}"] if checkpoint.flags_from_checkpoint else []
    if checkpoint.save and checkpoint.no_save_optim:
        lines.append("--no-save-optim: the checkpoints hold no optimizer state nor learning-rate schedule: a resume "
                     "from them needs --no-load-optim or --finetune (it is not exact)")
    if checkpoint.save and checkpoint.no_save_rng:
        lines.append("--no-save-rng: the checkpoints hold no RNG states: a resume from them needs --no-load-rng or "
                     "--finetune (it is not exact)")
    distributed_torch_dist = config.parallel.use_distributed_optimizer and checkpoint.ckpt_format == "torch_dist"
    for given, without, what in (
            ((checkpoint.no_save_optim or checkpoint.no_save_rng), not checkpoint.save,
             "--no-save-optim and --no-save-rng: without --save nothing is saved"),
            (checkpoint.non_persistent_save_interval, not checkpoint.save,
             "--non-persistent-save-interval: without --save nothing is saved"),
            (checkpoint.exit_on_missing_checkpoint, not checkpoint.load,
             "--exit-on-missing-checkpoint: without --load no checkpoint is looked for"),
            (checkpoint.use_mp_args_from_checkpoint_args or not checkpoint.use_tokenizer_model_from_checkpoint_args,
             not checkpoint.use_checkpoint_args, "--use-mp-args-from-checkpoint-args and "
             "--no-use-tokenizer-model-from-checkpoint-args: without --use-checkpoint-args no flag is taken from a "
             "checkpoint"),
            (checkpoint.load_main_params_from_ckpt, not (precision.bf16 or precision.fp16),
             "--load-main-params-from-ckpt: without --bf16 or --fp16 the model's weights are the main ones"),
            (checkpoint.load_main_params_from_ckpt, config.parallel.use_megatron_fsdp,
             "--load-main-params-from-ckpt: Megatron-FSDP's main weights are the ones its checkpoint loads"),
            (checkpoint.distrib_optim_fully_reshardable_mem_efficient, not distributed_torch_dist,
             "--distrib-optim-fully-reshardable-mem-efficient: it applies to the distributed optimizer's state in "
             "torch_dist checkpoints only")):
        if given and without:
            lines.append(f"{what} (as in Megatron-LM, nothing changes)")
    return lines


def _ddp_notes(config: RunConfig) -> list[str]:
    """A line for each data-parallel flag given where, as in Megatron-LM, it changes nothing."""
    parallel, lines = config.parallel, []
    # megatron-core's DDP reduces the gradients in one bucket without the overlap (bucket_size None).
    for given, flag in ((parallel.ddp_num_buckets is not None, "--ddp-num-buckets"),
                        (parallel.ddp_bucket_size is not None, "--ddp-bucket-size")):
        if given and not parallel.overlap_grad_reduce:
            lines.append(f"{flag}: without --overlap-grad-reduce the gradients are reduced at once, in one bucket (as "
                         "in Megatron-LM, nothing changes)")
    # Only the distributed optimizer's buffers reduce-scatter, and pad their buckets; not Megatron-FSDP's.
    sharded = parallel.use_distributed_optimizer and not parallel.use_megatron_fsdp
    if parallel.pad_buckets_for_high_nccl_busbw and not sharded:
        lines.append("--ddp-pad-buckets-for-high-nccl-busbw: only the distributed optimizer's buckets are padded, "
                     "and this run has none (as in Megatron-LM, nothing changes)")
    if parallel.reduce_scatter_with_fp32_accumulation and not sharded:
        lines.append("--ddp-reduce-scatter-with-fp32-accumulation: only the distributed optimizer's gradients are "
                     "reduce-scattered, and this run has none (as in Megatron-LM, nothing changes)")
    pipelined = parallel.pipeline_model_parallel_size > 1
    if not parallel.align_grad_reduce and not (parallel.overlap_grad_reduce and pipelined):
        lines.append("--no-align-grad-reduce: the stages' overlapped gradient reductions are aligned only with "
                     "--overlap-grad-reduce and pipeline parallelism (as in Megatron-LM, nothing changes)")
    if not parallel.align_param_gather and not (parallel.overlap_param_gather and parallel.virtual_pipeline_stages):
        lines.append("--no-align-param-gather: the stages' overlapped weight all-gathers are aligned only with "
                     "--overlap-param-gather and the interleaved schedule (as in Megatron-LM, nothing changes)")
    if parallel.fake_process_group:
        lines.append("--fake-process-group: every collective is skipped, so the losses and norms are this rank's own; "
                     "no NaN checks and no gloo process groups (as Megatron-LM sets them)")
    if parallel.create_all_gather_group and not parallel.use_megatron_fsdp:
        lines.append("--create-all-gather-group: only Megatron-FSDP's all-gathers use the group (as in Megatron-LM, "
                     "nothing changes)")
    return lines


def _object_storage_notes(config: RunConfig) -> list[str]:
    """--object-storage-cache-path without a prefix in object storage, and what such a prefix changes of other
    flags (megatron-core's GPTDataset.build_low_level_dataset and _build_document_sample_shuffle_indices)."""
    data = config.data
    stored = [prefix for prefix in data.prefixes() if is_object_storage_path(prefix)]
    if not stored:
        return ["--object-storage-cache-path: no dataset prefix is in object storage (s3:// or msc://): it changes "
                "nothing (as in Megatron-LM)"] if data.object_storage_cache_path else []
    lines = []
    if data.data_cache_path is None:
        lines.append(f"{stored[0]}: without --data-cache-path megatron-core writes the datasets' index caches beside "
                     "the prefix read as a local path, under ./" + os.path.normpath(os.path.join(stored[0], "cache"))
                     + " here (as in Megatron-LM)")
    if data.per_dataset_sequences_path:
        lines.append("--per-dataset-sequences-path: megatron-core reads the counts of a prefix in object storage from "
                     "its .idx, not from the file (as in Megatron-LM)")
    return lines


def _cuda_graph_scope_notes(config: RunConfig) -> list[str]:
    """What --cuda-graph-scope captures where it does not say it itself (megatron-core 0.16.1's local graphs:
    TransformerLayer.create_mcore_cudagraph_manager, the schedules' create_cudagraphs)."""
    scope = config.fusion.cuda_graph_scope
    if not scope:
        return []
    given = f"--cuda-graph-scope {' '.join(scope)}"
    if config.fusion.cuda_graph_impl == "none":
        return [f"{given}: without --cuda-graph-impl nothing is captured (as in Megatron-LM, nothing changes)"]
    if scope == ("full",):
        return [f"{given}: Megatron-LM's deprecated name of no scope: each whole layer is captured"]
    if "full_iteration" in scope:
        if scope == ("full_iteration",):
            return []
        return [f"{given}: the whole iteration is captured; megatron-core then creates no graph of a layer (its "
                "schedules create them only without full_iteration)"]
    if "attn" in scope or "mlp" in scope:
        return [f"{given}: megatron-core's local CUDA graphs capture each whole layer, as with no scope (they do not "
                "split a layer)"]
    return [f"{given}: megatron-core graphs Mamba layers only, and this model has none: nothing is captured"]


def notes(config: RunConfig, cuda: bool = True) -> list[str]:
    """The lines a run logs once about Megatron-LM flags the family replaced, that Megatron-LM turns off, or that it
    ignores (`cuda`: whether the run has CUDA devices)."""
    lines = _ignored(config)
    if config.parallel.sequence_parallel_disabled:
        lines.append("--sequence-parallel: off, as in Megatron-LM, with --tensor-model-parallel-size 1")
    if config.rerun.test_mode and not family_has_qk_norms(config):
        lines.append("--test-mode: megatron-core's real-time test checks the q and k layer norms, which this model "
                     "has none of: nothing to check")
    if config.optimizer.apply_wd_to_qk_layernorm:
        if family_has_qk_norms(config):
            if config.model.model_family == "gptplus":
                lines.append("--apply-wd-to-qk-layernorm: GPT+'s q and k norm gains are decayed, which the paper's "
                             "recipe leaves undecayed (docs/model.md)")
        else:
            lines.append("--apply-wd-to-qk-layernorm: this model has no q and k norm gains to decay")
    if config.parallel.virtual_pipeline_stages and config.parallel.overlap_p2p_comm and not cuda:
        lines.append("--overlap-p2p-communication" + ("-warmup-flush" if config.parallel.overlap_p2p_comm_warmup_flush
                                                      else " (Megatron-LM's default)")
                     + ": not without CUDA: gloo matches the messages between two ranks in posting order, so the "
                       "interleaved schedule's exchanges run one at a time here")
    if config.precision.first_last_layers_bf16 and not config.precision.fp8_format:
        lines.append("--first-last-layers-bf16: without --fp8-format every layer is in BF16 already (as in "
                     "Megatron-LM, nothing changes)")
    if config.optimizer.no_weight_decay_cond_type:
        lines.append("--no-weight-decay-cond-type apply_wd_to_qk_layernorm: deprecated in Megatron-LM, which takes it "
                     "as --apply-wd-to-qk-layernorm (so here)")
    if config.evaluation.skip_train:
        lines.append("--skip-train: as in Megatron-LM, the optimizer state is not loaded (--no-load-optim), and "
                     "nothing is saved or written to TensorBoard or W&B")
    memory = config.memory
    for given, flag in ((memory.offload_modules, "--offload-modules"),
                        (memory.min_offloaded_tensor_size != 1024 * 1024, "--min-offloaded-tensor-size")):
        if given and not memory.fine_grained_activation_offloading:
            lines.append(f"{flag}: without --fine-grained-activation-offloading nothing is offloaded (as in "
                         "Megatron-LM, nothing changes)")
    if config.training.train_sync_interval and not cuda:
        lines.append("--train-sync-interval: without CUDA there is no device to wait for (nothing changes)")
    if config.precision.disable_bf16_reduced_precision_matmul and not config.precision.bf16:
        lines.append("--disable-bf16-reduced-precision-matmul: without --bf16 there are no bf16 GEMMs (as in "
                     "Megatron-LM, nothing changes)")
    lines += _cuda_graph_scope_notes(config)
    lines += _gated_mlp_notes(config)
    lines += _tokenizer_notes(config)
    lines += _mtp_notes(config)
    lines += _object_storage_notes(config)
    lines += _fim_notes(config)
    if not config.parallel.clone_scatter_output_in_embedding and not config.parallel.sequence_parallel:
        lines.append("--no-clone-scatter-output-in-embedding: without --sequence-parallel the embeddings are not "
                     "scattered (as in Megatron-LM, nothing changes)")
    precision = config.precision
    if not precision.fp8_wgrad and not (precision.fp8_format and precision.fp8_recipe == "delayed"):
        lines.append("--no-fp8-wgrad: megatron-core overrides the weight gradients' precision in --fp8-format's "
                     "delayed recipe only (as in Megatron-LM, nothing changes)")
    lines.extend(_logging_notes(config, cuda))
    lines += _ddp_notes(config)
    if config.checkpoint.async_save and config.checkpoint.ckpt_format == "fsdp_dtensor":
        lines.append("--async-save: fsdp_dtensor checkpoints are written by the training processes before training "
                     "goes on (as Megatron-LM writes them, whatever --async-save says)")
    if config.checkpoint.use_persistent_ckpt_worker and not config.checkpoint.async_save:
        lines.append("--use-persistent-ckpt-worker: without --async-save, saves are written by the training "
                     "processes, with no background writer (as in Megatron-LM)")
    lines += _checkpoint_notes(config)
    if config.parallel.wgrad_deferral_limit and not config.parallel.defer_embedding_wgrad_compute:
        lines.append("--wgrad-deferral-limit: without --defer-embedding-wgrad-compute nothing is deferred (as in "
                     "Megatron-LM, nothing changes)")
    if config.parallel.cp_comm_type_all_gather_default:
        lines.append("--cp-comm-type: all_gather, the only one built on --transformer-impl local (Megatron-LM's "
                     "default p2p needs Transformer Engine)")
    family = config.model.model_family
    values, defaults = config.flags(), RunConfig().flags()
    given = [(dest, values[dest]) for dest in NORM_FLAGS if values[dest] != defaults[dest]]
    if family not in NORMALIZED_FAMILIES or not given:
        return lines
    shown = ", ".join(option_of(dest) + ("" if value is True else f" {value}") for dest, value in given)
    return [*lines, f"{shown}: replaced by {FAMILY_NAMES[family]}'s own normalization (docs/model.md)"]
