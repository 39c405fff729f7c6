"""The cluster examples cannot drift from the flags: each config parses at the world sizes it is written
for, each script is valid bash, and every flag a script passes exists in the program that receives it."""

import glob
import os
import re
import subprocess

import pytest
from torch.distributed.run import get_args_parser

from angpt.config.arguments import parse_args
from angpt.config.parser import build_parser

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLES = os.path.join(ROOT, "examples")
CONFIGS = sorted(glob.glob(os.path.join(EXAMPLES, "configs", "*.yaml")))
SCRIPTS = sorted(glob.glob(os.path.join(EXAMPLES, "*.sh")) + glob.glob(os.path.join(EXAMPLES, "*.slurm")))
# srun's own flags used by examples/pretrain.slurm (srun is not installed here to ask).
SRUN_FLAGS = {"--kill-on-bad-exit", "--ntasks-per-node", "--nodes", "--export"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def option_strings(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def torchrun_flags() -> set[str]:
    return option_strings(get_args_parser())


def tool_flags(tool: str) -> set[str]:
    """The flags one of tools/*.py defines: its quoted "--name" strings (importing it would take long)."""
    with open(os.path.join(ROOT, tool)) as file:
        return set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", file.read()))


def commands(path: str) -> list[str]:
    """The script's commands, continuation lines joined, comments, #SBATCH lines and here-documents (text
    for a program's standard input, not flags) dropped."""
    with open(path) as file:
        text = file.read()
    lines, ends = [], None
    for line in text.replace("\\\n", " ").splitlines():
        if ends is not None:
            ends = None if line.strip() == ends else ends
            continue
        if not line.lstrip().startswith("#"):
            lines.append(line)
            if here := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line):
                ends = here.group(1)
    return lines


def test_the_examples_are_there():
    names = {os.path.basename(path) for path in SCRIPTS + CONFIGS}
    assert {"pretrain_single_node.sh", "pretrain_multi_node.sh", "pretrain.slurm", "quickstart.sh",
            "angpt_0.5b.yaml", "angpt_1b.yaml"} <= names


@pytest.mark.parametrize("world_size", [8, 16])
@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses_for_one_and_two_nodes(path, world_size, tmp_path):
    config = parse_args(["--config", path, "--mock-data", "--vocab-size", "50304", "--save", str(tmp_path)],
                        world_size=world_size)
    model = config.model
    # docs/model.md, Model shapes: head dim 64, f = 4d, context 2048, vocabulary padded to a multiple of 128.
    assert model.hidden_size == 64 * model.num_attention_heads
    assert model.ffn_hidden_size in (None, 4 * model.hidden_size)
    assert model.seq_length == 2048
    assert config.data.make_vocab_size_divisible_by == 128
    assert config.parallel.use_distributed_optimizer
    assert model.model_family == "angpt"
    # The anGPT recipe comes from the family's defaults (docs/model.md, Optimizer and schedule), not from the file.
    schedule = config.optimizer
    assert schedule.weight_decay is None and schedule.min_lr is None and schedule.lr_warmup_iters is None


def test_configs_are_the_spec_shapes():
    shapes = {}
    for path in CONFIGS:
        model = parse_args(["--config", path, "--mock-data", "--vocab-size", "50304", "--save", "unused"],
                           world_size=8).model
        shapes[os.path.basename(path)] = (model.hidden_size, model.num_layers, model.num_attention_heads)
    assert shapes["angpt_0.5b.yaml"] == (1024, 24, 16)
    assert shapes["angpt_1b.yaml"] == (1280, 36, 20)


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_is_valid_bash(path):
    done = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_every_flag_of_a_script_exists(path):
    """torchrun's flags (before `-m angpt.pretrain`) are torchrun's, srun's before the script it runs are
    srun's, those of `python tools/NAME.py` that tool's, and every other flag reaches angpt.pretrain."""
    pretrain, torchrun = option_strings(build_parser()), torchrun_flags()
    unknown = []
    for command in commands(path):
        if "torchrun" in command:
            launcher, _, rest = command.partition("-m angpt.pretrain")
            unknown += [f"torchrun {f}" for f in FLAG.findall(launcher.partition("torchrun")[2]) if f not in torchrun]
            command = rest
        elif tool := re.search(r"tools/\w+\.py", command):
            flags = tool_flags(tool.group())
            unknown += [f"{tool.group()} {f}" for f in FLAG.findall(command[tool.end():]) if f not in flags]
            continue
        elif re.search(r"\bsrun\b", command):
            launcher, _, rest = command.partition("examples/pretrain_multi_node.sh")
            unknown += [f"srun {f}" for f in FLAG.findall(launcher) if f not in SRUN_FLAGS]
            command = rest
        unknown += [flag for flag in FLAG.findall(command) if flag not in pretrain]
    assert not unknown, f"{os.path.basename(path)}: flags that do not exist: {unknown}"


def test_flag_check_catches_a_flag_that_does_not_exist(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text("python tools/preprocess_data.py --input x --worker 2\n"
                      "torchrun --standalone --nproc-per-node 8 --nnode 1 -m angpt.pretrain --num-layers 2 \\\n"
                      "    --bf16-typo\n")
    with pytest.raises(AssertionError) as error:
        test_every_flag_of_a_script_exists(str(script))
    assert all(f in str(error.value) for f in ("preprocess_data.py --worker'", "torchrun --nnode'", "'--bf16-typo'"))
    assert "--num-layers" not in str(error.value) and "--input" not in str(error.value)
