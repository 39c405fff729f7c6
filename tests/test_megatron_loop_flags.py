"""Megatron-LM's training-loop and data flags with its meaning: --skip-train, --full-validation,
--multiple-validation-sets, --iterations-to-skip, --phase-transition-iterations, --decrease-batch-size-if-needed,
--no-weight-decay-cond-type; megatron-core's dataset config fields by name (--num-dataset-builder-threads,
--mid-level-dataset-surplus, --dataloader-fast-cache-load, --dataloader-defer-npy-index-mmap,
--per-dataset-sequences-path); the files of --data-args-path and --per-split-data-args-path; --sample-rate and
--vocab-extra-ids, which Megatron-LM ignores for a GPT."""

import json
import math
import os

import numpy as np
import pytest
import torch
from megatron.core.datasets import blended_megatron_dataset_builder
from megatron.core.datasets.gpt_dataset import GPTDataset
from test_gpt_datasets import two_prefixes  # noqa: F401 (a fixture)
from test_optimizer import tiny_chunks
from test_trainer import records

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.batch_schedule import BatchSchedule
from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary
from angpt.training import trainer as trainer_module
from angpt.training.optimizer import build_optimizer

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1"]


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    return capsys.readouterr().err


def recording_train_step(monkeypatch) -> list[torch.Tensor]:
    """The first micro-batch's tokens of each step the trainer runs (the step itself runs as usual)."""
    seen, real = [], trainer_module.train_step

    def train_step(iterators, *args, **kwargs):
        batches = list(iterators)
        seen.append(batches[0]["tokens"].clone())
        return real(iter(batches), *args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", train_step)
    return seen


# -- --skip-train, --full-validation, --multiple-validation-sets


@pytest.mark.slow  # two in-process runs
def test_skip_train_evaluates_the_loaded_model_and_trains_saves_and_writes_nothing(tmp_path, single_process):
    """Megatron-LM's --skip-train: the validation and test losses of the loaded checkpoint's model, exactly those the
    run that saved it logged at its end; no step, no save, no TensorBoard; --no-load-optim turned on, said in a line."""
    save = tmp_path / "run"
    flags = [*MOCK, *TINY, "--eval-iters", "2", "--save", str(save)]
    assert in_process_trainer(flags).run() == 0
    trained = {r["split"]: r["lm_loss"] for r in records(save, "eval")}
    assert set(trained) == {"validation", "test"}
    metrics = tmp_path / "skip.jsonl"
    argv = [*flags, "--load", str(save), "--skip-train", "--metrics-file", str(metrics), "--save",
            str(tmp_path / "unused")]
    config = parse_args(argv, world_size=1)
    assert config.checkpoint.no_load_optim
    assert ("--skip-train: as in Megatron-LM, the optimizer state is not loaded (--no-load-optim), and nothing is "
            "saved or written to TensorBoard or W&B") in megatron_lm.notes(config)
    trainer = in_process_trainer(argv)
    assert trainer.run() == 0
    with open(metrics) as file:
        lines = [json.loads(line) for line in file]
    assert [r["kind"] for r in lines] == ["start", "eval", "eval"]
    assert {r["split"]: (r["iteration"], r["lm_loss"]) for r in lines[1:]} == {
        split: (4, loss) for split, loss in trained.items()}
    assert not os.path.exists(tmp_path / "unused" / "latest_checkpointed_iteration.txt")
    assert not os.path.exists(tmp_path / "unused" / "tensorboard")


def evaluated_batches(monkeypatch) -> list[tuple[int, int]]:
    """(first sample, samples) of each global batch an evaluation reads."""
    seen, real = [], trainer_module.micro_batches

    def micro_batches(dataset, consumed, global_batch_size, *args, **kwargs):
        seen.append((consumed, global_batch_size))
        return real(dataset, consumed, global_batch_size, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "micro_batches", micro_batches)
    return seen


def epoch_samples(prefix: str, seq_length: int) -> int:
    """The samples of one epoch of a dataset, from its .idx alone: its tokens, less the one extra token a sample
    reads past its end, in whole sequences (megatron-core's GPTDataset drops the partial last one)."""
    with open(prefix + ".idx", "rb") as idx:
        header = idx.read(34)
        sequences = int.from_bytes(header[18:26], "little")
        lengths = np.frombuffer(idx.read(4 * sequences), dtype=np.int32)
    return (int(lengths.sum()) - 1) // seq_length


@pytest.mark.slow  # an in-process run
def test_full_validation_reads_every_whole_global_batch_of_one_epoch(two_prefixes, tmp_path, single_process,  # noqa: F811
                                                                     monkeypatch):
    """Each evaluation reads the whole validation split, built as one epoch of its dataset (Megatron-LM: no sample
    count), in whole global batches from its first sample, whatever --eval-iters says (0 included)."""
    a, b = two_prefixes
    seen = evaluated_batches(monkeypatch)
    argv = [*TINY, "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "0", "--full-validation",
            "--train-data-path", a, "--valid-data-path", b, "--data-cache-path", str(tmp_path / "cache"),
            "--seq-length", "64", "--global-batch-size", "16"]
    trainer = in_process_trainer(argv)
    assert trainer.run() == 0
    samples = epoch_samples(b, 64)
    assert len(trainer.data.valid) == samples
    one_evaluation = [(16 * i, 16) for i in range(samples // 16)]
    assert samples // 16 > 10 and seen == one_evaluation * 2  # at iterations 1 and 2 (the last, evaluated once)


def test_multiple_validation_sets_need_full_validation_as_in_megatron_lm(capsys):
    assert ("--multiple-validation-sets needs --full-validation (Megatron-LM's check; or --skip-train)"
            in refusal([*MOCK, "--multiple-validation-sets"], capsys))
    assert parse_args([*MOCK, "--multiple-validation-sets", "--full-validation"], world_size=1)
    assert parse_args([*MOCK, "--multiple-validation-sets", "--skip-train"], world_size=1)


@pytest.mark.slow  # an in-process run
def test_multiple_validation_sets_evaluate_each_dataset_of_the_validation_blend(two_prefixes, tmp_path,  # noqa: F811
                                                                                single_process, monkeypatch):
    """megatron-core's builder gives one validation dataset per prefix of --valid-data-path (its weights unused);
    each is evaluated by itself and reported as validation-<index>, in the order given (Megatron-LM's names)."""
    a, b = two_prefixes
    seen = evaluated_batches(monkeypatch)
    metrics = tmp_path / "metrics.jsonl"
    argv = [*TINY, "--train-iters", "1", "--eval-iters", "2", "--skip-train", "--multiple-validation-sets",
            "--train-data-path", a, "--valid-data-path", "1", b, "1", a, "--data-cache-path", str(tmp_path / "cache"),
            "--metrics-file", str(metrics)]
    trainer = in_process_trainer(argv)
    assert [(name, dataset.dataset.path_prefix) for name, dataset in trainer.validation_sets] == [
        ("validation-0", b), ("validation-1", a)]
    assert trainer.run() == 0
    with open(metrics) as file:
        evaluations = [record for record in map(json.loads, file) if record["kind"] == "eval"]
    assert [record["split"] for record in evaluations] == ["validation-0", "validation-1"]
    assert evaluations[0]["lm_loss"] != evaluations[1]["lm_loss"]
    assert seen == [(0, 4), (4, 4)] * 2


@pytest.mark.slow  # an in-process run
def test_whole_validation_sets_are_each_prefix_of_a_blend_without_weights(two_prefixes, tmp_path,  # noqa: F811
                                                                          single_process, monkeypatch):
    """With --full-validation, megatron-core builds each prefix of a --valid-data-path without weights (Megatron-LM's
    list of prefixes) as one whole epoch: each evaluation reads every whole batch of each, in the order given."""
    a, b = two_prefixes
    seen = evaluated_batches(monkeypatch)
    valid = [b, a]
    argv = [*TINY, "--train-iters", "1", "--eval-iters", "0", "--full-validation", "--multiple-validation-sets",
            "--train-data-path", a, "--valid-data-path", *valid, "--data-cache-path", str(tmp_path / "cache"),
            "--seq-length", "64", "--global-batch-size", "16"]
    trainer = in_process_trainer(argv)
    assert [len(dataset) for _, dataset in trainer.validation_sets] == [epoch_samples(b, 64), epoch_samples(a, 64)]
    assert trainer.run() == 0
    assert seen == [(16 * i, 16) for i in range(epoch_samples(b, 64) // 16)] + \
        [(16 * i, 16) for i in range(epoch_samples(a, 64) // 16)]


@pytest.mark.parametrize("split", ["--valid-data-path", "--data-path"])
def test_a_whole_validation_split_takes_no_weights_as_megatron_core_asserts(two_prefixes, split, capsys):  # noqa: F811
    """megatron-core's builder asserts that a split without a sample count has no weights; the boundary: one prefix
    with a weight (Megatron-LM reads `1 PREFIX` as a weighted blend too) is refused, the same prefixes without weights
    are taken."""
    a, b = two_prefixes
    train = [] if split == "--data-path" else ["--train-data-path", a]
    for values in (["1", a, "1", b], ["1", a]):
        assert (f"--full-validation builds the validation split whole, and megatron-core weighs no such split: give "
                f"{split} its prefixes without weights") in refusal(
            ["--train-iters", "4", *train, split, *values, "--full-validation"], capsys)
    for values in ([a, b], [a]):
        assert parse_args(["--train-iters", "4", *train, split, *values, "--full-validation"], world_size=1)


# -- --iterations-to-skip, --phase-transition-iterations


@pytest.mark.slow  # an in-process run
def test_iterations_to_skip_read_their_batch_and_take_no_step(tmp_path, single_process, monkeypatch):
    """Megatron-LM counts the iterations from 0 there (the steps done): skipping 1 leaves out the batch of samples
    4-7 and the step the log would number 2; the next step reads samples 8-11; the optimizer steps 3 times of 4."""
    seen = recording_train_step(monkeypatch)
    save = tmp_path / "run"
    trainer = in_process_trainer([*MOCK, *TINY, "--eval-iters", "0", "--iterations-to-skip", "1", "--save",
                                  str(save)])
    assert trainer.run() == 0
    assert [(r["iteration"], r["consumed_samples"]) for r in records(save)] == [(1, 4), (3, 12), (4, 16)]
    expected = [torch.stack([trainer.data.train[i]["tokens"] for i in (first, first + 1)]) for first in (0, 8, 12)]
    assert len(seen) == 3 and all(torch.equal(got, want) for got, want in zip(seen, expected))
    assert trainer.scheduler.num_steps == 3 and (trainer.state.iteration, trainer.state.consumed_samples) == (4, 16)


def tracker_line(job: str, rank: int, iteration: int, status: str) -> str:
    """A line as megatron-core's RerunStateMachine._log_validation_error_to_file writes it."""
    return (f"ts=2026-12-06 10:00:00.000000 node=n1 device=0 jobID={job} rank={rank} iteration={iteration} "
            f"status=RerunValidationStatus.{status} result=nan message='Unexpected result nan'\n")


@pytest.mark.slow  # an in-process run
def test_iterations_a_tracker_file_records_failing_twice_on_a_rank_are_skipped(tmp_path, single_process, monkeypatch):
    """Megatron-LM adds to --iterations-to-skip the iterations its --result-rejected-tracker-filename records as failing
    twice on one rank in one job: iteration 1 here (as skipping it by hand, in the test above); iteration 2 failed on
    two ranks of a job (not the data: kept), and 3 once (kept)."""
    tracker = tmp_path / "rejected.txt"
    tracker.write_text(tracker_line("7", 0, 1, "RERUN_DISABLED") + tracker_line("8", 0, 1, "FIRST_RERUN_REPRODUCIBLE")
                       + tracker_line("7", 0, 2, "RERUN_DISABLED") + tracker_line("7", 1, 2, "RERUN_DISABLED")
                       + tracker_line("8", 0, 2, "RERUN_DISABLED") + tracker_line("7", 0, 3, "RERUN_DISABLED"))
    save = tmp_path / "run"
    trainer = in_process_trainer([*MOCK, *TINY, "--eval-iters", "0", "--result-rejected-tracker-filename",
                                  str(tracker), "--save", str(save)])
    assert trainer.iterations_to_skip == {1}
    assert trainer.run() == 0
    assert [(r["iteration"], r["consumed_samples"]) for r in records(save)] == [(1, 4), (3, 12), (4, 16)]


def test_iterations_to_skip_cannot_be_negative(capsys):
    assert "--iterations-to-skip -1 cannot be negative" in refusal([*MOCK, "--iterations-to-skip", "0", "-1"],
                                                                      capsys)
    assert parse_args([*MOCK, "--iterations-to-skip", "0"], world_size=1).training.iterations_to_skip == (0,)


@pytest.mark.slow  # two in-process runs
def test_a_phase_ends_with_a_save_and_the_next_reads_its_own_data_from_its_start(tmp_path, single_process,
                                                                                 monkeypatch):
    """Megatron-LM's multi-phase training: --train-samples 24 in batches of 4, transitions at 2 and 4. The first run
    builds the 8 samples of its phase and exits at iteration 2 with a save; the next builds the 8 of [8, 16) and
    reads them from its first sample."""
    seen = recording_train_step(monkeypatch)
    save = tmp_path / "run"
    argv = [*MOCK[:-2], *TINY, "--train-samples", "24", "--eval-iters", "0", "--save", str(save), "--load",
            str(save), "--phase-transition-iterations", "4,2"]
    first = in_process_trainer(argv)
    assert first.data.train.num_samples == 8 and first.train_data_offset == 0
    assert first.run() == 0 and first.state.iteration == 2
    second = in_process_trainer(argv)
    assert (second.state.iteration, second.state.consumed_samples) == (2, 8)
    assert second.data.train.num_samples == 8 and second.train_data_offset == 8
    assert second.run() == 0 and second.state.iteration == 4
    assert [r["iteration"] for r in records(save)] == [1, 2, 3, 4]
    assert torch.equal(seen[2], torch.stack([second.data.train[i]["tokens"] for i in (0, 1)]))
    with open(save / "latest_checkpointed_iteration.txt") as file:
        assert file.read().strip() == "4"


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "4", "--phase-transition-iterations", "2"],
     "--phase-transition-iterations needs --train-samples"),
    (["--train-samples", "16", "--phase-transition-iterations", "0,2"],
     "--phase-transition-iterations 0,2: an iteration must be at least 1"),
    (["--train-samples", "16", "--phase-transition-iterations", ""], "not comma-separated iterations"),
    (["--train-samples", "16", "--phase-transition-iterations", "2,x"], "not comma-separated iterations"),
    (["--train-samples", "16", "--phase-transition-iterations", "2", "--rampup-batch-size", "4", "4", "8"],
     "multi-phase training does not support batch size ramp-up (Megatron-LM's check)"),
])
def test_phase_transitions_are_refused_where_megatron_lm_fails(argv, message, capsys):
    assert message in refusal(["--mock-data", "--vocab-size", "64", "--micro-batch-size", "4", "--global-batch-size",
                               "8", *argv], capsys)


def test_phase_transitions_are_read_sorted_from_one():
    config = parse_args(["--mock-data", "--vocab-size", "64", "--train-samples", "16", "--phase-transition-iterations",
                         " 3, 1"], world_size=1)
    assert config.training.phase_transitions == (1, 3)


# -- --decrease-batch-size-if-needed


def test_decrease_batch_size_if_needed_runs_the_largest_multiple_of_micro_batch_times_data_parallel(capsys):
    """megatron-core's calculator: 10 in micro-batches of 4 runs 8; a ramp-up from 6 by 3 runs 4, 8 (9), 12; at
    the boundary, a batch of one micro-batch per rank is taken and one below is refused."""
    assert "(or give --decrease-batch-size-if-needed)" in refusal(
        [*MOCK, "--micro-batch-size", "4", "--global-batch-size", "10"], capsys)
    flags = [*MOCK, "--micro-batch-size", "4", "--decrease-batch-size-if-needed"]
    assert parse_args([*flags, "--global-batch-size", "10"], world_size=1)
    assert BatchSchedule(10, 4, 1, decrease_if_needed=True).running_batch_size(0) == 8
    assert BatchSchedule(10, 2, 2, decrease_if_needed=True).running_batch_size(0) == 8
    assert parse_args([*flags, "--global-batch-size", "4"], world_size=1)
    assert ("--decrease-batch-size-if-needed: --global-batch-size 3 is below --micro-batch-size 4 x data-parallel "
            "size 1") in refusal([*flags, "--global-batch-size", "3"], capsys)
    ramp = BatchSchedule(12, 4, 1, rampup=(6, 3, 12), decrease_if_needed=True)
    assert [(ramp.global_batch_size(n), ramp.running_batch_size(n)) for n in (0, 6, 12, 13)] == [
        (6, 4), (9, 8), (12, 12), (12, 12)]
    ramp_flags = ["--mock-data", "--vocab-size", "64", "--micro-batch-size", "4", "--train-samples", "64",
                  "--global-batch-size", "12", "--decrease-batch-size-if-needed"]
    assert parse_args([*ramp_flags, "--rampup-batch-size", "4", "4", "12"], world_size=1)
    assert "START must be at least --micro-batch-size 4" in refusal([*ramp_flags, "--rampup-batch-size", "3", "3",
                                                                     "12"], capsys)


@pytest.mark.slow  # an in-process run
def test_a_decreased_batch_is_what_a_step_reads_and_counts(tmp_path, single_process, monkeypatch):
    seen = recording_train_step(monkeypatch)
    save = tmp_path / "run"
    trainer = in_process_trainer([*MOCK, *TINY, "--global-batch-size", "5", "--decrease-batch-size-if-needed",
                                  "--eval-iters", "1", "--save", str(save)])
    assert trainer.run() == 0
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in records(save)] == [(4, 4), (4, 8), (4, 12),
                                                                                        (4, 16)]
    assert torch.equal(seen[1], torch.stack([trainer.data.train[i]["tokens"] for i in (4, 5)]))
    assert trainer.eval_batch_size == 4


# -- --no-weight-decay-cond-type


def test_no_weight_decay_cond_type_is_megatron_lms_deprecated_apply_wd_to_qk_layernorm(seeded, capsys):
    """Megatron-LM's one value turns --apply-wd-to-qk-layernorm on (its validate_args), said in a line: the q and k
    norm gains are then decayed, the other norm gains and the biases not (its default rule: 1-D weights and biases
    are not decayed, as the families' norm gains, scales and biases)."""
    config = parse_args([*MOCK, "--model-family", "gpt", "--qk-layernorm", "--weight-decay", "0.1",
                         "--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"], world_size=1)
    assert config.optimizer.apply_wd_to_qk_layernorm
    assert ("--no-weight-decay-cond-type apply_wd_to_qk_layernorm: deprecated in Megatron-LM, which takes it as "
            "--apply-wd-to-qk-layernorm (so here)") in megatron_lm.notes(config)
    chunks = tiny_chunks("gpt", qk_layernorm=True)
    optimizer, _ = build_optimizer(chunks, config)
    names = {id(param): name for name, param in chunks[0].module.named_parameters()}
    decayed = {names[id(p)] for group in optimizer.param_groups if group["wd_mult"] > 0 for p in group["params"]}
    qk_norms = {name for name in names.values() if "q_layernorm" in name or "k_layernorm" in name}
    assert qk_norms and qk_norms <= decayed
    assert not {name for name in decayed - qk_norms if name.endswith(".bias") or "layernorm" in name}
    assert "invalid choice" in refusal([*MOCK, "--no-weight-decay-cond-type", "qwen3_next"], capsys)


# -- data: the files of the blends, megatron-core's dataset config by name


def test_data_args_path_holds_data_paths_values(two_prefixes, tmp_path, capsys):  # noqa: F811
    a, b = two_prefixes
    path = tmp_path / "blend.txt"
    path.write_text(f"0.7 {a}\n0.3\t{b}.bin\n")
    assert parse_args(["--train-iters", "4", "--data-args-path", str(path)], world_size=1).data.data_path == (
        "0.7", a, "0.3", b)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    assert f"--data-args-path {empty}: empty: it holds --data-path's values" in refusal(
        ["--train-iters", "4", "--data-args-path", str(empty)], capsys)
    assert f"--data-args-path {tmp_path / 'none'}: No such file or directory" in refusal(
        ["--train-iters", "4", "--data-args-path", str(tmp_path / "none")], capsys)
    assert "give one of --data-args-path and --data-path" in refusal(
        ["--train-iters", "4", "--data-args-path", str(path), "--data-path", a], capsys)


def test_per_split_data_args_path_holds_each_splits_values(two_prefixes, tmp_path, capsys):  # noqa: F811
    """Megatron-LM's JSON: train, valid and test, each a list, a string split at white space, or null."""
    a, b = two_prefixes
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": f"0.5 {a} 0.5 {b}", "valid": [b], "test": None}))
    data = parse_args(["--train-iters", "4", "--per-split-data-args-path", str(path)], world_size=1).data
    assert (data.train_data_path, data.valid_data_path, data.test_data_path) == (("0.5", a, "0.5", b), (b,), None)
    flags = ["--train-iters", "4", "--per-split-data-args-path", str(path)]
    for content, message in ((json.dumps({"train": [a], "valid": [b]}), "no test (the keys are train, valid and test)"),
                             (json.dumps({"train": [], "valid": None, "test": None}), "train: [] is not a list"),
                             ("[]", "not a JSON object"), ("{", "line 1 column 2: not JSON")):
        path.write_text(content)
        assert f"--per-split-data-args-path {path}: {message}" in refusal(flags, capsys)
    assert "give one of --per-split-data-args-path and --valid-data-path" in refusal([*flags, "--valid-data-path", a],
                                                                                     capsys)


def built(data: DataSection, samples=(64, 0, 0), seq_length: int = 16):
    return build_datasets(data, dataset_vocabulary(data), seq_length, 1234, list(samples))


def test_num_dataset_builder_threads_is_megatron_cores_builder_threads(two_prefixes, tmp_path, capsys, monkeypatch):  # noqa: F811
    a, b = two_prefixes
    workers = []
    real = blended_megatron_dataset_builder.ThreadPoolExecutor

    def executor(max_workers):
        workers.append(max_workers)
        return real(max_workers=max_workers)

    monkeypatch.setattr(blended_megatron_dataset_builder, "ThreadPoolExecutor", executor)
    for threads in (1, 3):
        built(DataSection(data_path=("0.5", a, "0.5", b), split="1,0,0", num_dataset_builder_threads=threads,
                          data_cache_path=str(tmp_path / "cache")))
        assert workers[-1] == threads
    assert "--num-dataset-builder-threads 0 must be at least 1" in refusal(
        [*MOCK, "--num-dataset-builder-threads", "0"], capsys)


def test_mid_level_dataset_surplus_sizes_each_blended_dataset(two_prefixes, tmp_path, capsys):  # noqa: F811
    """megatron-core's sizes: ceil(ceil(samples x weight) x (1 + surplus)) per dataset of a weighted blend."""
    a, b = two_prefixes
    for surplus in (0.0, 0.5):
        data = DataSection(data_path=("0.7", a, "0.3", b), split="1,0,0", mid_level_dataset_surplus=surplus,
                           data_cache_path=str(tmp_path / "cache"))
        train, _, _ = built(data, samples=(1000, 0, 0))
        assert [d.num_samples for d in train.datasets] == [math.ceil(700 * (1 + surplus)),
                                                           math.ceil(300 * (1 + surplus))]
    assert "--mid-level-dataset-surplus -0.1 cannot be negative" in refusal(
        [*MOCK, "--mid-level-dataset-surplus", "-0.1"], capsys)


def test_the_index_cache_flags_read_what_a_first_build_cached(two_prefixes, tmp_path, capsys):  # noqa: F811
    """--dataloader-fast-cache-load and --dataloader-defer-npy-index-mmap (megatron-core's fields): the samples of
    the caches a first build wrote; deferred, the index arrays are mapped at the first read. Both need the cache
    directory; the fast load takes per-split paths only (megatron-core's checks)."""
    a, _ = two_prefixes
    cache = str(tmp_path / "cache")
    first, _, _ = built(DataSection(train_data_path=(a,), data_cache_path=cache))
    fast, _, _ = built(DataSection(train_data_path=(a,), data_cache_path=cache, dataloader_fast_cache_load=True))
    deferred, _, _ = built(DataSection(train_data_path=(a,), data_cache_path=cache,
                                       dataloader_defer_npy_index_mmap=True))
    assert fast.config.fast_cache_load and deferred.config.defer_npy_index_mmap
    assert deferred.document_index is None
    for index in (0, 17, 63):
        assert torch.equal(fast[index]["tokens"], first[index]["tokens"])
        assert torch.equal(deferred[index]["tokens"], first[index]["tokens"])
    assert deferred.document_index is not None
    for flag in ("--dataloader-fast-cache-load", "--dataloader-defer-npy-index-mmap"):
        assert f"{flag} needs --data-cache-path" in refusal([*MOCK, flag], capsys)
    assert "--dataloader-fast-cache-load with --data-path: megatron-core builds it from per-split paths only" in \
        refusal(["--train-iters", "4", "--data-path", a, "--data-cache-path", cache, "--dataloader-fast-cache-load"],
                capsys)


def test_per_dataset_sequences_path_gives_megatron_core_the_idx_counts(two_prefixes, tmp_path):  # noqa: F811
    """Megatron-LM's tools/build_sequences_per_dataset.py's file: {prefix: [sequences, documents]} as the .idx header
    counts them (400 documents: 400 sequences, 401 document indices); megatron-core then reads the index at those
    counts; a count that differs, or a prefix left out, is refused naming it."""
    a, b = two_prefixes
    path = tmp_path / "sequences.json"
    path.write_text(json.dumps({a: [400, 401], b: [300, 301]}))
    data = DataSection(data_path=("0.5", a, "0.5", b), split="1,0,0", data_cache_path=str(tmp_path / "cache"),
                       per_dataset_sequences_path=str(path))
    train, _, _ = built(data)
    assert [(d.dataset.index.sequence_count, d.dataset.index.document_count) for d in train.datasets] == [
        (400, 401), (300, 301)]
    assert isinstance(train.datasets[0], GPTDataset) and train[5]["tokens"].shape == (16,)
    path.write_text(json.dumps({a: [400, 400], b: [300, 301]}))
    with pytest.raises(ValueError, match=f"^--per-dataset-sequences-path {path}: {a} has \\[400, 400\\], but "
                                         f"{a}.idx counts \\[400, 401\\]"):
        built(data)
    path.write_text(json.dumps({a: [400, 401]}))
    with pytest.raises(ValueError, match=f"^--per-dataset-sequences-path {path}: no entry for {b}$"):
        built(data)


@pytest.mark.parametrize("argv, line", [
    (["--sample-rate", "0.5"], "--sample-rate: ignored, as in Megatron-LM (read by Megatron-LM's legacy ORQA "
                               "(retrieval) dataset only: pretrain_gpt.py's datasets do not subsample)"),
    (["--vocab-extra-ids", "100"], "--vocab-extra-ids: ignored, as in Megatron-LM (read by Megatron-LM's legacy BERT "
                                   "and SentencePiece tokenizers only (T5's span masking): neither megatron-core's "
                                   "tokenizers, which Megatron-LM 0.16 builds, nor the legacy GPT2BPETokenizer "
                                   "(--legacy-tokenizer) add tokens for it)"),
])
def test_flags_megatron_lm_ignores_for_a_gpt_are_said_in_a_line(argv, line):
    assert megatron_lm.notes(parse_args([*MOCK, *argv], world_size=1)) == [line]
    assert megatron_lm.notes(parse_args([*MOCK, "--vocab-extra-ids", "0"], world_size=1)) == []
