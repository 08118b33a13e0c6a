"""The vectorized kernels. Each is one jit-compiled function over stacked clients."""

from fedjax_sim.ops.aggregation import (
    divide_segments,
    mean_or_keep,
    segment_average,
    segment_totals,
    weighted_sum,
)
from fedjax_sim.ops.chunking import check_client_chunk, map_client_chunks, scan_client_chunks
from fedjax_sim.ops.clustering import assign_clusters, cluster_gradient_sums, cluster_losses
from fedjax_sim.ops.cohort import (
    Cohort,
    CohortBatch,
    cohort_sums,
    put,
    sample_cohort,
    take,
    taking_part,
)
from fedjax_sim.ops.kmeans import kmeans
from fedjax_sim.ops.local_update import (
    SAMPLINGS,
    LinearInGradients,
    check_sampling,
    client_keys,
    client_update,
    epoch_batches,
    input_span_pays,
    linear_in_gradients,
    local_update,
    sample_batch,
    sample_batches,
)
from fedjax_sim.ops.mixup import mixup, mixup_client
from fedjax_sim.ops.sampling import sample_uniform, sample_weighted
from fedjax_sim.ops.simplex import project_simplex

__all__ = [
    "SAMPLINGS",
    "Cohort",
    "LinearInGradients",
    "CohortBatch",
    "cohort_sums",
    "put",
    "sample_cohort",
    "take",
    "taking_part",
    "assign_clusters",
    "check_client_chunk",
    "check_sampling",
    "client_keys",
    "client_update",
    "cluster_gradient_sums",
    "cluster_losses",
    "divide_segments",
    "epoch_batches",
    "input_span_pays",
    "kmeans",
    "linear_in_gradients",
    "local_update",
    "mean_or_keep",
    "map_client_chunks",
    "mixup",
    "mixup_client",
    "project_simplex",
    "sample_batch",
    "sample_batches",
    "sample_uniform",
    "sample_weighted",
    "scan_client_chunks",
    "segment_average",
    "segment_totals",
    "weighted_sum",
]
