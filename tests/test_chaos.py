"""The chaos soak, short: benchmarks/chaos_resume.py kills a 2-process torchrun job 5 times at random moments
(SIGKILL or SIGTERM, to one rank, all ranks, torchrun or everything; during a step, a sync or async save, or
the start and load), resumes it after each, and finds the uninterrupted run's checkpoint and losses, and no
process left behind. The long soak's report is in docs/results.md."""

import os
import signal
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import chaos_resume  # noqa: E402

pytestmark = pytest.mark.multiprocess


# Over the suite's budget of 60 s: torchrun and its kills are the subject, so each of the 7 launches is a cold
# torchrun job of two ranks.
def test_five_kills_and_resumes_end_as_the_uninterrupted_run_with_nothing_left_behind(tmp_path, capsys):
    soak = chaos_resume.soak_run(kills=5, seed=6, iterations=6, workdir=str(tmp_path))
    print(chaos_resume.report(soak, 6, 0))
    assert len(soak.kills) == 5 and soak.resumes == 5
    assert soak.differences == [] and soak.orphans == [] and soak.hangs == []
    # The seed draws both signals, every moment, and SIGKILL of torchrun (its training processes then save and exit).
    assert {kill.signum for kill in soak.kills} == set(chaos_resume.SIGNALS)
    assert {kill.moment for kill in soak.kills} == set(chaos_resume.MOMENTS)
    assert any(kill.target == "torchrun" and kill.signum == signal.SIGKILL for kill in soak.kills)
