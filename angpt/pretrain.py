"""Pretrain a model of one family with Megatron-style flags, under torchrun.

    torchrun --nproc-per-node 2 -m angpt.pretrain --model-family angpt --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-3

Data are Megatron indexed datasets (`tools/preprocess_data.py` writes them) read through megatron-core's
GPTDataset: `--data-path PREFIX` or `--data-path W1 PREFIX1 W2 PREFIX2` with `--split`, or
`--train-data-path ...`; `--mock-data --vocab-size V` trains on megatron-core's synthetic sequences.
Checkpoints and evaluation come with the trainer work.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from angpt.models.config import FACTOR_MODES, MODEL_FAMILIES, NU_P_READINGS, POST_NORMS, RESIDUALS

logger = logging.getLogger("angpt.pretrain")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model-family", choices=MODEL_FAMILIES, default="angpt")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--ffn-hidden-size", type=int, help="width of each SwiGLU half (default 4 x hidden)")
    model.add_argument("--kv-channels", type=int, help="head dim (default hidden / heads)")
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--rotary-base", type=int, default=10000)
    tying = model.add_mutually_exclusive_group()
    tying.add_argument("--tie-embeddings-and-output-weights", action="store_true",
                       help="use the embedding as the output head (default: untied, as in the spec)")
    tying.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="accepted for Megatron-LM scripts; untied is already the default")
    angpt = parser.add_argument_group("anGPT switches (spec sections 2-6 and 9)")
    angpt.add_argument("--angpt-post-norm", choices=POST_NORMS, default="l2")
    angpt.add_argument("--angpt-nu-p", choices=NU_P_READINGS, default="one")
    angpt.add_argument("--angpt-alpha-init", type=float, help="default 0.01 (anGPT), 0.05 (nGPT)")
    angpt.add_argument("--angpt-constant-factors", choices=FACTOR_MODES, default="analytic")
    angpt.add_argument("--angpt-constant-factor-multiplier", type=float, default=1.0)
    angpt.add_argument("--angpt-nu-alpha", choices=FACTOR_MODES, default="analytic")
    angpt.add_argument("--angpt-nu-alpha-multiplier", type=float, default=1.0)
    angpt.add_argument("--angpt-no-nu-alpha-grad", action="store_true", help="treat nu(alpha) as a constant")
    angpt.add_argument("--angpt-residual", choices=RESIDUALS, default="lerp")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--use-distributed-optimizer", action="store_true")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=4)
    train.add_argument("--global-batch-size", type=int, default=8)
    train.add_argument("--train-iters", type=int, default=20)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--min-lr", type=float, help="default: the family's (0.1 lr; 0 for nGPT)")
    train.add_argument("--lr-warmup-iters", type=int, help="default: the family's (none; 1%% for GPT+)")
    train.add_argument("--weight-decay", type=float, help="default: the family's (0; 0.1 for GPT+)")
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.95)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=1)
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    data.add_argument("--split", default="969,30,1", help="train,valid,test weights of --data-path")
    data.add_argument("--train-data-path", nargs="+")
    data.add_argument("--valid-data-path", nargs="+")
    data.add_argument("--test-data-path", nargs="+")
    data.add_argument("--data-cache-path", help="where GPTDataset caches its indices")
    data.add_argument("--mock-data", action="store_true", help="megatron-core's synthetic sequences")
    data.add_argument("--vocab-size", type=int, help="vocabulary of --mock-data")
    data.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                      help="pad the vocabulary to a multiple of this times the tensor-parallel size")
    args = parser.parse_args(argv)
    validate(parser, args, int(os.environ.get("WORLD_SIZE", 1)))
    return args


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> None:
    """Refuse impossible layouts before any process-group work, naming the flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        parser.error(f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp} "
                     f"x --pipeline-model-parallel-size {pp}")
    dp = world_size // (tp * pp)
    if args.num_attention_heads % tp:
        parser.error(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        parser.error(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.num_layers_per_virtual_pipeline_stage and (args.num_layers // pp) % args.num_layers_per_virtual_pipeline_stage:
        parser.error("--num-layers / --pipeline-model-parallel-size is not divisible by "
                     "--num-layers-per-virtual-pipeline-stage")
    if args.global_batch_size % (args.micro_batch_size * dp):
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                     f"{args.micro_batch_size} x data-parallel size {dp}")
    if args.sequence_parallel and tp == 1:
        parser.error("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if not (args.data_path or args.train_data_path or args.mock_data):
        parser.error("no training data: give --data-path, --train-data-path or --mock-data")
    if args.mock_data and not args.vocab_size:
        parser.error("--mock-data needs --vocab-size")
    from angpt.data.gpt_datasets import parse_blend

    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        values = getattr(args, flag)
        if not values:
            continue
        try:
            prefixes, _ = parse_blend(values)
        except ValueError as error:
            parser.error(str(error).replace("--data-path", f"--{flag.replace('_', '-')}"))
        for prefix in prefixes:
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                parser.error(f"--{flag.replace('_', '-')} {prefix}: no {' or '.join(prefix + e for e in missing)}")


def data_arguments(args):
    from angpt.data.gpt_datasets import DataArguments

    return DataArguments(
        data_path=args.data_path, split=args.split, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        data_cache_path=args.data_cache_path, mock_data=args.mock_data, vocab_size=args.vocab_size,
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's padding of the vocabulary, so the head splits evenly over tensor-parallel ranks."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def main(argv=None) -> None:
    args = parse_args(argv)
    from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary, micro_batches

    data = data_arguments(args)
    try:
        vocabulary = dataset_vocabulary(data)
    except (ValueError, OSError) as error:
        raise SystemExit(f"angpt.pretrain: {error}") from None
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    from megatron.core import parallel_state

    from angpt import distributed
    from angpt.models import model_config
    from angpt.optimizer import build_optimizer
    from angpt.training import build_model_chunks, train_step

    pp = args.pipeline_model_parallel_size
    virtual = None
    if args.num_layers_per_virtual_pipeline_stage:
        virtual = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    distributed.initialize(args.tensor_model_parallel_size, pp, virtual, args.seed)
    overrides = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=torch.float32,
        post_norm=args.angpt_post_norm,
        nu_p_reading=args.angpt_nu_p,
        alpha_init=args.angpt_alpha_init,
        constant_factors=args.angpt_constant_factors,
        constant_factor_multiplier=args.angpt_constant_factor_multiplier,
        nu_alpha_mode=args.angpt_nu_alpha,
        nu_alpha_multiplier=args.angpt_nu_alpha_multiplier,
        nu_alpha_grad=not args.angpt_no_nu_alpha_grad,
        residual=args.angpt_residual,
        share_embeddings_and_output_weights=args.tie_embeddings_and_output_weights,
        rotary_base=args.rotary_base,
    )
    if args.model_family == "ngpt":  # nGPT fixes its own factors and residual.
        for key in ("constant_factors", "nu_alpha_mode"):
            overrides.pop(key)
    if args.ffn_hidden_size:
        overrides["ffn_hidden_size"] = args.ffn_hidden_size
    if args.kv_channels:
        overrides["kv_channels"] = args.kv_channels
    if not torch.cuda.is_available():
        # The interleaved schedule's batched p2p gives wrong gradients on gloo at PP=2.
        overrides.update(batch_p2p_comm=False, batch_p2p_sync=False)
    config = model_config(args.model_family, **overrides)

    from megatron.core.distributed import DistributedDataParallelConfig

    vocab_size = padded_vocab_size(vocabulary.vocab_size, args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)
    chunks = build_model_chunks(
        config, vocab_size, args.seq_length,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer),
    )
    optimizer, scheduler = build_optimizer(
        chunks, args.model_family, lr=args.lr, train_iters=args.train_iters, min_lr=args.min_lr,
        weight_decay=args.weight_decay, lr_warmup_iters=args.lr_warmup_iters, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    train_samples = args.train_iters * args.global_batch_size
    train_data, _, _ = build_datasets(data, vocabulary, args.seq_length, args.seed, [train_samples, 0, 0])
    rank = torch.distributed.get_rank()
    if rank == 0:
        params = sum(p.numel() for c in chunks for p in c.parameters())
        logger.info("%s: %d layers, d=%d, vocabulary %d (padded %d), %d parameters on rank 0; "
                    "%d training samples; world %d (TP %d, PP %d, DP %d)",
                    args.model_family, args.num_layers, args.hidden_size, vocabulary.vocab_size, vocab_size,
                    params, len(train_data), torch.distributed.get_world_size(),
                    args.tensor_model_parallel_size, pp, parallel_state.get_data_parallel_world_size())
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    for iteration in range(1, args.train_iters + 1):
        start, lr = time.perf_counter(), optimizer.param_groups[0]["lr"]
        consumed_samples = (iteration - 1) * args.global_batch_size
        batches = micro_batches(train_data, consumed_samples, args.global_batch_size, args.micro_batch_size,
                                dp_rank, dp_size)
        iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        loss, grad_norm, updated = train_step(iterators, chunks, optimizer, scheduler, len(batches),
                                              args.micro_batch_size, args.seq_length)
        if rank == 0 and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            logger.info("iteration %d/%d | lm loss %.4f | grad norm %.3f | lr %.3e | %.2f s%s",
                        iteration, args.train_iters, loss, grad_norm or float("nan"), lr,
                        time.perf_counter() - start,
                        "" if updated else " | skipped")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
