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


# Three tiers. The default run skips the tests marked `slow` (multi-process and
# multi-device runs, golden outputs, end-to-end presets, ...), so that the README's test
# command stays under eight minutes on two cores; `--run-slow` adds them (CI does:
# .ci/run, about 16 minutes on two cores in all). The tests marked `exhaustive` (also
# slow) repeat what CI's set already covers on more presets, methods or devices: 14 of the
# golden cases, every method of the table once, every scoped setting against every
# method, a comparison on four devices, the benchmark suite's dry run, ...;
# `--run-exhaustive` runs everything (about 27 minutes on two cores), the check before a
# release or after a change to an experiment, the runner or the engine. An explicit `-m`
# expression (`-m slow`, `-m exhaustive`) chooses for itself, and a test named by its
# node id (`FILE::TEST`) runs.
def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (CI's set)")
    parser.addoption("--run-exhaustive", action="store_true", default=False,
                     help="also run the tests marked slow and exhaustive (everything)")


# Slow tests marked here rather than where they are defined (`@pytest.mark.slow` does the
# same): end-to-end runs of whole presets, killed-and-resumed comparisons, subprocess CLI
# runs, and three of the four notebooks (quickstart.ipynb stays in the default run). An
# entry is a file, a test (`file::name`, every parameter) or one parametrized case;
# tests/test_slow_marks.py checks that each names an existing test.
SLOW = (
    "notebooks/mixed_fl.ipynb",
    "tests/test_ifca_images.py::test_digits_quick_start_ifca_beats_global_and_local",
    "tests/test_hetero.py::test_robust_clusters_preset_tiny",
    "tests/test_pfl_cifar10.py::test_the_preset_runs_alike_from_the_archive_and_npz",
    "tests/test_faults.py::test_ctrl_c_is_exit_130_and_one_line",
    "tests/test_faults.py::test_bad_distributed_settings_are_one_line",
    "tests/test_slow_marks.py::test_every_pytest_step_of_ci_selects_tests",
    "tests/test_ifca_theory.py::test_preset_runs_end_to_end",
    # Whole presets through the runner or the CLI (their kernels are checked against
    # per-client loops in the default run).
    "tests/test_hetero.py::test_views_compare_equals_copies",
    "tests/test_hetero.py::test_compare_cli_orders_methods_with_paired_differences",
    "tests/test_unseen_images.py::test_participation_gap_compares_seen_and_unseen_clients_under_one_rule",
    "tests/test_unseen_images.py::test_unseen_clients_take_the_cluster_of_lowest_training_loss",
    "tests/test_unseen_images.py::test_seen_metrics_match_the_full_runs_layout_for_local_models",
    "tests/test_unseen_images.py::test_held_out_clients_are_the_same_for_every_method_and_never_trained_on",
    "tests/test_unseen_clients.py::test_adaptation_is_adapt_steps_of_full_batch_sgd_from_the_global_model",
    "tests/test_unseen_clients.py::test_unseen_clients_take_the_cluster_of_lowest_training_loss",
    "tests/test_cli.py::test_every_success_preset_runs_one_cell",
    "tests/test_kernel_forms.py::test_config_json_records_the_form_that_ran",
    "tests/test_compilation_cache.py::test_a_rerun_loads_every_program_from_the_cache_and_gives_the_same_numbers",
    "tests/test_protocol_fixes.py::test_drfa_presets_weight_fedavg_by_rows_and_fedavg_mixup_honours_official_code",
    "tests/test_compare_lifecycle.py::test_a_comparison_preset_runs_one_method_and_reruns_from_its_config",
    "tests/test_divergence_reporting.py::test_an_all_diverged_comparison_is_a_diverged_comparison",
    "tests/test_tuned.py::test_chosen_value_equals_a_loop_over_the_grid",
    "tests/test_tuned.py::test_grid_equals_each_point_trained_alone",
    "tests/test_memory_plan_outputs.py",
    "tests/test_ifca_images.py::test_cifar_protocol_from_local_npz",
    "tests/test_ifca_images.py::test_views_compare_equals_copies",
    "tests/test_ifca_images.py::test_cfl_thresholds_are_settings_and_the_digits_preset_splits",
    "tests/test_ifca_images.py::test_frozen_trunk_method_of_the_weight_sharing_preset",
    "tests/test_client_sources.py::test_run_with_generated_clients_equals_copies",
    "tests/test_client_sources.py::test_a_run_reports_its_long_chunked_evaluations",
    "tests/test_drfa.py::test_synthetic_noise_preset_small_drfa_chases_noisy_clients",
    "tests/test_mixed.py::test_synthetic_preset_pt_matches_gt_at_gap_zero_and_lags_at_a_large_gap",
    "tests/test_sweep.py::test_cell_equals_separate_runs",
    "tests/test_cli.py::test_every_run_preset_runs_tiny",
    "tests/test_resume.py::test_killed_run_resumes_to_identical_results",
    # Every factory twice (whole and chunked), every doctest, the guides' names against
    # the built site.
    "tests/test_surface.py::test_every_factory_runs_and_chunked_rounds_agree",
    "tests/test_doctests.py",
    "tests/test_docs_guides.py::test_every_function_a_guide_names_resolves_and_is_in_the_api_reference",
    # The schedule against the per-round rebuild for every registered algorithm (the
    # float64 loops of FedAvg, IFCA and SCAFFOLD stay in the default run).
    "tests/test_lr_schedule.py::test_schedule_equals_the_per_round_rebuild",
)


# Exhaustive tests (see above), named as in SLOW; each is also slow. CI's set still runs
# every experiment end to end (the golden cases left to it, or the slow cases of
# tests/test_every_listed_method.py), every algorithm on 1, 2 and 4 devices and the
# engine on two processes (tests/test_sharding.py), and a killed run resumed
# (tests/test_resume.py).
EXHAUSTIVE = (
    *(f"tests/test_golden.py::test_outputs_equal_the_recorded_ones[{case}]" for case in (
        "ifca-rotated-mnist-compare", "ifca-rotated-digits-cifar-protocol-compare",
        "ifca-weight-sharing-compare", "hetero-digits-compare", "hetero-digits-partial-compare",
        "hetero-mnist-compare", "drflm-esol-compare", "mixed-smile-compare",
        "mixed-movielens-compare", "mixed-charlm-wiki-compare",
        "fedavg-cifar10-pfl-dirichlet-compare", "robust-clusters-digits-compare",
        "mixed-charlm-compare", "ifca-theory-run")),
    "tests/test_femnist.py::test_compare_every_table_2_method_tiny",
    "tests/test_suite.py::test_dry_run_writes_every_section_as_strict_json",
    "tests/test_conv_forms.py::test_benchmark_dry_run_times_both_forms_as_strict_json",
    "tests/test_client_sources.py::test_rounds_over_views_equal_copies_one_device",
    "tests/test_compare_lifecycle.py::test_the_synthetic_baselines_stay_finite_at_their_defaults",
    "tests/test_compare_devices.py::test_four_devices_give_the_numbers_of_one",
    "tests/test_unseen_clients.py::test_comparison_end_to_end_has_the_unseen_columns",
    "tests/test_ifca_images.py::test_cifar_views_compare_equals_copies",
    "tests/test_compilation_cache.py::test_the_cache_can_be_turned_off_or_moved_and_an_unwritable_one_is_skipped",
    "tests/test_mixed_charlm_wiki.py::test_preset_compares_every_method_at_a_tiny_size",
    "tests/test_divergence_reporting.py::test_an_all_diverged_comparison_is_a_diverged_comparison[molecules]",
    "tests/test_divergence_reporting.py::test_an_all_diverged_comparison_is_a_diverged_comparison[images]",
    "tests/test_multiprocess_resume.py::test_killed_two_process_run_resumes_to_identical_results",
    "tests/test_sharding.py::test_sweep_on_four_devices_equals_one",
    "tests/test_client_sources.py::test_rounds_over_views_equal_copies_four_devices",
    "tests/test_femnist.py::test_compare_end_to_end_tiny",
    "tests/test_compare_lifecycle.py::test_killed_comparison_resumes_to_identical_outputs",
    "tests/test_unseen_images.py::test_comparison_end_to_end_has_the_unseen_columns",
    "tests/test_standard_workloads.py::test_dry_run_writes_both_systems_as_strict_json",
    "notebooks/drflm_molecules.ipynb",
    "notebooks/ifca_rotated_mnist.ipynb",
    "tests/test_method_settings.py::test_scoped_settings_match_what_methods_read",
    "tests/test_every_listed_method.py::test_every_listed_method_runs_tiny[ifca-rotated-cifar-ifca]",
    "tests/test_cli.py::test_every_compare_preset_compares_tiny",
    "tests/test_slow_marks.py::test_the_three_tiers_nest",
)


def _listed(nodeid: str, entries) -> bool:
    return any(nodeid == entry or nodeid.startswith((entry + "::", entry + "["))
               for entry in entries)


def _listed_slow(nodeid: str) -> bool:
    return _listed(nodeid, SLOW)


def _listed_exhaustive(nodeid: str) -> bool:
    return _listed(nodeid, EXHAUSTIVE)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _listed_exhaustive(item.nodeid):
            item.add_marker("exhaustive")
        if item.get_closest_marker("exhaustive") or _listed_slow(item.nodeid):
            item.add_marker("slow")
    if config.getoption("--run-exhaustive") or config.getoption("markexpr"):
        return
    tier = "exhaustive" if config.getoption("--run-slow") else "slow"
    named = {os.path.relpath(arg.split("::")[0], config.rootpath) + "::" + arg.split("::", 1)[1]
             for arg in config.args if "::" in arg}

    def skipped(item):
        return item.get_closest_marker(tier) and not any(
            item.nodeid == n or item.nodeid.startswith(n + "[") or item.nodeid.startswith(n + "::")
            for n in named)

    deselected = [item for item in items if skipped(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not skipped(item)]
