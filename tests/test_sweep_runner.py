"""angpt.experiments.sweep_runner, the one runner of tools/sweep.py and benchmarks/convergence.py: its resume marker,
what an attempt starts over, a failure's log, and an interrupt that stops the runs in flight."""

import json
import os
import subprocess
import sys
import time

import pytest

from angpt.experiments.sweep_runner import Job, run_jobs


def python_job(tmp_path, name: str, code: str, flags=None, **kwargs) -> Job:
    directory = str(tmp_path / name)
    return Job(name=name, directory=directory, command=[sys.executable, "-c", code], cwd=directory,
               flags=flags if flags is not None else ["--lr", "0.01"], **kwargs)


def status(job: Job) -> dict:
    return json.loads(open(job.status_path).read())


def test_a_finished_job_is_skipped_only_with_the_same_flags(tmp_path, capsys):
    counter = tmp_path / "starts"
    code = f"open({str(counter)!r}, 'a').write('x')"
    counts = run_jobs([python_job(tmp_path, "a", code)])
    assert (counts["finished"], counts["skipped"]) == (1, 0)
    assert status(python_job(tmp_path, "a", code))["status"] == "finished"
    again = run_jobs([python_job(tmp_path, "a", code)])
    assert (again["finished"], again["skipped"]) == (0, 1)
    assert "a: already finished, skipped" in capsys.readouterr().out
    assert counter.read_text() == "x"
    # Other flags are another run; so is --force.
    run_jobs([python_job(tmp_path, "a", code, flags=["--lr", "0.02"])])
    run_jobs([python_job(tmp_path, "a", code, flags=["--lr", "0.02"])], force=True)
    assert counter.read_text() == "xxx"


def test_a_status_file_without_flags_is_read_from_its_command(tmp_path):
    """Status files of sweeps run before the flags were recorded: the flags end the recorded command."""
    job = python_job(tmp_path, "old", "raise SystemExit(1)")
    os.makedirs(job.directory)
    with open(job.status_path, "w") as file:
        json.dump({"status": "finished", "command": ["/other/python", "-m", "angpt.pretrain", *job.flags]}, file)
    assert job.is_finished()
    assert not python_job(tmp_path, "old", "", flags=["--lr", "0.5"]).is_finished()


def test_each_attempt_starts_over_what_the_job_names_and_keeps_the_rest(tmp_path):
    job = python_job(tmp_path, "b", "import os; print(sorted(os.listdir('.')))", start_over=("metrics.jsonl", "cache"))
    os.makedirs(os.path.join(job.directory, "cache"))
    for name in ("metrics.jsonl", "keep.txt"):
        open(os.path.join(job.directory, name), "w").close()
    run_jobs([job])
    assert sorted(os.listdir(job.directory)) == ["keep.txt", "log.txt", "status.json"]


def test_a_failure_prints_the_end_of_its_log_and_stops_the_queue_when_asked(tmp_path, capsys):
    failing = python_job(tmp_path, "c", "import sys; print('line one'); print('the reason'); sys.exit(3)")
    never = python_job(tmp_path, "d", "pass")
    counts = run_jobs([failing, never], stop_on_failure=True)
    assert (counts["failed"], counts["not_started"], counts["failed_runs"]) == (1, 1, ["c"])
    output = capsys.readouterr().out
    assert "c: FAILED (exit code 3)" in output and "the reason" in output and failing.log_path in output
    assert status(failing)["status"] == "failed" and status(failing)["returncode"] == 3
    assert not os.path.exists(never.directory)


def test_judge_decides_and_its_summary_is_kept_for_the_skip_message(tmp_path, capsys):
    def judge(job, returncode):
        done = os.path.exists(os.path.join(job.directory, "result.json"))
        return {"status": "finished" if returncode == 0 and done else "failed", "summary": "loss 1.5"}

    no_result = python_job(tmp_path, "e", "pass")
    assert run_jobs([no_result], judge=judge)["failed"] == 1
    with_result = python_job(tmp_path, "f", "open('result.json', 'w').write('{}')")
    assert run_jobs([with_result], judge=judge)["finished"] == 1
    run_jobs([with_result], judge=judge)
    assert "f: already finished (loss 1.5), skipped" in capsys.readouterr().out


@pytest.mark.parametrize("parallel", [1, 2])
def test_an_interrupt_sends_sigterm_to_the_runs_in_flight_and_records_them_failed(tmp_path, parallel):
    # Each run answers SIGTERM by writing a file, as the trainer answers it by saving.
    code = ("import signal, sys, time, pathlib\n"
            "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path('terminated').touch(), sys.exit(143)))\n"
            "pathlib.Path('ready').touch()\n"
            "time.sleep(60)\n")
    jobs = [python_job(tmp_path, f"g{i}", code) for i in range(2)]

    def interrupt_when_ready():
        if all(os.path.exists(os.path.join(j.directory, "ready")) for j in jobs[:parallel]):
            raise KeyboardInterrupt

    began = time.time()
    with pytest.raises(KeyboardInterrupt):
        run_jobs(jobs, parallel=parallel, progress_seconds=0.1, on_progress=interrupt_when_ready)
    assert time.time() - began < 30
    for job in jobs[:parallel]:
        assert os.path.exists(os.path.join(job.directory, "terminated"))
        assert status(job)["status"] == "failed" and status(job)["returncode"] == 143
    if parallel == 1:
        assert not os.path.exists(jobs[1].directory)  # never started


def test_threads_and_environment_reach_the_run_and_rank_variables_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    job = python_job(tmp_path, "h", "import os, json; json.dump({k: os.environ.get(k) for k in "
                     "('OMP_NUM_THREADS', 'RANK', 'EXTRA')}, open('env.json', 'w'))", env={"EXTRA": "yes"})
    run_jobs([job], threads=1)
    seen = json.loads(open(os.path.join(job.directory, "env.json")).read())
    assert seen == {"OMP_NUM_THREADS": "1", "RANK": None, "EXTRA": "yes"}


def test_the_coordinator_does_not_import_torch():
    code = "import sys, angpt.experiments.sweep_runner; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"

