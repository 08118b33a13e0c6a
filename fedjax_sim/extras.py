"""Optional dependencies, installed as the package's extras.

A plain `pip install fedjax_sim` brings JAX, flax, optax, orbax and the small
scientific stack. What only some presets or options need is an extra:

| extra | installs | needed by |
|---|---|---|
| `molecules` | rdkit | the `drflm-*` presets (SMILES → graphs, scaffold clients) |
| `tfds` | tensorflow-datasets | reading a tensorflow-datasets build from a `data_dir` |
| `tensorboard` | tensorboardX | `--tensorboard` |
| `privacy` | dp-accounting | `fedjax_sim.accounting` (ε of a DP run, noise calibration) |
| `all` | all of the above | |

`require` is called where a preset's settings are checked, so a run that needs
a missing extra stops before it writes anything (the CLI's exit 2), naming the
`pip install` line: the extra's own requirements, which install beside fedjax_sim
however it was installed (a checkout, a wheel), and the extra's name for a
checkout (`pip install -e '.[EXTRA]'`).
"""

from __future__ import annotations

#: extra -> the modules it provides (what `require` accepts).
EXTRAS = {
    "molecules": ("rdkit",),
    "tfds": ("tensorflow_datasets",),
    "tensorboard": ("tensorboardX",),
    "privacy": ("dp_accounting",),
}


def require(module: str, extra: str, what: str = "this") -> None:
    """Checks that `module` (from extra `extra`) can be imported.

    Args:
      module: the top-level module, e.g. "rdkit".
      extra: the extra that installs it, e.g. "molecules" (a key of `EXTRAS`).
      what: what needs it, for the message (e.g. "dataset=esol").

    Raises:
      ValueError: the module cannot be imported; the message names the
        `pip install` line of the extra's requirements.
    """
    if module not in EXTRAS.get(extra, ()):
        raise ValueError(f"extra {extra!r} does not provide module {module!r}; extras: "
                         + ", ".join(f"{e} ({', '.join(m)})" for e, m in EXTRAS.items()))
    try:
        __import__(module)  # the builtin, so a test can make it fail with monkeypatch
    except ImportError as err:
        line = " ".join(f"'{r}'" for r in requirements(extra)) or module
        raise ValueError(
            f"{what} needs {module}, which is not installed ({err}): pip install {line} "
            f"(the extra {extra!r}; in a checkout: pip install -e '.[{extra}]')") from None


def requirements(extra: str) -> list[str]:
    """The requirements that `extra` adds, read from the installed package's metadata
    (e.g. ["rdkit>=2026.9.1"] for "molecules"); [] when the metadata is unavailable.

    >>> requirements("tensorboard")
    ['tensorboardX>=2.6.5']
    """
    from importlib import metadata

    try:
        declared = metadata.requires("fedjax_sim") or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for line in declared:
        spec, _, marker = line.partition(";")
        spec = spec.strip()
        if (f'extra == "{extra}"' in marker.replace("'", '"')
                and not spec.startswith("fedjax_sim")):
            found.append(spec.replace(" ", ""))
    return found
