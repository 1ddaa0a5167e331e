"""``Mapper``: the interface of a mapping network, which turns an image encoder's tokens into the prefix a causal
language model reads (``model.decoder: prefix_lm``'s ``model.mapper``).

A mapper is a :class:`keras.layers.Layer` constructed ``cls(settings, width, seed=0)``: ``settings`` is the
decoder's ``PrefixLMSettings`` (a mapper reads only ``prefix_length``, ``query_tokens``, ``mapper_layers`` and
``mapper_heads`` of it), ``width`` the language model's hidden size, ``seed`` the initial weights'. Its call
``mapper(tokens, mask=None, training=False)`` takes the encoder's tokens ``[B, N, D]`` (any float dtype) and their
mask ``[B, N]`` (float or bool, 1 = a real token, 0 = padding; None: all real) and gives the prefix ``[B, L,
width]`` in the layer's compute dtype (bfloat16 or float16 under a mixed precision policy, float32 otherwise), ``L``
= :meth:`Mapper.output_length` ``(settings)``.

**Padding changes nothing.** Every mapper first sets the padding tokens to zeros (so even a non-finite value there
cannot leak through a zero weight), then keeps them out of what it computes: out of the MLP's mean, and out of the
keys of every attention. Adding tokens of mask 0 to an image gives the same prefix (tests/test_mappers.py). A row
must hold at least one real token (every encoder gives one): the Q-Former's cross-attention over a row with none
has nothing to attend to.

**Built on its first call** (or ``mapper.build((None, None, D))``), when ``D`` is known: its sublayers are made
and built then, with Python's ``random`` seeded by ``seed`` for the build
(:func:`~captioning.model.encoders.python_random_seeded`, as the encoders are built). Keras gives an unseeded
initializer a seed drawn from Python's ``random`` when it is made and again when a layer clones it (keras-hub's
layers clone theirs, as :class:`keras.layers.MultiHeadAttention` does for its projections): seeding the draws gives
every projection its own initial values, the same ones in every process for one seed, and different ones for
another seed. (An integer seed on the initializer instead would give a layer's query, key and value projections the
same initial values, every clone repeating it.) Build it outside a ``tf.function`` (the decoder builds it with a
first call on concrete tokens) or under one: both work. Its sublayers take the mapper's own dtype policy, the
global one when the mapper was constructed (a mixed precision policy applies while the model is constructed only,
and the build may come after): variables in float32, computation in the policy's compute dtype.

:meth:`Mapper.parameter_count` is each mapper's count of trainable parameters as a formula (its class docstring),
checked against the built layer's weights by the tests."""

from __future__ import annotations

import keras
from keras import ops

from captioning.errors import InputError
from captioning.model.encoders import python_random_seeded


class Mapper(keras.layers.Layer):
    """A mapping network (module docstring): tokens ``[B, N, D]`` and their mask → prefix ``[B, L, width]``.

    A subclass implements :meth:`make_layers` (its sublayers and weights, made and built for tokens of size ``D``)
    and :meth:`map` (the prefix from tokens whose padding is zero and a float mask, or None), and says its
    :meth:`parameter_count`; it overrides :meth:`output_length` if ``L`` is not ``prefix_length``."""

    key = ""  # its name in MAPPERS (model.mapper)

    def __init__(self, settings, width: int, seed: int = 0, **kwargs):
        kwargs.setdefault("name", f"{self.key}_mapper")
        super().__init__(**kwargs)
        self.settings = settings
        self.width = int(width)
        self.seed = int(seed)
        self.length = self.output_length(settings)
        self.check(settings, self.width)

    @classmethod
    def output_length(cls, settings) -> int:
        """How many prefix vectors come out: ``settings.prefix_length`` (ClipCap's ``k``)."""
        return int(settings.prefix_length)

    @classmethod
    def attention_width(cls, settings, width: int) -> int | None:
        """The size of the vectors its attention runs over (``model.mapper_heads`` must divide it), or None for a
        mapper without attention."""
        return None

    @classmethod
    def check(cls, settings, width: int) -> None:
        """An InputError in one line if ``settings`` cannot map into ``width``: a number of heads that does not
        divide the attention's width, no layers for a mapper made of layers."""
        if width < 1:
            raise InputError(f"the language model's width must be >= 1 (got {width})")
        size = cls.attention_width(settings, width)
        if size is not None:
            heads, layers = int(settings.mapper_heads), int(settings.mapper_layers)
            if heads < 1 or size % heads:
                what = "the language model's width" if size == width else f"the {cls.key} mapper's width"
                raise InputError(f"model.mapper_heads ({heads}) must divide {what} ({size})")
            if layers < 1:
                raise InputError(f"model.mapper_layers must be >= 1 for the {cls.key} mapper (got {layers})")

    @classmethod
    def parameter_count(cls, settings, width: int, dim: int) -> int:
        """The trainable parameters of this mapper over tokens of size ``dim`` (the class docstring's formula)."""
        raise NotImplementedError

    def build(self, tokens_shape):
        dim = tokens_shape[-1]
        if dim is None:
            raise ValueError(f"{self.name}: the tokens' last dimension must be known to build it")
        with python_random_seeded(self.seed):
            self.make_layers(int(dim))
        self.dim = int(dim)

    def make_layers(self, dim: int) -> None:
        """Make and build the sublayers and weights for tokens of size ``dim`` (Python's ``random`` seeded)."""
        raise NotImplementedError

    def call(self, tokens, mask=None, training=False):
        tokens = ops.cast(tokens, self.compute_dtype)
        if mask is not None:
            mask = ops.cast(ops.cast(mask, "bool"), self.compute_dtype)
            tokens = ops.where(ops.expand_dims(mask, -1) > 0, tokens, ops.zeros_like(tokens))
        return self.map(tokens, mask, training)

    def map(self, tokens, mask, training):
        """The prefix ``[B, L, width]`` of ``tokens`` ``[B, N, D]`` (compute dtype, padding zero) and ``mask``
        ``[B, N]`` (compute dtype, 1 = real) or None (all real)."""
        raise NotImplementedError

    def compute_output_shape(self, tokens_shape, mask_shape=None):
        return (tokens_shape[0], self.length, self.width)
