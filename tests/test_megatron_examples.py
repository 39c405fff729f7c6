"""Megatron-LM's own example scripts (core_v0.16.1) as a user brings them: their argument lists, shapes shrunk
and --model-family added, train on two CPU processes on a dataset written by megatron-core's
IndexedDatasetBuilder with no .json (as Megatron-LM's tools/preprocess_data.py writes it), and a run resumed
from the middle equals the uninterrupted one, checkpoint tensor for tensor.

Each line that differs from the script says why; the rest is the script's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from test_tokenizers import bytes_to_unicode
from test_trainer import checkpoint_tensors, copy_checkpoint, losses, records

pytestmark = pytest.mark.multiprocess

from test_trainer import environment  # noqa: E402

from launch import launch  # noqa: E402


def llama3_8b(data: str, vocab_size: int, save: str) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE=bf16 (FP8 needs Transformer Engine on a GPU), its
    real-data branch given NullTokenizer ids, TP_SIZE=2 over the two processes."""
    return [
        # GPT_MODEL_ARGS
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
        "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS (samples shrunk: 6 iterations of 8)
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "48", "--lr-decay-samples", "40",
        "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
        "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level",
        "1", "--exit-duration-in-mins", "235",
        # MODEL_PARALLEL_ARGS and DDP_ARGS
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "1", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DATA_ARGS_LIST (the real-data branch; NullTokenizer's ids as the mock branch names them)
        "--data-path", data, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
        "--data-cache-path", f"{save}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS (intervals shrunk). Left out: --profile --profile-step-start 4 --profile-step-end 6,
        # an Nsight Systems capture range, which needs CUDA.
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--save-interval", "3",
        "--log-throughput", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", save,
        "--load", save, "--tensorboard-dir", f"{save}/tensorboard",
        # Added (Megatron-LM's, not in this script): the weights' norm over tensor-parallel ranks and duplicates.
        "--log-params-norm",
    ]


def gpt3_175b(data: str, vocab_file: str, merge_file: str, save: str) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh, pipeline-parallel over the two processes."""
    return [
        # GPT_MODEL_ARGS
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--attention-backend", "auto",
        # TRAINING_ARGS (ramp-up and iterations shrunk; --train-iters becomes --train-samples, which Megatron-LM
        # requires with --rampup-batch-size too). Left out: --fp16, whose loss scale, coming down from 2^32, would
        # skip every one of these 9 steps (tests/test_fp16.py trains in fp16): fp32 here.
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16",
        "--train-samples", "45", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-samples", "40",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        # DATA_ARGS. Added: --tokenizer-type GPT2BPETokenizer, which Megatron-LM 0.16 needs too (its
        # build_tokenizer has no default type).
        "--data-path", data, "--vocab-file", vocab_file, "--merge-file", merge_file, "--tokenizer-type",
        "GPT2BPETokenizer", "--split", "949,50,1", "--data-cache-path", f"{save}/cache",
        # Added: Megatron-LM's flags of documents on their own (positions from 0, attention within) and of its
        # timers, which this script does not give, for a multi-process run that carries the documents' masks
        # through the pipeline and gathers timers that only some stages run.
        "--reset-position-ids", "--reset-attention-mask", "--timing-log-level", "2", "--timing-log-option", "all",
        "--log-params-norm", "--log-num-zeros-in-grad",
        # EVAL_AND_LOGGING_ARGS (intervals shrunk)
        "--log-interval", "1", "--save-interval", "4", "--eval-interval", "4", "--save", save, "--load", save,
        "--eval-iters", "1", "--tensorboard-dir", f"{save}/tensorboard",
    ]


def megatron_dataset(prefix: str, vocab_size: int, eod: int) -> str:
    """Documents of random ids below vocab_size, each ending in the end-of-document id, as Megatron-LM's
    tools/preprocess_data.py writes them with --append-eod: a .bin/.idx pair and nothing else."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for length in rng.integers(8, 40, size=2000):  # enough documents for the 1/1000 test split of 949,50,1
        builder.add_document(torch.from_numpy(np.append(rng.integers(0, vocab_size, length), eod)), [length + 1])
    builder.finalize(prefix + ".idx")
    return prefix


def gpt2_files(directory) -> tuple[str, str]:
    """A GPT-2-format vocab.json and merges.txt: the 256 byte symbols, two merges and <|endoftext|> (260)."""
    symbols = bytes_to_unicode()
    vocab = {symbols[byte]: byte for byte in range(256)}
    vocab.update({"he": 256, "Ġt": 257, "<|endoftext|>": 258})
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nh e\nĠ t\n")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def weights_norm(run, iteration: int) -> float:
    """The L2 norm of all the model's weights in a checkpoint (whole tensors, whatever the layout that saved it)."""
    weights = [tensor for key, tensor in checkpoint_tensors(run, iteration).items() if not key.startswith("optimizer.")]
    return torch.cat([tensor.double().flatten() for tensor in weights]).norm().item()


def launch_clean(argv: list[str]):
    # Without the NVTE_*_ATTN variables megatron-core exported in this pytest worker for an earlier test's model:
    # with them, it refuses another attention backend (the llama script's fused).
    env = {name: value for name, value in environment().items() if not name.startswith("NVTE_")}
    return launch(["-m", "angpt.pretrain", *argv], nproc=2, env=env, timeout=600)


def train(argv: list[str], family: str) -> str:
    done = launch_clean([*argv, "--model-family", family])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def check_resume(argv_for, uninterrupted, resumed, at: int, last: int, family: str) -> None:
    """A run from `uninterrupted`'s checkpoint at `at` to `last` equals it: losses and every tensor."""
    copy_checkpoint(uninterrupted, at, resumed)
    train(argv_for(str(resumed)), family)
    assert {i: loss for i, loss in losses(resumed).items() if i > at} == \
        {i: loss for i, loss in losses(uninterrupted).items() if i > at}
    final, expected = checkpoint_tensors(resumed, last), checkpoint_tensors(uninterrupted, last)
    assert final.keys() == expected.keys() and any(key.startswith("optimizer.") for key in final)
    assert [key for key in final if not torch.equal(final[key], expected[key])] == []


def test_megatron_lms_llama3_script_trains_an_angpt_and_resumes_exactly(tmp_path, single_process):
    data = megatron_dataset(str(tmp_path / "corpus_text_document"), vocab_size=500, eod=500)
    run = tmp_path / "run"
    output = train(llama3_8b(data, 500, str(run)), "angpt")
    assert "--normalization" not in output  # nothing said of a norm flag the script does not give
    assert "--apply-layernorm-1p: replaced by anGPT's own normalization" in output
    assert "--weight-decay 0.1 departs from anGPT's recipe, no weight decay" in output
    assert [r["iteration"] for r in records(run)] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["lm_loss"]) for r in records(run))
    # bf16 weights, their norm summed in fp32 over the ranks: the checkpoint's weights' norm to bf16's precision.
    assert records(run)[-1]["params_norm"] == pytest.approx(weights_norm(run, 6), rel=1e-2)
    check_resume(lambda save: llama3_8b(data, 500, save), run, tmp_path / "resumed", 3, 6, "angpt")


def test_megatron_lms_gpt3_script_ramps_up_its_batch_and_resumes_exactly_in_the_ramp(tmp_path, single_process):
    vocab_file, merge_file = gpt2_files(tmp_path)
    data = megatron_dataset(str(tmp_path / "corpus_text_document"), vocab_size=258, eod=258)
    run = tmp_path / "run"
    train(gpt3_175b(data, vocab_file, merge_file, str(run)), "gptplus")
    # The ramp-up (START 2, INCREMENT 2, 16 samples; tests/test_batch_schedule.py): 2, 2, 2, 4, 4, 6, then 8.
    assert [r["global_batch_size"] for r in records(run)] == [2, 2, 2, 4, 4, 6, 8, 8, 8]
    assert [r["consumed_samples"] for r in records(run)] == [2, 4, 6, 10, 14, 20, 28, 36, 44]
    # fp32 weights: the norm of the final checkpoint's, up to the order of the sums.
    assert records(run)[-1]["params_norm"] == pytest.approx(weights_norm(run, 9), rel=1e-6)
    assert records(run)[-1]["num_zeros"] > 0  # the embedding rows of the tokens not in the last batch
    # Every rank's time (--timing-log-option all): both stages compute, and each receives from the other.
    timers = records(run)[-1]["timers_ms"]
    assert timers["forward-compute"][0] > 0 and timers["forward-compute"][1] > 0
    assert "forward-recv" in timers and "backward-recv" in timers
    # Resumed at iteration 4, in the middle of the ramp-up.
    check_resume(lambda save: gpt3_175b(data, vocab_file, merge_file, save), run, tmp_path / "resumed", 4, 9,
                 "gptplus")


def test_a_dataset_without_its_tokenizer_is_refused_in_one_line_by_the_node_not_by_each_rank(tmp_path):
    """As Megatron-LM's tool writes a dataset, without our .json and without the tokenizer flags: the refusal
    is one line (rank 0's; the node's other ranks check the same files), nothing after it, exit status 2."""
    data = megatron_dataset(str(tmp_path / "corpus_text_document"), vocab_size=500, eod=500)
    done = launch_clean(["--train-iters", "2", "--data-path", data])
    assert done.returncode == 1  # torchrun's code when a rank failed; each rank exited with 2
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines == [f"angpt.pretrain: {data}.json: no dataset metadata: give the tokenizer the dataset was written "
                     "with (--tokenizer-type and --tokenizer-model, --vocab-file/--merge-file, or NullTokenizer with "
                     "--vocab-size), or write it with tools/preprocess_data.py"]
