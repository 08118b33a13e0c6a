"""Presets: a name, an experiment and default settings (a plain dict registry)."""

from __future__ import annotations

from fedjax_sim.experiments import (
    drfa_molecules,
    hetero,
    ifca_images,
    ifca_success,
    ifca_synthetic,
    mixed,
)
from fedjax_sim.experiments.base import Preset

# Every experiment module declares its own presets (a module-level PRESETS list).
_EXPERIMENT_MODULES = (
    ifca_synthetic,
    ifca_success,
    ifca_images,
    drfa_molecules,
    mixed,
    hetero,
)


_PRESETS: list[Preset] = []
for _module in _EXPERIMENT_MODULES:
    _PRESETS += _module.PRESETS
if len({p.name for p in _PRESETS}) != len(_PRESETS):
    raise RuntimeError("two presets share a name")
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def get_preset(name: str, command: str | None = None) -> Preset:
    """The preset `name`; ValueError listing the presets (that support `command`) otherwise."""
    preset = PRESETS.get(name)
    if preset is None or (command is not None and command not in preset.commands):
        names = sorted(p.name for p in PRESETS.values()
                       if command is None or command in p.commands)
        what = f"preset for {command}" if command else "preset"
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(names)}.")
    return preset
