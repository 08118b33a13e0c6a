"""Golden outputs: every preset's `run` and `compare` at tiny sizes, recorded once.

`tests/test_golden.py` reruns each case and compares what it writes with the files
recorded under `tests/golden/<case>/`: a redesign of the surface must not move a
number. Integer and text cells must be equal; float cells equal to `RTOL` (the
recording machine's bytes are reproduced exactly on that machine: run this module
with `--check` to say so; another CPU may round a fused reduction differently).

Record (after a change that is meant to move numbers, with the commit saying why):
  python tests/golden.py --write            # every case
  python tests/golden.py --write --only hetero-digits-compare
Check byte for byte on this machine:
  python tests/golden.py --check
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
RTOL = 1e-4  # float cells, across machines; on the recording machine they are equal
# ... and absolutely: a paired difference of two O(1) float32 losses (a `_diff` column)
# carries their rounding, ~1e-7 each, whatever its own size (an Intel Xeon moved one
# mixed-movielens difference of 4.1e-4 by 1.2e-7 against the AMD EPYC's recording).
ATOL = 1e-6
FILES = {"run": ("metrics.csv",), "compare": ("results.csv", "per_seed.csv", "metrics.csv")}

_SYN = ["k=2", "m=8", "n=10", "d=5", "rounds=4", "eval_every=2", "restarts=2", "n_test=5"]
_SUCCESS = ["k=2", "m=8", "n=5", "d=5", "rounds=5", "restarts=2", "R=1.0", "sigma=0.1",
            "lr=0.1"]
_DIGITS = ["n=100", "test_per_class=30", "hidden=8", "rounds=2", "seeds=2", "local_steps=2",
           "eval_every=1"]
_MNIST = ["n=20", "test_per_class=10", "hidden=8", "rounds=2", "seeds=2", "local_steps=2",
          "eval_every=1"]
_DRFA = ["num_clients=4", "noisy_clients=1", "n=8", "n_test=8", "batch_size=4",
         "local_steps=2", "rounds=4", "eval_every=2", "seeds=2"]
_ESOL = ["num_clients=4", "batch_size=8", "local_steps=2", "rounds=2", "eval_every=1",
         "seeds=2", "hidden=8", "layers=1"]
_MIXED = ["rounds=4", "eval_every=2", "seeds=2", "local_steps=2"]
_HETERO = ["rounds=2", "eval_every=1", "seeds=2", "num_clients=6", "hidden=8",
           "local_steps=2"]
_NOVA = ["rounds=20", "eval_every=10", "seeds=2", "num_clients=4", "n_max=20", "tau_max=5",
         "lr=0.05"]
# A case whose settings hold TINY_CIFAR10 runs on tiny CIFAR-10 archives `produce` writes
# (`tiny_cifar10`): no CIFAR-10 ships.
TINY_CIFAR10 = "data_dir={tiny_cifar10}"
_PFL = [TINY_CIFAR10, "datapoints_per_user=5", "batch_size=5", "cohort_size=2", "rounds=2",
        "eval_every=1", "eval_batch_size=10"]
_EVERY_HETERO = ("methods=fedavg,fedavgm,fedadam,fedyogi,fedadagrad,fedprox,scaffold,qffl,afl,"
                 "ditto,hypcluster,cfl,ifca,robust_ifca,drfa,local")

# case -> (command, preset, settings)
CASES = {
    "ifca-synthetic-run": ("run", "ifca-synthetic", _SYN),
    "ifca-synthetic-tiny-run": ("run", "ifca-synthetic-tiny", _SYN),
    "fedavg-synthetic-run": ("run", "fedavg-synthetic", _SYN),
    "local-synthetic-run": ("run", "local-synthetic", _SYN),
    "oneshot-synthetic-run": ("run", "oneshot-synthetic", [*_SYN, "pretrain_steps=2"]),
    "ifca-synthetic-option2-run": ("run", "ifca-synthetic",
                                   [*_SYN, "option=model", "local_steps=2",
                                    "participation=0.5"]),
    "ifca-synthetic-compare": ("compare", "ifca-synthetic",
                               [*_SYN, "seeds=2", "pretrain_steps=2"]),
    "ifca-success-small-run": ("run", "ifca-success-small", _SUCCESS),
    "ifca-success-r-noise-k2-run": ("run", "ifca-success-r-noise-k2", _SUCCESS),
    "ifca-theory-run": ("run", "ifca-theory",
                        ["m=4", "n=20", "d=3", "rounds=6", "seeds=2", "deltas=0.1,0.4",
                         "n_grid=12,24", "success_deltas=0.2,2.0", "success_seeds=3"]),
    "ifca-rotated-digits-run": ("run", "ifca-rotated-digits", _DIGITS),
    "ifca-rotated-digits-compare": ("compare", "ifca-rotated-digits", _DIGITS),
    # The rotated-CIFAR protocol's paths (epochs, lr decay, balanced init, partial
    # participation) on the digits, which need no local copy.
    "ifca-rotated-digits-cifar-protocol-compare": (
        "compare", "ifca-rotated-digits",
        [*_DIGITS, "sampling=epochs", "batch_size=10", "lr_decay=0.99", "init_tries=3",
         "participation=0.5", "methods=ifca,fedavg,local"]),
    "ifca-rotated-mnist-compare": ("compare", "ifca-rotated-mnist", [*_MNIST, "local_rounds=2"]),
    "ifca-weight-sharing-compare": ("compare", "ifca-weight-sharing",
                                    [*_MNIST, "pretrain_rounds=2", "warm_start_rounds=1"]),
    "drfa-synthetic-noise-run": ("run", "drfa-synthetic-noise", _DRFA),
    "drfa-synthetic-noise-compare": ("compare", "drfa-synthetic-noise", _DRFA),
    "drflm-esol-compare": ("compare", "drflm-esol", _ESOL),
    "mixed-synthetic-run": ("run", "mixed-synthetic", [*_MIXED, "m=4", "n=8", "n_c=16"]),
    "mixed-synthetic-compare": ("compare", "mixed-synthetic",
                                [*_MIXED, "m=4", "n=8", "n_c=16"]),
    "mixed-smile-compare": ("compare", "mixed-smile",
                            [*_MIXED, "m=8", "hidden=8", "clients_per_round=4"]),
    "hetero-digits-run": ("run", "hetero-digits", _HETERO),
    "hetero-digits-compare": ("compare", "hetero-digits", [*_HETERO, _EVERY_HETERO]),
    "hetero-digits-partial-compare": ("compare", "hetero-digits",
                                      [*_HETERO, _EVERY_HETERO, "participation=0.5",
                                       "batch_size=4"]),
    "hetero-mnist-compare": ("compare", "hetero-mnist", [*_HETERO, "methods=fedavg,ifca"]),
    "robust-clusters-digits-compare": ("compare", "robust-clusters-digits",
                                       [*[x for x in _HETERO if x != "num_clients=6"],
                                        "num_clients=8", "k=2"]),
    "hetero-systems-digits-compare": ("compare", "hetero-systems-digits",
                                      [*_HETERO, "participation=0.5", "availability=0.8",
                                       "dropout=0.2"]),
    "fednova-quadratic-run": ("run", "fednova-quadratic", _NOVA),
    "fednova-quadratic-compare": ("compare", "fednova-quadratic", _NOVA),
    "mixed-charlm-compare": ("compare", "mixed-charlm",
                             ["rounds=2", "eval_every=1", "seeds=2", "local_steps=1",
                              "max_clients=8", "max_per_client=2", "seq_len=10",
                              "datacenter_examples=32", "test_examples=16", "hidden=8",
                              "clients_per_round=4"]),
    "mixed-charlm-wiki-compare": ("compare", "mixed-charlm-wiki",
                                  ["rounds=2", "eval_every=1", "seeds=2", "local_steps=1",
                                   "max_clients=8", "max_per_client=2", "seq_len=10",
                                   "datacenter_examples=32", "test_examples=16", "hidden=8",
                                   "layers=1", "clients_per_round=4"]),
    "mixed-movielens-compare": ("compare", "mixed-movielens",
                                ["rounds=2", "eval_every=1", "seeds=2", "local_steps=1",
                                 "test_examples=64", "clients_per_round=8", "max_examples=5",
                                 "dim=4"]),
    "fedavg-cifar10-pfl-run": ("run", "fedavg-cifar10-pfl", _PFL),
    "fedavg-cifar10-pfl-dirichlet-compare": ("compare", "fedavg-cifar10-pfl-dirichlet",
                                             [*_PFL, "seeds=2", "central_lr=0.5"]),
}


def tiny_cifar10(root: Path) -> Path:
    """A tiny CIFAR-10 python archive (40 train, 10 test images of seeded noise, every class)
    in `root`; returns `root`."""
    import numpy as np

    from fedjax_sim.data.cifar import write_archive

    rng = np.random.default_rng(2024)
    parts = [(rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), np.arange(n) % 10)
             for n in (40, 10)]
    write_archive(root, *parts)
    return root


def case_settings(case: str, scratch: Path) -> list[str]:
    """The case's settings, its data written under `scratch` where it needs some."""
    settings = list(CASES[case][2])
    if TINY_CIFAR10 in settings:
        data = tiny_cifar10(scratch / "tiny_cifar10")
        settings = [f"data_dir={data}" if x == TINY_CIFAR10 else x for x in settings]
    return settings


def produce(case: str, out: Path) -> Path:
    """Runs one case into `out` (which must not exist); returns it."""
    from fedjax_sim import experiments
    from fedjax_sim.experiments import runner

    command, preset, _ = CASES[case]
    settings = case_settings(case, out.parent)
    if command == "run" and "checkpoint_every" in experiments.PRESETS[preset].experiment.declared:
        settings.append("checkpoint_every=0")
    fn = runner.run_preset if command == "run" else runner.compare_preset
    fn(preset, settings, out, progress=False)
    return out


def _cells(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def differences(got: Path, want: Path, rtol: float = RTOL) -> list[str]:
    """Cells of CSV `got` that differ from `want` (floats beyond rtol; the rest exactly)."""
    a, b = _cells(got), _cells(want)
    if len(a) != len(b):
        return [f"{got.name}: {len(a)} rows, recorded {len(b)}"]
    out = []
    header = b[0]
    for r, (row_a, row_b) in enumerate(zip(a, b, strict=True)):
        if len(row_a) != len(row_b):
            out.append(f"{got.name} row {r}: {len(row_a)} cells, recorded {len(row_b)}")
            continue
        for c, (x, y) in enumerate(zip(row_a, row_b, strict=True)):
            if x == y:
                continue
            fx, fy = _number(x), _number(y)
            integers = _is_int(x) and _is_int(y)
            close = not integers and fx is not None and fy is not None and (
                (math.isnan(fx) and math.isnan(fy))
                or math.isclose(fx, fy, rel_tol=rtol, abs_tol=ATOL))
            if not close:
                name = header[c] if r and c < len(header) else c
                out.append(f"{got.name} row {r} {name}: {x} (recorded {y})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="record the cases")
    group.add_argument("--check", action="store_true", help="compare byte for byte")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args(argv)
    cases = args.only or list(CASES)
    failed = 0
    for case in cases:
        command = CASES[case][0]
        with tempfile.TemporaryDirectory() as tmp:
            out = produce(case, Path(tmp) / "out")
            for name in FILES[command]:
                target = GOLDEN / case / name
                if args.write:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(out / name, target)
                elif (out / name).read_bytes() != target.read_bytes():
                    failed += 1
                    diff = differences(out / name, target, rtol=0.0)
                    print(f"{case}/{name}: differs ({len(diff)} cells), e.g. {diff[:3]}")
        print(f"{case}: {'recorded' if args.write else 'checked'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    # As under pytest (conftest.py): the default kernel form, XLA:CPU at optimisation level 0.
    os.environ.setdefault("FEDJAX_SIM_KERNEL_FORM", "loop")
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_backend_optimization_level=0").strip()
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
