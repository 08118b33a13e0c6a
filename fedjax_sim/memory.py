"""Memory planning: how many clients, seeds or runs to process at once under a byte budget.

The executor plans through this module (it names no algorithm's options and no
experiment's settings): an experiment declares what a method's round holds
(`execution.Footprint`) and `plan_client_chunk` turns that and the execution's
budget into a chunk; no experiment calls the functions below.

Clients of a round (`client_chunk`). A round holds the data of all m clients
(its input) plus, for the clients being processed together, their working
memory: gathered data rows, forward and backward activations, and, when clients
train locally, their own copies of the model, its gradient, update and optimizer
state. The first part does not depend on the chunk; the second is linear in it.
`estimate_bytes_per_client` approximates the second per client,
`client_chunk_for_budget` turns a budget into a chunk size, and
`choose_client_chunk` does both for a setting. The chunk also bounds the
evaluation of train and test clients, which may need more per client than a
round (100 test rows against 10 train rows): `working_bytes_per_client` takes
the larger. `client_chunk_within_machine` adds the check that the run fits this
machine (building the data, the state of two rounds, a chunk's working memory),
and `working_memory_chunk` bounds per-client models (and, on a CPU, any round)
when no budget is set.

Clients of a round held in a core's cache (`cache_chunk`): not a memory bound but
a speed candidate, which `fedjax_sim.tuning` times beside the plan's chunk.

Vmapped copies of a whole run (sweep cells, data seeds): `run_bytes` (one run
of a model, every client at once) or `linear_fit_bytes` (a hand count for
linear models), and `items_per_chunk` turns a budget into how many at once.

The estimates are deliberately simple upper-bound-ish counts, not XLA's buffer
assignment; benchmarks/MEMORY.md describes how the peak RSS behind them is measured.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:  # annotations only: `execution` (which the data layer imports) imports this
    import optax

    from fedjax_sim.data.federated import FederatedData
    from fedjax_sim.models.core import Model

# Per-client copies of the model while a client trains locally: its start
# params, its trained params, the gradient, the update and the weighted copy
# summed into the cluster total.
_MODEL_COPIES = 5

# Working memory of per-client models when no budget is set: their gradients and
# updates for all m clients × copies would double the resident models (rotated MNIST's
# 5 seeds × 320 MLPs peaked at 4.25 GB unchunked).
PER_CLIENT_MODELS_BYTES = 2**30

# Working memory of a round on a CPU when no budget is set (rotated-image comparisons):
# a round over every client at once allocates its temporaries fresh each round (2.8 GB at
# rotated MNIST's 5 seeds × 320 clients) and runs 2.6× slower than in 256 MiB chunks (5.1
# vs 1.95 s a round on a 2-core CPU); 64 MiB and 1 GiB were slower. A CNN's users
# (`fedavg-cifar10-pfl`: simple_cnn, 50 images, ≈ 490 MiB estimated each, its
# convolutions' patches counted) go one at a time under it: 10.0 s a round against 21.1 s
# for the cohort of 50 vmapped at once (benchmarks/conv_round.py, 2-core Intel Xeon).
CPU_ROUND_WORK_BYTES = 2**28

# Working memory of a round over generated clients when no budget is set: their rows
# exist only while a chunk trains, and the whole-cohort path would draw all m at once.
GENERATED_WORK_BYTES = 2**30


def core_cache_bytes() -> int:
    """The largest cache private to one core (L2 on current x86 and Arm CPUs), as
    /sys/devices/system/cpu/cpu0/cache names it; 1 MiB where the OS does not say."""
    sizes = []
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(index, "shared_cpu_list")) as f:
                shared = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        if shared not in ("0", "") or not text:  # shared with other cores: contended
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else 2**20


def cache_chunk(data) -> int | None:
    """The clients whose rows fit one core's cache (`core_cache_bytes`), spread evenly
    over the client axis (`client_chunk_for_budget`); None when every client's rows fit
    at once, or `data` holds no stored rows (`x`, `y` with a leading client axis).

    A speed candidate, not a memory bound: a round that reads each client's rows more
    than once (IFCA option I's fused linear kernel: once for the residuals, once for
    the gradients) reads them from memory once per chunk when a chunk stays in the
    cache, where over the whole cohort the second pass streams them again.
    """
    x, y = getattr(data, "x", None), getattr(data, "y", None)
    if not (isinstance(getattr(x, "shape", None), tuple)
            and isinstance(getattr(y, "shape", None), tuple)):
        return None
    counts = getattr(data, "num_examples", None)
    if getattr(counts, "ndim", None) != 1:  # no client axis, or copies axes before it
        return None
    m = counts.shape[0]
    if m < 2 or x.shape[:1] != (m,) or y.shape[:1] != (m,):
        return None
    per_client = tree_bytes([x, y]) // m
    if per_client < 1:
        return None
    return client_chunk_for_budget(m, per_client, core_cache_bytes())


def machine_bytes() -> int:
    """This machine's physical memory in bytes (1 TiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


def tree_bytes(tree) -> int:
    """Bytes of all array leaves (arrays or ShapeDtypeStructs) of a pytree."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def activation_bytes(model: Model, params, x, *, differentiated: bool = False) -> int:
    """Bytes of every intermediate of `model.apply(params, x)` (traced, never run).

    The sum over the top-level operations of the jaxpr: an upper bound on what
    XLA keeps alive for one forward pass, since it fuses elementwise ops.
    differentiated: the forward as local training runs it (layers whose evaluated
    and differentiated forms differ, `models.conv`, in the differentiated one).
    """
    from fedjax_sim.models import conv  # (lazily: the data layer imports this module)

    context = conv.as_differentiated() if differentiated else contextlib.nullcontext()
    with context:
        jaxpr = jax.make_jaxpr(model.apply)(params, x)
    return sum(tree_bytes([v.aval]) for eqn in jaxpr.eqns for v in eqn.outvars)


def estimate_bytes_per_client(
    model: Model,
    data: FederatedData,
    *,
    local_training: bool = True,
    num_clusters: int = 1,
    optimizer: optax.GradientTransformation | None = None,
) -> int:
    """Working memory of one client inside a round, in bytes.

    Counted per client of a chunk:
      data: its x and y rows (the chunk is gathered from the full arrays);
      losses: one forward pass per cluster model (k · activations);
      without local training (one gradient per client, summed over clients,
        e.g. gradient averaging): the VJP of those losses, another
        k · activations; no per-client model copies (the gradient is summed
        over clients inside the backward matmuls);
      with local training (each client takes steps on its own copy): 5
        copies of the params (start, trained, gradient, update, weighted
        copy), the optimizer state, and the forward and backward activations
        of one local step.

    Args:
      model: the model (only shapes are used: nothing is run).
      data: the clients (only shapes and dtypes are used).
      local_training: whether clients train their own model copies, as above.
      num_clusters: k (1 for FedAvg and local models).
      optimizer: the client optimizer of local training (default: SGD, no
        state); e.g. momentum adds one params-sized slot, Adam two.

    Returns:
      bytes per client (an int).
    """
    if not isinstance(local_training, bool):
        raise ValueError(f"local_training must be True or False; got {local_training!r}.")
    if not isinstance(num_clusters, int) or num_clusters < 1:
        raise ValueError(f"num_clusters must be an integer >= 1; got {num_clusters!r}.")
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct(data.x.shape[1:], data.x.dtype)
    rows = tree_bytes([x, jax.ShapeDtypeStruct(data.y.shape[1:], data.y.dtype)])
    act = activation_bytes(model, params, x, differentiated=True)
    total = rows + num_clusters * act
    if not local_training:
        return total + num_clusters * act
    opt_state = jax.eval_shape(optimizer.init, params) if optimizer is not None else ()
    return total + _MODEL_COPIES * tree_bytes(params) + tree_bytes(opt_state) + 2 * act


def evaluation_bytes_per_client(model: Model, data: FederatedData, *,
                                num_clusters: int = 1) -> int:
    """Working memory of one client while it is evaluated, in bytes: its x and y rows
    and one forward pass per cluster model (k · activations), no gradient.

    A test set with more rows per client than the training set (the synthetic
    runs' n_test = 100 against n = 10) needs more per client here than in a round.
    """
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct(data.x.shape[1:], data.x.dtype)
    rows = tree_bytes([x, jax.ShapeDtypeStruct(data.y.shape[1:], data.y.dtype)])
    return rows + num_clusters * activation_bytes(model, params, x)


def working_bytes_per_client(model: Model, data: FederatedData, *, eval_data=None,
                             **estimate) -> int:
    """Per client of a chunk, the most a round or an evaluation (of `data`, or of
    `eval_data`, e.g. the test set, with the same chunk) needs: the largest of
    `estimate_bytes_per_client(model, data, **estimate)` and the
    `evaluation_bytes_per_client` of both."""
    k = estimate.get("num_clusters", 1)
    sets = [data] if eval_data is None else [data, eval_data]
    return max(estimate_bytes_per_client(model, data, **estimate),
               *(evaluation_bytes_per_client(model, d, num_clusters=k) for d in sets))


def client_chunk_for_budget(
    num_clients: int, bytes_per_client: int, budget_bytes: float
) -> int | None:
    """The client_chunk that keeps chunk × bytes_per_client within budget_bytes.

    Returns None when all clients fit at once (no chunking). Otherwise the
    fewest chunks that fit, each as even as possible (so the padded last
    chunk wastes little), and at least 1 client per chunk even when a single
    client exceeds the budget.
    """
    if not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1; got {num_clients!r}.")
    if not bytes_per_client > 0:
        raise ValueError(f"bytes_per_client must be > 0; got {bytes_per_client!r}.")
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be > 0; got {budget_bytes!r}.")
    if num_clients * bytes_per_client <= budget_bytes:
        return None
    fit = max(1, int(budget_bytes // bytes_per_client))
    num_chunks = -(-num_clients // fit)
    return -(-num_clients // num_chunks)


def choose_client_chunk(
    model: Model,
    data: FederatedData,
    budget_bytes: float,
    *,
    local_training: bool = True,
    num_clusters: int = 1,
    optimizer: optax.GradientTransformation | None = None,
    copies: int = 1,
    per_client_models: bool = False,
    budget_name: str = "the memory budget",
    eval_data: FederatedData | None = None,
) -> int | None:
    """client_chunk for a setting under a total memory budget (None: no chunking needed).

    The resident part (the data, and for local models the [m, ...] state of
    this round and the next) is taken off the budget first; what is left is
    split by `estimate_bytes_per_client` × copies.

    Args:
      model, data, local_training, num_clusters, optimizer: as in
        `estimate_bytes_per_client`.
      budget_bytes: the whole budget (e.g. a setting in GiB · 2**30).
      copies: algorithm copies run side by side (`with_restarts` restarts, or
        vmapped learning rates); each holds its own chunk.
      budget_name: what the error tells the user to raise (e.g. the setting's name).
      per_client_models: the state holds one model per client (local models,
        one-shot pre-training).
      eval_data: other clients evaluated with the same chunk (e.g. the test
        set): `working_bytes_per_client` counts their evaluation too.

    Raises:
      ValueError: if the resident part alone exceeds the budget.
    """
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an integer >= 1; got {copies!r}.")
    m = data.num_clients
    resident = tree_bytes(data)
    if per_client_models:
        resident += 2 * copies * m * tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))
    if resident >= budget_bytes:
        raise ValueError(
            f"the memory budget ({budget_bytes / 2**30:.3g} GiB) is below what the run holds "
            f"regardless of chunking ({resident / 2**30:.3g} GiB: the data of m={m} clients"
            f"{' and their models' if per_client_models else ''}); raise {budget_name}."
        )
    per_client = copies * working_bytes_per_client(
        model, data, eval_data=eval_data, local_training=local_training,
        num_clusters=num_clusters, optimizer=optimizer)
    return client_chunk_for_budget(m, per_client, budget_bytes - resident)


def client_chunk_within_machine(
    model: Model,
    data: FederatedData,
    budget_bytes: float,
    *,
    copies: int = 1,
    per_client_models: bool = False,
    local_training: bool = True,
    num_clusters: int = 1,
    extra_resident_bytes: int = 0,
    machine_fraction: float = 0.8,
    describe: str = "",
    remedy: str = "",
    budget_name: str = "the memory budget",
    generated_clients: int | None = None,
    eval_data: FederatedData | None = None,
    state_bytes: int = 0,
    build_bytes: int = 0,
) -> int | None:
    """client_chunk under budget_bytes (0: no budget, no chunking), after refusing a
    round that would not fit this machine.

    Without a budget the whole round must fit `machine_fraction` of this
    machine's memory; with one, `choose_client_chunk` chunks the clients and the
    chunked round must fit. The peak counted is the larger of building the data
    (build_bytes) and running: the data, extra_resident_bytes (e.g. test data),
    the state of this round and the next (2 · state_bytes; the [m, ...]
    per-client models of local models, 2 · copies · m models) and the working
    memory of one chunk, a round's or an evaluation's
    (`working_bytes_per_client` × copies).

    Args:
      model, data, local_training, num_clusters: as in `estimate_bytes_per_client`
        (shapes only: nothing is built).
      budget_bytes, copies, per_client_models, budget_name: as in
        `choose_client_chunk`.
      extra_resident_bytes: bytes the run holds besides `data` regardless of chunking.
      machine_fraction: the share of this machine's memory a run may take.
      describe, remedy: the caller's words in the error (the settings behind the
        estimate; what to change).
      generated_clients: None, or `data` is a sample (e.g. one client,
        `source.take(jnp.arange(1))`) of this many clients drawn chunk by chunk
        inside the round: nothing of theirs is resident, and a chunk is chosen
        whenever they do not all fit the budget (GENERATED_WORK_BYTES without one).
      eval_data: as in `choose_client_chunk` (for generated clients, one
        client's sample too).
      state_bytes: the algorithm's state, all copies (e.g. the tree_bytes of
        `jax.eval_shape(algorithm.init, ...)`), held twice (this round's and
        the next); leave per-client models to `per_client_models`.
      build_bytes: the peak while the data is built (0: the data itself).

    Raises:
      ValueError: the round does not fit (or the budget is below the data).
    """
    m = data.num_clients if generated_clients is None else generated_clients
    resident = extra_resident_bytes + (tree_bytes(data) if generated_clients is None else 0)
    resident += 2 * state_bytes
    if per_client_models:
        resident += 2 * copies * m * tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))
    per_client = copies * working_bytes_per_client(
        model, data, eval_data=eval_data, local_training=local_training,
        num_clusters=num_clusters)
    chunk = None
    if generated_clients is not None:
        work = budget_bytes - resident if budget_bytes > 0 else GENERATED_WORK_BYTES
        if work <= 0:
            raise ValueError(
                f"the memory budget ({budget_bytes / 2**30:.3g} GiB) is below what the run "
                f"holds regardless of chunking ({resident / 2**30:.3g} GiB); raise "
                f"{budget_name}.")
        chunk = client_chunk_for_budget(m, per_client, work)
    elif budget_bytes > 0:
        chunk = choose_client_chunk(
            model, data, budget_bytes - 2 * state_bytes, local_training=local_training,
            num_clusters=num_clusters, copies=copies, per_client_models=per_client_models,
            budget_name=budget_name, eval_data=eval_data)
    peak = max(resident + per_client * (chunk or m), build_bytes)
    machine = machine_bytes()
    if peak > machine_fraction * machine:
        raise ValueError(
            f"this run needs about {peak / 2**30:.3g} GiB ({describe}), more than this "
            f"machine's {machine / 2**30:.3g} GiB allow (a run may take "
            f"{machine_fraction:.0%}: {machine_fraction * machine / 2**30:.3g} GiB); {remedy}"
        )
    return chunk


def working_memory_chunk(
    model: Model, data: FederatedData, *, copies: int = 1,
    work_bytes: float = PER_CLIENT_MODELS_BYTES, num_clusters: int = 1,
) -> int | None:
    """client_chunk that trains `work_bytes` of working memory at a time, without a budget
    (per-client models: 1 GiB by default; any round on a CPU: `CPU_ROUND_WORK_BYTES`).

    A client's working memory: `estimate_bytes_per_client` with local training and
    num_clusters cluster models, × copies (seeds).
    """
    per_client = copies * estimate_bytes_per_client(model, data, num_clusters=num_clusters)
    return client_chunk_for_budget(data.num_clients, per_client, work_bytes)


def plan_client_chunk(footprint, budget_bytes: float = 0.0) -> int | None:
    """The executor's client chunk for a method's round (`execution.Footprint`) under
    budget_bytes (0: none); None: every client at once. `execution.Execution.client_chunk`
    calls this; no experiment does.

    With `footprint.fit_machine`: `client_chunk_within_machine` (the round must fit this
    machine; without a budget every client at once, generated ones
    `GENERATED_WORK_BYTES` at a time). Otherwise: with a budget `choose_client_chunk`;
    without one, on a CPU `CPU_ROUND_WORK_BYTES` of working memory at a time (k
    cluster models' losses, one model's for per-client models), elsewhere
    `PER_CLIENT_MODELS_BYTES` at a time for per-client models and every client at
    once for the rest (`working_memory_chunk`).

    Raises:
      ValueError: the round does not fit, saying what to change.
    """
    fp = footprint
    if fp.fit_machine:
        extra = 0 if fp.resident is None else tree_bytes(fp.resident)
        build = 0
        if fp.build_factor and fp.generated_clients is None:
            build = fp.build_factor * (tree_bytes(fp.clients) + extra)
        return client_chunk_within_machine(
            fp.model, fp.clients, budget_bytes, copies=fp.copies,
            per_client_models=fp.per_client_models, local_training=fp.local_training,
            num_clusters=fp.num_clusters, extra_resident_bytes=extra,
            describe=fp.describe, remedy=fp.remedy, budget_name=fp.budget_name,
            generated_clients=fp.generated_clients, eval_data=fp.evaluated,
            state_bytes=0 if fp.state is None else tree_bytes(fp.state), build_bytes=build)
    if budget_bytes:
        return choose_client_chunk(
            fp.model, fp.clients, budget_bytes, local_training=fp.local_training,
            num_clusters=fp.num_clusters, copies=fp.copies,
            per_client_models=fp.per_client_models, budget_name=fp.budget_name,
            eval_data=fp.evaluated)
    if jax.default_backend() == "cpu":
        return working_memory_chunk(
            fp.model, fp.clients, copies=fp.copies, work_bytes=CPU_ROUND_WORK_BYTES,
            num_clusters=1 if fp.per_client_models else fp.num_clusters)
    if fp.per_client_models:
        return working_memory_chunk(fp.model, fp.clients, copies=fp.copies)
    return None


def run_bytes(
    model: Model,
    data: FederatedData,
    *,
    copies: int = 1,
    extra_resident_bytes: int = 0,
    local_training: bool = True,
    num_clusters: int = 1,
) -> int:
    """Bytes one whole run holds when every client is processed at once.

    Its data (+ extra_resident_bytes, e.g. test data) and `copies` rounds of
    all m clients' working memory (`estimate_bytes_per_client`): what one item
    of a vmap over runs (sweep cells × seeds) costs.
    """
    work = copies * data.num_clients * estimate_bytes_per_client(
        model, data, local_training=local_training, num_clusters=num_clusters)
    return tree_bytes(data) + extra_resident_bytes + work


def linear_fit_bytes(rows: int, features: int, outputs: int, runs: int) -> int:
    """Bytes of one data set of a vmap of full-batch linear-model fits (float32).

    The data x [rows, features] and y [rows] three times over (the data, and
    the gradient's traffic through x), and per run (e.g. learning rates ×
    restarts sharing the data) four [rows, outputs] buffers: predictions,
    residuals, losses and their gradient.
    """
    data = 4 * rows * (features + 1) * 3
    return data + 4 * rows * outputs * runs * 4


def items_per_chunk(
    total: int, bytes_per_item: float, budget_bytes: float = 0.0,
    machine_fraction: float = 0.5,
) -> int:
    """How many of `total` equal items (vmapped runs, data seeds) to process at once.

    As many as fit budget_bytes (0: machine_fraction of this machine's
    memory), at least 1 and at most total.
    """
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an integer >= 0; got {total!r}.")
    if not bytes_per_item > 0:
        raise ValueError(f"bytes_per_item must be > 0; got {bytes_per_item!r}.")
    budget = budget_bytes or machine_fraction * machine_bytes()
    return int(max(1, min(total, budget // bytes_per_item)))
