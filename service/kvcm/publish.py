"""Publishing a request's committed blocks for prefix reuse (docs/prefix-reuse.md).

A commit keys the blocks its tokens fill (reusing the keys allocate computed for the prompt,
``kvcm.commit_keys``) and publishes each new one in every reusable layer group, in runs of
contiguous new blocks (one ``block_stored`` event a run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .commit_keys import commit_keys
from .hashing import MultimodalItem

if TYPE_CHECKING:
    from .coordinator import Coordinator


@dataclass(slots=True)
class PrefixState:
    """A request's extra keys, the keys of its committed full blocks (a chain), and its
    prompt's int32 bytes and block keys as allocate had them (``commit_keys`` reuses them;
    never changed after allocate, so a rewind needs no undo for them)."""

    root: bytes
    lora_id: int | str | None
    has_salt: bool
    multimodal: tuple[MultimodalItem, ...]
    keys: list[bytes]
    prompt: bytes
    prompt_keys: list[bytes]


def publish(
    coord: Coordinator,
    state: PrefixState,
    row: int,
    tokens: bytearray,
    done: int,
    data: bytes,
) -> None:
    """Key the request's newly full blocks and publish them in every reusable group.

    ``tokens`` are all its committed ids (int32 bytes), the last ones new; ``data`` is the
    bytes of ids ``[done:]``. Blocks before ``len(state.keys)`` are keyed already, so the bytes
    to key start at that block: the few uncommitted-block ids before ``done``, then
    ``data``. Example (tokens_per_block 4): 6 committed, 5 new: 1 block keyed, ids 4 and
    5 are packed again and blocks 1 and 2 are keyed from ids [4, 12).
    """
    tpb = coord.tokens_per_block
    have, full = len(state.keys), len(tokens) // (4 * tpb)
    if full <= have:
        return
    step = 4 * tpb
    chunk = bytes(tokens[have * step : 4 * done]) + data
    parent = state.keys[-1] if have else state.root
    state.keys += commit_keys(
        parent, chunk, have, tpb, state.multimodal, state.prompt, state.prompt_keys
    )
    c = coord
    cache = c.cache
    empty = c.empty
    for g in range(len(coord.policies)):
        if not cache.reusable[g]:
            continue
        pg = c.group_pool[g]
        index = cache.scope(g, state.root)
        held = c.tables[g][row, have:full]
        if full - have <= 4:  # a decode-time commit: ints beat numpy calls
            slots = held.tolist()
            flags = cache.cached[pg]
            fresh = [s > empty and not flags[s] for s in slots]
        else:
            # Live slots not cached yet (one numpy pass; a -1 indexes the last slot, masked).
            fresh = ((held > empty) & ~cache.cached[pg][held]).tolist()
            slots = held.tolist()
        keys = state.keys
        new = [f and k not in index for f, k in zip(fresh, keys[have:full], strict=True)]
        if all(new):  # the usual case: every block is new, one run
            cache.store(
                g,
                state.root,
                keys[have:full],
                slots,
                keys[have - 1] if have else None,
                chunk[: (full - have) * step],
                state.lora_id,
                state.has_salt,
            )
            continue
        run: list[int] = []  # block positions of a contiguous run of new blocks
        for b in range(have, full + 1):
            if b < full and new[b - have]:
                run.append(b)
                continue
            if run:
                cache.store(
                    g,
                    state.root,
                    keys[run[0] : run[-1] + 1],
                    slots[run[0] - have : run[-1] + 1 - have],
                    keys[run[0] - 1] if run[0] else None,
                    chunk[(run[0] - have) * step : (run[-1] + 1 - have) * step],
                    state.lora_id,
                    state.has_salt,
                )
                run = []
