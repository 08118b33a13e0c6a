"""Presets: a name, an experiment and default settings (a plain dict registry)."""

from __future__ import annotations

from fedjax_sim.experiments import (
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
    fednova_quadratic,
    pfl_cifar10,
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
      ValueError: an unknown name (listing the presets that support `command`), or a
        preset that does not support `command` (`wrong_command`: naming the preset
        and the commands to use instead).
    """
    preset = PRESETS.get(name)
    if preset is None:
        names = sorted(p.name for p in PRESETS.values()
                       if command is None or command in p.commands)
        what = f"preset for {command}" if command else "preset"
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(names)}.")
    if command is not None and command not in preset.commands:
        raise ValueError(wrong_command(preset, command))
    return preset


# What `run` trains of a preset whose main command is another one.
_ONE_RUN = {"sweep": "one cell (--set each grid axis to one value)", "compare": "one method"}


def wrong_command(preset: Preset, command: str) -> str:
    """Why `command` refuses `preset`, and the commands that take it: the user asked for a
    preset that exists, so the answer names it and what to type instead (a sweep-only
    preset given to `compare`, a comparison preset given to `sweep`)."""
    commands = preset.commands
    main = [c for c in ("sweep", "compare") if c in commands]
    kind = {("sweep",): "a sweep preset", ("compare",): "a comparison preset"}.get(
        tuple(main), "a preset")
    uses = [f"`fedjax-sim {c} {preset.name}`" for c in main]
    if "run" in commands:
        run = f"`fedjax-sim run {preset.name}`"
        uses.append(f"{run} for {_ONE_RUN[main[0]]}" if len(main) == 1 else run)
    return (f"preset {preset.name} is {kind} (commands: {', '.join(commands)}); it has no "
            f"{command}: use {' or '.join(uses)}.")
