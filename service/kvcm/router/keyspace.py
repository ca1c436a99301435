"""What makes the block keys and hits of two sidecars comparable, and the gate that refuses
a sidecar that differs.

Block keys depend on the tokens of each block (``tokens_per_block``) and the extra keys;
which blocks a hit needs depends on the layer groups (a sliding window needs only its sinks
and last blocks; a group with ``reuse="none"`` serves nothing). Sidecars of one model agree
on all of that; a sidecar that does not would be scored wrongly, so the router refuses it
(``model_mismatch``) and says why. The first sidecar admitted (or the index store, which
keeps the key space it was built with) fixes the router's key space; ``--tokens-per-block``
pins it before any sidecar answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvcm_client.errors import ModelMismatch
from kvcm_client.models import ModelInfo


@dataclass(frozen=True, slots=True)
class GroupRule:
    """How one layer group serves a hit (``prefix_cache.find_hit``)."""

    sliding_window: int | None
    sink_blocks: int
    reusable: bool


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Tokens per block and the layer groups' rules: equal for every sidecar a router scores."""

    tokens_per_block: int
    groups: tuple[GroupRule, ...]

    @classmethod
    def of(cls, info: ModelInfo) -> KeySpace:
        return cls(
            info.config.tokens_per_block,
            tuple(
                GroupRule(g.sliding_window, g.sink_blocks, g.reuse == "reusable")
                for g in info.layout.layer_groups
            ),
        )

    @property
    def windows(self) -> list[tuple[int | None, int]]:
        """(window, sink blocks) per group: ``prefix_cache.needed_blocks``'s argument."""
        return [(g.sliding_window, g.sink_blocks) for g in self.groups]

    @property
    def reusable(self) -> bool:
        """False when a group never reuses: then the sidecar never hits at all."""
        return all(g.reusable for g in self.groups)

    @property
    def has_full_group(self) -> bool:
        """A full-attention group needs every block of a hit, so a walk over a prompt's
        blocks can stop at the first block no sidecar holds."""
        return any(g.sliding_window is None for g in self.groups)

    def to_json(self) -> str:
        return json.dumps(
            {
                "tokens_per_block": self.tokens_per_block,
                "groups": [[g.sliding_window, g.sink_blocks, g.reusable] for g in self.groups],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> KeySpace:
        raw = json.loads(text)
        return cls(raw["tokens_per_block"], tuple(GroupRule(*g) for g in raw["groups"]))

    def describe(self) -> str:
        groups = ", ".join(
            f"{'full' if g.sliding_window is None else f'window {g.sliding_window}'}"
            f"{f' + {g.sink_blocks} sink blocks' if g.sink_blocks else ''}"
            f"{'' if g.reusable else ' (no reuse)'}"
            for g in self.groups
        )
        return f"{self.tokens_per_block} tokens per block, layer groups [{groups}]"


class ModelGate:
    """Admits sidecars whose key space is the router's; the first one admitted fixes it,
    unless the store already holds one (``bind``) or ``tokens_per_block`` was given."""

    def __init__(self, tokens_per_block: int | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.space: KeySpace | None = None
        self._lock = asyncio.Lock()

    async def admit(
        self, sidecar: str, info: ModelInfo, bind: Callable[[KeySpace], Awaitable[KeySpace]]
    ) -> KeySpace:
        """The router's key space, once ``info`` matches it (``ModelMismatch`` otherwise).
        ``bind`` stores a key space unless the store has one, and returns the stored one."""
        space = KeySpace.of(info)
        if self.tokens_per_block is not None and space.tokens_per_block != self.tokens_per_block:
            raise ModelMismatch(
                f"sidecar {sidecar} has {space.tokens_per_block} tokens per block; this router "
                f"scores {self.tokens_per_block} (--tokens-per-block)",
                sidecar=sidecar,
            )
        async with self._lock:
            if self.space is None:
                self.space = await bind(space)
        if space != self.space:
            raise ModelMismatch(
                f"sidecar {sidecar} serves a model of {space.describe()}; this router's index "
                f"is of {self.space.describe()}",
                sidecar=sidecar,
            )
        return self.space
