"""`make quickstart`'s script end to end on the real corpus, shortened: it must learn far more than
token frequencies, and its Hugging Face export must generate."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT


def unigram_entropy(bin_file: str) -> float:
    """Entropy (nats) of the tokens' own frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.fromfile(bin_file, dtype=np.uint16)).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# Three minutes and more on 2 cores: the quickstart's six steps as a user runs them (a cold torchrun, a BPE
# trained, 100 iterations at TP 2, the export checked against our logits, generation): 100 iterations is what it
# takes to fall well below the unigram entropy, the claim under test. So with the long checks (make test-long,
# which CI runs after make test).
@pytest.mark.multiprocess
@pytest.mark.long
def test_the_quickstart_validation_loss_falls_well_below_the_unigram_entropy(tmp_path):
    corpus, run = tmp_path / "corpus", tmp_path / "run"
    env = {**os.environ, "CORPUS_DIR": str(corpus), "RUN_DIR": str(run), "TRAIN_ITERS": "100",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    loss = float(re.search(r"validation loss at iteration 100: ([0-9.]+)", output).group(1))
    entropy = unigram_entropy(str(corpus / "valid_text_document.bin"))
    print(f"validation loss {loss:.3f}, unigram entropy of the validation tokens {entropy:.3f}")
    assert loss < entropy - 0.5
    assert (run / "iter_0000100").is_dir() and (run / "latest_checkpointed_iteration.txt").read_text().strip() == "100"
    # The export matched our logits (the converter exits 1 otherwise) and generated through transformers.
    assert (run / "hf" / "modeling_angpt.py").is_file()
    assert re.search(r"transformers generates: 'ROMEO:.{10,}", output, re.DOTALL)
    # Every step under its heading with its time, no blank lines from progress bars, and a summary that
    # points at what the run left.
    headings = [match.group(1) for match in re.finditer(r"^\[(\d)/6\] .*$", output, re.MULTILINE)]
    assert headings == [str(step) for step in range(1, 7)], headings
    assert len(re.findall(r"^ +done in \d+m \d\ds$", output, re.MULTILINE)) == 6
    assert "\n\n\n" not in output
    assert f"checkpoint:    {run}/iter_0000100" in output and f"metrics:       {run}/metrics.jsonl" in output
    assert f"tensorboard --logdir {run}/tensorboard" in output and any((run / "tensorboard").iterdir())
    assert f"curves:        {run}/metrics.png" in output
    assert (run / "metrics.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
