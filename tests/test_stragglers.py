"""--log-straggler's pieces in one process on the CPU (angpt/telemetry/stragglers.py): the rule at its boundaries, the
log line, the forward timer against a scripted clock, and the report gathered over ranks (the other ranks' rows as
all_gather delivers them). The rule's first cases and a trainer's report: tests/test_run_diagnostics.py."""

import inspect
import math
import time

import pytest
import torch
from megatron.core.utils import StragglerDetector

from angpt.telemetry import stragglers as module
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


class RecordingDetector:
    """megatron-core's StragglerDetector as the timer drives it on CUDA, in a stand-in: configure's arguments bound
    to the real method's signature (so each is read by the name megatron-core gives it), start/stop/report
    recorded, the enabled state the test sets (the controller's toggle), and elapsed()'s six figures (megatron-core's
    docstring: the time in the timed kernels, the time in get_batch, then the GPU's temperature, power, utilization
    and clock)."""

    def __init__(self):
        self.calls, self.enabled, self.configured = [], True, None

    def configure(self, *args, **kwargs):
        arguments = inspect.signature(StragglerDetector.configure).bind(self, *args, **kwargs).arguments
        self.configured = {name: value for name, value in arguments.items() if name != "self"}

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")

    def elapsed(self):
        return 12.5, 3.0, 60, 200, 90, 1980

    def report(self):
        self.calls.append("report")


@pytest.fixture
def on_cuda(monkeypatch):
    """This process as one on GPU 1 whose NVML answers, with megatron-core's detector replaced by the stand-in."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "temperature", lambda *args: 40)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(module, "StragglerDetector", RecordingDetector)
    yield
    FORWARD_TIMER.close()


def test_on_cuda_the_timer_hands_megatron_cores_detector_the_flags_and_reads_its_kernel_time(on_cuda):
    timer = ForwardTimer()
    timer.configure(4, 3, 2, 29500, True)  # none of them megatron-core's default
    detector = timer.detector
    assert isinstance(detector, RecordingDetector)
    assert detector.configured == {"world": 4, "rank": 3, "mmcnt": 2, "port": 29500, "enabled": True}
    with timer:
        pass
    assert detector.calls == ["start", "stop"]
    assert timer.take_ms() == 12.5  # elapsed()'s first figure, the forward kernels' time
    # Whether it times is the detector's own state, which the controller's port toggles.
    detector.enabled = False
    assert not timer.active()
    detector.enabled = True
    assert timer.active()


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'pynvml'"), RuntimeError("NVML_ERROR")])
def test_on_cuda_without_nvml_the_timer_is_refused_saying_what_to_install(on_cuda, monkeypatch, error):
    def temperature(*args):
        raise error

    monkeypatch.setattr(torch.cuda, "temperature", temperature)
    with pytest.raises(ValueError) as refusal:
        ForwardTimer().configure(4, 3, 2, 29500, True)
    assert str(refusal.value) == ("--log-straggler on CUDA: megatron-core's StragglerDetector reads the GPU's "
                                  f"temperature through NVML, which failed ({error}); pip install nvidia-ml-py")


def test_on_cuda_the_report_configures_the_timer_and_gathers_on_the_ranks_gpu(on_cuda, monkeypatch):
    """The report's rows go through all_gather on the rank's own GPU (NCCL gathers no CPU tensors); off, it
    gathers nothing, and megatron-core's report() still runs at each interval (it applies the controller's
    toggle)."""
    report = StragglerReport(4, 3, 1, 2, 29500, False)
    assert report.device == torch.device("cuda", 1)
    detector = FORWARD_TIMER.detector
    assert detector.configured == {"world": 4, "rank": 3, "mmcnt": 2, "port": 29500, "enabled": False}
    detector.enabled = False
    assert report.gather(3) is None and detector.calls == ["report"]
    devices = []

    def all_gather(every, mine):
        devices.append([mine.device, *(row.device for row in every)])
        every[:] = [torch.tensor([ms, 1.0], dtype=torch.float64) for ms in (10.0, 10.0)]

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    report.device = torch.device("meta")  # a device this CPU machine has, standing in for the GPU
    detector.enabled = True
    assert report.gather(3)["stragglers"] == [] and devices == [[torch.device("meta")] * 3]
    assert detector.calls == ["report", "report"]
