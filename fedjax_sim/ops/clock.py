"""A virtual clock: how many seconds a client's trip takes, and when it is online.

A *trip* is one client's round of work: it downloads the server model, takes its
τ_i local steps, and uploads its update. Its length, in virtual seconds:

    d_i = τ_i · step_seconds_i + 2 · model_bytes / bandwidth_i      (download + upload)

τ_i is the client's local work (`ClientTraining.work`, `ops.work.Work`, drawn from
the trip's key exactly as its training draws it); step_seconds_i (the seconds of one
local step) and bandwidth_i (bytes per second, the same both ways) are the client's
speeds: one number for everyone, one per client, or drawn once per client from
`seed`, heavy-tailed (a lognormal: median `step_seconds`, σ = `spread`), or read from
a trace (`read_trace`). model_bytes is the model's size (Σ leaf size × item size).

**Availability.** A client is online inside its *windows* (intervals of virtual
time; with `cycle` > 0 they repeat every `cycle` seconds): from a trace, or from
`Systems`' day/night cycle, a client then being online during its day rounds
(round u = ⌊t / round_seconds⌋, its day as `Systems` defines it). Without windows a
client is always online. A trip starts only while its client is online, and it
*fails* when the client leaves its window before the trip ends: the event happens
at the window's end, and no update is uploaded (a client that goes offline never
finishes). So a trip of d_i seconds started at t:

    e = min(t + d_i, end of the window holding t)          completes ⇔ t + d_i ≤ that end

The clock models neither network contention (every client has its bandwidth to
itself, whatever the number of clients in flight) nor the server's own compute.

Everything here is a pure function of arrays, for use inside one compiled round:
`Clock.tables` turns the settings into constant arrays once, on the host, and
`trip_seconds`, `trip_events`, `online`, `next_online` and `sync_round_seconds`
read them.

Examples:
  >>> import jax.numpy as jnp
  >>> from fedjax_sim.ops.clock import Clock, trip_events
  >>> clock = Clock(step_seconds=(1.0, 2.0), bandwidth=100.0,
  ...               windows=(((0.0, 100.0),), ((0.0, 30.0),)))
  >>> tables = clock.tables(2)
  >>> when, done = trip_events(tables, jnp.array([0, 1]), jnp.array([10, 10]),
  ...                          jnp.zeros(2), model_bytes=500)
  >>> when.tolist(), done.tolist()  # 10·1 + 2·5 s; 10·2 + 10 s = 30 ≤ 30
  ([20.0, 30.0], [True, True])
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.ops.work import time_zones
from fedjax_sim.systems import NO_SYSTEMS, Systems


def _positive(name: str, value, *, infinite: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0 or (math.isinf(number) and not infinite):
        allowed = "a number > 0 (inf allowed)" if infinite else "a finite number > 0"
        raise ValueError(f"Clock {name} must be {allowed}; got {value!r}.")
    return number


def _per_client(name: str, value, *, infinite: bool = False):
    """One positive number, or a non-empty tuple of them (one per client)."""
    if isinstance(value, tuple | list | np.ndarray):
        values = tuple(_positive(name, v, infinite=infinite) for v in value)
        if not values:
            raise ValueError(f"Clock {name} per client must hold one number per client; got "
                             "an empty sequence.")
        return values
    return _positive(name, value, infinite=infinite)


def _windows(value) -> tuple:
    """Per-client windows as a tuple (clients) of tuples of (start, end), each checked."""
    out = []
    for i, client in enumerate(value):
        spans = []
        for span in client:
            try:
                start, end = (float(v) for v in span)
            except (TypeError, ValueError):
                raise ValueError(f"Clock windows of client {i} must be (start, end) pairs of "
                                 f"seconds; got {span!r}.") from None
            if not (math.isfinite(start) and start >= 0 and end > start):
                raise ValueError(f"Clock windows of client {i}: a window must have 0 <= start "
                                 f"< end (seconds); got ({start}, {end}).")
            spans.append((start, end))
        out.append(_merged(sorted(spans)))
    if not out:
        raise ValueError("Clock windows must hold one tuple of windows per client; got none.")
    return tuple(out)


def _merged(spans) -> tuple:
    """Sorted windows with overlapping or touching ones merged."""
    merged = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


class ClockTables(NamedTuple):
    """A clock's per-client constants (numpy; `Clock.tables`).

    step_seconds: [m] float32, the seconds of one local step.
    bandwidth: [m] float32, bytes per second both ways (inf: communication is free).
    starts, ends: [m, W] float32, each client's online windows, sorted; a client with
      fewer than W windows is padded with (inf, inf). W = 0: every client always online.
    cycle: the windows repeat every `cycle` seconds; 0: they do not (after its last
      window a client is offline for ever).
    """

    step_seconds: np.ndarray
    bandwidth: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    cycle: float


@dataclass(frozen=True)
class Clock:
    """Each client's speeds and online windows (hashable: part of an algorithm's build).

    Attributes:
      step_seconds: the seconds of one local step: one number (the median when
        `spread` > 0), or a tuple with one per client.
      bandwidth: bytes per second, the same for download and upload: one number (the
        median with `bandwidth_spread`), or one per client; inf (default): free.
      spread: σ of the lognormal the per-client step times are drawn from, once, from
        `seed` (step_seconds_i = step_seconds · exp(σ z_i), z_i ~ N(0, 1)); 0: none.
      bandwidth_spread: the same for the bandwidths (bandwidth_i = bandwidth ·
        exp(−σ z'_i), a heavy tail of slow links).
      seed: the seed of those draws.
      windows: per client, its online windows ((start, end), ...) in seconds; None:
        always online (or `Systems`' day/night cycle, with `round_seconds`).
      cycle: the windows repeat every `cycle` seconds; 0: they do not.
      round_seconds: the virtual seconds of one `Systems` round, the unit of its
        day/night `period` (needed when the data carry a period).

    Examples:
      >>> from fedjax_sim.ops.clock import Clock
      >>> Clock(step_seconds=0.5, spread=1.0, seed=3).tables(4).step_seconds.shape
      (4,)
      >>> Clock(step_seconds=-1.0)
      Traceback (most recent call last):
      ...
      ValueError: Clock step_seconds must be a finite number > 0; got -1.0.
    """

    step_seconds: float | tuple[float, ...] = 1.0
    bandwidth: float | tuple[float, ...] = math.inf
    spread: float = 0.0
    bandwidth_spread: float = 0.0
    seed: int = 0
    windows: tuple | None = None
    cycle: float = 0.0
    round_seconds: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "step_seconds", _per_client("step_seconds", self.step_seconds))
        object.__setattr__(self, "bandwidth",
                           _per_client("bandwidth", self.bandwidth, infinite=True))
        for name in ("spread", "bandwidth_spread", "cycle", "round_seconds"):
            value = getattr(self, name)
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not (math.isfinite(number) and number >= 0):
                raise ValueError(f"Clock {name} must be a finite number >= 0; got {value!r}.")
            object.__setattr__(self, name, number)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"Clock seed must be an integer; got {self.seed!r}.")
        if self.windows is not None:
            windows = _windows(self.windows)
            if self.cycle and any(end > self.cycle for client in windows for _, end in client):
                raise ValueError(f"Clock windows must lie within the cycle [0, {self.cycle}) "
                                 "when they repeat (cycle > 0).")
            object.__setattr__(self, "windows", windows)

    def replace(self, **changes) -> Clock:
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    def check(self, num_clients: int, systems: Systems = NO_SYSTEMS) -> None:
        """ValueError unless this clock fits m clients and `systems` (per-client lengths;
        a day/night cycle needs `round_seconds` and no windows of its own)."""
        for name in ("step_seconds", "bandwidth", "windows"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_clients:
                raise ValueError(f"Clock {name} holds {len(value)} entries for {num_clients} "
                                 "clients: give one per client.")
        if systems.period:
            if self.windows is not None:
                raise ValueError("Clock windows and Systems' day/night cycle (period) both say "
                                 "when clients are online: give one of them.")
            if not self.round_seconds:
                raise ValueError("Systems period counts rounds: under the virtual clock give "
                                 "Clock(round_seconds=...), the seconds of one round.")
            if systems.night:
                raise ValueError("under the virtual clock a client's night is offline: give "
                                 f"Systems night=0; got {systems.night}.")

    def tables(self, num_clients: int, systems: Systems = NO_SYSTEMS) -> ClockTables:
        """The per-client constants for m clients (cached; checked by `check`)."""
        self.check(num_clients, systems)
        return _tables(self, num_clients, systems)


@functools.lru_cache(maxsize=64)
def _tables(clock: Clock, m: int, systems: Systems) -> ClockTables:
    rng = np.random.default_rng(clock.seed)
    z = rng.standard_normal((2, m))
    step = np.broadcast_to(np.asarray(clock.step_seconds, np.float64), (m,))
    step = step * np.exp(clock.spread * z[0])
    bandwidth = np.broadcast_to(np.asarray(clock.bandwidth, np.float64), (m,))
    bandwidth = bandwidth * np.exp(-clock.bandwidth_spread * z[1])
    cycle = clock.cycle
    if clock.windows is not None:
        spans = clock.windows
    elif systems.period:
        spans, cycle = _day_windows(m, systems, clock.round_seconds)
    else:
        spans = ()
    width = max((len(s) for s in spans), default=0)
    starts = np.full((m, width), np.inf, np.float32)
    ends = np.full((m, width), np.inf, np.float32)
    for i, client in enumerate(spans):
        for w, (start, end) in enumerate(client):
            starts[i, w], ends[i, w] = start, end
    out = ClockTables(step.astype(np.float32), bandwidth.astype(np.float32), starts, ends,
                      float(cycle))
    for a in out[:4]:
        a.setflags(write=False)
    return out


def _day_windows(m: int, systems: Systems, round_seconds: float):
    """`Systems`' day/night cycle as windows: client i's day rounds u ((u + z_i) mod period
    < period / 2) as one window of a cycle of period · round_seconds (two where it wraps)."""
    period = systems.period
    day = math.ceil(period / 2)  # rounds u with (u + z) mod period in 0 .. day − 1
    cycle = period * round_seconds
    spans = []
    for z in time_zones(m, systems):
        first = (-int(z)) % period
        last = first + day
        if last <= period:
            client = ((first * round_seconds, last * round_seconds),)
        else:
            client = ((0.0, (last - period) * round_seconds),
                      (first * round_seconds, cycle))
        spans.append(client)
    return tuple(spans), cycle


# --------------------------------------------------------------------------- pure functions


def model_bytes(params) -> int:
    """Bytes of one model (static): Σ leaf size × item size."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(params))


def trip_seconds(tables: ClockTables, ids, steps, model_bytes: int):
    """[c] seconds of the clients `ids` ([c] int32) taking `steps` ([c]) local steps each:
    steps · step_seconds_i + 2 · model_bytes / bandwidth_i."""
    step = jnp.asarray(tables.step_seconds)[ids]
    bandwidth = jnp.asarray(tables.bandwidth)[ids]
    return steps.astype(jnp.float32) * step + 2.0 * float(model_bytes) / bandwidth


def _position(tables: ClockTables, t):
    """(seconds since the current cycle began, when it began) of times t."""
    if not tables.cycle:
        return t, jnp.zeros_like(t)
    position = jnp.mod(t, tables.cycle)
    return position, t - position


def window_end(tables: ClockTables, ids, t):
    """([c] whether each client `ids` is online at its time t [c], [c] the end of the window
    holding t: inf without windows, or for a client online across every cycle)."""
    t = jnp.asarray(t, jnp.float32)
    if tables.starts.shape[1] == 0:
        return jnp.ones(t.shape, bool), jnp.full(t.shape, jnp.inf, jnp.float32)
    starts, ends = jnp.asarray(tables.starts)[ids], jnp.asarray(tables.ends)[ids]
    p, base = _position(tables, t)
    inside = (starts <= p[:, None]) & (p[:, None] < ends)
    online = jnp.any(inside, axis=1)
    end = base + jnp.sum(jnp.where(inside, ends, 0.0), axis=1)
    if tables.cycle:
        # A window reaching the cycle's end goes on in the next cycle's window from 0.
        wraps = jnp.any(inside & (ends >= tables.cycle), axis=1) & (starts[:, 0] == 0.0)
        whole = ends[:, 0] >= tables.cycle  # online all along
        end = jnp.where(wraps, jnp.where(whole, jnp.inf, end + ends[:, 0]), end)
    return online, jnp.where(online, end, t)


def online(tables: ClockTables, ids, t):
    """[c] bool: whether each client `ids` is inside one of its windows at its time t."""
    return window_end(tables, ids, t)[0]


def next_online(tables: ClockTables, ids, t):
    """[c] the first time ≥ t at which each client `ids` is online (inf: never)."""
    t = jnp.asarray(t, jnp.float32)
    if tables.starts.shape[1] == 0:
        return t
    starts = jnp.asarray(tables.starts)[ids]
    now, _ = window_end(tables, ids, t)
    p, base = _position(tables, t)
    later = jnp.min(jnp.where(starts > p[:, None], starts, jnp.inf), axis=1)
    if tables.cycle:
        later = jnp.where(jnp.isfinite(later), later, tables.cycle + starts[:, 0])
    return jnp.where(now, t, base + later)


def trip_events(tables: ClockTables, ids, steps, start, model_bytes: int):
    """When each trip's event happens, and whether it completes.

    Args:
      tables: `Clock.tables`.
      ids: [c] int32 clients; steps: [c] their local steps τ_i; start: [c] when each
        trip starts (seconds).
      model_bytes: the model's size (`model_bytes`).

    Returns:
      (event [c] seconds: the upload, or the moment the client left its window;
      completes [c] bool: the trip ends inside the window it started in). A client
      offline at `start` fails at once (event = start).
    """
    start = jnp.asarray(start, jnp.float32)
    finish = start + trip_seconds(tables, ids, steps, model_bytes)
    here, end = window_end(tables, ids, start)
    completes = here & (finish <= end)
    return jnp.where(completes, finish, jnp.where(here, end, start)), completes


def sync_round_seconds(durations, reports, deadline=None):
    """The virtual seconds of a synchronous round, and the slots whose update counts.

    The round lasts as long as its slowest reporting slot; with a deadline, the server
    stops waiting at it, and the reporting slots past it are dropped (a slot exactly at
    the deadline is kept).

    Args:
      durations: [s] seconds each slot's trip takes (`trip_seconds`).
      reports: [s] bool, the slots that report (hold data, are online, do not drop out).
      deadline: None, or seconds (may be traced).

    Returns:
      (seconds, kept [s] bool): 0 seconds when no slot reports.

    Examples:
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.ops.clock import sync_round_seconds
      >>> d, r = jnp.array([3.0, 9.0, 5.0]), jnp.array([True, True, False])
      >>> float(sync_round_seconds(d, r)[0])
      9.0
      >>> seconds, kept = sync_round_seconds(d, r, deadline=4.0)
      >>> float(seconds), kept.tolist()
      (4.0, [True, False, False])
    """
    durations = jnp.asarray(durations, jnp.float32)
    longest = jnp.max(jnp.where(reports, durations, 0.0), initial=0.0)
    if deadline is None:
        return longest, reports
    return jnp.minimum(longest, deadline), reports & (durations <= deadline)


def sync_round(tables: ClockTables, ids, steps, reports, start, model_bytes: int,
               deadline=None):
    """A synchronous round of the cohort `ids` started at `start` (seconds): (seconds,
    kept [s]). A slot whose client goes offline before its trip ends does not report;
    the rest is `sync_round_seconds`."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.float32), ids.shape)
    event, completes = trip_events(tables, ids, steps, start, model_bytes)
    return sync_round_seconds(event - start, reports & completes, deadline)


# --------------------------------------------------------------------------- traces

TRACE_COLUMNS = ("client", "step_seconds", "bandwidth", "online_from", "online_until")


def read_trace(path, num_clients: int, *, cycle: float = 0.0) -> Clock:
    """A `Clock` from a CSV trace of the clients' speeds and online windows.

    One row per client, or per window of a client (its speeds repeated), with columns
    `client` (its id, 0 .. m − 1), `step_seconds` (> 0), and optionally `bandwidth`
    (bytes per second, > 0; empty or absent: free), `online_from` and `online_until`
    (seconds; empty or absent: always online). Every client must appear; every check
    fails in one line naming the file and the row. (FedScale's device-capacity and
    behaviour traces, converted, have this form.)

    Args:
      path: the CSV file.
      num_clients: m.
      cycle: the windows repeat every `cycle` seconds (0: they do not).

    Examples:
      >>> import tempfile, os
      >>> from fedjax_sim.ops.clock import read_trace
      >>> path = os.path.join(tempfile.mkdtemp(), "trace.csv")
      >>> _ = open(path, "w").write("client,step_seconds,bandwidth\\n0,0.5,1e6\\n1,2.0,\\n")
      >>> read_trace(path, 2).step_seconds
      (0.5, 2.0)
      >>> read_trace(path, 3)
      Traceback (most recent call last):
      ...
      ValueError: trace ...trace.csv has no row for client 2 (of m=3): give every client a row.
    """
    where = f"trace {path}"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
            columns = rows[0].keys() if rows else ()
    except OSError as err:
        raise ValueError(f"{where}: cannot be read ({err.strerror}).") from None
    for needed in TRACE_COLUMNS[:2]:
        if needed not in columns:
            raise ValueError(f"{where} needs the columns {', '.join(TRACE_COLUMNS[:2])} (and "
                             f"optionally {', '.join(TRACE_COLUMNS[2:])}); it has "
                             f"{', '.join(columns) or 'no rows'}.")
    speeds, windows = {}, {}
    for line, row in enumerate(rows, start=2):
        def number(name, default=None, row=row, line=line):
            text = (row.get(name) or "").strip()
            if not text:
                if default is None:
                    raise ValueError(f"{where} line {line}: {name} is empty.")
                return default
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{where} line {line}: {name} must be a number; got "
                                 f"{text!r}.") from None

        client = number("client")
        if not (client.is_integer() and 0 <= client < num_clients):
            raise ValueError(f"{where} line {line}: client must be an id in 0..{num_clients - 1}"
                             f"; got {row['client']!r}.")
        client = int(client)
        step, bandwidth = number("step_seconds"), number("bandwidth", math.inf)
        if not (step > 0 and math.isfinite(step)):
            raise ValueError(f"{where} line {line}: step_seconds must be a finite number > 0; "
                             f"got {row['step_seconds']!r}.")
        if not bandwidth > 0:
            raise ValueError(f"{where} line {line}: bandwidth must be a number > 0; got "
                             f"{row['bandwidth']!r}.")
        if speeds.setdefault(client, (step, bandwidth)) != (step, bandwidth):
            raise ValueError(f"{where} line {line}: client {client}'s speeds differ from its "
                             f"first row's {speeds[client]}.")
        start, end = number("online_from", math.nan), number("online_until", math.nan)
        if math.isnan(start) != math.isnan(end):
            raise ValueError(f"{where} line {line}: give both online_from and online_until, "
                             "or neither.")
        spans = windows.setdefault(client, [])
        if not math.isnan(start):
            if not (0 <= start < end) or (cycle and end > cycle):
                bound = f" <= cycle={cycle}" if cycle else ""
                raise ValueError(f"{where} line {line}: a window needs 0 <= online_from < "
                                 f"online_until{bound}; got ({start}, {end}).")
            spans.append((start, end))
    missing = [i for i in range(num_clients) if i not in speeds]
    if missing:
        listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        noun = "client" if len(missing) == 1 else f"{len(missing)} clients"
        raise ValueError(f"{where} has no row for {noun} {listed} (of m={num_clients}): give "
                         "every client a row.")
    has_windows = any(windows.values())
    if has_windows and not all(windows.values()):
        always = [i for i in range(num_clients) if not windows[i]][:5]
        raise ValueError(f"{where}: clients {always} have no window while others do: give "
                         "every client its windows, or none.")
    return Clock(step_seconds=tuple(speeds[i][0] for i in range(num_clients)),
                 bandwidth=tuple(speeds[i][1] for i in range(num_clients)),
                 windows=tuple(tuple(windows[i]) for i in range(num_clients))
                 if has_windows else None, cycle=cycle)
