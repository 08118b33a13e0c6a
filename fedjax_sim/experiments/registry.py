"""Presets: a name, an experiment and default settings (a plain dict registry)."""

from __future__ import annotations

from fedjax_sim.experiments import (
    async_digits,
    dp_cohorts,
    drfa_molecules,
    fednova_quadratic,
    hetero,
    ifca_femnist,
    ifca_images,
    ifca_success,
    ifca_synthetic,
    ifca_theory,
    mixed,
    pfl_cifar10,
)
from fedjax_sim.experiments.base import Preset
from fedjax_sim.experiments.manifest import find_preset, wrong_command

# Every experiment module declares its own presets (a module-level PRESETS list).
_EXPERIMENT_MODULES = (
    ifca_synthetic,
    ifca_success,
    ifca_theory,
    ifca_images,
    ifca_femnist,
    drfa_molecules,
    mixed,
    hetero,
    dp_cohorts,
    fednova_quadratic,
    pfl_cifar10,
    async_digits,
)


_PRESETS: list[Preset] = []
for _module in _EXPERIMENT_MODULES:
    _PRESETS += _module.PRESETS
if len({p.name for p in _PRESETS}) != len(_PRESETS):
    raise RuntimeError("two presets share a name")
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def get_preset(name: str, command: str | None = None) -> Preset:
    """The preset `name`, for `command` when given.

    Raises:
      ValueError: an unknown name (with the closest names, listing the presets that
        support `command`), or a preset that does not support `command` (naming the
        preset and the commands to use instead: `manifest.wrong_command`).
    """
    return find_preset(PRESETS, name, command)


__all__ = ["PRESETS", "Preset", "get_preset", "wrong_command"]
