"""Flat settings of a preset: parsing `--set KEY=VALUE` and validating values."""

from __future__ import annotations

import math


def parse_assignments(items: list[str] | None) -> dict[str, str]:
    """["k=4", "R=0.1,0.2"] -> {"k": "4", "R": "0.1,0.2"}; also accepts "k=4,m=8"-free forms."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE; got {item!r}.")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"--set expects KEY=VALUE; got {item!r}.")
        out[key] = value.strip()
    return out


def _convert(key: str, text: str, like):
    try:
        if isinstance(like, bool):
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if isinstance(like, int):
            value = float(text)
            if not math.isfinite(value) or value != int(value):
                raise ValueError
            return int(value)
        if isinstance(like, float):
            return float(text)
        return text
    except ValueError:
        raise ValueError(
            f"setting {key}: cannot read {text!r} as {type(like).__name__}."
        ) from None


def resolve(
    defaults: dict, overrides: dict, list_keys: frozenset[str] = frozenset()
) -> dict:
    """Applies overrides (strings as typed on the command line, or Python values) to defaults.

    A comma list is allowed only for `list_keys` (sweep axes and grids); the
    result for such a key is always a list.
    """
    settings = dict(defaults)
    for key, text in overrides.items():
        if isinstance(text, (list, tuple)):
            text = ",".join(str(v) for v in text)
        text = str(text)
        if key not in defaults:
            raise ValueError(
                f"unknown setting {key!r}; this preset takes: {', '.join(sorted(defaults))}."
            )
        like = defaults[key]
        like_item = like[0] if isinstance(like, list) else like
        parts = [p for p in text.split(",") if p.strip()] if "," in text else [text]
        if not parts or not parts[0].strip():
            raise ValueError(f"setting {key}: empty value {text!r}.")
        if len(parts) > 1 and key not in list_keys:
            raise ValueError(
                f"setting {key} takes one value here; got the list {text!r}."
            )
        values = [_convert(key, p.strip(), like_item) for p in parts]
        settings[key] = values if key in list_keys else values[0]
    return settings


def require_int(
    settings: dict, key: str, minimum: int = 1, maximum: int | None = None
) -> None:
    for value in _values(settings[key]):
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise ValueError(f"setting {key} must be an integer {bounds}; got {value!r}.")


def require_float(settings: dict, key: str, minimum: float = 0.0) -> None:
    for value in _values(settings[key]):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
            raise ValueError(
                f"setting {key} must be a finite number >= {minimum}; got {value!r}."
            )


MAX_SEED = 2**32 - 1


def require_seed(settings: dict, key: str = "seed") -> None:
    """A seed jax.random.key takes on every platform."""
    require_int(settings, key, minimum=0, maximum=MAX_SEED)


def _values(v):
    return v if isinstance(v, list) else [v]
