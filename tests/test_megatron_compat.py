"""angpt.megatron_compat: the one place of megatron-core workarounds. Each workaround's effect is tested
where it matters (the CPU adapter in test_cpu_adapter.py, the optimizer load in test_checkpoint.py, the
signal-proof save queue in test_faults.py); here: that they are installed by `angpt.training.distributed.initialize`,
that the warnings and the log filter hide exactly what they name, and the version check."""

import logging
import os
import queue as queue_module
import signal
import subprocess
import sys
import time
import warnings

import megatron.core
import psutil
import pytest
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer
from megatron.core.transformer import cuda_graphs
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from angpt.config.sections import EXIT_SIGNALS
from angpt.megatron_compat import (
    KNOWN_WARNINGS,
    WRITTEN_FOR,
    fsdp2,
    parent_watch,
    patches,
    quiet_known_warnings,
    results_queue,
)

from conftest import ROOT
from launch import launch


def test_the_known_warnings_are_ignored_and_others_still_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        for category, message in KNOWN_WARNINGS:
            warnings.warn(message + " (and the rest of megatron-core's text)", category)
        warnings.warn("Transformer Engine is broken in a new way", UserWarning)
        warnings.warn("`load_state_dict` is deprecated", UserWarning)  # a known text, another category
    shown = [str(w.message) for w in caught]
    assert shown == ["Transformer Engine is broken in a new way", "`load_state_dict` is deprecated"]


def test_distributed_initialize_installs_the_patches(single_process):
    assert patches._installed
    assert filesystem_async._get_write_results_queue is patches._results_queue_that_outlives_exit_signals
    patched = DistributedOptimizer._set_main_param_and_optimizer_states.__qualname__
    assert ("_load_only_checkpointed_states" in patched) == (not HAVE_APEX_OR_TE)


GLOO_THREADS_AFTER_SET_UPS = """
import os, sys
from megatron.core import parallel_state
from angpt.training import distributed
destroy = distributed.destroy_model_parallel if sys.argv[1] == "ours" else parallel_state.destroy_model_parallel
counts = []
for _ in range(4):
    destroy()
    distributed.initialize()
    counts.append(len(os.listdir("/proc/self/task")))
print(*counts)
"""


@pytest.mark.slow
def test_destroying_the_model_parallel_groups_frees_their_gloo_threads(tmp_path):
    # megatron-core's own destroy_model_parallel only forgets the groups: each set-up left ~20 gloo groups and
    # their threads behind (the equivalence job, set up some 50 times, reached 2,500 threads per rank). In a
    # process of its own (started warm, tests/launch.py): a pytest worker holds the threads of whatever ran before.
    script = tmp_path / "gloo_threads.py"
    script.write_text(GLOO_THREADS_AFTER_SET_UPS)

    def threads_after_each_set_up(destroy: str) -> list:
        done = launch([str(script), destroy], env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"})
        assert done.returncode == 0, done.stderr[-2000:]
        return [int(count) for count in done.stdout.split()]

    ours, megatron_cores = threads_after_each_set_up("ours"), threads_after_each_set_up("megatron-core's")
    assert ours[-1] == ours[0], ours
    assert megatron_cores[-1] > megatron_cores[0], megatron_cores  # what the test would catch


def test_only_the_unknown_mlp_type_log_is_filtered(single_process, caplog):
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Unknown MLP type: <class 'angpt.models.layers.ScaledSwiGLUMLP'>. Using default kwargs.")
        logger.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]


def test_the_version_check_names_both_versions(caplog):
    assert megatron.core.__version__ == WRITTEN_FOR  # the installed one is the one pinned in setup.py
    assert patches.check_version(WRITTEN_FOR)
    with caplog.at_level(logging.WARNING, logger="angpt.megatron_compat"):
        assert not patches.check_version("0.17.0")
    assert WRITTEN_FOR in caplog.text and "0.17.0" in caplog.text and "make test" in caplog.text


def test_the_package_itself_imports_neither_torch_nor_megatron():
    code = "import sys, angpt.megatron_compat; print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


@pytest.mark.slow  # a process that imports megatron-core
def test_a_run_without_wandb_skips_megatron_cores_import_of_it():
    """wandb is installed (for --wandb-project); megatron-core imported it in every process, for 1.2 CPU-s."""
    code = ("import sys; from angpt.megatron_compat import skip_wandb_import; skip_wandb_import(); "
            "from megatron.core.inference.contexts import dynamic_context; "
            "print(dynamic_context.HAVE_WANDB, sys.modules['wandb'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                                                                                              "PYTHONPATH": ROOT})
    assert done.stdout.strip() == "False None", done.stderr[-2000:]


@pytest.mark.parametrize("pinned", ["setup.py", "requirements/cpu.txt"])
def test_the_pins_name_the_version_the_workarounds_were_written_for(pinned):
    assert f"megatron-core=={WRITTEN_FOR}" in open(f"{ROOT}/{pinned}").read()


def test_a_graph_input_buffer_kept_for_backward_stays_out_of_the_reuse_pool(single_process):
    """megatron-core's local CUDA graphs return the first layer's forward input buffer to the reuse pool, from
    which a later backward graph took it as a gradient buffer (wrong gradients, found on an H200). With the
    patch, such a buffer (marked `can_skip_replay_copy = False`) stays out while gradients are on; gradient
    buffers (unmarked) and buffers of forward-only graphs still go back."""
    pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
    assert cuda_graphs.TensorReusePool.insert is patches._insert_unless_saved_for_backward

    def buffer(marked):
        tensor = pool.get(cuda_graphs.ArgMetadata(torch.zeros(2, 3)))
        if marked:
            tensor.can_skip_replay_copy = False
        return tensor

    try:
        forward_input, gradient, forward_only_input = buffer(True), buffer(False), buffer(True)
        pool.insert(forward_input)
        pool.insert(gradient)
        with torch.no_grad():
            pool.insert(forward_only_input)
        pooled = {id(tensor) for tensor in pool.pool}
        assert id(forward_input) not in pooled
        assert id(gradient) in pooled and id(forward_only_input) in pooled
    finally:
        pool.pool.clear()
        pool.tensor_strong_refs.clear()
        pool.tensor_strong_refs_dataptrs.clear()


# A training process that starts the save's results queue and says its Manager's pid (tests below kill it).
QUEUE_HOLDER = """
import sys, time
from angpt.config.sections import EXIT_SIGNALS
from angpt.megatron_compat import results_queue
manager, queue = results_queue.start(EXIT_SIGNALS)
print(manager._process.pid, flush=True)
time.sleep(600)
"""


def _ended(pid: int) -> bool:
    # An orphan is a zombie until init reaps it (a container's init may never): it has ended.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_results_queue_passes_torch_objects_through_a_manager_without_torch():
    """megatron-core's Manager unpickled every write result, importing torch for it (2 CPU-s and 300 MB a
    rank): the results now cross it as bytes."""
    manager, queue = results_queue.start(EXIT_SIGNALS)
    try:
        result = WriteResult(index=MetadataIndex("decoder.weight", torch.Size([4, 0]), 1), size_in_bytes=64,
                             storage_data={"relative_path": "__0_0.distcp"})
        queue.put([result])
        assert queue.get_nowait() == [result]
        with pytest.raises(queue_module.Empty):
            queue.get_nowait()
        assert "libtorch" not in open(f"/proc/{manager._process.pid}/maps").read()
    finally:
        manager.shutdown()


def test_the_results_queue_outlives_exit_signals_but_not_its_process():
    """The Manager ignores SIGTERM (a signal to the process group must not kill the save it asked for), and
    exits by itself within a second of its training process's SIGKILL, rather than staying behind for good."""
    holder = subprocess.Popen([sys.executable, "-c", QUEUE_HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        manager = int(holder.stdout.readline())
        os.kill(manager, signal.SIGTERM)
        time.sleep(2 * parent_watch.PARENT_POLL_INTERVAL)
        assert not _ended(manager)
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 10
        while not _ended(manager) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ended(manager), "the Manager outlived its killed training process by 10 s"
    finally:
        holder.kill()


def test_fsdp2_weights_with_fewer_rows_than_ranks_are_named_at_the_boundary():
    """torch.chunk cuts R rows into R shards of one at R ranks; at R + 1 ranks one shard is empty."""
    rows = {"s_qk": 4, "embedding": 256, "empty": 0}
    assert fsdp2.fewer_rows_than_ranks(rows, 4) == {"empty": 0}
    assert fsdp2.fewer_rows_than_ranks(rows, 5) == {"s_qk": 4, "empty": 0}
    assert fsdp2.fewer_rows_than_ranks({}, 8) == {}
