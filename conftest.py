"""Repo-root pytest configuration, loaded before any test or notebook is collected.

`notebooks/quickstart.ipynb` runs at full (paper) size by default, which takes
minutes. Under pytest it runs through nbmake (`pytest --nbmake notebooks/`) in a
fresh Jupyter kernel; that kernel is a child process and inherits this process's
environment. Setting FEDJAX_SIM_NOTEBOOK_SMALL=1 here, at import time, makes the
notebook pick its seconds-long SMALL size. `setdefault` keeps an explicit
FEDJAX_SIM_NOTEBOOK_SMALL=0 from the caller, to test the full size on purpose.
"""

import os

os.environ.setdefault("FEDJAX_SIM_NOTEBOOK_SMALL", "1")

# The tests' programs are small and each is compiled once or a few times, so XLA:CPU's
# LLVM optimisation costs more than it saves: level 0 halves a typical test's wall time
# (the rotated-digits notebook: 57 s -> 30 s on 2 cores). It changes how the kernels are
# code-generated, not what they compute; every test compares two computations made under
# the same flags, or a computation with a reference within a tolerance. Subprocesses
# inherit it (tests/federations.py keeps it when it adds forced devices). Benchmarks never
# run under this file. An explicit level in the caller's XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

# The kernel forms `fedjax_sim.tuning` would otherwise time per machine: forced to the
# default, so no test's numbers depend on how loaded the machine was when a form was
# timed (tests/test_kernel_forms.py times and stores forms on purpose, in a store of its
# own). Subprocesses inherit it. An explicit FEDJAX_SIM_KERNEL_FORM from the caller is kept.
os.environ.setdefault("FEDJAX_SIM_KERNEL_FORM", "loop")

# One persistent XLA compilation cache for the whole test session, shared by the
# xdist workers and every subprocess the tests start (CLI runs, killed-and-resumed
# runs, notebook kernels), which compile the same programs over and over. It lives
# in a fresh temporary directory, so every session compiles each program once and
# no state survives between sessions. Set before any test imports jax; an explicit
# JAX_COMPILATION_CACHE_DIR from the caller is kept.
import atexit
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="fedjax_sim_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # Only the process that made it removes it (workers inherit the variable).
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
