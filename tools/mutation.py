"""Mutation testing of the guards and the arithmetic (issue 52), with mutmut.

Each module of MODULES is mutated on its own, in a fresh copy of the tree under build/mutation/LABEL/NAME/
(the working tree is never written), and each mutant runs the module's own fast tests that reach the mutated
function (mutmut finds them by tracing a clean run). The survivors of each module are printed with their diffs,
then a score table; the counts and the survivors' diffs go to docs/results/mutation.json under a label
(`--label before`: with the tests as committed in HEAD; `after`, the default: those of the working tree), and
the table of docs/testing.md is written from that file.

    python tools/mutation.py                       # every module (make mutation)
    python tools/mutation.py batch_schedule        # some modules, by name (make mutation MODULES=...)
    python tools/mutation.py --list                # the modules and their tests
    python tools/mutation.py --render              # only the table of docs/testing.md, from the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"
RESULTS = ROOT / "docs" / "results" / "mutation.json"
DOC = ROOT / "docs" / "testing.md"
TABLE_BEGIN = "<!-- mutation table: written by tools/mutation.py from docs/results/mutation.json -->"
TABLE_END = "<!-- end of mutation table -->"
# What each copy holds: the package, the tests, the tools, benchmarks and result files some of them read, pytest's
# configuration.
ALSO_COPIED = ["tools", "benchmarks", "pytest.ini", "docs/results"]
COPIED = ["angpt", "tests", *ALSO_COPIED]
# In-process tests only: no torchrun jobs, no end-to-end scripts (a mutant must take seconds).
FAST = "not multiprocess and not slow and not long and not gpu"


@dataclass
class Module:
    name: str
    source: str
    tests: list[str]
    # Whole-package directories mutmut copies and puts first on sys.path.
    source_paths: list[str] = field(default_factory=lambda: ["angpt"])
    # Only the mutants of these functions are run and counted (all of the module's when empty): a part of a
    # large module, such as the preprocessing tool's document assembly.
    functions: list[str] = field(default_factory=list)
    # A script its tests load from its file under its bare name (tools/preprocess_data.py as `preprocess_data`).
    # mutmut names a module by its path (tools.preprocess_data) and finds no test of it, but strips a leading
    # src/: the copy holds the script as src/NAME.py, and the path the tests load links to its mutated copy.
    script: bool = False

    @property
    def mutated(self) -> str:
        """The mutated file's path in the copy."""
        return f"src/{Path(self.source).name}" if self.script else self.source


MODULES = [
    Module("gpt_datasets", "angpt/data/gpt_datasets.py",
           ["tests/test_gpt_datasets.py", "tests/test_bad_inputs.py"]),
    Module("indexed", "angpt/data/indexed.py",
           ["tests/test_gpt_datasets.py", "tests/test_bad_inputs.py",
            "tests/test_tokenizer_backends.py::test_the_writer_writes_what_megatron_cores_builder_writes"]),
    Module("tokenizers", "angpt/data/tokenizers.py",
           ["tests/test_tokenizers.py", "tests/test_tokenizer_backends.py", "tests/test_bad_inputs.py",
            "tests/test_preprocess_data.py"]),
    Module("batch_schedule", "angpt/config/batch_schedule.py", ["tests/test_batch_schedule.py"]),
    Module("memory_estimate", "angpt/training/memory_estimate.py", ["tests/test_memory_estimate.py"]),
    Module("activation_memory", "angpt/models/activation_memory.py", ["tests/test_memory_estimate.py"]),
    Module("layout_search", "angpt/training/layout_search.py", ["tests/test_memory_estimate.py"]),
    Module("factors", "angpt/models/factors.py", ["tests/test_factors.py"]),
    Module("scales", "angpt/models/scales.py", ["tests/test_optimizer.py", "tests/test_scales.py"]),
    Module("bounding", "angpt/models/bounding.py", ["tests/test_bounding.py"]),
    Module("kernels_reference", "angpt/kernels/reference.py", ["tests/test_kernels.py"]),
    Module("stragglers", "angpt/telemetry/stragglers.py",
           ["tests/test_run_diagnostics.py", "tests/test_stragglers.py"]),
    Module("digests", "angpt/training/digests.py", ["tests/test_checkpoint_integrity.py"]),
    Module("save_lock", "angpt/training/save_lock.py", ["tests/test_checkpoint_integrity.py"]),
    Module("rerun", "angpt/training/rerun.py", ["tests/test_rerun.py"]),
    Module("preprocess_data", "tools/preprocess_data.py", ["tests/test_preprocess_data.py"],
           source_paths=["angpt", "src"], functions=["encode_batch", "assemble_documents"], script=True),
]

# Survivors that cannot change behaviour, by module: (function, OLD, NEW, why): a survivor of that function
# whose one changed line is the original with one OLD replaced by NEW is counted as equivalent; any other
# survivor is a gap in the tests.
RANK_LOGS = "the rank only decides whether megatron-core's calculator logs its batch size (on rank 0)"
FAST_PATH = ("the fast path's lower bound: a batch holding id 0 then takes the slow path, which finds no id "
             "outside the vocabulary either (slower, same outcome)")
DEDUP = ("only the key that checks each tokenizer once: descriptions that differ only in key order are then "
         "checked twice, with the same outcome")
WHOLE_MAP = "without a shape the map runs to the file's end, and only the entries below `sequences` are read"
CHUNK = "the size of the chunks the arrays are read in: every entry is still read, once"
CACHE_NAMING = ("the naming inside the scan's cache (a key, the file name's hash length): written and read by "
                "the same code; a cache named otherwise is a miss, scanned again with the same result")
C_ORDER = "numpy reads the order case-insensitively and takes None as C; the arrays are contiguous anyway"
# The descriptions of the tensors a layer keeps (Saved.what): documentation, which no code reads.
DESCRIPTIONS = re.findall(r'Saved\(\s*"([^"]*)"', (ROOT / "angpt" / "models" / "activation_memory.py").read_text())
POWERS = ("the candidates are powers of two: one that does not divide a count leaves every larger one not "
          "dividing it either, so stopping there drops nothing")
EQUIVALENT: dict[str, list[tuple[str, str, str, str]]] = {
    "factors": [
        ("derive_factors", "hidden_size // num_attention_heads", "hidden_size / num_attention_heads",
         "a hidden size not divisible by the heads without --kv-channels is refused before (Megatron-LM's check, "
         "in the flags' validation and tools/angpt_factors.py): the quotient is whole"),
    ],
    "bounding": [
        ("_kernel_piece", "region: int = 0", "region: int = 1",
         "only project_whole_ takes pieces made without a region, and it ignores their region"),
        ("split_over_tp", '"tensor_model_parallel", False)', '"tensor_model_parallel", None)',
         "None and False are both false, and the callers only test the truth"),
        ("attach_weight_constraint", 'getattr(inner.config, "timers", None)', 'getattr(inner.config, "timers", )',
         "megatron-core's OptimizerConfig declares `timers` (None by default): the attribute always exists"),
    ],
    "rerun": [
        ("_Machine._log_validation_error_to_file", "if isinstance(result, torch.Tensor) else",
         "if (isinstance(result, torch.Tensor)) and False else", "float() of a one-element tensor is its item()"),
    ],
    "scales": [
        *[("LearnableScale._apply", old, new, "a scale has no submodules: whether the cast recurses into them "
           "changes nothing") for old, new in (("recurse=True)", "recurse=False)"), ("(fn, recurse)", "(fn, None)"),
                                                ("(fn, recurse)", "(fn, )"))],
        ("LearnableScale.sharded_state_dict", 'self.state_dict(prefix="", keep_vars=True)',
         "self.state_dict(keep_vars=True)", "state_dict's prefix is \"\" by default"),
        ("LearnableScale.forward", "if factor == 1.0 else", "if (factor == 1.0) and False else",
         "multiplying by 1.0 is exact: the same values"),
        *[("LearnableScale.__init__", "dtype=torch.float32, ", new, "torch's default dtype is float32, which "
           "nothing in angpt changes") for new in ("dtype=None, ", "")],
    ],
    "preprocess_data": [
        *[("assemble_documents", "copy=False)", new, "whether astype copies ids already of the dtype: the same "
           "values, which the caller only reads") for new in ("copy=None)", ")", "copy=True)")],
        ("encode_batch", "if texts[key] else", "if (texts[key]) or True else", "a shortcut: every tokenizer backend "
         "(tokenizers, tiktoken, gigatoken) encodes no texts into no ids, the same empty arrays"),
    ],
    "save_lock": [
        ("_read", '"rb")', ")", "json.dump writes the lock in ASCII (it escapes the rest), which text mode reads as "
         "the bytes"),
        *[("take", "refusal, src=0)", new, "torch's broadcast_object_list takes no source (None) as rank 0")
          for new in ("refusal, src=None)", "refusal, )")],
    ],
    "stragglers": [
        ("ForwardTimer.__init__", "self.enabled = False", "self.enabled = None",
         "None and False are both false, and the callers test only the truth"),
        *[("ForwardTimer.__init__", "self._started = 0.0", new, "__enter__ sets it before __exit__ reads it")
          for new in ("self._started = None", "self._started = 1.0")],
    ],
    "digests": [
        ("_my_share", "[0] * dist.get_world_size()", "[1] * dist.get_world_size()",
         "every rank's load then starts 1 higher: the comparisons between them are the same"),
        *[("file_digest", "buffering=0)", new, "the buffering of the reads: readinto fills the buffer with the same "
           "bytes either way (a binary file takes no line buffering)") for new in (")", "buffering=1)")],
        *[(function, f"{what}, src=0)", f"{what}, {new})", "torch's broadcast_object_list takes no source (None) as "
           "rank 0") for function, what in (("record", "listing"), ("check", "read")) for new in ("src=None", "")],
        *[(function, "if dist.get_rank() == 0 else None", "if (dist.get_rank() == 0) or True else None",
           f"every rank then {what}, and the broadcast replaces what each found with rank 0's")
          for function, what in (("record", "lists the directory"), ("check", "reads the digests"))],
    ],
    "kernels_reference": [
        ("blocks", "end - position < cols", "end - position <= cols",
         "with exactly one whole row left, both branches yield it as one block of 1 x cols"),
        ("scaled_swiglu", "if output_factor == 1.0 else", "if (output_factor == 1.0) and False else",
         "multiplying by 1.0 is exact: the same values"),
        ("project_whole_", "regions, total = [], 0", "regions, total = [], 1",
         "the regions then start at 1 in a buffer one longer: entry 0 is unused, every vector keeps its own"),
    ],
    "layout_search": [
        ("candidate_layouts", "tp > GPUS_PER_NODE or heads % tp", "tp > GPUS_PER_NODE and heads % tp",
         "no TP here exceeds a node, which leaves `groups % tp`: the groups divide the heads, so a TP that does not "
         "divide the heads does not divide the groups"),
        ("candidate_layouts", "world_size // tp", "world_size / tp", "a float of the same whole quotient: the same "
         "remainder"),
        ("candidate_layouts", "world_size // (tp * cp)", "world_size / (tp * cp)", "a float of the same whole "
         "quotient: the same remainder"),
        *[("candidate_layouts", f"{indent}continue", f"{indent}break", POWERS) for indent in (" " * 12, " " * 16)],
        ("candidate_layouts", "(seq_length // cp) % tp", "(seq_length / cp) % tp", "the sequence is a multiple "
         "of 2 x CP when CP > 1 (the clause before), so the quotient is whole either way"),
        ("step_seconds", "global_batch // (micro_batch * dp)", "global_batch / (micro_batch * dp)",
         "the global batch is a multiple of micro-batch x DP (the flags' validation and candidate_layouts require "
         "it): the quotient is whole either way"),
        ("candidate_layouts", "config.num_layers + 1)", "config.num_layers + 2)",
         "no number of stages above the layers divides them"),
    ],
    "activation_memory": [
        *[("layer_saved", f'"{what}"', new, "the tensor's description (Saved.what), which no code reads")
          for what in DESCRIPTIONS for new in ("None", f'"XX{what}XX"', f'"{what.upper()}"', f'"{what.lower()}"')],
        *[("layer_saved", '"hidden"', new, 'layer_bytes only asks whether a region is "tensor": any other is '
           "the residual stream's") for new in ("None", '"XXhiddenXX"', '"HIDDEN"')],
        ("layer_saved", "context_parallel: int = 1", "context_parallel: int = 2",
         "the default is never used: layer_bytes, the only caller, passes its own"),
        ("layer_saved", "h // config.num_attention_heads", "h / config.num_attention_heads",
         "megatron-core's TransformerConfig always sets kv_channels (hidden // heads by default): the fallback "
         "after `or` never runs"),
    ],
    "indexed": [
        ("_check_index_arrays", "shape=(sequences,))", "shape=None)", WHOLE_MAP),
        ("_check_index_arrays", ", shape=(sequences,))", ", )", WHOLE_MAP),
        ("_check_index_arrays", "shape=(sequences,))", ")", WHOLE_MAP),
        *[("_check_index_arrays", "shape=(documents,))", new, "the document indices are the file's last array: "
           "without a shape the map holds exactly them") for new in ("shape=None)", ")")],
        ("check_indexed_dataset", "(last_index,) = struct.unpack(\"<q\", idx.read(_DOCUMENT_INDEX))",
         "(last_index,) = struct.unpack(\"<q\", idx.read(None))",
         "the last document index is the file's last 8 bytes: reading to the end reads exactly them"),
        ("_check_index_arrays", "astype(numpy.int64)", "astype(None)",
         "float64 holds the byte offsets exactly below 2**53 (8 PiB): the comparison is the same"),
        *[("_check_index_arrays", f"{count} - 1, chunk)", new, why) for count in ("sequences", "documents")
          for new, why in ((f"{count} + 1, chunk)", "the starts past the last entry give empty slices"),
                           (f"{count} - 1, )", "a step of 1: the first slice already holds the first bad entry, "
                            "the others overlap it (slower, the same verdict)"))],
        ("_check_index_arrays", "if documents > 1:", "if documents >= 1:",
         "one entry (no document) has no pair to compare"),
        ("_check_index_arrays", "if documents > 1:", "if documents > 2:",
         "with two entries, check_indexed_dataset has already required them to be 0 and `sequences`"),
        ("check_indexed_dataset", 'struct.unpack("<q", idx.read(_POINTER))', 'struct.unpack("<Q", idx.read(_POINTER))',
         "the last pointer is checked against its neighbour (or, alone, to be 0) before the .bin's size reads it: "
         "a negative one never gets there"),
        ("_check_index_arrays", "1 << 22", "2 << 22", CHUNK),
        ("_check_index_arrays", "1 << 22", "1 << 23", CHUNK),
        *[("cached_max_token_id", old, new, CACHE_NAMING) for old, new in (
            ('".bin"', '"XX.binXX"'), ('".bin"', '".BIN"'), ('"size"', '"XXsizeXX"'), ('"size"', '"SIZE"'),
            ('"mtime_ns"', '"XXmtime_nsXX"'), ('"mtime_ns"', '"MTIME_NS"'), ("[:12]", "[:13]"))],
        ("DatasetWriter.add_documents", "dtype=numpy.int64)", "dtype=None)",
         "numpy's cumsum of integers is already in the platform's int64 (64-bit Linux, the only platform)"),
        ("DatasetWriter.add_documents", ", dtype=numpy.int64)", ", )",
         "numpy's cumsum of integers is already in the platform's int64 (64-bit Linux, the only platform)"),
        *[(function, 'order="C"', new, C_ORDER) for function in ("DatasetWriter.add_documents",
                                                                  "DatasetWriter.finalize")
          for new in ('order="c"', "order=None")],
        ("DatasetWriter.finalize", "astype(numpy.int64)", "astype(None)",
         "float64 holds byte offsets exactly below 2**53 (8 PiB), and cumsum writes them into the int64 pointers"),
    ],
    "gpt_datasets": [
        ("check_batch_token_ids", "last_labels.min()) >= 0", "last_labels.min()) > 0", FAST_PATH),
        ("check_batch_token_ids", "last_labels.min()) >= 0", "last_labels.min()) >= 1", FAST_PATH),
        ("dataset_vocabulary", "sort_keys=True", "sort_keys=None", DEDUP),
        ("dataset_vocabulary", "sort_keys=True", "sort_keys=False", DEDUP),
        ("dataset_vocabulary", ", sort_keys=True)", ", )", DEDUP),
        ("TrainingBatches.close", "self.batches = None", 'self.batches = ""', "either drops the loader's "
         "iterator, which ends its workers; nothing reads it after"),
        *[("TrainingBatches.__init__", old, new, "pinned memory only speeds up copies to a GPU; without CUDA it "
           "is off either way") for old, new in (("pin_memory=torch.cuda.is_available()", "pin_memory=None"),
                                                  (", pin_memory=torch.cuda.is_available())", ", )"))],
    ],
    "tokenizers": [
        *[("load_gpt2_vocab_merges", "special=True, ", new, "tokenizers' add_special_tokens marks every token it adds "
           "special, whatever the AddedToken says") for new in ("", "special=False, ")],
        *[("load_gpt2_vocab_merges", ", normalized=False)", new, "the byte-level BPE has no normalizer: the token is "
           "matched in the same text either way") for new in (", )", ", normalized=True)")],
        ("GigatokenTokenizer.__init__", 'version("gigatoken")', 'version("GIGATOKEN")',
         "importlib.metadata finds a distribution by its normalized name, whatever its case"),
        ("GigatokenTokenizer._rebuild", "self.encoder = None", 'self.encoder = ""',
         "either drops the old encoder (and its caches) before the new one is built; nothing reads it between"),
        *[("flat_ids", old, new, "`count` only lets numpy allocate the array once: without it fromiter grows it to "
           "the same values") for old, new in ((", count=len(encoded))", ", )"),
                                               (", count=int(lengths.sum()))", ", )"))],
        ("TikTokenizer.__init__", "name=os.path.basename(path), ", "name=None, ", "the Encoding's name is a label "
         "(its repr, and carried through pickling): no encoding reads it"),
        ("MegatronCoreTokenizer.__init__", "num_special_tokens=tiktoken_num_special_tokens, special_tokens=None)",
         "num_special_tokens=tiktoken_num_special_tokens, )", "megatron-core's tiktoken library takes special_tokens "
         "None as its default template (its SPECIAL_TOKENS), which it is when not passed"),
        ("select_backend", "reason = None", 'reason = ""', "both are false, and the only reader tests the truth "
         "(`if reason:`)"),
        ("_tiktoken_vocabulary_error", "entries = None", 'entries = ""',
         "neither is a list, the only case the message reads entries"),
        ("_tiktoken_vocabulary_error", 'encoding="utf-8"', 'encoding="UTF-8"', "codec names are case-insensitive"),
        *[("MegatronCoreTokenizer.encode_batch", "out_type=int, ", new, "megatron-core builds the "
           "SentencePieceProcessor with sentencepiece's default return type, ids (int), which out_type None reads")
          for new in ("out_type=None, ", "")],
    ],
    "batch_schedule": [
        *[(function, old, new, RANK_LOGS) for function in ("ramp", "rampup_train_iters")
          for old, new in (("rank=1", "rank=None"), ("rank=1", "rank=2"), ("rank=1", ""))],
        ("BatchSchedule.__init__", "rank: int = 0", "rank: int = 1", RANK_LOGS),
        ("BatchSchedule.__init__", "False, rank", "False, None", RANK_LOGS),
        ("BatchSchedule.__init__", "False, rank", "None, rank",
         "megatron-core tests decrease_batch_size_if_needed for truth: None is False"),
        ("ramp", "if size == training.global_batch_size", "if (size == training.global_batch_size) and False",
         "the steps at --global-batch-size are then added one at a time to the same (size, count) entry"),
        ("ramp", "size * count", "size / count",
         "count is above 1 only for the last entry, after which `consumed` is not read again"),
        ("rampup_train_iters", "train_samples > consumed", "train_samples >= consumed",
         "when they are equal, the added (train_samples - consumed) // global_batch_size is 0"),
    ],
}


# Survivors that do change behaviour but are left, by module, as EQUIVALENT: (function, OLD, NEW, why no test
# kills them). They count as surviving.
READ_ONLY = ("numpy.memmap's default mode is r+, which fails on a dataset the user may not write: a test run as "
             "root (CI) cannot see it")
ON_GPU = ("differs only for weights on a GPU (the sums would then be on the CPU): the tests on CUDA are marked gpu, "
          "outside the fast selection, and on the CPU the default device is the CPU")
DP_OVER_ONE = ("differs only with a data-parallel group of more than one rank, which an in-process test lacks: the "
               "multi-process test_parallel_equivalence.py (dp2, dp2_fsdp2) compares it with one process")
LEFT: dict[str, list[tuple[str, str, str | None, str]]] = {
    "tokenizers": [
        *[("_tiktoken_vocabulary_error", ', encoding="utf-8")', new, "differs only where Python's locale encoding is "
           "not UTF-8 (it is on the supported Linux, PEP 538/540) and only for a vocabulary that is not ASCII JSON; "
           "it then only words the refusal") for new in (", encoding=None)", ", )")],
    ],
    "rerun": [
        *[("_Machine._maybe_report_stats", old, new, "differs only with more than one rank, whose statistics rank 0 "
           "gathers: the in-process tests have one, and no multi-process test runs --rerun-mode report_stats")
          for old, new in (("if dist.get_rank() == 0 else None", "if (dist.get_rank() == 0) or True else None"),
                           ("gathered[1:]", "gathered[2:]"), ("if caller in stats]", "if caller not in stats]"))],
    ],
    "kernels_reference": [
        ("project_whole_", 'pieces[0].data.device if pieces else torch.device("cpu")', "None", ON_GPU),
        ("project_whole_", "if pieces else", "if (pieces) and False else", ON_GPU),
        ("project_whole_", "device=device)", "device=None)", ON_GPU),
        ("project_whole_", ", device=device)", ", )", ON_GPU),
    ],
    "factors": [
        *[("_store_in_cache", old, new, "the cache file's layout: json.loads reads it back the same, no reader "
           "depends on it") for old, new in (
              ("indent=1", "indent=None"), ("indent=1", "indent=2"), ("indent=1, ", ""),
              ("sort_keys=True", "sort_keys=None"), ("sort_keys=True", "sort_keys=False"), ("sort_keys=True", ""))],
    ],
    "digests": [
        *[("record", "indent=1)", new, "the digests file's layout: no reader depends on it")
          for new in ("indent=None)", ")", "indent=2)")],
    ],
    "bounding": [
        *[("attach_weight_constraint", "mode, data_parallel_group)", new, DP_OVER_ONE)
          for new in ("mode, None)", "mode, )")],
        ("_optimizer_pieces", "buffer.params if wanted(p)]", "buffer.params if wanted(None)]",
         "the distributed optimizer's list of every weight matters only where its shards cut weights, never at "
         "one rank: the multi-process test_parallel_equivalence.py (dp2) compares it with one process"),
        *[("_fsdp_piece", old, new, "at one rank the shard starts at row 0 whatever the arithmetic; a shard "
           "elsewhere needs two ranks, as in the multi-process test_parallel_equivalence.py (dp2_fsdp2)")
          for old, new in (("offset[0] * param", "offset[0] / param"), ("offset[0] * param", "offset[1] * param"))],
    ],
    "layout_search": [
        *[(function, "1e9", "1000000001.0", "one part in a billion of an estimate: below the float tolerance the "
           "tests allow") for function in ("_collective_seconds", "step_seconds")],
    ],
    "indexed": [
        ("_check_index_arrays", 'mode="r", ', "", READ_ONLY),
        ("_check_index_arrays", 'mode="r", offset', "offset", READ_ONLY),
        ("_check_index_arrays", "documents - 1, chunk)", "documents - 2, chunk)", "differs only where the last "
         "chunk of 4M (2**22) entries starts at the last entry, or with one document, whose two entries "
         "check_indexed_dataset already requires to be 0 and `sequences`"),
        ("max_token_id", 'mode="r").max()', ").max()", READ_ONLY),
        ("_check_index_arrays", "stop + 1]", "stop + 2]", "differs only past the first chunk of 4M entries "
         "(2**22): a test would write an index of 50 MB"),
        ("write_metadata", "indent=2", "indent=3", "the .json's layout: no reader depends on it"),
        ("write_metadata", "indent=2", "indent=None", "the .json's layout: no reader depends on it"),
        ("write_metadata", ", indent=2)", ", )", "the .json's layout: no reader depends on it"),
        ("write_metadata", 'file.write("\\n")', 'file.write("XX\\nXX")', "the .json's last line: no reader "
         "depends on it"),
    ],
}


def mutmut_config(module: Module) -> str:
    def toml_list(values):
        return "[" + ", ".join(json.dumps(value) for value in values) + "]"
    return "\n".join([
        "[tool.mutmut]",
        f"source_paths = {toml_list(module.source_paths)}",
        f"only_mutate = {toml_list([module.mutated])}",
        f"pytest_add_cli_args_test_selection = {toml_list(module.tests)}",
        # mutmut copies the source paths and tests/ into mutants/; the tests also read these.
        f"also_copy = {toml_list([name for name in ALSO_COPIED if name not in module.source_paths])}",
        f"pytest_add_cli_args = {toml_list(['-p', 'no:cacheprovider', '-p', 'no:xdist', '-m', FAST])}",
        # torch is not fork-safe after it has run: each mutant forks from a server that has only imported.
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
        "",
    ])


def prepare(module: Module, label: str) -> Path:
    """A fresh copy of the tree for the module's run (a previous run's results would be reused otherwise), one
    per label, so that runs under different labels can go at once."""
    work = WORK / label / module.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, work / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, work / name)
    if label == "before":  # the tests as committed, without those added since (for issue 52, or uncommitted)
        shutil.rmtree(work / "tests")
        archive = subprocess.run(["git", "archive", "HEAD", "tests"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    if module.script:
        (work / "src").mkdir()
        shutil.move(work / module.source, work / module.mutated)
        # mutmut copies tools/ (without the script now) around this link, and writes the mutants where it points.
        link = work / "mutants" / module.source
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(work / "mutants" / module.mutated, link.parent))
    (work / "pyproject.toml").write_text(mutmut_config(module))
    return work


def mutant_diff(work: Path, module: Module, name: str) -> str:
    """The mutant's changed lines ("-" the original's, "+" the mutant's)."""
    with contextlib.chdir(work):  # mutmut reads its mutants/ relative to the working directory
        diff = get_diff_for_mutant(name, path=module.mutated)
    return "\n".join(line for line in diff.splitlines()
                     if line[:1] in "+-" and not line.startswith(("+++", "---")))


def run_module(module: Module, label: str, max_children: int) -> dict | None:
    work = prepare(module, label)
    print(f"== {module.name}: mutating {module.source}, tests {' '.join(module.tests)}", flush=True)
    start = time.monotonic()
    # mutmut's own entry point rather than `python -m mutmut`, which it warns imports it twice.
    mutmut = Path(sys.executable).with_name("mutmut")
    patterns = [f"*.x_{function}__mutmut_*" for function in module.functions]
    completed = subprocess.run([str(mutmut), "run", "--max-children", str(max_children), *patterns], cwd=work,
                               capture_output=True, text=True)
    seconds = time.monotonic() - start
    (work / "mutmut.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        print(f"   mutmut failed (exit {completed.returncode}); its output is in {work / 'mutmut.log'}", flush=True)
        return None
    meta = json.loads((work / "mutants" / (module.mutated + ".meta")).read_text())
    codes = {name: code for name, code in meta["exit_code_by_key"].items()
             if not module.functions or function_of(name) in module.functions}
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    # 1 and 3: a test failed or pytest stopped with an error; timeouts (SIGXCPU) also detect the mutant.
    killed = sorted(name for name, code in codes.items() if code in (1, 3))
    timeout = sorted(name for name, code in codes.items() if code in (24, -24, 152, 255, 36))
    survived = sorted(name for name, code in codes.items() if code == 0)
    no_tests = sorted(name for name, code in codes.items() if code in (5, 33))
    other = sorted(name for name in codes if name not in {*killed, *timeout, *survived, *no_tests})
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "source": module.source,
        "tests": module.tests,
        "mutants": len(codes),
        "killed": len(killed) + len(timeout),
        "timeouts": len(timeout),
        # Not reached by any of the module's tests: surviving too, listed apart.
        "survived": {name: mutant_diff(work, module, name) for name in survived + no_tests + other},
        "not_reached": no_tests,
        "other": {name: codes[name] for name in other},
        "run_seconds": round(seconds, 1),
        "tests_seconds": round(sum(stats["duration_by_test"].values()), 2),
        "tests_count": len(stats["duration_by_test"]),
    }


def function_of(mutant: str) -> str:
    """angpt.config.batch_schedule.x_ramp__mutmut_3 -> ramp; ...xǁClassǁmethod__mutmut_1 -> Class.method."""
    local = mutant.rsplit(".", 1)[-1].split("__mutmut_")[0]
    return ".".join(part for part in re.sub(r"^x[_ǁ]", "", local).split("ǁ") if part)


def reason(entries: list[tuple[str, str, str | None, str]], mutant: str, diff: str) -> str | None:
    """The why of the entry (of EQUIVALENT or LEFT) that describes the mutant's change, if one does: in that
    function, the original statement with one OLD replaced by NEW (an OLD that starts with a space is the whole
    line, indentation included, which tells nested loops apart), or with NEW None any change of a statement that
    holds OLD (a statement that runs only on CUDA or at tensor-parallel size above 1)."""
    removed = [line[1:].rstrip() for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:].rstrip() for line in diff.splitlines() if line.startswith("+")]
    for function, old, new, why in entries:
        if function != function_of(mutant):
            continue
        if new is None:
            matches = any(old in line for line in removed)
        elif old.startswith(" "):
            matches = removed == [old] and added == [new]
        else:  # a statement over several lines is compared as one
            before, after = (" ".join(line.strip() for line in lines) for lines in (removed, added))
            matches = any(before[:match.start()] + new + before[match.end():] == after
                          for match in re.finditer(re.escape(old), before))
        if matches:
            return why
    return None


def score(module_name: str, run: dict) -> dict:
    equivalent = {name: why for name, diff in run["survived"].items()
                  if (why := reason(EQUIVALENT.get(module_name, []), name, diff)) is not None}
    surviving = [name for name in run["survived"] if name not in equivalent]
    return {"mutants": run["mutants"], "killed": run["killed"], "equivalent": len(equivalent),
            "surviving": len(surviving), "equivalent_names": equivalent, "surviving_names": surviving}


def percent(counts: dict) -> str:
    effective = counts["mutants"] - counts["equivalent"]
    return f"{100 * counts['killed'] / effective:.0f}%" if effective else "-"


def table(results: dict) -> str:
    lines = ["| module | tests | before: mutants / killed / equivalent / surviving | score | "
             "after: mutants / killed / equivalent / surviving | score | tests' time (before → after) | "
             "mutation run (after) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for module in MODULES:
        runs = results.get(module.name, {})
        cells = []
        for label in ("before", "after"):
            if label in runs:
                counts = score(module.name, runs[label])
                cells += [" / ".join(str(counts[key]) for key in ("mutants", "killed", "equivalent", "surviving")),
                          percent(counts)]
            else:
                cells += ["not run yet", ""]
        times = " → ".join(f"{runs[label]['tests_seconds']:.1f} s" for label in ("before", "after") if label in runs)
        run = f"{runs['after']['run_seconds'] / 60:.0f} min" if "after" in runs else ""
        # The tests of the latest run (the after run's may add a file the before run lacked).
        tests = ", ".join(f"`{Path(test).name}`" for test in (runs.get("after") or runs.get("before") or
                                                              {"tests": module.tests})["tests"])
        part = f" ({', '.join(f'`{function}`' for function in module.functions)})" if module.functions else ""
        lines.append(f"| `{module.source}`{part} | {tests} | {' | '.join(cells)} | {times} | {run} |")
    return "\n".join(lines)


def survivors_section(results: dict) -> str:
    """The survivors of each module's latest run, one line each: function, mutant number, the changed line
    before and after, and why where it is equivalent."""
    out = []
    for module in MODULES:
        run = results.get(module.name, {}).get("after")
        if run is None:
            continue
        counts = score(module.name, run)
        names = sorted(counts["surviving_names"] + list(counts["equivalent_names"]),
                       key=lambda name: (function_of(name), int(name.rsplit("__mutmut_", 1)[-1])))
        out.append(f"`{module.source}`:" + ("" if names else " none."))
        for name in names:
            why = counts["equivalent_names"].get(name)
            left = reason(LEFT.get(module.name, []), name, run["survived"][name])
            reached = " (no test of the module reaches it)" if name in run["not_reached"] else ""
            changed = [line[1:].strip() for line in run["survived"][name].splitlines()]
            number = name.rsplit("__mutmut_", 1)[-1]
            out.append(f"- `{function_of(name)}` #{number}: " + " → ".join(f"`{line}`" for line in changed) +
                       (f"; equivalent: {why}" if why else f"; **surviving**{reached}" + (f": {left}" if left else "")))
        out.append("")
    return "\n".join(out).strip() or "None yet."


def render(results: dict) -> None:
    if not DOC.exists():
        return
    text = DOC.read_text()
    begin, end = text.index(TABLE_BEGIN), text.index(TABLE_END)
    generated = (f"{TABLE_BEGIN}\n\n{table(results)}\n\nThe survivors of the latest run (`after`):\n\n"
                 f"{survivors_section(results)}\n\n")
    DOC.write_text(text[:begin] + generated + text[end:])


def print_module(module: Module, run: dict) -> None:
    counts = score(module.name, run)
    print(f"   {counts['mutants']} mutants, {counts['killed']} killed ({run['timeouts']} by timeout), "
          f"{counts['equivalent']} equivalent, {counts['surviving']} surviving; "
          f"{run['run_seconds']:.0f} s, tests {run['tests_seconds']:.1f} s")
    for name in counts["surviving_names"]:
        reached = " (no test reaches it)" if name in run["not_reached"] else ""
        print(f"   survived{reached}: {name}\n" + "\n".join("      " + line for line in
                                                             run["survived"][name].splitlines()))


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="module names (default: all); see --list")
    parser.add_argument("--label", default="after", help="where the results go in the JSON (before, after)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, and exit")
    parser.add_argument("--render", action="store_true", help="only write docs/testing.md's table from the JSON")
    args = parser.parse_args()
    by_name = {module.name: module for module in MODULES}
    if args.list:
        for module in MODULES:
            part = f" ({' '.join(module.functions)})" if module.functions else ""
            print(f"{module.name:18} {module.source + part:36} {' '.join(module.tests)}")
        return
    unknown = [name for name in args.modules if name not in by_name]
    if unknown:
        parser.error(f"unknown modules {unknown}; --list lists them")
    if not args.render:
        failed = []
        for name in args.modules or list(by_name):
            run = run_module(by_name[name], args.label, args.max_children)
            if run is None:
                failed.append(name)
                continue
            print_module(by_name[name], run)
            # Read again after each module: other modules' results may have been written meanwhile.
            results = load_results()
            results.setdefault(name, {})[args.label] = run
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    results = load_results()
    render(results)
    print(table(results))
    if not args.render and failed:
        raise SystemExit(f"mutmut failed on {' '.join(failed)}")


if __name__ == "__main__":
    main()
