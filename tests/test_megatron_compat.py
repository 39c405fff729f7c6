"""angpt.megatron_compat: the one place of megatron-core workarounds. Each workaround's effect is tested
where it matters (the CPU adapter in test_cpu_adapter.py, the optimizer load in test_checkpoint.py, the
signal-proof save queue in test_faults.py); here: that they are installed by `angpt.distributed.initialize`,
that the warnings and the log filter hide exactly what they name, and the version check."""

import logging
import subprocess
import sys
import warnings

import megatron.core
import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

from angpt.megatron_compat import KNOWN_WARNINGS, WRITTEN_FOR, patches, quiet_known_warnings

from conftest import ROOT


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


@pytest.mark.parametrize("pinned", ["setup.py", "requirements/cpu.txt"])
def test_the_pins_name_the_version_the_workarounds_were_written_for(pinned):
    assert f"megatron-core=={WRITTEN_FOR}" in open(f"{ROOT}/{pinned}").read()
