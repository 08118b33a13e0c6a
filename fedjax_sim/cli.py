"""The `fedjax-sim` command: run, sweep, list."""

from __future__ import annotations

import argparse
import sys

from fedjax_sim.algorithms import ALGORITHMS

EXIT_DIVERGED = 3  # the run stopped on NaN/inf (exit 2: bad input)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedjax-sim",
        description="Vectorized federated-learning simulations (IFCA, FedAvg, baselines).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "train once and write a run directory"),
                        ("sweep", "success-probability sweep over a grid of cells")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("preset", help="preset name (see `fedjax-sim list`)")
        p.add_argument(
            "--set", dest="overrides", nargs="+", action="extend", default=[],
            metavar="KEY=VALUE",
            help="override settings, e.g. --set k=4 m=80" + (
                " R=0.1,0.25 (a comma list makes an axis of cells; lr=a,b,c is the lr grid "
                "searched within each cell)" if name == "sweep" else ""),
        )
        p.add_argument("--out", default=None, help="output directory (default runs/PRESET-TIME)")
        p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                       help="memory budget in GiB: the client axis (sweep: seeds) is processed "
                            "in chunks that fit (same as --set memory_budget_gb=GB)")
        p.add_argument("--devices", type=int, default=None,
                       help="devices to shard the clients (sweep: data seeds) over "
                            "(default: all that divide m)")
        p.add_argument("--distributed", action="store_true",
                       help="start JAX's multi-process runtime (jax.distributed.initialize); "
                            "each process builds only its clients, process 0 writes")
        p.add_argument("--coordinator", default=None,
                       help="host:port of process 0 (or FEDJAX_SIM_COORDINATOR; default: "
                            "auto-detected on SLURM/MPI/TPU)")
        p.add_argument("--num-processes", type=int, default=None,
                       help="number of processes (or FEDJAX_SIM_NUM_PROCESSES)")
        p.add_argument("--process-id", type=int, default=None,
                       help="this process's index (or FEDJAX_SIM_PROCESS_ID)")
        p.add_argument(
            "--resume", action="store_true",
            help="continue a sweep in --out, skipping rows in its trials.csv" if name == "sweep"
            else "continue the run in --out (same settings) from its latest checkpoint",
        )
    sub.add_parser("list", help="list presets and algorithms")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "memory_budget", None) is not None:
        args.overrides.append(f"memory_budget_gb={args.memory_budget}")
    if getattr(args, "distributed", False):
        from fedjax_sim import parallel

        parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    from fedjax_sim import experiments
    from fedjax_sim.simulate import Diverged

    try:
        if args.command == "list":
            print("presets:")
            for p in experiments.PRESETS.values():
                print(f"  {p.name:<26} {p.kind:<6} {p.description}")
            print("algorithms:")
            for name, factory in ALGORITHMS.items():
                doc = (factory.__doc__ or "").strip().splitlines()[0]
                print(f"  {name:<26} {doc}")
            return 0
        if args.command == "run":
            out = experiments.run_preset(
                args.preset, args.overrides, args.out, progress=not args.no_progress,
                devices=args.devices, resume=args.resume,
            )
        else:
            out = experiments.sweep_preset(
                args.preset, args.overrides, args.out, progress=not args.no_progress,
                resume=args.resume, devices=args.devices,
            )
    except ValueError as err:
        print(f"fedjax-sim: error: {err}", file=sys.stderr)
        return 2
    except Diverged as err:  # metrics.csv and summary.json are written by then
        print(f"fedjax-sim: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    import jax

    if jax.process_index() == 0:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
