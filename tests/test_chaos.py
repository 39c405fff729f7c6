"""The chaos soak, short (a long check: `make test-long`): benchmarks/chaos_resume.py kills a 2-process torchrun
job 5 times at random moments (SIGKILL or SIGTERM, to one rank, all ranks, torchrun or everything; during a
step, a sync or async save, or the start and load), resumes it after each, and finds the uninterrupted run's
checkpoint and losses, and no process left behind. The long soak's report is in docs/results.md."""

import os
import signal
import sys

import pytest
from test_trainer import environment

from conftest import ROOT
from launch import launch

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import chaos_resume  # noqa: E402

# A long check (`make test-long`, which CI runs after `make test`): its cold torchrun jobs took 71 s alone and
# 124-181 s beside the rest of `make test`, whose 10 minutes they overran.
pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


# torchrun and its kills are the subject, so each of the 6 launches after the uninterrupted run (which starts
# warm) is a cold torchrun job of two ranks.
def test_five_kills_and_resumes_end_as_the_uninterrupted_run_with_nothing_left_behind(tmp_path):
    reference = str(tmp_path / "uninterrupted")
    done = launch(["-m", "angpt.pretrain", *chaos_resume.MODEL, "--train-iters", "4", "--save", reference,
                   "--save-interval", str(chaos_resume.SAVE_INTERVAL)], nproc=2, env=environment())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    soak = chaos_resume.soak_run(kills=5, seed=144, iterations=4, workdir=str(tmp_path), reference=reference)
    print(chaos_resume.report(soak, 4, 0))
    assert len(soak.kills) == 5 and soak.resumes == 5
    assert soak.differences == [] and soak.orphans == [] and soak.hangs == []
    # The seed draws every moment, both signals, SIGKILL of torchrun (its training processes then save and exit)
    # and SIGTERM to torchrun during an async save (it forwards the signal; the ranks save and exit).
    assert {kill.moment for kill in soak.kills} == set(chaos_resume.MOMENTS)
    kinds = {(kill.target, kill.signum, kill.moment) for kill in soak.kills}
    assert ("torchrun", signal.SIGKILL, "sync save") in kinds and ("torchrun", signal.SIGTERM, "async save") in kinds
