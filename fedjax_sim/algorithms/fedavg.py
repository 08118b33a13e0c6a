"""FedAvg, the "global model" baseline of IFCA.

H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Agüera y
Arcas. "Communication-Efficient Learning of Deep Networks from Decentralized
Data". AISTATS 2017, arXiv:1602.05629.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    check_fraction,
    client_optimizer,
    cohort_size,
    tree_weighted_mean,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import (
    check_client_chunk,
    client_keys,
    divide_segments,
    local_update,
    map_client_chunks,
    sample_uniform,
    scan_client_chunks,
    segment_totals,
)


class FedAvgState(NamedTuple):
    params: object  # pytree, one model
    round: jax.Array  # int32


def evaluate_shared(
    model: Model, params, data: FederatedData, client_chunk: int | None = None
) -> dict:
    """Every client uses the same params (evaluated client_chunk clients at a time if set)."""

    def evaluate_part(part: FederatedData) -> dict:
        def per_client(fn):
            return jax.vmap(lambda x, y, n: fn(model, params, x, y, n))(
                part.x, part.y, part.num_examples
            )

        out = {
            "client_loss": per_client(client_loss),
            "assignment": jnp.zeros((part.num_clients,), jnp.int32),
        }
        if model.correct is not None:
            out["client_accuracy"] = per_client(client_accuracy)
        return out

    return map_client_chunks(evaluate_part, data, client_chunk)


def fedavg(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    learning_rate=None,
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    client_chunk: int | None = None,
) -> Algorithm:
    """Builds FedAvg: τ local steps on a cohort, then the (weighted) mean model.

    Args:
      model: the shared model.
      optimizer: client optimizer (default SGD at learning_rate).
      learning_rate: client lr when optimizer is None; may be traced.
      local_steps: τ.
      batch_size: None for full-batch steps, else the minibatch size.
      participation: fraction of clients per round, uniform without replacement.
      weighting: "uniform" or "examples" (weights ∝ num_examples).
      client_chunk: None trains the whole cohort at once; else this many
        clients at a time, accumulating the weighted sum of trained models
        (never holding [s, ...] of them). If every client of the cohort has
        weight 0 (weighting="examples", all empty) the model is kept; the
        unchunked mean is NaN then.
    """
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1; got {local_steps!r}.")
    check_fraction("participation", participation)
    if weighting not in ("uniform", "examples"):
        raise ValueError(f"weighting must be 'uniform' or 'examples'; got {weighting!r}.")
    check_client_chunk(client_chunk)
    opt = client_optimizer(optimizer, learning_rate)

    def init(key, data: FederatedData) -> FedAvgState:
        del data
        return FedAvgState(model.init(key), jnp.zeros((), jnp.int32))

    def round_(state: FedAvgState, data: FederatedData, key):
        m = data.num_clients
        s = cohort_size(m, participation)
        key_cohort, key_local = jax.random.split(key)
        ids = sample_uniform(key_cohort, m, s) if s < m else jnp.arange(m, dtype=jnp.int32)
        keys = client_keys(key_local, ids)

        def weights_of(part: FederatedData):
            if weighting == "examples":
                return part.num_examples.astype(jnp.float32)
            return jnp.ones((part.num_clients,), jnp.float32)

        def train(part: FederatedData, keys):
            c = part.num_clients
            start = jax.tree.map(lambda p: jnp.broadcast_to(p, (c,) + p.shape), state.params)
            trained, _, losses = local_update(
                model, opt, start, part, keys, num_steps=local_steps, batch_size=batch_size,
            )
            return trained, losses[:, 0]

        if client_chunk is None:
            cohort = data.take(ids) if s < m else data
            trained, first_losses = train(cohort, keys)
            params = tree_weighted_mean(trained, weights_of(cohort))
        else:

            def add_chunk(acc, part, valid):
                ids_c, keys_c = part
                chunk = data.take(ids_c)
                trained, first = train(chunk, keys_c)
                # Segment 0 is the model; padding clients go to segment 1, dropped.
                totals = segment_totals(trained, jnp.where(valid, 0, 1), 1, weights_of(chunk))
                return optax.tree.add(acc, totals), first

            zero = (
                jax.tree.map(lambda p: jnp.zeros((1,) + p.shape, p.dtype), state.params),
                jnp.zeros((1,), jnp.float32),
            )
            (totals, weight), first_losses = scan_client_chunks(
                add_chunk, zero, (ids, keys), client_chunk
            )
            one = jax.tree.map(lambda p: p[None], state.params)
            params = jax.tree.map(lambda p: p[0], divide_segments(totals, weight, one))
        metrics = {"train_loss": jnp.mean(first_losses)}
        return FedAvgState(params, state.round + 1), metrics

    def evaluate(state: FedAvgState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data, client_chunk)

    return Algorithm(init, round_, evaluate)
