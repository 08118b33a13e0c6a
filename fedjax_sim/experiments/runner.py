"""Run directories for every registered experiment: run, sweep, compare, describe.

Nothing here knows an experiment's metric names: the experiment builds its
rows, summaries and plots; the runner checks settings, refuses unusable
output directories before writing, writes config.json, streams metrics.csv,
and writes the rest.
"""

from __future__ import annotations

import contextvars
import datetime
import errno
import functools
import hashlib
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import jax

import fedjax_sim
from fedjax_sim import compare, parallel, plots, simulate, stats
from fedjax_sim.experiments.base import Comparison, RunContext
from fedjax_sim.experiments.registry import Preset, get_preset
from fedjax_sim.experiments.settings import parse_assignments, resolve
from fedjax_sim.io import append_csv, read_csv, read_json, write_csv, write_json
from fedjax_sim.logs import MetricsCSV, Progress, TensorBoardLog, write_bands

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


def resolve_settings(preset: Preset, overrides, command: str = RUN,
                     base: dict | None = None) -> dict:
    """The preset's settings with overrides, checked; a sweep allows a comma list anywhere.

    base: settings recorded in a config.json (--config, --resume), as values: they
    replace the preset's defaults, and overrides apply on top.
    """
    if isinstance(overrides, list):
        overrides = parse_assignments(overrides)
    experiment = preset.experiment
    unknown = sorted(set(base or {}) - set(experiment.declared))
    if unknown:
        raise ValueError(f"the recorded settings name {', '.join(unknown)}, which preset "
                         f"{preset.name} does not take (written by another version?).")
    settings = resolve(experiment.declared, {**preset.defaults, **(base or {})},
                       overrides or {}, lists=command == SWEEP)
    for key in overrides or {}:
        readers = experiment.declared[key].commands
        if readers and command not in readers and settings[key] != preset.defaults[key]:
            raise ValueError(
                f"setting {key} is not read by {command} (only by {', '.join(readers)}); "
                f"leave it at {preset.defaults[key]!r}.")
    if command == SWEEP:
        axes = sweep_axes(preset, settings)
        if "seeds" in axes:
            raise ValueError(
                "setting seeds counts the seeds of every cell; it cannot be a sweep axis.")
        for axis in axes:
            if len(set(map(str, settings[axis]))) != len(settings[axis]):
                raise ValueError(f"setting {axis} repeats a value: {settings[axis]!r}.")
    else:
        for key, value in settings.items():
            if isinstance(value, list) and not experiment.declared[key].listable:
                raise ValueError(
                    f"setting {key} takes one value here (a list makes a sweep axis: use "
                    f"`fedjax-sim sweep`); got {value!r}."
                )
        experiment.validate(settings, command)
    return settings


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
    resumable = "" if command == COMPARE else ", or --resume it"  # compare has no --resume
    if out_dir.is_dir():
        for other, marker in _MARKERS.items():
            if other != command and (out_dir / marker).exists():
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


def choose_mesh(devices: int | None, num_clients: int | None = None, what: str = "m (clients)"):
    """The mesh for a run: `devices` devices, or automatically every device.

    Automatic choice (devices None) on one process: the most devices that
    divide num_clients, None when that is one. Several processes always use
    every device, and an explicit count must divide num_clients.
    """
    if devices is None:
        available = jax.device_count()
        if jax.process_count() == 1 and num_clients is not None:
            available = max(c for c in range(1, available + 1) if num_clients % c == 0)
        return parallel.make_mesh(available) if available > 1 else None
    mesh = parallel.make_mesh(devices)
    if num_clients is not None:
        parallel.check_divisible(num_clients, mesh, what)
    return mesh if devices > 1 or jax.process_count() > 1 else None


def load_config(path, command: str | None = None) -> tuple[str, dict]:
    """(preset name, settings) of an output directory's config.json, for `--config`.

    command: the command that will use it; a config.json of a sweep holds lists
    that only a sweep reads, so only a sweep may take one.
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
        raise ValueError(f"--config {path} records a sweep (settings with lists); use it with "
                         "`fedjax-sim sweep --config`.")
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
        saved_name, base = load_config(path, command)
        if name is not None and name != saved_name:
            raise ValueError(f"cannot resume {out_dir}: it holds preset {saved_name}, not {name}.")
        return saved_name, base
    if name is None:
        raise ValueError(f"{command} needs a PRESET, --config DIR/config.json, or --resume "
                         "--out DIR.")
    return name, {}


def _rows_writer(out_dir: Path, tensorboard: bool):
    """on_rows for a run: metrics.csv (streamed, fsynced) and optional TensorBoard events."""
    path = out_dir / "metrics.csv"
    state = {"csv": None, "tb": TensorBoardLog(out_dir / "tensorboard") if tensorboard else None}

    def on_rows(rows):
        if not rows:
            return
        if state["csv"] is None:  # the history so far: a fresh run's round 0, or a resume's
            write_csv(path, rows)
            state["csv"] = MetricsCSV(path, resume_round=int(rows[-1]["round"]))
        else:
            state["csv"].append(rows)
        if state["tb"] is not None:
            for row in rows:
                copy = next((c for c in ("restart", "seed") if c in row), None)
                tag = f"/{copy}{row[copy]}" if copy else ""
                state["tb"].write(int(row["round"]), {
                    f"{k}{tag}": v for k, v in row.items() if k not in ("round", copy)})

    def close():
        if state["tb"] is not None:
            state["tb"].close()

    return on_rows, close


def _after_first_rows(on_rows, write_config):
    """on_rows that calls write_config once, before the first rows are written."""
    pending = [write_config]

    def wrapped(rows):
        if pending:
            pending.pop()()
        on_rows(rows)

    return wrapped


@_reports_kept(RUN)
def run_preset(name, overrides=None, out_dir=None, progress: bool = True,
               devices: int | None = None, resume: bool = False, tensorboard: bool = False,
               config=None) -> Path:
    """Runs a preset and writes config.json, metrics.csv (streamed), summary.json and plots.

    config: a run directory or its config.json: rerun that run (its preset
    and settings; `overrides` apply on top).

    Raises:
      ValueError: bad settings or --out (nothing written).
      OutputError: --out unusable for an OS reason (nothing written).
      simulate.Diverged: every restart went NaN/inf; metrics.csv (up to the
        last good evaluation) and summary.json ("diverged": true) are written first.
    """
    name, base = _base_settings(RUN, name, config, out_dir, resume)
    preset = get_preset(name, RUN)
    if isinstance(overrides, list):
        overrides = parse_assignments(overrides)
    settings = resolve_settings(preset, overrides, RUN, base)
    mesh = choose_mesh(devices, settings.get("m"))
    out_dir = Path(out_dir) if out_dir else default_out_dir(preset.name)
    primary = parallel.is_primary()
    checkpoint_dir = out_dir / "checkpoints" if settings.get("checkpoint_every") else None
    record = _config(preset, RUN, settings, mesh)
    # Every process checks (so all of them stop on a bad --out or --resume)
    # before process 0 rewrites the config.json the others read.
    if resume:
        previous = _check_resumable(out_dir, settings, preset.experiment.declared, RUN)
        record["started"] = previous.get("started", record["started"])
        record["resumed"] = [*previous.get("resumed", []), _now()]
    else:
        _prepare_out(out_dir, RUN)
    parallel.sync_processes("fedjax_sim: run directory checked")
    on_rows, close = (_rows_writer(out_dir, tensorboard) if primary
                      else (lambda rows: None, lambda: None))
    write_config = (lambda: write_json(out_dir / "config.json", record)) if primary else None
    if write_config and resume:
        # Rewritten only once a checkpoint has restored (the first rows come then), so a
        # refused resume (no intact checkpoint) leaves config.json as it was.
        on_rows, write_config = _after_first_rows(on_rows, write_config), None
    if write_config:
        write_config()
    ctx = RunContext(mesh=mesh, progress=progress and primary, checkpoint_dir=checkpoint_dir,
                     resume=resume, on_rows=on_rows)
    try:
        rows, summary = preset.experiment.run(settings, ctx)
    finally:
        close()
    if primary:
        write_json(out_dir / "summary.json", summary)
        preset.experiment.plot_run(rows, summary, out_dir)
    if "diverged_round" in summary:
        raise simulate.Diverged(
            summary["diverged_round"], summary["diverged_metric"], summary["diverged_value"],
            history=rows, checkpoint_round=summary["last_checkpoint_round"],
            checkpoint_dir=checkpoint_dir.absolute() if checkpoint_dir else None,
        )
    return out_dir


# ----------------------------------------------------------------------------- sweeps


def sweep_axes(preset: Preset, settings: dict) -> list[str]:
    """The settings that take several values (listable ones are grids within a cell)."""
    declared = preset.experiment.declared
    return [k for k, v in settings.items() if isinstance(v, list) and not declared[k].listable]


def expand_cells(settings: dict, axes: list[str]) -> list[dict]:
    """One dict per point of the product of the list-valued `axes`."""
    lists = [settings[a] for a in axes]
    cells = []
    for values in itertools.product(*lists):
        cell = dict(settings)
        cell.update(zip(axes, values, strict=True))
        cells.append(cell)
    return cells


def cell_id(preset: Preset, cell: dict) -> str:
    """A key of every setting that changes a cell's results (not seeds, not memory options)."""
    declared = preset.experiment.declared
    keyed = {k: v for k, v in sorted(cell.items())
             if k in declared and declared[k].result and k != "seeds"}
    text = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _group_cells(experiment, cells: list[dict]) -> list[list[dict]]:
    """Cells that differ only in traced settings, together (when the experiment vmaps them)."""
    if not experiment.group_cells:
        return [[c] for c in cells]
    untraced = [k for k, st in experiment.declared.items() if not st.traced]
    groups: dict[str, list[dict]] = {}
    for cell in cells:
        key = json.dumps([cell[k] for k in untraced], default=str)
        groups.setdefault(key, []).append(cell)
    return list(groups.values())


@_reports_kept(SWEEP)
def sweep_preset(name, overrides=None, out_dir=None, progress: bool = True, resume: bool = False,
                 devices: int | None = None, config=None, tensorboard: bool = False) -> Path:
    """Runs a sweep: trials.csv (appended per chunk, fsynced), summary.csv, plots.

    Any setting given a comma list is an axis of cells. A trial is keyed by
    every setting that changes its result (`cell_id`), so --resume continues
    without duplicates, and a resume with other settings is refused.
    """
    name, base = _base_settings(SWEEP, name, config, out_dir, resume)
    preset = get_preset(name, SWEEP)
    experiment = preset.experiment
    if isinstance(overrides, list):
        overrides = parse_assignments(overrides)
    settings = resolve_settings(preset, overrides, SWEEP, base)
    axes = sweep_axes(preset, settings)
    cells = expand_cells(settings, axes)
    for cell in cells:  # every cell is checked before anything is written
        experiment.validate(cell, SWEEP)
        cell["cell_id"] = cell_id(preset, cell)
    mesh = choose_mesh(devices)
    out_dir = Path(out_dir) if out_dir else default_out_dir(preset.name)
    primary = parallel.is_primary()
    if resume:
        _check_resumable(out_dir, settings, experiment.declared, SWEEP)
    else:
        _prepare_out(out_dir, SWEEP)
    if primary:
        record = _config(preset, SWEEP, settings, mesh)
        record["axes"] = axes
        if resume:
            previous = read_json(out_dir / "config.json")
            record["started"] = previous.get("started", record["started"])
            record["resumed"] = [*previous.get("resumed", []), _now()]
        write_json(out_dir / "config.json", record)
    columns = experiment.trial_columns(axes)
    trials_path = out_dir / "trials.csv"
    existing = read_csv(trials_path)
    done = {(r["cell_id"], int(r["data_seed"])) for r in existing}
    kept: list[dict] = []
    groups = _group_cells(experiment, cells)
    todo = [(group, sorted({s for c in group for s in range(c["seeds"])
                            if (c["cell_id"], s) not in done})) for group in groups]
    wanted = {(c["cell_id"], s) for c in cells for s in range(c["seeds"])}
    total_cost = sum(experiment.cell_cost(c) for c in cells for s in range(c["seeds"])
                     if (c["cell_id"], s) not in done)
    with Progress(len(wanted), initial=len(done & wanted), description=preset.name,
                  unit="seed", enabled=progress and primary, total_cost=total_cost) as bar:
        for group, seeds in todo:
            size = experiment.seeds_per_chunk(group[0])
            by_id = {c["cell_id"]: c for c in group}
            for start in range(0, len(seeds), size):
                chunk = seeds[start : start + size]
                rows = [{**{a: by_id[r["cell_id"]][a] for a in axes}, **r}
                        for r in experiment.group_trials(group, chunk, mesh)
                        if (r["cell_id"], r["data_seed"]) in wanted - done]
                if primary:
                    append_csv(trials_path, rows, columns)
                else:
                    kept.extend(rows)
                bar.advance(len(rows), cost=sum(experiment.cell_cost(by_id[r["cell_id"]])
                                                for r in rows),
                            postfix={a: group[0][a] for a in axes
                                     if len({c[a] for c in group}) == 1})
    trials = read_csv(trials_path) if primary else existing + kept
    summary = experiment.summarize_cells(trials, cells, axes)
    if primary:
        write_csv(out_dir / "summary.csv", summary)
        experiment.plot_sweep(summary, out_dir)
        if tensorboard:  # each cell's summary as scalars, one step per cell
            with TensorBoardLog(out_dir / "tensorboard") as tb:
                for i, row in enumerate(summary):
                    tb.write(i, {k: v for k, v in row.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out_dir


# ----------------------------------------------------------------------------- comparisons


@_reports_kept(COMPARE)
def compare_preset(name=None, overrides=None, out_dir=None, progress: bool = True,
                   resume: bool = False, config=None, tensorboard: bool = False,
                   devices: int | None = None) -> Path:
    """Trains the experiment's methods side by side over vmapped seeds (`compare.run_methods`).

    Writes config.json first; methods/<name>.json as each method finishes (its
    per-seed finals and history) while checkpoints/<name>/ holds the method in
    flight, so `resume` continues a killed comparison; then results.csv (one
    row per method: diverged_seeds, seeds_used, <metric>_mean, _std and, but
    for the baseline, _diff, _diff_se, _significant: the per-seed paired
    difference to the baseline over the seeds that did not diverge),
    results.md (printed too), per_seed.csv, per_seed_metrics.csv (every
    evaluated round of every seed), metrics.csv (per method, averaged over the
    seeds that did not diverge), comparison.png and the experiment's plots.

    devices: devices to shard every method's client axis over (None: all that
    divide the clients); it changes results only in the order of float sums, so
    it is no setting and a resume may change it (config.json's mesh_devices).

    Raises:
      compare.MethodsDiverged: a method diverged in some seed, after every
        output is written (exit code 3).
    """
    name, base = _base_settings(COMPARE, name, config, out_dir, resume)
    preset = get_preset(name, COMPARE)
    experiment = preset.experiment
    if isinstance(overrides, list):
        overrides = parse_assignments(overrides)
    settings = resolve_settings(preset, overrides, COMPARE, base)
    if devices is not None:
        parallel.make_mesh(devices)  # a count JAX lacks: refused before anything is written
    out_dir = Path(out_dir) if out_dir else default_out_dir(f"{preset.name}-compare")
    primary = parallel.is_primary()
    methods = tuple(experiment.compared(settings))
    record = {**_config(preset, COMPARE, settings), "methods": list(methods),
              "baseline": experiment.baseline}
    if resume:
        previous = _check_resumable(out_dir, settings, experiment.declared, COMPARE)
        record["started"] = previous.get("started", record["started"])
        record["resumed"] = [*previous.get("resumed", []), _now()]
    else:
        _prepare_out(out_dir, COMPARE)
    problem = experiment.problem(settings)
    builds = {m: functools.partial(experiment.method_run, m, settings, problem) for m in methods}
    # The mesh shards the client axis of the methods' data (after its seeds axis, where the
    # data has one): the clients are counted, and --devices checked, before config.json.
    first = builds[methods[0]]()
    builds[methods[0]] = lambda: first
    mesh = choose_mesh(devices, compare.method_clients(first), "clients")
    record["mesh_devices"] = 1 if mesh is None else mesh.size
    if primary:
        write_json(out_dir / "config.json", record)
    results = compare.run_methods(
        builds, settings["seeds"], out_dir, resume=resume,
        checkpoint_every=settings.get("checkpoint_every"), progress=progress, primary=primary,
        mesh=mesh)
    if primary:
        _write_comparison(preset, settings, problem, results, out_dir, tensorboard)
    if any(r.diverged_seeds for r in results.values()):
        raise compare.MethodsDiverged(results)
    return out_dir


def _write_comparison(preset: Preset, settings: dict, problem, results: dict, out_dir: Path,
                      tensorboard: bool) -> None:
    experiment = preset.experiment
    metrics = experiment.table(settings)
    seeds = settings["seeds"]
    rows = compare.results_table(results, experiment.baseline, metrics)
    write_csv(out_dir / "results.csv", rows, compare.results_columns(metrics))
    table = stats.results_markdown(rows, metrics, experiment.baseline, seeds=seeds,
                                   title=f"{preset.name}: final metrics")
    per_seed_finals = compare.table_per_seed(results, metrics)
    notes = experiment.notes(settings, problem, results)
    if notes:  # the experiment's caption: protocol choices, deviations, extra counts
        table = table.rstrip("\n") + "\n\n" + "\n".join(
            f"- {key}: {value}" for key, value in notes.items()) + "\n"
        write_json(out_dir / "notes.json", notes)
    (out_dir / "results.md").write_text(table)
    print(table)
    per_seed = [{"method": n, "seed": i, "diverged": r.diverged[i] is not None,
                 **{k: float(v[i]) for k, v in r.per_seed.items()}}
                for n, r in results.items() for i in range(seeds)]
    write_csv(out_dir / "per_seed.csv", per_seed)
    long_rows = [row for r in results.values() for row in r.long_rows()]
    write_csv(out_dir / "per_seed_metrics.csv", long_rows)
    histories = {n: r.seed_mean_rows() for n, r in results.items()}
    write_csv(out_dir / "metrics.csv", [{"method": n, **row} for n, rows_ in histories.items()
                                        for row in rows_])
    comparison = Comparison(per_seed_finals, histories, metrics, experiment.baseline, notes,
                            results)
    methods = list(experiment.methods)
    # Curves and bands over the seeds that did not diverge, as the means of metrics.csv.
    kept = [row for row in long_rows if results[row["method"]].diverged[row["seed"]] is None]
    plots.plot_comparison(kept, out_dir / "comparison.png", list(experiment.panels),
                          title=f"{preset.name}: {seeds} seeds", methods=methods,
                          colors=plots.method_colors(methods), labels=experiment.labels,
                          log_y=experiment.log_metrics)
    experiment.plot_compare(comparison, out_dir)
    if tensorboard:  # one run folder per method: the seed mean and its band per metric
        write_bands(out_dir / "tensorboard", plots.seed_bands(
            kept, [m for m, _ in experiment.panels] + [
                m for m in metrics if m not in dict(experiment.panels)]))


def describe_preset(name: str) -> str:
    """Every setting of a preset with its default, allowed range and help."""
    preset = get_preset(name)
    lines = [f"{preset.name}: {preset.description}",
             f"experiment: {preset.experiment.name}; commands: {', '.join(preset.commands)}"]
    if preset.experiment.methods:
        lines.append(f"compare: {', '.join(preset.experiment.methods)} "
                     f"(baseline {preset.experiment.baseline})")
    lines.append("settings:")
    defaults = preset.defaults
    for s in preset.experiment.settings:
        value = defaults[s.name]
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        flags = [f for f, on in (("traced", s.traced), ("no effect on results", not s.result))
                 if on]
        lines.append(f"  {s.name:<18} {s.type.__name__:<5} default {shown:<14} "
                     f"range {s.describe_range():<20} {s.help}"
                     + (f" [{', '.join(flags)}]" if flags else ""))
    return "\n".join(lines)


__all__ = ["OutputError", "compare_preset", "describe_preset", "run_preset", "sweep_preset"]

