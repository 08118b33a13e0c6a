"""Models: pure init/apply/loss functions; flax modules plug in via `from_flax`."""

from fedjax_sim.models.core import (
    MLP,
    Model,
    client_accuracy,
    client_loss,
    from_flax,
    linear_regression,
    masked_mean,
    mlp_classifier,
    softmax_cross_entropy,
    squared_error,
)

__all__ = [
    "MLP",
    "Model",
    "client_accuracy",
    "client_loss",
    "from_flax",
    "linear_regression",
    "masked_mean",
    "mlp_classifier",
    "softmax_cross_entropy",
    "squared_error",
]
