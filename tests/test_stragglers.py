"""--log-straggler's pieces in one process on the CPU (angpt/telemetry/stragglers.py): the rule at its boundaries, the
log line, the forward timer against a scripted clock, and the report gathered over ranks (the other ranks' rows as
all_gather delivers them). The rule's first cases and a trainer's report: tests/test_run_diagnostics.py."""

import math
import time

import pytest
import torch

from angpt.telemetry.stragglers import (
    CONTROLLER_PORT,
    FORWARD_TIMER,
    ForwardTimer,
    StragglerReport,
    format_stragglers,
    stragglers,
)

on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's timer (CUDA's is megatron-core's)")


def test_a_rank_exactly_at_the_margin_is_no_straggler_and_one_past_it_is():
    """The documented rule: over its stage's median by more than 10%. 11.0 is 10% over 10 exactly."""
    assert stragglers([10.0, 10.0, 11.0, 10.0], [0] * 4, count=1)["stragglers"] == []
    past = math.nextafter(11.0, math.inf)
    assert stragglers([10.0, 10.0, past, 10.0], [0] * 4, count=1)["stragglers"] == [[2, past, 10.0]]


def test_a_stage_whose_median_is_not_above_zero_has_no_stragglers():
    """A median of 0 ms (no forward time measured) makes no rank "over" it; one of 0.5 ms still does."""
    assert stragglers([0.0, 0.0, 0.0, 5.0], [0] * 4, count=1)["stragglers"] == []
    assert stragglers([0.5, 0.5, 0.5, 2.0], [0] * 4, count=1)["stragglers"] == [[3, 2.0, 0.5]]


def test_the_furthest_over_its_own_stages_median_comes_first():
    """Rank 2 is 3x its stage's 10 ms, rank 5 1.5x its stage's 100 ms (more milliseconds over, less far)."""
    report = stragglers([10.0, 10.0, 30.0, 100.0, 100.0, 150.0], [0, 0, 0, 1, 1, 1], count=2)
    assert report["stragglers"] == [[2, 30.0, 10.0], [5, 150.0, 100.0]]


def test_the_log_lines_parts_list_ranks_and_stragglers_comma_separated():
    record = {"forward_ms_fastest": [[0, 10.0], [1, 10.25]], "forward_ms_slowest": [[3, 40.0], [2, 30.0]],
              "stragglers": [[3, 40.0, 10.0], [2, 30.0, 10.0]], "stragglers_count": 2}
    assert format_stragglers(record) == [
        "forward ms fastest: 10.0 (rank 0), 10.2 (rank 1), slowest: 40.0 (rank 3), 30.0 (rank 2)",
        "stragglers (2): rank 3 40.0 ms (+300% over its stage's median 10.0), rank 2 30.0 ms (+200% over its "
        "stage's median 10.0)"]


@pytest.fixture
def clock(monkeypatch):
    """time.perf_counter as a script: each call returns the next value."""
    values = []
    monkeypatch.setattr(time, "perf_counter", lambda: values.pop(0))
    yield values
    FORWARD_TIMER.close()


@on_cpu
def test_the_forward_timer_adds_up_its_passes_only_while_on_and_starts_again_from_zero(clock):
    timer = ForwardTimer()
    assert not timer.active()
    with timer:  # off: not timed (the clock is not read)
        pass
    timer.configure(1, 0, 1, CONTROLLER_PORT, True)
    assert timer.active()
    clock += [1.0, 1.25, 2.0, 2.5]
    for _ in range(2):
        with timer:
            pass
    assert timer.take_ms() == 750.0
    assert timer.take_ms() == 0.0  # taken: the next interval starts from zero
    clock += [3.0, 3.5]
    with timer:
        pass
    timer.close()
    assert not timer.active() and timer.take_ms() == 0.0


@on_cpu
def test_on_the_cpu_the_report_refuses_the_controllers_flags_naming_what_it_does_instead(single_process):
    for port, enabled, flag in ((6000, True, "--straggler-ctrlr-port 6000"),
                                (CONTROLLER_PORT, False, "--disable-straggler-on-startup")):
        with pytest.raises(ValueError) as refusal:
            StragglerReport(1, 0, 0, 1, port, enabled)
        assert str(refusal.value) == (f"{flag} steers megatron-core's StragglerDetector controller, which runs on "
                                      "CUDA only; on CPU --log-straggler times the forward passes from the start to "
                                      "the end")


@on_cpu
def test_the_report_gathers_each_ranks_milliseconds_per_iteration_and_stage(clock, single_process, monkeypatch):
    """This rank (0, of stage 0) timed 300.3 ms over 3 iterations; ranks 1 and 2 (stages 0 and 1) send theirs."""
    others = [[200.0, 0.0], [500.0, 1.0]]

    def all_gather(every, mine):
        every[0].copy_(mine)
        for row, values in zip(every[1:], others):
            row.copy_(torch.tensor(values, dtype=mine.dtype))

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    report = StragglerReport(3, 0, 0, 1, CONTROLLER_PORT, True)
    assert FORWARD_TIMER.active()
    clock += [1.0, 1.3003]
    with FORWARD_TIMER:
        pass
    mine = 1000 * (1.3003 - 1.0) / 3
    assert report.gather(3) == {"forward_ms_fastest": [[0, mine]], "forward_ms_slowest": [[2, 500.0]],
                                "stragglers": [[1, 200.0, (mine + 200.0) / 2]], "stragglers_count": 1}
    assert report.gather(3)["forward_ms_fastest"] == [[0, 0.0]]  # nothing timed since
    report.close()
    assert report.gather(3) is None  # timing off
