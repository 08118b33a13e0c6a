"""Client data: stacked padded arrays and generators."""

from fedjax_sim.data.federated import (
    ClientSource,
    ClientViews,
    FederatedData,
    ServerData,
    copies_axes,
    copy_at,
    stack_views,
)
from fedjax_sim.data.synthetic import (
    GeneratedClients,
    LinearMixture,
    bernoulli_init,
    check_mixture_settings,
    generated_mixture,
    linear_mixture,
)

__all__ = [
    "ClientSource",
    "ClientViews",
    "FederatedData",
    "GeneratedClients",
    "LinearMixture",
    "ServerData",
    "bernoulli_init",
    "check_mixture_settings",
    "copies_axes",
    "copy_at",
    "generated_mixture",
    "linear_mixture",
    "stack_views",
]
