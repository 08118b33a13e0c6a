"""pfl-research's CIFAR-10 benchmark: FedAvg on its users, its simple_cnn, central evaluation.

pfl-research (Apple; Granqvist et al., "pfl-research: simulation framework for accelerating
research in Private Federated Learning", NeurIPS 2024 Datasets and Benchmarks,
arXiv:2404.06430) publishes the configuration it times simulators on,
`pfl:benchmarks/image_classification/configs/baseline.yaml` of apple/pfl-research:

    users    ← 50 000 CIFAR-10 training images, permuted, cut into 1 000 users of 50
               (cifar10_iid; cifar10: Dirichlet(0.1) class shares per user)
    model    ← simple_cnn (conv 32, conv 64, maxpool, dropout .25, dense 128, dropout .5,
               dense 10: 1 626 442 parameters)
    each central iteration t = 1 … 1 500:
        S    ← 50 users
        each i ∈ S: w_i ← one epoch of SGD(lr 0.1) over its images in batches of 10, from w
        Δ    ← mean_{i ∈ S} (w_i − w)                      (unweighted: weight_by_samples false)
        w    ← w + 1.0 · Δ                                  (central SGD at learning_rate 1.0)
        every 10: loss and accuracy of w on the 10 000 test images

`fedavg-cifar10-pfl` runs it from a user's CIFAR-10 copy (`data_dir`);
docs/protocols.md#cifar-10-pfl-research says what matches pfl and what differs.
Modules: `data` (the images, pfl's users), `experiment` (the record `PFL`: settings,
metrics, presets; `problem(s, arrays)` builds its problem from given arrays).
"""

from fedjax_sim.experiments.pfl_cifar10.data import (
    build_problem,
    channel_stats,
    dirichlet_users,
    iid_users,
    load_split_images,
)
from fedjax_sim.experiments.pfl_cifar10.experiment import (
    PFL,
    PRESETS,
    TABLE,
    metrics_fn,
    problem,
)

__all__ = ["PFL", "PRESETS", "TABLE", "build_problem", "channel_stats",
           "dirichlet_users", "iid_users", "load_split_images", "metrics_fn", "problem"]
