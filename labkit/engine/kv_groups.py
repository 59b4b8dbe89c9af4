"""Layer groups: how layers that attend differently share one pool of KV blocks.

Gemma 3's local layers read only the last `window` positions; its global layers read every
position. Giving both one block table would keep every position of every local layer, of
which all but the last window is never read again. So the engine splits the layers into
*groups* of equal size, each group holding layers of one window, and gives every sequence
one block table per group. A block (a page of the pool) holds `block_size` positions of the
keys and values of one group's layers; since every group has as many layers, every page
has the same size and all groups draw from one free list (vLLM's hybrid allocator does the
same). A windowed group's table gives its blocks back as the window passes them: the entry
becomes NO_BLOCK, and the group holds about `window / block_size` blocks however long the
sequence grows. That is the rolling (ring) cache of `labkit.models.window_cache`, made of
blocks: the freed blocks return to the free list and come back as the sequence's newest.

Gemma 3 270M: 15 local layers (window 512) and 3 global ones make six groups of three
layers, one global. A model without windows has one group of all its layers: a page is a
block of every layer, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NO_BLOCK = -1  # a windowed group's table entry for a block the window has passed


def first_block(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` reads through `window` (keys j with
    position - window < j; None: every key, from block 0)."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def peak_blocks(windows: tuple[int | None, ...], tokens: int, step_tokens: int, block_size: int) -> int:
    """The most blocks one sequence of `tokens` tokens holds at once over groups of these
    windows, when one step writes up to `step_tokens` of its positions: a full group holds
    every position, a windowed one the window behind a step and the step's new positions."""
    blocks = -(-tokens // block_size)
    total = 0
    for window in windows:
        if window is None:
            total += blocks
        else:  # positions p - window + 1 .. p + step - 1 of a step from p; +1: block boundaries
            total += min(blocks, -(-(window + step_tokens - 1) // block_size) + 1)
    return total


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int | None, ...]      # per group: its layers' window (None: every position)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        return len(self.layers[0])

    def locate(self, layer: int) -> tuple[int, int]:
        """(group, slot in the group) of `layer`: the page holds it at that slot."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def first_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of `group` that a query at `position` reads."""
        return first_block(self.windows[group], position, block_size)


def layer_groups(num_layers: int, layer_windows: tuple[int | None, ...] | None = None) -> LayerGroups:
    """Split the layers into groups of equal size, each of one window, full-attention groups
    first. The size is the greatest common divisor of the numbers of layers of each window
    (3 for Gemma 3 270M's 15 local and 3 global layers)."""
    windows = tuple(layer_windows) if layer_windows is not None else (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = math.gcd(*(len(m) for m in members.values()))
    groups = [(w, tuple(m[i:i + size])) for w in kinds for m in [members[w]] for i in range(0, len(m), size)]
    return LayerGroups(tuple(w for w, _ in groups), tuple(layers for _, layers in groups))
