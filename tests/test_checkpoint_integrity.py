"""Nothing lost, nothing silently wrong: the fault drills on checkpoints. Damaged, truncated or missing files
are refused in one line naming the file and the iteration (or skipped for the newest intact checkpoint
when asked); one run at a time writes into a --save directory; a missing latest file is not ignored; a
full disk says so and leaves the previous checkpoint; the Hugging Face export replaces an old one whole.

Trainers run in this process (one-process gloo group) on a tiny model; one test launches real runs."""

from __future__ import annotations

import atexit
import errno
import io
import json
import logging
import os
import pickle
import random
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from torch.distributed.checkpoint import default_planner

from angpt.hf.export import ExportError, export
from angpt.hf.importer import import_hf
from angpt.megatron_compat import checkpoint_unpickling
from angpt.training import checkpointing, digests, save_lock
from angpt.training.trainer import Trainer

from conftest import ROOT, in_process_trainer
from launch import launch

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "128",
         "--log-interval", "1", "--eval-iters", "0", "--train-iters", "4"]


def trainer(*flags: str) -> Trainer:
    return in_process_trainer([*MODEL, *flags])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, single_process):
    """A run of 4 iterations, checkpointed at 2 and 4."""
    run_dir = tmp_path_factory.mktemp("saved")
    assert trainer("--save", str(run_dir), "--save-interval", "2").run() == 0
    return run_dir


@pytest.fixture
def copy(saved, tmp_path):
    destination = tmp_path / "run"
    shutil.copytree(saved, destination)
    return destination


def overwrite_256_bytes(path) -> None:
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(bytes(range(256)))


def truncate(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


# The drills: what happened to a file of the latest checkpoint (iteration 4), and the file.
DAMAGES = {
    "256_bytes_overwritten_in_a_shard": (overwrite_256_bytes, "__0_0.distcp"),
    "truncated_shard": (truncate, "__0_1.distcp"),
    "truncated_common_state": (truncate, "common.pt"),
    "missing_metadata": (os.remove, ".metadata"),
    "missing_common_state": (os.remove, "common.pt"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(damage, copy):
    """Before digests: the overwritten shard loaded silently (its NaNs surfaced as a NaN loss two steps
    later); truncated and missing files raised EOFError, PytorchStreamReader or 'metadata is None' naming no
    file."""
    harm, name = DAMAGES[damage]
    harm(copy / "iter_0000004" / name)
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        trainer("--load", str(copy))
    message = str(refusal.value)
    print(message)
    assert "\n" not in message
    assert message.startswith("the checkpoint of iteration 4 is damaged: ")
    assert str(copy / "iter_0000004" / name) in message
    assert "--load-fallback-to-intact" in message


@pytest.mark.slow
def test_the_fallback_resumes_from_the_newest_intact_checkpoint(copy, caplog):
    overwrite_256_bytes(copy / "iter_0000004" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        resumed = trainer("--load", str(copy), "--load-fallback-to-intact")
    assert resumed.state.iteration == 2
    assert f"{copy / 'iter_0000004' / '__0_0.distcp'} is corrupted" in caplog.text
    assert f"resuming from {copy / 'iter_0000002'}, the newest intact checkpoint" in caplog.text


@pytest.mark.slow
def test_ckpt_step_resumes_from_that_iteration_and_names_what_there_is_otherwise(copy):
    """--ckpt-step (Megatron-LM's): the checkpoint of that iteration, not the latest (4), verified as any load;
    the latest itself too; an iteration with no complete checkpoint (3, and one past the last) refused in one line
    naming the ones there are, and a damaged one refused as the latest would be."""
    resumed = trainer("--load", str(copy), "--ckpt-step", "2")
    assert (resumed.loaded_from, resumed.state.iteration) == (str(copy / "iter_0000002"), 2)
    assert trainer("--load", str(copy), "--ckpt-step", "4").state.iteration == 4
    for missing in (3, 5):
        with pytest.raises(checkpointing.CheckpointError) as refusal:
            trainer("--load", str(copy), "--ckpt-step", str(missing))
        assert str(refusal.value) == (f"--ckpt-step {missing}: {copy} holds no complete checkpoint of iteration "
                                      f"{missing} (its iterations: 2, 4)")
    overwrite_256_bytes(copy / "iter_0000002" / "__0_0.distcp")
    with pytest.raises(checkpointing.CheckpointError, match="the checkpoint of iteration 2 is damaged: "):
        trainer("--load", str(copy), "--ckpt-step", "2")


@pytest.mark.slow
def test_a_checkpoint_without_digests_still_loads_with_a_note(copy, caplog):
    """As written before digests were recorded; damaged, it is refused in one line naming the directory."""
    os.remove(copy / "iter_0000004" / digests.DIGESTS)
    with caplog.at_level(logging.WARNING):
        assert trainer("--load", str(copy)).state.iteration == 4
    assert f"{copy / 'iter_0000004'} has no {digests.DIGESTS} (saved before digests were recorded): it cannot be " \
           "verified" in caplog.text
    truncate(copy / "iter_0000004" / "common.pt")
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        trainer("--load", str(copy))
    assert "\n" not in str(refusal.value)
    assert str(refusal.value).startswith(f"the checkpoint of iteration 4 in {copy / 'iter_0000004'}, which has no "
                                         "digests to name a damaged file, cannot be read: ")


@pytest.mark.slow
def test_a_missing_latest_file_beside_checkpoints_is_refused_or_resolved_when_asked(copy, caplog):
    """Before: a warning, and training from scratch over the checkpoints."""
    os.remove(copy / checkpointing.LATEST)
    with pytest.raises(checkpointing.CheckpointError,
                       match=rf"has no {re.escape(checkpointing.LATEST)} but holds checkpoints of iterations 2, 4: "
                             "give --load-fallback-to-intact"):
        trainer("--load", str(copy), "--save", str(copy))
    with caplog.at_level(logging.WARNING):
        assert trainer("--load", str(copy), "--load-fallback-to-intact").state.iteration == 4
    assert "has no usable latest_checkpointed_iteration.txt" in caplog.text


def test_the_export_verifies_the_checkpoint_it_reads(copy, tmp_path):
    damaged = copy / "iter_0000004" / "common.pt"
    overwrite_256_bytes(damaged)
    with pytest.raises(ExportError, match=rf"^the checkpoint of iteration 4 is damaged: {re.escape(str(damaged))} "
                                          r"is corrupted"):
        export(str(copy), str(tmp_path / "hf"))


class RunsCode:
    """Unpickled, it makes the directory `marker` (as a crafted checkpoint could run any command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant_code(directory, name: str, marker) -> None:
    """Rewrite the checkpoint file `name` (common.pt or the distributed checkpoint's .metadata) so that it runs
    code when unpickled, keeping everything else it holds."""
    path = directory / name
    if name == "common.pt":
        state = torch.load(path, weights_only=True)
        state["train_state"]["planted"] = RunsCode(marker)
        torch.save(state, path)
    else:
        with open(path, "rb") as file:
            metadata = pickle.load(file)
        metadata.planner_data = RunsCode(marker)
        with open(path, "wb") as file:
            pickle.dump(metadata, file)


def recompute_digest(directory, name: str) -> None:
    """As someone who crafts a checkpoint would: its digests then vouch for the file."""
    with open(directory / digests.DIGESTS) as file:
        recorded = json.load(file)
    path = str(directory / name)
    recorded["files"][name] = {"size": os.path.getsize(path), "digest": digests.file_digest(path)}
    with open(directory / digests.DIGESTS, "w") as file:
        json.dump(recorded, file)


@pytest.mark.parametrize("with_digests", ["recomputed", "removed"])
@pytest.mark.parametrize("name", ["common.pt", ".metadata"])
def test_a_checkpoint_that_would_run_code_is_refused_in_one_line_naming_the_file(name, with_digests, copy, tmp_path):
    """Before: common.pt was refused by torch in paragraphs that suggest weights_only=False; .metadata (a
    plain pickle.load in torch's FileSystemReader) ran the code. The training load and the export refuse both."""
    directory, marker = copy / "iter_0000004", tmp_path / "code_ran"
    plant_code(directory, name, marker)
    if with_digests == "recomputed":
        recompute_digest(directory, name)
    else:
        os.remove(directory / digests.DIGESTS)
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        trainer("--load", str(copy))
    message = str(refusal.value)
    print(message)
    assert "\n" not in message
    assert message.startswith(f"{directory / name}: refused: loading it would call or build ")
    assert "posix.mkdir" in message and "checkpoints are loaded as data only" in message
    if with_digests == "recomputed":
        with pytest.raises(ExportError, match=rf"^{re.escape(str(directory / name))}: refused: "):
            export(str(copy), str(tmp_path / "hf"))
    assert not marker.exists()


def test_a_checkpoint_item_that_would_run_code_is_refused(tmp_path):
    """The distributed checkpoint's non-tensor items (the RNG states) are read weights-only too; NumPy's RNG
    state, which megatron-core saves, is allowed."""
    marker = tmp_path / "code_ran"
    planner = default_planner.DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="rng_state/shard_0.0_1.1"))

    def pickled(value) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer

    checkpoint_unpickling.install()
    state = {"np_rng_state": np.random.get_state(), "random_rng_state": random.getstate(),
             "torch_rng_state": torch.get_rng_state()}
    planner.load_bytes(item, pickled(state))
    assert str(planner.state_dict[item.dest_index.fqn]) == str(state)
    with pytest.raises(checkpoint_unpickling.UnsafeCheckpointError,
                       match=r"^the checkpoint's item rng_state/shard_0.0_1.1: refused: loading it would call or "
                             r"build posix.mkdir"):
        planner.load_bytes(item, pickled([RunsCode(marker)]))
    assert not marker.exists()


def lock_of(process: psutil.Process, host: str = socket.gethostname()) -> dict:
    return {"host": host, "pid": process.pid, "started": process.create_time(), "command": "an earlier run"}


def write_lock(directory, holder: dict) -> None:
    with open(os.path.join(directory, save_lock.LOCK), "w") as file:
        json.dump(holder, file)


def test_a_second_run_on_a_save_directory_is_refused_naming_the_holder(copy):
    """Before: the second run deleted the first one's save in progress and appended to its metrics."""
    in_progress = copy / "iter_0000006.incomplete"
    in_progress.mkdir()
    metrics = (copy / "metrics.jsonl").read_bytes()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(copy, lock_of(psutil.Process(holder.pid)))
        with pytest.raises(save_lock.SaveLockError) as refusal:
            trainer("--save", str(copy), "--load", str(copy))
    finally:
        holder.kill()
        holder.wait()
    assert str(refusal.value).startswith(f"{copy} is being written by another run (PID {holder.pid} on "
                                         f"{socket.gethostname()}, started ")
    assert in_progress.is_dir() and (copy / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_on_its_host_and_refused_from_another(copy, caplog):
    ended = subprocess.Popen(["sleep", "60"])
    holder = lock_of(psutil.Process(ended.pid))
    ended.kill()
    ended.wait()
    write_lock(copy, holder)
    with caplog.at_level(logging.WARNING):
        run = trainer("--save", str(copy), "--load", str(copy), "--train-iters", "5")
    assert f"taking over {copy / save_lock.LOCK} from a run that is no longer running (PID {ended.pid}" in caplog.text
    assert run.run() == 0 and not (copy / save_lock.LOCK).exists()  # released at the end

    write_lock(copy, lock_of(psutil.Process(), host="another-host"))
    with pytest.raises(save_lock.SaveLockError,
                       match=rf"locked by a run on another host \(PID {os.getpid()} on another-host, "
                             rf".*remove {re.escape(str(copy / save_lock.LOCK))} and start again"):
        trainer("--save", str(copy))


def test_a_lock_of_a_killed_run_not_yet_reaped_is_taken_over(tmp_path, caplog):
    """A run killed the hard way is a zombie until reaped, and psutil still gives its start time: before, a run
    started at once on its save directory was refused as if the killed one still wrote there."""
    killed = subprocess.Popen(["sleep", "60"])
    try:
        holder = lock_of(psutil.Process(killed.pid))
        killed.kill()
        while psutil.Process(killed.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        write_lock(tmp_path, holder)
        with caplog.at_level(logging.WARNING):
            save_lock.acquire(str(tmp_path))
    finally:
        killed.wait()
    assert f"from a run that is no longer running (PID {killed.pid}" in caplog.text
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["pid"] == os.getpid()
    save_lock.release(str(tmp_path))


@pytest.mark.slow
def test_a_lock_left_by_an_earlier_attempt_of_the_same_slurm_job_is_taken_over_from_another_host(
        copy, caplog, monkeypatch):
    """A requeued Slurm job (the same SLURM_JOB_ID, its SLURM_RESTART_COUNT one higher) whose rank 0 now runs on
    another node: the earlier attempt has stopped, since Slurm requeues only a stopped job."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for job, attempt in (("4242", 1), ("4243", 0)):  # this very attempt elsewhere, or another job: refused
        write_lock(copy, {**lock_of(psutil.Process(), host="another-host"), "slurm_job_id": job,
                          "slurm_restart_count": attempt})
        with pytest.raises(save_lock.SaveLockError, match="locked by a run on another host"):
            trainer("--save", str(copy))
    write_lock(copy, {**lock_of(psutil.Process(), host="another-host"), "slurm_job_id": "4242",
                      "slurm_restart_count": 0})
    with caplog.at_level(logging.WARNING):
        run = trainer("--save", str(copy), "--load", str(copy), "--train-iters", "5")
    assert f"taking over {copy / save_lock.LOCK} from an earlier attempt of Slurm job 4242, requeued" in caplog.text
    assert run.run() == 0 and not (copy / save_lock.LOCK).exists()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs: room for one checkpoint of the tiny model (660 kB), not two. Mounting needs root."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (not root?): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["refused_before_writing", "filled_while_writing"])
def test_a_full_disk_says_so_and_leaves_the_previous_checkpoint(when, small_filesystem, tmp_path, monkeypatch):
    """A real full file system. "filled_while_writing": the estimate of the space needed is taken as 0, so
    the save runs into ENOSPC. Before: a CheckpointException whose text never said "no space" (or a
    torch.save 'unexpected pos'), and an `.incomplete` directory filling the disk."""
    if when == "filled_while_writing":
        monkeypatch.setattr(checkpointing, "_estimated_bytes", lambda sharded: 0)
    run_dir = small_filesystem / "run"
    run = trainer("--save", str(run_dir), "--save-interval", "2", "--metrics-file", str(tmp_path / "metrics.jsonl"),
                  "--tensorboard-dir", str(tmp_path / "tensorboard"))
    with pytest.raises(checkpointing.CheckpointError) as refusal:
        run.run()
    message = str(refusal.value)
    print(message)
    assert message.startswith(f"no space left in {run_dir} for the checkpoint of iteration 4: it needs ")
    assert message.endswith("; the previous checkpoint (iteration 2) is intact")
    # Nothing of the failed save left; the lock goes when the process exits.
    assert set(os.listdir(run_dir)) - {save_lock.LOCK} == {checkpointing.LATEST, "iter_0000002"}
    assert checkpointing.verify_checkpoint(str(run_dir / "iter_0000002"))


def convert_to_hf(*argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["convert_to_hf.py", *argv, "--no-verify"])
    runpy.run_path(os.path.join(ROOT, "tools", "convert_to_hf.py"), run_name="__main__")


def test_an_export_over_an_old_one_is_refused_unless_asked_and_then_replaces_it_whole(saved, tmp_path, monkeypatch):
    """Before: the sharded export was written beside the old model.safetensors, which transformers loads
    first, and exited 0."""
    output = tmp_path / "hf"
    convert_to_hf("--load", str(saved), "--output", str(output), monkeypatch=monkeypatch)
    (output / "notes.txt").write_text("from the old export")
    sharded = ["--load", str(saved), "--output", str(output), "--max-shard-size-mb", "0.05"]
    with pytest.raises(SystemExit, match=rf"^convert_to_hf: {re.escape(str(output))} is not empty: give --overwrite"):
        convert_to_hf(*sharded, monkeypatch=monkeypatch)
    assert (output / "model.safetensors").exists()
    convert_to_hf(*sharded, "--overwrite", monkeypatch=monkeypatch)
    files = sorted(os.listdir(output))
    assert "model.safetensors" not in files and "notes.txt" not in files
    assert "model.safetensors.index.json" in files and any(name.startswith("model-00001-of-") for name in files)
    assert os.listdir(tmp_path) == ["hf"]  # no staging directory left beside it


def test_a_checkpoint_imported_from_hugging_face_records_digests(saved, tmp_path):
    export(str(saved), str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert checkpointing.verify_checkpoint(str(tmp_path / "imported" / "iter_0000000"))


# Over the suite's budget of 60 s: a real torchrun job trains (and saves asynchronously) while a
# second run is refused and until its workers are signalled; the second run and the resume start warm.
@pytest.mark.multiprocess
def test_two_runs_on_one_save_directory(tmp_path):
    """Real runs under torchrun: a second run on the directory of one in progress is refused by every rank
    without touching it; the first (saving asynchronously) goes on, releases the lock at exit and recorded
    digests at each commit; a resume at two ranks verifies them and falls back past a damaged checkpoint."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    pretrain = ["-m", "angpt.pretrain", *MODEL, "--global-batch-size", "4", "--save", str(tmp_path)]

    def to_the_end(*flags: str) -> tuple[int, str]:
        """A run started warm while the first one trains (tests/launch.py): its exit code and output."""
        done = launch([*pretrain, *flags], nproc=2, env=env, timeout=240)
        return done.returncode, done.stdout + done.stderr

    # torchrun for real: the first run is stopped by signals to its workers.
    first = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              *pretrain, "--train-iters", "1000", "--save-interval", "2", "--keep-last-n-checkpoints",
                              "3", "--async-save"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not os.path.isfile(tmp_path / checkpointing.LATEST):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-4000:]
            time.sleep(0.2)
        with open(tmp_path / save_lock.LOCK) as file:
            holder = json.load(file)
        code, output = to_the_end("--load", str(tmp_path), "--train-iters", "1000", "--lr", "5e-3")
        assert code != 0, output[-4000:]
        assert f"angpt.pretrain: {tmp_path} is being written by another run (PID {holder['pid']} on {holder['host']}" \
            in output, output[-4000:]
        assert first.poll() is None
    finally:
        for worker in psutil.Process(first.pid).children():  # as a cluster's warning: save and exit 0
            worker.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=240)[0]
    assert first.returncode == 0, output[-4000:]
    assert not (tmp_path / save_lock.LOCK).exists()
    with open(tmp_path / "metrics.jsonl") as file:
        steps = [record["iteration"] for record in map(json.loads, file) if record["kind"] == "train"]
    assert steps == list(range(1, len(steps) + 1))  # the first run's alone
    latest = checkpointing.read_latest_iteration(str(tmp_path))
    previous = checkpointing.complete_iterations(str(tmp_path))[-2]
    for iteration in checkpointing.complete_iterations(str(tmp_path)):
        with open(tmp_path / f"iter_{iteration:07d}" / digests.DIGESTS) as file:
            assert json.load(file)["algorithm"] == digests.ALGORITHM
    overwrite_256_bytes(tmp_path / f"iter_{latest:07d}" / "__1_0.distcp")
    code, output = to_the_end("--load", str(tmp_path), "--load-fallback-to-intact", "--train-iters", str(previous + 1))
    assert code == 0, output[-4000:]
    assert f"the checkpoint of iteration {latest} is damaged: {tmp_path / f'iter_{latest:07d}' / '__1_0.distcp'}" \
           in output
    assert f"loaded checkpoint {tmp_path / f'iter_{previous:07d}'} (iteration {previous})" in output
    assert checkpointing.read_latest_iteration(str(tmp_path)) == previous + 1


def test_the_files_are_shared_out_largest_first_each_to_the_least_loaded_rank(monkeypatch):
    """digests.py's rule, by hand on two ranks: c (5 bytes) to rank 0; d (4) to rank 1; b (3) to rank 1, which
    has 4 to rank 0's 5; a (1) to rank 0, which has 5 to rank 1's 7. Every rank computes the same split."""
    sizes = {"a": 1, "b": 3, "c": 5, "d": 4}
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, rank=rank: rank)
        shares.append(digests._my_share(sizes))
    assert shares == [["c", "a"], ["d", "b"]]


def write_digests(directory, content) -> None:
    with open(os.path.join(directory, digests.DIGESTS), "w") as file:
        file.write(content if isinstance(content, str) else json.dumps(content))


def test_digests_of_another_algorithm_or_unreadable_are_refused_saying_why(tmp_path, single_process):
    path = tmp_path / digests.DIGESTS
    write_digests(tmp_path, {"algorithm": "md5", "files": {}})
    assert digests.check(str(tmp_path)) == f"{path} uses the digest 'md5', which this version does not know"
    write_digests(tmp_path, "{")
    assert digests.check(str(tmp_path)).startswith(f"{path} is unreadable (JSONDecodeError: ")


def test_the_verdict_names_the_first_damaged_file_and_counts_the_others(tmp_path, single_process):
    """digests.check: one line naming the first damaged file (by name), and how many others are."""
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(name.encode() * 10)
    digests.record(str(tmp_path))
    assert digests.check(str(tmp_path)) is None
    (tmp_path / "c").write_bytes(b"c" * 5)
    assert digests.check(str(tmp_path)) == f"{tmp_path / 'c'} has 5 bytes, 10 when it was saved (truncated or " \
        "overwritten)"
    (tmp_path / "b").unlink()
    assert digests.check(str(tmp_path)) == f"{tmp_path / 'b'} is missing (and 1 other damaged files)"
    (tmp_path / "a").write_bytes(b"x" * 10)
    assert digests.check(str(tmp_path)) == f"{tmp_path / 'a'} is corrupted (its content differs from the digest " \
        "recorded when it was saved) (and 2 other damaged files)"


def test_a_file_that_cannot_be_read_is_named_with_the_systems_reason(tmp_path, single_process):
    """A directory where a file of the same size was recorded: the size matches, reading it fails."""
    (tmp_path / "shard").mkdir()
    write_digests(tmp_path, {"algorithm": digests.ALGORITHM,
                             "files": {"shard": {"size": os.path.getsize(tmp_path / "shard"), "digest": "0"}}})
    assert digests.check(str(tmp_path)) == f"{tmp_path / 'shard'} cannot be read ({os.strerror(errno.EISDIR)})"


@pytest.fixture
def this_host_only(monkeypatch):
    """No Slurm job around: the lock's tests set their own."""
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def test_a_lock_names_this_process_and_is_released_by_it_alone(tmp_path, this_host_only, monkeypatch):
    """Released when the run ends (at exit), by the process that holds it only. The lock is a file of data that
    every user may read."""
    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda function, *args: at_exit.append((function, args)))
    directory = tmp_path / "not" / "yet"
    save_lock.acquire(str(directory))
    assert at_exit == [(save_lock.release, (str(directory),))]
    mode = os.stat(directory / save_lock.LOCK).st_mode
    assert mode & 0o444 == 0o444 and not mode & 0o111
    holder = json.loads((directory / save_lock.LOCK).read_text())
    assert holder == {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time(),
                      "command": " ".join(sys.argv), "slurm_job_id": None, "slurm_restart_count": 0}
    save_lock.acquire(str(directory))  # taken again by the same process: a no-op
    assert json.loads((directory / save_lock.LOCK).read_text()) == holder
    write_lock(directory, {**holder, "pid": holder["pid"] + 1})  # another process's lock is not released
    save_lock.release(str(directory))
    assert (directory / save_lock.LOCK).exists()
    write_lock(directory, holder)
    save_lock.release(str(directory))
    assert not (directory / save_lock.LOCK).exists()
    save_lock.release(str(directory))  # nothing to release


@pytest.mark.parametrize("content", ["{", "[]", json.dumps({"host": "h", "pid": "1", "started": 1.0}),
                                     json.dumps({"host": 1, "pid": 1, "started": 1.0}),
                                     json.dumps({"host": "h", "pid": 1, "started": "now"}),
                                     json.dumps({"pid": 1, "started": 1.0})])
def test_a_lock_that_names_no_run_is_refused_after_waiting_for_its_writer(content, tmp_path, monkeypatch,
                                                                          this_host_only):
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    (tmp_path / save_lock.LOCK).write_text(content)
    with pytest.raises(save_lock.SaveLockError, match=rf"^{re.escape(str(tmp_path / save_lock.LOCK))} exists but "
                       rf"names no run \(damaged\?\): if no run writes into {re.escape(str(tmp_path))}, remove it"):
        save_lock.acquire(str(tmp_path))
    assert len(waits) == 50 and sum(waits) == pytest.approx(5.0)  # 5 s for a run to write who it is


# How the lock's messages name its holder: PID, host, local start time.
HOLDER = r"\(PID \d+ on \S+, started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\)"


def test_a_lock_is_stale_when_its_pid_started_at_another_time(tmp_path, caplog, this_host_only, monkeypatch):
    """A PID is the same process when psutil's start time agrees to within STARTED_TOLERANCE_S (1 s): a lock
    naming a live PID with a start time 1 s off names a process that ended (its PID reused). Taken over, it is
    released at exit as a lock created."""
    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda function, *args: at_exit.append((function, args)))
    running = subprocess.Popen(["sleep", "60"])
    try:
        holder = lock_of(psutil.Process(running.pid))
        write_lock(tmp_path, {**holder, "started": holder["started"] + 0.9})
        with pytest.raises(save_lock.SaveLockError, match=rf"^{re.escape(str(tmp_path))} is being written by another "
                           rf"run \(PID {running.pid} .*\): wait for it to end or give this run another --save$"):
            save_lock.acquire(str(tmp_path))
        write_lock(tmp_path, {**holder, "started": holder["started"] + 1.0})
        with caplog.at_level(logging.WARNING):
            save_lock.acquire(str(tmp_path))
    finally:
        running.kill()
        running.wait()
    [message] = caplog.messages
    assert re.fullmatch(rf"taking over {re.escape(str(tmp_path / save_lock.LOCK))} from a run that is no longer "
                        rf"running {HOLDER}", message) and f"(PID {running.pid} " in message
    assert at_exit == [(save_lock.release, (str(tmp_path),))]
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["pid"] == os.getpid()
    save_lock.release(str(tmp_path))
    write_lock(tmp_path, holder)  # its PID now names no process
    with caplog.at_level(logging.WARNING):
        save_lock.acquire(str(tmp_path))
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["pid"] == os.getpid()
    save_lock.release(str(tmp_path))


@pytest.mark.parametrize("winner", ["another run", "damaged"])
def test_of_two_runs_taking_over_one_stale_lock_the_one_overwritten_is_refused(winner, tmp_path, monkeypatch,
                                                                              this_host_only):
    """Both replace the stale lock at the same moment; the file then names the other (or, half written, no one)."""
    ended = subprocess.Popen(["sleep", "60"])
    stale = lock_of(psutil.Process(ended.pid))
    ended.kill()
    ended.wait()
    write_lock(tmp_path, stale)
    replace = save_lock._replace

    def overwritten(path, me):
        replace(path, me)
        if winner == "damaged":
            (tmp_path / save_lock.LOCK).write_text("{")
        else:
            write_lock(tmp_path, {**me, "host": "another-host"})

    monkeypatch.setattr(save_lock, "_replace", overwritten)
    named = rf" {HOLDER}" if winner == "another run" else ""
    with pytest.raises(save_lock.SaveLockError, match=rf"^{re.escape(str(tmp_path))} was taken over at the same "
                                                      rf"time by another run{named}$"):
        save_lock.acquire(str(tmp_path))


def test_a_lock_released_while_it_is_read_is_taken(tmp_path, monkeypatch, this_host_only):
    """Between this run's attempt to create the lock and its reading of the holder, the holder released it."""
    write_lock(tmp_path, lock_of(psutil.Process(), host="another-host"))
    read = save_lock._read

    def released_meanwhile(path):
        monkeypatch.setattr(save_lock, "_read", read)
        os.remove(path)
        return read(path)

    monkeypatch.setattr(save_lock, "_read", released_meanwhile)
    save_lock.acquire(str(tmp_path))
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["pid"] == os.getpid()
    save_lock.release(str(tmp_path))


def test_this_process_is_itself_to_within_the_tolerance_of_its_start_time(tmp_path, caplog, this_host_only):
    me = save_lock.this_process()
    write_lock(tmp_path, {**me, "started": me["started"] + 0.9})
    save_lock.acquire(str(tmp_path))  # its own lock: nothing to take over
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["started"] == me["started"] + 0.9
    write_lock(tmp_path, {**me, "started": me["started"] + 1.0})  # an earlier process of the same PID
    with caplog.at_level(logging.WARNING):
        save_lock.acquire(str(tmp_path))
    assert "from a run that is no longer running" in caplog.text
    assert json.loads((tmp_path / save_lock.LOCK).read_text()) == me
    save_lock.release(str(tmp_path))


@pytest.mark.parametrize("holder, taken_over", [
    ({"slurm_job_id": "42", "slurm_restart_count": 0}, True),  # the attempt before
    ({"slurm_job_id": "42", "slurm_restart_count": 1}, False),  # this very attempt, elsewhere
    ({"slurm_job_id": "42", "slurm_restart_count": "0"}, False),  # not a count
    ({"slurm_job_id": "42"}, False),
    ({"slurm_job_id": "43", "slurm_restart_count": 0}, False),  # another job
])
def test_only_an_earlier_attempt_of_this_slurm_job_is_taken_over_from_another_host(holder, taken_over, tmp_path,
                                                                                   monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path, {**lock_of(psutil.Process(), host="another-host"), **holder})
    if not taken_over:
        with pytest.raises(save_lock.SaveLockError, match="locked by a run on another host"):
            save_lock.acquire(str(tmp_path))
        return
    with caplog.at_level(logging.WARNING):
        save_lock.acquire(str(tmp_path))
    [message] = caplog.messages
    assert re.fullmatch(rf"taking over {re.escape(str(tmp_path / save_lock.LOCK))} from an earlier attempt of Slurm "
                        rf"job 42, requeued {HOLDER}", message) and f"(PID {os.getpid()} on another-host" in message
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["slurm_restart_count"] == 1
    save_lock.release(str(tmp_path))


def test_outside_slurm_a_lock_from_another_host_is_refused_whatever_its_job(tmp_path, this_host_only):
    """Two runs outside Slurm both have no job id: that is no earlier attempt of one job."""
    write_lock(tmp_path, {**lock_of(psutil.Process(), host="another-host"), "slurm_job_id": None,
                          "slurm_restart_count": -1})
    with pytest.raises(save_lock.SaveLockError, match="locked by a run on another host"):
        save_lock.acquire(str(tmp_path))


def test_the_holder_is_described_by_its_local_start_time(tmp_path, this_host_only):
    started = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    write_lock(tmp_path, {"host": "another-host", "pid": 12, "started": started})
    with pytest.raises(save_lock.SaveLockError, match=r"\(PID 12 on another-host, started 2026-03-04 05:06:07\)"):
        save_lock.acquire(str(tmp_path))


def test_taking_a_lock_that_cannot_be_written_is_refused_on_every_rank(tmp_path, single_process, this_host_only):
    (tmp_path / "file").write_text("")
    with pytest.raises(save_lock.SaveLockError, match=rf"^cannot lock {re.escape(str(tmp_path / 'file' / 'run'))}: "):
        save_lock.take(str(tmp_path / "file" / "run"))
    write_lock(tmp_path, lock_of(psutil.Process(), host="another-host"))
    with pytest.raises(save_lock.SaveLockError, match="locked by a run on another host"):
        save_lock.take(str(tmp_path))
    save_lock.take(str(tmp_path / "free"))
    assert json.loads((tmp_path / "free" / save_lock.LOCK).read_text())["pid"] == os.getpid()
    save_lock.release(str(tmp_path / "free"))
