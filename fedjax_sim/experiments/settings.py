"""Settings of an experiment: declarations, `--set KEY=VALUE` parsing, and checks.

An experiment declares each setting once (`Setting`: name, type, default,
allowed range or choices, one-line help, whether it is traced and whether it
changes results); `resolve` applies a preset's defaults and the user's
overrides and checks every value against its declaration before anything is
traced or written.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**32 - 1
# Sizes past this are refused before anything is built: no run here needs more,
# and a mistyped 1e12 would otherwise abort, hang or exhaust memory.
MAX_COUNT = 10**7


@dataclass(frozen=True)
class Setting:
    """One setting of an experiment.

    Attributes:
      name: the key in `--set KEY=VALUE` and config.json.
      type: int, float, str or bool.
      default: the experiment's default (a preset may override it).
      help: one line for `fedjax-sim describe`.
      minimum, maximum: inclusive bounds for numbers (None: unbounded).
      choices: the allowed values of a str setting.
      traced: vmapped inside one compiled sweep cell where shapes allow
        (learning rates, R, σ, …) rather than compiled per value.
      result: whether the value changes a result. Settings that only change
        how a result is computed (memory budget, checkpoint interval) are
        left out of sweep trial keys and resume checks.
      listable: accepts a comma list in a run (e.g. a sweep's lr grid). A listable
        setting declared with the default [] (none, e.g. a tune_* grid) may stay
        empty, and `--set NAME=none` empties it.
      commands: the commands that read it (None: every command). A value
        other than the preset's default given to a command that would ignore
        it is refused, naming the setting.
      methods: the compared methods that read it (None: every method). A value
        other than the preset's default given to a `run` of another method, or
        to a comparison that trains none of them, is refused, naming the
        setting, its readers and the methods trained.
      when: (another setting, the values under which this one is read), e.g.
        ("dataset", ("synthetic",)); a value other than the preset's default
        given when the other setting has none of them is refused, naming both.
      refused: values outside `choices` that are known and refused for a reason
        (a method that does not fit the experiment): value -> the one-line message
        that says why, used in place of "must be one of".
      aliases: other names of allowed values (an older name of a method): alias ->
        the value it stands for; a value given by its alias is read as that value,
        with a one-line note on stderr.
    """

    name: str
    type: type
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    traced: bool = False
    result: bool = True
    listable: bool = False
    commands: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None
    when: tuple[str, tuple] | None = None
    refused: Mapping[str, str] | None = None
    aliases: Mapping[str, str] | None = None

    def describe_range(self) -> str:
        if self.choices is not None:
            return " | ".join(str(c) for c in self.choices)
        if self.type is bool:
            return "true | false"
        if self.minimum is None and self.maximum is None:
            return "any"
        low = "-inf" if self.minimum is None else f"{self.minimum:g}"
        high = "inf" if self.maximum is None else f"{self.maximum:g}"
        return f"[{low}, {high}]"

    def canonical(self, value, note: bool = True):
        """`value` (or each value of a list) with an alias replaced by the value it stands
        for, saying so on stderr; an alias of a value that is not among the choices is
        left as given (and refused by `check` under the name the user gave)."""
        if not self.aliases:
            return value
        values = value if isinstance(value, list) else [value]
        out = []
        for v in values:
            new = self.aliases.get(v) if isinstance(v, str) else None
            if new is not None and (self.choices is None or new in self.choices):
                if note:
                        print(f"fedjax-sim: note: {v} is called {new}; setting {self.name} reads "
                          f"{new}.", file=sys.stderr)
                v = new
            out.append(v)
        return out if isinstance(value, list) else out[0]

    def check(self, value) -> None:
        """Raises ValueError naming the setting unless `value` is allowed."""
        name = f"setting {self.name}"
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false; got {value!r}.")
            return
        if self.type is str:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be text; got {value!r}.")
            if self.choices is not None and value not in self.choices:
                if self.refused and value in self.refused:
                    raise ValueError(self.refused[value])
                raise ValueError(
                    f"{name} must be one of {', '.join(map(str, self.choices))}; got {value!r}"
                    f"{did_you_mean(value, self.choices)}.")
            return
        if self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            what = "an integer"
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
                value)
            what = "a finite number"
        low, high = self.minimum, self.maximum
        if ok and ((low is not None and value < low) or (high is not None and value > high)):
            ok = False
        if not ok:
            if low is not None and high is not None:
                bounds = f" in [{low:g}, {high:g}]"
            elif low is not None:
                bounds = f" >= {low:g}"
            elif high is not None:
                bounds = f" <= {high:g}"
            else:
                bounds = ""
            raise ValueError(f"{name} must be {what}{bounds}; got {value!r}.")


def did_you_mean(given, known) -> str:
    """" (did you mean X?)" when `given` is close to one of `known` (difflib), else ""."""
    close = difflib.get_close_matches(str(given), [str(k) for k in known], n=3, cutoff=0.6)
    if not close:
        return ""
    names = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f" (did you mean {names}?)"


def count(name: str, default: int, help: str, minimum: int = 1, maximum: int = MAX_COUNT,
          **kw) -> Setting:
    """An integer size setting, bounded so a typo cannot abort or exhaust the machine."""
    return Setting(name, int, default, help, minimum=minimum, maximum=maximum, **kw)


# The settings every experiment shares, declared here once; an experiment gives its own
# default and, where it says more about its protocol, its own help line.


def lr_setting(default: float, help: str = "client learning rate", **kw) -> Setting:
    """The clients' learning rate (`lr`): a float >= 0."""
    return Setting("lr", float, default, help, minimum=0.0, **kw)


def rounds_setting(default: int, help: str = "communication rounds", **kw) -> Setting:
    return count("rounds", default, help, **kw)


def seeds_setting(default: int, help: str = "seeds compared side by side (one vmapped axis)",
                  maximum: int = 10_000, **kw) -> Setting:
    """How many seeds a comparison (or each sweep cell) runs as one vmapped axis."""
    return count("seeds", default, help, maximum=maximum, **kw)


def local_steps_setting(default: int, help: str = "local steps τ per round",
                        maximum: int = 10**5, **kw) -> Setting:
    return count("local_steps", default, help, maximum=maximum, **kw)


def eval_every_setting(default: int, help: str = "evaluate every this many rounds",
                       **kw) -> Setting:
    return count("eval_every", default, help, **kw)


def participation_setting(default: float = 1.0, help: str = "fraction of clients per round",
                          minimum: float = 1e-9, **kw) -> Setting:
    return Setting("participation", float, default, help, minimum=minimum, maximum=1.0, **kw)


def batch_size_setting(default: int = 0, help: str = "local minibatch size; 0: full batch",
                       minimum: int = 0, **kw) -> Setting:
    return count("batch_size", default, help, minimum=minimum, maximum=10**6, **kw)


def sampling_setting(default: str = "with_replacement", help: str | None = None,
                     **kw) -> Setting:
    """How local minibatches are drawn (`algorithms.SAMPLINGS`)."""
    return Setting("sampling", str, default, help or (
        "local minibatches: with_replacement (each step draws its own) or epochs (every row "
        "once per epoch, a fresh permutation each)"), choices=("with_replacement", "epochs"),
        **kw)


def checkpoint_setting(default: int = 50) -> Setting:
    """Rounds between checkpoints (a run's, or each method's of a comparison)."""
    return count("checkpoint_every", default, "rounds between checkpoints (each method's, in a "
                 "comparison); 0: none", minimum=0, result=False)


def method_setting(methods: tuple[str, ...], default: str) -> Setting:
    """The method a `run` of a comparison preset trains."""
    return Setting("method", str, default, "the method `run` trains (compare trains them all)",
                   choices=tuple(methods), commands=("run",))


def seed_setting(default: int = 0) -> Setting:
    return Setting("seed", int, default, "base PRNG seed: the same seed gives the same numbers",
                   minimum=0, maximum=MAX_SEED)


def unseen_clients_setting(clients: str = "clients") -> Setting:
    """The share of the `clients` held out of training (`experiments.unseen`)."""
    return Setting("unseen_clients", float, 0.0, f"share of the {clients} held out of "
                   "training (rounded, at least 1 when > 0; drawn per seed, the same for every "
                   "method) and scored as unseen clients beside the seen ones; 0: none",
                   minimum=0.0, maximum=0.9)


def adapt_steps_setting(help: str = "local steps that fine-tune (fedavg_ft: every client) or "
                        "adapt (personal methods: an unseen client) the global model before "
                        "a test; 0: local_steps") -> Setting:
    """The local steps of an evaluation's fine-tuning or adaptation (`experiments.unseen`)."""
    return count("adapt_steps", 0, help, minimum=0, maximum=10**5)


def parse_assignments(items: list[str] | None) -> dict[str, str]:
    """["k=4", "R=0.1,0.2"] -> {"k": "4", "R": "0.1,0.2"}; a key given twice is refused."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE; got {item!r}.")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"--set expects KEY=VALUE; got {item!r}.")
        if key in out:
            raise ValueError(
                f"setting {key} is given twice ({out[key]!r} and {value.strip()!r}); give it once."
            )
        out[key] = value.strip()
    return out


def _convert(key: str, text: str, kind: type):
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if kind is int:
            value = float(text)
            if not math.isfinite(value) or value != int(value):
                raise ValueError
            return int(value)
        if kind is float:
            return float(text)
        return text
    except (ValueError, OverflowError):
        raise ValueError(f"setting {key}: cannot read {text!r} as {kind.__name__}.") from None


def _parse_value(key: str, raw, kind: type, allow_list: bool):
    """One override (CLI text or a Python value) -> a value or, where allowed, a list."""
    if isinstance(raw, (list, tuple)):
        parts = [str(v) for v in raw]
        if not parts:
            raise ValueError(f"setting {key}: empty list.")
    else:
        text = str(raw)
        parts = text.split(",") if "," in text else [text]
    if any(not p.strip() for p in parts):
        raise ValueError(f"setting {key}: empty value in {','.join(parts)!r}.")
    if len(parts) > 1 and not allow_list:
        raise ValueError(f"setting {key} takes one value here; got the list {','.join(parts)!r}.")
    values = [_convert(key, p.strip(), kind) for p in parts]
    return values if len(values) > 1 or isinstance(raw, (list, tuple)) else values[0]


def resolve(declared: dict[str, Setting], defaults: dict, overrides: dict, *,
            lists: bool = False, notes: bool = True) -> dict:
    """defaults with overrides applied; every value checked against its declaration.

    Args:
      declared: name -> Setting of the experiment.
      defaults: the preset's values (every declared setting).
      overrides: name -> CLI text or Python value.
      lists: a comma list is allowed for every setting (a sweep makes axes of
        them); otherwise only for `listable` settings.
      notes: say on stderr when a value is given by an alias (`Setting.aliases`).

    Returns:
      name -> value, or a list of values for a sweep axis / listable setting.
    """
    settings = dict(defaults)
    for key, raw in overrides.items():
        if key not in declared:
            raise ValueError(
                f"unknown setting {key!r}{did_you_mean(key, declared)}; this preset takes: "
                f"{', '.join(sorted(declared))}.")
        setting = declared[key]
        if setting.default == [] and str(raw).strip().lower() in ("", "none"):
            settings[key] = []
            continue
        settings[key] = setting.canonical(
            _parse_value(key, raw, setting.type, lists or setting.listable), notes)
    for key, value in settings.items():
        for v in value if isinstance(value, list) else [value]:
            declared[key].check(v)
        if isinstance(value, list) and not value and declared[key].default != []:
            raise ValueError(f"setting {key}: empty list.")
    return settings
