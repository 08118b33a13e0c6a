"""Presets: a name, an experiment and default settings (a plain dict registry)."""

from __future__ import annotations

from fedjax_sim.experiments import drfa_molecules, ifca_images, ifca_synthetic, mixed
from fedjax_sim.experiments.base import Preset

# Experiment modules that declare their own presets (a module-level PRESETS list).
_EXPERIMENT_MODULES = (
    ifca_images,
    drfa_molecules,
    mixed,
)


def _success(name, k, m, n, sigma, R, lr, offset, description, d=1000):
    return Preset(name, ifca_synthetic.SUCCESS, description, {
        "k": k, "m": m, "n": n, "d": d, "sigma": sigma, "R": R, "lr": lr,
        "rounds": 300, "restarts": 10, "seeds": 40, "seed": 0,
        "threshold_offset": offset, "memory_budget_gb": 1.0,
    })


_TINY = {"m": 20, "n": 50, "d": 10, "R": 1.0, "rounds": 60, "restarts": 10, "eval_every": 10,
         "n_test": 20}

_PRESETS = [
    Preset("ifca-synthetic", ifca_synthetic.RUN,
           "IFCA (option I, gradient averaging) on the synthetic mixture of linear regressions."),
    Preset("ifca-synthetic-tiny", ifca_synthetic.RUN,
           "A seconds-long IFCA synthetic run (k=2, m=20, n=50, d=10) for smoke tests.", _TINY),
    Preset("fedavg-synthetic", ifca_synthetic.RUN,
           "FedAvg (one global model) on the synthetic mixture of linear regressions.",
           {"algorithm": "fedavg"}),
    Preset("local-synthetic", ifca_synthetic.RUN,
           "Local models (each client alone) on the synthetic mixture of linear regressions.",
           {"algorithm": "local"}),
    Preset("oneshot-synthetic", ifca_synthetic.RUN,
           "One-shot clustering (k-means of local models) on the synthetic mixture.",
           {"algorithm": "oneshot"}),
    # The four official grids (jichan3751/ifca synthetic/run_p{2,4}_{r_noise,m_n}.py).
    _success("ifca-success-r-noise-k2", 2, 100, 100, [0.0, 0.1, 0.2, 0.4],
             [0.1, 0.25, 0.5, 0.75, 1.0], [1.0, 0.1, 0.01], 0.001,
             "Fig. 3 (k=2): success probability vs R, a curve per σ; m=n=100, d=1000."),
    _success("ifca-success-r-noise-k4", 4, 400, 100, [0.0, 0.1, 0.2, 0.4],
             [0.1, 0.25, 0.5, 0.75, 1.0], [2.0, 1.0, 0.5], 0.001,
             "Fig. 3 (k=4): success probability vs R, a curve per σ; m=400, n=100, d=1000."),
    _success("ifca-success-m-n-k2", 2, [50, 70, 100, 150, 200, 300, 400], [50, 100, 200], 0.1,
             [0.1, 0.25], [1.0, 0.1, 0.01], 0.0,
             "Fig. 3 (k=2): success probability vs m, a curve per n; σ=0.1, d=1000."),
    _success("ifca-success-m-n-k4", 4, [100, 200, 300, 400, 800], [50, 100, 200], 0.1,
             [0.5, 0.75], [2.0, 1.0, 0.5], 0.0,
             "Fig. 3 (k=4): success probability vs m, a curve per n; σ=0.1, d=1000."),
    # CI scale: k=4 (at small d, k=2 succeeds everywhere), about a minute on 2 cores.
    # At d=10 and small R every θ*_j lies within 0.6σ of the others, so a seed
    # "succeeds" without clustering; n=5 keeps that regime below the R grid.
    _success("ifca-success-small", 4, 80, 5, 0.5, [0.1, 0.2, 0.4, 0.8, 1.6], [2.0, 1.0, 0.5],
             0.001, "CI-scale k=4 grid at d=10: success probability rises from ~0 to ~1 with R.",
             d=10),
]

for _module in _EXPERIMENT_MODULES:
    _PRESETS += _module.PRESETS
if len({p.name for p in _PRESETS}) != len(_PRESETS):
    raise RuntimeError("two presets share a name")
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def get_preset(name: str, command: str | None = None) -> Preset:
    """The preset `name`; ValueError listing the presets (that support `command`) otherwise."""
    preset = PRESETS.get(name)
    if preset is None or (command is not None and command not in preset.commands):
        names = sorted(p.name for p in PRESETS.values()
                       if command is None or command in p.commands)
        what = f"preset for {command}" if command else "preset"
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(names)}.")
    return preset
