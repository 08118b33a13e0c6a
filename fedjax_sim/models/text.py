"""A small next-character model: embedding, a recurrent (or causal conv) layer, logits.

The LEAF Shakespeare model is embedding 8 → 2 × LSTM(256) → softmax over 80
characters at sequence length 80; the Mixed FL paper's char-LM is a similar
recurrent net. The defaults here are smaller (one GRU layer of 128) so a CPU
simulation of hundreds of clients stays fast; `cell="lstm"`, `layers=2`,
`hidden=256` gives the LEAF model.

Targets are whole shifted sequences y [n, seq_len] (every position predicts
its next character, see data/text.py); positions holding the pad id are not
characters and count in neither the loss nor the accuracy.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax

from fedjax_sim.models.core import Model, from_flax

PAD_ID = 0  # data/text.py's pad id (models never import data; keep the two equal)


class CharRNN(nn.Module):
    """ids [n, L] int → logits [n, L, vocab]; causal (position t sees ids[:t+1] only).

    cell: "gru" or "lstm" (flax.linen.RNN over the cell) or "conv" (a stack of causal
    1-D convolutions, kernel `kernel`, left-padded: no recurrence, fast on CPU).
    """

    vocab_size: int
    embed_dim: int = 8
    hidden: int = 128
    layers: int = 1
    cell: str = "gru"
    kernel: int = 5

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab_size, self.embed_dim)(ids)
        for _ in range(self.layers):
            if self.cell == "gru":
                h = nn.RNN(nn.GRUCell(self.hidden))(h)
            elif self.cell == "lstm":
                h = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(h)
            else:
                h = jnp.pad(h, ((0, 0), (self.kernel - 1, 0), (0, 0)))
                h = nn.relu(nn.Conv(self.hidden, (self.kernel,), padding="VALID")(h))
        return nn.Dense(self.vocab_size)(h)


def char_mask(y):
    """[n, L] float32, 1 where y holds a character (not the pad id)."""
    return (y != PAD_ID).astype(jnp.float32)


def masked_char_loss(logits, y):
    """Per-example loss [n]: mean cross-entropy over the example's real positions.

    Each example (window) weighs the same whatever its length; a window with no
    real position (never produced by data/text.py) has loss 0.
    """
    mask = char_mask(y)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def masked_char_correct(logits, y):
    """Per-example accuracy [n]: the fraction of real positions whose argmax is right."""
    mask = char_mask(y)
    hit = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
    return jnp.sum(hit * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def char_model(vocab_size: int, seq_len: int = 80, *, embed_dim: int = 8, hidden: int = 128,
               layers: int = 1, cell: str = "gru", kernel: int = 5) -> Model:
    """The Model of `CharRNN` with the masked loss and accuracy (x, y: [n, seq_len] int32)."""
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len),
                        ("embed_dim", embed_dim), ("hidden", hidden), ("layers", layers),
                        ("kernel", kernel)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    if cell not in ("gru", "lstm", "conv"):
        raise ValueError(f"cell must be 'gru', 'lstm' or 'conv'; got {cell!r}.")
    module = CharRNN(vocab_size, embed_dim, hidden, layers, cell, kernel)
    example = jnp.zeros((1, seq_len), jnp.int32)
    return from_flax(module, example, masked_char_loss, masked_char_correct)


def sequence_accuracy(logits, y):
    """Accuracy over all real positions of a batch (character-weighted), a scalar."""
    mask = char_mask(y)
    hit = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
    return jnp.sum(hit * mask) / jnp.maximum(jnp.sum(mask), 1.0)
