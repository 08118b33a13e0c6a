"""Output directories of run, sweep and compare: checked before anything is written.

`_prepare_out` refuses an --out that is another command's output, already used
or unwritable; `_check_resumable` refuses a resume whose result-affecting
settings differ, and `_plan_refused` one whose memory plan would change;
`_config` is the config.json every command writes first; `_reports_kept` tells
the CLI what a directory keeps when an OS error or an interrupt stops a command.
`load_config` and `_base_settings` read a config.json back for --config and
--resume.
"""

from __future__ import annotations

import contextvars
import datetime
import errno
import functools
import json
import os
import platform
import sys
from pathlib import Path

import jax

import fedjax_sim
from fedjax_sim.experiments.base import Preset
from fedjax_sim.io import read_csv, read_json

RUN, SWEEP, COMPARE = "run", "sweep", "compare"
# The file that marks a directory as each command's output.
_MARKERS = {RUN: "metrics.csv", SWEEP: "trials.csv", COMPARE: "results.csv"}


class OutputError(OSError):
    """--out cannot be used (unwritable, read-only, not a directory, full): exit code 4."""


# ----------------------------------------------------------------------------- what a stop keeps
# The --out a command has started writing (set once it is checked, see `_reports_kept`).
_STARTED: contextvars.ContextVar = contextvars.ContextVar("fedjax_sim_started", default=None)


def _kept(command: str, out_dir: Path) -> str:
    """What `command` keeps in out_dir after an OS error or an interrupt stopped it."""
    try:
        if command == RUN:
            rounds = [int(r["round"]) for r in read_csv(out_dir / "metrics.csv")]
            steps = sorted(int(p.name) for p in (out_dir / "checkpoints").glob("*")
                           if p.is_dir() and p.name.isdigit())
            rows = (f"metrics.csv up to round {max(rounds)}" if rounds
                    else "no metrics.csv rows")
            ckpt = (f"the checkpoint of round {steps[-1]} (--resume continues from it)" if steps
                    else "no checkpoint")
            return f"kept in {out_dir}: {rows} and {ckpt}"
        if command == SWEEP:
            rows = len(read_csv(out_dir / "trials.csv"))
            return f"kept in {out_dir}: {rows} trials.csv rows (--resume continues from them)"
        if not (out_dir / "config.json").exists():  # stopped while loading the data
            return f"nothing was written to {out_dir}"
        done = sorted(p.stem for p in (out_dir / "methods").glob("*.json"))
        return (f"kept in {out_dir}: the finished methods {', '.join(done)} (methods/*.json)"
                if done else f"no method had finished; {out_dir} holds only its config.json")
    except Exception:  # the disk may be failing: say where to look, not what is there
        return f"what was written before the stop is in {out_dir}"


def _reports_kept(command: str):
    """Marks an OSError or KeyboardInterrupt that stops `command` after its --out was checked.

    The exception gets `out_dir` and `kept` (one clause saying what the
    directory keeps) for the CLI's one-line message; one raised before (a bad
    cache_dir while validating) gets neither: nothing was written.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            token = _STARTED.set(None)
            try:
                return fn(*args, **kwargs)
            except (OSError, KeyboardInterrupt) as err:
                out_dir = _STARTED.get()
                if out_dir is not None and not isinstance(err, OutputError):
                    err.out_dir, err.kept = str(out_dir), _kept(command, out_dir)
                raise
            finally:
                _STARTED.reset(token)

        return wrapped

    return decorate


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def _config(preset: Preset, command: str, settings: dict, mesh=None) -> dict:
    from fedjax_sim.provenance import provenance

    experiment = preset.experiment
    produced_by = provenance()
    return {
        "preset": preset.name,
        "experiment": experiment.name,
        "command": command,
        "description": preset.description,
        "settings": settings,
        "seed": settings.get("seed"),
        "fedjax_sim_version": fedjax_sim.__version__,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "mesh_devices": 1 if mesh is None else mesh.size,
        "processes": jax.process_count(),
        "python": platform.python_version(),
        # The package's git commit (None when not a checkout) and dirty flag; the versions
        # of its stack (None: not installed).
        "git_commit": produced_by["git"]["commit"],
        "git_dirty": produced_by["git"]["dirty"],
        "versions": produced_by["versions"],
        "argv": sys.argv,
        "started": _now(),
    }


def default_out_dir(name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def _prepare_out(out_dir: Path, command: str) -> None:
    """Refuses an --out that is another command's output, already used, or unwritable.

    Nothing is written when it refuses (nor when it accepts: the write probe
    and any directory it made are removed; in a multi-process run an empty new
    directory is left). Raises ValueError (exit 2) for a
    directory of the wrong kind or already used, OutputError (exit 4) for an
    OS reason.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(errno.ENOTDIR, f"--out {out_dir} is not a directory")
    resumable = ", or --resume it"
    if out_dir.is_dir():
        # A comparison writes metrics.csv too: a directory with this command's own marker
        # is this command's, whatever else it holds.
        ours = (out_dir / _MARKERS[command]).exists()
        for other, marker in _MARKERS.items():
            if other != command and not ours and (out_dir / marker).exists():
                raise ValueError(
                    f"--out {out_dir} holds a {other} ({marker}); a {command} there would "
                    f"overwrite its config.json. Choose another --out."
                )
        config_path = out_dir / "config.json"
        if config_path.exists():
            try:
                previous = read_json(config_path).get("command")
            except (OSError, json.JSONDecodeError):
                previous = None
            if previous not in (None, command):
                raise ValueError(
                    f"--out {out_dir} holds a {previous}; choose another --out for this {command}."
                )
            raise ValueError(
                f"output directory {out_dir} already holds a run (config.json); choose "
                f"another --out{resumable}."
            )
        own = out_dir / _MARKERS[command]
        if own.exists():
            raise ValueError(
                f"output directory {out_dir} already holds a {own.name}; choose another "
                f"--out{resumable}."
            )
    created = []  # the directories the probe makes, deepest first
    parent = out_dir
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    # Every process of a multi-process run probes the same new directory at once: each
    # uses its own probe name, tolerates the others' mkdir, and only a lone process
    # removes the directories it made (another may be probing inside them).
    alone = jax.process_count() == 1
    probe = out_dir / f".fedjax_sim_write_probe.{os.getpid()}"
    try:
        for d in reversed(created):
            d.mkdir(exist_ok=True)
        with open(probe, "w") as f:
            f.write("x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise OutputError(err.errno, f"--out {out_dir}: {err.strerror or err}") from None
    finally:
        # Also when the write failed (a full disk): the probe may exist, empty.
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        for d in created if alone else ():
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    _STARTED.set(out_dir)


def _check_resumable(out_dir: Path, settings: dict, declared, command: str) -> dict:
    """The config.json to resume in out_dir; ValueError naming the settings that differ."""
    path = out_dir / "config.json"
    if not path.exists():
        raise ValueError(
            f"cannot resume: {out_dir} holds no config.json (no run was started there)."
        )
    config = read_json(path)
    if config.get("command", command) != command:
        raise ValueError(
            f"cannot resume {out_dir} as a {command}: it holds a {config['command']}."
        )
    saved = config.get("settings", {})
    keys = saved.keys() | settings.keys()
    differ = sorted(k for k in keys if saved.get(k) != settings.get(k)
                    and (k not in declared or declared[k].result))
    if differ:
        changes = ", ".join(f"{k} ({saved.get(k)!r} there, {settings.get(k)!r} now)"
                            for k in differ)
        raise ValueError(
            f"cannot resume {out_dir}: settings differ from its config.json: {changes}. "
            "Resume with the same settings, or start a new run in another --out."
        )
    _STARTED.set(out_dir)
    return config


BUDGET = "memory_budget_gb"


def _plan_refused(out_dir: Path, command: str, subject: str, there: str, now: str,
                  saved: dict, settings: dict) -> ValueError:
    """The one-line refusal of a resume whose memory plan differs from the one the command
    started with (config.json's "plan", or its checkpoints').

    The plan (how many clients a round processes at once; a sweep's trials per compiled
    program) follows memory_budget_gb and this machine; the numbers depend on it in their
    last bits (chunks' partial sums are added in another order; XLA compiles a program of
    other shapes differently), so a resume keeps it.

    Args:
      subject: what is planned, ending in ": " ("method fedavg: "), or "".
      there, now: the plan the command started with and this resume's, in words.
      saved, settings: the settings of config.json and of this resume.
    """
    if BUDGET in settings:
        was, new = saved.get(BUDGET, settings[BUDGET]), settings[BUDGET]
        plans = (f"{BUDGET}={new} plans {now} on this machine" if was == new
                 else f"{BUDGET}={new} (config.json: {was}) plans {now}")
        fix = f"resume with {BUDGET}={was} on a machine like the one it started on"
    else:
        plans, fix = f"this machine plans {now}", "resume on a machine like the one it started on"
    return ValueError(
        f"cannot resume {out_dir}: {subject}{plans} where the {command} started with {there}, "
        f"and its numbers depend on that plan in their last bits; a resume may change {BUDGET} "
        f"only to a value that keeps the plan: {fix}, or start a new {command} in another "
        "--out.")


def load_config(path, command: str | None = None, resume: bool = False) -> tuple[str, dict]:
    """(preset name, settings) of an output directory's config.json, for `--config`.

    command: the command that will use it; a config.json of a sweep holds lists
    that only a sweep reads, so only a sweep may take one (the refusal names the
    preset and the sweep command to use). resume: it is the --out of a
    `--resume` (the refusal says so).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = read_json(path)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--config {path}: cannot read it ({err}).") from None
    if not isinstance(config, dict) or "preset" not in config or "settings" not in config:
        raise ValueError(f"--config {path}: not a fedjax_sim config.json (no preset/settings).")
    if not isinstance(config["settings"], dict) or not isinstance(config["preset"], str):
        raise ValueError(f"--config {path}: \"settings\" must be a mapping of setting names "
                         f"to values and \"preset\" a name; got "
                         f"{type(config['settings']).__name__} and "
                         f"{type(config['preset']).__name__}.")
    if command is not None and config.get("command") == SWEEP and command != SWEEP:
        if resume:
            raise ValueError(
                f"--out {path.parent} holds a sweep of preset {config['preset']}, not a "
                f"{command}; continue it with `fedjax-sim sweep --resume --out {path.parent}`.")
        raise ValueError(
            f"--config {path} records a sweep of preset {config['preset']} (settings with "
            f"lists), not a {command}; rerun it with `fedjax-sim sweep --config {path}`.")
    return config["preset"], config["settings"]


def _base_settings(command: str, name, config, out_dir, resume: bool) -> tuple[str, dict]:
    """(preset name, the settings overrides apply on): a --config's, a resumed directory's
    config.json's (so `--resume --out DIR` alone continues DIR), or none."""
    if config is not None:
        if name is not None:
            raise ValueError("give a PRESET or --config (which names its preset), not both.")
        return load_config(config, command)
    if resume:
        if out_dir is None:
            raise ValueError("--resume needs --out DIR (the directory to continue).")
        path = Path(out_dir) / "config.json"
        if not path.exists():
            raise ValueError(
                f"cannot resume: {out_dir} holds no config.json (no {command} was started "
                "there).")
        saved_name, base = load_config(path, command, resume=True)
        if name is not None and name != saved_name:
            raise ValueError(f"cannot resume {out_dir}: it holds preset {saved_name}, not {name}.")
        return saved_name, base
    if name is None:
        raise ValueError(f"{command} needs a PRESET, --config DIR/config.json, or --resume "
                         "--out DIR.")
    return name, {}
