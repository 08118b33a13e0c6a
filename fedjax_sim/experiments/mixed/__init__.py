"""Mixed FL experiments (Augenstein et al., arXiv:2205.13655): one module per task.

* `synthetic` (`mixed-synthetic`): two linear objectives whose optima differ by `gap`;
* `smile` (`mixed-smile`): label imbalance on sklearn's digits;
* `charlm` (`mixed-charlm`): Shakespeare next-character prediction, other plays in the
  datacenter (the same-source control);
* `charlm_wiki` (`mixed-charlm-wiki`): the same clients with a few lines each, English
  Wikipedia in the datacenter (the paper's regime);
* `movielens` (`mixed-movielens`): a dual encoder with a server-side regularizer.

`base` holds what they share: the compared methods and their rows of the method table,
the settings, the metrics, and `mixed_task`, which makes a task's pieces (`Task`) one
`Experiment` record trained through the generic path (`study`).
"""

from fedjax_sim.experiments.mixed.base import (
    LABELS,
    METHODS,
    MIXED,
    Task,
    mixed_task,
    rounds_to_target,
    run_methods,
    with_objective,
)
from fedjax_sim.experiments.mixed.charlm import CHARLM
from fedjax_sim.experiments.mixed.charlm import PRESET as _CHARLM_PRESET
from fedjax_sim.experiments.mixed.charlm_wiki import CHARLM_WIKI
from fedjax_sim.experiments.mixed.charlm_wiki import PRESET as _CHARLM_WIKI_PRESET
from fedjax_sim.experiments.mixed.movielens import MOVIELENS, Costs, costs
from fedjax_sim.experiments.mixed.movielens import PRESET as _MOVIELENS_PRESET
from fedjax_sim.experiments.mixed.smile import PRESET as _SMILE_PRESET
from fedjax_sim.experiments.mixed.smile import SMILE, binary_auc, digits_label_imbalance
from fedjax_sim.experiments.mixed.synthetic import PRESET as _SYNTHETIC_PRESET
from fedjax_sim.experiments.mixed.synthetic import SYNTHETIC, mixed_linear

PRESETS = [_SYNTHETIC_PRESET, _SMILE_PRESET, _CHARLM_PRESET, _CHARLM_WIKI_PRESET,
           _MOVIELENS_PRESET]

__all__ = [
    "CHARLM",
    "CHARLM_WIKI",
    "LABELS",
    "METHODS",
    "MIXED",
    "MOVIELENS",
    "PRESETS",
    "SMILE",
    "SYNTHETIC",
    "Costs",
    "Task",
    "binary_auc",
    "costs",
    "digits_label_imbalance",
    "mixed_linear",
    "mixed_task",
    "rounds_to_target",
    "run_methods",
    "with_objective",
]
