"""``model.mapper: qformer``: BLIP-2's Querying Transformer (Li et al. 2023, "BLIP-2: Bootstrapping Language-Image
Pre-training with Frozen Image Encoders and Large Language Models", section 3.1) and its projection into the
language model.

BLIP-2's Q-Former is a BERT-base Transformer (hidden size 768, 12 layers, 12 heads, feed-forward 3072, LayerNorm
ε 1e-12, dropout 0.1) over 32 learned query vectors: every layer runs self-attention among the queries, every
other layer (``cross_attention_frequency`` 2: layers 0, 2, 4, …) cross-attention from the queries to the frozen
image encoder's patch tokens ``[B, N, D]``, then a GELU feed-forward block, each post-norm in a residual. Its output
``[B, 32, 768]`` goes through one fully connected layer (the "language projection") to the language model's width
and is prepended to the text: ``[B, 32, width]``.

Here keras-hub's :class:`keras_hub.models.BLIP2QFormer` holds the Q-Former (its weights and layers), with
``num_query_tokens`` = ``model.query_tokens`` (BLIP-2's 32), ``num_layers`` = ``model.mapper_layers`` (the same key
the Transformer mapper reads: its default 8 is BLIP-2's 12 made smaller, cross-attention in layers 0, 2, 4 and 6),
``num_heads`` = ``model.mapper_heads``, ``vision_dim`` = the encoder's ``D``, and BLIP-2's other values
(``cross_attention_frequency`` 2, dropout 0.1, ε 1e-12). Its hidden size comes from the language model's width,
with no setting of its own: BLIP-2 keeps BERT-base's 768 whatever the LM, so it is ``min(width, 768)``
(:data:`HIDDEN`): 768 for GPT-2 and every larger LM, the LM's own width for a smaller one (the tests' tiny LMs);
the feed-forward block is 4× it (BERT's). ``model.mapper_heads`` must divide it. Then ``Dense(width)``, BLIP-2's
language projection (also when the two widths are equal, as for GPT-2 small).

**The mask.** keras-hub's ``BLIP2QFormer`` takes the tokens alone (no mask: in BLIP-2 every patch is real), so
padding would enter its cross-attention. The mapper therefore runs the same layers itself —
:meth:`QFormerMapper.run`, the loop of ``BLIP2QFormer``'s functional graph and of ``QFormerLayer.call`` over the
same sublayers and weights — and hands each cross-attention the mask as its ``attention_mask`` (padding tokens are
no keys). Without a mask it equals ``BLIP2QFormer``'s own call (tests/test_mappers.py checks it, so a keras-hub
release that changes the layer is caught).

**Initial weights**: keras-hub's (Glorot-uniform kernels, zero biases), except the query vectors: keras-hub makes
them zeros (a converted checkpoint brings them), which would leave all queries equal and every output vector the
same; they are drawn from a normal of standard deviation 0.02, BLIP-2's (BERT's ``initializer_range``)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers, ops

from captioning.model.mappers.base import Mapper

HIDDEN = 768  # BLIP-2's Q-Former width (BERT-base), the most the Q-Former takes from the LM's width
FREQUENCY = 2  # BLIP-2's cross_attention_frequency: cross-attention in every other layer, from the first
DROPOUT = 0.1  # BLIP-2's (BERT's hidden and attention dropout)
EPSILON = 1e-12  # BLIP-2's LayerNorm epsilon (BERT's)
QUERY_STDDEV = 0.02  # BLIP-2's initial query vectors: normal(0, 0.02)


class QFormerMapper(Mapper):
    """BLIP-2's bridge: keras-hub's ``BLIP2QFormer`` (``Q`` = ``query_tokens`` learned queries, ``L`` =
    ``mapper_layers`` layers, ``mapper_heads`` heads, hidden size ``h = min(w, 768)``, feed-forward ``4h``,
    cross-attention to the tokens ``[B, N, D]`` in layers 0, 2, …, padding masked) → ``[B, Q, h]``, then
    ``Dense(w)`` → ``[B, Q, w]``.

    Trainable parameters, with ``i = 4h`` and ``c = ⌈L/2⌉`` layers of cross-attention: ``Q·h`` (queries) ``+ 2h``
    (their LayerNorm) ``+ L·(4h² + 2h·i + 9h + i)`` (per layer: self-attention's four projections ``4h² + 4h`` and
    LayerNorm ``2h``, the feed-forward block ``h·i + i + i·h + h`` and LayerNorm ``2h``) ``+ c·(2h² + 2D·h + 6h)``
    (cross-attention: query and output ``h² + h`` each, key and value ``D·h + h`` each, LayerNorm ``2h``)
    ``+ h·w + w`` (the language projection)."""

    key = "qformer"

    @classmethod
    def output_length(cls, settings) -> int:
        """``settings.query_tokens``: one prefix vector per query."""
        return int(settings.query_tokens)

    @classmethod
    def attention_width(cls, settings, width: int) -> int:
        return min(int(width), HIDDEN)

    @classmethod
    def parameter_count(cls, settings, width: int, dim: int) -> int:
        q, n, w = int(settings.query_tokens), int(settings.mapper_layers), int(width)
        h = cls.attention_width(settings, w)
        i, crossing = 4 * h, -(-n // FREQUENCY)
        return (q * h + 2 * h + n * (4 * h * h + 2 * h * i + 9 * h + i) + crossing * (2 * h * h + 2 * dim * h + 6 * h)
                + h * w + w)

    def make_layers(self, dim: int) -> None:
        import keras_hub

        h = self.attention_width(self.settings, self.width)
        self.qformer = keras_hub.models.BLIP2QFormer(
            num_query_tokens=self.length, num_layers=int(self.settings.mapper_layers),
            num_heads=int(self.settings.mapper_heads), hidden_dim=h, intermediate_dim=4 * h, vision_dim=dim,
            cross_attention_frequency=FREQUENCY, dropout=DROPOUT, layer_norm_epsilon=EPSILON,
            dtype=self.dtype_policy, name="qformer")
        queries = self.qformer.query_tokens
        with tf.init_scope():  # once, eagerly, also when the first call is traced
            queries.assign(keras.initializers.RandomNormal(stddev=QUERY_STDDEV)(queries.shape, dtype=queries.dtype))
        self.language_projection = layers.Dense(self.width, dtype=self.dtype_policy, name="language_projection")
        self.language_projection.build((None, None, h))

    def map(self, tokens, mask, training):
        return self.language_projection(self.run(tokens, mask, training))

    def run(self, tokens, mask=None, training=False):
        """The Q-Former's output ``[B, Q, h]``: ``BLIP2QFormer``'s layers, each cross-attention given ``mask`` (``[B,
        N]``, 1 = real; None: all real) as which tokens are keys."""
        qformer = self.qformer
        keys = None if mask is None else ops.expand_dims(mask > 0, 1)  # [B, 1, N]: the same keys for every query
        x = qformer.query_tokens_layer(tokens)
        x = qformer.get_layer("dropout")(qformer.layer_norm(x), training=training)
        for block in qformer.transformer_layers:  # QFormerLayer.call, with the mask
            y = block.self_attention([x, x], training=training)
            if block.has_cross_attention:
                cross = block.cross_attention
                attended = cross.attention(y, tokens, tokens, attention_mask=keys, training=training)
                y = cross.layer_norm(y + cross.dropout_layer(attended, training=training))
            z = block.output_dropout(block.output_dense(block.intermediate_dense(y)), training=training)
            x = block.output_layer_norm(y + z)
        return x
