"""Repo-root pytest configuration, loaded before any test or notebook is collected.

The notebooks in `notebooks/` run at a small size by default (the size their saved
outputs come from) and at their full size with FEDJAX_SIM_NOTEBOOK_SMALL=0. Under pytest
they run through nbmake (`pytest --nbmake notebooks/`), each in a fresh Jupyter kernel;
that kernel is a child process and inherits this process's environment. Setting
FEDJAX_SIM_NOTEBOOK_SMALL=1 here, at import time, keeps them at the small size;
`setdefault` keeps an explicit FEDJAX_SIM_NOTEBOOK_SMALL=0 from the caller, to test the
full size on purpose.
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


# The default run skips the tests marked `slow` (multi-process and multi-device runs, the
# golden outputs of every preset, the benchmark suite's dry run, ...), so that the README's
# test command stays under ten minutes on two cores; `--run-slow` runs everything (CI does:
# .ci/run), an explicit `-m` expression (`-m slow`) chooses for itself, and a test named
# by its node id (`FILE::TEST`) runs.
def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (the full set, as CI runs it)")


# Slow tests marked here rather than where they are defined (`@pytest.mark.slow` does the
# same): end-to-end runs of whole presets, killed-and-resumed comparisons, subprocess CLI
# runs, and three of the four notebooks (quickstart.ipynb stays in the default run). An
# entry is a file, a test (`file::name`, every parameter) or one parametrized case;
# tests/test_slow_marks.py checks that each names an existing test.
SLOW = (
    "notebooks/drflm_molecules.ipynb",
    "notebooks/ifca_rotated_mnist.ipynb",
    "notebooks/mixed_fl.ipynb",
    "tests/test_ifca_images.py::test_cifar_views_compare_equals_copies",
    "tests/test_ifca_images.py::test_digits_quick_start_ifca_beats_global_and_local",
    "tests/test_compare_lifecycle.py::test_killed_comparison_resumes_to_identical_outputs",
    "tests/test_compare_lifecycle.py::test_the_synthetic_baselines_stay_finite_at_their_defaults",
    "tests/test_method_settings.py::test_scoped_settings_match_what_methods_read[ifca-rotated-digits]",
    "tests/test_method_settings.py::test_scoped_settings_match_what_methods_read[drfa-synthetic-noise]",
    "tests/test_method_settings.py::test_scoped_settings_match_what_methods_read[mixed-synthetic]",
    "tests/test_compilation_cache.py::test_the_cache_can_be_turned_off_or_moved_and_an_unwritable_one_is_skipped",
    "tests/test_client_sources.py::test_rounds_over_views_equal_copies_one_device",
    "tests/test_hetero.py::test_robust_clusters_preset_tiny",
    "tests/test_pfl_cifar10.py::test_the_preset_runs_alike_from_the_archive_and_npz",
    "tests/test_faults.py::test_ctrl_c_is_exit_130_and_one_line",
    "tests/test_faults.py::test_bad_distributed_settings_are_one_line",
    "tests/test_femnist.py::test_compare_end_to_end_tiny",
    "tests/test_slow_marks.py::test_every_pytest_step_of_ci_selects_tests",
    "tests/test_unseen_images.py::test_comparison_end_to_end_has_the_unseen_columns",
    "tests/test_unseen_clients.py::test_comparison_end_to_end_has_the_unseen_columns",
    "tests/test_ifca_theory.py::test_preset_runs_end_to_end",
)


def _listed_slow(nodeid: str) -> bool:
    return any(nodeid == entry or nodeid.startswith((entry + "::", entry + "["))
               for entry in SLOW)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _listed_slow(item.nodeid):
            item.add_marker("slow")
    if config.getoption("--run-slow") or config.getoption("markexpr"):
        return
    named = {os.path.relpath(arg.split("::")[0], config.rootpath) + "::" + arg.split("::", 1)[1]
             for arg in config.args if "::" in arg}

    def skipped(item):
        return item.get_closest_marker("slow") and not any(
            item.nodeid == n or item.nodeid.startswith(n + "[") or item.nodeid.startswith(n + "::")
            for n in named)

    slow = [item for item in items if skipped(item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not skipped(item)]
