"""--hang-timeout-minutes' watchdog (angpt.telemetry.hang_watchdog), on its own: the trainer's runs are in
tests/test_trainer.py."""

import io
import threading
import time

from angpt.telemetry.hang_watchdog import HangWatchdog


def stalled_here(seconds: float) -> None:
    time.sleep(seconds)


def test_iterations_that_end_within_the_timeout_write_nothing():
    out = io.StringIO()
    watchdog = HangWatchdog(0.5, "rank 0", out)
    for iteration in range(1, 9):  # 8 x 0.1 s: past the timeout in all, never within one iteration
        watchdog.arm(iteration)
        time.sleep(0.1)
    watchdog.close()
    assert out.getvalue() == ""


def test_a_stalled_iteration_writes_every_threads_stack_once_per_timeout_while_others_run_python():
    """faulthandler's timer read frames without the GIL and once crashed a rank whose other thread ran Python; here
    a thread creates and frees frames all along, and each dump still names where the stalled thread waits."""
    out, stop = io.StringIO(), threading.Event()

    def busy():
        while not stop.is_set():
            sorted(str(i) for i in range(100))

    worker = threading.Thread(target=busy, name="busy-python")
    worker.start()
    watchdog = HangWatchdog(0.2, "rank 3", out)
    armed = time.monotonic()
    try:
        watchdog.arm(7)
        stalled_here(1.1)
    finally:
        watchdog.close()
        closed = time.monotonic()
        stop.set()
        worker.join()
    dumps = out.getvalue().split("angpt hang watchdog: rank 3, iteration 7 has run ")[1:]
    # One dump per 0.2 s while armed: 5 in 1.1 s, more only if a loaded machine delayed close(); at least 3 even
    # if it delayed the watchdog.
    assert 3 <= len(dumps) <= int((closed - armed) / 0.2), out.getvalue()
    for dump in dumps:
        assert "(--hang-timeout-minutes 0.00333333)" in dump
        assert "Thread MainThread" in dump and "in stalled_here" in dump and "Thread busy-python" in dump
        assert "Thread hang-watchdog" not in dump
    assert [float(dump.split(" s ", 1)[0]) for dump in dumps] == sorted(float(d.split(" s ", 1)[0]) for d in dumps)


def test_nothing_is_written_once_closed_and_the_thread_ends():
    out = io.StringIO()
    watchdog = HangWatchdog(0.1, "rank 0", out)
    watchdog.arm(1)
    watchdog.close()
    time.sleep(0.3)
    assert out.getvalue() == "" and not watchdog._thread.is_alive()
