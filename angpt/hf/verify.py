"""Our model next to an exported one: angpt's megatron-core model at one process in fp32, loaded from the
checkpoint, and the checks the converter runs on what it wrote."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from transformers import AutoModelForCausalLM, AutoTokenizer

from angpt.hf.checkpoint_reader import Checkpoint, ensure_process_group, model_config
from angpt.hf.weights import DTYPES
from angpt.models.gpt import build_model

# Whatever the tokenizer, the check runs on the same ids (taken modulo the vocabulary).
PROMPT_IDS = [17, 3, 101, 42, 7, 250, 64, 9, 128, 31, 77, 5]
PROMPT_TEXT = "The quick brown fox"

# The exported model computes the checkpoint's function in other arithmetic (another order of operations;
# in bf16 other roundings too), so its logits are compared with ours within a tolerance, and an argmax only
# where no difference within the tolerance can move it: a near-tie may fall either way on another CPU.
FP32_LOGIT_TOLERANCE = 1e-4
# bf16 rounds every weight and each layer's activations, a relative error of up to u = 2^-8 each, which add
# up through the layers: on the tests' models at most 6 u of a position's largest |logit|. 16 u leaves room
# for other models and CPUs; a wrong tensor or factor is off by O(1), hundreds of u.
BF16_UNIT_ROUNDOFF = 2.0**-8
BF16_ROUNDOFFS = 16


def logit_tolerance(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., 1]: how far from our fp32 logits `reference` a correct export in `dtype` may be, per position."""
    if dtype == torch.float32:
        return torch.full_like(reference[..., :1], FP32_LOGIT_TOLERANCE)
    return BF16_ROUNDOFFS * BF16_UNIT_ROUNDOFF * reference.abs().amax(-1, keepdim=True)


def decided(reference: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """[...]: the positions whose argmax no change of the logits within `tolerance` can move: if each logit
    moves by at most tol, the top one stays on top unless it led the second by 2 tol or less."""
    top = reference.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1] > 2 * tolerance[..., 0]


def near_argmax(logits: torch.Tensor, chosen: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """[...]: whether each `chosen` token is within 2 `tolerance` of the top of `logits`: what a greedy step
    can pick from logits that differ from these by at most `tolerance` (their argmax g has
    logits[g] >= theirs[g] - tol >= theirs[top] - tol >= logits[top] - 2 tol)."""
    return logits.gather(-1, chosen[..., None])[..., 0] >= logits.amax(-1) - 2 * tolerance[..., 0]


def load_megatron_model(checkpoint: Checkpoint):
    """angpt's model of the checkpoint at TP = PP = 1 in fp32, in eval mode."""
    ensure_process_group()
    config = model_config(checkpoint)
    padded_vocab = checkpoint.tensors["embedding.word_embeddings.weight"].shape[0]
    model = build_model(config, padded_vocab, checkpoint.config.model.seq_length, parallel_output=False)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint.path)
    model.load_state_dict(loaded["model"], strict=True)
    return model.eval()


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, tokens, vocab_size] logits of our model (padding columns dropped)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)[..., :vocab_size].float()


@torch.no_grad()
def megatron_greedy(model, tokens: torch.Tensor, new_tokens: int, vocab_size: int,
                    eos_token_id: Optional[int] = None) -> torch.Tensor:
    """Greedy continuation of one sequence by our model, recomputing it whole each step (no cache), up to
    and including the end-of-document token, as `generate()` stops."""
    for _ in range(new_tokens):
        following = megatron_logits(model, tokens, vocab_size)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, following], dim=1)
        if following.item() == eos_token_id:
            break
    return tokens


@torch.no_grad()
def greedy_within_tolerance(model, tokens: torch.Tensor, prompt_length: int, vocab_size: int,
                            dtype: torch.dtype = torch.float32) -> bool:
    """Whether each token after `prompt_length` in `tokens` [1, n] (another model's greedy continuation) is
    a greedy choice of our model up to the tolerance of `dtype`, teacher-forced on the tokens before it.
    Identical sequences would also demand the same choice at near-ties, where rounding decides."""
    logits = megatron_logits(model, tokens[:, :-1], vocab_size)[:, prompt_length - 1:]
    return bool(near_argmax(logits, tokens[:, prompt_length:], logit_tolerance(logits, dtype)).all())


def load_exported(output: str, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True, dtype=dtype).eval()


def load_tokenizer(output: str):
    """The exported tokenizer, or None (mock data have none). Its config.json names our remote code."""
    if not os.path.isfile(os.path.join(output, "tokenizer.json")):
        return None
    return AutoTokenizer.from_pretrained(output, trust_remote_code=True)


def prompt(tokenizer, vocab_size: int) -> torch.Tensor:
    """The fixed prompt: PROMPT_TEXT through the exported tokenizer, or PROMPT_IDS without one."""
    if tokenizer is not None:
        return tokenizer(PROMPT_TEXT, return_tensors="pt").input_ids
    return torch.tensor([[i % vocab_size for i in PROMPT_IDS]])


@dataclass
class Verification:
    max_logit_difference: float
    cosine_similarity: float  # of the two models' logits, flattened
    same_argmax: bool  # at the decided positions of the prompt (see `decided`)
    decided_positions: int
    positions: int
    greedy_agrees: bool  # each exported greedy token is one of ours up to the tolerance (`near_argmax`)
    greedy_identical: bool  # the two continuations token for token (informative: rounding breaks near-ties)
    ours: list
    exported: list
    text: Optional[str]

    def passed(self, dtype: str) -> bool:
        """The acceptance of the tests: fp32 equal to FP32_LOGIT_TOLERANCE and a greedy continuation of
        ours; bf16 the same direction and the same argmax wherever its error cannot move it."""
        if dtype == "float32":
            return self.max_logit_difference < FP32_LOGIT_TOLERANCE and self.greedy_agrees
        return self.cosine_similarity > 0.999 and self.same_argmax


@torch.no_grad()
def verify(checkpoint: Checkpoint, output: str, new_tokens: int = 20) -> Verification:
    """Run the fixed prompt through our model and the exported one (in the exported dtype)."""
    with open(os.path.join(output, "config.json")) as file:
        dtype = DTYPES[json.load(file).get("dtype", "float32")]
    exported = load_exported(output, dtype)
    vocab_size = exported.config.vocab_size
    ours = load_megatron_model(checkpoint)
    tokenizer = load_tokenizer(output)
    tokens = prompt(tokenizer, vocab_size)
    theirs, reference = exported(tokens).logits.float(), megatron_logits(ours, tokens, vocab_size)
    cosine = torch.nn.functional.cosine_similarity(theirs.flatten(), reference.flatten(), dim=0).item()
    positions = decided(reference, logit_tolerance(reference, dtype))
    same_argmax = torch.equal(theirs.argmax(-1)[positions], reference.argmax(-1)[positions])
    expected = megatron_greedy(ours, tokens, new_tokens, vocab_size, exported.config.eos_token_id)
    generated = exported.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=new_tokens,
                                  do_sample=False)
    agrees = greedy_within_tolerance(ours, generated, tokens.shape[1], vocab_size, dtype)
    text = None if tokenizer is None else tokenizer.decode(generated[0])
    return Verification((theirs - reference).abs().max().item(), cosine, same_argmax, int(positions.sum()),
                        positions.numel(), agrees, torch.equal(generated, expected), expected[0].tolist(),
                        generated[0].tolist(), text)
