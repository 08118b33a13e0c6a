"""The tests conftest.py marks slow by name exist, so a rename cannot quietly move a slow
test back into the default run (or drop a mark that no longer matches anything)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("fedjax_sim_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test")}


def test_every_slow_entry_names_an_existing_test():
    conftest = _root_conftest()
    missing = []
    for entry in (*conftest.SLOW, *conftest.EXHAUSTIVE):
        path, _, test = entry.partition("::")
        if not (ROOT / path).is_file():
            missing.append(entry)
        elif test and test.split("[")[0] not in _test_names(ROOT / path):
            missing.append(entry)
    assert not missing, f"conftest.py SLOW or EXHAUSTIVE names no such test: {missing}"


def test_listed_tests_are_matched_with_and_without_parameters():
    conftest = _root_conftest()
    assert conftest._listed_slow(
        "tests/test_faults.py::test_ctrl_c_is_exit_130_and_one_line[run-x]")
    assert conftest._listed_slow("notebooks/mixed_fl.ipynb::mixed_fl.ipynb")
    assert conftest._listed_slow(
        "tests/test_unseen_images.py::test_seen_metrics_match_the_full_runs_layout_for_local_models")
    assert not conftest._listed_slow(
        "tests/test_kernel_forms.py::test_every_form_equals_the_per_client_loop[ifca]")
    assert not conftest._listed_slow("notebooks/quickstart.ipynb::quickstart.ipynb")
    assert conftest._listed_exhaustive(
        "tests/test_golden.py::test_outputs_equal_the_recorded_ones[hetero-mnist-compare]")
    assert conftest._listed_exhaustive(
        "tests/test_method_settings.py::test_scoped_settings_match_what_methods_read[hetero-digits]")
    assert not conftest._listed_exhaustive(
        "tests/test_golden.py::test_outputs_equal_the_recorded_ones[hetero-digits-run]")


def _collected(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:xdist", "-p", "no:cacheprovider", *args,
                           "tests/test_golden.py", "tests/test_every_listed_method.py"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_the_three_tiers_nest():
    default, slow, everything = _collected(), _collected("--run-slow"), _collected(
        "--run-exhaustive")
    assert default < slow < everything
    hetero = "tests/test_golden.py::test_outputs_equal_the_recorded_ones[hetero-digits-{}]"
    assert hetero.format("run") in slow - default
    assert hetero.format("compare") in everything - slow
    assert _collected("-m", "exhaustive") == everything - slow


def _ci_pytest_commands() -> list[list[str]]:
    """Each `python -m pytest ...` line of .ci/run (continuations joined), as the
    arguments after `pytest`, with the environment assignments that precede it."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#") or "-m pytest" not in line:
            continue
        words = shlex.split(line)
        commands.append(words)
    return commands


def test_every_pytest_step_of_ci_selects_tests():
    # A step whose tests are all marked slow and that lacks --run-slow selects nothing
    # and pytest exits 5: the packaging step once did exactly that.
    commands = _ci_pytest_commands()
    assert len(commands) >= 3, commands
    for words in commands:
        env = dict(os.environ)
        while "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        args = words[words.index("pytest") + 1:]
        for flag in ("-n", "--dist"):  # collection alone, in this process
            if flag in args:
                del args[args.index(flag):args.index(flag) + 2]
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only",
                               "-p", "no:xdist", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        # Exit 5: nothing selected (--collect-only exits so too); 0: at least one test.
        assert done.returncode == 0, (words, done.stdout[-2000:], done.stderr[-2000:])
