"""Client data: stacked padded arrays and generators."""

from fedjax_sim.data.federated import FederatedData, ServerData
from fedjax_sim.data.synthetic import (
    LinearMixture,
    bernoulli_init,
    check_mixture_settings,
    linear_mixture,
)

__all__ = [
    "FederatedData",
    "LinearMixture",
    "ServerData",
    "bernoulli_init",
    "check_mixture_settings",
    "linear_mixture",
]
