"""Run directories for every registered experiment: run, sweep, compare, describe.

Nothing here knows an experiment's metric names: the experiment builds its
rows, summaries and plots; the runner checks settings, refuses unusable
output directories before writing, writes config.json, streams metrics.csv,
and writes the rest. The output directory's checks, config.json and what a
stop keeps are `rundir.py`; the files a run streams and a finished
comparison writes are `outputs.py`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from pathlib import Path

import jax

from fedjax_sim import compare, parallel, simulate
from fedjax_sim.execution import PlanChanged, describe_chunk, plan_record
from fedjax_sim.experiments import privacy, robustness, study, tuned
from fedjax_sim.experiments.base import RunContext, Sweep, check_method
from fedjax_sim.experiments.outputs import _after_first_rows, _rows_writer, _write_comparison
from fedjax_sim.experiments.registry import Preset, get_preset
from fedjax_sim.experiments.rundir import (
    COMPARE,
    RUN,
    SWEEP,
    OutputError,
    _base_settings,
    _check_resumable,
    _config,
    _now,
    _plan_refused,
    _prepare_out,
    _reports_kept,
    default_out_dir,
)
from fedjax_sim.experiments.settings import parse_assignments, resolve
from fedjax_sim.io import (
    append_csv,
    read_csv,
    remove_temporaries,
    write_csv,
    write_json,
)
from fedjax_sim.logs import Progress, TensorBoardLog


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
        readers = experiment.declared[key].methods
        if readers and settings[key] != preset.defaults[key]:
            trained = _trained(experiment, settings, command)
            if trained is not None and not set(readers) & set(trained):
                hint = (f" or --set method={readers[0]}" if len(readers) == 1
                        and command != COMPARE and "method" in experiment.declared else "")
                raise ValueError(
                    f"setting {key} is read only by method{'s' if len(readers) > 1 else ''} "
                    f"{', '.join(readers)}; this {command} trains {', '.join(trained)}: leave "
                    f"it at {preset.defaults[key]!r}{hint}.")
        when = experiment.declared[key].when
        if when and settings[key] != preset.defaults[key]:
            other, allowed = when
            values = settings[other] if isinstance(settings[other], list) else [settings[other]]
            if not set(values) & set(allowed):
                raise ValueError(
                    f"setting {key} is read only with {other}={' or '.join(map(str, allowed))};"
                    f" this {command} has {other}={','.join(map(str, values))}: leave it at "
                    f"{preset.defaults[key]!r}.")
    if command == SWEEP:
        axes = sweep_axes(preset, settings)
        if "seeds" in axes:
            raise ValueError(
                "setting seeds counts the seeds of every cell; it cannot be a sweep axis.")
        for axis in axes:
            if len(set(map(str, settings[axis]))) != len(settings[axis]):
                raise ValueError(f"setting {axis} repeats a value: {settings[axis]!r}.")
    else:
        _refuse_axes(preset, settings, overrides or {}, base or {}, command)
        if command == COMPARE and experiment.methods:
            # each named method fits (or is refused, saying why)
            study.compared(experiment, settings)
        elif "method" in experiment.declared and experiment.methods:
            check_method(experiment, settings["method"])
        if experiment.validate is not None:
            experiment.validate(settings, command)
        if privacy.enabled(settings) and experiment.methods:
            privacy.check(experiment.method_table, _trained(experiment, settings, command) or (),
                          settings)
        if "aggregator" in experiment.declared and experiment.methods:
            robustness.check(experiment.method_table,
                             _trained(experiment, settings, command) or (), settings)
        tuned.check(settings, tuple(k for k in overrides or {}
                                    if settings[k] != preset.defaults[k]))
    return settings


def _refuse_axes(preset: Preset, settings: dict, overrides: dict, base: dict,
                 command: str) -> None:
    """Refuses a list for a setting that takes one value outside a sweep, saying where the
    list came from: the user's own (--set, the Python API), the recorded settings of
    --config or --resume (a sweep's), or the preset's defaults (a sweep-only preset,
    whose grid axes are lists: it names the preset and `fedjax-sim sweep PRESET`)."""
    lists = [k for k, v in settings.items()
             if isinstance(v, list) and not preset.experiment.declared[k].listable]
    for key in lists:
        if key in overrides:
            raise ValueError(
                f"setting {key} takes one value here (a list makes a sweep axis: use "
                f"`fedjax-sim sweep`); got {settings[key]!r}.")
    recorded = [k for k in lists if k in base]
    if recorded:
        raise ValueError(
            f"the recorded settings give {_names(recorded)} several values, as a sweep's "
            f"config.json does; a {command} takes one value each: use `fedjax-sim sweep "
            f"--config DIR/config.json` (preset {preset.name}), or --set "
            + " ".join(f"{k}={settings[k][0]}" for k in recorded) + ".")
    if lists:
        one = " ".join(f"{k}={settings[k][0]}" for k in lists)
        raise ValueError(
            f"preset {preset.name} is a sweep preset: its defaults give {_names(lists)} "
            f"several values (the axes of its grid); use `fedjax-sim sweep {preset.name}`, "
            f"or give each one value to {command} one cell (e.g. --set {one}).")


def _names(keys: list[str]) -> str:
    """Setting names as a phrase: "R", "R and sigma", "R, sigma and lr"."""
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def _trained(experiment, settings: dict, command: str) -> tuple[str, ...] | None:
    """The methods this command trains (None: the experiment has no choice of method)."""
    if command == COMPARE:
        return tuple(study.compared(experiment, settings)) if experiment.methods else None
    if "method" not in experiment.declared:
        return None
    method = settings["method"]
    return tuple(method) if isinstance(method, list) else (method,)


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
    previous = {}
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
    timing: dict = {}

    def write_config():
        if resume:  # the temporary files a killed write left go as the resume starts writing
            remove_temporaries(out_dir)
        if "client_chunk" in timing:  # the plan, known once the rounds start
            record["plan"] = {"client_chunk": timing["client_chunk"]}
        write_json(out_dir / "config.json", record)

    if primary:
        # (Re)written once a checkpoint has restored (the first rows come then), with the
        # plan the rounds run under, so a refused resume (no intact checkpoint, another
        # plan) leaves the directory as it was.
        if not resume:
            write_config()
        on_rows = _after_first_rows(on_rows, write_config)
    ctx = RunContext(mesh=mesh, progress=progress and primary, checkpoint_dir=checkpoint_dir,
                     resume=resume, on_rows=on_rows, timing=timing)
    refused = False
    try:
        rows, summary = study.run(preset.experiment, settings, ctx)
    except PlanChanged as err:
        refused = True
        raise _plan_refused(out_dir, RUN, "", describe_chunk(err.saved.get("client_chunk")),
                            describe_chunk(err.now.get("client_chunk")),
                            previous.get("settings", {}), settings) from None
    finally:
        close()
        if primary and not refused and ctx.timing.get("kernel_form") is not None:
            record["kernel_form"] = ctx.timing["kernel_form"]  # the form the rounds ran in
            write_json(out_dir / "config.json", record)
    if primary:
        write_json(out_dir / "summary.json", summary)
        if preset.experiment.plot_run is not None:
            preset.experiment.plot_run(rows, summary, out_dir)
    if "diverged_round" in summary:
        raise simulate.Diverged(
            summary["diverged_round"], summary["diverged_metric"], summary["diverged_value"],
            history=rows, checkpoint_round=summary["last_checkpoint_round"],
            checkpoint_dir=checkpoint_dir.absolute() if checkpoint_dir else None,
        )
    return out_dir


def run_summary(out_dir) -> str:
    """The paragraph `fedjax-sim run` ends with: what the run found, as its experiment
    states it (`Experiment.run_facts`, from summary.json and the settings in config.json),
    and the files it wrote. Any experiment's run directory gives one."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    preset = get_preset(config["preset"])
    facts = study.run_facts(preset.experiment, summary, config["settings"])
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                   if not p.name.startswith("."))
    files = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    found = f"{'; '.join(facts)}. It" if facts else "It"
    return f"{preset.name}: {found} wrote {files} to {out_dir}."


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


def _group_cells(experiment, sweep: Sweep, cells: list[dict]) -> list[list[dict]]:
    """Cells that differ only in traced settings, together (when the sweep vmaps them)."""
    if not sweep.group:
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
        if experiment.validate is not None:
            experiment.validate(cell, SWEEP)
        if "aggregator" in experiment.declared and experiment.methods:
            robustness.check(experiment.method_table, _trained(experiment, cell, SWEEP) or (),
                             cell, sweep=True)
        cell["cell_id"] = cell_id(preset, cell)
    mesh = choose_mesh(devices)
    out_dir = Path(out_dir) if out_dir else default_out_dir(preset.name)
    primary = parallel.is_primary()
    previous = {}
    if resume:
        previous = _check_resumable(out_dir, settings, experiment.declared, SWEEP)
    else:
        _prepare_out(out_dir, SWEEP)
    sweep = study.sweep_of(experiment)
    columns = sweep.columns(axes, settings)
    trials_path = out_dir / "trials.csv"
    existing = read_csv(trials_path)
    done = {(r["cell_id"], int(r["data_seed"])) for r in existing}
    kept: list[dict] = []
    groups = _group_cells(experiment, sweep, cells)
    todo = [(group, sorted({s for c in group for s in range(c["seeds"])
                            if (c["cell_id"], s) not in done})) for group in groups]
    plan = _sweep_plan(sweep, todo, axes, out_dir, previous, settings)
    if primary:
        record = _config(preset, SWEEP, settings, mesh)
        record["axes"] = axes
        record["plan"] = plan
        if resume:
            record["started"] = previous.get("started", record["started"])
            record["resumed"] = [*previous.get("resumed", []), _now()]
            remove_temporaries(out_dir)  # a killed write's (the sweep's first write)
        write_json(out_dir / "config.json", record)
    wanted = {(c["cell_id"], s) for c in cells for s in range(c["seeds"])}
    total_cost = sum(sweep.cell_cost(c) for c in cells for s in range(c["seeds"])
                     if (c["cell_id"], s) not in done)
    with Progress(len(wanted), initial=len(done & wanted), description=preset.name,
                  unit="seed", enabled=progress and primary, total_cost=total_cost) as bar:
        for group, seeds in todo:
            size = sweep.seeds_per_chunk(group[0])
            by_id = {c["cell_id"]: c for c in group}
            for start in range(0, len(seeds), size):
                chunk = seeds[start : start + size]
                rows = [{**{a: by_id[r["cell_id"]][a] for a in axes}, **r}
                        for r in sweep.run_group(group, chunk, mesh)
                        if (r["cell_id"], r["data_seed"]) in wanted - done]
                if primary:
                    append_csv(trials_path, rows, columns)
                else:
                    kept.extend(rows)
                bar.advance(len(rows), cost=sum(sweep.cell_cost(by_id[r["cell_id"]])
                                                for r in rows),
                            postfix={a: group[0][a] for a in axes
                                     if len({c[a] for c in group}) == 1})
    trials = read_csv(trials_path) if primary else existing + kept
    summary = sweep.summarize(trials, cells, axes)
    if primary:
        write_csv(out_dir / "summary.csv", summary)
        if sweep.plot is not None:
            sweep.plot(summary, out_dir)
        if tensorboard:  # each cell's summary as scalars, one step per cell
            with TensorBoardLog(out_dir / "tensorboard") as tb:
                for i, row in enumerate(summary):
                    tb.write(i, {k: v for k, v in row.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out_dir


def _sweep_plan(sweep: Sweep, todo, axes: list[str], out_dir: Path, previous: dict,
                settings: dict) -> dict:
    """config.json's "plan" of a sweep: how many trials (cell × seed) one compiled program
    holds, per group of cells (keyed by its first cell's id; `trials_per_program`).

    On a resume, every group with trials left must plan what config.json recorded:
    otherwise it is refused, before anything is written.
    """
    saved = (previous.get("plan") or {}).get("trials_per_program", {})
    plans = {}
    for group, seeds in todo:
        key = group[0]["cell_id"]
        plans[key] = sweep.program_size(group)
        if not seeds and key in saved:
            plans[key] = saved[key]  # done: as it ran
        elif key in saved and saved[key] != plans[key]:
            shared = [f"{a}={group[0][a]}" for a in axes if len({str(c[a]) for c in group}) == 1]
            what = f"cell{'s' if len(group) > 1 else ''} {', '.join(shared)}: " if shared else ""
            raise _plan_refused(out_dir, SWEEP, what, _trials(saved[key]),
                                _trials(plans[key]), previous.get("settings", {}), settings)
    return {"trials_per_program": plans}


def _trials(count: int) -> str:
    return f"{count} trial{'' if count == 1 else 's'} per compiled program"


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
        output is written (exit code 3); its message is the one line that says
        what diverged (nothing is printed per seed).
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
    methods = tuple(study.compared(experiment, settings))
    record = {**_config(preset, COMPARE, settings), "methods": list(methods),
              "baseline": experiment.baseline}
    previous = {}
    if resume:
        previous = _check_resumable(out_dir, settings, experiment.declared, COMPARE)
        record["started"] = previous.get("started", record["started"])
        record["resumed"] = [*previous.get("resumed", []), _now()]
    else:
        _prepare_out(out_dir, COMPARE)
    problem = study.problem_for(experiment, settings)
    # Each method's data planned by the executor (`Execution.planned`) under the settings'
    # memory budget; the mesh is chosen once the first method's clients are counted.
    execution = RunContext(progress=progress).execution(settings)
    builds = {m: functools.partial(study.method_spec, experiment, m, settings, problem,
                                   execution)
              for m in methods}
    # The mesh shards the client axis of the methods' data (after its seeds axis, where the
    # data has one): the clients are counted, and --devices checked, before config.json.
    first = builds[methods[0]]()
    builds[methods[0]] = lambda: first
    mesh = choose_mesh(devices, compare.method_clients(first), "clients")
    record["mesh_devices"] = 1 if mesh is None else mesh.size
    record["plan"] = _method_plans(builds, methods, first, out_dir, resume, previous, settings)
    if primary:
        if resume:
            remove_temporaries(out_dir)  # a killed write's (the comparison's first write)
        write_json(out_dir / "config.json", record)
    results = compare.run_methods(
        builds, settings["seeds"], out_dir, execution=execution.replace(mesh=mesh),
        resume=resume, checkpoint_every=settings.get("checkpoint_every"), primary=primary)
    forms = {name: r.timing["kernel_form"] for name, r in results.items()
             if r.timing.get("kernel_form") is not None}
    if primary and forms:  # the kernel form each method's rounds ran in (`tuning`)
        record["kernel_forms"] = forms
        write_json(out_dir / "config.json", record)
    if primary:
        _write_comparison(preset, settings, problem, results, out_dir, tensorboard)
    if any(r.diverged_seeds for r in results.values()):
        raise compare.MethodsDiverged(results, out_dir)
    return out_dir


def _method_plans(builds, methods, first, out_dir: Path, resume: bool, previous: dict,
                  settings: dict) -> dict:
    """config.json's "plan": each method's `execution.plan_record` (its client chunk).

    On a resume, every method still to train (in flight or not started) must plan what
    config.json recorded: otherwise it is refused, before anything is written. Finished
    methods keep their record (they are not rebuilt).
    """
    saved = previous.get("plan") or {}
    plans = dict(saved)
    for name in methods:
        if resume and (out_dir / "methods" / f"{name}.json").exists():
            continue
        plans[name] = plan_record((first if name == methods[0] else builds[name]()).data)
        if name in saved and saved[name] != plans[name]:
            raise _plan_refused(out_dir, COMPARE, f"method {name}: ",
                                describe_chunk(saved[name].get("client_chunk")),
                                describe_chunk(plans[name]["client_chunk"]),
                                previous.get("settings", {}), settings)
    return {name: plans[name] for name in methods if name in plans}


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
    for s in preset.experiment.declared.values():
        value = defaults[s.name]
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        flags = [f for f, on in (("traced", s.traced), ("no effect on results", not s.result))
                 if on]
        if s.methods:
            flags.append(f"read by {', '.join(s.methods)}")
        if s.when:
            flags.append(f"read with {s.when[0]}={' or '.join(map(str, s.when[1]))}")
        lines.append(f"  {s.name:<18} {s.type.__name__:<5} default {shown:<14} "
                     f"range {s.describe_range():<20} {s.help}"
                     + (f" [{', '.join(flags)}]" if flags else ""))
    return "\n".join(lines)


__all__ = ["OutputError", "compare_preset", "describe_preset", "run_preset", "run_summary",
           "sweep_preset"]
