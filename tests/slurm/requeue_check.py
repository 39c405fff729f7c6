#!/usr/bin/env python
"""examples/pretrain.slurm under a real Slurm: a one-node cluster started here (slurmctld and slurmd on this
host, munge for authentication), the example submitted with a tiny configuration and a time limit of 3
minutes whose warning (SIGUSR1, 90 s before it) comes while it trains. The check: the job saved at the
signal, requeued itself, resumed from that checkpoint and finished with the checkpoint and the losses of an
uninterrupted run of the same flags. The daemons it started are stopped whatever happens.

    make test-slurm      (as root: installs Debian's slurm-wlm and munge first; CI runs it after make test)

Not part of `make test`: a real time limit takes minutes to arrive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_gpt_datasets import write_dataset  # noqa: E402 (random ids below 499, 499 ending each document)

ITERATIONS = 1200
# The model and run shrunk from examples/configs/angpt_0.5b.yaml, as flags after the script override it.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
        "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--no-bf16", "--save-interval", "100000",
        "--eval-iters", "0", "--log-interval", "1", "--lr", "1e-3", "--split", "100,0,0"]
STEP_SECONDS = "0.07"  # 1200 steps of at least 84 s: the warning of a 3-minute limit comes in the middle
JOB_TIMEOUT = 900


def log(message: str) -> None:
    print(f"[slurm check] {message}", flush=True)


class Cluster:
    """slurmctld and slurmd of one node (this host), configured in `directory`, and munged if it was not
    running."""

    def __init__(self, directory: str):
        self.directory = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.started_munge = False
        host, cpus = socket.gethostname(), os.cpu_count()
        for sub in ("ctld", "d", "log"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        with open(self.conf, "w") as file:
            file.write("\n".join([
                "ClusterName=angpt-check", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
                "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
                "MpiDefault=none", "ReturnToService=2", "JobRequeue=1", "MinJobAge=900",
                f"StateSaveLocation={directory}/ctld", f"SlurmdSpoolDir={directory}/d",
                f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd.pid",
                f"SlurmctldLogFile={directory}/log/slurmctld.log", f"SlurmdLogFile={directory}/log/slurmd.log",
                "SlurmctldPort=16817", "SlurmdPort=16818",
                f"NodeName={host} CPUs={cpus} State=UNKNOWN",
                "PartitionName=check Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self.env = {**os.environ, "SLURM_CONF": self.conf}

    def start(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            subprocess.run(["/etc/init.d/munge", "start"], check=True, capture_output=True)
            self.started_munge = True
        subprocess.run(["/usr/sbin/slurmctld", "-f", self.conf, "-i"], check=True, env=self.env)
        subprocess.run(["/usr/sbin/slurmd", "-f", self.conf], check=True, env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
            if state.stdout.strip() == "idle":
                log("one-node Slurm cluster up")
                return
            time.sleep(1)
        raise RuntimeError(f"the node never became idle; see {self.directory}/log")

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            path = os.path.join(self.directory, f"{daemon}.pid")
            if os.path.isfile(path):
                try:
                    os.kill(int(open(path).read()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        if self.started_munge:
            subprocess.run(["/etc/init.d/munge", "stop"], capture_output=True)

    def job(self, job_id: str) -> dict:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                               env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))


def losses(run: str) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as file:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, file) if r["kind"] == "train"}


def differing_tensors(run: str, reference: str) -> list[str]:
    from megatron.core.dist_checkpointing import load_plain_tensors  # noqa: PLC0415 (after the runs)

    from angpt.training import distributed  # noqa: PLC0415

    distributed.initialize()
    ours, theirs = (load_plain_tensors(os.path.join(directory, f"iter_{ITERATIONS:07d}"))
                    for directory in (run, reference))
    names = {key for key, value in [*ours.items(), *theirs.items()] if isinstance(value, torch.Tensor)}
    return sorted(key for key in names if key not in ours or key not in theirs or not torch.equal(ours[key],
                                                                                                    theirs[key]))


def main() -> int:
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        print("needs root and Debian's slurm-wlm and munge (make test-slurm installs them)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="angpt-slurm-")
    cluster = Cluster(os.path.join(work, "slurm"))
    venv_bin = os.path.dirname(sys.executable)
    env = {**cluster.env, "PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHONPATH": ROOT,
           "PYTHONWARNINGS": "ignore", "SIZE": "0.5b", "DATA_PATH": os.path.join(work, "data_text_document"),
           "DATA_CACHE_PATH": os.path.join(work, "cache"), "GPUS_PER_NODE": "2"}
    try:
        write_dataset(env["DATA_PATH"], documents=400, seed=0)
        reference = os.path.join(work, "uninterrupted")
        log("the uninterrupted run (torchrun, the example's flags)")
        subprocess.run(["bash", "examples/pretrain_multi_node.sh", "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                        *TINY], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**env, "NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
                            "CHECKPOINT_DIR": reference})
        cluster.start()
        run, output = os.path.join(work, "requeued"), os.path.join(work, "job.out")
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=3",
             "--signal=USR1@90", f"--output={output}", "examples/pretrain.slurm", *TINY],
            cwd=ROOT, check=True, capture_output=True, text=True,
            env={**env, "CHECKPOINT_DIR": run, "MASTER_PORT": "29518", "ANGPT_TEST_STEP_SECONDS": STEP_SECONDS})
        job_id = submitted.stdout.strip().split(";")[0]
        log(f"submitted examples/pretrain.slurm as job {job_id} (--time=3 --signal=USR1@90)")
        deadline, state = time.monotonic() + JOB_TIMEOUT, {}
        while time.monotonic() < deadline:
            state = cluster.job(job_id)
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(2)
        text = open(output).read() if os.path.isfile(output) else ""
        log(f"job {job_id}: {state.get('JobState')}, {state.get('Restarts')} restarts")
        problems = []
        if state.get("JobState") != "COMPLETED":
            problems.append(f"the job ended {state.get('JobState')}, not COMPLETED")
        if not re.search(r"exiting at iteration \d+: received SIGUSR1", text):
            problems.append("no save and exit at SIGUSR1")
        if "iterations left: requeueing" not in text or int(state.get("Restarts", 0)) < 1:
            problems.append("no requeue")
        if not re.search(r"loaded checkpoint \S+/iter_\d+", text):
            problems.append("no resume from the checkpoint saved at the signal")
        if not problems:
            differing = differing_tensors(run, reference)
            if differing:
                problems.append(f"the final checkpoints differ in {differing[:5]}")
            if losses(run) != losses(reference):
                problems.append("the losses differ from the uninterrupted run's")
        for line in text.splitlines():
            if re.search(r"^job |exiting at|requeueing|loaded checkpoint", line):
                log(f"  {line.strip()[:160]}")
        if problems:
            log("FAILED: " + "; ".join(problems))
            print(text[-6000:])
            return 1
        log("passed: saved at SIGUSR1, requeued, resumed, and ended as the uninterrupted run did")
        return 0
    finally:
        subprocess.run(["scancel", "--full", "--quiet", "--user=root"], env=cluster.env, capture_output=True)
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
