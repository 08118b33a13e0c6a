"""Experiment presets (a plain dict registry) and the drivers that write run directories."""

from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jax

import fedjax_sim
from fedjax_sim import parallel, plots, simulate, sweep
from fedjax_sim.experiments import ifca_synthetic
from fedjax_sim.experiments.settings import parse_assignments, resolve
from fedjax_sim.io import read_json, write_csv, write_json


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "run" or "sweep"
    description: str
    defaults: dict = field(default_factory=dict)


def _success_grid(k, m, n, sigma, R, lr, offset, description, d=1000):
    return {
        "k": k, "m": m, "n": n, "d": d, "sigma": sigma, "R": R, "lr": lr,
        "rounds": 300, "restarts": 10, "seeds": 40, "seed": 0,
        "threshold_offset": offset, "memory_budget_gb": 1.0,
    }, description


_GRIDS = {
    # The four official grids (jichan3751/ifca synthetic/run_p{2,4}_{r_noise,m_n}.py).
    "ifca-success-r-noise-k2": _success_grid(
        2, 100, 100, [0.0, 0.1, 0.2, 0.4], [0.1, 0.25, 0.5, 0.75, 1.0], [1.0, 0.1, 0.01], 0.001,
        "Fig. 3 (k=2): success probability vs R, a curve per σ; m=n=100, d=1000.",
    ),
    "ifca-success-r-noise-k4": _success_grid(
        4, 400, 100, [0.0, 0.1, 0.2, 0.4], [0.1, 0.25, 0.5, 0.75, 1.0], [2.0, 1.0, 0.5], 0.001,
        "Fig. 3 (k=4): success probability vs R, a curve per σ; m=400, n=100, d=1000.",
    ),
    "ifca-success-m-n-k2": _success_grid(
        2, [50, 70, 100, 150, 200, 300, 400], [50, 100, 200], 0.1, [0.1, 0.25],
        [1.0, 0.1, 0.01], 0.0,
        "Fig. 3 (k=2): success probability vs m, a curve per n; σ=0.1, d=1000.",
    ),
    "ifca-success-m-n-k4": _success_grid(
        4, [100, 200, 300, 400, 800], [50, 100, 200], 0.1, [0.5, 0.75],
        [2.0, 1.0, 0.5], 0.0,
        "Fig. 3 (k=4): success probability vs m, a curve per n; σ=0.1, d=1000.",
    ),
    # CI scale: k=4 (at small d, k=2 succeeds everywhere), about a minute on 2 cores.
    # At d=10 and small R every θ*_j lies within 0.6σ of the others, so a seed
    # "succeeds" without clustering; n=5 keeps that regime below the R grid.
    "ifca-success-small": _success_grid(
        4, 80, 5, 0.5, [0.1, 0.2, 0.4, 0.8, 1.6], [2.0, 1.0, 0.5], 0.001,
        "CI-scale k=4 grid at d=10: success probability rises from ~0 to ~1 with R.", d=10,
    ),
}

PRESETS: dict[str, Preset] = {
    "ifca-synthetic": Preset(
        "ifca-synthetic", "run",
        "IFCA (option I, gradient averaging) on the synthetic mixture of linear regressions.",
        dict(ifca_synthetic.RUN_DEFAULTS),
    ),
    "ifca-synthetic-tiny": Preset(
        "ifca-synthetic-tiny", "run",
        "A seconds-long IFCA synthetic run (k=2, m=20, n=50, d=10) for smoke tests.",
        {**ifca_synthetic.RUN_DEFAULTS, "m": 20, "n": 50, "d": 10, "R": 1.0, "rounds": 60,
         "restarts": 10, "eval_every": 10, "n_test": 20},
    ),
    **{name: Preset(name, "sweep", desc, grid) for name, (grid, desc) in _GRIDS.items()},
}

SWEEP_AXES = ifca_synthetic.SWEEP_KEYS
TRIAL_COLUMNS = [
    *SWEEP_AXES, "data_seed", "best_min_dist", "success", "best_lr", "best_restart",
    "diverged_runs", "all_diverged",
]


def get_preset(name: str, kind: str | None = None) -> Preset:
    preset = PRESETS.get(name)
    if preset is None or (kind is not None and preset.kind != kind):
        names = sorted(p.name for p in PRESETS.values() if kind is None or p.kind == kind)
        raise ValueError(f"unknown {kind or ''} preset {name!r}; known: {', '.join(names)}.")
    return preset


def resolve_settings(preset: Preset, overrides: dict[str, str] | list[str] | None) -> dict:
    if isinstance(overrides, list):
        overrides = parse_assignments(overrides)
    list_keys = frozenset((*SWEEP_AXES, "lr")) if preset.kind == "sweep" else frozenset()
    settings = resolve(preset.defaults, overrides or {}, list_keys)
    if preset.kind == "sweep" and not isinstance(settings["lr"], list):
        settings["lr"] = [settings["lr"]]
    return settings


def _config(preset: Preset, settings: dict, mesh=None) -> dict:
    return {
        "preset": preset.name,
        "kind": preset.kind,
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
        "command": sys.argv,
        "started": _now(),
    }


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def default_out_dir(name: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def _fresh_dir(out_dir: Path, marker: str) -> None:
    if (out_dir / marker).exists():
        raise ValueError(
            f"output directory {out_dir} already holds a {marker}; choose another --out."
        )


def choose_mesh(devices: int | None, num_clients: int | None = None):
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
        parallel.check_divisible(num_clients, mesh)
    return mesh if devices > 1 or jax.process_count() > 1 else None


def _check_resumable(out_dir: Path, settings: dict) -> dict:
    """The config.json of the run to resume in out_dir; ValueError unless its settings match."""
    path = out_dir / "config.json"
    if not path.exists():
        raise ValueError(
            f"cannot resume: {out_dir} holds no config.json (no run was started there)."
        )
    config = read_json(path)
    saved = config.get("settings", {})
    differ = sorted(k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k))
    if differ:
        changes = ", ".join(f"{k} ({saved.get(k)!r} there, {settings.get(k)!r} now)"
                            for k in differ)
        raise ValueError(
            f"cannot resume {out_dir}: settings differ from its config.json: {changes}. "
            "Resume with the same settings, or start a new run in another --out."
        )
    return config


def run_preset(
    name: str,
    overrides=None,
    out_dir=None,
    progress: bool = True,
    devices: int | None = None,
    resume: bool = False,
) -> Path:
    """Runs a 'run' preset and writes config.json, metrics.csv, summary.json, metrics.png.

    Checkpoints go to OUT/checkpoints every `checkpoint_every` rounds; with
    resume=True the run in out_dir (same settings) continues from its latest
    checkpoint. Only process 0 writes the run's files; with several devices
    the clients are sharded; with several processes `out_dir` must be on
    storage every process shares: all of them write their shards of each
    checkpoint there and read config.json and the checkpoints on resume.

    Raises:
      simulate.Diverged: every restart went NaN/inf; metrics.csv (up to the
        last good evaluation) and summary.json ("diverged": true) are written first.
    """
    preset = get_preset(name, "run")
    settings = resolve_settings(preset, overrides)
    ifca_synthetic.validate_run(settings)  # before anything is written
    mesh = choose_mesh(devices, settings["m"])
    out_dir = Path(out_dir) if out_dir else default_out_dir(name)
    primary = parallel.is_primary()
    checkpoint_dir = out_dir / "checkpoints" if settings["checkpoint_every"] else None
    config = _config(preset, settings, mesh)
    # Every process checks (so all of them stop on a bad --out or --resume)
    # before process 0 rewrites the config.json the others read.
    if resume:
        previous = _check_resumable(out_dir, settings)
        config["started"] = previous.get("started", config["started"])
        config["resumed"] = [*previous.get("resumed", []), _now()]
    else:
        _fresh_dir(out_dir, "config.json")
    parallel.sync_processes("fedjax_sim: run directory checked")
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "config.json", config)
    rows, summary = ifca_synthetic.run(
        settings, progress=progress and primary, mesh=mesh,
        checkpoint_dir=checkpoint_dir, resume=resume,
    )
    if primary:
        write_csv(out_dir / "metrics.csv", rows)
        write_json(out_dir / "summary.json", summary)
        plots.plot_run(
            rows, out_dir / "metrics.png",
            title=f"{name}: IFCA, k={settings['k']}, R={settings['R']}",
            threshold=summary["success_threshold"],
        )
    if "diverged_round" in summary:
        raise simulate.Diverged(
            summary["diverged_round"], summary["diverged_metric"], summary["diverged_value"],
            history=rows, checkpoint_round=summary["last_checkpoint_round"],
            checkpoint_dir=checkpoint_dir.absolute() if checkpoint_dir else None,
        )
    return out_dir


def sweep_preset(
    name: str,
    overrides=None,
    out_dir=None,
    progress: bool = True,
    resume: bool = False,
    devices: int | None = None,
) -> Path:
    """Runs a 'sweep' preset: trials.csv (appended per chunk), summary.csv, plots.

    With several devices the data-seed axis of each chunk is sharded over them.
    """
    preset = get_preset(name, "sweep")
    settings = resolve_settings(preset, overrides)
    cells = sweep.expand_cells(settings, SWEEP_AXES)
    if not cells:
        raise ValueError("the sweep has no cells: every axis needs at least one value.")
    for cell in cells:  # every cell is checked before anything is written
        ifca_synthetic.validate_cell(cell)
    if not settings["memory_budget_gb"] > 0:
        raise ValueError(
            f"setting memory_budget_gb must be > 0; got {settings['memory_budget_gb']!r}."
        )
    mesh = choose_mesh(devices)
    out_dir = Path(out_dir) if out_dir else default_out_dir(name)
    primary = parallel.is_primary()
    if primary:
        if not resume:
            _fresh_dir(out_dir, "trials.csv")
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "config.json", _config(preset, settings, mesh))
    budget = settings["memory_budget_gb"] * 2**30
    summary = sweep.run_sweep(
        cells,
        lambda cell, seeds: ifca_synthetic.seed_trials(cell, seeds, mesh),
        lambda cell: ifca_synthetic.seeds_per_chunk(cell, budget),
        out_dir,
        axes=SWEEP_AXES,
        trial_columns=TRIAL_COLUMNS,
        progress=progress and primary,
        write=primary,
    )
    if primary:
        sweep.write_summary(summary, out_dir)
        plots.plot_success(summary, out_dir)
    return out_dir


__all__ = [
    "PRESETS",
    "Preset",
    "get_preset",
    "resolve_settings",
    "run_preset",
    "sweep_preset",
]
