"""Where an encoder's tokens sit in the image: its :class:`TokenLayout`.

An encoder gives a set of ``N`` tokens of width ``D``. When they come from a feature map or from patches,
the encoder declares their layout: ``prefix`` tokens that belong to no place (a Vision Transformer's class
token, DINOv2's register tokens), then ``rows × cols`` tokens row by row over the image. A CNN's 8 × 8 map has
no prefix; ViT-B/16 at 224 px has 1 + 14 × 14 = 197 tokens; DINOv2 with 4 registers at 224 px has 1 + 4 +
16 × 16 = 261. Regions have no layout (their places are their boxes), and neither has an encoder that does
not say. Pictures of attention draw a map where there is a layout (the prefix tokens' share shown apart) and a
bar per token where there is none (:mod:`captioning.model.pictures`); region pooling reads the map.

>>> layout = TokenLayout(rows=2, cols=3, prefix=1)
>>> layout.tokens
7
>>> import numpy as np
>>> weights = np.array([0.4, 0.1, 0.0, 0.2, 0.0, 0.3, 0.0])
>>> layout.prefix_share(weights), layout.grid(weights).tolist()
(0.4, [[0.1, 0.0, 0.2], [0.0, 0.3, 0.0]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLayout:
    """``prefix`` placeless tokens first, then ``rows × cols`` tokens row by row (module docstring)."""

    rows: int
    cols: int
    prefix: int = 0

    def __post_init__(self):
        if self.rows < 1 or self.cols < 1 or self.prefix < 0:
            raise ValueError(f"a token layout needs rows, cols >= 1 and prefix >= 0, got {self}")

    @property
    def tokens(self) -> int:
        """How many tokens an encoder of this layout gives."""
        return self.prefix + self.rows * self.cols

    @classmethod
    def of(cls, tokens: int, rows: int, cols: int) -> "TokenLayout | None":
        """The layout of ``tokens`` tokens ending in a ``rows × cols`` map (the rest before it: prefix
        tokens); None when they cannot hold the map."""
        prefix = tokens - rows * cols
        return cls(rows, cols, prefix) if rows >= 1 and cols >= 1 and prefix >= 0 else None

    def grid(self, values):
        """``values [..., N]`` (numpy) → the map's ``[..., rows, cols]`` (the prefix tokens left out)."""
        values = np.asarray(values)
        return values[..., self.prefix:].reshape(values.shape[:-1] + (self.rows, self.cols))

    def prefix_share(self, weights) -> float:
        """The share of attention ``weights [N]`` that fell on the prefix tokens (0 without any)."""
        weights = np.asarray(weights, np.float64)
        return float(weights[:self.prefix].sum() / max(weights.sum(), 1e-12)) if self.prefix else 0.0

    def describe(self) -> str:
        """``"4 × 4"``, ``"1 + 14 × 14"``: how the docs and logs name it."""
        grid = f"{self.rows} × {self.cols}"
        return f"{self.prefix} + {grid}" if self.prefix else grid
