"""The trainer as users run it: `angpt.pretrain` under torchrun, resumed, moved to other layouts, killed,
signalled and fed NaNs. Losses are read from metrics.jsonl; parameters and optimizer states from the
checkpoints themselves."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import load_plain_tensors
from megatron.core.transformer.enums import AttnBackend

from angpt.config.arguments import parse_args
from angpt.hf.export import export
from angpt.models import build_model, model_config
from angpt.models.attention import clear_attention_backend_environment
from angpt.training import checkpoint_store, checkpointing, distributed, faults, save_lock

from conftest import ROOT, in_process_trainer
from launch import launch

MODEL = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--mock-data", "--vocab-size", "256",
         "--log-interval", "1", "--eval-iters", "0"]
ITERS = ["--train-iters", "6"]

pytestmark = pytest.mark.multiprocess


def command(*args, nproc: int = 2, torchrun: tuple = ("--standalone",)) -> list[str]:
    launcher = [sys.executable, "-m", "angpt.pretrain"] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", *torchrun, f"--nproc-per-node={nproc}", "-m", "angpt.pretrain"]
    return [*launcher, *MODEL, *args]


def environment(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", **extra}


def train(*args, nproc: int = 2, expect: int = 0, env: dict | None = None, timeout: int = 300) -> str:
    """A run to its end, warm (tests/launch.py): the tests of torchrun's part start `command` themselves."""
    done = launch(["-m", "angpt.pretrain", *MODEL, *args], nproc=nproc, env=environment(**(env or {})),
                  timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == expect, f"exit code {done.returncode}, expected {expect}:\n{output[-5000:]}"
    return output


def records(run_dir, kind: str = "train") -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        return [r for r in map(json.loads, file) if r["kind"] == kind]


def losses(run_dir) -> dict[int, float]:
    """{iteration: loss} of the last record of each iteration (a resumed run appends its own)."""
    return {r["iteration"]: r["lm_loss"] for r in records(run_dir)}


def latest(run_dir) -> int:
    with open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")) as file:
        return int(file.read())


def checkpoint_tensors(run_dir, iteration: int) -> dict[str, torch.Tensor]:
    loaded = load_plain_tensors(os.path.join(run_dir, f"iter_{iteration:07d}"))
    return {key: value for key, value in loaded.items() if isinstance(value, torch.Tensor)}


def copy_checkpoint(run_dir, iteration: int, destination) -> str:
    """A checkpoint directory whose latest checkpoint is `iteration` of run_dir."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(run_dir, name), os.path.join(destination, name))
    with open(os.path.join(destination, "latest_checkpointed_iteration.txt"), "w") as file:
        file.write(f"{iteration}\n")
    return str(destination)


def wait_for_iteration(run_dir, iteration: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0][-4000:]
        try:
            if any(r["iteration"] >= iteration for r in records(run_dir)):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no iteration {iteration} in {run_dir}")


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    # Without megatron-core's gloo groups, which the distributed optimizer's checkpoints here do not need.
    "dp2_distributed_optimizer": ["--use-distributed-optimizer", "--disable-gloo-process-groups"],
    # Dropout makes the resumed run consume randomness: it equals the uninterrupted one only if the RNG
    # states are restored. Here rather than at tp2, whose checkpoint test_a_checkpoint_continues_at_another_layout
    # continues at another layout, where RNG states are not restored. Overlapped, as on clusters: the weights' all-
    # gather ends in the next forward's pre-hooks, which the first step runs without and which what reads the
    # weights between steps (the logged health probe and params norm, the saves) finishes first.
    "bf16_dp2_distributed_optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                       "--bf16", "--attention-dropout", "0.1"],
    # Every weight, gradient and Adam state sharded over the two ranks (megatron-core's FSDP2 wrapper).
    "dp2_fsdp2": ["--use-torch-fsdp2"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{layout: run directory} of 6 uninterrupted iterations, checkpointed at 3 and 6; each layout is
    trained when first asked for (a selection of the tests runs only the layouts it needs)."""

    class Runs(dict):
        def __missing__(self, name):
            run_dir = tmp_path_factory.mktemp(f"uninterrupted_{name}")
            train(*LAYOUTS[name], *ITERS, "--save", str(run_dir), "--save-interval", "3")
            self[name] = run_dir
            return run_dir

    return Runs()


# Over the suite's budget of 60 s: it trains the bf16 layout's uninterrupted run too (the
# fixture, 6 iterations) before the two runs that stop and resume; all three start warm.
# tp2 and dp2 with the distributed optimizer stop and resume under signals, and are compared with their
# uninterrupted runs in the same way, in
# test_signals_to_torchrun_or_to_the_workers_groups_save_and_the_runs_resume_exactly.
@pytest.mark.parametrize("layout", ["bf16_dp2_distributed_optimizer"])
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(layout, uninterrupted, tmp_path, single_process):
    flags = [*LAYOUTS[layout], *ITERS, "--save", str(tmp_path)]
    # Megatron-LM's checkpoint I/O switches ride along: the first save writes each tensor from its main replica
    # alone (here rank 0: the optimizer's state is gathered), the resumed run reads each tensor once over the
    # ranks and exchanges them.
    output = train(*flags, "--exit-interval", "3", "--no-ckpt-fully-parallel-save")
    assert "exiting at iteration 3" in output and latest(tmp_path) == 3
    def rank_1_files(run_dir) -> list[str]:
        return [name for name in os.listdir(os.path.join(run_dir, "iter_0000003")) if name.startswith("__1_")]

    assert rank_1_files(tmp_path) == [] and rank_1_files(uninterrupted[layout])  # rank 0 wrote it all
    train(*flags, "--load", str(tmp_path), "--ckpt-fully-parallel-load")
    reference = losses(uninterrupted[layout])
    resumed = losses(tmp_path)
    print(layout, "resumed", resumed, "uninterrupted", reference)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed == reference
    final, expected = checkpoint_tensors(tmp_path, 6), checkpoint_tensors(uninterrupted[layout], 6)
    assert final.keys() == expected.keys()
    assert any(key.startswith("optimizer.") for key in final)  # Adam's moments are compared too
    differing = [key for key in final if not torch.equal(final[key], expected[key])]
    assert not differing


@pytest.mark.parametrize("family, backend", [("angpt", AttnBackend.unfused), ("ngpt", AttnBackend.flash),
                                             ("gptplus", AttnBackend.flash)])
def test_dropout_draws_from_the_rng_states_a_checkpoint_restores(family, backend, seeded):
    """In process, what the resumed bf16 layout relies on: dropout reaches the model (megatron's and the
    fused attention, GPT+'s hidden dropout too) and its masks come from the checkpointed RNG states."""
    hidden = dict(hidden_dropout=0.2) if family == "gptplus" else {}
    clear_attention_backend_environment()
    model = build_model(model_config(family, num_layers=2, hidden_size=32, num_attention_heads=4,
                                     attention_dropout=0.2, attention_backend=backend, **hidden), 64, 16)
    clear_attention_backend_environment()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)

    def forward():
        with torch.no_grad():
            return model(tokens, positions, None)

    saved, tracker = checkpoint_store.rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()
    first = forward()
    # Attention dropout forks the model-parallel tracker, as megatron does (saved as "tracker").
    assert not all(torch.equal(state, tracker[name])
                   for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items())
    assert not torch.equal(forward(), first)
    checkpoint_store.set_rng_state(saved)
    assert torch.equal(forward(), first)
    model.eval()
    assert torch.equal(forward(), forward())


# A writer forked per save; megatron-core's persistent writer, with the second save reusing the first's plan and
# who-writes-what over the two data-parallel ranks (--ckpt-assume-constant-structure).
@pytest.mark.parametrize("layout, flags", [
    ("tp2", []), ("dp2_distributed_optimizer", ["--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure"])])
def test_an_async_save_writes_what_a_synchronous_one_does(layout, flags, uninterrupted, tmp_path, single_process):
    train(*LAYOUTS[layout], *ITERS, "--save", str(tmp_path), "--save-interval", "3", "--async-save", *flags)
    assert latest(tmp_path) == 6
    for iteration in (3, 6):
        written = checkpoint_tensors(tmp_path, iteration)
        expected = checkpoint_tensors(uninterrupted[layout], iteration)
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[key], expected[key]) for key in written)


def test_fsdp2_trains_as_the_distributed_optimizer_does(uninterrupted):
    """--use-torch-fsdp2 over two ranks: each step's loss and grad norm those of the distributed optimizer's run
    (every weight, gradient and Adam state sharded instead of Adam's state alone; the same arithmetic up to the
    order of the gradient norm's sums). Its gradients and bounding, weight by weight, are in
    tests/test_parallel_equivalence.py (dp2_fsdp2)."""
    sharded, expected = records(uninterrupted["dp2_fsdp2"]), records(uninterrupted["dp2_distributed_optimizer"])
    assert [r["iteration"] for r in sharded] == [r["iteration"] for r in expected] == list(range(1, 7))
    for got, want in zip(sharded, expected):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_an_fsdp2_checkpoint_resumes_exactly_and_continues_without_fsdp2(uninterrupted, tmp_path, single_process):
    """An FSDP2 checkpoint holds every tensor at its global rows (megatron-core's layout: a gated MLP's fc1 as
    [W; V], whichever rank held which rows), so FSDP2 resumes it bit for bit, and plain DDP in one process
    continues it as FSDP2 does (the same arithmetic up to the order of the sums); the weights, Adam's moments and
    step all carried over."""
    reference = losses(uninterrupted["dp2_fsdp2"])
    resumed = copy_checkpoint(uninterrupted["dp2_fsdp2"], 3, tmp_path / "fsdp2")
    train("--use-torch-fsdp2", *ITERS, "--load", resumed, "--save", resumed)
    assert losses(resumed) == {i: reference[i] for i in (4, 5, 6)}
    final, expected = checkpoint_tensors(resumed, 6), checkpoint_tensors(uninterrupted["dp2_fsdp2"], 6)
    assert final.keys() == expected.keys() and any(key.startswith("optimizer.state.exp_avg.") for key in final)
    assert [key for key in final if not torch.equal(final[key], expected[key])] == []

    continued = copy_checkpoint(uninterrupted["dp2_fsdp2"], 3, tmp_path / "ddp")
    assert in_process_trainer([*MODEL, *ITERS, "--load", continued, "--save", continued]).run() == 0
    assert losses(continued).keys() == {4, 5, 6}
    for iteration, loss in losses(continued).items():
        assert loss == pytest.approx(reference[iteration], rel=1e-5)
    final = checkpoint_tensors(continued, 6)
    assert final.keys() == expected.keys()
    for key in final:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-4, atol=1e-6)
    # The Hugging Face export reads the FSDP2 checkpoint as the DDP one.
    def exported(run_dir, output) -> dict[str, torch.Tensor]:
        export(str(run_dir), str(output))
        return safetensors.torch.load_file(os.path.join(output, "model.safetensors"))

    sharded, plain = exported(uninterrupted["dp2_fsdp2"], tmp_path / "hf_fsdp2"), exported(continued, tmp_path / "hf")
    assert sharded.keys() == plain.keys()
    for key in sharded:
        torch.testing.assert_close(sharded[key], plain[key], rtol=1e-4, atol=1e-6)


@pytest.mark.long  # three launches of three processes, one of four, one of two
def test_fsdp2_shards_of_rows_that_do_not_divide_go_to_plain_ddp_and_back(tmp_path, single_process):
    """Over three ranks the 256 embedding rows are FSDP2 shards of 86, 86 and 84 (torch.chunk's): each is saved at
    its rows. DDP in one process continues the checkpoint of iteration 2 as FSDP2 went on and saves iteration 3,
    which FSDP2 over three ranks continues as it went on. The same from TP 2 x FSDP2 over 2 and from FSDP2 over CP
    2; and a weight with fewer rows than ranks is refused before a step."""
    batch = ["--global-batch-size", "6"]  # one micro-batch of 2 per rank
    sharded, plain = tmp_path / "fsdp2", tmp_path / "ddp"
    train("--use-torch-fsdp2", *batch, "--train-iters", "4", "--save", str(sharded), "--save-interval", "2", nproc=3)
    reference = losses(sharded)
    copy_checkpoint(sharded, 2, plain)
    assert in_process_trainer([*MODEL, *batch, "--train-iters", "3", "--load", str(plain), "--save",
                               str(plain)]).run() == 0
    assert latest(plain) == 3
    train("--use-torch-fsdp2", *batch, "--train-iters", "4", "--load", str(plain), "--save", str(plain), nproc=3)
    assert losses(plain).keys() == {3, 4}
    for iteration, loss in losses(plain).items():
        assert loss == pytest.approx(reference[iteration], rel=1e-5)
    # FSDP2 with tensor parallelism (each rank a quarter of a gated fc1: W_t's rows or V_t's), continued by DDP.
    tp2, continued = tmp_path / "tp2_fsdp2", tmp_path / "tp2_continued"
    train("--use-torch-fsdp2", "--tensor-model-parallel-size", "2", *ITERS, "--save", str(tp2), "--save-interval", "3",
          nproc=4)
    copy_checkpoint(tp2, 3, continued)
    assert in_process_trainer([*MODEL, *ITERS, "--load", str(continued), "--save", str(continued)]).run() == 0
    reference = losses(tp2)
    assert losses(continued).keys() == {4, 5, 6}
    for iteration, loss in losses(continued).items():
        assert loss == pytest.approx(reference[iteration], rel=1e-5)
    # FSDP2 over the context-parallel ranks (megatron-core's data x context group), continued by DDP.
    cp2, continued = tmp_path / "cp2_fsdp2", tmp_path / "cp2_continued"
    train("--use-torch-fsdp2", "--context-parallel-size", "2", "--cp-comm-type", "all_gather", *ITERS, "--save",
          str(cp2), "--save-interval", "3")
    copy_checkpoint(cp2, 3, continued)
    assert in_process_trainer([*MODEL, *ITERS, "--load", str(continued), "--save", str(continued)]).run() == 0
    reference = losses(cp2)
    for iteration, loss in losses(continued).items():
        assert loss == pytest.approx(reference[iteration], rel=1e-5)
    # 24 heads of 2 dimensions: q and k's scale has 2 rows, too few for 3 ranks; refused before a step.
    short = ["--num-attention-heads", "24", "--save", str(tmp_path / "short")]
    output = train("--use-torch-fsdp2", *batch, *ITERS, *short, nproc=3, expect=1)  # torchrun's code for a failure
    assert output.count("angpt.pretrain: --use-torch-fsdp2 over 3 data-parallel ranks with --save or --load: "
                        "decoder.layers.0.self_attention.core_attention.s_qk.s_hat (2 rows), "
                        "decoder.layers.1.self_attention.core_attention.s_qk.s_hat (2 rows) and 2 more would leave "
                        "ranks an empty shard, whose checkpoint is not built; give at most 2 data-parallel ranks") == 1
    assert "iteration " not in output


@pytest.mark.long  # three runs of two processes for anGPT, two for nGPT
@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_fsdp2_at_bf16_keeps_the_scales_fp32_and_trains_as_the_distributed_optimizer(family, tmp_path, single_process):
    """At --bf16 the weights are bf16 and the learnable scales fp32 (docs/model.md), each scale an FSDP2 unit of its
    own (angpt.megatron_compat.fsdp2). Each step's loss and grad norm are the distributed optimizer's at bf16 up to
    one bf16 rounding (2^-8 relative): FSDP2 reduce-scatters the gradients in bf16, the distributed optimizer here in
    fp32. The first step's loss, before any update, is the same number. Every row of the fp32 main weights is
    bounded (anGPT) or normalized (nGPT) after the steps, the scales are saved fp32, and FSDP2 resumes its own
    checkpoint bit for bit."""
    base = ["--model-family", family, *ITERS, "--bf16", "--save-interval", "3"]
    sharded, expected = tmp_path / "fsdp2", tmp_path / "distributed_optimizer"
    train(*base, "--use-torch-fsdp2", "--save", str(sharded))
    train(*base, "--use-distributed-optimizer", "--save", str(expected))
    got, want = records(sharded), records(expected)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == list(range(1, 7))
    assert got[0]["lm_loss"] == want[0]["lm_loss"]
    for mine, theirs in zip(got, want):
        assert mine["lm_loss"] == pytest.approx(theirs["lm_loss"], rel=2**-8)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2**-8)
    saved = checkpoint_tensors(sharded, 6)
    scales = [key for key in saved if key.endswith("s_hat") and not key.startswith("optimizer.")]
    assert scales and all(saved[key].dtype == torch.float32 for key in scales)
    assert saved["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # rows of d: docs/model.md
        norms = saved[f"optimizer.state.fp32_param.{name}"].norm(dim=1)
        if family == "angpt":
            assert norms.max() <= 1 + 1e-6 and (norms > 1 - 1e-6).any()  # bounding acted
        else:
            torch.testing.assert_close(norms, torch.ones_like(norms))
    if family == "ngpt":  # the resume is the same code for both
        return
    resumed = copy_checkpoint(sharded, 3, tmp_path / "resumed")
    train(*base, "--use-torch-fsdp2", "--load", resumed, "--save", resumed)
    assert losses(resumed) == {i: losses(sharded)[i] for i in (4, 5, 6)}
    final = checkpoint_tensors(resumed, 6)
    assert final.keys() == saved.keys()
    assert [key for key in final if not torch.equal(final[key], saved[key])] == []


@pytest.mark.long  # two runs of two processes each
@pytest.mark.parametrize("family, precision", [("angpt", ["--bf16"]),
                                               ("ngpt", ["--fp16", "--initial-loss-scale", "4096"])])
def test_the_param_gather_started_by_the_optimizer_step_trains_as_the_one_started_by_the_forward(family, precision,
                                                                                               tmp_path):
    """--overlap-param-gather-with-optimizer-step at 16 bits, where the first chunk's one bucket group holds the
    bf16 (fp16) weights and the fp32 scales: every logged value is that of the run without it (the same updates,
    gathered at another time), the grad norm up to the order of its sums (an optimizer per chunk, chained, sum
    their squares: fp32's rounding). Gloo gathered such a group's scales wrong (angpt.megatron_compat.cpu)."""
    base = ["--model-family", family, *precision, *ITERS, "--pipeline-model-parallel-size", "2",
            "--num-virtual-stages-per-pipeline-rank", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--ckpt-format", "torch"]
    for name, flags in (("forward", []), ("optimizer_step", ["--overlap-param-gather-with-optimizer-step"])):
        train(*base, *flags, "--metrics-file", str(tmp_path / name / "metrics.jsonl"))
    started_by_step, started_by_forward = records(tmp_path / "optimizer_step"), records(tmp_path / "forward")
    assert [r["iteration"] for r in started_by_step] == list(range(1, 7))
    assert all(r["skipped"] == 0 for r in started_by_step[1:])  # the steps were taken
    clocks = ("time", "ms_per_step", "tokens_per_s_per_device", "mfu", "timers_ms", "grad_norm")
    assert ([{k: v for k, v in r.items() if k not in clocks and "mem" not in k} for r in started_by_step]
            == [{k: v for k, v in r.items() if k not in clocks and "mem" not in k} for r in started_by_forward])
    assert ([r["grad_norm"] for r in started_by_step]
            == pytest.approx([r["grad_norm"] for r in started_by_forward], rel=1e-6))


@pytest.mark.long  # two runs of two processes
def test_the_overlapped_param_gather_logs_what_the_synchronous_one_does(tmp_path):
    """The distributed optimizer's all-gather of the updated weights overlapped with the next forward (Megatron-LM's
    pre-hooks, off for the first step) at bf16 over two data-parallel ranks: what reads the weights between steps
    (the health probe, which calls modules, and the params norm) finishes the gather first, so that every logged
    value is the synchronous gather's. With virtual stages: tests/test_megatron_configs_train.py."""
    base = [*ITERS, "--use-distributed-optimizer", "--overlap-grad-reduce", "--bf16", "--log-params-norm"]
    for name, flags in (("synchronous", []), ("overlapped", ["--overlap-param-gather"])):
        train(*base, *flags, "--metrics-file", str(tmp_path / name / "metrics.jsonl"))
    overlapped, synchronous = records(tmp_path / "overlapped"), records(tmp_path / "synchronous")
    assert [r["iteration"] for r in overlapped] == list(range(1, 7))

    def values(record):  # all but the clocks and memory
        clocks = ("time", "ms_per_step", "tokens_per_s_per_device", "mfu", "timers_ms")
        return {key: value for key, value in record.items() if key not in clocks and "mem" not in key}

    assert "params_norm" in overlapped[0] and any("alpha_" in key for key in overlapped[0])
    assert [values(r) for r in overlapped] == [values(r) for r in synchronous]


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
    # The trainer under context parallelism, from a CP=1 checkpoint (and saving at CP=2 at its end).
    ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
], ids=["pp2_uneven", "cp2"])
def test_a_checkpoint_continues_at_another_layout(layout, uninterrupted, tmp_path):
    """tp2's checkpoint continued at PP 2 split unevenly (1 layer, then 3): the layers are found by their global
    numbers whatever the split; and at CP 2, where each rank holds half of every sequence."""
    run_dir = copy_checkpoint(uninterrupted["tp2"], 3, tmp_path)
    output = train(*layout, *ITERS, "--load", run_dir, "--save", run_dir)
    assert "RNG states are not restored" in output
    continued, reference = losses(run_dir), losses(uninterrupted["tp2"])
    print("tp2 ->", " ".join(layout), continued, reference)
    assert sorted(continued) == [4, 5, 6]
    for iteration in continued:
        assert continued[iteration] == pytest.approx(reference[iteration], rel=1e-5)


def test_a_distributed_optimizer_checkpoint_continues_in_one_process(uninterrupted, tmp_path, single_process, caplog):
    """dp2's distributed optimizer state, sharded over two ranks, continued at DP 1 (in this process)."""
    run_dir = copy_checkpoint(uninterrupted["dp2_distributed_optimizer"], 3, tmp_path)
    with caplog.at_level(logging.INFO, logger="angpt"):
        code = in_process_trainer([*MODEL, "--use-distributed-optimizer", *ITERS, "--load", run_dir,
                                   "--save", run_dir]).run()
    assert code == 0 and "RNG states are not restored" in caplog.text
    continued, reference = losses(run_dir), losses(uninterrupted["dp2_distributed_optimizer"])
    print("dp2 -> dp1", continued, reference)
    assert sorted(continued) == [4, 5, 6]
    for iteration in continued:
        assert continued[iteration] == pytest.approx(reference[iteration], rel=1e-5)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    flags = ["--use-distributed-optimizer", *ITERS, "--save", str(tmp_path), "--save-interval", "2"]
    process = subprocess.Popen(command(*flags), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=environment(ANGPT_TEST_PAUSE_IN_SAVE_AT="4"))
    try:
        deadline = time.monotonic() + 240
        # metadata.json is written once every rank's tensors are; the commit is what the save pauses before.
        while not (tmp_path / "iter_0000004.incomplete" / "metadata.json").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-4000:]
            time.sleep(0.2)
        time.sleep(1)
    finally:
        # As a node that dies: the launcher and every training process (each in a session of its own).
        for victim in [*psutil.Process(process.pid).children(recursive=True), process]:
            victim.kill()
        process.wait()
    assert latest(tmp_path) == 2
    assert not (tmp_path / "iter_0000004").exists()
    # The resumed run also checks the diagnostics of a slow rank, sharing this launch: rank 1's forward passes
    # are 1 s late (2 micro-batches a step: 2 s a step; the forward times are wall times, which a loaded machine
    # stretched by seconds: at 0.25 s late, rank 0 was once as slow), and before iteration 5 rank 1 stalls for 2 s.
    output = train(*flags, "--load", str(tmp_path), "--log-straggler", "--hang-timeout-minutes", "0.01",
                   env={faults.SLOW_RANK: "1:1", faults.STALL_BEFORE: "5:2:1"})
    assert "loaded checkpoint" in output and "(iteration 2)" in output
    assert "left by a save that did not finish" in output
    assert not (tmp_path / "iter_0000004.incomplete").exists()
    assert latest(tmp_path) == 6
    assert [r["iteration"] for r in records(tmp_path)] == [1, 2, 3, 4, 3, 4, 5, 6]
    # --log-straggler names rank 1 at every log (rank 0 waits for it in the gradient reduction, which is not
    # timed); the stall, outside the forward passes, makes nobody a straggler.
    resumed = [(r["forward_ms_slowest"], r["stragglers"]) for r in records(tmp_path)[-4:]]
    assert all(stragglers and stragglers[0][0] == 1 and slowest[0][0] == 1 for slowest, stragglers in resumed), resumed
    assert all(slowest[0][1] >= 2000 for slowest, _ in resumed), resumed
    assert output.count("| stragglers (1): rank 1 ") == 4
    # --hang-timeout-minutes: the stalled rank (the only one to stall) wrote its stacks, inside the stall.
    assert output.count("angpt fault injection: rank 1 stalls for 2.0 s") == 1 and "rank 0 stalls" not in output
    stacks = output.split("angpt hang watchdog: rank 1, iteration 5 has run ")
    assert any('faults.py", line' in stack and "in stall" in stack for stack in stacks[1:]), output[-5000:]


def test_sigterm_saves_and_exits_cleanly_and_the_next_run_resumes(tmp_path):
    flags = ["--train-iters", "1000", "--save", str(tmp_path)]
    process = subprocess.Popen(command(*flags, nproc=0), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=environment())
    wait_for_iteration(tmp_path, 3, process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-4000:]
    stopped = latest(tmp_path)
    assert 3 <= stopped < 1000 and "received SIGTERM" in output
    train("--train-iters", str(stopped + 2), "--save", str(tmp_path), "--load", str(tmp_path), nproc=0)
    assert [r["iteration"] for r in records(tmp_path)][-3:] == [stopped, stopped + 1, stopped + 2]


def test_exit_duration_saves_and_exits_after_the_step_that_passes_it(tmp_path, single_process, caplog):
    with caplog.at_level(logging.INFO, logger="angpt"):
        code = in_process_trainer([*MODEL, "--train-iters", "1000", "--save", str(tmp_path),
                                   "--exit-duration-in-mins", "0.0001"]).run()
    assert code == 0
    assert "past --exit-duration-in-mins 0.0001" in caplog.text and "exiting at iteration 1" in caplog.text
    assert latest(tmp_path) == 1


def test_exit_signal_handler_with_sigusr1_under_torchrun(tmp_path):
    flags = ["--train-iters", "1000", "--save", str(tmp_path), "--exit-signal-handler", "--exit-signal", "SIGUSR1",
             "--tensor-model-parallel-size", "2"]
    process = subprocess.Popen(command(*flags), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=environment())
    wait_for_iteration(tmp_path, 2, process)
    # As a cluster's warning before its time limit: to the training processes, not to the launcher.
    for worker in psutil.Process(process.pid).children(recursive=True):
        worker.send_signal(signal.SIGUSR1)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-4000:]
    assert "received SIGUSR1" in output and latest(tmp_path) >= 2


def signal_job(process: subprocess.Popen, iteration: int, nproc: int, whom: str, signum: signal.Signals,
               close_output: bool = False, timeout: float = 240) -> tuple[int, str]:
    """Signal a torchrun job (started in a session of its own, stdout a pipe) once its ranks wait before
    `iteration` (ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE), with saves behind them. `whom`: "torchrun" (a
    shell's kill or Ctrl-C, Kubernetes, `kill -TERM -<torchrun's pgid>`: torchrun forwards the signal to
    each training process's group) or "workers" (`kill -TERM -<pgid>` of each training process: torchrun
    starts each in a session of its own, with the processes megatron-core forks and spawns for saves).
    `close_output` closes the read end of the job's stdout first, as a killed `torchrun ... | tee`.
    Returns torchrun's exit code and what it printed (nothing after a close)."""
    descriptor, output = process.stdout.fileno(), bytearray()
    os.set_blocking(descriptor, False)
    waiting = f"waiting for an exit signal before iteration {iteration}".encode()

    def drain():
        try:
            while chunk := os.read(descriptor, 1 << 16):
                output.extend(chunk)
        except BlockingIOError:
            pass

    deadline = time.monotonic() + timeout
    while output.count(waiting) < nproc:
        drain()
        assert process.poll() is None and time.monotonic() < deadline, output.decode(errors="replace")[-4000:]
        time.sleep(0.2)
    workers = psutil.Process(process.pid).children()
    assert len(workers) == nproc and all(os.getpgid(worker.pid) == worker.pid for worker in workers)
    if close_output:
        process.stdout.close()
    if whom == "torchrun":
        os.kill(process.pid, signum)
    else:
        for worker in workers:
            os.killpg(worker.pid, signum)
    if close_output:
        return process.wait(timeout=timeout), ""
    os.set_blocking(descriptor, True)
    output.extend(process.communicate(timeout=timeout)[0])
    return process.returncode, output.decode(errors="replace")


# Per save mode, a layout of `uninterrupted`, its flags, and the runs that stop it and resume it to iteration
# 6: (the iteration the run exits at, whom the signal goes to, the signal, whether its stdout is closed).
# SIGTERM to torchrun (during an async save) and to everything are among the chaos soak's kills
# (tests/test_chaos.py); here torchrun forwards SIGINT, and the workers' groups get SIGTERM with stdout closed.
SIGNALLED_RUNS = {
    "sync": ("tp2", ["--save-interval", "1", "--exit-signal-handler", "--exit-signal", "SIGINT"],
             [(3, "torchrun", signal.SIGINT, False), (6, "workers", signal.SIGTERM, True)]),
}


# Over the suite's budget of 60 s: torchrun is the subject, so each of the 2 runs is a cold torchrun job of two
# ranks, each stopped by a real signal after a save.
@pytest.mark.parametrize("saves", SIGNALLED_RUNS)
def test_signals_to_torchrun_or_to_the_workers_groups_save_and_the_runs_resume_exactly(saves, uninterrupted,
                                                                                      tmp_path, single_process):
    """What a shell's kill, Ctrl-C, Kubernetes, scancel do: every process of a training process's group
    (megatron-core's save helpers too) gets the signal. The step finishes, a complete checkpoint of it is
    written, the processes exit 0, and the runs resumed from these checkpoints equal an uninterrupted run."""
    layout, flags, runs = SIGNALLED_RUNS[saves]
    flags = [*LAYOUTS[layout], *flags, *ITERS, "--save", str(tmp_path)]
    for index, (stop, whom, signum, close_output) in enumerate(runs):
        resume = ["--load", str(tmp_path)] if index else []
        process = subprocess.Popen(command(*flags, *resume), cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env=environment(ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE=str(stop)))
        try:
            code, output = signal_job(process, stop, 2, whom, signum, close_output)
        finally:
            if process.poll() is None:  # a failed check: the launcher and every training process
                for victim in [*psutil.Process(process.pid).children(recursive=True), process]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        victim.kill()
                process.wait()
        described = f"{signum.name} to {whom} before iteration {stop}: exit code {code}\n{output[-5000:]}"
        if whom == "torchrun":
            # torch's launcher re-raises the signal it got (SignalException) once its workers have exited:
            # status 1 whatever they did. That they exited cleanly: no other traceback, none killed.
            raised = f"SignalException: Process {process.pid} got signal: {int(signum)}"
            assert code == 1 and raised in output, described
            assert output.count("Traceback") == 1 and "forcefully exiting" not in output, described
            assert f"exiting at iteration {stop}: received {signum.name}" in output, described
        else:
            assert code == 0, described
        assert latest(tmp_path) == stop, described
        assert not [name for name in os.listdir(tmp_path) if name.endswith(checkpointing.INCOMPLETE)], described
    assert [r["iteration"] for r in records(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path) == losses(uninterrupted[layout])
    final, expected = checkpoint_tensors(tmp_path, 6), checkpoint_tensors(uninterrupted[layout], 6)
    assert final.keys() == expected.keys()
    assert not [key for key in final if not torch.equal(final[key], expected[key])]


def test_a_nan_step_is_skipped_and_logged(tmp_path, single_process, monkeypatch):
    """With --rerun-mode disabled (with the default, the rerun state machine stops the run: tests/test_rerun.py)."""
    monkeypatch.setenv(faults.NAN_AT_ITERATIONS, "3")
    assert in_process_trainer([*MODEL, *ITERS, "--save", str(tmp_path), "--rerun-mode", "disabled"]).run() == 0
    steps = {r["iteration"]: r for r in records(tmp_path)}
    assert steps[3]["skipped"] == 1 and steps[3]["lm_loss"] is None  # NaN is written as null
    assert all(steps[i]["skipped"] == 0 for i in (1, 2, 4, 5, 6))
    assert steps[6]["lm_loss"] < steps[2]["lm_loss"]


def test_repeated_nans_stop_the_run_with_the_last_good_state(tmp_path, single_process, monkeypatch, caplog):
    monkeypatch.setenv(faults.NAN_AT_ITERATIONS, "3,4,5,6")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="angpt"):
        code = in_process_trainer([*MODEL, *ITERS, "--save", str(run_dir), "--save-interval", "2",
                                   "--max-skipped-steps", "2", "--rerun-mode", "disabled"]).run()
    assert code == 1
    assert "3 steps in a row had a NaN or Inf loss or grad norm (--max-skipped-steps 2)" in caplog.text
    assert latest(run_dir) == 5
    # The checkpoint of the last good step (2) and the one the stop wrote (5) hold the same weights.
    good, saved = checkpoint_tensors(run_dir, 2), checkpoint_tensors(run_dir, 5)
    weights = [key for key in good if not key.startswith("optimizer.")]
    assert weights and all(torch.equal(good[key], saved[key]) for key in weights)


def test_a_run_killed_in_an_async_save_leaves_no_process_behind(tmp_path):
    """SIGKILL of both training processes while their async saves write (the OOM killer, `kill -9`): the
    save's writer, its write workers and the results queue's Manager of each rank exit by themselves
    (angpt/megatron_compat/parent_watch.py), and torchrun ends; before, all but torchrun stayed."""
    process = subprocess.Popen(command("--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2",
                                       "--async-save"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, env=environment(**{faults.PAUSE_IN_WRITER_AT: "2"}))
    job = psutil.Process(process.pid)
    try:
        paused, lines = set(), []
        while len(paused) < 2:  # each rank's writer says so, with its pid
            line = process.stdout.readline().decode(errors="replace")
            assert line, "".join(lines[-50:])
            lines.append(line)
            if "pausing in the save's background writer" in line:
                paused.add(int(line.rsplit("pid ", 1)[1].rstrip(")\n")))
        workers = job.children()
        helpers = [helper for worker in workers for helper in worker.children(recursive=True)]
        assert len(workers) == 2 and paused <= {helper.pid for helper in helpers}
        # Per rank: the Manager (spawned), the writer (forked), and the resource tracker of multiprocessing.
        assert len(helpers) >= 4, helpers
        killed = time.monotonic()
        for worker in workers:
            worker.kill()
        gone, alive = psutil.wait_procs([job, *workers, *helpers], timeout=10)
        assert not alive, [(p.pid, p.name(), p.cmdline()[-3:]) for p in alive]
        print(f"{len(helpers)} helpers and torchrun gone {time.monotonic() - killed:.2f} s after the SIGKILL")
    finally:
        if process.poll() is None:  # a failed check
            for victim in [*job.children(recursive=True), job]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.kill()
        process.wait()


# Over the suite's budget of 60 s: torchrun's restart is the subject, so the job is a cold torchrun of two ranks
# that runs twice.
def test_torchrun_restarts_a_crashed_group_which_resumes_and_ends_as_an_uninterrupted_run(uninterrupted, tmp_path,
                                                                                         single_process):
    """`torchrun --max-restarts 1` with --load equal to --save: rank 1 dies (SIGKILL) before iteration 5; torchrun
    stops rank 0 and starts both again, which resume from iteration 3 and end with the uninterrupted run's
    checkpoint; the save lock of the dead attempt is taken over, and metrics.jsonl records the restart."""
    done = subprocess.run(command(*LAYOUTS["tp2"], *ITERS, "--save", str(tmp_path), "--load", str(tmp_path),
                                  "--save-interval", "3", torchrun=("--standalone", "--max-restarts", "1")),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=environment(**{faults.CRASH_AT: "5:1"}))
    output = done.stdout
    assert done.returncode == 0, output[-5000:]
    assert "rank 1 crashes before iteration 5" in output and output.count("crashes before") == 1, output[-5000:]
    assert f"loaded checkpoint {tmp_path / 'iter_0000003'}" in output, output[-5000:]
    assert latest(tmp_path) == 6 and not (tmp_path / save_lock.LOCK).exists()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(checkpointing.INCOMPLETE)]
    # Iteration 4 was trained twice; the records of the attempt that resumed are the run's.
    assert [r["iteration"] for r in records(tmp_path)] == [1, 2, 3, 4, 4, 5, 6]
    assert [r["iteration"] for r in records(tmp_path, "start")] == [0, 3]
    assert losses(tmp_path) == losses(uninterrupted["tp2"])
    final, expected = checkpoint_tensors(tmp_path, 6), checkpoint_tensors(uninterrupted["tp2"], 6)
    assert final.keys() == expected.keys()
    assert not [key for key in final if not torch.equal(final[key], expected[key])]


# Over the suite's budget of 60 s: two cold torchrun agents rendezvous over TCP as two nodes
# do; the launcher's rendezvous is the subject.
def test_two_nodes_train_like_one_node(uninterrupted, tmp_path, single_process):
    """Two nodes of one process each, rendezvousing over TCP, train exactly as one node of two processes."""
    port = distributed.free_port()
    nodes = [
        subprocess.Popen(
            command(*LAYOUTS["tp2"], *ITERS, "--save", str(tmp_path), "--save-interval", "3", nproc=1,
                    torchrun=("--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                              "--master-port", str(port))),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # The threads torchrun gives the reference's two processes (it sets 1 only for several per node).
            env=environment(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert losses(tmp_path) == losses(uninterrupted["tp2"])
    assert latest(tmp_path) == 6
    final, expected = checkpoint_tensors(tmp_path, 6), checkpoint_tensors(uninterrupted["tp2"], 6)
    assert final.keys() == expected.keys()
    assert not [key for key in final if not torch.equal(final[key], expected[key])]


def test_a_hang_writes_every_threads_stack_before_the_collective_times_out(tmp_path, single_process, monkeypatch,
                                                                           capfd):
    """--hang-timeout-minutes: an iteration that stalls past it writes this rank's stacks to its log (stderr),
    once per timeout while it lasts, naming where it waits; the run then goes on."""
    monkeypatch.setenv(faults.STALL_BEFORE, "2:2.5")
    trainer = in_process_trainer([*MODEL, "--train-iters", "3", "--hang-timeout-minutes", "0.01"])  # 0.6 s
    assert trainer.run() == 0
    err = capfd.readouterr().err
    header = "angpt hang watchdog: rank 0, iteration 2 has run "
    assert header in err and "Thread MainThread" in err, err[-3000:]
    stack = err[err.index(header):]
    assert 'faults.py", line' in stack and "in stall" in stack and "in _run" in stack, stack[:3000]
    assert err.count(header) >= 3  # 2.5 s of stall: a dump every 0.6 s


@pytest.mark.parametrize("argv,message", [
    (["--hang-timeout-minutes", "10"], "--hang-timeout-minutes 10.0 must be below --distributed-timeout-minutes 10"),
    (["--hang-timeout-minutes", "0"], "--hang-timeout-minutes 0.0 must be positive"),
])
def test_a_hang_timeout_that_cannot_fire_first_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, *ITERS, *argv])
    assert message in capsys.readouterr().err


def test_every_process_group_times_out_after_distributed_timeout_minutes(single_process):
    """megatron-core's groups took 30 minutes whatever --distributed-timeout-minutes said; given the flag's value,
    its expert data-parallel gloo groups still did (megatron-core 0.16.1 builds them without it)."""
    distributed.destroy_model_parallel()
    try:
        distributed.initialize(timeout_minutes=7)
        # Every group megatron-core built (its gloo copies, embedding, expert and hierarchical groups among them).
        groups = {id(group): group for value in vars(parallel_state).values()
                  for group in (value if isinstance(value, (list, tuple)) else [value])
                  if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD}
        assert len(groups) >= 10
        timeouts = {group._get_backend(torch.device("cpu")).options._timeout for group in groups.values()}
        assert timeouts == {datetime.timedelta(minutes=7)}
    finally:
        distributed.destroy_model_parallel()
        distributed.initialize()
