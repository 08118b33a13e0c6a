"""Every preset's commands and settings as plain data, for checks that need no JAX.

The `fedjax-sim` command checks a preset's name and its `--set` values here before it
imports JAX or builds an experiment, so a mistyped preset or setting is refused in a
fraction of a second, with the same one-line message the full check (`runner.
resolve_settings`) gives. The data (`_manifest.py`) is generated from the registry:

    python docs/generate.py            # rewrites it with the generated docs
    python docs/generate.py --check    # fails while it differs from the registry

It holds what `settings.resolve` reads of each setting (type, default, range, choices,
the values refused with a reason, aliases) and each preset's commands and overrides; the
checks across settings (`Experiment.validate`) need the experiment and run after.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from fedjax_sim.experiments.settings import Setting, did_you_mean, parse_assignments, resolve

TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# The fields of a Setting that `settings.resolve` reads, in the order they are written.
FIELDS = ("name", "type", "default", "minimum", "maximum", "choices", "listable", "refused",
          "aliases")


@dataclass(frozen=True)
class Declared:
    """A preset as data: what `find_preset` and `check` need of a `registry.Preset`."""

    name: str
    commands: tuple[str, ...]
    settings: dict[str, Setting]
    overrides: dict

    @property
    def defaults(self) -> dict:
        return {**{k: s.default for k, s in self.settings.items()}, **self.overrides}


def load() -> dict[str, Declared]:
    """The presets of `_manifest.py`, by name."""
    from fedjax_sim.experiments import _manifest

    tables = {key: {row[0]: Setting(**{**dict(zip(FIELDS, row, strict=True)),
                                       "type": TYPES[row[1]], "help": ""})
                    for row in rows}
              for key, rows in _manifest.SETTINGS.items()}
    return {name: Declared(name, tuple(commands), tables[key], dict(overrides))
            for name, (key, commands, overrides) in _manifest.PRESETS.items()}


def find_preset(presets: Mapping, name: str, command: str | None = None):
    """The preset `name` of `presets` (a `registry.Preset` or a `Declared`), for `command`
    when given.

    Raises:
      ValueError: an unknown name (with the closest names, and the presets that support
        `command`), or a preset that does not support `command` (`wrong_command`).
    """
    preset = presets.get(name)
    if preset is None:
        names = sorted(p.name for p in presets.values()
                       if command is None or command in p.commands)
        what = f"preset for {command}" if command else "preset"
        raise ValueError(f"unknown {what} {name!r}{did_you_mean(name, names)}; known: "
                         f"{', '.join(names)}.")
    if command is not None and command not in preset.commands:
        raise ValueError(wrong_command(preset, command))
    return preset


# What `run` trains of a preset whose main command is another one.
_ONE_RUN = {"sweep": "one cell (--set each grid axis to one value)", "compare": "one method"}


def wrong_command(preset, command: str) -> str:
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


def check(command: str, name: str, overrides: list[str]) -> None:
    """Raises the ValueError that `runner.resolve_settings` would raise first for this
    preset and these `--set` items, where the declarations alone decide it (an unknown
    preset or setting, a value of the wrong type or out of range); returns quietly
    otherwise (the full check follows). A preset that a program registered itself (in
    the imported registry, not in the generated manifest) is left to the full check."""
    declared = load()
    registry = sys.modules.get("fedjax_sim.experiments.registry")
    if name not in declared and registry is not None and name in registry.PRESETS:
        return
    parsed = parse_assignments(overrides)
    preset = find_preset(declared, name, command)
    resolve(preset.settings, preset.defaults, parsed, lists=command == "sweep", notes=False)


# ----------------------------------------------------------------------------- generation


def _row(setting: Setting) -> tuple:
    values = {f: getattr(setting, f) for f in FIELDS}
    values["type"] = setting.type.__name__
    for f in ("refused", "aliases"):
        values[f] = dict(values[f]) if values[f] else None
    return tuple(values[f] for f in FIELDS)


def render() -> str:
    """The text of `_manifest.py` from the live registry (imports every experiment)."""
    from fedjax_sim.experiments.registry import PRESETS

    tables: dict[str, list] = {}
    presets = {}
    for name, preset in PRESETS.items():
        rows = [_row(s) for s in preset.experiment.declared.values()]
        key = preset.experiment.name
        if tables.setdefault(key, rows) != rows:  # another instance, declared otherwise
            key = f"{key}@{name}"
            tables[key] = rows
        presets[name] = (key, preset.commands, dict(preset.overrides))
    lines = ['"""Generated by docs/generate.py from the preset registry (`manifest.render`): do '
             'not edit by hand."""', "", "# ruff: noqa: E501", "", "SETTINGS = {"]
    for key, rows in tables.items():
        lines += [f"    {key!r}: [", *(f"        {row!r}," for row in rows), "    ],"]
    lines += ["}", "", "PRESETS = {", *(f"    {name!r}: {entry!r}," for name, entry in
                                         presets.items()), "}", ""]
    return "\n".join(lines)
