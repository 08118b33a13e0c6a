"""The host loop: compiled chunks of rounds (`lax.scan`), evaluation between chunks.

The Python loop runs only over chunks of rounds, to evaluate, log and draw the
progress bar; every round inside a chunk is one step of a compiled scan. Round
t's key is fold_in(round_key, t), so a run's numbers do not depend on the chunk
length or on when evaluation happens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedjax_sim import parallel
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.metrics import summarize_clients


@functools.partial(jax.jit, static_argnames=("algorithm", "length"))
def run_rounds(algorithm: Algorithm, state, data: FederatedData, round_key, start, length: int):
    """Rounds start, ..., start + length − 1 as one `lax.scan`.

    Returns (state, metrics of every round stacked on a leading [length] axis).
    """

    def body(s, t):
        return algorithm.round(s, data, jax.random.fold_in(round_key, t))

    return jax.lax.scan(body, state, start + jnp.arange(length))


def default_evaluate(algorithm: Algorithm, data: FederatedData) -> Callable[[object], dict]:
    """Average and worst-case client loss (and accuracy) on `data`."""
    evaluate = jax.jit(algorithm.evaluate)
    return lambda state: summarize_clients(evaluate(state, data))


def run(
    algorithm: Algorithm,
    data: FederatedData,
    key,
    *,
    rounds: int,
    eval_every: int = 1,
    evaluate: Callable[[object], dict] | None = None,
    progress: bool = True,
    description: str = "rounds",
    mesh=None,
):
    """Runs `rounds` rounds of `algorithm` on `data`, evaluating every `eval_every`.

    Args:
      algorithm: Algorithm(init, round, evaluate).
      data: the training clients.
      key: PRNG key; the same key gives the same numbers.
      rounds: number of communication rounds (>= 0).
      eval_every: evaluate after every this many rounds (and at round 0 and
        at the last round).
      evaluate: state -> dict of host values for one history row; default:
        loss / loss_worst (and accuracy) of `algorithm.evaluate` on `data`.
      progress: draw a tqdm progress bar.
      mesh: optional `jax.sharding.Mesh` (see `parallel.make_mesh`): the client
        axis of `data` and of the per-client state is sharded over it.

    Returns:
      (final state, history): history is a list of dict rows, each with
      `round` and the scalar round metrics of the last round before it.
    """
    if not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0; got {rounds!r}.")
    if not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be an integer >= 1; got {eval_every!r}.")
    if mesh is not None:
        data = parallel.shard_clients(data, mesh)
    evaluate = evaluate or default_evaluate(algorithm, data)
    key_init, key_rounds = jax.random.split(key)
    state = jax.jit(algorithm.init)(key_init, data)
    if mesh is not None:
        state = parallel.shard_state(state, data.num_clients, mesh)
    history = [{"round": 0, **evaluate(state)}]
    done = 0
    with tqdm(total=rounds, disable=not progress, desc=description, unit="round") as bar:
        while done < rounds:
            length = min(eval_every, rounds - done)
            state, metrics = run_rounds(algorithm, state, data, key_rounds, done, length)
            done += length
            last = {
                name: float(np.asarray(value[-1]))
                for name, value in metrics.items()
                if np.ndim(value) == 1
            }
            row = {"round": done, **last, **evaluate(state)}
            history.append(row)
            bar.update(length)
            if "loss" in row and np.ndim(row["loss"]) == 0:
                bar.set_postfix(loss=f"{row['loss']:.4g}")
    return state, history
