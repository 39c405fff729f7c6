"""Whether Transformer Engine (TE) can run here, and what to say when it cannot: one small module that the
command line (angpt.config.arguments, before anything is built) and the TE layer specs (angpt.models.te_specs)
share. It imports nothing heavy at the top, so that `--help` stays quick; TE is an optional dependency,
and torch and megatron-core are imported only by the FP8 check that needs them.
"""

from __future__ import annotations

import functools
from typing import Optional

FLAG = "--transformer-impl transformer_engine"


class TransformerEngineUnavailable(ImportError):
    """Transformer Engine was asked for and is not importable."""


@functools.cache
def transformer_engine_error() -> Optional[str]:
    """Why Transformer Engine's PyTorch package cannot be used here, or None when it can."""
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415 (optional: Transformer Engine)
    except Exception as error:  # ImportError, or an OSError of a missing CUDA / cuDNN library
        return f"{type(error).__name__}: {error}"
    return None


def unavailable_message(flag: str = FLAG, error: Optional[str] = None) -> str:
    error = error or transformer_engine_error()
    return (f"{flag} needs NVIDIA Transformer Engine, which is not importable here ({error}). Install it on "
            "a machine with CUDA and a CUDA build of torch (`pip install --no-build-isolation "
            "transformer-engine[pytorch]`, or `pip install -e '.[gpu]'`), or use the NGC PyTorch container "
            "of docker/Dockerfile, which has it; otherwise use --transformer-impl local (the default).")


def require_transformer_engine(flag: str = FLAG) -> None:
    """Raise TransformerEngineUnavailable, naming `flag` and what to install, unless TE is importable."""
    error = transformer_engine_error()
    if error is not None:
        raise TransformerEngineUnavailable(unavailable_message(flag, error))


# The Transformer Engine release from which megatron-core 0.16 builds each recipe (megatron.core.fp8_utils).
FP8_RECIPE_MIN_TE = {"delayed": None, "tensorwise": "2.2.0.dev0", "mxfp8": "2.1.0"}


def fp8_recipe_problem(recipe: str) -> Optional[str]:
    """Why the installed Transformer Engine or this GPU cannot run FP8 with `recipe`, or None. Checked at
    run time: FP8 GEMMs need compute capability 8.9 (Ada, Hopper) or newer, MXFP8 10.0 (Blackwell)."""
    import torch  # noqa: PLC0415 (not at the top, for a quick --help: see the module's docstring)

    error = transformer_engine_error()
    if error is not None:
        return unavailable_message(error=error)
    from megatron.core.utils import get_te_version, is_te_min_version  # noqa: PLC0415 (as torch, above)

    minimum = FP8_RECIPE_MIN_TE[recipe]
    if minimum and not is_te_min_version(minimum):
        return f"needs Transformer Engine >= {minimum} (installed: {get_te_version()})"
    if recipe == "mxfp8":
        import transformer_engine.common.recipe as te_recipe  # noqa: PLC0415 (optional: Transformer Engine)

        if not hasattr(te_recipe, "MXFP8BlockScaling"):
            return "the installed Transformer Engine has no MXFP8BlockScaling recipe"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        needed = (10, 0) if recipe == "mxfp8" else (8, 9)
        if (major, minor) < needed:
            what = "MXFP8 needs Blackwell" if recipe == "mxfp8" else "FP8 needs Ada, Hopper or newer"
            return (f"{what} (compute capability >= {needed[0]}.{needed[1]}); this GPU has compute capability "
                    f"{major}.{minor}")
    return None
