"""Normalization factors (docs/model.md, Normalization factors) and the tool that prints them."""

import json
import math
import subprocess
import sys

import pytest
import torch

from angpt.models.factors import (
    NU_PLAIN_RESIDUAL,
    NormalizationFactors,
    derive_factors,
    nu_acf_monte_carlo,
    nu_alpha,
)

from conftest import ROOT

# docs/model.md, Model shapes: (d, layers, heads), head dim 64, f = 4d.
SHAPES = {"0.5B": (1024, 24, 16), "1B": (1280, 36, 20)}


@pytest.mark.parametrize("name", list(SHAPES))
def test_factor_values_of_the_paper_shapes(name):
    d, _, heads = SHAPES[name]
    # 5k samples estimate nu_acf to about 0.1%, well inside the 1% checked here.
    factors = derive_factors(d, 4 * d, heads, nu_acf_samples=5_000)
    assert factors.nu_qkv == pytest.approx(math.sqrt(d / 64))  # 4.0 and 4.472
    assert factors.nu_p == 1.0
    assert factors.nu_uz == pytest.approx(0.5)
    assert factors.nu_d == pytest.approx(2.0)
    assert factors.nu_acf == pytest.approx(3.72, rel=0.01)
    sqrt_h_over_d = derive_factors(d, 4 * d, heads, nu_p_reading="sqrt_h_over_d", nu_acf_samples=5_000)
    assert sqrt_h_over_d.nu_p == pytest.approx(math.sqrt(64 / d))


@pytest.fixture(autouse=True)
def no_cached_nu_acf(tmp_path, monkeypatch):
    """Every estimate computed afresh: a value cached on this machine by an earlier (or buggy) version must
    not stand in for the computation under test."""
    monkeypatch.setenv("ANGPT_CACHE_DIR", str(tmp_path))
    nu_acf_monte_carlo.cache_clear()
    yield
    nu_acf_monte_carlo.cache_clear()


@pytest.mark.slow
def test_nu_acf_matches_its_scalar_form():
    # 1/sqrt(E[SiLU(x)^2]) with x ~ N(0, 1/4), by quadrature: the large-f limit of the estimate. It is
    # 3.7204 (docs/model.md, Normalization factors); by Jensen's inequality the estimate at finite f lies above it.
    x = torch.linspace(-3, 3, 200_001, dtype=torch.float64)
    density = torch.exp(-2 * x**2) / math.sqrt(2 * math.pi * 0.25)
    scalar = 1 / math.sqrt(torch.trapezoid(torch.nn.functional.silu(x) ** 2 * density, x).item())
    assert scalar == pytest.approx(3.7204, abs=1e-4)
    assert scalar < nu_acf_monte_carlo(256, 1024) < scalar * 1.002


def test_nu_acf_is_a_deterministic_function_of_its_seed(tmp_path):
    shape = dict(hidden_size=64, ffn_hidden_size=256, samples=20_000)
    first = nu_acf_monte_carlo(**shape, seed=3)
    nu_acf_monte_carlo.cache_clear()
    (tmp_path / "nu_acf.json").unlink()
    assert nu_acf_monte_carlo(**shape, seed=3) == first  # recomputed, not read back
    other = nu_acf_monte_carlo(**shape, seed=4)
    # Another seed draws other samples: a different estimate of the same value, within Monte Carlo error
    # (||u * SiLU(z')|| varies by about 10% at f = 256, so 20k samples give about 0.1%).
    assert other != first and other == pytest.approx(first, rel=0.01)


def test_nu_acf_is_cached_on_disk_per_shape_and_seed(tmp_path):
    value = nu_acf_monte_carlo(64, 256, 2_000, 5)
    table = json.loads((tmp_path / "nu_acf.json").read_text())
    assert table == {"d=64,f=256,samples=2000,seed=5": value}
    # Another process (the lru cache cleared) reads the value back instead of recomputing it.
    table["d=64,f=256,samples=2000,seed=5"] = 1.5
    (tmp_path / "nu_acf.json").write_text(json.dumps(table))
    nu_acf_monte_carlo.cache_clear()
    assert nu_acf_monte_carlo(64, 256, 2_000, 5) == 1.5


def test_nu_alpha_keeps_the_lerp_of_independent_unit_vectors_at_unit_norm():
    generator = torch.Generator().manual_seed(0)
    d = 4096
    h, x = torch.randn(2, 256, d, generator=generator)
    h, x = h / h.norm(dim=-1, keepdim=True), x / x.norm(dim=-1, keepdim=True)
    for alpha in (0.01, 0.2, 0.5, 0.9):
        a = torch.full((d,), alpha)
        out = nu_alpha(a) * (h + a * (x - h))
        assert out.norm(dim=-1).mean().item() == pytest.approx(1.0, abs=0.01)
        assert (h + a * (x - h)).norm(dim=-1).mean().item() != pytest.approx(1.0, abs=0.01) or alpha == 0.01
    assert (NU_PLAIN_RESIDUAL * (h + x)).norm(dim=-1).mean().item() == pytest.approx(1.0, abs=0.01)


@pytest.mark.slow
def test_factor_tool_prints_the_table():
    done = subprocess.run(
        [sys.executable, "tools/angpt_factors.py", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
         "--num-attention-heads", "16", "--kv-channels", "64", "--nu-acf-samples", "5000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = dict(line.split()[:2] for line in done.stdout.splitlines() if line.startswith("nu_"))
    assert float(rows["nu_qkv"]) == pytest.approx(4.0)
    assert float(rows["nu_uz"]) == pytest.approx(0.5)
    assert float(rows["nu_d"]) == pytest.approx(2.0)
    assert float(rows["nu_p"]) == pytest.approx(1.0)
    assert float(rows["nu_acf"]) == pytest.approx(3.72, rel=0.01)


def test_the_cache_follows_the_xdg_cache_home_else_home(tmp_path, monkeypatch):
    # docs/model.md: $ANGPT_CACHE_DIR/nu_acf.json, else ~/.cache/angpt/; the XDG base directory spec puts
    # ~/.cache at $XDG_CACHE_HOME when that is set.
    monkeypatch.delenv("ANGPT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    value = nu_acf_monte_carlo(8, 32, 100, 0)
    assert json.loads((tmp_path / "home" / ".cache" / "angpt" / "nu_acf.json").read_text()) == {
        "d=8,f=32,samples=100,seed=0": value}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    nu_acf_monte_carlo(8, 32, 100, 1)
    assert list(json.loads((tmp_path / "xdg" / "angpt" / "nu_acf.json").read_text())) == [
        "d=8,f=32,samples=100,seed=1"]


def test_the_cache_directory_is_created_with_its_parents(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGPT_CACHE_DIR", str(tmp_path / "not" / "yet"))
    value = nu_acf_monte_carlo(8, 32, 100, 0)
    assert json.loads((tmp_path / "not" / "yet" / "nu_acf.json").read_text()) == {"d=8,f=32,samples=100,seed=0": value}


def test_derive_factors_reads_the_estimate_of_its_samples_and_seed(tmp_path):
    # docs/model.md: nu_acf_samples and nu_acf_seed default to 100000 and 0. Values planted in the cache
    # (no estimate is near them) show which estimate derive_factors asked for, without computing one.
    (tmp_path / "nu_acf.json").write_text(json.dumps({"d=64,f=256,samples=100000,seed=0": 1.25,
                                                      "d=64,f=256,samples=1000,seed=7": 2.5}))
    assert derive_factors(64, 256, 4).nu_acf == 1.25
    assert derive_factors(64, 256, 4, nu_acf_samples=1000, nu_acf_seed=7).nu_acf == 2.5


def test_an_unknown_nu_p_reading_is_refused_by_name():
    with pytest.raises(ValueError, match="'two'") as refused:
        derive_factors(64, 256, 4, nu_p_reading="two")
    assert "sqrt_h_over_d" in str(refused.value)


def test_the_factors_as_a_dict_and_scaled_keep_the_names_of_docs_model_md():
    factors = NormalizationFactors(nu_qkv=1.0, nu_p=2.0, nu_uz=3.0, nu_acf=4.0, nu_d=5.0)
    names = {"nu_qkv": 1.0, "nu_p": 2.0, "nu_uz": 3.0, "nu_acf": 4.0, "nu_d": 5.0}
    assert factors.as_dict() == names
    assert list(factors.as_dict()) == list(names)  # the table's order (tools/angpt_factors.py prints it)
    assert factors.scaled(-0.5) == NormalizationFactors(-0.5, -1.0, -1.5, -2.0, -2.5)
