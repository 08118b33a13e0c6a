"""Models: pure init/apply/loss functions; flax modules plug in via `from_flax`."""

from fedjax_sim.models.core import (
    DenseInput,
    Model,
    check_model_data,
    client_accuracy,
    client_loss,
    combine,
    from_flax,
    linear_regression,
    masked_mean,
    partition,
    soft_cross_entropy,
    softmax_cross_entropy,
    split_model,
    squared_error,
)
from fedjax_sim.models.pool import max_pool
from fedjax_sim.models.zoo import MLP, MLPTrunk, mlp_classifier, simple_cnn

__all__ = [
    "DenseInput",
    "MLP",
    "MLPTrunk",
    "Model",
    "check_model_data",
    "client_accuracy",
    "client_loss",
    "combine",
    "from_flax",
    "linear_regression",
    "masked_mean",
    "max_pool",
    "mlp_classifier",
    "partition",
    "simple_cnn",
    "soft_cross_entropy",
    "softmax_cross_entropy",
    "split_model",
    "squared_error",
]
