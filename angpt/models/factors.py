"""The normalization factors nu of anGPT (docs/model.md, Normalization factors), each derived in one place.

For a map g applied to a unit-norm input, nu_g = 1 / sqrt(E||g(x)||^2): a linear map with unit rows has
E||Wx||^2 = out/in, hence nu = sqrt(in/out). The activation factor nu_acf = 1 / E||u * SiLU(z')|| has no
closed form and is estimated by a seeded Monte Carlo run, cached per shape.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from angpt.config.choices import NU_P_READINGS


def linear_map_factor(in_features: int, out_features: int) -> float:
    """nu for a linear map with unit-norm rows applied to a unit-norm input: sqrt(in/out)."""
    return math.sqrt(in_features / out_features)


def nu_alpha(alpha: torch.Tensor) -> torch.Tensor:
    """nu(alpha) = 1/sqrt((1-alpha)^2 + alpha^2), from E||(1-a)h + a x||^2 for independent unit h, x."""
    return torch.rsqrt((1 - alpha) ** 2 + alpha**2)


# The plain residual h + x (an ablation, docs/model.md, Ablations): E||h + x||^2 = 2.
NU_PLAIN_RESIDUAL = 1 / math.sqrt(2)


def _cache_path() -> Path:
    root = os.environ.get("ANGPT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "angpt"
    )
    return Path(root) / "nu_acf.json"


@functools.lru_cache(maxsize=None)
def nu_acf_monte_carlo(hidden_size: int, ffn_hidden_size: int, samples: int = 100_000, seed: int = 0) -> float:
    """1 / E||u * SiLU(sqrt(d) z)|| for u, z uniform on the unit sphere of R^f (docs/model.md, Normalization factors).

    Deterministic for a given (d, f, samples, seed), so every rank computes the same value. The estimate
    takes seconds to minutes for large f, so it is also cached on disk (ANGPT_CACHE_DIR, else
    ~/.cache/angpt) and computed once per machine."""
    key = f"d={hidden_size},f={ffn_hidden_size},samples={samples},seed={seed}"
    path = _cache_path()
    try:
        return float(json.loads(path.read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    generator = torch.Generator().manual_seed(seed)
    # Chunks of about 2^24 numbers keep memory flat for large f.
    chunk = max(1, min(samples, (1 << 24) // ffn_hidden_size))
    total_norm, done = 0.0, 0
    while done < samples:
        n = min(chunk, samples - done)
        # On the CPU explicitly: models are also built under `torch.device("meta")` (the dry run).
        u = torch.randn(n, ffn_hidden_size, generator=generator, device="cpu")
        z = torch.randn(n, ffn_hidden_size, generator=generator, device="cpu")
        u = u / u.norm(dim=1, keepdim=True)
        z = math.sqrt(hidden_size) * z / z.norm(dim=1, keepdim=True)
        total_norm += (u * torch.nn.functional.silu(z)).norm(dim=1).double().sum().item()
        done += n
    value = samples / total_norm
    _store_in_cache(path, key, value)
    return value


def _store_in_cache(path: Path, key: str, value: float) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[key] = value
        # Several ranks may write at once: each writes a whole file and renames it into place.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # A read-only home only costs the recomputation.


@dataclass(frozen=True)
class NormalizationFactors:
    """The constant factors of one anGPT shape, named as in the table of docs/model.md, Normalization factors."""

    nu_qkv: float
    nu_p: float
    nu_uz: float
    nu_acf: float
    nu_d: float

    def scaled(self, multiplier: float) -> "NormalizationFactors":
        return NormalizationFactors(*(multiplier * value for value in self.as_dict().values()))

    def as_dict(self) -> dict[str, float]:
        return dict(nu_qkv=self.nu_qkv, nu_p=self.nu_p, nu_uz=self.nu_uz, nu_acf=self.nu_acf, nu_d=self.nu_d)


def derive_factors(
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    kv_channels: int | None = None,
    nu_p_reading: str = "one",
    nu_acf_samples: int = 100_000,
    nu_acf_seed: int = 0,
) -> NormalizationFactors:
    """Every constant factor (docs/model.md, Normalization factors) for one shape (d, f, H, h)."""
    d, f = hidden_size, ffn_hidden_size
    h = kv_channels or hidden_size // num_attention_heads
    if nu_p_reading == "one":
        # W_p is d x d: E||W_p o||^2 = ||o||^2 = 1 if o is read as one unit vector.
        nu_p = linear_map_factor(d, d)
    elif nu_p_reading == "sqrt_h_over_d":
        # o read as the concatenation of H = d/h unit-norm head outputs, so ||o||^2 = d/h.
        nu_p = math.sqrt(h / d)
    else:
        raise ValueError(f"nu_p reading must be one of {NU_P_READINGS}, got {nu_p_reading!r}")
    return NormalizationFactors(
        nu_qkv=linear_map_factor(d, h),
        nu_p=nu_p,
        nu_uz=linear_map_factor(d, f),
        nu_acf=nu_acf_monte_carlo(d, f, nu_acf_samples, nu_acf_seed),
        nu_d=linear_map_factor(f, d),
    )
