"""Experiments: presets (a plain dict registry) and the runner that writes their directories."""

from fedjax_sim.experiments.registry import PRESETS, Preset, get_preset
from fedjax_sim.experiments.runner import (
    OutputError,
    compare_preset,
    describe_preset,
    resolve_settings,
    run_preset,
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
    "sweep_preset",
]
