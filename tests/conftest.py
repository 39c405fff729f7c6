import base64
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pydoc_data.topics import topics

import pytest
import sentencepiece
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tokenizers import MegatronTokenizer

from angpt.config.arguments import parse_args
from angpt.training import checkpointing, distributed
from angpt.training.trainer import Trainer

from launch import launch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PYDOC_VOCAB_SIZE = 512  # the BPE of the pydoc_corpus fixture

# Under pytest-xdist, each worker's tests (and the processes they start, which inherit the variable) get
# their share of the cores: one thread each with a worker per core, rather than every process spinning
# as many threads as there are cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# torchrun's variables as the session found them (unset, but for the warm workers of tests/distributed), and the
# attention backend megatron-core exports when it builds a model (angpt.models.attention).
PROCESS_VARIABLES = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN",
                                                              "NVTE_UNFUSED_ATTN")}


@pytest.fixture(autouse=True)
def process_variables_as_the_session_found_them():
    """An in-process trainer or importer joins as the only process of a job by setting torchrun's variables
    (angpt.training.distributed), and its store keeps MASTER_PORT bound: a process a later test of the worker
    starts inherited them and failed to bind that port (EADDRINUSE). A model built with one attention backend leaves
    it in NVTE_*, and megatron-core refuses to build a later test's model of another backend in the worker. Each
    test ends with them as they were."""
    yield
    for name, value in PROCESS_VARIABLES.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "multiprocess: launches real processes with torchrun on gloo")
    config.addinivalue_line("markers", "xdist_group(name): run on the pytest-xdist worker of that group")
    config.addinivalue_line("markers",
                            "slow: takes more than a few seconds in one process (left out of `make test-fast`)")
    config.addinivalue_line("markers", "long: an end-to-end check of minutes, run by `make test-long` (CI runs it "
                                       "after `make test`), not by `make test`")


# `make test` runs the tests on parallel pytest-xdist workers (--dist loadgroup). A test that uses a fixture of
# its own file living longer than the test runs on the worker of its file, so that the fixture is built
# once; tests of trained_runs (too expensive to build twice) on one worker; any other test wherever a worker
# is free (conftest's other session fixtures are cheap enough to build on each worker).
SHARED_SESSION_FIXTURES = ("trained_runs",)
# The long torchrun jobs of these files (minutes of two and four ranks each) run one after the other on one worker:
# beside each other on two cores every collective waits for ranks descheduled by the other job's, and the
# configurations' job, 2.5 minutes alone, overran 15 beside Megatron-FSDP's in make test-long.
ONE_AT_A_TIME = {"test_megatron_configs_train.py", "test_megatron_fsdp.py"}
# Files whose tests take longest start first, so that none is left running alone at the end.
LONGEST_FIRST = ["test_trainer.py", "test_hf_export.py", "test_pretrain.py", "test_quickstart.py",
                 "test_convergence.py", "test_faults.py", "test_checkpoint_integrity.py",
                 "test_parallel_equivalence.py", "test_kernels.py"]


def worker_group(item: pytest.Item) -> str:
    shared = [name for name in SHARED_SESSION_FIXTURES if name in item.fixturenames]
    if shared:
        return shared[0]
    if item.path.name in ONE_AT_A_TIME and "long" in item.keywords:
        return "long torchrun jobs"
    # pytest keeps the resolved fixture definitions of an item only in this private attribute.
    own_lasting = [definition for definitions in item._fixtureinfo.name2fixturedefs.values()
                   for definition in definitions[-1:]
                   if definition.scope != "function" and definition.baseid.endswith(item.path.name)]
    return item.path.name if own_lasting else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session):
    # What the test modules' imports made, out of every later collection (tests/distributed/warm_start.py does
    # so for the ranks): a full collection, which each rebuild of megatron-core's groups runs
    # (angpt.training.distributed), took 0.4 s, and collections were 17% of `make test-fast`.
    gc.freeze()
    # pytest-xdist's --dist loadgroup appends each test's group to its node id; under a pytest that ignores
    # that (9.2, with pytest-xdist 3.8) tests are scheduled one by one and every worker builds the shared
    # fixtures again: said here rather than found in the suite's time.
    if getattr(session.config.option, "loadgroup", False) and session.items and "@" not in session.items[0].nodeid:
        raise pytest.UsageError(f"pytest {pytest.__version__} does not keep pytest-xdist's test groups: "
                                "install the pytest that setup.py's test extra names")


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_workers(script: str, *args: str, nproc: int = 2, timeout: int = 600) -> str:
    """Run a worker as torchrun's ranks (or alone when nproc is 0), warm (tests/launch.py), and return its
    output; fail with it."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    done = launch([os.path.join(ROOT, "tests", "distributed", script), *args], nproc=nproc, env=env,
                  timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="session")
def single_process():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = DP = 1)."""
    if not dist.is_initialized():
        port = distributed.free_port()
        # On a GPU machine, CUDA tensors go through NCCL (gloo lacks reduce-scatter for them).
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    distributed.destroy_model_parallel()  # what an in-process trainer of an earlier test left
    distributed.initialize()
    yield
    distributed.destroy_model_parallel()


def in_process_trainer(argv: list[str]) -> Trainer:
    """`angpt.pretrain`'s trainer built in this process at TP = PP = DP = 1, for tests that need a real run
    without a torchrun launch (20 s or more). It builds megatron-core's groups itself (the same as
    single_process's); pytest keeps its SIGTERM handler (the trainer's saves and carries on)."""
    config = parse_args(argv, world_size=1, recorded_flags=checkpointing.recorded_flags)
    sigterm = signal.getsignal(signal.SIGTERM)
    distributed.destroy_model_parallel()
    try:
        return Trainer(config)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        if not parallel_state.model_parallel_is_initialized():
            distributed.initialize()


@pytest.fixture
def seeded(single_process):
    distributed.set_random_seed(1234)


@pytest.fixture(scope="session")
def pydoc_corpus(tmp_path_factory):
    """Python's own help texts (pydoc_data.topics, one document per topic, every tenth topic for validation),
    prepared offline with the project's tools as examples/quickstart.sh prepares its corpus: train.jsonl and
    valid.jsonl, a byte-level BPE of PYDOC_VOCAB_SIZE tokens trained on train.jsonl (tokenizer/), and the
    indexed datasets train_text_document and valid_text_document. The directory is a `--corpus` of
    benchmarks/convergence.py."""
    root = tmp_path_factory.mktemp("pydoc_corpus")
    keys = sorted(topics)
    splits = {"train": [key for i, key in enumerate(keys) if i % 10], "valid": keys[::10]}
    for split, names in splits.items():
        with open(root / f"{split}.jsonl", "w") as handle:
            for key in names:
                handle.write(json.dumps({"text": topics[key]}) + "\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def start(*command: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def finish(process: subprocess.Popen) -> None:
        stdout, stderr = process.communicate()
        assert process.returncode == 0, f"{' '.join(process.args[1:])} failed:\n{stdout[-2000:]}{stderr[-4000:]}"

    finish(start("tools/train_tokenizer.py", "--input", str(root / "train.jsonl"),
                 "--vocab-size", str(PYDOC_VOCAB_SIZE), "--output-dir", str(root / "tokenizer")))
    # Both splits side by side: each process spends most of its time importing megatron-core.
    for process in [start("tools/preprocess_data.py", "--input", str(root / f"{split}.jsonl"),
                          "--output-prefix", str(root / split), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", str(root / "tokenizer"), "--append-eod")
                    for split in splits]:
        finish(process)
    return root


def write_megatron_tiktoken(path, tokens: list) -> str:
    """A vocabulary as Megatron-LM's TikTokenizer reads it (megatron-core's tiktoken library): a .json list of
    {rank, token_bytes (base64), token_str}, the 256 single bytes first (rank = byte), then `tokens` (bytes)."""
    ranked = [bytes([byte]) for byte in range(256)] + list(tokens)
    with open(path, "w") as file:
        json.dump([{"rank": rank, "token_bytes": base64.b64encode(token).decode(),
                    "token_str": token.decode("utf-8", errors="replace")} for rank, token in enumerate(ranked)], file)
    return str(path)


def megatron_tokenizer(library: str, path, **kwargs):
    """megatron-core's own tokenizer object, for the expected ids of a test: MegatronTokenizer.from_pretrained
    as Megatron-LM 0.16's build_tokenizer calls it (library "tiktoken": num_special_tokens, special_tokens=None,
    and pattern and vocab_size when given; "sentencepiece": legacy=False, special_tokens=None)."""
    return MegatronTokenizer.from_pretrained(tokenizer_path=str(path), metadata_path={"library": library}, **kwargs)


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory) -> str:
    """A SentencePiece BPE of 120 pieces (<unk>, <s>, </s> at 0, 1, 2, and a user-defined symbol <sep>)."""
    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {7 * i}, ünïcødé ✓"
                                 for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "sp"), vocab_size=120,
                                             model_type="bpe", user_defined_symbols=["<sep>"], minloglevel=2)
    return str(directory / "sp.model")


# A small model trained by `angpt.pretrain` under torchrun, once per family, at a layout that splits its
# tensors: test_pretrain checks that training lowers the loss, test_hf_export exports the checkpoints.
TRAINED_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--micro-batch-size", "4", "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0"]
TRAINED_ITERS = 30
TRAINED_RUNS = {
    "angpt": ["--model-family", "angpt", "--tensor-model-parallel-size", "2", "--lr", "3e-2"],  # on pydoc_corpus
    "ngpt": ["--model-family", "ngpt", "--pipeline-model-parallel-size", "2", "--lr", "1e-2", "--mock-data",
             "--vocab-size", "256"],
    # 200 ids padded to 256: the export trims the head to the vocabulary.
    "gptplus": ["--model-family", "gptplus", "--pipeline-model-parallel-size", "2", "--lr", "1e-2", "--mock-data",
                "--vocab-size", "200"],
}


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, pydoc_corpus):
    """{family: run directory}: the final checkpoint, metrics.jsonl and the job's output in output.txt."""
    runs = {}
    for family, flags in TRAINED_RUNS.items():
        run_dir = tmp_path_factory.mktemp(f"{family}_trained")
        data = [] if "--mock-data" in flags else [
            "--data-path", str(pydoc_corpus / "train_text_document"), "--split", "98,2,0",
            "--data-cache-path", str(run_dir)]
        output = run_workers(os.path.join(ROOT, "angpt", "pretrain.py"), *TRAINED_MODEL, *flags, *data,
                             "--train-iters", str(TRAINED_ITERS), "--save", str(run_dir))
        (run_dir / "output.txt").write_text(output)
        runs[family] = run_dir
    return runs
