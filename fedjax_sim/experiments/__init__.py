"""Experiments: presets (a plain dict registry) and the runner that writes their directories.

The names below are imported on first use (PEP 562): the command line checks a preset's
settings against `experiments.manifest` (no JAX) before it imports the experiments.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    **dict.fromkeys(("PRESETS", "Preset", "get_preset"), "fedjax_sim.experiments.registry"),
    **dict.fromkeys(("OutputError", "compare_preset", "describe_preset", "resolve_settings",
                     "run_preset", "run_summary", "sweep_preset"),
                    "fedjax_sim.experiments.runner"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedjax_sim.experiments' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:
    from fedjax_sim.experiments.registry import PRESETS, Preset, get_preset  # noqa: F401
    from fedjax_sim.experiments.runner import (  # noqa: F401
        OutputError,
        compare_preset,
        describe_preset,
        resolve_settings,
        run_preset,
        run_summary,
        sweep_preset,
    )

__all__ = [
    "PRESETS",
    "OutputError",
    "Preset",
    "compare_preset",
    "describe_preset",
    "get_preset",
    "resolve_settings",
    "run_preset",
    "run_summary",
    "sweep_preset",
]
