"""The megatron-core CPU adapter is applied only when CUDA is unavailable."""

import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = """
import torch
{pretend}
original = torch.cuda.current_device
from angpt.megatron_compat import cpu
active = cpu.enable()
print(active, torch.cuda.current_device is original)
if active:
    print(torch.cuda.current_device(), torch.empty(2, device="cuda").device, torch.zeros(1).type())
"""


def run(pretend_cuda: bool) -> list[str]:
    code = PROBE.format(pretend="torch.cuda.is_available = lambda: True" if pretend_cuda else "")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_untouched_when_cuda_is_available():
    assert run(pretend_cuda=True) == ["False", "True"]


@pytest.mark.slow
def test_cuda_requests_land_on_the_cpu_without_cuda():
    assert run(pretend_cuda=False) == ["True", "False", "cpu", "cpu", "torch.cuda.FloatTensor"]
