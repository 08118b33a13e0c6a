"""Client data held as stored copies vs views (clients=copies | views), per dataset.

Usage:
  python benchmarks/memory_views.py --out benchmarks/results/memory_views.json
  python benchmarks/memory_views.py --cases digits,hetero-digits --out /tmp/mv.json

For each case (a preset with its own data sizes, a few settings changed where
named below) and each kind of clients, in a fresh subprocess:

  bytes: the experiment's problem is built (`build_problem`) and the nbytes of
    every array leaf of its client data (train, test and, for the rotated
    presets, paired test clients; seeds stacked) are summed: copies hold every
    client's rows, views hold the index arrays and the base images they index
    (held once for every seed; a buffer two parts share counted once).
    peak_build_mib is the process's VmHWM after
    building (Python, JAX and the decoded dataset included).
  rss: one small compare (`fedjax-sim compare PRESET --set rounds=1
    methods=<baseline> ...`, written to a temporary directory), the process's
    peak RSS (VmHWM) at its end: data building, compilation, one round and the
    evaluations included.

A third point, `import`, is the VmHWM of a process that only imports
fedjax_sim and JAX (what every other row carries too). Rotated CIFAR reads
CIFAR-10 from data_dir; with none here, random uint8 images of CIFAR-10's
shape are written to a temporary data_dir (--cifar-train/--cifar-test images).
The JSON written to --out holds the rows and `meta` (CPU model, git HEAD, load).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import harness

# case -> (preset, settings changed for both kinds, the compare's extra settings)
CASES = {
    "digits": ("ifca-rotated-digits", {}, {"methods": "fedavg"}),
    "mnist": ("ifca-rotated-mnist", {}, {"methods": "fedavg"}),
    "cifar": ("ifca-rotated-cifar", {"seeds": 1},
              {"methods": "fedavg", "local_steps": 1, "augment": False}),
    "hetero-digits": ("hetero-digits", {}, {"methods": "fedavg"}),
    "hetero-mnist": ("hetero-mnist", {}, {"methods": "fedavg"}),
    "robust-clusters-digits": ("robust-clusters-digits", {}, {"methods": "ifca"}),
}
SMALL = {"rounds": 1, "eval_every": 1, "checkpoint_every": 0}


def _vmhwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _fake_cifar(root: Path, train: int, test: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    (root / "cifar10").mkdir(parents=True, exist_ok=True)
    for split, size in (("train", train), ("test", test)):
        np.savez(root / "cifar10" / f"{split}.npz",
                 x=rng.integers(0, 256, size=(size, 32, 32, 3), dtype=np.uint8),
                 y=rng.integers(0, 10, size=size))


def point(case: str, kind: str, clients: str, data_dir: str) -> dict:
    """One (case, kind, clients) in this process."""
    import jax

    import fedjax_sim  # noqa: F401  (the import point's baseline)

    if kind == "import":
        return {"peak_rss_mib": _vmhwm_mib()}
    from fedjax_sim import cli
    from fedjax_sim.experiments import get_preset, resolve_settings

    name, changed, small = CASES[case]
    changed = {**changed, "clients": clients}
    if case == "cifar":
        changed["data_dir"] = data_dir
    if kind == "bytes":
        preset = get_preset(name)
        s = resolve_settings(preset, changed, "compare")
        module = sys.modules[type(preset.experiment).__module__.rsplit(".", 1)[0]]
        problem = module.build_problem(s)
        parts = [problem[p] for p in ("train", "test", "paired") if p in problem]
        # Each buffer once: paired test views share the test views' base array.
        nbytes = sum({id(a): a.nbytes for a in jax.tree.leaves(parts)}.values())
        return {"client_data_bytes": int(nbytes), "peak_build_mib": _vmhwm_mib(),
                "seeds": s["seeds"]}
    with tempfile.TemporaryDirectory() as out:
        settings = {**changed, **SMALL, **small}
        started = time.perf_counter()
        code = cli.main(["compare", name, "--set", *(f"{k}={v}" for k, v in settings.items()),
                         "--out", str(Path(out) / "cmp"), "--no-progress"])
        return {"exit": code, "peak_rss_mib": _vmhwm_mib(),
                "compare_s": time.perf_counter() - started, "settings": settings}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kinds", default="bytes,rss")
    parser.add_argument("--cifar-train", type=int, default=10_000)
    parser.add_argument("--cifar-test", type=int, default=2_000)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    parser.add_argument("--out", default="benchmarks/results/memory_views.json")
    parser.add_argument("--point", nargs=4, metavar=("CASE", "KIND", "CLIENTS", "DATA_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        print(json.dumps(point(*args.point)), flush=True)
        return
    started = time.perf_counter()
    meta = harness.collect_meta(cases={c: CASES[c] for c in args.cases.split(",")},
                                small=SMALL, cifar_images=[args.cifar_train, args.cifar_test])
    rows = []
    with tempfile.TemporaryDirectory() as data_dir:
        if "cifar" in args.cases.split(","):
            _fake_cifar(Path(data_dir), args.cifar_train, args.cifar_test)
        todo = [("-", "import", "-")] + [
            (case, kind, clients) for case in args.cases.split(",")
            for kind in args.kinds.split(",") for clients in ("copies", "views")]
        for case, kind, clients in todo:
            row = harness.run_point_subprocess(__file__, ["--point", case, kind, clients,
                                                          data_dir], timeout=args.timeout)
            row.update(case=case, kind=kind, clients=clients)
            rows.append(row)
            print(json.dumps(harness.strict_json(row)), file=sys.stderr, flush=True)
    harness.write_json(args.out, {"meta": harness.finish_meta(meta, started), "rows": rows})


if __name__ == "__main__":
    main()
