"""Hugging Face export (tools/convert_to_hf.py, angpt/hf/): models trained a few steps at TP 2 or PP 2,
exported, loaded with transformers and compared with angpt's own model (TP 1, fp32, one process) on
logits, greedy decoding and padded batches; and anGPT under the switches whose constant factors the export
folds into weights.

The exported model computes in other arithmetic than ours (another order of operations, bf16), so logits
are compared within tolerances, and argmaxes and greedy choices only up to what those tolerances allow
(angpt.hf.verify): a near-tie may fall either way on another CPU."""

from __future__ import annotations

import glob
import json
import math
import os
import random
import re
import runpy
import shutil
import sys
from pydoc_data.topics import topics

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from angpt.config.arguments import parse_args
from angpt.config.saved import config_from_saved
from angpt.data.tokenizers import EOD_TOKEN, build_tokenizer
from angpt.hf.checkpoint_reader import Checkpoint, model_config, read_checkpoint
from angpt.hf.errors import ExportError
from angpt.hf.export import export
from angpt.hf.importer import import_hf, qwen3_args
from angpt.hf.model_card import recorded_losses
from angpt.hf.verify import (
    FP32_LOGIT_TOLERANCE,
    decided,
    greedy_within_tolerance,
    load_exported,
    load_megatron_model,
    load_tokenizer,
    logit_tolerance,
    megatron_logits,
    near_argmax,
)
from angpt.hf.weights import LAYER
from angpt.training.megatron_configs import transformer_config

from conftest import PYDOC_VOCAB_SIZE, ROOT, TRAINED_ITERS, TRAINED_MODEL, TRAINED_RUNS, in_process_trainer
from launch import launch

pytestmark = pytest.mark.multiprocess

# The model of conftest's trained_runs (each family trained at a layout that splits its tensors: the export
# reads them back whole).
MODEL = [*TRAINED_MODEL, "--lr", "1e-2"]
RUNS = list(TRAINED_RUNS)
# The switches that change what the exported anGPT must compute. Without the post-norm nothing cancels the
# constant factors after W_v, W_o and W_down, and the export folds them into those weights (with it they
# cancel, so the runs above cannot see one left out); the nu_p reading is W_o's factor, which shows only
# without the post-norm; the plain residual has no alpha and a constant of its own.
SWITCHES = {
    "post_norm_none": ["--angpt-post-norm", "none"],
    # Here nu_qkv nu_p = sqrt(d/h) sqrt(h/d) = 1: W_v's and W_o's factors both left out would go unseen (not
    # above, where nu_p = 1), either one alone shows.
    "post_norm_none_nu_p_sqrt_h_over_d_plain_residual": ["--angpt-post-norm", "none", "--angpt-nu-p", "sqrt_h_over_d",
                                                         "--angpt-residual", "plain"],
}
# Logits of the same exported weights with and without left padding: only the order of a few sums differs.
PADDING_TOLERANCE = 1e-5


def run(*command: str, nproc: int = 0, cold: bool = False, **env: str) -> str:
    """`python COMMAND` (or torchrun's nproc ranks of it), warm unless `cold` (tests/launch.py), in the
    repository, with `env` added to the environment; its output."""
    done = launch(list(command), nproc=nproc, timeout=600, cold=cold,
                  env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", **env})
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"exit code {done.returncode}:\n{output[-5000:]}"
    return output


@pytest.fixture(scope="module")
def checkpoints(trained_runs):
    """{family: checkpoint directory}."""
    return {family: str(run_dir) for family, run_dir in trained_runs.items()}


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory, single_process):
    """{(family, dtype): (checkpoint, Hugging Face directory)}, written by the library."""
    out = {}
    for family, load in checkpoints.items():
        for dtype in ("float32", "bfloat16"):
            output = str(tmp_path_factory.mktemp(f"{family}_{dtype}_hf"))
            out[family, dtype] = export(load, output, dtype=dtype), output
    return out


@pytest.fixture(scope="module")
def models(exported):
    """{family: (angpt's model, the exported fp32 model, the exported bf16 model)}."""
    return {family: (load_megatron_model(exported[family, "float32"][0]),
                     load_exported(exported[family, "float32"][1]),
                     load_exported(exported[family, "bfloat16"][1], torch.bfloat16))
            for family in RUNS}


def tokens(vocab_size: int, shape=(2, 24), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", RUNS)
def test_the_exported_model_computes_our_logits(family, models):
    ours, fp32, bf16 = models[family]
    ids = tokens(fp32.config.vocab_size, (8, 24))
    reference = megatron_logits(ours, ids, fp32.config.vocab_size)
    with torch.no_grad():
        theirs = fp32(ids).logits
        theirs_bf16 = bf16(ids).logits.float()
    difference = (theirs - reference).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(theirs_bf16.flatten(), reference.flatten(), dim=0).item()
    tolerance = logit_tolerance(reference, torch.bfloat16)
    bf16_error = ((theirs_bf16 - reference).abs() / tolerance).max().item()  # in tolerances
    positions = decided(reference, tolerance)
    print(f"{family}: fp32 max |difference| {difference:.3g}; bf16 cosine similarity {cosine:.6f}, largest error "
          f"{bf16_error:.3f} of its bound; argmax decided at {int(positions.sum())} of {positions.numel()} positions")
    assert theirs.shape == reference.shape
    assert difference < FP32_LOGIT_TOLERANCE
    assert cosine > 0.999
    assert bf16_error <= 1
    # The argmax wherever the bf16 error cannot move it (a near-tie may go either way), on enough positions
    # for the check to say something.
    assert positions.float().mean() >= 0.15
    assert torch.equal(theirs_bf16.argmax(-1)[positions], reference.argmax(-1)[positions])


@pytest.mark.parametrize("family", RUNS)
def test_greedy_generation_matches_our_greedy_decoding(family, models):
    ours, fp32, _ = models[family]
    prompt = tokens(fp32.config.vocab_size, (1, 8), seed=1)
    with torch.no_grad():
        generated = fp32.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    print(family, generated[0, 8:].tolist())
    assert generated.shape[1] == 28 or generated[0, -1] == fp32.config.eos_token_id
    # Each token (generated with the cache) is a greedy choice of our model on the tokens before it, up to
    # the fp32 tolerance; not our own greedy sequence, which a near-tie could send elsewhere.
    assert greedy_within_tolerance(ours, generated, prompt.shape[1], fp32.config.vocab_size)


@pytest.mark.parametrize("family", RUNS)
def test_a_left_padded_batch_gives_the_logits_and_continuations_of_its_rows_alone(family, models):
    _, fp32, _ = models[family]
    long, short = tokens(fp32.config.vocab_size, (1, 16), seed=2), tokens(fp32.config.vocab_size, (1, 9), seed=3)
    padding = long.shape[1] - short.shape[1]
    batch = torch.cat([long, torch.cat([torch.full((1, padding), fp32.config.eos_token_id), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :padding] = 0
    with torch.no_grad():
        padded = fp32(batch, attention_mask=mask).logits
        alone = [fp32(long).logits[0], fp32(short).logits[0]]
    torch.testing.assert_close(padded[0], alone[0], rtol=0, atol=PADDING_TOLERANCE)
    torch.testing.assert_close(padded[1, padding:], alone[1], rtol=0, atol=PADDING_TOLERANCE)
    eos = fp32.config.eos_token_id
    with torch.no_grad():
        generated = fp32.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for row, prompt in zip(generated, (long, short)):
            continuation = row[batch.shape[1]:]
            ends = (continuation == eos).nonzero()
            if len(ends):  # the batch pads a row after its eos (with eos)
                continuation = continuation[: ends[0, 0] + 1]
            # Each token is a greedy choice of the row alone, teacher-forced, up to the padding tolerance.
            logits = fp32(torch.cat([prompt[0], continuation])[None, :-1]).logits[:, prompt.shape[1] - 1:]
            tolerance = torch.full_like(logits[..., :1], PADDING_TOLERANCE)
            assert near_argmax(logits, continuation[None], tolerance).all()


def test_the_export_carries_the_tokenizer_with_the_end_of_document_token_as_eos(exported, pydoc_corpus):
    output = exported["angpt", "float32"][1]
    theirs = load_tokenizer(output)
    ours = build_tokenizer("HuggingFaceTokenizer", str(pydoc_corpus / "tokenizer"))
    text = "Return the value of the named attribute of object."
    assert theirs(text).input_ids == ours.encode_batch([text])[0]
    assert theirs.eos_token == EOD_TOKEN and theirs.eos_token_id == ours.eod
    with open(os.path.join(output, "generation_config.json")) as file:
        assert json.load(file)["eos_token_id"] == ours.eod
    with open(os.path.join(output, "config.json")) as file:
        config = json.load(file)
    assert config["vocab_size"] == ours.vocab_size
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_angpt.AnGPTForCausalLM"


def test_gptplus_is_exported_as_qwen3_without_remote_code(exported):
    output = exported["gptplus", "float32"][1]
    assert not any(name.endswith(".py") for name in os.listdir(output))
    model = AutoModelForCausalLM.from_pretrained(output)
    assert type(model) is Qwen3ForCausalLM and model.config.vocab_size == 200


def trained_flag(name: str) -> int:
    """A flag of conftest's trained model."""
    return int(TRAINED_MODEL[TRAINED_MODEL.index(name) + 1])


@pytest.mark.parametrize("family", RUNS)
def test_the_model_card_states_what_the_run_recorded_and_loads_as_it_says(family, exported, checkpoints, capsys):
    output = exported[family, "float32"][1]
    card = ModelCard.load(os.path.join(output, "README.md"))
    assert card.data.library_name == "transformers" and family in card.data.tags
    with open(os.path.join(checkpoints[family], "metrics.jsonl")) as file:
        final = [record for record in map(json.loads, file) if record["kind"] == "train"][-1]
    assert final["iteration"] == TRAINED_ITERS
    batch, length = trained_flag("--global-batch-size"), trained_flag("--seq-length")
    with safe_open(os.path.join(output, "model.safetensors"), "pt") as file:
        parameters = sum(math.prod(file.get_slice(key).get_shape()) for key in file.keys())
    assert f"- parameters: {parameters:,} as exported" in card.text
    assert f"- context length: {length} tokens" in card.text
    assert f"- {TRAINED_ITERS} iterations of {batch} sequences of {length} tokens; tokens seen: " \
           f"{TRAINED_ITERS * batch * length:,}" in card.text
    assert f"- final training loss: {final['lm_loss']:.4f} (lm loss at iteration {TRAINED_ITERS}," in card.text
    assert "- final validation loss: not recorded" in card.text  # --eval-iters 0
    if family == "angpt":
        assert f"; {PYDOC_VOCAB_SIZE} tokens, `{EOD_TOKEN}` (id 0) ends documents" in card.text
    else:
        assert "- tokenizer: none: trained on synthetic token ids (--mock-data)" in card.text
    # Its snippet runs as it stands: greedy text from the prompt, or ids without a tokenizer.
    exec(re.search(r"```python\n(.*?)```", card.text, re.DOTALL).group(1), {})
    printed = capsys.readouterr().out
    assert printed.startswith("The quick brown fox" if family == "angpt" else "[1, 2, 3, ")


def test_the_model_card_takes_the_losses_of_the_run_as_it_stands_up_to_the_checkpoint(tmp_path):
    """A run resumed from iteration 2 logged iterations 3 and 4 again: the card of iteration 3 gives the
    second run's loss at 3, and the validation loss at 2 (the first run's at 4 is past the checkpoint)."""
    records = [{"kind": "start", "iteration": 0}, {"kind": "train", "iteration": 2, "lm_loss": 5.0},
               {"kind": "eval", "iteration": 2, "split": "validation", "lm_loss": 5.5},
               {"kind": "train", "iteration": 3, "lm_loss": 4.0}, {"kind": "eval", "iteration": 4, "split": "test",
                                                                   "lm_loss": 9.0},
               {"kind": "start", "iteration": 2}, {"kind": "train", "iteration": 3, "lm_loss": 3.25},
               {"kind": "train", "iteration": 4, "lm_loss": None},
               {"kind": "eval", "iteration": 4, "split": "validation", "lm_loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    recorded = {"model_family": "angpt"}  # every other flag at its default: no --metrics-file
    checkpoint = Checkpoint(str(tmp_path / "iter_0000003"), recorded, {})
    assert recorded_losses(checkpoint, 3) == (
        "3.2500 (lm loss at iteration 3, mean over the steps since the previous log line)",
        "5.5000 (lm loss at iteration 2, mean over the evaluation's batches)")
    assert recorded_losses(checkpoint, 4)[0] == "not finite at iteration 4"
    assert recorded_losses(Checkpoint(str(tmp_path / "iter_0000001"), recorded, {}), 1)[1] == \
        f"not recorded ({tmp_path / 'metrics.jsonl'} has no validation loss up to iteration 1)"
    os.remove(tmp_path / "metrics.jsonl")
    assert recorded_losses(checkpoint, 3)[0] == f"not available ({tmp_path / 'metrics.jsonl'}: no such file)"


def test_large_weights_are_sharded_with_an_index(checkpoints, tmp_path, single_process):
    export(checkpoints["ngpt"], str(tmp_path), max_shard_bytes=100_000)
    with open(tmp_path / "model.safetensors.index.json") as file:
        weight_map = json.load(file)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as file:
            assert file.metadata() == {"format": "pt"}
            assert set(file.keys()) == {key for key, name in weight_map.items() if name == shard}


def convert_to_hf(*argv: str, monkeypatch) -> None:
    """tools/convert_to_hf.py as from the command line, in this process."""
    monkeypatch.setattr(sys, "argv", ["convert_to_hf.py", *argv])
    runpy.run_path(os.path.join(ROOT, "tools", "convert_to_hf.py"), run_name="__main__")


def test_the_converter_checks_its_output_against_our_model(checkpoints, tmp_path, single_process, monkeypatch,
                                                          capsys):
    convert_to_hf("--load", checkpoints["angpt"], "--output", str(tmp_path), monkeypatch=monkeypatch)
    printed = capsys.readouterr().out
    print(printed)
    assert "max |logit difference|" in printed
    argmax = re.search(r"same argmax where the margin exceeds twice the tolerance \((\d+) of \d+ positions\): True",
                       printed)
    assert argmax and int(argmax.group(1)) > 0
    assert "greedy continuation of 20 tokens agrees up to the tolerance" in printed
    assert "exported model's continuation: 'The quick brown fox" in printed


@pytest.mark.parametrize("family", RUNS)
def test_export_then_import_gives_back_every_tensor_bit_exactly(family, exported, tmp_path):
    checkpoint, output = exported[family, "float32"]
    import_hf(output, str(tmp_path))
    original, imported = checkpoint.tensors, read_checkpoint(str(tmp_path)).tensors
    assert imported.keys() == original.keys()
    with open(os.path.join(output, "config.json")) as file:
        vocab_size = json.load(file)["vocab_size"]
    # Rows past the vocabulary pad it for tensor parallelism: the export drops them, the import zeroes them.
    differing = [key for key in original
                 if not torch.equal(imported[key][:vocab_size], original[key][:vocab_size])]
    assert not differing


@pytest.fixture(scope="module")
def switched(tmp_path_factory, single_process):
    """{switches: (checkpoint, Hugging Face fp32 directory)}: anGPT trained 2 steps in this process at TP =
    PP = 1 (a torchrun launch costs 20 s or more; the layouts are the runs above)."""
    out = {}
    for name, flags in SWITCHES.items():
        save = str(tmp_path_factory.mktemp(f"{name}_checkpoint"))
        assert in_process_trainer([*MODEL, "--model-family", "angpt", "--mock-data", "--vocab-size", "200", *flags,
                                   "--train-iters", "2", "--save", save]).run() == 0
        output = str(tmp_path_factory.mktemp(f"{name}_hf"))
        out[name] = export(save, output), output
    return out


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_export_computes_our_logits_under_the_switches_that_fold_factors(switches, switched):
    checkpoint, output = switched[switches]
    theirs = load_exported(output)
    assert any(factor != 1.0 for factor in theirs.config.folded_factors.values())  # some weights do change
    ids = tokens(theirs.config.vocab_size)
    reference = megatron_logits(load_megatron_model(checkpoint), ids, theirs.config.vocab_size)
    with torch.no_grad():
        difference = (theirs(ids).logits - reference).abs().max().item()
    print(f"{switches}: folded {theirs.config.folded_factors}; max |difference| {difference:.3g}")
    assert difference < FP32_LOGIT_TOLERANCE


@pytest.mark.parametrize("switches", SWITCHES)
def test_export_then_import_under_the_switches_gives_back_every_tensor_and_our_model(switches, switched, tmp_path):
    checkpoint, output = switched[switches]
    import_hf(output, str(tmp_path))
    imported = read_checkpoint(str(tmp_path))
    assert {flag: imported.args[flag] for flag in ("angpt_post_norm", "angpt_nu_p", "angpt_residual")} == \
        {flag: checkpoint.args[flag] for flag in ("angpt_post_norm", "angpt_nu_p", "angpt_residual")}
    assert imported.tensors.keys() == checkpoint.tensors.keys()
    vocab_size = checkpoint.args["vocab_size"]
    # A weight times a folded factor f, divided by f again, is rounded to fp32 twice (three times if the
    # division multiplies by 1/f), 2^-24 relative each: within 2^-22. Every other tensor comes back bit
    # for bit.
    folded = {LAYER + name for name in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                                        "mlp.linear_fc2.weight")}
    for key, original in checkpoint.tensors.items():
        back, original = imported.tensors[key][:vocab_size], original[:vocab_size]
        if key in folded:
            torch.testing.assert_close(back, original, rtol=2**-22, atol=0, msg=key)
        else:
            assert torch.equal(back, original), key
    ids = tokens(vocab_size)
    difference = (megatron_logits(load_megatron_model(imported), ids, vocab_size)
                  - megatron_logits(load_megatron_model(checkpoint), ids, vocab_size)).abs().max().item()
    assert difference < FP32_LOGIT_TOLERANCE


def test_the_margin_rules_pass_over_near_ties_and_catch_other_choices():
    reference = torch.tensor([[0.50, 0.50 - 1e-5, 0.1],  # a near-tie: rounding may pick either
                              [0.50, 0.40, 0.1]])  # decided
    tolerance = logit_tolerance(reference, torch.float32)
    assert decided(reference, tolerance).tolist() == [False, True]
    assert near_argmax(reference, torch.tensor([1, 0]), tolerance).tolist() == [True, True]
    assert near_argmax(reference, torch.tensor([2, 1]), tolerance).tolist() == [False, False]
    # bf16: 16 roundoffs of 2^-8 of the largest |logit|, 1/32 of 0.5; its argmax decided past twice that.
    assert decided(reference, logit_tolerance(reference, torch.bfloat16)).tolist() == [False, True]
    close = torch.tensor([[0.50, 0.47, 0.1]])
    assert not decided(close, logit_tolerance(close, torch.bfloat16)).item()


def test_an_imported_checkpoint_is_fine_tuned_by_the_trainer_at_another_layout(exported, tmp_path):
    output = exported["ngpt", "float32"][1]
    printed = run("tools/convert_from_hf.py", "--input", output, "--save", str(tmp_path))
    assert "--model-family ngpt --num-layers 2 --hidden-size 64 --seq-length 64" in printed
    trained = run("-m", "angpt.pretrain", *MODEL, "--model-family", "ngpt", "--tensor-model-parallel-size", "2",
                  "--mock-data", "--vocab-size", "256", "--train-iters", "1", "--load", str(tmp_path), "--finetune",
                  nproc=2)
    assert "for fine-tuning" in trained and "iteration        1/       1" in trained


def test_a_directory_that_is_not_a_checkpoint_is_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        convert_to_hf("--load", str(tmp_path), "--output", str(tmp_path / "hf"), monkeypatch=monkeypatch)
    assert str(exit_.value) == \
        f"convert_to_hf: {tmp_path} is not a checkpoint directory: it has no latest_checkpointed_iteration.txt"


def test_a_missing_iteration_is_refused_with_the_ones_there(checkpoints, tmp_path, single_process):
    with pytest.raises(ExportError, match=rf"has no checkpoint of iteration 7 \(it has \[{TRAINED_ITERS}\]\)"):
        export(checkpoints["ngpt"], str(tmp_path), iteration=7)


def test_a_checkpoint_of_an_unknown_family_is_refused(checkpoints, tmp_path, single_process):
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoints["ngpt"], copy)
    common_file = copy / f"iter_{TRAINED_ITERS:07d}" / "common.pt"
    common = torch.load(common_file, weights_only=False)
    common["args"]["model_family"] = "bert"
    torch.save(common, common_file)
    os.remove(common_file.parent / "angpt_digests.json")  # else its digests would refuse the edited file first
    with pytest.raises(ExportError, match="unknown model family 'bert'"):
        export(str(copy), str(tmp_path / "hf"))


def multiple_choice_items(count: int = 24) -> list[dict]:
    """Four words of Python's help texts, their next word and three other words of the texts."""
    rng = random.Random(0)
    words = " ".join(topics[key] for key in sorted(topics)).split()
    items = []
    for start in range(100, 100 + 97 * count, 97):
        choices = [" " + words[start + 4], *(" " + rng.choice(words) for _ in range(3))]
        items.append({"context": " ".join(words[start:start + 4]), "choices": choices, "label": 0})
    return items


def our_loglikelihoods(model, tokenizer, items: list[dict], vocab_size: int) -> list[list[tuple[float, int]]]:
    """(log-likelihood, number of tokens) of each choice of each item as lm-eval scores it (the choice's
    tokens are those of context + choice after the context's), from our model's logits."""
    scores = []
    for item in items:
        context = tokenizer(item["context"]).input_ids
        scores.append([])
        for choice in item["choices"]:
            whole = tokenizer(item["context"] + choice).input_ids
            log_probs = megatron_logits(model, torch.tensor([whole[:-1]]), vocab_size).log_softmax(-1)[0]
            continuation = torch.tensor(whole[len(context):])
            score = log_probs[len(context) - 1:].gather(-1, continuation[:, None]).sum().item()
            scores[-1].append((score, len(continuation)))
    return scores


def test_lm_eval_runs_offline_on_the_export_and_scores_what_our_model_does(exported, models, tmp_path):
    items = multiple_choice_items()
    with open(tmp_path / "items.jsonl", "w") as file:
        file.writelines(json.dumps(item) + "\n" for item in items)
    task = {"task": "angpt_local", "dataset_path": "json", "output_type": "multiple_choice",
            "dataset_kwargs": {"data_files": {"test": str(tmp_path / "items.jsonl")}}, "test_split": "test",
            "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
            "target_delimiter": "", "metric_list": [{"metric": "acc", "higher_is_better": True}]}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "angpt_local.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML
    output = exported["angpt", "float32"][1]
    run("-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={output},trust_remote_code=True,dtype=float32",
        "--tasks", "angpt_local", "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "8",
        "--output_path", str(tmp_path / "results"), "--log_samples", cold=True,  # HF_HUB_OFFLINE is read at import
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    (results_file,) = glob.glob(str(tmp_path / "results" / "*" / "results_*.json"))
    with open(results_file) as file:
        accuracy = json.load(file)["results"]["angpt_local"]["acc,none"]
    (samples_file,) = glob.glob(str(tmp_path / "results" / "*" / "samples_angpt_local_*.jsonl"))
    with open(samples_file) as file:
        samples = sorted(map(json.loads, file), key=lambda sample: sample["doc_id"])
    ours = our_loglikelihoods(models["angpt"][0], load_tokenizer(output), items, models["angpt"][1].config.vocab_size)
    assert len(samples) == len(items)
    assert accuracy == pytest.approx(sum(sample["acc"] for sample in samples) / len(samples), abs=1e-9)
    decided_items = 0
    for sample, item, choices in zip(samples, items, ours):
        theirs = [float(loglikelihood) for loglikelihood, _ in sample["filtered_resps"]]
        # A choice's log-likelihood sums the log-softmax of n tokens; logits within the fp32 tolerance t
        # move each log-softmax by at most 2 t (t for the logit, t for the log-sum-exp): 2 n t in all.
        bounds = [2 * n * FP32_LOGIT_TOLERANCE for _, n in choices]
        scores = [score for score, _ in choices]
        assert all(abs(a - b) <= bound for a, b, bound in zip(theirs, scores, bounds)), (theirs, scores)
        # Right or wrong as ours, item by item, wherever those bounds cannot change the best choice.
        best = max(range(len(scores)), key=scores.__getitem__)
        if all(scores[best] - scores[other] > bounds[best] + bounds[other] for other in range(len(scores))
               if other != best):
            decided_items += 1
            assert sample["acc"] == float(best == item["label"]), sample["doc_id"]
    print(f"lm-eval accuracy {accuracy}; the best choice decided on {decided_items} of {len(items)} items")
    assert decided_items >= len(items) // 2


@pytest.mark.parametrize("epsilon", [1e-6, 1e-5])
def test_a_qwen3_models_rms_norm_epsilon_is_imported_as_norm_epsilon(epsilon):
    """Qwen3's own checkpoints use 1e-6; GPT+'s default (Megatron-LM's --norm-epsilon) is 1e-5."""
    config = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=32, rope_theta=10000, rms_norm_eps=epsilon)
    assert qwen3_args(config)["norm_epsilon"] == epsilon


def test_a_context_parallel_run_is_exported_at_one_process():
    """The export builds the model whole in one process: a run's --context-parallel-size does not reach it."""
    recorded = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                           "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size",
                           "256", "--train-iters", "1", "--context-parallel-size", "2", "--cp-comm-type",
                           "all_gather"], world_size=2).flags()  # what its checkpoints record
    assert transformer_config(config_from_saved(recorded)).context_parallel_size == 2
    assert model_config(Checkpoint("iter_0000001", recorded, {})).context_parallel_size == 1
