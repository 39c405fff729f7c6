"""Megatron-LM's training flags with its meaning: --decoupled-lr and --decoupled-min-lr, --num-workers,
--grad-reduce-in-bf16
and --ddp-bucket-size, --manual-gc (with --manual-gc-interval, --no-manual-gc-eval), --empty-unused-memory-level,
--no-mmap-bin-files, --deterministic-mode, --dist-ckpt-strictness, --use-tp-pp-dp-mapping, --ddp-average-in-collective,
--override-opt_param-scheduler, --save-retain-interval, --num-virtual-stages-per-pipeline-rank,
--no-overlap-p2p-communication and --overlap-p2p-communication-warmup-flush, --test-mode,
--check-weight-hash-across-dp-replicas-interval, --expert-tensor-parallel-size, --num-distributed-optimizer-instances
(trained in tests/test_parallel_equivalence.py)."""

import gc
import json
import logging
import math
import os
import re

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import TorchFullyShardedDataParallelConfig
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.transformer.attention import SelfAttention
from test_gpt_datasets import two_prefixes  # noqa: F401 (a fixture)
from test_optimizer import batch, tiny_chunks
from test_trainer import losses

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.choices import MODEL_FAMILIES
from angpt.config.sections import DIST_CKPT_STRICTNESS, DataSection, RunConfig
from angpt.data.gpt_datasets import TrainingBatches, build_datasets, dataset_vocabulary, micro_batches
from angpt.models import build_model
from angpt.training import checkpoint_store, checkpointing, distributed
from angpt.training import step as step_module
from angpt.training import trainer as trainer_module
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.optimizer import build_optimizer, optimizer_config

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]


def test_decoupled_lr_gives_the_input_and_output_layers_their_own_max_and_min_lr(seeded):
    """megatron-core's param groups: the embedding and the output head follow the schedule between
    --decoupled-lr and --decoupled-min-lr, every other weight between --lr and --min-lr (cosine, no warm-up)."""
    chunks = tiny_chunks("gptplus")
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family="gptplus", lr=1e-3, min_lr=1e-4, train_iters=10, lr_warmup_iters=0, decoupled_lr=5e-3,
        decoupled_min_lr=5e-4)))
    decoupled = {id(chunks[0].module.embedding.word_embeddings.weight), id(chunks[0].module.output_layer.weight)}
    for step in range(12):
        coefficient = 0.5 * (math.cos(math.pi * min(step, 10) / 10) + 1)
        for group in optimizer.param_groups:
            params = {id(p) for p in group["params"]}
            assert params <= decoupled or not params & decoupled
            assert group["is_decoupled_lr"] == (params <= decoupled)
            top, bottom = (5e-3, 5e-4) if params <= decoupled else (1e-3, 1e-4)
            assert group["lr"] == pytest.approx(bottom + coefficient * (top - bottom), rel=1e-12)
        assert get_canonical_lr_for_logging(optimizer.param_groups) == pytest.approx(
            1e-4 + coefficient * (1e-3 - 1e-4), rel=1e-12)
        scheduler.step(increment=1)
    assert decoupled <= {id(p) for group in optimizer.param_groups for p in group["params"]}
    with pytest.raises(ValueError, match="decouples nothing"):
        build_optimizer(chunks, RunConfig.from_flags(dict(model_family="gptplus", lr=1e-3, min_lr=1e-4,
                                                          train_iters=10, decoupled_lr=1e-3)))


@pytest.mark.slow  # three in-process trainer runs
def test_a_run_with_decoupled_lr_resumes_exactly(tmp_path, single_process):
    """megatron-core 0.16 matched the saved groups to the optimizer's without telling the decoupled group
    apart: a resumed run's steps differed (the distributed optimizer), or the load failed (this one)."""
    flags = [*MOCK[:-2], "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--eval-iters", "0", "--lr", "1e-3", "--min-lr", "1e-4", "--decoupled-lr",
             "5e-3", "--decoupled-min-lr", "5e-4", "--train-iters", "4", "--log-interval", "1"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    assert in_process_trainer([*flags, "--save", str(uninterrupted), "--save-interval", "2"]).run() == 0
    assert in_process_trainer([*flags, "--save", str(resumed), "--exit-interval", "2"]).run() == 0
    assert in_process_trainer([*flags, "--save", str(resumed), "--load", str(resumed)]).run() == 0
    assert losses(resumed) == losses(uninterrupted) and sorted(losses(resumed)) == [1, 2, 3, 4]


def test_gradients_reduce_in_fp32_unless_grad_reduce_in_bf16_and_the_bucket_size_reaches_ddp():
    default = ddp_config(parse_args(MOCK, world_size=1))
    assert default.grad_reduce_in_fp32 and default.bucket_size is None
    bf16 = parse_args([*MOCK, "--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16", "--ddp-bucket-size",
                       "1000000"], world_size=1)
    assert not ddp_config(bf16).grad_reduce_in_fp32 and ddp_config(bf16).bucket_size == 1000000


@pytest.mark.parametrize("family", ["gpt", "angpt"])
def test_disable_bf16_reduced_precision_matmul_turns_cublas_reduced_precision_off_under_bf16(family, monkeypatch):
    """megatron-core's TransformerConfig field, as Megatron-LM passes it: under --bf16 the model's config turns torch's
    allow_bf16_reduced_precision_reduction off; without --bf16 nothing changes, and the run says so in one line."""
    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", True)
    flags = [*MOCK, "--model-family", family, "--disable-bf16-reduced-precision-matmul"]
    transformer_config(parse_args([*flags, "--bf16"], world_size=1))
    assert matmul.allow_bf16_reduced_precision_reduction is False
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", True)
    fp32 = parse_args(flags, world_size=1)
    transformer_config(fp32)
    assert matmul.allow_bf16_reduced_precision_reduction is True
    assert [line for line in megatron_lm.notes(fp32, cuda=False) if "bf16" in line] == [
        "--disable-bf16-reduced-precision-matmul: without --bf16 there are no bf16 GEMMs (as in Megatron-LM, nothing "
        "changes)"]


def test_the_new_flags_take_zero_their_boundary():
    """0 is the least each takes (-1 is refused, above): --train-sync-interval 0 (off), --ckpt-step 0, a weight
    decay schedule from 0 to 0."""
    config = parse_args([*MOCK, "--train-sync-interval", "0", "--load", "x", "--ckpt-step", "0",
                         "--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0"],
                        world_size=1)
    assert (config.training.train_sync_interval, config.checkpoint.ckpt_step, config.optimizer.start_weight_decay,
            config.optimizer.end_weight_decay) == (0, 0, 0.0, 0.0)


def test_train_sync_interval_waits_for_the_device_every_so_many_steps(monkeypatch):
    """Megatron-LM's: torch.cuda.synchronize() at the steps that are multiples of the interval (3: steps 3 and 6 of
    7), none without it; without CUDA none, and the run says so in one line."""
    synchronized = []
    monkeypatch.setattr(step_module.torch.cuda, "synchronize", lambda: synchronized.append(True))
    for interval, cuda, expected in ((3, True, 2), (None, True, 0), (3, False, 0)):
        synchronized.clear()
        monkeypatch.setattr(step_module.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for iteration in range(1, 8):
            step_module.wait_for_the_device(iteration, interval)
        assert len(synchronized) == expected, (interval, cuda)
    config = parse_args([*MOCK, "--train-sync-interval", "3"], world_size=1)
    assert config.training.train_sync_interval == 3
    assert "--train-sync-interval: without CUDA there is no device to wait for (nothing changes)" in \
        megatron_lm.notes(config, cuda=False)


@pytest.mark.parametrize("argv,message", [
    (["--train-sync-interval", "-1"], "--train-sync-interval -1 cannot be negative"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--decoupled-min-lr", "1e-4"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--manual-gc-interval", "2"], "--manual-gc-interval needs --manual-gc"),
    (["--no-manual-gc-eval"], "--no-manual-gc-eval needs --manual-gc"),
    (["--empty-unused-memory-level", "3"], "invalid choice: 3"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size 0 must be at least 1"),
    (["--save", "x", "--save-interval", "2", "--save-retain-interval", "3"],
     "--save-retain-interval 3 must be a multiple of --save-interval 2"),
    (["--save", "x", "--save-retain-interval", "4"], "--save-retain-interval needs --save-interval"),
    (["--save-retain-interval", "4"], "--save-retain-interval needs --save"),
    (["--save", "x", "--save-interval", "2", "--save-retain-interval", "0"], "--save-retain-interval 0 must be at "
                                                                             "least 1"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "give one of --override-opt_param-scheduler (the flags' schedule) and --use-checkpoint-opt_param-scheduler"),
    (["--use-pytorch-profiler"], "--use-pytorch-profiler, --profile-ranks, --profile-step-start and "
                                 "--profile-step-end need --profile"),
    (["--start-weight-decay", "0"], "--start-weight-decay needs --weight-decay-incr-style linear or cosine"),
    (["--start-weight-decay", "0", "--end-weight-decay", "0.1"],
     "--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "-0.1", "--end-weight-decay", "0"],
     "--start-weight-decay -0.1 cannot be negative"),
    (["--ckpt-step", "0"], "--ckpt-step needs --load"),
    (["--load", "x", "--ckpt-step", "-1"], "--ckpt-step -1 cannot be negative"),
    (["--load", "x", "--ckpt-step", "2", "--load-fallback-to-intact"], "give one of --ckpt-step (that checkpoint) "
                                                                       "and --load-fallback-to-intact"),
])
def test_these_flags_alone_or_out_of_range_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("level,releases", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_level_releases_the_cache_after_the_backward_and_the_step(level, releases, seeded,
                                                                                     monkeypatch):
    calls = []
    monkeypatch.setattr(step_module.torch.cuda, "empty_cache", lambda: calls.append(1))
    chunks = tiny_chunks("angpt")
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(model_family="angpt", lr=1e-3,
                                                                              train_iters=10)))
    step_module.train_step(iter([batch()]), chunks, optimizer, scheduler, 1, 2, 16, 1, level)
    assert len(calls) == releases


@pytest.mark.slow  # an in-process trainer run
def test_manual_gc_collects_at_the_interval_and_around_evaluations_with_the_collector_off(tmp_path, monkeypatch):
    collections = []
    real_collect = gc.collect

    def collect(generation=2):
        collections.append((generation, gc.isenabled()))
        return real_collect(generation)

    trainer = in_process_trainer([*MOCK, "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
                                  "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-interval", "2",
                                  "--eval-iters", "1", "--manual-gc", "--manual-gc-interval", "3"])
    monkeypatch.setattr(gc, "collect", collect)
    assert trainer.run() == 0
    assert gc.isenabled()
    # At the start; evaluations at 2 and 4 (before: all generations, after: the youngest); the interval at 3;
    # the test split's evaluation at the end.
    full, young = (2, False), (0, False)
    assert collections == [full, full, young, full, full, young, full, young]


def test_bin_files_read_without_a_memory_map_give_the_same_samples(two_prefixes, tmp_path, single_process):  # noqa: F811
    samples = []
    for mmap in (True, False):
        data = DataSection(train_data_path=(two_prefixes[0],), data_cache_path=str(tmp_path / "cache"),
                           mmap_bin_files=mmap)
        train, _, _ = build_datasets(data, dataset_vocabulary(data), 16, 1234, [32, 0, 0])
        samples.append(torch.stack([train[i]["tokens"] for i in range(32)]))
    assert torch.equal(*samples)
    assert not parse_args([*MOCK, "--no-mmap-bin-files"], world_size=1).data.mmap_bin_files


def _loss_and_grads(chunks, batches):
    for chunk in chunks:
        chunk.zero_grad_buffer()
    loss = step_module._mean_loss_over_global_batch(iter(batches), chunks, len(batches), 2, 16, forward_only=False)
    return loss, {name: p.main_grad.clone() for name, p in chunks[0].named_parameters()}


def test_calculate_per_token_loss_weighs_each_micro_batch_by_its_tokens(seeded):
    """Micro-batch A counts 24 tokens (8 masked), B all 32: per token, the loss is (sum_A + sum_B) / 56 and the
    gradient (24 g_A + 32 g_B) / 56, where g_A and g_B are each micro-batch's own mean gradient; without the
    flag, (mean_A + mean_B) / 2 and (g_A + g_B) / 2 (Megatron-LM's two losses)."""
    per_token = tiny_chunks("angpt", calculate_per_token_loss=True)
    mean = tiny_chunks("angpt")
    mean[0].load_state_dict(per_token[0].state_dict())
    a, b = batch(0), batch(1)
    a["loss_mask"][:, :4] = 0
    with torch.no_grad():
        sums = [(mean[0](x["tokens"], x["position_ids"], None, labels=x["labels"]) * x["loss_mask"]).sum().item()
                for x in (a, b)]
    loss_a, grads_a = _loss_and_grads(mean, [a])
    loss_b, grads_b = _loss_and_grads(mean, [b])
    assert (loss_a, loss_b) == pytest.approx((sums[0] / 24, sums[1] / 32), rel=1e-6)
    loss, grads = _loss_and_grads(per_token, [a, b])
    assert loss == pytest.approx((sums[0] + sums[1]) / 56, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, (24 * grads_a[name] + 32 * grads_b[name]) / 56, rtol=1e-5, atol=1e-7)
    loss, grads = _loss_and_grads(mean, [a, b])
    assert loss == pytest.approx((sums[0] / 24 + sums[1] / 32) / 2, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, (grads_a[name] + grads_b[name]) / 2, rtol=1e-5, atol=1e-7)


def test_eod_mask_loss_leaves_the_end_of_document_tokens_out_of_the_loss(two_prefixes, tmp_path,  # noqa: F811
                                                                         single_process):
    masks = []
    for eod_mask_loss in (False, True):
        data = DataSection(train_data_path=(two_prefixes[0],), data_cache_path=str(tmp_path / "cache"),
                           eod_mask_loss=eod_mask_loss)
        vocabulary = dataset_vocabulary(data)
        train, _, _ = build_datasets(data, vocabulary, 16, 1234, [32, 0, 0])
        samples = [train[i] for i in range(32)]
        masks.append(torch.stack([s["loss_mask"] for s in samples]))
    tokens = torch.stack([s["tokens"] for s in samples])
    assert (masks[0] == 1).all() and (tokens == vocabulary.eod).any()
    assert torch.equal(masks[1], (tokens != vocabulary.eod).float())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_give_the_micro_batches_of_the_inline_reads(num_workers, two_prefixes,  # noqa: F811
                                                                      tmp_path, single_process):
    """--num-workers N reads ahead in N processes; the micro-batches are those micro_batches() reads in the
    training process, in order, from any consumed-samples offset (a resumed run), through a ramp-up's sizes."""
    data = DataSection(train_data_path=(two_prefixes[0],), data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)
    train, _, _ = build_datasets(data, vocabulary, 16, 1234, [96, 0, 0])
    loader = TrainingBatches(train, 6, 1, 1, 2, num_workers, vocabulary.vocab_size)  # rank 1 of 2, from sample 6
    consumed = 6
    for global_batch in (2, 4, 4, 8, 8):
        taken = loader.take(global_batch // 2)
        expected = micro_batches(train, consumed, global_batch, 1, 1, 2, vocabulary.vocab_size)
        assert len(taken) == len(expected) == global_batch // 2
        for got, want in zip(taken, expected):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        consumed += global_batch
    loader.close()


@pytest.mark.slow
def test_profile_with_the_pytorch_profiler_traces_the_steps_asked_for(tmp_path, single_process):
    """Megatron-LM's numbering: --profile-step-start 1 --profile-step-end 3 profiles the 2nd and 3rd steps (the
    steps that start with 1 and 2 completed), written to the TensorBoard directory as a trace."""
    trainer = in_process_trainer([*MOCK, "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
                                  "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0",
                                  "--tensorboard-dir", str(tmp_path), "--profile", "--use-pytorch-profiler",
                                  "--profile-step-start", "1", "--profile-step-end", "3"])
    assert trainer.run() == 0
    traces = list(tmp_path.glob("*.pt.trace.json"))
    assert len(traces) == 1
    steps = {event["name"] for event in json.load(open(traces[0]))["traceEvents"]
             if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}


@pytest.mark.parametrize("argv,message", [
    (["--profile"], "--profile without --use-pytorch-profiler opens an Nsight Systems capture range"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile-step-end 3 must be above --profile-step-start 3"),
])
@pytest.mark.slow
def test_a_profile_that_cannot_run_here_is_refused_before_training(argv, message, tmp_path, single_process):
    """A ValueError from the trainer's construction: angpt.pretrain prints it in one line and exits with 2."""
    if torch.cuda.is_available() and "--use-pytorch-profiler" not in argv:
        pytest.skip("an Nsight Systems range runs on a GPU")
    with pytest.raises(ValueError, match=f"^{message}"):
        in_process_trainer([*MOCK, "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
                            "--micro-batch-size", "2", "--global-batch-size", "2", "--tensorboard-dir", str(tmp_path),
                            *argv])


TINY = [*MOCK, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--cross-entropy-loss-fusion", "--bf16", "--use-distributed-optimizer"],
     "--deterministic-mode with --cross-entropy-loss-fusion: the fused cross-entropy is not deterministic"),
    (["--attention-backend", "flash"], "--deterministic-mode with --attention-backend flash: flash attention is not "
     "deterministic"),
])
def test_deterministic_mode_refuses_what_megatron_lm_refuses(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, "--deterministic-mode", *argv], world_size=1)
    assert message in capsys.readouterr().err
    # Each alone is accepted; deterministic mode turns the fused cross-entropy's GPU default off.
    assert parse_args([*MOCK, *argv], world_size=1).training.deterministic_mode is False
    assert parse_args([*MOCK, "--deterministic-mode"], world_size=1).training.deterministic_mode


@pytest.fixture
def deterministic_algorithms_restored():
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.slow  # in-process trainer builds, seconds each: out of make test-fast
def test_deterministic_mode_trains_with_torchs_deterministic_algorithms(tmp_path, single_process,
                                                                        deterministic_algorithms_restored):
    trainer = in_process_trainer([*TINY, "--deterministic-mode", "--save", str(tmp_path)])
    assert torch.are_deterministic_algorithms_enabled() and trainer.config.deterministic_mode
    assert trainer.run() == 0
    first = losses(tmp_path)
    torch.use_deterministic_algorithms(False)
    again = tmp_path / "again"
    assert in_process_trainer([*TINY, "--deterministic-mode", "--save", str(again)]).run() == 0
    assert losses(again) == first and len(first) == 4


def test_deterministic_mode_on_cuda_needs_a_deterministic_nccl_algorithm(monkeypatch,
                                                                        deterministic_algorithms_restored):
    """Megatron-LM's check, made before any communicator reads NCCL_ALGO (a GPU is pretended: only the environment
    is read)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs NCCL_ALGO set to one of Tree, Ring, CollnetDirect, CollnetChain, "
                                         r"\^NVLS .*; it is not set"):
        distributed.use_deterministic_algorithms()
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(ValueError, match="it is NVLS"):
        distributed.use_deterministic_algorithms()
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    distributed.use_deterministic_algorithms(transformer_engine=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert (os.environ["CUBLAS_WORKSPACE_CONFIG"], os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]) == (":4096:8", "0")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")  # given otherwise by the user: refused
    with pytest.raises(ValueError, match="needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"):
        distributed.use_deterministic_algorithms(transformer_engine=True)


@pytest.mark.slow  # in-process trainer builds, seconds each: out of make test-fast
def test_dist_ckpt_strictness_takes_megatron_cores_values_and_reaches_the_load(tmp_path, single_process, caplog):
    assert DIST_CKPT_STRICTNESS == tuple(handling.value for handling in StrictHandling)
    assert in_process_trainer([*TINY, "--train-iters", "1", "--save", str(tmp_path)]).run() == 0
    # Without the optimizer, the checkpoint holds tensors the run does not ask for (Adam's moments): "missing".
    resume = [*TINY, "--load", str(tmp_path), "--no-load-optim"]
    with caplog.at_level(logging.WARNING, logger="angpt"):
        in_process_trainer([*resume, "--dist-ckpt-strictness", "return_all"])
    assert "--dist-ckpt-strictness return_all:" in caplog.text and "lacks 0 it asks for (none)" in caplog.text
    assert re.search(r"holds \d+ tensors this run does not load \(optimizer\.", caplog.text)
    with pytest.raises(checkpointing.CheckpointError, match="--dist-ckpt-strictness raise_all: .*optimizer"):
        in_process_trainer([*resume, "--dist-ckpt-strictness", "raise_all"])
    assert in_process_trainer([*resume, "--dist-ckpt-strictness", "raise_unexpected"]).state.iteration == 1


def test_use_tp_pp_dp_mapping_puts_a_replicas_pipeline_stages_on_neighbouring_ranks(monkeypatch, single_process):
    """World 4 = PP 2 x DP 2: megatron-core's groups of either order, and the order initialize hands it."""
    def groups(order):
        generator = parallel_state.RankGenerator(tp=1, ep=1, dp=2, pp=2, cp=1, order=order)
        return generator.get_ranks("dp"), generator.get_ranks("pp")

    assert groups("tp-cp-ep-dp-pp") == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert groups("tp-cp-ep-pp-dp") == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    orders = []
    build = parallel_state.initialize_model_parallel
    monkeypatch.setattr(parallel_state, "initialize_model_parallel",
                        lambda **kwargs: orders.append(kwargs["order"]) or build(**kwargs))
    for mapping in (True, False):
        distributed.destroy_model_parallel()
        distributed.initialize(use_tp_pp_dp_mapping=mapping)
    assert orders == ["tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp"]


def test_use_tp_pp_dp_mapping_reaches_initialize(monkeypatch):
    class Initialized(Exception):
        pass

    def initialize(*args, **kwargs):
        raise Initialized(kwargs["use_tp_pp_dp_mapping"])

    monkeypatch.setattr(trainer_module.distributed, "initialize", initialize)
    for flags, mapping in (([], False), (["--use-tp-pp-dp-mapping"], True)):
        with pytest.raises(Initialized) as initialized:
            trainer_module.Trainer(parse_args([*MOCK, *flags], world_size=1))
        assert initialized.value.args == (mapping,)


@pytest.mark.parametrize("world, etp, pp, refused", [(8, 4, 2, False), (4, 4, 1, False), (4, 4, 2, True),
                                                     (6, 4, 1, True)])
def test_expert_tensor_parallel_size_must_divide_the_world_with_the_pipeline(world, etp, pp, refused, capsys):
    """megatron-core asserts world % (ETP x EP x PP) == 0 (EP 1 here); at the limit (ETP x PP = world) it runs."""
    argv = [*MOCK, "--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "2",
            "--expert-tensor-parallel-size", str(etp), "--pipeline-model-parallel-size", str(pp)]
    if refused:
        with pytest.raises(SystemExit):
            parse_args(argv, world_size=world)
        assert (f"the world size {world} is not divisible by --expert-tensor-parallel-size {etp} x "
                f"--pipeline-model-parallel-size {pp}") in capsys.readouterr().err
    else:
        assert parse_args(argv, world_size=world).parallel.expert_tensor_parallel_size == etp


def test_expert_tensor_parallel_size_reaches_megatron_cores_expert_groups(monkeypatch, single_process):
    """A dense model has no experts: the flag goes from the trainer to initialize_model_parallel, which builds
    the expert groups of that size (None: megatron-core's default, the tensor-parallel size)."""
    given = []
    build = parallel_state.initialize_model_parallel
    monkeypatch.setattr(parallel_state, "initialize_model_parallel",
                        lambda **kwargs: given.append(kwargs["expert_tensor_parallel_size"]) or build(**kwargs))

    class Initialized(Exception):
        pass

    def initialize(*args, **kwargs):
        raise Initialized(kwargs["expert_tensor_parallel_size"])

    for flags, size in (([], None), (["--expert-tensor-parallel-size", "1"], 1)):
        with monkeypatch.context() as patched:
            patched.setattr(trainer_module.distributed, "initialize", initialize)
            with pytest.raises(Initialized) as initialized:
                trainer_module.Trainer(parse_args([*MOCK, *flags], world_size=1))
        assert initialized.value.args == (size,)
        distributed.destroy_model_parallel()
        distributed.initialize(expert_tensor_parallel_size=size)
    assert given == [None, 1]


@pytest.mark.parametrize("world, cp, instances, refusal", [
    (4, 1, 4, None), (4, 2, 4, None), (4, 1, 3, "--num-distributed-optimizer-instances 3 must divide the "
                                               "data-parallel size 4 x --context-parallel-size 1"),
    (2, 1, 4, "--num-distributed-optimizer-instances 4 must divide the data-parallel size 2"),
])
def test_distributed_optimizer_instances_must_divide_the_data_and_context_parallel_ranks(world, cp, instances,
                                                                                          refusal, capsys):
    argv = [*MOCK, "--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "16",
            "--context-parallel-size", str(cp), "--use-distributed-optimizer",
            "--num-distributed-optimizer-instances", str(instances)]
    if refusal:
        with pytest.raises(SystemExit):
            parse_args(argv, world_size=world)
        assert refusal in capsys.readouterr().err
    else:
        config = parse_args(argv, world_size=world)
        assert ddp_config(config).num_distributed_optimizer_instances == instances


def test_distributed_optimizer_instances_need_the_distributed_optimizer(capsys):
    assert ddp_config(parse_args([*MOCK, "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                                  "1"], world_size=1)).num_distributed_optimizer_instances == 1
    with pytest.raises(SystemExit):
        parse_args([*MOCK, "--num-distributed-optimizer-instances", "2"], world_size=2)
    assert "--num-distributed-optimizer-instances needs --use-distributed-optimizer" in capsys.readouterr().err


OVERLAP_STEP = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                "2", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ckpt-format",
                "torch", "--overlap-param-gather-with-optimizer-step"]


@pytest.mark.parametrize("left_out, need", [
    ("--use-distributed-optimizer", "--use-distributed-optimizer"),
    ("--overlap-param-gather", "--overlap-param-gather"),
    ("--num-virtual-stages-per-pipeline-rank", "the interleaved schedule"),
    ("--ckpt-format", "--ckpt-format torch"),
])
def test_overlap_param_gather_with_optimizer_step_needs_what_megatron_lm_asserts(left_out, need, capsys):
    """Megatron-LM's checks, one flag left out at a time (with its value); all given, it reaches megatron-core's
    OptimizerConfig, and the trainer builds every chunk in one bucket group (trained in
    tests/test_parallel_equivalence.py and tests/test_megatron_configs_train.py)."""
    config = parse_args([*MOCK, *OVERLAP_STEP], world_size=2)
    assert optimizer_config(config).overlap_param_gather_with_optimizer_step
    position = OVERLAP_STEP.index(left_out)
    argv = OVERLAP_STEP[:position] + OVERLAP_STEP[position + (1 if left_out.startswith("--use") or
                                                              left_out == "--overlap-param-gather" else 2):]
    if left_out == "--use-distributed-optimizer":
        argv.remove("--overlap-param-gather")  # which needs it too
        need = "--use-distributed-optimizer, --overlap-param-gather"
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=2)
    assert f"--overlap-param-gather-with-optimizer-step needs {need}" in capsys.readouterr().err


@pytest.mark.parametrize("family", MODEL_FAMILIES)
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16"]])
def test_overlap_param_gather_with_optimizer_step_is_taken_by_every_family_at_every_precision(family, precision):
    """As Megatron-LM takes it (trained at 16 bits in tests/test_trainer.py)."""
    argv = [*MOCK, *OVERLAP_STEP, "--model-family", family, *precision]
    assert parse_args(argv, world_size=2).parallel.overlap_param_gather_with_optimizer_step


@pytest.mark.slow  # two in-process trainer runs
def test_disable_gloo_process_groups_reaches_megatron_cores_groups_and_optimizer(single_process, monkeypatch):
    """Trained over two ranks in tests/test_trainer.py (the dp2_distributed_optimizer layout). The default last:
    the groups stay built for the next test."""
    for flags, gloo in ((["--disable-gloo-process-groups"], False), ([], True)):
        trainer = in_process_trainer([*TINY, "--use-distributed-optimizer", *flags])
        assert (parallel_state._DATA_PARALLEL_GROUP_GLOO is not None) == gloo
        (inner,) = trainer.optimizer.chained_optimizers
        assert (inner.data_parallel_group_gloo is not None) == gloo
        assert trainer.run() == 0


def test_ddp_average_in_collective_reaches_the_ddp_config():
    assert not ddp_config(parse_args(MOCK, world_size=1)).average_in_collective
    assert ddp_config(parse_args([*MOCK, "--ddp-average-in-collective"], world_size=1)).average_in_collective


@pytest.mark.parametrize("override", [False, True])
def test_override_opt_param_scheduler_takes_the_flags_schedule_on_resuming(override, seeded):
    chunks = tiny_chunks("gptplus")
    flags = dict(model_family="gptplus", lr=1e-3, min_lr=1e-4, train_iters=10, lr_warmup_iters=2)
    _, saved = build_optimizer(chunks, RunConfig.from_flags(flags))
    resumed_flags = dict(flags, lr=2e-3, min_lr=2e-4, lr_warmup_iters=3, override_opt_param_scheduler=override)
    _, resumed = build_optimizer(chunks, RunConfig.from_flags(resumed_flags))
    resumed.load_state_dict(saved.state_dict())
    expected = (2e-3, 2e-4, 3) if override else (1e-3, 1e-4, 2)
    assert (resumed.max_lr, resumed.min_lr, resumed.lr_warmup_steps) == expected


@pytest.mark.parametrize("keep_last, retain, kept", [
    (None, None, [2, 4, 6, 8, 10]),
    (2, None, [8, 10]),
    (2, 4, [4, 8, 10]),  # 8 is kept as one of the last two and as a multiple alike
    (None, 4, [4, 8, 10]),  # Megatron-LM's: the latest, and the multiples
    (1, 6, [6, 10]),
])
def test_save_retain_interval_spares_its_multiples_from_deletion(keep_last, retain, kept, tmp_path):
    for iteration in (2, 4, 6, 8, 10):
        os.makedirs(checkpointing.checkpoint_dir(str(tmp_path), iteration))
    checkpoint_store._delete_old(str(tmp_path), keep_last, retain)
    assert checkpointing.complete_iterations(str(tmp_path)) == kept


PIPELINE = [*MOCK, "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]


def pipeline(pp: int, *flags: str):
    return parse_args([*PIPELINE, "--pipeline-model-parallel-size", str(pp), *flags], world_size=pp)


@pytest.mark.parametrize("per_rank, per_stage, stages", [("2", "2", 2), ("4", "1", 4), ("1", "4", None)])
def test_virtual_stages_per_pipeline_rank_are_the_layers_per_virtual_stage_turned_round(per_rank, per_stage, stages):
    """8 layers over 2 pipeline ranks; one virtual stage per rank is no interleaving at all (None), as in
    Megatron-LM."""
    by_rank = pipeline(2, "--num-virtual-stages-per-pipeline-rank", per_rank)
    by_layers = pipeline(2, "--num-layers-per-virtual-pipeline-stage", per_stage)
    assert by_rank.parallel.virtual_pipeline_stages == by_layers.parallel.virtual_pipeline_stages == stages
    assert transformer_config(by_rank).virtual_pipeline_model_parallel_size == stages


@pytest.mark.parametrize("pp, argv, message", [
    (2, ["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"),
    (2, ["--num-virtual-stages-per-pipeline-rank", "3"], "--num-layers / --pipeline-model-parallel-size (4) is not "
     "divisible by --num-virtual-stages-per-pipeline-rank 3"),
    (2, ["--num-virtual-stages-per-pipeline-rank", "0"], "--num-virtual-stages-per-pipeline-rank 0 must be at least 1"),
    (1, ["--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank needs "
     "--pipeline-model-parallel-size > 1"),
    (2, ["--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "1"],
     "--decoder-first-pipeline-num-layers: the pipeline stages' shares [1, 7] (the embedding and loss counted) are "
     "not divisible by the 2 virtual stages per pipeline rank"),
    (2, ["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"],
     "--no-overlap-p2p-communication with the interleaved schedule needs --pipeline-model-parallel-size > 2"),
    (4, ["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication",
         "--overlap-p2p-communication-warmup-flush"], "--overlap-p2p-communication-warmup-flush needs the overlap"),
    (2, ["--overlap-p2p-communication-warmup-flush"], "--overlap-p2p-communication-warmup-flush needs the "
     "interleaved schedule"),
    (2, ["--num-virtual-stages-per-pipeline-rank", "1", "--overlap-p2p-communication-warmup-flush"],
     "--overlap-p2p-communication-warmup-flush needs the interleaved schedule"),
])
def test_the_interleaved_schedules_flags_refuse_what_megatron_lm_refuses(pp, argv, message, capsys):
    with pytest.raises(SystemExit):
        pipeline(pp, *argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("pp, argv, overlap, flush", [
    (2, [], False, False),  # no interleaving: nothing to overlap
    (2, ["--num-virtual-stages-per-pipeline-rank", "2"], True, False),  # Megatron-LM's default overlaps
    (2, ["--num-virtual-stages-per-pipeline-rank", "2", "--overlap-p2p-communication-warmup-flush"], True, True),
    (4, ["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"], False, False),
    (2, ["--no-overlap-p2p-communication"], False, False),  # accepted without interleaving (nothing to turn off)
])
def test_the_interleaved_schedules_exchanges_follow_megatron_lm(pp, argv, overlap, flush, monkeypatch):
    """Megatron-LM's core_transformer_config_from_args: batch_p2p_comm = not overlap_p2p_comm (a GPU is pretended).
    Without CUDA the exchanges are neither batched nor overlapped (gloo), and a line says so where the flags ask."""
    config = pipeline(pp, *argv, "--no-rope-fusion", "--no-bias-swiglu-fusion")  # no Transformer Engine here
    for cuda, expected in ((True, (overlap, not overlap, flush)), (False, (False, False, False))):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        built = transformer_config(config)
        assert (built.overlap_p2p_comm, built.batch_p2p_comm, built.overlap_p2p_comm_warmup_flush) == expected
        said = [line for line in megatron_lm.notes(config, cuda=cuda) if line.startswith("--overlap-p2p")]
        assert said == ([] if cuda or not overlap else [
            "--overlap-p2p-communication" + ("-warmup-flush" if flush else " (Megatron-LM's default)") + ": not "
            "without CUDA: gloo matches the messages between two ranks in posting order, so the interleaved "
            "schedule's exchanges run one at a time here"])


@pytest.mark.parametrize("pp, argv, message", [
    (1, ["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size "
     "> 1"),
    (2, ["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"], "--defer-embedding-wgrad-compute "
     "needs gradient-accumulation fusion, which --no-gradient-accumulation-fusion turns off"),
    (2, ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "-1"], "--wgrad-deferral-limit -1 cannot be "
     "negative"),
])
def test_a_deferred_embedding_wgrad_refuses_what_megatron_core_refuses(pp, argv, message, capsys):
    with pytest.raises(SystemExit):
        pipeline(pp, *argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", MODEL_FAMILIES)
@pytest.mark.parametrize("limit", ["0", "1"])
def test_a_deferred_embedding_wgrad_reaches_megatron_core_with_the_fusion_it_needs(family, limit):
    """Megatron-LM's flags reach ModelParallelConfig by name; megatron-core's own checks of them (PP > 1, the fusion,
    the limit from 0, which defers every micro-batch) pass. Without the deferral the fusion stays off, and a limit
    alone changes nothing, as in Megatron-LM, said in one line."""
    config = pipeline(2, "--model-family", family, "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", limit)
    built = transformer_config(config)
    assert (built.defer_embedding_wgrad_compute, built.wgrad_deferral_limit, built.gradient_accumulation_fusion) == (
        True, int(limit), True)
    assert not [line for line in megatron_lm.notes(config) if "wgrad" in line]
    alone = pipeline(2, "--model-family", family, "--wgrad-deferral-limit", "2")
    assert not transformer_config(alone).defer_embedding_wgrad_compute
    assert not transformer_config(alone).gradient_accumulation_fusion
    assert [line for line in megatron_lm.notes(alone) if "wgrad" in line] == [
        "--wgrad-deferral-limit: without --defer-embedding-wgrad-compute nothing is deferred (as in Megatron-LM, "
        "nothing changes)"]


GPT_QK = [*TINY, "--model-family", "gpt", "--qk-layernorm"]


@pytest.mark.slow  # two in-process trainer runs
def test_test_mode_runs_megatron_cores_real_time_test_in_each_attention(single_process, monkeypatch):
    checked = []
    real_time_tests = SelfAttention.run_realtime_tests
    monkeypatch.setattr(SelfAttention, "run_realtime_tests", lambda self: checked.append(real_time_tests(self)))
    trainer = in_process_trainer([*GPT_QK, "--test-mode", "--train-iters", "1"])
    assert trainer.config.test_mode and trainer.run() == 0
    assert len(checked) == 1  # one layer, one micro-batch; megatron-core's check raised nothing
    checked.clear()
    assert in_process_trainer([*GPT_QK, "--train-iters", "1"]).run() == 0 and checked == []


@pytest.mark.parametrize("argv", [["--model-family", "gptplus"], ["--model-family", "gpt", "--qk-layernorm",
                                                                  "--normalization", "RMSNorm"]])
def test_test_mode_is_refused_where_megatron_cores_check_would_fail_on_rmsnorm(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, "--test-mode", *argv], world_size=1)
    assert "--test-mode checks the q and k layer norms' weights and biases, and this model's are RMSNorm" in \
        capsys.readouterr().err
    assert parse_args([*MOCK, "--test-mode", "--model-family", "gpt", "--qk-layernorm", "--normalization",
                       "LayerNorm"], world_size=1).rerun.test_mode


@pytest.mark.slow  # an in-process trainer run
def test_the_weight_hash_check_runs_at_its_interval(tmp_path, single_process, caplog):
    """The check itself, across two replicas, is in tests/test_parallel_equivalence.py."""
    with caplog.at_level(logging.INFO, logger="angpt"):
        assert in_process_trainer([*TINY, "--check-weight-hash-across-dp-replicas-interval", "2"]).run() == 0
    lines = [record.getMessage() for record in caplog.records if "data-parallel replica" in record.getMessage()]
    assert lines == [f"iteration {n}: the weights are the same on every data-parallel replica" for n in (2, 4)]


@pytest.mark.slow  # an in-process trainer run with three saves
@pytest.mark.parametrize("assume, validated", [(False, [True, True, True]), (True, [True, False, False])])
def test_ckpt_assume_constant_structure_checks_the_first_saves_sharding_only(assume, validated, tmp_path,
                                                                            single_process, monkeypatch):
    """Megatron-LM's: one save strategy for the run; with the flag, the later saves reuse the first's plan and skip
    megatron-core's sharding checks. The saves' tensors are what a run without it writes
    (tests/test_trainer.py::test_an_async_save_writes_what_a_synchronous_one_does, over two ranks)."""
    calls = []
    save = checkpointing.dist_checkpointing.save
    monkeypatch.setattr(checkpointing.dist_checkpointing, "save",
                        lambda *args, **kwargs: calls.append(kwargs) or save(*args, **kwargs))
    flags = [*TINY, "--save", str(tmp_path), "--save-interval", "1", "--train-iters", "3"]
    trainer = in_process_trainer([*flags, *(["--ckpt-assume-constant-structure"] if assume else [])])
    assert trainer.run() == 0
    assert [call["validate_access_integrity"] for call in calls] == validated
    strategies = {id(call["sharded_strategy"]) for call in calls}
    assert len(strategies) == 1
    assert calls[0]["sharded_strategy"].base_strategy.use_cached_ckpt_structure is assume


def test_a_persistent_checkpoint_worker_without_async_save_is_said_to_have_nothing_to_do():
    notes = megatron_lm.notes(parse_args([*MOCK, "--save", "x", "--use-persistent-ckpt-worker"], world_size=1))
    assert notes == ["--use-persistent-ckpt-worker: without --async-save, saves are written by the training "
                     "processes, with no background writer (as in Megatron-LM)"]
    assert megatron_lm.notes(parse_args([*MOCK, "--save", "x", "--async-save", "--use-persistent-ckpt-worker"],
                                        world_size=1)) == []


@pytest.mark.parametrize("apply", [False, True])
def test_apply_wd_to_qk_layernorm_decays_the_q_and_k_norm_gains_only(apply, seeded):
    """megatron-core's parameter groups: with the flag, the q and k norms' gains join the decayed weights; the other
    norms' gains and the biases stay undecayed."""
    chunks = tiny_chunks("gpt", qk_layernorm=True)
    optimizer, _ = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family="gpt", lr=1e-3, train_iters=10, weight_decay=0.1, apply_wd_to_qk_layernorm=apply)))
    names = {id(param): name for name, param in chunks[0].module.named_parameters()}
    decayed = {names[id(param)] for group in optimizer.param_groups if group["wd_mult"] > 0
               for param in group["params"]}
    qk_norms = {name for name in names.values() if "q_layernorm" in name or "k_layernorm" in name}
    assert qk_norms and qk_norms & decayed == (qk_norms if apply else set())
    others = {name for name in names.values() if name.endswith(".bias") or "layernorm" in name} - qk_norms
    assert others and not others & decayed
    assert "decoder.layers.0.mlp.linear_fc1.weight" in decayed


@pytest.mark.parametrize("family, argv, line", [
    ("gptplus", [], "--apply-wd-to-qk-layernorm: GPT+'s q and k norm gains are decayed, which the paper's recipe "
                    "leaves undecayed (docs/model.md)"),
    ("angpt", [], "--apply-wd-to-qk-layernorm: this model has no q and k norm gains to decay"),
    ("gpt", [], "--apply-wd-to-qk-layernorm: this model has no q and k norm gains to decay"),
    ("gpt", ["--qk-layernorm"], None),
])
def test_apply_wd_to_qk_layernorm_says_what_it_changes(family, argv, line):
    notes = megatron_lm.notes(parse_args([*MOCK, "--model-family", family, "--apply-wd-to-qk-layernorm", *argv],
                                         world_size=1))
    assert notes == ([line] if line else [])


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-size", "2"], "--use-torch-fsdp2 with pipeline parallelism (Megatron-LM's check)"),
    (["--use-distributed-optimizer"], "--use-torch-fsdp2 with --use-distributed-optimizer, which it replaces"),
    (["--tie-embeddings-and-output-weights"], "--use-torch-fsdp2 with tied embeddings"),
    (["--model-family", "gpt"], "--use-torch-fsdp2 with tied embeddings"),  # gpt ties unless told otherwise
    (["--fp16"], "--use-torch-fsdp2 with --fp16 (Megatron-LM's check)"),
    (["--bf16", "--use-distributed-optimizer"], "--use-torch-fsdp2 with --use-distributed-optimizer"),
    (["--save", "ckpt", "--ckpt-format", "torch"], "--use-torch-fsdp2 with --ckpt-format torch: give torch_dist"),
    (["--check-weight-hash-across-dp-replicas-interval", "1"], "no replicas"),
])
def test_fsdp2_refuses_what_megatron_lm_refuses_and_what_is_not_built_yet(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*PIPELINE, "--use-torch-fsdp2", "--micro-batch-size", "2", *argv], world_size=4)
    assert message in capsys.readouterr().err


def test_fsdp2_builds_megatron_cores_fsdp2_wrapper_with_the_flags_resharding():
    for flags, reshard in (([], True), (["--torch-fsdp2-no-reshard-after-forward"], False)):
        config = ddp_config(parse_args([*PIPELINE, "--use-torch-fsdp2", *flags], world_size=2))
        assert isinstance(config, TorchFullyShardedDataParallelConfig) and config.reshard_after_forward is reshard
    gpt = parse_args([*PIPELINE, "--use-torch-fsdp2", "--model-family", "gpt", "--untie-embeddings-and-output-weights"],
                     world_size=2)
    assert gpt.parallel.use_torch_fsdp2
    for family in MODEL_FAMILIES:  # bf16 weights beside the normalized families' fp32 scales included
        assert parse_args([*PIPELINE, "--use-torch-fsdp2", "--bf16", "--model-family", family,
                           "--untie-embeddings-and-output-weights"], world_size=2).parallel.use_torch_fsdp2
    assert type(ddp_config(parse_args(PIPELINE, world_size=2))) is not TorchFullyShardedDataParallelConfig
    with pytest.raises(SystemExit):
        parse_args([*PIPELINE, "--torch-fsdp2-no-reshard-after-forward"], world_size=2)


@pytest.mark.parametrize("argv, message", [
    (["--hidden-size", "50", "--num-attention-heads", "4"],
     "--hidden-size 50 is not divisible by --num-attention-heads 4: give --kv-channels (Megatron-LM's check)"),
    (["--hidden-size", "48", "--num-attention-heads", "16"], "a head's 3 rotated channels"),
    (["--hidden-size", "48", "--num-attention-heads", "4", "--kv-channels", "7"], "a head's 7 rotated channels"),
    (["--hidden-size", "48", "--num-attention-heads", "12"], None),  # 4 channels a head: the boundary, even
    (["--hidden-size", "50", "--num-attention-heads", "4", "--kv-channels", "12"], None),
    (["--hidden-size", "48", "--num-attention-heads", "16", "--model-family", "gpt"], None),  # learned positions
])
def test_a_head_that_does_not_split_or_rotate_is_refused_before_the_model_is_built(argv, message, capsys):
    """Megatron-LM asserts hidden = heads x head dimension without --kv-channels; RoPE's frequencies pair a head's
    channels, so an odd count of rotated channels failed in the first forward (a shape mismatch)."""
    base = ["--num-layers", "2", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--mock-data", "--vocab-size", "256"]
    if message is None:
        parse_args([*base, *argv], world_size=1)
        return
    with pytest.raises(SystemExit):
        parse_args([*base, *argv], world_size=1)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("clone", [True, False])
def test_clone_scatter_output_in_embedding_decides_whether_the_scattered_embeddings_are_copied(clone, seeded,
                                                                                              monkeypatch):
    """megatron-core's TransformerConfig field (--no-clone-scatter-output-in-embedding, by name): under sequence
    parallelism the embeddings' scattered part goes on to the layers as a copy (the default, so that the whole
    tensor can be freed) or as the view the scatter returned (one process here: the scatter returns a view of all
    of it); without sequence parallelism nothing is scattered, and the run says so."""
    flags = [*MOCK, "--model-family", "gpt", *([] if clone else ["--no-clone-scatter-output-in-embedding"])]
    config = parse_args(flags, world_size=1)
    assert config.parallel.clone_scatter_output_in_embedding is clone
    model = build_model(transformer_config(config), 256, 128)
    model.embedding.config.sequence_parallel = True  # after megatron-core's check of TP > 1, for the embedding alone
    scattered, dropped = [], []
    monkeypatch.setattr(tensor_parallel, "scatter_to_sequence_parallel_region",
                        lambda tensor, group=None: scattered.append(tensor[:]) or scattered[-1])
    model.embedding.embedding_dropout.register_forward_pre_hook(lambda module, args: dropped.append(args[0]))
    model.embedding(torch.randint(0, 256, (2, 128)), torch.arange(128).expand(2, 128))
    assert torch.equal(dropped[0], scattered[0])
    assert (dropped[0].data_ptr() == scattered[0].data_ptr()) is not clone
    assert ("--no-clone-scatter-output-in-embedding: without --sequence-parallel the embeddings are not scattered (as "
            "in Megatron-LM, nothing changes)" in megatron_lm.notes(config)) is not clone
