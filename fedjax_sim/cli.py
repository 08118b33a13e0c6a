"""The `fedjax-sim` command: run, sweep, compare, list, describe.

Exit codes: 0 done; 2 bad input (a setting, a preset, an --out of the wrong
kind: nothing written); 3 the run diverged (metrics.csv and summary.json
written); 4 --out unusable for an OS reason (unwritable, read-only, not a
directory, disk full: the message names the path and the reason).
"""

from __future__ import annotations

import argparse
import sys

from fedjax_sim.algorithms import ALGORITHMS
from fedjax_sim.data.archives import DataUnavailable

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_OUTPUT = 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedjax-sim",
        description="Vectorized federated-learning simulations (IFCA, FedAvg, baselines).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "train once and write a run directory"),
                        ("sweep", "a grid of cells (any setting given a comma list) × seeds"),
                        ("compare", "the experiment's methods side by side over seeds")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("preset", nargs="?",
                       help="preset name (see `fedjax-sim list`); optional with --config or "
                            "--resume --out DIR")
        p.add_argument(
            "--set", dest="overrides", nargs="+", action="extend", default=[],
            metavar="KEY=VALUE",
            help="override settings, e.g. --set k=4 m=80" + (
                " R=0.1,0.25 (a comma list makes an axis of cells)" if name == "sweep" else ""),
        )
        p.add_argument("--out", default=None, help="output directory (default runs/PRESET-TIME)")
        p.add_argument("--no-progress", action="store_true", help="hide progress output")
        p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                       help="off a terminal (a pipe, a SLURM log): at most one progress line "
                            "every this many seconds, plus the last (default 10)")
        p.add_argument(
            "--resume", action="store_true",
            help={"run": "continue the run in --out from its newest intact checkpoint",
                  "sweep": "continue the sweep in --out, skipping rows in its trials.csv",
                  "compare": "continue the comparison in --out: finished methods are kept, "
                             "the one in flight continues from its newest checkpoint"}[name]
            + " (its config.json gives the settings; --set may change those that do not "
              "change results)",
        )
        p.add_argument("--config", default=None, metavar="DIR/config.json",
                       help=f"rerun the {name} recorded in an output directory's config.json "
                            "(--set overrides its settings)")
        p.add_argument("--tensorboard", action="store_true",
                       help="also write TensorBoard event files to OUT/tensorboard (run: every "
                            "round metric; compare: a folder per method; sweep: a step per "
                            "cell; needs the 'tensorboard' extra)")
        if name == "compare":
            continue
        p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                       help="memory budget in GiB: the client axis (sweep: seeds) is processed "
                            "in chunks that fit (same as --set memory_budget_gb=GB)")
        p.add_argument("--devices", type=int, default=None,
                       help="devices to shard the clients (sweep: data seeds) over "
                            "(default: all that divide m)")
        if name == "sweep":
            continue
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
    sub.add_parser("list", help="list presets and algorithms")
    p = sub.add_parser("describe", help="every setting of a preset: default, range, help")
    p.add_argument("preset")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "memory_budget", None) is not None:
        args.overrides.append(f"memory_budget_gb={args.memory_budget}")
    if getattr(args, "distributed", False):
        from fedjax_sim import parallel

        parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    from fedjax_sim import experiments
    from fedjax_sim.compare import MethodsDiverged
    from fedjax_sim.simulate import Diverged

    try:
        if args.command == "list":
            print("presets:")
            for p in experiments.PRESETS.values():
                print(f"  {p.name:<26} {'/'.join(p.commands):<18} {p.description}")
            print("algorithms:")
            for name, factory in ALGORITHMS.items():
                doc = (factory.__doc__ or "").strip().splitlines()[0]
                print(f"  {name:<26} {doc}")
            return 0
        if args.command == "describe":
            print(experiments.describe_preset(args.preset))
            return 0
        progress = not args.no_progress
        if not args.progress_every >= 0:
            raise ValueError(f"--progress-every must be a number of seconds >= 0; got "
                             f"{args.progress_every}.")
        from fedjax_sim import logs

        logs.PROGRESS_EVERY_SECONDS = args.progress_every
        if args.config is not None and args.resume:
            raise ValueError("give --config (a new directory) or --resume (continue --out), "
                             "not both.")
        common = dict(progress=progress, resume=args.resume, config=args.config,
                      tensorboard=args.tensorboard)
        if args.command == "run":
            out = experiments.run_preset(args.preset, args.overrides, args.out,
                                         devices=args.devices, **common)
        elif args.command == "sweep":
            out = experiments.sweep_preset(args.preset, args.overrides, args.out,
                                           devices=args.devices, **common)
        else:
            out = experiments.compare_preset(args.preset, args.overrides, args.out, **common)
    except experiments.OutputError as err:
        print(f"fedjax-sim: error: {err.strerror or err}", file=sys.stderr)
        return EXIT_OUTPUT
    except (ValueError, DataUnavailable) as err:  # bad settings, or data not on this machine
        print(f"fedjax-sim: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (Diverged, MethodsDiverged) as err:  # every output is written by then
        print(f"fedjax-sim: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except OSError as err:  # e.g. the disk filled mid-run: the last checkpoint is kept
        print(f"fedjax-sim: error: {err.filename or ''} {err.strerror or err}; the last "
              "complete checkpoint and metrics.csv rows are kept", file=sys.stderr)
        return EXIT_OUTPUT
    import jax

    if jax.process_index() == 0:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
