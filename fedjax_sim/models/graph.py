"""A GIN-style graph network for molecular regression, split for mixup after g.

Keyulu Xu, Weihua Hu, Jure Leskovec, Stefanie Jegelka. "How Powerful are Graph
Neural Networks?" ICLR 2019, arXiv:1810.00826.

Graphs are padded dense arrays (data/molecules.py): x = {"nodes" [n, A, F],
"adjacency" [n, A, A], "atom_mask" [n, A]}. The trunk g maps a graph to its
embedding (GIN layers h ← MLP((1 + ε) h + A h), then sum or mean pooling over
real atoms); the head is an MLP to one number. DRFLM mixes the embeddings g(x)
(docs/protocols.md#drflm), so the split is trunk = g, head = the MLP.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fedjax_sim.models.core import Model, split_model, squared_error

POOLINGS = ("sum", "mean")
# LeCun-normal without the truncation: flax's default truncated normal compiles ~3x slower
# when the init is vmapped over seeds (erfinv), for no difference that matters here.
_KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


def _dense(features, name=None):
    return nn.Dense(features, kernel_init=_KERNEL_INIT, name=name)


class GINTrunk(nn.Module):
    """Graph -> embedding [n, hidden]."""

    hidden: int = 64
    layers: int = 3
    pooling: str = "mean"

    @nn.compact
    def __call__(self, x):
        h, adj, mask = x["nodes"], x["adjacency"], x["atom_mask"][..., None]
        h = _dense(self.hidden, name="embed")(h) * mask
        for i in range(self.layers):
            eps = self.param(f"eps_{i}", nn.initializers.zeros, ())
            agg = (1.0 + eps) * h + jnp.einsum("nab,nbf->naf", adj, h)
            agg = nn.relu(_dense(self.hidden, name=f"mlp_{i}_0")(agg))
            h = nn.relu(_dense(self.hidden, name=f"mlp_{i}_1")(agg)) * mask
        total = jnp.sum(h, axis=1)
        if self.pooling == "sum":
            return total
        return total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


class RegressionHead(nn.Module):
    """Embedding -> one prediction per graph, [n]."""

    hidden: int = 64

    @nn.compact
    def __call__(self, h):
        h = nn.relu(_dense(self.hidden)(h))
        return _dense(1)(h)[..., 0]


def gin_regressor(num_features: int, max_atoms: int, *, hidden: int = 64, layers: int = 3,
                  pooling: str = "mean", head_hidden: int | None = None) -> Model:
    """A split GIN regression model with squared error (trunk: g, head: MLP).

    Args:
      num_features: per-atom features F.
      max_atoms: padded atom count A (for the example input only).
      hidden: GIN width; layers: GIN layers; pooling: "sum" or "mean".
      head_hidden: width of the head's hidden layer (default: hidden).
    """
    for name, value in (("num_features", num_features), ("max_atoms", max_atoms),
                        ("hidden", hidden), ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}; got {pooling!r}.")
    example = {"nodes": jnp.zeros((1, max_atoms, num_features)),
               "adjacency": jnp.zeros((1, max_atoms, max_atoms)),
               "atom_mask": jnp.ones((1, max_atoms))}
    return split_model(GINTrunk(hidden, layers, pooling), RegressionHead(head_hidden or hidden),
                       example, example_loss=squared_error, correct=None)
