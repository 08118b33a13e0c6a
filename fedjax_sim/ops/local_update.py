"""τ local optimizer steps on every client at once: `vmap` of a `lax.scan`.

A model that declares its first layer dense on the flattened input
(`Model.dense_input`), trained by an optimizer declared linear in its gradients
(`linear_in_gradients`, e.g. SGD), trains that layer in the span of the
client's rows (`client_update`, "The input layer in the span of the rows").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.execution import plan_of
from fedjax_sim.models.core import Model
from fedjax_sim.ops.chunking import map_client_chunks

AUGMENT_STREAM = 1  # a step's augmentation key: fold_in(step key, 1), beside its batch/loss split
EPOCH_STREAM = 2  # sampling="epochs": epoch e is keyed fold_in(fold_in(client key, 2), e)
DROPOUT_STREAM = 3  # a step's `Model.train_apply` key (dropout): fold_in(step key, 3)
SAMPLINGS = ("with_replacement", "epochs")
RANK_MAX_ROWS = 128  # up to here `lowest` counts ranks (n² compares) instead of sorting


def lowest(scores, size: int, *, replicated: bool = False):
    """Indices of the `size` lowest of scores [n], ascending, ties to the lower index
    (what `jnp.argsort(scores)[:size]` gives, without its full sort: on CPU that sort took
    1.9 ms per step for 100 clients' 16 of 64 rows, and 2.1 ms for 256 of 4096 rows).

    n ≤ RANK_MAX_ROWS: each row's rank is counted (O(n²) compares, in a loop over the
    rows j, unrolled 4 at a time, that adds 1 to every row j comes before: O(n) memory.
    The [n, n] table of compares it replaced was materialized by XLA:CPU: 16 MB for 100
    clients' K = 10 draws of 64 rows, 4× slower there; about as fast up to 32 rows; the
    loop not unrolled was 6× slower at 20 rows) and row r of the batch is the one of rank r;
    elementwise work that splits along any batch axis, so vmapped over clients sharded
    on a mesh it moves nothing between devices. Larger n: `replicated=True` (an array
    every device holds whole, e.g. the server's datacenter) uses `lax.top_k` (the same
    indices: it puts the lower index first too; the optimization barrier keeps XLA:CPU
    from rewriting a batched top_k fused with its consumers into a full sort); otherwise
    the full argsort, because XLA's partitioner all-gathers a sharded batch axis of top_k.
    """
    n = scores.shape[0]
    if n <= RANK_MAX_ROWS:
        i = jnp.arange(n)

        def count(j, rank):  # +1 for every row that row j comes before
            s_j = scores[j]
            return rank + ((s_j < scores) | ((s_j == scores) & (j < i))).astype(jnp.int32)

        rank = jax.lax.fori_loop(0, n, count, jnp.zeros(n, jnp.int32), unroll=4)
        at = rank[None, :] == jnp.arange(size)[:, None]  # [size, n]: row i holds rank r
        return jnp.sum(jnp.where(at, i[None, :], 0), axis=1).astype(jnp.int32)
    if replicated:
        return jax.lax.optimization_barrier(jax.lax.top_k(-scores, size)[1])
    return jnp.argsort(scores)[:size].astype(jnp.int32)


def sample_batch(key, num_examples, n_max: int, batch_size: int, *, replicated: bool = False):
    """Row indices of one minibatch of a client, without replacement.

    Returns (idx [b], mask [b]), b = min(batch_size, n_max). When the client
    has fewer than batch_size real rows, the batch is all of them and the rest
    is masked. `replicated`: the rows belong to an array held whole by every
    device (the server's), see `lowest`.
    """
    with jax.named_scope("sample_batch"):  # (its ops' name in profiles)
        rows = jnp.arange(n_max)
        scores = jnp.where(rows < num_examples, jax.random.uniform(key, (n_max,)), jnp.inf)
        size = min(batch_size, n_max)  # a batch larger than the padded width is all rows
        idx = lowest(scores, size, replicated=replicated)
        mask = jnp.arange(size) < num_examples
    return idx, mask


def sample_batches(keys, num_examples, n_max: int, batch_size: int, *,
                   replicated: bool = False):
    """`sample_batch` for each of K step keys, drawn together: (idx [K, b], mask [K, b]).

    The same batches as K separate calls; drawn before a step loop, the PRNG
    and the rank count run once for all K steps instead of once per step (on
    CPU the threefry hash is a rolled loop, whose per-call cost dominates at
    these sizes).
    """
    return jax.vmap(lambda k: sample_batch(k, num_examples, n_max, batch_size,
                                           replicated=replicated))(keys)


def epoch_batches(key, num_examples, n_max: int, batch_size: int, num_steps: int):
    """Row indices of num_steps minibatches that go through a client's real rows in epochs.

    Epoch e is a fresh permutation of the client's n real rows (padding never
    drawn), keyed by fold_in(key, e), cut into S = ⌈n / b⌉ batches of b rows in
    order; the last batch of an epoch holds the remaining n − (S − 1)·b rows
    and the rest of it is masked (a DataLoader without drop_last). Step t is
    batch t mod S of epoch ⌊t / S⌋, so every epoch visits every real row
    exactly once; when num_steps is not a multiple of S the last epoch is
    partial. A client without rows gets all-masked batches.

    Args:
      key: the client's epoch key.
      num_examples: n, the client's real rows (traced).
      n_max: the padded row count (static).
      batch_size: b (static); b > n_max is cut to n_max.
      num_steps: K (static).

    Returns:
      (idx [K, b'], mask [K, b']) with b' = min(b, n_max).
    """
    with jax.named_scope("epoch_batches"):
        size = min(batch_size, n_max)
        rows = jnp.arange(n_max)
        per_epoch = jnp.maximum((num_examples + size - 1) // size, 1)
        steps = jnp.arange(num_steps)
        pos = (steps % per_epoch)[:, None] * size + jnp.arange(size)  # [K, b']: place in epoch

        def order(epoch):  # the real rows first, in a random order
            u = jax.random.uniform(jax.random.fold_in(key, epoch), (n_max,))
            return lowest(jnp.where(rows < num_examples, u, jnp.inf), n_max)

        orders = jax.vmap(order)(steps // per_epoch)  # [K, n_max]
        idx = jnp.take_along_axis(orders, jnp.minimum(pos, n_max - 1), axis=1)
    return idx, pos < num_examples


class LinearInGradients(optax.GradientTransformation):
    """An optax transformation declared linear in its gradients (`linear_in_gradients`)."""

    __slots__ = ()


def linear_in_gradients(optimizer: optax.GradientTransformation) -> LinearInGradients:
    """The same optimizer, declared linear: its updates are a fixed linear function of the
    gradients seen so far, whatever the params (SGD with any learning-rate schedule,
    momentum, Nesterov; NOT Adam, clipping or weight decay: the caller vouches for it).
    Lets `client_update` step a dense input layer through the coefficients of its rows.
    """
    def init(params):  # own functions: never equal to the undeclared optimizer as a tuple
        return optimizer.init(params)

    def update(updates, state, params=None, **extra_args):
        return optimizer.update(updates, state, params, **extra_args)

    return LinearInGradients(init, update)


def input_span_pays(n_max: int, batch: int, d: int, h: int, num_steps: int) -> bool:
    """Whether the span form of a dense input layer [d, h] needs fewer multiply-adds than
    plain steps, for a client of n_max rows and num_steps steps of `batch` rows.

    Plain: every step multiplies its batch by the kernel and forms the kernel's
    gradient, 2·b·d·h. Span: once the rows through the starting kernel (n·d·h),
    their Gram matrix (n²·d) and the final kernel (n·d·h); per step b·n·h.
    """
    plain = num_steps * 2 * batch * d * h
    span = 2 * n_max * d * h + n_max * n_max * d + num_steps * batch * n_max * h
    return span < plain


def _input_span_applies(model, optimizer, params, x, batch_size, num_steps,
                        plain_step_only: bool) -> bool:
    """Whether `client_update` takes `_input_span_steps` (see its docstring)."""
    if (model.dense_input is None or not isinstance(optimizer, LinearInGradients)
            or model.augment is not None or model.train_apply is not None
            or not plain_step_only or not hasattr(x, "shape")):
        return False
    n_max = x.shape[0]
    batch = n_max if batch_size is None else min(batch_size, n_max)
    h = model.dense_input.kernel(params).shape[-1]
    return input_span_pays(n_max, batch, math.prod(x.shape[1:]), h, num_steps)


def _step_if(t, active_steps, stepped, held):
    """`stepped` where step t is one of the client's first `active_steps`, else `held`."""
    if active_steps is None:
        return stepped
    go = t < active_steps
    return jax.tree.map(lambda a, b: jnp.where(go, a, b), stepped, held)


def _input_span_steps(model, optimizer, params, x, y, num_examples, batches, num_steps,
                      active_steps=None):
    """`client_update`'s steps with the dense input layer kept as W₀ + Xᵀ C.

    A step's kernel gradient is X_bᵀ g_z (g_z: the loss's gradient at the
    layer's output z = X_b W), which lies in the span of the client's rows X:
    it is Xᵀ G with G the [n, h] matrix holding g_z at the batch's rows. So
    every kernel the steps reach is W_t = W₀ + Xᵀ C_t, and a step needs only
    z = X_b W₀ + (X_b Xᵀ) C_t, two products with [n, ·] sides: X W₀ and the
    Gram matrix X Xᵀ are formed once. An optimizer linear in its gradients
    (`linear_in_gradients`) stepping C along G moves W exactly as it would
    step W along X_bᵀ g_z. The same batches and losses as the plain steps;
    float rounding differs.
    """
    spec = model.dense_input
    n_max = y.shape[0]
    kernel = spec.kernel(params)
    # X [n, d] in the dtype the layer's product promotes to (uint8 pixels: float32, as flax's
    # Dense does), so the Gram matrix never sums in the pixels' integer type.
    rows = x.reshape(n_max, -1).astype(jnp.result_type(x.dtype, kernel.dtype))
    through = rows @ kernel  # X W₀ [n, h]
    gram = rows @ rows.T  # X Xᵀ [n, n]
    rest = spec.without_kernel(params)
    coef = jnp.zeros_like(through)  # C [n, h]

    def loss_fn(z, r, yb, mb):
        losses = model.example_loss(spec.rest(r, z), yb)
        return jnp.sum(mb * losses) / jnp.maximum(jnp.sum(mb), 1.0)

    def step(carry, inputs):
        coef, r, opt_state = carry
        t, batch = inputs
        if batch is None:
            z = through + gram @ coef
            yb, mb = y, (jnp.arange(n_max) < num_examples).astype(jnp.float32)
        else:
            idx, bmask = batch
            z = through[idx] + gram[idx] @ coef
            yb, mb = y[idx], bmask.astype(jnp.float32)
        loss, (g_z, g_rest) = jax.value_and_grad(loss_fn, argnums=(0, 1))(z, r, yb, mb)
        g_coef = g_z if batch is None else jnp.zeros_like(coef).at[batch[0]].add(g_z)
        updates, new_state = optimizer.update((g_coef, g_rest), opt_state, (coef, r))
        stepped = (*optax.apply_updates((coef, r), updates), new_state)
        return _step_if(t, active_steps, stepped, (coef, r, opt_state)), loss

    carry = (coef, rest, optimizer.init((coef, rest)))
    (coef, rest, _), losses = jax.lax.scan(step, carry, (jnp.arange(num_steps), batches),
                                           length=num_steps)
    return spec.with_kernel(rest, kernel + rows.T @ coef), None, losses


def client_update(
    model: Model,
    optimizer: optax.GradientTransformation,
    params,
    x,
    y,
    num_examples,
    key,
    *,
    num_steps: int,
    batch_size: int | None = None,
    snapshot_step=None,
    batch_loss=None,
    direction=None,
    keep_first_grad: bool = False,
    sampling: str = "with_replacement",
    active_steps=None,
):
    """Runs num_steps optimizer steps on one client, from `params`.

    Args:
      model, optimizer: the model and the client optimizer (a fresh optimizer
        state each call, as in FedAvg).
      params: the starting params (one model).
      x, y, num_examples: the client's padded data (x may be a pytree of
        [n_max, ...] arrays) and its row count.
      key: the client's PRNG key (minibatches, mixup).
      num_steps: τ (static).
      batch_size: None for full-batch steps, else the minibatch size (static).
      snapshot_step: optional traced int t′ in [0, num_steps]: also return the
        params after t′ steps (DRFA's w^(t′)).
      batch_loss: optional (params, x_b, y_b, mask_b, key) -> scalar replacing
        the masked mean of the model's loss (e.g. a mixup loss).
      direction: optional gradient -> what the optimizer steps along (e.g.
        Mixed FL's w_f·g + w_c·ĝ_c); default the gradient itself.
      keep_first_grad: also return the first step's gradient (at `params`, on
        the first batch, before `direction`), e.g. what Mixed FL's clients send.
      sampling: how minibatches are drawn (static; ignored for full-batch
        steps): "with_replacement" (default): each step draws its batch
        independently (distinct rows within a batch, but a row may come back
        in the next batch before others were seen); "epochs": the steps go
        through the rows in epochs, each a fresh permutation (`epoch_batches`,
        the "E local epochs of batch b" of a protocol: ⌈n / b⌉ steps an epoch).
      active_steps: optional traced int τ_i in [0, num_steps]: the client steps
        only that many times (`ops.work`); the remaining iterations of the scan
        carry its params and optimizer state unchanged (their losses are those of
        the params reached). None: all num_steps.

    Keys: step t's key is k_t = split(key, num_steps)[t]; its batch and loss keys
    are split(k_t) (the loss key goes to `batch_loss`), its augmentation key
    fold_in(k_t, AUGMENT_STREAM) and, for a model with a `train_apply` (dropout),
    the key of that call fold_in(k_t, DROPOUT_STREAM): without `batch_loss` the
    step's loss is the masked mean of example_loss(train_apply(p, x_b, that key),
    y_b) instead of apply's. A model without `train_apply` draws nothing more.

    The input layer in the span of the rows: when the model declares a dense
    input layer (`Model.dense_input`), the optimizer is declared linear
    (`linear_in_gradients`), nothing else shapes the step (no batch_loss,
    direction, snapshot, first gradient or augmentation) and it saves
    multiply-adds (`input_span_pays`: a client with fewer rows than the input
    has features, several steps), the steps keep that layer as W₀ + Xᵀ C
    (`_input_span_steps`): the same maths, a different float rounding.

    Returns:
      (final params, snapshot params or None, [num_steps] step losses), and
      with keep_first_grad that gradient as a fourth item.
    """
    check_sampling(sampling)
    n_max = y.shape[0]

    def default_loss(p, xb, yb, mb, _key, train_key=None):
        pred = model.apply(p, xb) if train_key is None else model.train_apply(p, xb, train_key)
        return jnp.sum(mb * model.example_loss(pred, yb)) / jnp.maximum(jnp.sum(mb), 1.0)

    training_apply = batch_loss is None and model.train_apply is not None

    keys = jax.random.split(key, num_steps)
    halves = jax.vmap(jax.random.split)(keys)  # [num_steps, 2]: each step's (batch, loss) keys
    k_batch, k_loss = halves[:, 0], halves[:, 1]
    # Every step's batch is drawn before the loop (the same rows as drawing in the step).
    if batch_size is None:
        batches = None
    elif sampling == "epochs":
        batches = epoch_batches(jax.random.fold_in(key, EPOCH_STREAM), num_examples, n_max,
                                batch_size, num_steps)
    else:
        batches = sample_batches(k_batch, num_examples, n_max, batch_size)
    plain_step_only = (batch_loss is None and direction is None and snapshot_step is None
                       and not keep_first_grad)
    if _input_span_applies(model, optimizer, params, x, batch_size, num_steps, plain_step_only):
        return _input_span_steps(model, optimizer, params, x, y, num_examples, batches,
                                 num_steps, active_steps)

    def advance(carry, inputs):
        """One step: (carry, (its loss, its gradient before `direction`))."""
        p, opt_state, snap = carry
        t, k, kl, batch = inputs
        if batch is None:
            xb, yb = x, y
            mb = (jnp.arange(n_max) < num_examples).astype(jnp.float32)
        else:
            idx, bmask = batch
            xb = jax.tree.map(lambda a: a[idx], x)
            yb, mb = y[idx], bmask.astype(jnp.float32)
        if model.augment is not None:  # this step's train-time view (its own key stream)
            xb = model.augment(jax.random.fold_in(k, AUGMENT_STREAM), xb)
        if batch_loss is not None:
            loss_fn = batch_loss
        elif training_apply:  # dropout on its own key stream
            loss_fn = functools.partial(default_loss,
                                        train_key=jax.random.fold_in(k, DROPOUT_STREAM))
        else:
            loss_fn = default_loss
        loss, grads = jax.value_and_grad(loss_fn)(p, xb, yb, mb, kl)
        along = grads if direction is None else direction(grads)
        updates, new_state = optimizer.update(along, opt_state, p)
        p, opt_state = _step_if(t, active_steps, (optax.apply_updates(p, updates), new_state),
                                (p, opt_state))
        if snapshot_step is not None:
            snap = jax.tree.map(lambda s, q: jnp.where(t + 1 == snapshot_step, q, s), snap, p)
        return (p, opt_state, snap), (loss, grads)

    def step(carry, inputs):
        carry, (loss, _) = advance(carry, inputs)
        return carry, loss

    snap0 = params if snapshot_step is not None else None
    carry = (params, optimizer.init(params), snap0)
    steps = (jnp.arange(num_steps), keys, k_loss, batches)
    if not keep_first_grad:
        (p, _, snap), losses = jax.lax.scan(step, carry, steps)
        return p, snap, losses
    # The first step is peeled off the scan, so its gradient comes out without a
    # [num_steps]-long output of gradients.
    first, rest = (jax.tree.map(lambda a, i=i: a[i], steps) for i in (0, slice(1, None)))
    carry, (loss0, grad0) = advance(carry, first)
    (p, _, snap), losses = jax.lax.scan(step, carry, rest)
    return p, snap, jnp.concatenate([loss0[None], losses]), grad0


@functools.partial(
    jax.jit,
    static_argnames=("model", "optimizer", "num_steps", "batch_size", "batch_loss", "sampling"),
)
def local_update(
    model: Model,
    optimizer: optax.GradientTransformation,
    params,
    data,
    keys,
    *,
    num_steps: int,
    batch_size: int | None = None,
    snapshot_step=None,
    batch_loss=None,
    sampling: str = "with_replacement",
    active_steps=None,
):
    """`client_update` on every client of `data`, each from its own params.

    With a `client_chunk` in the data's execution plan the clients train that
    many at a time: the gradients, optimizer states and activations then exist
    for one chunk only (the [m, ...] inputs and outputs still do).

    Args:
      params: pytree, leaves [m, ...] (client i starts from params[i]).
      data: FederatedData with m clients.
      keys: [m] PRNG keys, one per client.
      active_steps: None, or [m] int32: each client's τ_i (`client_update`).
      (the rest as in `client_update`; snapshot_step is shared by all clients)

    Returns:
      (params [m, ...], snapshots [m, ...] or None, losses [m, num_steps]).
    """
    one = functools.partial(
        client_update,
        model,
        optimizer,
        num_steps=num_steps,
        batch_size=batch_size,
        snapshot_step=snapshot_step,
        batch_loss=batch_loss,
        sampling=sampling,
    )
    if active_steps is None:
        return map_client_chunks(
            lambda part: jax.vmap(one)(*part),
            (params, data.x, data.y, data.num_examples, keys),
            plan_of(data).client_chunk,
        )
    return map_client_chunks(
        lambda part: jax.vmap(lambda p, x, y, n, k, a: one(p, x, y, n, k, active_steps=a))(
            *part),
        (params, data.x, data.y, data.num_examples, keys, active_steps),
        plan_of(data).client_chunk,
    )


def check_sampling(sampling: str) -> None:
    """ValueError unless sampling is one of SAMPLINGS."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}; got {sampling!r}.")


def client_keys(key, client_ids: jax.Array) -> jax.Array:
    """One key per client, `fold_in(key, id)`: independent of how clients are laid out."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(client_ids)
