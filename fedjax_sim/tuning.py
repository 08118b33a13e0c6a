"""Kernel forms chosen per machine: timed once per round shape, remembered on disk.

IFCA option I's fused linear kernel (`ops.linear`) can be computed by several
programs (`ops.linear.LINEAR_FORMS`) that give the same numbers up to float
rounding. Which is fastest depends on the CPU (its vector units, whether
YNNPACK's dot gets a thread), on the sizes, and on whether rounds are called
one by one or scanned inside one compiled chunk. So the executor does not
guess: the first time a program holding the kernel is compiled on a machine,
each form is compiled and timed for a few rounds (as XLA autotunes its GPU
kernels and FFTW plans its transforms), the fastest is kept, and the choice
is written to `kernel_forms.json` in the data cache, beside the compilation
cache, keyed by the program and the machine. Later runs of the same shapes
read it back and time nothing.

- The default form ("loop") is kept unless another is `MARGIN` faster, so a
  noisy measurement falls back on the simplest program.
- `FEDJAX_SIM_KERNEL_FORM=loop|dot|dot_ynn` forces a form (`auto`, the default,
  chooses); `FEDJAX_SIM_KERNEL_FORMS=off` (or a file path) turns the store off
  (or moves it). A store that cannot be read, or whose entry was written on
  another machine or by another version, is ignored (and rewritten).
- On a CPU, where the clients' rows outgrow a core's cache, each form is also
  timed processing the clients a cache-sized chunk at a time
  (`memory.cache_chunk`: the round reads the rows twice, for the residuals and
  for the gradients, and a chunk's second read then comes from the cache). The
  chunked program is kept only when the timing finds it faster (on a 2-core
  Intel Xeon it is at m = 10⁵ clients of 10 rows × 10 features, and is not at
  10⁴, whose rows the caches mostly hold: benchmarks/kernel_forms.py): the chunk
  is the executor's to choose, never an algorithm's flag.
  It adds the round's sums chunk by chunk, so the numbers may differ from the
  plan's chunk in their last bits; the choice is recorded (`Choice.client_chunk`)
  beside the form, and it never raises the memory plan's chunk.
- A resumed run takes the form (and chunk) its checkpoint recorded, so it
  continues bit for bit; `config.json` and `summary.json` name the form that ran.

`simulate.run` plans its chunks with `plan_scan`; a Python loop over single
rounds (a benchmark, a notebook) compiles them with `compile_round`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax

from fedjax_sim import backend, memory
from fedjax_sim.execution import plan_of, planned
from fedjax_sim.ops.linear import DEFAULT_LINEAR_FORM, LINEAR_FORMS

FORM_ENV = "FEDJAX_SIM_KERNEL_FORM"
STORE_ENV = "FEDJAX_SIM_KERNEL_FORMS"
STORE_NAME = "kernel_forms.json"
STORE_VERSION = 2  # 2: the cache-sized client chunk is a candidate too
# The name of ops.linear's jitted gradient sums in a lowered program: its presence says
# that the program has a form to choose.
MARKER = "@_grad_sums"
MARGIN = 0.95  # another form is taken when its time is below this × the default's
TUNE_ROUNDS = 8  # rounds per timed sample (one scanned chunk, or chained calls)
TUNE_SAMPLES = 7  # timed samples per form, forms alternating (after one warm-up each)
MODES = ("scan", "call")


class Choice(NamedTuple):
    """The form a program runs in, and how it was decided.

    form: one of `ops.linear.LINEAR_FORMS`.
    source: "forced" (FEDJAX_SIM_KERNEL_FORM, the caller, or a checkpoint),
      "stored" (read from the store), or "timed" (measured now).
    seconds: per candidate (`arm`), the seconds of its median sample (None unless
      timed).
    client_chunk: the cache-sized client chunk the timing chose over the data's plan
      (`memory.cache_chunk`); None: the plan's chunk, as it is.
    """

    form: str
    source: str
    seconds: dict | None = None
    client_chunk: int | None = None

    @property
    def arm(self) -> str:
        """The candidate's name: `arm(form, client_chunk)`."""
        return arm(self.form, self.client_chunk)

    def record(self) -> dict:
        """What config.json and summary.json say of it."""
        out = {"form": self.form, "source": self.source}
        if self.client_chunk is not None:
            out["client_chunk"] = self.client_chunk
        if self.seconds is not None:
            out["seconds_per_sample"] = self.seconds
        return out


def arm(form: str, client_chunk: int | None = None) -> str:
    """A candidate's name: the form, and "/c" when it processes c clients at a time
    instead of the plan's chunk ("loop", "loop/4762")."""
    return form if client_chunk is None else f"{form}/{client_chunk}"


def parse_arm(name) -> tuple[str, int | None] | None:
    """(form, client_chunk) of a candidate's name; None when it names none."""
    if not isinstance(name, str):
        return None
    form, _, chunk = name.partition("/")
    if form not in LINEAR_FORMS:
        return None
    if not chunk:
        return form, None
    return (form, int(chunk)) if chunk.isdigit() and int(chunk) >= 1 else None


def forced_form() -> str | None:
    """The form FEDJAX_SIM_KERNEL_FORM forces (None: unset, empty or "auto").

    Raises:
      ValueError: a value that is no form, naming the variable and the forms.
    """
    value = os.environ.get(FORM_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value not in LINEAR_FORMS:
        raise ValueError(f"{FORM_ENV}={value!r} is no kernel form; use one of "
                         f"{', '.join(LINEAR_FORMS)} or auto.")
    return value


def store_path() -> Path | None:
    """Where chosen forms are kept: `$FEDJAX_SIM_KERNEL_FORMS` (a file; "off": nowhere), else
    `kernel_forms.json` in the data cache (`$FEDJAX_SIM_CACHE` or `~/.cache/fedjax_sim`)."""
    from fedjax_sim.data.archives import cache_root

    value = os.environ.get(STORE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no", "none"):
        return None
    return Path(value).expanduser() if value else cache_root() / STORE_NAME


def _cpu() -> dict:
    """The CPU as /proc/cpuinfo names it: model and a digest of its feature flags (two
    machines sold under one name may differ in vector units)."""
    model, flags = platform.processor() or None, ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "model name" and model in (None, platform.processor()):
                    model = value.strip()
                elif name in ("flags", "features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return {"model": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "cores": os.cpu_count()}


def machine() -> dict:
    """What a stored choice is valid for: the device, the CPU and the software."""
    from fedjax_sim import __version__
    from fedjax_sim.provenance import package_versions

    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": device.device_kind,
            "devices": jax.device_count(), "cpu": _cpu(), "jax": jax.__version__,
            "jaxlib": package_versions(("jaxlib",))["jaxlib"], "fedjax_sim": __version__,
            "store_version": STORE_VERSION}


def program_key(text: str, mode: str) -> str:
    """The store's key of a program (its lowered text, at the default form) in a mode."""
    return hashlib.sha256(f"{mode}\n{text}".encode()).hexdigest()


def _read_store(path: Path | None) -> dict:
    """The store's entries ({key: entry}); {} when absent, unreadable or corrupt."""
    if path is None:
        return {}
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = payload.get("entries") if isinstance(payload, dict) else None
    return entries if isinstance(entries, dict) else {}


def stored_form(key: str, path: Path | None = None,
                arms: tuple[str, ...] | None = None) -> str | None:
    """The candidate (`arm`) stored for `key` on this machine; None when there is none, or
    when the entry is corrupt, names no candidate (of `arms` where given), or was written
    on another machine or by another version."""
    path = store_path() if path is None else path
    entry = _read_store(path).get(key)
    if not isinstance(entry, dict) or entry.get("machine") != machine():
        return None
    form = entry.get("form")
    if parse_arm(form) is None or (arms is not None and form not in arms):
        return None
    return form


def remember(key: str, choice: Choice, path: Path | None = None) -> None:
    """Adds `choice` under `key` (atomically: a write that fails leaves the store as it was,
    and a store that cannot be written is skipped, never an error)."""
    path = store_path() if path is None else path
    if path is None:
        return
    entries = _read_store(path)
    entries[key] = {"form": choice.arm, "machine": machine(), "seconds": choice.seconds,
                    "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"entries": entries}, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def has_forms(lowered) -> bool:
    """Whether a lowered program holds a kernel with forms to choose."""
    return MARKER in lowered.as_text()


def time_forms(run: dict[str, Callable[[], Any]], samples: int = TUNE_SAMPLES) -> dict:
    """{form: median sample's seconds} of each thunk (blocked until ready), after one
    warm-up call each, the forms alternating and their order reversed every sample, so
    every form meets the same load. The median, not the fastest sample: candidates differ
    in how much other load slows them (a whole-cohort pass streaming 40 MB of rows twice
    competes for memory bandwidth, a cache-sized chunk much less: on a shared 2-core
    Intel Xeon at m = 10⁵ their fastest samples were within 5 % of each other, their
    medians 0.70–0.80× apart, benchmarks/README.md), and a run meets the load its
    timing met."""
    names = list(run)
    for name in names:
        jax.block_until_ready(run[name]())
    seconds = {name: [] for name in names}
    for sample in range(samples):
        for name in names if sample % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(run[name]())
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def fastest(seconds: dict) -> str:
    """The default form (at the plan's chunk) unless another candidate's time is below
    MARGIN × the default's."""
    best = min(seconds, key=seconds.get)
    if DEFAULT_LINEAR_FORM in seconds and seconds[best] >= MARGIN * seconds[DEFAULT_LINEAR_FORM]:
        return DEFAULT_LINEAR_FORM
    return best


def candidates(feature_size: int | None, client_chunk: int | None = None) -> tuple[str, ...]:
    """The forms that compile to different programs at this feature size ("dot_ynn" differs
    from "dot" only in its compiler options for narrow features on CPU), each also at
    `client_chunk` clients at a time where one is given (`arm` names them)."""
    same = (backend.compiler_options(feature_size, "dot")
            == backend.compiler_options(feature_size, "dot_ynn"))
    forms = tuple(f for f in LINEAR_FORMS if not (same and f == "dot_ynn"))
    chunked = () if client_chunk is None else tuple(arm(f, client_chunk) for f in forms)
    return forms + chunked


def chunk_candidate(data) -> int | None:
    """The cache-sized client chunk timed beside the data's plan (`memory.cache_chunk`),
    only on a CPU and only where it is smaller than the plan's chunk (so no candidate
    holds more at once than the memory plan allows); None: none."""
    if jax.default_backend() != "cpu":
        return None
    chunk = memory.cache_chunk(data)
    if chunk is None:
        return None
    planned_chunk = plan_of(data).client_chunk
    return chunk if planned_chunk is None or chunk < planned_chunk else None


def planned_arm(data, name: str):
    """`data` planned to run candidate `name` (`arm`): its form, and its chunk if it names
    one."""
    form, chunk = parse_arm(name)
    changes = {"linear_form": form}
    if chunk is not None:
        changes["client_chunk"] = chunk
    return planned(data, **changes)


def choose(key: str, build: Callable[[str], Callable[[], Any]], feature_size: int | None,
           forced: str | None = None, client_chunk: int | None = None) -> Choice:
    """The form of one program: `forced` (a form, or a candidate's `arm` name), else
    FEDJAX_SIM_KERNEL_FORM, else the stored choice for `key`, else timed now (each
    candidate's `build(arm)()` runs TUNE_ROUNDS rounds; `candidates`, with client_chunk
    the chunked ones) and stored."""
    forced = forced or forced_form()
    if forced is not None:
        form, chunk = parse_arm(forced) or (forced, None)
        return Choice(form, "forced", client_chunk=chunk)
    arms = candidates(feature_size, client_chunk)
    stored = stored_form(key, arms=arms)
    if stored is not None:
        form, chunk = parse_arm(stored)
        return Choice(form, "stored", client_chunk=chunk)
    seconds = time_forms({name: build(name) for name in arms})
    form, chunk = parse_arm(fastest(seconds))
    choice = Choice(form, "timed", seconds, chunk)
    remember(key, choice)
    return choice


def plan_scan(lower: Callable, compile_scan: Callable, data, forced: str | None = None):
    """The form (and client chunk) of `simulate.run`'s scanned chunks, and the data that
    carries it.

    Args:
      lower: data -> the first chunk lowered (at the data's plan).
      compile_scan: data -> a thunk running TUNE_ROUNDS scanned rounds compiled for that
        data's plan (a sample), the state left untouched.
      data: the round's inputs.
      forced: a form, or a candidate's `arm` name, the caller (a checkpoint) requires.

    Returns:
      (data, Choice or None): None when no kernel of the program has forms, and then
      `data` unchanged.
    """
    if plan_of(data).linear_form is not None:  # set by the caller: used as it is
        return data, Choice(plan_of(data).linear_form, "forced")
    lowered = lower(data)
    if not has_forms(lowered):
        return data, None
    feature_size = backend.feature_size(data)
    choice = choose(program_key(lowered.as_text(), "scan"),
                    lambda name: compile_scan(planned_arm(data, name)), feature_size,
                    forced, chunk_candidate(data))
    return planned_arm(data, choice.arm), choice


def compile_round(algorithm, state, data, key, *, form: str | None = None):
    """One round of `algorithm`, compiled ahead of time for calls one by one, in the form
    timed fastest on this machine for such calls.

    For a Python loop over rounds (a benchmark, a notebook): `simulate.run` scans its
    rounds in compiled chunks and plans them itself.

    Args:
      algorithm, state, data, key: as `algorithm.round` takes them (shapes only are
        used, but for the timing's few rounds, which do not change `state`).
      form: force a form (one of `ops.linear.LINEAR_FORMS`).

    Returns:
      (round_fn, data, Choice or None): call `round_fn(state, data, key)` with the
      returned `data` (it carries the form, and the chunk the timing chose); Choice
      None when the round has no kernel with forms.
    """
    feature_size = backend.feature_size(data)

    def jitted(d):
        return backend.jit(algorithm.round, feature_size,
                           linear_form=plan_of(d).linear_form)

    if form is not None:
        data = planned(data, linear_form=form)
    lowered = jitted(data).lower(state, data, key)
    choice = None
    if plan_of(data).linear_form is not None:
        choice = Choice(plan_of(data).linear_form, "forced")
    elif has_forms(lowered):
        keys = jax.random.split(key, TUNE_ROUNDS)

        def build(name):
            d = planned_arm(data, name)
            compiled = jitted(d).lower(state, d, key).compile()

            def sample():
                s = state
                for k in keys:
                    s, _ = compiled(s, d, k)
                return s

            return sample

        choice = choose(program_key(lowered.as_text(), "call"), build, feature_size,
                        client_chunk=chunk_candidate(data))
        data = planned_arm(data, choice.arm)
        lowered = jitted(data).lower(state, data, key)
    return lowered.compile(), data, choice
