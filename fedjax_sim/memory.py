"""How many clients to process at once under a memory budget (`client_chunk`).

A round holds the data of all m clients (its input) plus, for the clients
being processed together, their working memory: gathered data rows, forward
and backward activations, and, when clients train locally, their own copies
of the model, its gradient, update and optimizer state. The first part does
not depend on the chunk; the second is linear in it. `estimate_bytes_per_client`
approximates the second per client, `client_chunk_for_budget` turns a budget
into a chunk size, and `choose_client_chunk` does both for a setting.
The estimates are deliberately simple upper-bound-ish counts, not XLA's buffer
assignment; benchmarks/MEMORY.md compares them with measured peak RSS.
"""

from __future__ import annotations

import math

import jax
import optax

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model

# Per-client copies of the model while a client trains locally: its start
# params, its trained params, the gradient, the update and the weighted copy
# summed into the cluster total.
_MODEL_COPIES = 5


def tree_bytes(tree) -> int:
    """Bytes of all array leaves (arrays or ShapeDtypeStructs) of a pytree."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def activation_bytes(model: Model, params, x) -> int:
    """Bytes of every intermediate of `model.apply(params, x)` (traced, never run).

    The sum over the top-level operations of the jaxpr: an upper bound on what
    XLA keeps alive for one forward pass, since it fuses elementwise ops.
    """
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
        e.g. IFCA's gradient averaging): the VJP of those losses, another
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
      optimizer: the client optimizer for option "model" (default: SGD, no
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
    act = activation_bytes(model, params, x)
    total = rows + num_clusters * act
    if not local_training:
        return total + num_clusters * act
    opt_state = jax.eval_shape(optimizer.init, params) if optimizer is not None else ()
    return total + _MODEL_COPIES * tree_bytes(params) + tree_bytes(opt_state) + 2 * act


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
) -> int | None:
    """client_chunk for a setting under a total memory budget (None: no chunking needed).

    The resident part (the data, and for local models the [m, ...] state of
    this round and the next) is taken off the budget first; what is left is
    split by `estimate_bytes_per_client` × copies.

    Args:
      model, data, local_training, num_clusters, optimizer: as in
        `estimate_bytes_per_client`.
      budget_bytes: the whole budget (e.g. memory_budget_gb · 2**30).
      copies: algorithm copies run side by side (`with_restarts` restarts, or
        vmapped learning rates); each holds its own chunk.
      per_client_models: the state holds one model per client (local models,
        one-shot pre-training).

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
            f"{' and their models' if per_client_models else ''}); raise memory_budget_gb."
        )
    per_client = copies * estimate_bytes_per_client(
        model, data, local_training=local_training, num_clusters=num_clusters,
        optimizer=optimizer)
    return client_chunk_for_budget(m, per_client, budget_bytes - resident)
