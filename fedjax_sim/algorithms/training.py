"""How a client trains: one object, validated once, taken by every algorithm that trains clients.

A `ClientTraining` is the client optimizer, the number of local steps, the batch
size and how minibatches are drawn. Every factory that trains clients takes one
(`fedavg(model, sgd(0.1, steps=5, batch_size=32))`), so every method of a
comparison can be given the same local training, and every algorithm honours
every sampling mode. The steps themselves are `ops.client_update`'s: a
`lax.scan` over split keys, one client's maths, vmapped once.

Sampling modes (`SAMPLINGS`):

- "with_replacement": each step draws its minibatch afresh (distinct rows
  within a batch; a row may come back in the next batch before others were
  seen). The default.
- "epochs": the steps go through the client's rows without replacement, epoch
  after epoch, each a fresh permutation (the "E local epochs of batch b" of a
  protocol: ⌈n / b⌉ steps an epoch).

A full-batch step (`batch_size=None`) reads every real row, whatever the mode.

Per-client work (`work=`, an `ops.work.Work`): client i takes τ_i ≤ `steps`
steps (drawn once per client, redrawn every round, read from a per-client
table, or E epochs of its own rows), masked inside the one scan of `steps`.
A straggler of the round (`fedjax_sim.systems.Systems`) takes a uniform
1, …, τ_i − 1 of them (`ops.work.straggler_steps`; τ_i itself when τ_i ≤ 1).

A learning rate that changes with the round (`sgd(round_decay(0.25, 0.99))`: η_t =
0.25·0.99^t) is a schedule of the round, not of optax's step count: the client
optimizer starts fresh every round. Every algorithm's round trains at
`training.at_round(state.round)`, the plain-rate training of that round; a constant
rate is that training itself.

Examples:
  >>> import optax
  >>> from fedjax_sim.algorithms import ClientTraining, sgd
  >>> training = sgd(0.1, steps=5, batch_size=32)
  >>> training.steps, training.batch_size, training.sampling, training.learning_rate
  (5, 32, 'with_replacement', 0.1)
  >>> ClientTraining(optax.adam(1e-3), steps=10, batch_size=16, sampling="epochs").steps
  10
  >>> sgd(0.1, steps=0)
  Traceback (most recent call last):
  ...
  ValueError: ClientTraining steps (local steps) must be an integer >= 1; got 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.ops import SAMPLINGS, client_update, linear_in_gradients, local_update
from fedjax_sim.ops.work import TABLE_MAX_CLIENTS, UNIFORM_WORK, Work, straggler_steps


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ClientTraining {name} must be an integer >= 1; got {value!r}.")


@dataclasses.dataclass(frozen=True, eq=False)
class ClientTraining:
    """A client's local training: `steps` optimizer steps on minibatches of its rows.

    Attributes:
      optimizer: the client optimizer (an optax transformation; a fresh state
        on every client every round, as in FedAvg).
      steps: local steps τ per round (static).
      batch_size: rows per step; None for full-batch steps (static).
      sampling: how minibatches are drawn, one of `SAMPLINGS` (static).
      learning_rate: the step size when `optimizer` is plain SGD (`sgd` sets it; may
        be traced, or a schedule of the round: round -> rate); None for any other
        optimizer. Algorithms whose maths assume SGD at a known rate (SCAFFOLD's
        control variates, q-FFL's Lipschitz estimate) read it, at the round's rate,
        and refuse other optimizers.
      work: how many of the `steps` each client takes (`ops.work.Work`; static);
        the default: all of them.
    """

    optimizer: optax.GradientTransformation | Callable[..., optax.GradientTransformation]
    steps: int = 1
    batch_size: int | None = None
    sampling: str = "with_replacement"
    learning_rate: object = None
    work: Work = UNIFORM_WORK

    def __post_init__(self):
        # A function of the round is checked at round 0, before anything is traced.
        optimizer = self.optimizer(0) if self.scheduled else self.optimizer
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise ValueError(f"ClientTraining optimizer must be an optax "
                             f"GradientTransformation, or a function of the round returning "
                             f"one; got {optimizer!r}.")
        if callable(self.learning_rate) and not self.scheduled:
            raise ValueError("a ClientTraining learning_rate schedule needs an optimizer of the "
                             "round as well (sgd(schedule) builds both); got the optimizer "
                             f"{self.optimizer!r}.")
        _check_count("steps (local steps)", self.steps)
        if self.batch_size is not None:
            _check_count("batch_size", self.batch_size)
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"ClientTraining sampling must be one of "
                             f"{', '.join(SAMPLINGS)}; got {self.sampling!r}.")
        if not isinstance(self.work, Work):
            raise ValueError(f"ClientTraining work must be an ops.work.Work; got {self.work!r}.")
        self.work.check(self.steps)

    def replace(self, **changes) -> ClientTraining:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def scheduled(self) -> bool:
        """Whether the optimizer is a function of the round (a schedule of the round)."""
        return callable(self.optimizer) and not hasattr(self.optimizer, "init")

    def at_round(self, round) -> ClientTraining:  # noqa: A002
        """This training in round `round` (the state's round counter; may be traced): its
        optimizer and learning rate at that round's rate when they follow a schedule;
        itself otherwise, so a constant rate traces as it always did.

        Examples:
          >>> from fedjax_sim.algorithms import round_decay, sgd
          >>> training = sgd(round_decay(0.5, 0.5), steps=2)
          >>> float(training.at_round(2).learning_rate)  # 0.5 · 0.5²
          0.125
          >>> constant = sgd(0.1, steps=2)
          >>> constant.at_round(2) is constant
          True
        """
        if not self.scheduled:
            return self
        rate = self.learning_rate(round) if callable(self.learning_rate) else self.learning_rate
        return dataclasses.replace(self, optimizer=self.optimizer(round), learning_rate=rate)

    def preceded_by(self, *transforms) -> ClientTraining:
        """The same training with `transforms` applied to each gradient before its
        optimizer (`optax.chain(*transforms, optimizer)`: FedProx's proximal term), in
        every round when the optimizer is a function of the round."""
        if not self.scheduled:
            return self.replace(optimizer=optax.chain(*transforms, self.optimizer))
        optimizer_at = self.optimizer

        def optimizer(round):  # noqa: A002
            return optax.chain(*transforms, optimizer_at(round))

        return self.replace(optimizer=optimizer)

    def _check_resolved(self) -> None:
        if self.scheduled:
            raise ValueError("this ClientTraining's rate follows a schedule of the round: "
                             "train with training.at_round(state.round), the round's rate.")

    def client_steps(self, key, client_id, num_examples, straggles=None, *, tau=None):
        """τ_i of one client this round (int32), or None when it is all `steps` (no
        straggler and uniform work: the scan then needs no mask). tau: the client's τ_i
        when already read from its work's table (`Work.table`)."""
        if self.work.uniform and straggles is None:
            return None
        if tau is None:
            tau = self.work.steps_of(key, client_id, num_examples, self.steps,
                                     self.batch_size)
        if straggles is not None:
            tau = jnp.where(straggles, straggler_steps(key, tau), tau)
        return tau

    def steps_taken(self, data, keys, *, ids=None, straggles=None, num_clients=None):
        """[c] int32: the steps each client of `data` takes this round (τ_i, or a
        straggler's share of it; `steps` for all under uniform work), drawn as
        `update_clients` draws them from the same keys, ids and flags.

        num_clients: m, static, when known (`CohortBatch.work()`): work drawn once per
        client is then read from its table (`Work.table`) instead of drawn again.
        """
        if self.work.uniform and straggles is None:
            return jnp.full(keys.shape[:1], self.steps, jnp.int32)
        if ids is None:
            if self.work.needs_ids():
                raise ValueError("this ClientTraining's work draws τ_i per client, from its "
                                 "id: pass ids= (a cohort batch's `batch.work()`).")
            ids = jnp.zeros(keys.shape[:1], jnp.int32)  # unread
        flags = jnp.zeros(keys.shape[:1], bool) if straggles is None else straggles
        tau = None
        if (num_clients is not None and self.work.needs_ids()
                and num_clients <= TABLE_MAX_CLIENTS):
            tau = jnp.asarray(self.work.table(self.steps, num_clients))[ids]
        return jax.vmap(lambda k, i, n, f, t: self.client_steps(k, i, n, f, tau=t))(
            keys, ids, data.num_examples, flags, tau)

    def update(self, model, params, x, y, num_examples, key, *, client_id=None,
               straggles=None, work_key=None, **hooks):
        """One client's local steps from `params` (`ops.client_update`).

        client_id, straggles: the slot's client id and straggler flag (a cohort
        batch's `ids` and `straggles`), read by per-client work and stragglers.
        work_key: the key τ_i and a straggler's share are drawn from (default
          `key`): a second training of the same slot on its own key (Ditto's
          personal steps) passes the slot's key, so both take the same steps.
        hooks: client_update's `snapshot_step`, `batch_loss`, `direction`,
        `keep_first_grad`. Returns (params, snapshot or None, [steps] losses), and
        with keep_first_grad the first step's gradient.
        """
        self._check_resolved()
        return client_update(model, self.optimizer, params, x, y, num_examples, key,
                             num_steps=self.steps, batch_size=self.batch_size,
                             sampling=self.sampling,
                             active_steps=self.client_steps(
                                 key if work_key is None else work_key, client_id,
                                 num_examples, straggles), **hooks)

    def update_clients(self, model, params, data, keys, *, ids=None, straggles=None,
                       num_clients=None, **hooks):
        """Every client of `data` from its own params (leaves [c, ...]), one key each.

        ids, straggles: [c] client ids and straggler flags; num_clients: m, static
        (`CohortBatch.work()` gives all three).
        Returns (params [c, ...], snapshots or None, losses [c, steps])
        (`ops.local_update`; hooks: `snapshot_step`, `batch_loss`).
        """
        self._check_resolved()
        active = None
        if not (self.work.uniform and straggles is None):
            active = self.steps_taken(data, keys, ids=ids, straggles=straggles,
                                      num_clients=num_clients)
        return local_update(model, self.optimizer, params, data, keys, num_steps=self.steps,
                            batch_size=self.batch_size, sampling=self.sampling,
                            active_steps=active, **hooks)

    def minibatch(self, max_examples: int) -> int:
        """Rows of one minibatch of a client padded to `max_examples` rows."""
        return max_examples if self.batch_size is None else min(self.batch_size,
                                                                 max_examples)


def check_training(algorithm: str, training, name: str = "training") -> ClientTraining:
    """`training`, or ValueError naming the algorithm when it is no ClientTraining (an
    optax optimizer where the training belongs, say)."""
    if not isinstance(training, ClientTraining):
        hint = (" (an optax optimizer goes inside: ClientTraining(optimizer, steps=...))"
                if hasattr(training, "update") else "")
        raise ValueError(f"{algorithm}'s {name} must be a ClientTraining, e.g. sgd(0.1, "
                         f"steps=5); got {training!r}{hint}.")
    return training


def check_learning_rate(name: str, value, positive: bool = False) -> None:
    """ValueError unless a concrete `value` is a finite number >= 0 (> 0 with `positive`);
    a traced value (a sweep vmaps over it) passes; a schedule of the round is checked at
    round 0."""
    if callable(value):
        value = value(0)
    if isinstance(value, jax.core.Tracer) or isinstance(value, jax.Array) and value.ndim:
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}.") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")


def sgd(learning_rate, *, steps: int = 1, batch_size: int | None = None,
        sampling: str = "with_replacement", work: Work = UNIFORM_WORK) -> ClientTraining:
    """Plain SGD at `learning_rate` (may be traced), declared linear in its gradients
    (`ops.linear_in_gradients`: a model's dense input layer may then train in the span of
    its client's rows, the same maths at fewer multiply-adds).

    Args:
      learning_rate: the step size η >= 0 (a float, or a traced value a sweep vmaps), or
        a schedule of the round, round -> η_t (`round_decay`): round t's clients train
        at η_t (`ClientTraining.at_round`).
      steps: local steps τ per round.
      batch_size: rows per step; None: every real row of the client (full batch).
      sampling: how minibatches are drawn, one of `SAMPLINGS` ("with_replacement":
        afresh each step; "epochs": through the rows epoch after epoch).
      work: how many of the steps each client takes (`ops.work.Work`); default all.

    Returns:
      A ClientTraining whose `learning_rate` is set (SCAFFOLD and q-FFL read it).

    Examples:
      >>> from fedjax_sim.algorithms import sgd
      >>> training = sgd(0.1, steps=5, batch_size=32, sampling="epochs")
      >>> training.steps, training.batch_size, training.sampling, training.learning_rate
      (5, 32, 'epochs', 0.1)
      >>> training.replace(steps=1, batch_size=None).batch_size is None  # full batch
      True
      >>> sgd(0.1, sampling="shuffled")
      Traceback (most recent call last):
      ...
      ValueError: ClientTraining sampling must be one of with_replacement, epochs; got 'shuffled'.
    """
    check_learning_rate("learning_rate", learning_rate)
    if callable(learning_rate):
        def optimizer(round):  # noqa: A002
            return linear_in_gradients(optax.sgd(learning_rate(round)))
    else:
        optimizer = linear_in_gradients(optax.sgd(learning_rate))
    return ClientTraining(optimizer, steps, batch_size, sampling, learning_rate=learning_rate,
                          work=work)


def round_decay(learning_rate, decay) -> Callable:
    """The schedule of the round t -> learning_rate · decay^t (float32), for `sgd`.

    Round t's clients train at η_t (the rotated-CIFAR schedule is 0.25·0.99^t); the
    client optimizer starts fresh every round, so t is the round, not optax's step
    count. A decay of 1 is the constant rate itself.

    Args:
      learning_rate: η_0 >= 0 (may be traced).
      decay: the factor per round, >= 0 (may be traced; 1: the constant rate).

    Returns:
      A callable round -> rate (an optax-style schedule of the round).

    Examples:
      >>> from fedjax_sim.algorithms import round_decay, sgd
      >>> schedule = round_decay(0.25, 0.5)
      >>> [float(schedule(t)) for t in range(3)]
      [0.25, 0.125, 0.0625]
      >>> training = sgd(schedule, steps=5)
      >>> float(training.at_round(1).learning_rate)
      0.125
      >>> round_decay(0.25, -0.5)
      Traceback (most recent call last):
      ...
      ValueError: round_decay's decay must be a finite number >= 0; got -0.5.
    """
    check_learning_rate("round_decay's learning_rate", learning_rate)
    check_learning_rate("round_decay's decay", decay)
    constant = isinstance(decay, int | float) and decay == 1.0

    def schedule(round):  # noqa: A002
        if constant:  # the rate itself: no arithmetic in the trace
            return learning_rate
        return learning_rate * jnp.power(jnp.float32(decay),
                                         jnp.asarray(round).astype(jnp.float32))

    return schedule


def sgd_rate(training: ClientTraining, algorithm: str, why: str, positive: bool = True):
    """`training.learning_rate`, for an algorithm whose maths assume plain SGD at a known
    rate (a schedule of the round when it follows one: the round's rate is
    `training.at_round(round).learning_rate`); ValueError naming the algorithm and why
    otherwise."""
    if training.learning_rate is None:
        raise ValueError(f"{algorithm} trains its clients with plain SGD ({why}): give "
                         "training=sgd(learning_rate, ...).")
    check_learning_rate(f"{algorithm}'s learning_rate", training.learning_rate, positive)
    return training.learning_rate
