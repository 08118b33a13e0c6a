"""A dual encoder for next-movie prediction, split so that clients touch only their movies.

Mixed FL (Augenstein et al., arXiv 2205.13655, §5) trains a MovieLens dual
encoder where the clients compute only a hinge loss on their own movies, and
receive only those rows of the item embedding table, while the server computes
the spreadout regularizer over the whole table, a loss no client could compute
from its own rows. The dual encoder follows Ning et al. 2021 ("Learning
federated representations and recommendations with limited negatives"):

  user (context) tower  u = W · mean(E[context]) + b     (no user embedding;
                        W, b are shared, [d, d] and [d], W starts at the identity)
  item tower            v_j = E[j]                        (the table E [num_items, d])
  score                 s = u · v

Client loss (`loss=`):
  "positive" (default): Ning et al.'s loss insensitive to local negatives, a
    hinge on the positive pair only, ℓ_i = max(0, margin − s_ii), which pulls a
    user's context towards the movie it watched next; pushing unrelated movies
    apart is left to the spreadout regularizer on the server. With
    `cosine=True` (default) scores are cosines (u and the rows L2-normalised,
    Zhang et al. 2017's spreadout is defined on unit vectors): without it the
    dot-product spreadout shrinks every row towards 0 and the hinge is met by
    growing the tower, and recall@10 collapsed in our runs.
  "inbatch": a hinge over IN-BATCH negatives (the labels of the client's other
    examples in the batch, i.e. the client's own movies, never another client's):
    ℓ_i = mean_{j valid, y_j ≠ y_i} max(0, margin − s_ii + s_ij). A client's
    other movies are positives of the same user, so this pushes apart what the
    user watched; kept for comparison.
Every row of E either loss reads is a context or a label of the client, so its
gradient is exactly zero on every other row: the full-table model `dual_encoder`
run on a client is the same computation as the client's gathered rows
(`client_rows`, `to_local`, `scatter_rows` move between the two; tested).

Parameters are a plain dict {"item_table": [I, d], "tower": {"kernel": [d, d],
"bias": [d]}} ("tower" absent with tower=False): pure JAX, no flax module, so
gathering and scattering rows is plain indexing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sim.models.core import Model

TABLE, TOWER = "item_table", "tower"


# ------------------------------------------------------------------------------ towers

def init_dual_encoder(key, num_items: int, dim: int, *, tower: bool = True,
                      scale: float = 0.1) -> dict:
    """E ~ N(0, scale²) [num_items, dim]; the tower starts at the identity map."""
    params = {TABLE: scale * jax.random.normal(key, (num_items, dim), jnp.float32)}
    if tower:
        params[TOWER] = {"kernel": jnp.eye(dim, dtype=jnp.float32),
                         "bias": jnp.zeros((dim,), jnp.float32)}
    return params


def _rows(table, ids):
    """table[ids] with -1 (padding) read as a zero row: [..., d]."""
    valid = ids >= 0
    rows = table[jnp.where(valid, ids, 0)]
    return jnp.where(valid[..., None], rows, 0.0)


def unit(v):
    """Rows scaled to unit L2 norm; a zero row (padding) stays 0, with a zero gradient (the
    norm's own gradient is 0/0 there)."""
    squares = jnp.sum(v * v, axis=-1, keepdims=True)
    return v * jax.lax.rsqrt(jnp.maximum(squares, 1e-12))


def user_vectors(params, context, cosine: bool = False):
    """[n, c] item ids (-1 = none) → [n, d]: the tower of the bag (mean) of their rows
    (of their unit rows, and the result unit-normalised, with cosine=True)."""
    valid = (context >= 0).astype(jnp.float32)
    rows = _rows(params[TABLE], context)
    if cosine:
        rows = unit(rows)
    bag = jnp.sum(rows, axis=-2) / jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1.0)
    if TOWER in params:
        bag = bag @ params[TOWER]["kernel"] + params[TOWER]["bias"]
    return unit(bag) if cosine else bag


def item_vectors(params, ids, cosine: bool = False):
    """[n] item ids → [n, d] rows of the table (zero for -1; unit rows with cosine=True)."""
    rows = _rows(params[TABLE], ids)
    return unit(rows) if cosine else rows


def catalog_scores(params, context, cosine: bool = False):
    """[n, c] contexts → [n, I] scores of every item of the table."""
    table = unit(params[TABLE]) if cosine else params[TABLE]
    return user_vectors(params, context, cosine) @ table.T


# ------------------------------------------------------------------------------ losses

def inbatch_scores(params, x, cosine: bool = False):
    """x {"context": [n, c], "label": [n]} → s [n, n], s_ij = u_i · v_{label_j}."""
    return (user_vectors(params, x["context"], cosine)
            @ item_vectors(params, x["label"], cosine).T)


def positive_scores(params, x, cosine: bool = False):
    """x {"context": [n, c], "label": [n]} → s [n], s_i = u_i · v_{label_i}."""
    return jnp.sum(user_vectors(params, x["context"], cosine)
                   * item_vectors(params, x["label"], cosine), axis=-1)


def positive_hinge(scores, labels, margin: float = 1.0):
    """Per-example hinge [n] on the positive pair alone: max(0, margin − s_i) (0 on padding)."""
    return jnp.where(labels >= 0, jax.nn.relu(margin - scores), 0.0)


def inbatch_hinge(scores, labels, margin: float = 1.0):
    """Per-example hinge [n] over the in-batch negatives (labels_j ≥ 0, labels_j ≠ labels_i)."""
    pos = jnp.diagonal(scores)
    neg = (labels[None, :] >= 0) & (labels[None, :] != labels[:, None])
    hinge = jnp.where(neg, jax.nn.relu(margin - pos[:, None] + scores), 0.0)
    return jnp.sum(hinge, axis=-1) / jnp.maximum(jnp.sum(neg, axis=-1), 1)


def inbatch_correct(scores, labels):
    """[n] 1.0 where the positive outscores every in-batch negative."""
    pos = jnp.diagonal(scores)
    neg = (labels[None, :] >= 0) & (labels[None, :] != labels[:, None])
    return jnp.all(~neg | (scores < pos[:, None]), axis=-1).astype(jnp.float32)


def label_scores(scores, labels):
    """[n, I] catalog scores → [n, 1] the score of each example's label (-1: item 0's)."""
    return jnp.take_along_axis(scores, jnp.maximum(labels, 0)[:, None], axis=-1)


def rank_of_label(scores, labels):
    """[n] the number of items scoring strictly above the label (0 = ranked first)."""
    return jnp.sum(scores > label_scores(scores, labels), axis=-1)


def exclude_items(scores, ids):
    """scores [n, I] with the items ids [n, s] (-1: none) of each row set to −inf: candidates
    a user has already watched (a MovieLens user rates a movie once, so never its next one)."""
    rows = jnp.arange(scores.shape[0])[:, None]
    seen = jnp.zeros(scores.shape, bool).at[rows, jnp.where(ids >= 0, ids, scores.shape[-1])].set(
        True, mode="drop")
    return jnp.where(seen, -jnp.inf, scores)


def recall_at_k(scores, labels, k: int = 10):
    """[n] 1.0 where the label is among the k best of all items (one label per example,
    so recall@k is the hit rate); 0 on padding labels (-1) and where the label's score is
    not finite (a diverged model ranks nothing)."""
    finite = jnp.isfinite(label_scores(scores, labels)[:, 0])
    hit = (rank_of_label(scores, labels) < k) & (labels >= 0) & finite
    return hit.astype(jnp.float32)


def full_hinge(scores, labels, margin: float = 1.0):
    """Per-example hinge [n] against every other item of the catalog (evaluation loss)."""
    pos = label_scores(scores, labels)
    other = jnp.arange(scores.shape[-1])[None, :] != labels[:, None]
    hinge = jnp.where(other, jax.nn.relu(margin - pos + scores), 0.0)
    return jnp.sum(hinge, axis=-1) / jnp.maximum(jnp.sum(other, axis=-1), 1)


def spreadout_regularizer(item_table, *, kind: str = "dot", nu: float = 1.0,
                          cosine: bool = False):
    """The spreadout regularizer over the whole table, computed by the server. Scalar.

    kind="dot" (Zhang et al. 2017's global orthogonal form, as Ning et al. 2021 use it for
      MovieLens): mean over ordered pairs i ≠ j of (e_i · e_j)², so large dot products
      between different items are penalised.
    kind="distance" (Yu et al. 2020, FedAwS): mean over i ≠ j of max(0, ν − ‖e_i − e_j‖)².
    Both form the I × I pairwise matrix (I² d multiply-adds: `regularizer_macs`).
    cosine=True: of the unit rows (the scores' embeddings when the model scores cosines).
    """
    if cosine:
        item_table = unit(item_table)
    n = item_table.shape[0]
    off = ~jnp.eye(n, dtype=bool)
    gram = item_table @ item_table.T
    if kind == "dot":
        terms = jnp.square(gram)
    elif kind == "distance":
        sq = jnp.diagonal(gram)
        dist = jnp.sqrt(jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 1e-12))
        terms = jnp.square(jax.nn.relu(nu - dist))
    else:
        raise ValueError(f"kind must be 'dot' or 'distance'; got {kind!r}.")
    return jnp.sum(jnp.where(off, terms, 0.0)) / max(n * (n - 1), 1)


def spreadout_loss(*, kind: str = "dot", nu: float = 1.0, cosine: bool = False):
    """The regularizer as a server-side loss term, (params, server_arrays, key) -> scalar
    (the `central_loss` form algorithms/mixed.py takes); it reads no server arrays."""
    if kind not in ("dot", "distance"):
        raise ValueError(f"kind must be 'dot' or 'distance'; got {kind!r}.")

    def loss(params, arrays, key):
        del arrays, key
        return spreadout_regularizer(params[TABLE], kind=kind, nu=nu, cosine=cosine)

    return loss


# ------------------------------------------------------------------------------ models

LOSSES = ("positive", "inbatch")


def dual_encoder(num_items: int, dim: int = 32, *, tower: bool = True, margin: float = 1.0,
                 scale: float = 0.1, loss: str = "inbatch", cosine: bool = False) -> Model:
    """The client's training Model over the full table (x {"context", "label"}, y = label).

    loss="inbatch": apply → in-batch scores [n, n]; example_loss → the in-batch hinge
    [n]; correct → the positive beats every in-batch negative. Padding rows must carry
    label -1 (as data/movielens.py writes them) so that they are no one's negative.
    loss="positive": apply → the positive pairs' scores [n]; example_loss → the
    positive hinge [n]; correct → the pair clears the margin.
    cosine: scores are cosines (unit user vectors and rows).
    """
    _check_sizes(num_items, dim)
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}.")

    def init(key):
        return init_dual_encoder(key, num_items, dim, tower=tower, scale=scale)

    if loss == "positive":
        return Model(init, lambda p, x: positive_scores(p, x, cosine),
                     lambda s, y: positive_hinge(s, y, margin),
                     lambda s, y: (s >= margin).astype(jnp.float32))
    return Model(init, lambda p, x: inbatch_scores(p, x, cosine),
                 lambda s, y: inbatch_hinge(s, y, margin), inbatch_correct)


def dual_encoder_eval(num_items: int, dim: int = 32, *, tower: bool = True,
                      margin: float = 1.0, k: int = 10, scale: float = 0.1) -> Model:
    """The evaluation Model over the full table: apply → scores of all items [n, I];
    example_loss → hinge against every other item; correct → recall@k (hit@k)."""
    _check_sizes(num_items, dim)

    def init(key):
        return init_dual_encoder(key, num_items, dim, tower=tower, scale=scale)

    def apply(params, x):
        return user_vectors(params, x["context"]) @ params[TABLE].T

    return Model(init, apply, lambda s, y: full_hinge(s, y, margin),
                 lambda s, y: recall_at_k(s, y, k))


def batched_recall(params, context, labels, k: int = 10, batch_size: int = 1024):
    """Mean recall@k over flat examples (context [N, c], labels [N], -1 = skip), computed
    batch_size examples at a time so the [N, I] score matrix never exists at once."""
    def one(args):
        ctx, lab = args
        scores = user_vectors(params, ctx[None])[0] @ params[TABLE].T
        return recall_at_k(scores[None], lab[None], k)[0]

    hits = jax.lax.map(one, (context, labels), batch_size=batch_size)
    valid = labels >= 0
    return jnp.sum(jnp.where(valid, hits, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _check_sizes(num_items, dim):
    for name, value in (("num_items", num_items), ("dim", dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")


# ------------------------------------------------------------------------------ client rows

def client_rows(params, items):
    """The client's model: the rows `items` ([u] global ids, -1 = padding, zero rows) of
    the table, plus the shared tower. What the server sends the client."""
    out = dict(params)
    out[TABLE] = _rows(params[TABLE], items)
    return out


def to_local(x, items):
    """x's global item ids → indices into `items` ([u], sorted real ids then -1s); an id
    not among the items (or -1) becomes -1. Returns a new {"context", "label"} dict."""
    keys = jnp.where(items >= 0, items, jnp.iinfo(jnp.int32).max)

    def local(ids):
        pos = jnp.clip(jnp.searchsorted(keys, ids), 0, items.shape[0] - 1)
        return jnp.where((ids >= 0) & (keys[pos] == ids), pos, -1).astype(jnp.int32)

    return {name: local(ids) for name, ids in x.items()}


def scatter_rows(row_values, items, num_items: int):
    """[u, d] values of the client's rows → the [num_items, d] table holding them at
    `items` and zero elsewhere (padding entries dropped); items are distinct."""
    valid = items >= 0
    vals = jnp.where(valid[:, None], row_values, 0.0)
    target = jnp.where(valid, items, num_items)  # out of range: dropped
    return jnp.zeros((num_items, row_values.shape[-1]), row_values.dtype).at[target].add(
        vals, mode="drop")


# ------------------------------------------------------------------------------ counts

def tower_size(dim: int, tower: bool = True) -> int:
    return dim * dim + dim if tower else 0


def client_floats(num_client_items, dim: int, *, tower: bool = True,
                  payloads: int = 1):
    """Floats of one model-sized message to/from each client: its rows and the tower,
    times `payloads` (model-sized messages per direction). [m] ints."""
    return payloads * (jnp.asarray(num_client_items) * dim + tower_size(dim, tower))


def hinge_macs(batch, context_len: int, dim: int, *, tower: bool = True,
               loss: str = "inbatch", cosine: bool = False):
    """Forward multiply-adds of the client loss on b examples: bag b·c·d, tower b·d²,
    scores b²·d and hinge b² (inbatch) or b·d and b (positive); cosine adds the unit
    normalisations of the bag's rows, the user vector and the labels' rows, b·(c+2)·d."""
    b = jnp.asarray(batch)
    pairs = b * b if loss == "inbatch" else b
    macs = b * context_len * dim + (b * dim * dim if tower else 0) + pairs * dim + pairs
    return macs + (b * (context_len + 2) * dim if cosine else 0)


def regularizer_macs(num_items: int, dim: int, cosine: bool = False) -> int:
    """Forward multiply-adds of `spreadout_regularizer`: the I × I Gram I²·d, squares I²
    (and the rows' unit normalisation I·d with cosine=True)."""
    return num_items * num_items * dim + num_items * num_items + (num_items * dim if cosine
                                                                  else 0)


def compiled_flops(fn, *args) -> float:
    """XLA's own FLOP count of jit(fn)(*args) (2 per multiply-add), a cross-check of the
    hand counts above; nan where the backend reports none."""
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", float("nan")))
