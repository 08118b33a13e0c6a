"""Byzantine clients and robust aggregation as settings of an experiment, declared once.

An experiment that offers them adds `ROBUST_SETTINGS`; every method it trains then gets
`algorithms.with_aggregator` (a robust rule of `ops.robust` in place of the server's
weighted mean, and Byzantine clients sending what an `ops.attacks` attack crafts). With
aggregator=mean, pre_aggregation=none and byzantine=0 nothing is wrapped: the plain
algorithm, bit for bit. What a run is built with, for m training clients and a cohort of
s = `cohort_size(m, participation)` slots:

    Byzantine clients   b = ⌊byzantine · m⌋, drawn once per seed from the seed's init key
                        (the same clients for every method of a comparison)
    f of the rules      robust_f, or derived: f = ⌈b · s / m⌉, the Byzantine clients a
                        cohort holds in expectation, rounded up (f = b at full
                        participation); trimmed_mean trims f per side, (multi-)Krum, Bulyan
                        and NNM are built for f; median, geometric median and centered
                        clipping take none
    rule                [bucketing(bucket_size) | nnm(f)] then the aggregator
                        (`ops.robust.chain`); after bucketing the rule sees ⌈s / b⌉ buckets,
                        of which at most f hold a Byzantine client
    attack              none: the Byzantine clients train honestly (a rule's cost on
                        heterogeneous data alone); label_flip: they train on labels
                        y → C − 1 − y (C = the largest training label + 1); else what they
                        send, each round, from the round's honest updates (omniscient, as
                        in the papers)

A sweep's cells that differ only in attack and byzantine may train as one program
(`RobustGrid`: their Byzantine counts, f and attacks as traced values of a grid axis).

`check` refuses, in one line and before anything is written, what cannot be built: a method
whose server does not average model changes (`algorithms.ROBUST_READY`), an f beyond what
the rule tolerates for the cohort (the rule's own refusal, raised by tracing it on the
cohort's shapes), an attack without Byzantine clients, and DP with a robust rule (one
aggregation rule per algorithm).

Every reporting client counts alike under a wrapped rule (the robust rules take no
example weights): aggregator=mean with byzantine > 0 is the uniform mean, which is FedAvg's
own default (weighting="uniform"), not its weighting="examples".
"""

from __future__ import annotations

import functools
import math

from fedjax_sim.algorithms import ROBUST_READY, with_aggregator
from fedjax_sim.algorithms.base import cohort_size
from fedjax_sim.experiments.methods import Setting
from fedjax_sim.experiments.unseen import held_out_count

AGGREGATORS = (
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "geometric_median",
    "centered_clipping",
    "bulyan",
)
PRE_AGGREGATIONS = ("none", "bucketing", "nnm")
ATTACKS = (
    "none",
    "sign_flip",
    "gaussian",
    "alie",
    "ipm",
    "min_max",
    "min_sum",
    "mimic",
    "label_flip",
)
# What attack_scale sets, per attack, and its value at attack_scale=0.
SCALES = {
    "sign_flip": ("c (send −c × own update)", 1.0),
    "gaussian": ("σ (send N(0, σ²I))", 1.0),
    "alie": ("z (send μ − zσ)", "the paper's z_max from n and f"),
    "ipm": ("ε (send −ε μ)", 0.1),
    "min_max": ("γ_init of the search", 10.0),
    "min_sum": ("γ_init of the search", 10.0),
}

ROBUST_SETTINGS = {
    st.name: st
    for st in (
        Setting(
            "aggregator",
            str,
            "mean",
            "the server's aggregation rule (ops.robust): mean, "
            "coordinate-wise median, trimmed mean, (multi-)Krum, geometric median (RFA), "
            "centered clipping, Bulyan",
            choices=AGGREGATORS,
        ),
        Setting(
            "pre_aggregation",
            str,
            "none",
            "before the rule: none, bucketing (means of "
            "random buckets of bucket_size) or nnm (nearest-neighbour mixing with f)",
            choices=PRE_AGGREGATIONS,
        ),
        Setting(
            "bucket_size",
            int,
            2,
            "bucketing: clients per bucket (Karimireddy et al.: 2)",
            minimum=1,
            maximum=1000,
            when=("pre_aggregation", ("bucketing",)),
        ),
        Setting(
            "byzantine",
            float,
            0.0,
            "share of the training clients that are Byzantine: "
            "⌊share·m⌋ clients, drawn per seed, the same for every method",
            minimum=0.0,
            maximum=0.99,
        ),
        Setting(
            "attack",
            str,
            "none",
            "what the Byzantine clients send (ops.attacks; "
            "omniscient): none (they train honestly), sign_flip, gaussian, alie (A Little Is "
            "Enough), ipm (inner-product manipulation), min_max, min_sum, mimic, "
            "label_flip (they train on labels y → C−1−y, C = the largest training label + 1)",
            choices=ATTACKS,
        ),
        Setting(
            "attack_scale",
            float,
            0.0,
            "the attack's parameter, 0: its default "
            "(sign_flip c=1, gaussian σ=1, alie z=z_max, ipm ε=0.1, min_max/min_sum "
            "γ_init=10); mimic and none take none",
            minimum=0.0,
        ),
        Setting(
            "robust_f",
            int,
            -1,
            "the Byzantine count f the rules are built for; -1: "
            "⌈b·s/m⌉ for b Byzantine of m clients and a cohort of s",
            minimum=-1,
            maximum=100_000,
        ),
        Setting(
            "cc_tau",
            float,
            1.0,
            "centered_clipping: the clipping radius τ",
            minimum=1e-12,
            when=("aggregator", ("centered_clipping",)),
        ),
    )
}


def enabled(s: dict) -> bool:
    """Whether the settings ask for a robust rule or Byzantine clients."""
    return (
        s.get("aggregator", "mean") != "mean"
        or s.get("pre_aggregation", "none") != "none"
        or float(s.get("byzantine", 0.0) or 0.0) > 0.0
    )


def training_clients(s: dict) -> int:
    """m: the clients that train (num_clients less the unseen ones held out)."""
    total = s["num_clients"]
    return total - held_out_count(s.get("unseen_clients", 0.0), total)


def byzantine_count(s: dict, m: int) -> int:
    """b = ⌊byzantine · m⌋ (the 1e-9 keeps 0.3 · 20 from flooring to 5)."""
    return int(math.floor(float(s.get("byzantine", 0.0)) * m + 1e-9))


def rule_f(s: dict, m: int) -> int:
    """The f the rules are built for: robust_f, or ⌈b · s / m⌉ (the module docstring)."""
    if s.get("robust_f", -1) >= 0:
        return int(s["robust_f"])
    slots = cohort_size(m, float(s.get("participation", 1.0)))
    return math.ceil(byzantine_count(s, m) * slots / m - 1e-9)


def aggregator_of(s: dict, f: int):
    """The `ops.robust` rule of the settings (pre-aggregation chained before it)."""
    from fedjax_sim.ops import robust

    name = s.get("aggregator", "mean")
    rule = {
        "mean": robust.mean,
        "median": robust.coordinate_median,
        "trimmed_mean": lambda: robust.trimmed_mean(f=f),
        "krum": lambda: robust.krum(f=f),
        "multi_krum": lambda: robust.multi_krum(f=f),
        "geometric_median": robust.geometric_median,
        "centered_clipping": lambda: robust.centered_clipping(tau=s.get("cc_tau", 1.0)),
        "bulyan": lambda: robust.bulyan(f=f),
    }[name]()
    pre = s.get("pre_aggregation", "none")
    if pre == "bucketing":
        return robust.chain(robust.bucketing(bucket_size=s.get("bucket_size", 2)), rule)
    if pre == "nnm":
        return robust.chain(robust.nearest_neighbor_mixing(f=f), rule)
    return rule


def attack_of(s: dict, num_classes: int | None = None):
    """The `ops.attacks` attack of the settings (None for attack=none); num_classes: C of
    label_flip (`label_classes`)."""
    from fedjax_sim.ops import attacks

    name, scale = s.get("attack", "none"), float(s.get("attack_scale", 0.0))
    given = scale > 0
    return {
        "none": lambda: None,
        "sign_flip": lambda: attacks.sign_flip(scale=scale if given else 1.0),
        "gaussian": lambda: attacks.gaussian_noise(sigma=scale if given else 1.0),
        "alie": lambda: attacks.a_little_is_enough(z=scale if given else None),
        "ipm": lambda: attacks.inner_product_manipulation(epsilon=scale if given else 0.1),
        "min_max": lambda: attacks.min_max(gamma_init=scale if given else 10.0),
        "min_sum": lambda: attacks.min_sum(gamma_init=scale if given else 10.0),
        "mimic": attacks.mimic,
        "label_flip": lambda: attacks.label_flip(num_classes),
    }[name]()


def label_classes(train) -> int:
    """C of label_flip: the largest label of the training clients + 1 (their first client
    source's labels, padding rows' zeros among them).

    Raises:
      ValueError: the labels are not integer classes (a regression's targets).
    """
    import jax
    import numpy as np

    from fedjax_sim.data.federated import is_client_source

    source = next(
        n for n in jax.tree.leaves(train, is_leaf=is_client_source) if is_client_source(n)
    )
    y = np.asarray(getattr(source, "base_y", None) if hasattr(source, "base_y") else source.y)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"attack=label_flip needs integer class labels; this experiment's training "
            f"targets are {y.dtype} (flip a classifier's labels, or give another attack)."
        )
    return max(int(y.max()) + 1, 2)


def check(table, methods, s: dict, *, sweep: bool = False) -> None:
    """ValueError in one line when the settings cannot be built for these methods (before
    anything is written), each method with its row's own settings over `s`. sweep: a
    sweep's cell, where an attack at byzantine=0 is allowed (a grid of attacks × shares;
    with no Byzantine client it trains without one)."""
    own = {n: {**s, **table[n].settings} for n in methods}
    asked = [n for n in methods if enabled(own[n])]
    if not asked:
        if s.get("attack", "none") != "none" and not sweep:
            raise ValueError(
                f"attack={s['attack']} needs Byzantine clients: give "
                "byzantine > 0 (a share of the training clients)."
            )
        return
    from fedjax_sim.experiments import privacy

    if privacy.enabled(s):
        raise ValueError(
            "dp_clip > 0 with a robust rule or Byzantine clients: one aggregation "
            "rule per algorithm; give dp_clip=0, or aggregator=mean, "
            "pre_aggregation=none and byzantine=0."
        )
    refused = [n for n in asked if not _ready(table[n])]
    if refused:
        ready = [n for n, m in table.items() if _ready(m)]
        raise ValueError(
            f"aggregator/byzantine: method{'s' if len(refused) > 1 else ''} "
            f"{', '.join(refused)} cannot take a robust rule (its server uses more than the "
            f"clients' model changes, e.g. their losses); train {', '.join(ready)}."
        )
    for n in asked:
        _check_settings(own[n], sweep)


def _check_settings(s: dict, sweep: bool) -> None:
    m = training_clients(s)
    b = byzantine_count(s, m)
    if float(s.get("byzantine", 0.0)) > 0 and b == 0:
        raise ValueError(
            f"byzantine={s['byzantine']} of {m} training clients makes none "
            f"Byzantine; give 0 or at least {1 / m:.3g}."
        )
    if s.get("attack", "none") != "none" and b == 0 and not sweep:
        raise ValueError(
            f"attack={s['attack']} needs Byzantine clients: give byzantine > 0 "
            "(a share of the training clients)."
        )
    if float(s.get("attack_scale", 0.0)) > 0 and s.get("attack", "none") not in SCALES:
        raise ValueError(
            f"attack_scale is read by attacks {', '.join(SCALES)}; attack="
            f"{s.get('attack', 'none')} takes none: leave it at 0."
        )
    _check_tolerance(s, m, b)


def _check_tolerance(s: dict, m: int, b: int) -> None:
    """The rule's own refusal of f for the cohort, raised by tracing it on [s, 1] updates."""
    import jax
    import jax.numpy as jnp

    slots = cohort_size(m, float(s.get("participation", 1.0)))
    f = rule_f(s, m)
    try:
        rule = aggregator_of(s, f)
        shape = jax.ShapeDtypeStruct((slots, 1), jnp.float32)
        jax.eval_shape(
            rule.aggregate,
            shape,
            jax.ShapeDtypeStruct((slots,), jnp.bool_),
            jax.random.key(0),
            rule.init(jax.ShapeDtypeStruct((1,), jnp.float32)),
        )
    except ValueError as err:
        pre = s.get("pre_aggregation", "none")
        raise ValueError(
            f"aggregator={s['aggregator']}"
            + (f" after {pre}" if pre != "none" else "")
            + f" with f={f} ({b} Byzantine of {m} training clients, a cohort of {slots} "
            f"slots) cannot be built: {err} Lower byzantine or robust_f, or raise "
            "num_clients or participation."
        ) from None


def _ready(method) -> bool:
    return (
        isinstance(method.algorithm, str)
        and method.algorithm in ROBUST_READY
        and method.options.get("option", "model") == "model"
    )


class RobustRule:
    """One run's robust rule and Byzantine clients (`experiments.study`'s server rule)."""

    def __init__(self, s: dict, num_clients: int, num_classes: int | None = None):
        self.m = num_clients
        self.byzantine = byzantine_count(s, num_clients)
        self.f = rule_f(s, num_clients)
        self.slots = cohort_size(num_clients, float(s.get("participation", 1.0)))
        self.aggregator_name = s.get("aggregator", "mean")
        self.pre = s.get("pre_aggregation", "none")
        self.bucket_size = s.get("bucket_size", 2)
        self.attack_name = s.get("attack", "none") if self.byzantine else "none"
        self.attack_scale = float(s.get("attack_scale", 0.0))
        self.aggregator = aggregator_of(s, self.f)
        self.attack = attack_of(s, num_classes) if self.byzantine else None

    def settings(self, s: dict) -> dict:
        return s

    def wrap(self, algorithm):
        return with_aggregator(
            algorithm, self.aggregator, byzantine=self.byzantine, attack=self.attack
        )

    def record(self) -> dict:
        """What summary.json says of the rule and the Byzantine clients."""
        return {
            "aggregator": self.aggregator_name,
            "pre_aggregation": self.pre,
            "bucket_size": self.bucket_size if self.pre == "bucketing" else None,
            "f": self.f,
            "byzantine_clients": self.byzantine,
            "training_clients": self.m,
            "cohort_slots": self.slots,
            "attack": self.attack_name,
            "attack_scale": self.attack_scale or None,
        }


class RobustGrid:
    """The robust rules of sweep cells that differ only in attack and byzantine, as the
    traced values of one program (`study.grid_run`): one point per distinct (b, f, attack)
    of the cells, where b = ⌊byzantine · m⌋ and f = `rule_f` (as `RobustRule` builds each
    cell); a cell with no Byzantine client takes the point of (0, f, none), since no attack
    reaches the server without one. At a point,

        Byzantine clients   the first b of the seed's permutation (`ops.attacks.
                            byzantine_clients` with b traced: the cell's own draw)
        rule                `aggregator_of` with f traced (`ops.robust.inject_hyperparams`)
        attack              `ops.attacks.one_of` the cells' attacks, by a traced index

    Attributes:
      points: name -> [G] values (floats, as `algorithms.with_grid` takes them).
      cell_points: each cell's point, in the order of the cells.
    """

    def __init__(self, cells: list[dict], num_clients: int, num_classes: int | None = None):
        self.s = cells[0]
        self.num_classes = num_classes
        keys = []
        for c in cells:
            b = byzantine_count(c, num_clients)
            keys.append((b, rule_f(c, num_clients), c.get("attack", "none") if b else "none"))
        self.attacks = tuple(dict.fromkeys(["none", *(k[2] for k in keys)]))
        keys = [(b, f, self.attacks.index(a)) for b, f, a in keys]
        unique = list(dict.fromkeys(keys))
        self.cell_points = [unique.index(k) for k in keys]
        self.points = {
            name: [float(k[i]) for k in unique]
            for i, name in enumerate(("byzantine", "f", "attack"))
        }

    @functools.cached_property
    def choices(self) -> tuple:
        """The cells' attacks, by their index in `attacks` (None: honest)."""
        return tuple(attack_of({**self.s, "attack": a}, self.num_classes) for a in self.attacks)

    def __len__(self) -> int:
        return len(self.points["attack"])

    def wrap_at(self, point: dict):
        """The server rule's wrap at a point of `points` (its values may be traced)."""
        import jax.numpy as jnp

        from fedjax_sim.ops import attacks, robust

        def whole(name):
            return jnp.asarray(point[name]).astype(jnp.int32)

        aggregator = robust.inject_hyperparams(lambda f: aggregator_of(self.s, f), f=whole("f"))
        attack = attacks.one_of(self.choices, whole("attack"))

        def wrap(algorithm):
            return with_aggregator(
                algorithm, aggregator, byzantine=whole("byzantine"), attack=attack
            )

        return wrap


def plan(s: dict, num_clients: int, num_classes: int | None = None) -> RobustRule | None:
    """The run's RobustRule where its settings ask for one; None: the plain algorithm."""
    return RobustRule(s, num_clients, num_classes) if enabled(s) else None


__all__ = [
    "AGGREGATORS",
    "ATTACKS",
    "PRE_AGGREGATIONS",
    "ROBUST_SETTINGS",
    "RobustGrid",
    "RobustRule",
    "check",
    "enabled",
    "label_classes",
    "plan",
    "rule_f",
]
