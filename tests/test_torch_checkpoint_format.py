"""Megatron-LM's legacy checkpoint format (--ckpt-format torch, angpt/training/torch_checkpoint.py): its file
names, its keys, exact resume at the layouts it serves, the refusals of what it cannot do, and the load that reads
whichever format is on disk (--auto-detect-ckpt-format).

The runs share one warm torchrun job of 2 ranks (tests/distributed/megatron_config_worker.py): each layout trains 4
iterations saving at 2 and 4, then a run continues from its iteration 2 and must log what the uninterrupted run
logged and save the same tensors. The in-process tests need no job: the refusals that come before a model is
involved, and the flags.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from angpt.config.arguments import parse_args
from angpt.megatron_compat.checkpoint_unpickling import read_as_data
from angpt.training import checkpointing

from conftest import run_workers

MODEL = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--mock-data", "--vocab-size", "256",
         "--log-interval", "1", "--eval-iters", "0", "--train-iters", "4", "--save-interval", "2"]
NPROC = 2
SAVED_AT = 2
# {case: (flags, tensor size, pipeline size, distributed optimizer)}, each over 2 ranks.
LAYOUTS = {
    "ddp_fp32": ([], 1, 1, False),  # DP 2
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 1, False),
    # PP 2, two virtual stages of one layer on each rank (the interleaved schedule): model0 and model1 in each file.
    "pp2_interleaved": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                        1, 2, False),
    "distributed_optimizer": (["--use-distributed-optimizer"], 1, 1, True),  # DP 2: Adam's state sharded
    # Float16OptimizerWithFloat16Params: bf16 weights with fp32 main copies, beside anGPT's fp32 learnable scales; the
    # dropout draws from the RNG states, which the resumed run must restore to log the same losses.
    "bf16": (["--bf16", "--attention-dropout", "0.1"], 1, 1, False),
    # fp16's loss scaler starts at 2^32 and skips the steps whose gradients overflow: saved at 2 before Adam's first
    # applied step, the distributed optimizer's state is the zeros Adam starts from; the scaler's state is saved too.
    "fp16_distributed_optimizer": (["--fp16", "--use-distributed-optimizer"], 1, 1, True),
}
# Megatron-LM's keys of model_optim_rng.pt (checkpointing.py, generate_state_dict and save_checkpoint).
MEGATRON_KEYS = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state",
                 "num_floating_point_operations_so_far"}

def megatron_checkpoint_files(tensor: int, pipeline: int, distributed_optimizer: bool) -> set[str]:
    """The files Megatron-LM's get_checkpoint_name and get_distributed_optimizer_checkpoint_name name in an iteration
    directory: mp_rank_{tensor rank:02d}, with _{pipeline rank:03d} when the pipeline has more than one stage."""
    files = set()
    for tensor_rank in range(tensor):
        for pipeline_rank in range(pipeline):
            directory = "mp_rank_%02d" % tensor_rank + ("_%03d" % pipeline_rank if pipeline > 1 else "")
            files.add(f"{directory}/model_optim_rng.pt")
            if distributed_optimizer:
                files.add(f"{directory}/distrib_optim.pt")
    return files


def files_under(directory) -> set[str]:
    return {os.path.relpath(os.path.join(parent, name), directory)
            for parent, _, names in os.walk(directory) for name in names}


def run(name: str, save_dir, argv: list[str], resume_from=None) -> dict:
    os.makedirs(save_dir, exist_ok=True)
    return dict(name=name, argv=[*MODEL, *argv, "--save", str(save_dir), "--load", str(save_dir)],
                resume_from=resume_from)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple:
    """(run directories by name, RESULT lines by name) of every run, in one job of 2 ranks: the uninterrupted runs,
    then those that continue from their iteration 2, then the format conversions and the refused loads."""
    root = tmp_path_factory.mktemp("torch_format")
    dirs = {name: root / name for name in
            [*LAYOUTS, *(f"{name}_resumed" for name in LAYOUTS), "to_torch_dist", "back_to_torch",
             "pp2_refused_at_tp2", "interleaved_refused_without_virtual_stages"]}
    runs = [run(name, dirs[name], [*flags, "--ckpt-format", "torch"]) for name, (flags, *_) in LAYOUTS.items()]
    runs += [run(f"{name}_resumed", dirs[f"{name}_resumed"], [*flags, "--ckpt-format", "torch"],
                 [str(dirs[name]), SAVED_AT]) for name, (flags, *_) in LAYOUTS.items()]
    runs += [
        # The torch checkpoint of iteration 2 continued with the default --ckpt-format torch_dist, which reads the
        # format on disk (Megatron-LM's), saving distributed checkpoints at 3 and 4 ...
        run("to_torch_dist", dirs["to_torch_dist"], ["--save-interval", "1"], [str(dirs["ddp_fp32"]), SAVED_AT]),
        # ... whose iteration 3 continues in the torch format with --auto-detect-ckpt-format.
        run("back_to_torch", dirs["back_to_torch"], ["--ckpt-format", "torch", "--auto-detect-ckpt-format"],
            [str(dirs["to_torch_dist"]), 3]),
        # Saved at TP 1 x PP 2 (interleaved), loaded at TP 2 x PP 1, and at PP 2 without virtual stages.
        run("pp2_refused_at_tp2", dirs["pp2_refused_at_tp2"], [*LAYOUTS["tp2"][0], "--ckpt-format", "torch"],
            [str(dirs["pp2_interleaved"]), SAVED_AT]),
        run("interleaved_refused_without_virtual_stages", dirs["interleaved_refused_without_virtual_stages"],
            ["--pipeline-model-parallel-size", "2", "--ckpt-format", "torch"],
            [str(dirs["pp2_interleaved"]), SAVED_AT]),
    ]
    spec = root / "runs.json"
    spec.write_text(json.dumps(runs))
    output = run_workers("megatron_config_worker.py", str(spec), nproc=NPROC, timeout=600)
    results = {result["name"]: result for result in
               (json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT "))}
    assert list(results) == [entry["name"] for entry in runs], output[-6000:]
    return dirs, results


def logged(run_dir, after: int = 0) -> list[dict]:
    """What each step logged but its timings."""
    kept = ("iteration", "consumed_samples", "lm_loss", "grad_norm", "lr", "skipped", "loss_scale")
    with open(run_dir / "metrics.jsonl") as file:
        return [{key: record.get(key) for key in kept} for record in map(json.loads, file)
                if record["kind"] == "train" and record["iteration"] > after]


def tensors(value, prefix: str = ""):
    """(path, tensor) of every tensor in a loaded file."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensors(item, f"{prefix}/{index}")


def saved_tensors(iteration_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's files but the RNG states: the parameters, the optimizer's state and main
    weights, the loss scaler. (The RNG states shape the logged losses of the dropout case.)"""
    found = {}
    for name in sorted(files_under(iteration_dir)):
        if name.endswith(".pt"):
            loaded = read_as_data(str(iteration_dir / name), map_location="cpu")
            found.update({f"{name}{path}": tensor for path, tensor in tensors(loaded)
                          if not path.startswith("/rng_state")})
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_files_are_megatron_lms_names_and_keys(layout, job):
    dirs, results = job
    assert results[layout]["code"] == 0
    _, tensor, pipeline, distributed_optimizer = LAYOUTS[layout]
    for iteration in (2, 4):
        iteration_dir = dirs[layout] / f"iter_{iteration:07d}"
        assert files_under(iteration_dir) == (megatron_checkpoint_files(tensor, pipeline, distributed_optimizer)
                                              | {"angpt_digests.json"})
    assert (dirs[layout] / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for name in megatron_checkpoint_files(tensor, pipeline, False):
        saved = read_as_data(str(dirs[layout] / "iter_0000002" / name), map_location="cpu")
        models = {"model0", "model1"} if layout == "pp2_interleaved" else {"model"}
        assert MEGATRON_KEYS | models <= set(saved)
        assert saved["checkpoint_version"] == 3.0 and saved["iteration"] == 2
        assert saved["num_floating_point_operations_so_far"] > 0
        # Every data-parallel rank's RNG states, by Megatron-LM's names.
        assert len(saved["rng_state"]) == 2 // (tensor * pipeline)
        assert set(saved["rng_state"][0]) >= {"random_rng_state", "np_rng_state", "torch_rng_state",
                                              "rng_tracker_states"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(layout, job):
    dirs, results = job
    assert results[layout]["code"] == 0 and results[f"{layout}_resumed"]["code"] == 0
    expected, continued = logged(dirs[layout], SAVED_AT), logged(dirs[f"{layout}_resumed"])
    print(layout, "uninterrupted", expected, "resumed", continued)
    assert [record["iteration"] for record in continued] == [3, 4]
    assert continued == expected
    final, reference = (saved_tensors(dirs[name] / "iter_0000004") for name in (f"{layout}_resumed", layout))
    assert final.keys() == reference.keys()
    assert any("/optimizer/" in key for key in final) or LAYOUTS[layout][3]
    assert [key for key in final if not torch.equal(final[key], reference[key])] == []


@pytest.mark.multiprocess
def test_the_16_bit_optimizer_checkpoints_the_fp32_learnable_scales(job):
    """anGPT's learnable scales stay fp32 in a bf16 model: the model holds them, the optimizer's state holds
    Adam's moments of every parameter, theirs included."""
    dirs, _ = job
    saved = read_as_data(str(dirs["bf16"] / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"),
                         map_location="cpu")
    weights = {name: tensor for name, tensor in saved["model"].items() if isinstance(tensor, torch.Tensor)}
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16, torch.float32}
    optimizer = saved["optimizer"]
    ids = [index for group in optimizer["optimizer"]["param_groups"] for index in group["params"]]
    assert sorted(optimizer["optimizer"]["state"]) == sorted(ids)
    main_copies = [tensor for group in optimizer["fp32_from_fp16_params"] for tensor in group]
    assert main_copies and all(tensor.dtype == torch.float32 for tensor in main_copies)
    # The 16-bit weights have main copies; the fp32 scales are their own, and Adam's state covers both.
    scales = [name for name, tensor in weights.items() if tensor.dtype == torch.float32]
    assert len(ids) == len(main_copies) + len(scales)


@pytest.mark.multiprocess
def test_a_load_reads_the_format_on_disk(job):
    """The torch checkpoint of iteration 2 continued under --ckpt-format torch_dist (saving distributed
    checkpoints), whose iteration 3 continued under --ckpt-format torch --auto-detect-ckpt-format: both log what
    the uninterrupted torch run logged."""
    dirs, results = job
    assert results["to_torch_dist"]["code"] == results["back_to_torch"]["code"] == 0
    assert checkpointing.checkpoint_format(str(dirs["to_torch_dist"] / "iter_0000003")) == "torch_dist"
    assert checkpointing.checkpoint_format(str(dirs["back_to_torch"] / "iter_0000004")) == "torch"
    expected = logged(dirs["ddp_fp32"], SAVED_AT)
    assert logged(dirs["to_torch_dist"]) == expected
    assert logged(dirs["back_to_torch"]) == expected[1:]


@pytest.mark.multiprocess
def test_another_layout_is_refused_in_one_line_naming_both(job):
    _, results = job
    refused = results["pp2_refused_at_tp2"]
    assert refused["code"] == 2 and "\n" not in refused["error"]
    assert "was saved in the torch format at TP 1 x PP 2 and this run is TP 2 x PP 1: the torch format does not " \
           "reshard" in refused["error"]
    refused = results["interleaved_refused_without_virtual_stages"]
    assert refused["code"] == 2 and "\n" not in refused["error"]
    assert "at TP 1 x PP 2 x 2 virtual stages and this run is TP 1 x PP 2: the torch format does not reshard" \
           in refused["error"]


def fake_torch_checkpoint(root, tensor: int, pipeline: int) -> str:
    """A torch-format checkpoint of iteration 3 whose files are not pickles at all: a load that read one would fail
    otherwise than by the refusal."""
    for name in megatron_checkpoint_files(tensor, pipeline, False):
        path = root / "iter_0000003" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a checkpoint")
    (root / checkpointing.LATEST).write_text("3\n")
    return str(root / "iter_0000003")


@pytest.mark.parametrize("tensor, pipeline, saved", [(2, 1, "TP 2 x PP 1"), (1, 4, "TP 1 x PP 4")])
def test_another_tensor_or_pipeline_size_is_refused_before_anything_is_read(tensor, pipeline, saved, tmp_path,
                                                                            single_process):
    path = fake_torch_checkpoint(tmp_path, tensor, pipeline)
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        checkpointing.load_checkpoint(path, None, None, None)
    assert str(refusal.value) == (
        f"{path} was saved in the torch format at {saved} and this run is TP 1 x PP 1: the torch format does not "
        "reshard (Megatron-LM's neither); continue at the saved layout, or save with --ckpt-format torch_dist to move "
        "between layouts")


def test_a_missing_rank_and_no_format_are_refused_in_one_line(tmp_path, single_process):
    path = fake_torch_checkpoint(tmp_path, 2, 2)
    os.remove(os.path.join(path, "mp_rank_01_001", "model_optim_rng.pt"))
    os.rmdir(os.path.join(path, "mp_rank_01_001"))
    with pytest.raises(checkpointing.CheckpointError, match="^the checkpoint of iteration 3 is incomplete: .* has "
                                                            "no mp_rank_01_001$"):
        checkpointing.load_checkpoint(path, None, None, None)
    empty = tmp_path / "iter_0000005"
    empty.mkdir()
    with pytest.raises(checkpointing.CheckpointError, match="is in no format angpt reads: neither a distributed "
                                                            r"checkpoint \(metadata.json\) nor"):
        checkpointing.load_checkpoint(str(empty), None, None, None)


def test_the_readers_of_distributed_checkpoints_say_what_a_torch_one_is(tmp_path):
    """tools/convert_to_hf.py reads distributed checkpoints only (angpt/hf/checkpoint_reader.py)."""
    path = fake_torch_checkpoint(tmp_path, 1, 1)
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        checkpointing.read_common_state(path)
    assert str(refusal.value) == (f"{path} is in Megatron-LM's torch format (--ckpt-format torch), which is read only "
                                  "by a run at its layout: continue it under --ckpt-format torch_dist for a step and "
                                  "read that checkpoint")


def test_a_distributed_checkpoint_under_ckpt_format_torch_needs_auto_detect(tmp_path, single_process):
    """Megatron-LM's load: --ckpt-format torch reads a torch_dist checkpoint only with --auto-detect-ckpt-format."""
    path = tmp_path / "iter_0000003"
    path.mkdir()
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    assert checkpointing.checkpoint_format(str(path)) == "torch_dist"
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        checkpointing.load_checkpoint(str(path), None, None, None, ckpt_format="torch")
    assert str(refusal.value) == (f"{path} is a distributed checkpoint (torch_dist) and this run has --ckpt-format "
                                  "torch: give --auto-detect-ckpt-format to load it (as Megatron-LM)")


@pytest.mark.parametrize("flags, message", [
    (["--async-save"], "--async-save with --ckpt-format torch: Megatron-LM's torch format has no asynchronous save"),
    (["--use-distributed-optimizer", "--disable-gloo-process-groups"],
     "--ckpt-format torch with --use-distributed-optimizer needs megatron-core's gloo process groups"),
])
def test_what_the_torch_format_cannot_do_is_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--save", "ckpt", "--ckpt-format", "torch", *flags], world_size=2)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_the_flags_default_to_megatron_lms():
    config = parse_args([*MODEL, "--save", "x"], world_size=1).checkpoint
    assert (config.ckpt_format, config.auto_detect_ckpt_format) == ("torch_dist", False)
    config = parse_args([*MODEL, "--save", "x", "--ckpt-format", "torch", "--auto-detect-ckpt-format"],
                        world_size=1).checkpoint
    assert (config.ckpt_format, config.auto_detect_ckpt_format) == ("torch", True)
