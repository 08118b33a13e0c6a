"""Checks of an algorithm's inputs before a run, on the host."""

from __future__ import annotations

import warnings

import jax
import numpy as np

from fedjax_sim.data.federated import is_client_source as _is_clients


def check_run_inputs(data) -> None:
    """Refuses inputs that hold no client data; warns when every client is empty.

    Args:
      data: the algorithm's inputs: a FederatedData, or a pytree holding one
        beside server-side arrays (`ServerData`).

    Raises:
      TypeError: data holds no FederatedData (e.g. a bare array).
    """
    found = [n for n in jax.tree.leaves(data, is_leaf=_is_clients) if _is_clients(n)]
    if not found:
        raise TypeError(
            "data must be a FederatedData (FederatedData.from_arrays / from_clients) or a "
            f"pytree holding one beside ServerData; got {type(data).__name__}."
        )
    for clients in found:
        if clients.never_empty:  # generated clients: num_examples would be an [m] broadcast
            continue
        counts = clients.num_examples
        if isinstance(counts, jax.core.Tracer) or not getattr(counts, "is_fully_addressable",
                                                               True):
            continue
        if clients.num_clients and not np.any(np.asarray(counts) > 0):
            warnings.warn(
                f"every one of the {clients.num_clients} clients has 0 examples "
                "(data.num_examples is all 0): no client takes part, and client losses "
                "are NaN.", UserWarning, stacklevel=3)
