"""The `fedjax-sim` command: run, sweep, compare, list, describe.

Exit codes: 0 done; 2 bad input (a setting, a preset, a data file, an --out of
the wrong kind: nothing written); 3 the run diverged (metrics.csv and
summary.json written); 4 an OS error (--out unwritable, read-only, not a
directory; the disk filled while writing): the message names the path and the
reason, and says what the output directory keeps; 130 interrupted (Ctrl-C,
SIGINT): the message says what is kept. Every error is one line on stderr;
library logs (orbax, absl, JAX) stay off the terminal unless --verbose. Compiled
programs are kept on disk between commands (`_use_compilation_cache`).

A preset's name and its `--set` values are checked against `experiments.manifest`
before JAX is imported, so a refusal answers at once; this module imports nothing
heavy at the top.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import fedjax_sim

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_OUTPUT = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells and SLURM expect


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedjax-sim",
        description="Vectorized federated-learning simulations: IFCA (clustered FL), "
                    "DRFA/DRFLM (distributionally robust FL, with mixup) and Mixed FL "
                    "(clients beside a datacenter), with FedAvg and local baselines.",
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {fedjax_sim.__version__}")
    parser.add_argument("--verbose", action="store_true",
                        help="let library logs (orbax, absl, JAX) through to stderr")
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
        p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                       help="memory budget in GiB: the client axis (sweep: seeds) is processed "
                            "in chunks that fit (same as --set memory_budget_gb=GB)")
        p.add_argument("--devices", type=int, default=None,
                       help="devices to shard the clients (sweep: data seeds) over "
                            "(default: all that divide m)" if name != "compare" else
                            "devices to shard every method's clients over (the client axis "
                            "of each seed's data; default: all that divide the clients); "
                            "results equal those on one device up to float summation order, "
                            "so --resume may change it")
        if name != "run":
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
    sub.add_parser("list", help="list presets and methods")
    p = sub.add_parser("describe", help="every setting of a preset: default, range, help")
    p.add_argument("preset")
    for p in sub.choices.values():  # --verbose also after the command
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="let library logs (orbax, absl, JAX) through to stderr")
    return parser


def _route_library_logs(verbose: bool) -> None:
    """Library logs go nowhere unless verbose (then to stderr, one line each).

    absl's `logging.log` calls `logging.basicConfig()` when the root logger has
    no handler, which sends orbax's ERROR:absl messages (and tracebacks) to the
    terminal; a root NullHandler keeps them, and every other library's log,
    off it.
    """
    root = logging.getLogger()
    if verbose:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s:%(name)s: %(message)s")
    elif not root.handlers:
        root.addHandler(logging.NullHandler())


XLA_CACHE_ENV = "FEDJAX_SIM_XLA_CACHE"
XLA_CACHE_MIN_COMPILE_SECONDS = 0.1


def _use_compilation_cache() -> str | None:
    """Keeps compiled programs on disk between commands (JAX's persistent compilation cache).

    A rerun with the same shapes and settings (a resume, a comparison run again, a sweep
    started anew) loads its programs instead of compiling them: the digits comparison of
    the quick start takes ~10 s instead of ~22 on 2 cores. The cache is keyed by the
    program, the compiler options and flags, and the jax/jaxlib versions, so it never
    changes a number. Where: $FEDJAX_SIM_XLA_CACHE, else `xla/` in the data cache
    ($FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim); FEDJAX_SIM_XLA_CACHE=off turns it off,
    and a JAX_COMPILATION_CACHE_DIR of the caller's own is left as it is. Programs that
    compile in under 0.1 s are not kept (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, if
    set, decides). A cache that cannot be written is skipped, never an error.

    Returns the directory in use, or None.
    """
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    choice = os.environ.get(XLA_CACHE_ENV, "").strip()
    if choice.lower() in ("0", "off", "false", "no", "none"):
        return None
    from pathlib import Path

    from fedjax_sim.data.archives import cache_root

    path = Path(choice).expanduser() if choice else cache_root() / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            return None
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          XLA_CACHE_MIN_COMPILE_SECONDS)
    return str(path)


def _error(message: str) -> None:
    """One line on stderr, whatever the message holds."""
    print("fedjax-sim: " + " ".join(str(message).split()), file=sys.stderr)


def _kept(err: BaseException) -> str:
    """What the command's output directory keeps, as its runner said (nothing if it had not
    started)."""
    return getattr(err, "kept", None) or "nothing was written to the output directory"


def _check_declared(args) -> None:
    """The preset's name and `--set` values, checked against its declarations before
    JAX is imported (`experiments.manifest`): ValueError with the full check's message.
    A --config or --resume takes its settings from a file, checked in full later."""
    if (args.command in ("run", "sweep", "compare") and args.preset is not None
            and args.config is None and not args.resume):
        from fedjax_sim.experiments import manifest

        manifest.check(args.command, args.preset, args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _route_library_logs(args.verbose)
    if getattr(args, "memory_budget", None) is not None:
        args.overrides.append(f"memory_budget_gb={args.memory_budget}")
    try:
        _check_declared(args)
    except ValueError as err:
        _error(f"error: {err}")
        return EXIT_BAD_INPUT
    from fedjax_sim import experiments
    from fedjax_sim.compare import MethodsDiverged
    from fedjax_sim.data.archives import DataUnavailable
    from fedjax_sim.simulate import Diverged

    try:
        if getattr(args, "distributed", False):
            from fedjax_sim import parallel

            parallel.initialize_distributed(args.coordinator, args.num_processes,
                                            args.process_id)
        if args.command == "list":
            print("presets:")
            for p in experiments.PRESETS.values():
                print(f"  {p.name:<26} {'/'.join(p.commands):<18} {p.description}")
            from fedjax_sim.experiments.methods import METHODS

            print("methods (--set method=NAME or methods=A,B; `describe PRESET` lists those "
                  "that fit it):")
            for name, method in METHODS.items():
                built = "" if method.algorithm == name else f" [algorithm {method.algorithm}]"
                print(f"  {name:<26} {method.help}{built}")
            return 0
        if args.command == "describe":
            print(experiments.describe_preset(args.preset))
            return 0
        _use_compilation_cache()
        progress = not args.no_progress
        from fedjax_sim import logs

        try:
            logs.set_progress_every(args.progress_every)
        except ValueError:
            raise ValueError(f"--progress-every must be a number of seconds >= 0; got "
                             f"{args.progress_every}.") from None
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
            out = experiments.compare_preset(args.preset, args.overrides, args.out,
                                             devices=args.devices, **common)
    except experiments.OutputError as err:  # --out refused before anything was written
        _error(f"error: {err.strerror or err}")
        return EXIT_OUTPUT
    except (ValueError, DataUnavailable) as err:  # bad settings, or data not on this machine
        _error(f"error: {err}")
        return EXIT_BAD_INPUT
    except (Diverged, MethodsDiverged) as err:  # every output is written by then
        _error(str(err))
        return EXIT_DIVERGED
    except OSError as err:  # e.g. the disk filled mid-run
        where = err.filename or getattr(err, "out_dir", None)
        _error(f"error: {f'{where}: ' if where else ''}{err.strerror or err}; {_kept(err)}")
        return EXIT_OUTPUT
    except KeyboardInterrupt as err:
        _error(f"interrupted; {_kept(err)}")
        return EXIT_INTERRUPTED
    import jax

    if jax.process_index() == 0:
        print(experiments.run_summary(out) if args.command == "run" else f"wrote {out}")
    return 0


def console_main() -> None:
    """The `fedjax-sim` command: `main`, then exit with its code. An interrupted command
    (130) leaves at once after its one line: JAX's and orbax's threads may still be inside
    a compiled call or a save, and tearing the interpreter down around them can crash
    (a segfault instead of 130); what the command keeps is on disk by then."""
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
