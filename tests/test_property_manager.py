"""A stateful property test of the in-process manager (issue 11).

Hypothesis drives one ``KVCacheManager`` with random ``allocate`` (prompts from a few shared
families and from committed prefixes, so prefix hits happen), ``extend``, ``extend_many``,
decode steps, ``rewind``, ``commit``, ``free``, ``step`` (atomic or not), ``probe`` and
``copy_tokens`` calls, with edge integers and other hostile arguments mixed in (one wrong
argument per call, in about one call in five), over tiny specs of several layouts and pool
sizes, with and without the null page. A plain-Python model predicts every call: the typed
errors it must raise, or that it must succeed (``OutOfBlocks`` is predicted from the free
counts), and each request's length, block count, released window run and committed tokens
after it. A ``step`` is compared with its ops run one by one on a deep copy of the manager.

Why a model and not just "no crash": most kvcm bugs are silent (a block held twice, a window
run one block off, a refused op that moved a free-list entry, a hit across tenants). Every
rule therefore checks, besides its own prediction:

- a refused call raises a ``KVCMError`` subclass and changes nothing (requests, block and
  page tables, free counts and free order, reference counts, the prefix index, its stats and
  event sequence, pool bytes); probes, retries and token copies change nothing but bytes;
- after a single op, the free queues slot by slot: new blocks come off the head, freed ones
  go to the tail (a request's tail first), hit blocks leave from wherever they were;
- reference counts equal the table cells holding each slot; free + held = usable slots; a
  shared slot is cached and has at most one holder outside a prefix hit; no free slot is in a
  table; slot 0 stays unheld and zero with the null page; tables hold ``empty`` past blocks;
- lengths, ``block_table`` lengths and window runs match the model (docs/requests.md);
  ``num_free_blocks()`` is the least pool-group share;
- a hit is block-aligned, below the prompt's length, equal to a probe, and only of blocks
  committed before in the same (LoRA, salt) scope;
- KV content: a simulated engine writes a pattern per token (a hash of the scope, the tokens
  and images up to it) when tokens are added, and every live request's computed positions
  must hold their patterns: a hit that hands out the wrong block, or an op that overwrites
  another request's KV, shows up here; ``copy_tokens`` must move exactly the bytes it names.

Runs ``KVCM_PROPERTY_EXAMPLES`` examples (default 100, about 10 s) of up to
``KVCM_PROPERTY_STEPS`` rules (default 40); a longer run:
``KVCM_PROPERTY_EXAMPLES=3000 pytest tests/test_property_manager.py``. A failure prints the
shrunk sequence of rules and draws that reproduces it.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from helpers import layer
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcm import KVCacheManager, MultimodalItem, block_keys
from kvcm.hashing import multimodal_items
from kvcm.manager import MAX_COUNT, MAX_REQUEST_ID
from kvcm_client.errors import (
    CopyIntoSharedBlock,
    DuplicateRequest,
    InvalidArgument,
    InvalidRewind,
    KVCMError,
    OutOfBlocks,
    RequestLimitReached,
    RewindIntoSharedBlock,
    SequenceTooLong,
    StepAborted,
    UnknownRequest,
)
from kvcm_client.models import AllocateOp, CommitOp, ExtendOp, FreeOp, RewindOp

TPB = 4
MAX_SEQ = 64
#: Slots per pool group: a roomy pool and tight ones (out of blocks, evictions).
NUM_BLOCKS = (24, 12, 16)
MAX_REQUESTS = 6

LAYOUTS: dict[str, list[dict[str, object]]] = {
    "full": [layer(0), layer(1)],
    # A full group and a window group with 2 sink tokens (1 sink block) of one shape: one
    # pool group shared by both.
    "window_shared": [layer(0), layer(1, sliding_window=8, sink_tokens=2)],
    # The window group (5 sink tokens = 2 blocks) has another shape: its own pool group.
    "window_own": [layer(0), layer(1, sliding_window=6, sink_tokens=5, num_kv_heads=1)],
    # A key-only layer and a key/value layer in one group (two pools), and a key-only window.
    "key_only": [layer(0, kv_factor=1), layer(1), layer(2, sliding_window=5, kv_factor=1)],
    "no_reuse": [layer(0), layer(1, reuse="none")],
    # nvfp4 data and scale pools, full and window groups sharing a pool group.
    "nvfp4": [
        layer(0, head_dim=16, dtype="nvfp4"),
        layer(1, head_dim=16, dtype="nvfp4", sliding_window=8),
    ],
}

IDS = ["a", "r1", "r2", "r3", "r4", "r5", "r6", "x" * MAX_REQUEST_ID]
#: Request ids no request can have.
BAD_IDS: list[Any] = ["", "x" * (MAX_REQUEST_ID + 1), "y" * 100_000, 5, None, b"r1", ("r1",)]


def unknown(rid: Any) -> Outcome:
    """What naming a request no request has raises: ``UnknownRequest``, or
    ``InvalidArgument`` for an id that is not a string (kvcm.request_rows)."""
    return Outcome(must=(UnknownRequest if isinstance(rid, str) else InvalidArgument,))


#: ``first_unknown``'s answer when every id is live (None is an id a test may pass).
ALL_LIVE = object()


def first_unknown(ids: Any, live: Any) -> Any:
    """The first of ``ids`` no live request has (what the manager names), or ``ALL_LIVE``."""
    return next((r for r in ids if not isinstance(r, str) or r not in live), ALL_LIVE)


#: Counts at and past every bound, and values of the wrong type.
EDGE: list[Any] = [
    0,
    -1,
    2**31 - 1,
    2**31,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    True,
    False,
    np.int64(3),
    np.uint64(2**63),
    2.0,
    "3",
    None,
]
#: Scopes are drawn None-heavy, so that requests share prefixes often.
LORAS: list[Any] = [None, None, None, None, 1, "lora-a", 2**63 - 1]
SALTS: list[Any] = [None, None, None, "s1", "s2"]
BAD_LORAS: list[Any] = [2**63, -(2**63) - 1, True, 1.5, np.int64(1), b"x"]
BAD_SALTS: list[Any] = [1, b"s1"]
#: Prompt families: requests of one family share prefixes (and so blocks).
FAMILIES = [[(f + 1) * 1000 + i % (3 + f) for i in range(2 * MAX_SEQ)] for f in range(3)]
#: (multimodal argument, valid). One placeholder length per digest (img1 3, img2 6), as a
#: real image has: the KV patterns below depend on the digest only.
MULTIMODAL: list[tuple[Any, bool]] = [
    ([{"digest": "img1", "start": 0, "length": 3}], True),
    ([MultimodalItem("img2", 5, 6)], True),
    ([{"digest": "img1", "start": 9, "length": 3}], True),
    ([{"digest": "d", "start": -1, "length": 2}], False),
    ([{"digest": "d", "start": 0, "length": 0}], False),
    ([MultimodalItem("d", -3, 2)], False),
    ([{"digest": 1, "start": 0, "length": 1}], False),
    ([{"digest": "d", "start": True, "length": 1}], False),
    (["x"], False),
    (5, False),
]


def is_count(value: Any, minimum: int) -> bool:
    """What every count argument must be: an int (not a bool) in [minimum, MAX_COUNT]."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | np.integer)
        and minimum <= value <= MAX_COUNT
    )


def is_counts(value: Any, n: int, minimum: int) -> bool:
    """A count, or a list, tuple or int array of n counts."""
    if isinstance(value, list | tuple | np.ndarray):
        return len(value) == n and all(is_count(v, minimum) for v in value)
    return is_count(value, minimum)


def is_tokens(value: Any) -> bool:
    """Token ids: a sequence of ints in [0, 2**31) (in process a bool counts as an int)."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple | np.ndarray):
        return False
    return all(isinstance(t, int | np.integer) and 0 <= t < 2**31 for t in value)


def is_multimodal(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, list | tuple):
        return False
    for item in value:
        if isinstance(item, dict):
            item = MultimodalItem(item.get("digest"), item.get("start"), item.get("length"))
        if not isinstance(item, MultimodalItem) or not isinstance(item.digest, str):
            return False
        if not all(is_count(v, 0) for v in (item.start, item.length)) or item.length < 1:
            return False
    return True


def valid_lora(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, str)
        or (type(value) is int and -(2**63) <= value < 2**63)
    )


def blocks(tokens: int) -> int:
    return -(-tokens // TPB)


@dataclass
class Req:
    """The model of one live request."""

    row: int
    num_tokens: int
    lookahead: int
    blocks: int
    #: Per layer group: end of the released window run [sinks, end).
    released: list[int]
    #: The request's true tokens: its prompt, then its continuation (at least num_tokens).
    seq: list[int]
    family: int
    scope: tuple[Any, Any]
    mm: tuple[MultimodalItem, ...]
    hits: int
    first: Any
    #: The first allocate's arguments as the manager compares them for a retry.
    args: tuple[Any, ...]
    #: The first allocate's arguments as given (to resend them).
    raw: dict[str, Any]
    committed: int = 0
    #: Positions whose KV the simulated engine has written.
    written: int = 0
    #: Content pattern per position of seq (a hash chain).
    patterns: list[bytes] = field(default_factory=list)

    def extend_seq(self, n: int) -> None:
        on_family = self.seq == FAMILIES[self.family][: len(self.seq)]
        while len(self.seq) < n:
            p = len(self.seq)
            self.seq.append(FAMILIES[self.family][p] if on_family else 500 + p % 17)


@dataclass
class Outcome:
    """What a call must do: raise one of ``must`` if given, else succeed, or raise one of
    ``may`` (refusals the model justifies but does not pin down)."""

    must: tuple[type[KVCMError], ...] = ()
    may: tuple[type[KVCMError], ...] = ()


def rarely(data: st.DataObject, n: int) -> bool:
    """True about one draw in n: never in the simplest run Hypothesis tries (all draws at
    their minimum), which so stays a valid, busy one."""
    return data.draw(st.integers(1, n)) == n


def shown(call: Callable[[], Any]) -> str:
    """The values a call's lambda closes over, for failure messages."""
    return repr([c.cell_contents for c in call.__closure__ or ()])[:400]


def tiled(patterns: list[bytes], width: int) -> np.ndarray:
    """Per position a token's bytes in a buffer of ``width`` bytes per token."""
    raw = np.frombuffer(b"".join(patterns), dtype=np.uint8).reshape(-1, 32)
    return np.tile(raw, (1, -(-width // 32)))[:, :width]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.reqs: dict[str, Req] = {}
        #: (scope, block key) of every block some request committed: what a hit may reuse.
        self.published: set[tuple[tuple[Any, Any], bytes]] = set()
        #: (scope, images, tokens) of committed prefixes: prompts that a new request may hit.
        self.shared: list[tuple[tuple[Any, Any], tuple[MultimodalItem, ...], list[int]]] = []
        self.queries = self.query_tokens = self.hit_tokens = 0

    # -- setup ---------------------------------------------------------------------------------

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        null_page=st.booleans(),
        num_blocks=st.sampled_from(NUM_BLOCKS),
    )
    def build(self, layout: str, null_page: bool, num_blocks: int) -> None:
        self.m = m = KVCacheManager(
            {
                "layers": LAYOUTS[layout],
                "tokens_per_block": TPB,
                "max_requests": MAX_REQUESTS,
                "max_seq_len": MAX_SEQ,
                "num_blocks": num_blocks,
                "null_page": null_page,
            }
        )
        self.empty = 0 if null_page else -1
        groups = m.layout.layer_groups
        self.windows = [(g.sliding_window, g.sink_blocks) for g in groups]
        self.group_pool = [int(g.pool_group) for g in groups]
        self.sharing = [len(pg.layer_groups) for pg in m.layout.pool_groups]
        self.reusable = all(g.reuse == "reusable" for g in groups)
        #: Per layer group, its pools (shared with the other layer groups of its pool group).
        self.group_pools = [list(g.physical_pools) for g in groups]
        rng = np.random.default_rng(0)
        for t in m.memory.tensors:
            t.numpy()[:] = rng.integers(0, 256, t.shape, dtype=np.uint8)
            if null_page:
                t[0].zero_()

    def pools(self) -> dict[int, np.ndarray]:
        """Each pool as uint8 ``[slots, buffers, tpb, token bytes]`` (aliasing its memory)."""
        out = {}
        for pid, pool in enumerate(self.m.layout.pools):
            raw = self.m.memory.tensors[pid].numpy()
            out[pid] = raw.reshape(
                raw.shape[0], pool.num_buffers, TPB, pool.bytes_per_buffer // TPB
            )
        return out

    # -- observation ----------------------------------------------------------------------------

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a refused call must leave as it was."""
        m = self.m
        c = m.parts.coord
        cache = c.cache
        return (
            sorted(
                (
                    r,
                    m.request(r).model_dump_json(),
                    m.block_table(r),
                    m.committed_tokens(r),
                    len(m.parts.requests.prefix[r].keys),
                )
                for r in m.request_ids()
            ),
            m.page_tables().numpy().tobytes(),
            tuple(a.tobytes() for a in c._state_arrays()),
            tuple(p.free_order().tobytes() for p in c.pools),
            tuple(m.num_free_blocks(pg) for pg in range(len(c.pools))),
            m.num_free_blocks(),
            tuple(r.tobytes() for r in c.refs),
            tuple(x.tobytes() for x in cache.cached),
            sorted(
                (g, root, key, slot)
                for g, index in enumerate(cache.index)
                for root, keys in index.items()
                for key, slot in keys.items()
            ),
            m.stats().prefix_cache.model_dump_json(),
            m.last_event_seq,
            tuple(m.parts.requests.free_rows),
            m.parts.requests.committed.tobytes(),
            m.parts.requests.hits.tobytes(),
        )

    def memory(self) -> list[bytes]:
        return [t.numpy().tobytes() for t in self.m.memory.tensors]

    def attempt(
        self,
        name: str,
        outcome: Outcome,
        call: Callable[[], Any],
        writes: bool = False,
        readonly: bool = False,
    ) -> tuple[Any, KVCMError | None]:
        """Run ``call``: it must raise a ``KVCMError`` subclass or return; a refusal changes
        nothing, only ``writes`` calls may change pool bytes, and ``readonly`` ones nothing
        else even when they succeed. Checks ``outcome``."""
        before, memory = self.snapshot(), self.memory()
        c = self.m.parts.coord
        self.queues = [p.free_order().tolist() for p in c.pools]
        self.refs = [r.copy() for r in c.refs]
        try:
            out = call()
        except KVCMError as exc:
            assert self.snapshot() == before, f"a refused call changed the state: {exc!r}"
            assert self.memory() == memory, f"a refused call changed pool bytes: {exc!r}"
            if outcome.must:
                assert isinstance(exc, outcome.must), (
                    f"{name}: expected {outcome.must}, got {exc!r}"
                )
            else:
                assert isinstance(exc, outcome.may), f"{name}: unexpected {exc!r}: {shown(call)}"
            event(f"{name}: {exc.code}")
            return None, exc
        event(f"{name}: ok")
        assert not outcome.must, f"expected {outcome.must}, {name} succeeded: {shown(call)}"
        if not writes:
            assert self.memory() == memory, "an op that moves no KV changed pool bytes"
        if readonly:
            assert self.snapshot() == before, f"{name} changed the state"
        return out, None

    def check_slots(
        self,
        releases: list[tuple[int, np.ndarray]],
        takes: list[tuple[int, int, int, int]],
        claims: list[tuple[int, list[int]]] | None = None,
    ) -> None:
        """Slot by slot, the free queues after a successful single op (``attempt`` kept them
        as they were before it): it takes ``claims`` (pool group, hit slots) out of them,
        gives back ``releases`` (per layer group in order, the slots it drops, in the order
        they go: a window's by position, a free's or rewind's tail first; a slot only when
        its last holder drops it), then takes ``takes`` (layer group, row, first position,
        count) off their heads, layer group by layer group (docs/requests.md)."""
        queues = [list(q) for q in self.queues]
        refs = [r.copy() for r in self.refs]
        for pg, slots in claims or []:
            for slot in slots:
                queues[pg].remove(slot)
        for g, slots in releases:
            pg = self.group_pool[g]
            np.subtract.at(refs[pg], slots, 1)
            queues[pg] += [s for s in dict.fromkeys(slots.tolist()) if refs[pg][s] == 0]
        tables = self.m.parts.coord.tables
        for g, row, start, k in takes:
            pg = self.group_pool[g]
            got = tables[g, row, start : start + k].tolist()
            assert got == queues[pg][:k], ("new blocks come off the queue's head", g, got)
            del queues[pg][:k]
        for pg, pool in enumerate(self.m.parts.coord.pools):
            got = pool.free_order().tolist()
            assert got == queues[pg], ("free order", pg, got, queues[pg])

    def grow_plan(
        self, items: list[tuple[Req, int, int]]
    ) -> tuple[list[tuple[int, np.ndarray]], list[tuple[int, int, int, int]]]:
        """``check_slots``' releases and takes for extending these (request, new tokens,
        lookahead) at once: windows release their stale blocks, then each layer group takes
        the new blocks of every request in turn."""
        tables = self.m.parts.coord.tables
        releases = []
        for g, (window, _) in enumerate(self.windows):
            if window is not None:
                ends = [max(q.released[g], (q.num_tokens + 1 - window) // TPB) for q, _, _ in items]
                cells = [
                    tables[g, q.row, q.released[g] : e]
                    for (q, _, _), e in zip(items, ends, strict=True)
                ]
                releases.append((g, np.concatenate([np.empty(0, np.int32), *cells])))
        takes = [
            (g, q.row, q.blocks, max(blocks(q.num_tokens + n + la) - q.blocks, 0))
            for g in range(len(self.windows))
            for q, n, la in items
        ]
        return releases, takes

    def drop_plan(self, req: Req, keep: int) -> list[tuple[int, np.ndarray]]:
        """``check_slots``' releases of dropping the request's blocks from ``keep`` on."""
        out = []
        for g in range(len(self.windows)):
            cells = self.m.parts.coord.tables[g, req.row, keep : req.blocks]
            out.append((g, cells[cells > self.empty][::-1].copy()))
        return out

    # -- the model's predictions -----------------------------------------------------------------

    def free_counts(self) -> list[int]:
        return [self.m.num_free_blocks(pg) for pg in range(len(self.sharing))]

    def fits(self, items: list[tuple[Req | None, int, int]]) -> bool:
        """Whether growing these (request or None for a new one, new tokens, lookahead) at
        once fits: the need of each pool group against its free slots plus the slots the
        op's window releases free (a stale block a prefix hit shares stays held)."""
        need = [0] * len(self.sharing)
        stale: list[list[int]] = [[] for _ in self.sharing]
        tables = self.m.parts.coord.tables
        for req, n, la in items:
            h = req.num_tokens if req else 0
            want = blocks(h + n + la)
            for g, (window, _) in enumerate(self.windows):
                pg = self.group_pool[g]
                need[pg] += max(want - (req.blocks if req else 0), 0)
                if window is not None and req is not None:
                    rel = req.released[g]
                    end = max(rel, (h + 1 - window) // TPB)
                    stale[pg] += tables[g, req.row, rel:end].tolist()
        free = self.free_counts()
        for pg, slots in enumerate(stale):
            refs = self.m.parts.coord.refs[pg]
            holders = collections.Counter(slots)
            back = sum(refs[s] == k for s, k in holders.items())
            if need[pg] > free[pg] + back:
                return False
        return True

    def grown(self, req: Req, n: int, la: int) -> None:
        """Model of a successful allocate or extend from the request's current length."""
        h = req.num_tokens
        for g, (window, _) in enumerate(self.windows):
            if window is not None:
                req.released[g] = max(req.released[g], (h + 1 - window) // TPB)
        req.num_tokens = h + n
        req.lookahead = la
        req.blocks = max(req.blocks, blocks(h + n + la))
        req.extend_seq(req.num_tokens)

    def keys(self, req: Req, tokens: list[int]) -> list[bytes]:
        lora, salt = req.scope
        return block_keys(tokens, TPB, lora_id=lora, cache_salt=salt, multimodal=list(req.mm))

    def committed(self, req: Req, k: int) -> None:
        req.committed += k
        shared = (req.scope, req.mm, req.seq[: req.committed])
        if req.committed >= TPB and shared not in self.shared:
            self.shared.append(shared)
        for key in self.keys(req, req.seq[: req.committed]):
            self.published.add((req.scope, key))

    def check_hit(self, req: Req, prompt: list[int], hit: int) -> None:
        """A hit is whole blocks, leaves the last prompt token to compute and reuses only
        blocks committed before in the request's scope."""
        assert hit % TPB == 0 and 0 <= hit <= len(prompt) - 1, hit
        if hit:
            assert self.reusable, "a hit in a model with a reuse='none' group"
            key = self.keys(req, prompt[:hit])[-1]
            assert (req.scope, key) in self.published, "a hit on blocks nobody committed"

    # -- the simulated engine ----------------------------------------------------------------------

    def patterns(self, req: Req, end: int) -> list[bytes]:
        """The KV pattern of positions [0, end): a hash chain over the scope, the tokens and
        the images starting at each position, so equal patterns mean equal true KV."""
        pats = req.patterns
        prev = pats[-1] if pats else hashlib.sha256(repr(req.scope).encode()).digest()
        for p in range(len(pats), end):
            tag = "".join(sorted(it.digest for it in req.mm if it.start == p)).encode()
            prev = hashlib.sha256(prev + req.seq[p].to_bytes(4, "little") + tag).digest()
            pats.append(prev)
        return pats[:end]

    def cells(self, req: Req, g: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(live mask, slots) of these positions of the request in layer group g."""
        slots = self.m.parts.coord.tables[g, req.row, positions // TPB]
        return slots > self.empty, slots

    def write(self, req: Req, positions: np.ndarray) -> None:
        """The engine computes these positions' KV: their patterns into every live cell."""
        if not positions.size:
            return
        pats = self.patterns(req, int(positions.max()) + 1)
        pools = self.pools()
        for g, pids in enumerate(self.group_pools):
            live, slots = self.cells(req, g, positions)
            for view in (pools[pid] for pid in pids):
                data = tiled([pats[p] for p in positions[live]], view.shape[3])
                view[slots[live], :, positions[live] % TPB, :] = data[:, None, :]

    def fill(self) -> None:
        """Write the KV of every live request's new tokens."""
        for req in self.reqs.values():
            if req.written < req.num_tokens:
                self.write(req, np.arange(req.written, req.num_tokens))
            req.written = req.num_tokens

    # -- rules -----------------------------------------------------------------------------------

    def corrupt(self, data: st.DataObject, fields: list[str]) -> str | None:
        """The one argument this call gets wrong, about one call in five (None: all valid).

        One at a time, so that each check is met on its own and most calls do something.
        """
        if not rarely(data, 5):
            return None
        return data.draw(st.sampled_from(fields))

    def draw_id(self, data: st.DataObject, bad: bool) -> Any:
        """A live request's id mostly; if ``bad``, an id no request has."""
        live = sorted(self.reqs)
        if bad or not live:
            gone = [r for r in IDS if r not in self.reqs]
            return data.draw(st.sampled_from(gone + BAD_IDS))
        return data.draw(st.sampled_from(live))

    def draw_prompt(self, data: st.DataObject, length: int) -> tuple[int, list[int]]:
        """(family, tokens): a family's prefix, maybe diverging into its own tail."""
        family = data.draw(st.integers(0, len(FAMILIES) - 1))
        diverge = data.draw(st.sampled_from([length, length, 0]) | st.integers(0, length))
        tokens = [FAMILIES[family][p] if p < diverge else 500 + p % 17 for p in range(length)]
        return family, tokens

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        m = self.m
        live = sorted(self.reqs)
        if live and rarely(data, 10):  # a retry with the first arguments
            rid = data.draw(st.sampled_from(live))
            req = self.reqs[rid]
            out, _ = self.attempt(
                "allocate retry", Outcome(), lambda: m.allocate(rid, **req.raw), readonly=True
            )
            assert out == req.first, "a retry must return the first result"
            return
        if len(self.reqs) == MAX_REQUESTS and not rarely(data, 4):
            self.free(data, finish=True)  # a finished request makes room for the new one
        bad = self.corrupt(
            data, ["id", "num_tokens", "lookahead", "tokens", "lora", "salt", "mm", "keys"]
        )
        free_ids = [r for r in IDS if r not in self.reqs]
        if bad == "id":
            rid = data.draw(st.sampled_from(BAD_IDS))
        else:  # now and then a live id: a duplicate, or an identical retry
            rid = data.draw(st.sampled_from(IDS if rarely(data, 5) or not free_ids else free_ids))
        length = data.draw(st.integers(1, 20) | st.integers(1, MAX_SEQ + 1))
        family, prompt = self.draw_prompt(data, length)
        lookahead = data.draw(st.sampled_from(EDGE) if bad == "lookahead" else st.integers(0, 3))
        lora = data.draw(st.sampled_from(BAD_LORAS if bad == "lora" else LORAS))
        salt = data.draw(st.sampled_from(BAD_SALTS if bad == "salt" else SALTS))
        mm: Any = None
        if bad == "mm":
            mm = data.draw(st.sampled_from([m for m, ok in MULTIMODAL if not ok]))
        elif rarely(data, 6):
            mm = data.draw(st.sampled_from([m for m, ok in MULTIMODAL if ok]))
        if self.shared and not rarely(data, 3):  # a prompt that starts as one committed
            # Recent ones: older ones are likely evicted by now.
            (lora_, salt_), items_, head = data.draw(st.sampled_from(self.shared[-3:]))
            lora = lora if bad == "lora" else lora_
            salt = salt if bad == "salt" else salt_
            mm = mm if bad == "mm" else list(items_) or None
            cut = data.draw(st.sampled_from([len(head)]) | st.integers(1, len(head)))
            prompt = [*head[:cut], *prompt[: data.draw(st.integers(0, 6))]]
            length = len(prompt)
        num_tokens: Any = length
        if bad == "num_tokens":
            num_tokens = data.draw(st.sampled_from([length + 1, length - 1, *EDGE]))
        form = data.draw(st.sampled_from(["list"] * 6 + ["none", "array", "uint64", "bools"]))
        tokens: Any = {
            "list": prompt,
            "none": None,
            "array": np.array(prompt, dtype=np.int32),
            "uint64": np.array(prompt, dtype=np.uint64),
            "bools": [True] * length,
        }[form]
        if bad == "tokens":
            tokens = data.draw(
                st.sampled_from([[-1] * length, [2**31] * length, [1.5] * length, "abc", 7])
            )
        kw: dict[str, Any] = {"num_tokens": num_tokens, "token_ids": tokens, "lookahead": lookahead}
        kw |= {"lora_id": lora, "cache_salt": salt, "multimodal": mm}
        items = multimodal_items(mm) if is_multimodal(mm) else ()
        norm = [int(t) for t in tokens] if is_tokens(tokens) else None
        keys_kind = "none"
        if norm is not None:
            choices = (
                ["short", "int", "str", "nones"] if bad == "keys" else ["honest", "hex", "other"]
            )
            if bad == "keys" or rarely(data, 4):
                keys_kind = data.draw(st.sampled_from(choices))
        if keys_kind != "none":
            honest = (
                block_keys(norm, TPB, lora_id=lora, cache_salt=salt, multimodal=list(items))
                if bad not in ("lora", "salt")
                else []
            )
            kw["block_keys"] = {
                "honest": honest,
                "hex": [k.hex() for k in honest],
                "other": block_keys(norm, TPB, cache_salt="attacker"),
                "short": honest[:-1] if honest else [b"\0" * 32],
                "int": 5,
                "str": "zz",
                "nones": [None] * max(len(honest), 1),
            }[keys_kind]
        early = (
            not isinstance(rid, str)
            or not 0 < len(rid) <= MAX_REQUEST_ID
            or not is_count(num_tokens, 1)
            or not is_count(lookahead, 0)
            or (tokens is not None and norm is None)
            or not is_multimodal(mm)
            or not valid_lora(lora)
            or not (salt is None or isinstance(salt, str))
        )
        args = None if early else (int(num_tokens), int(lookahead), norm, lora, salt, items)
        outcome = Outcome()
        retry = False
        if early:
            outcome = Outcome(must=(InvalidArgument,))
        elif rid in self.reqs:
            retry = self.reqs[rid].args == args
            if not retry:  # the prompt is checked before the id (hashing it costs most)
                if norm is not None and len(norm) != num_tokens:
                    outcome = Outcome(must=(InvalidArgument,))
                elif norm is not None and len(norm) > MAX_SEQ:
                    outcome = Outcome(must=(SequenceTooLong,))
                else:
                    outcome = Outcome(must=(DuplicateRequest,))
        else:
            late: list[type[KVCMError]] = []
            if num_tokens + lookahead > MAX_SEQ:
                late.append(SequenceTooLong)
            if len(self.reqs) == MAX_REQUESTS:
                late.append(RequestLimitReached)
            if norm is not None and (len(norm) != num_tokens or bad == "keys"):
                late.append(InvalidArgument)
            if late:
                outcome = Outcome(must=tuple(late))
        hit = None
        if not outcome.must and not retry and norm is not None:
            probe_kw = {k: kw[k] for k in ("lora_id", "cache_salt", "multimodal")}
            if "block_keys" in kw:
                probe_kw["block_keys"] = kw["block_keys"]
            hit, _ = self.attempt(
                "probe before allocate",
                Outcome(),
                lambda: m.probe(tokens, **probe_kw),
                readonly=True,
            )
        if not outcome.must and not retry:
            no_hit_fits = self.fits([(None, int(num_tokens), int(lookahead))])
            if not hit:
                outcome = Outcome() if no_hit_fits else Outcome(must=(OutOfBlocks,))
            elif not no_hit_fits:
                outcome = Outcome(may=(OutOfBlocks,))
        info, err = self.attempt("allocate", outcome, lambda: m.allocate(rid, **kw))
        if err is not None:
            return
        if retry:
            assert info == self.reqs[rid].first
            return
        req = Req(
            row=info.row,
            num_tokens=0,
            lookahead=0,
            blocks=0,
            released=[s for _, s in self.windows],
            seq=list(norm) if norm is not None else prompt,
            family=family,
            scope=(lora, salt),
            mm=items,
            hits=info.num_hit_tokens,
            first=info,
            args=args,
            raw=kw,
        )
        assert info.num_tokens == num_tokens and info.capacity == num_tokens + lookahead
        assert info.num_committed == info.num_hit_tokens
        if norm is not None:
            self.queries += 1
            self.query_tokens += int(num_tokens)
            self.hit_tokens += info.num_hit_tokens
            event(f"allocate hit: {info.num_hit_tokens > 0}")
            assert info.num_hit_tokens == hit, "allocate must reuse what a probe promised"
            self.check_hit(req, norm, info.num_hit_tokens)
            if keys_kind == "other":
                assert info.num_hit_tokens == 0, "keys of another scope hit"
        else:
            assert info.num_hit_tokens == 0
        self.admit(rid, req, int(num_tokens), int(lookahead))
        b, tables = req.hits // TPB, m.parts.coord.tables
        claims = []
        for g, pg in enumerate(self.group_pool):  # hit blocks nobody held left the queue
            cells = tables[g, req.row, :b].tolist()
            claims.append((pg, [s for s in cells if s > self.empty and not self.refs[pg][s]]))
        self.check_slots(
            [], [(g, req.row, b, req.blocks - b) for g in range(len(self.windows))], claims
        )
        if data.draw(st.booleans()):  # the prefill is computed
            self.commit(data, rid)

    def admit(self, rid: str, req: Req, num_tokens: int, lookahead: int) -> None:
        """Model of a new request: its hit blocks, then growth from the hit."""
        req.num_tokens = req.committed = req.written = req.hits
        req.blocks = req.hits // TPB
        self.grown(req, num_tokens - req.hits, lookahead)
        self.reqs[rid] = req
        self.fill()

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        bad = self.corrupt(data, ["id", "n", "lookahead"])
        rid = self.draw_id(data, bad == "id")
        n = data.draw(st.sampled_from(EDGE) if bad == "n" else st.integers(1, 6))
        la = data.draw(st.sampled_from(EDGE) if bad == "lookahead" else st.integers(0, 3))
        req = self.reqs.get(rid) if isinstance(rid, str) else None
        if req is None:
            outcome = unknown(rid)
        elif not (is_count(n, 1) and is_count(la, 0)):
            outcome = Outcome(must=(InvalidArgument,))
        elif req.num_tokens + n + la > MAX_SEQ:
            outcome = Outcome(must=(SequenceTooLong,))
        elif not self.fits([(req, int(n), int(la))]):
            outcome = Outcome(must=(OutOfBlocks,))
        else:
            outcome = Outcome()
        plan = self.grow_plan([(req, int(n), int(la))]) if not outcome.must else None
        info, err = self.attempt("extend", outcome, lambda: self.m.extend(rid, n, lookahead=la))
        if err is None:
            self.check_slots(*plan)
            self.grown(req, int(n), int(la))
            assert (info.num_tokens, info.capacity) == (req.num_tokens, req.num_tokens + la)
            self.fill()

    def draw_counts(
        self, data: st.DataObject, n: int, valid: st.SearchStrategy[int], bad: bool
    ) -> Any:
        """A count, a list of n, or an int64 or uint64 array of n; if ``bad``, one of them (or
        the scalar) is an edge value."""
        form = data.draw(st.sampled_from(["scalar", "list", "int64", "uint64"]))
        if form == "scalar":
            return data.draw(st.sampled_from(EDGE)) if bad else data.draw(valid)
        values: list[Any] = data.draw(st.lists(valid, min_size=n, max_size=n))
        if form != "list":
            if bad:  # past MAX_COUNT, or negative (wrapped in uint64)
                values = [*values[1:], data.draw(st.sampled_from([2**31, 2**63 - 1, -1]))]
                if form == "uint64":
                    values[-1] %= 2**64
            return np.array(values, dtype=np.int64 if form == "int64" else np.uint64)
        if bad:
            values = [*values, data.draw(st.sampled_from(EDGE))][-max(n, 1) :]
        return values

    @rule(data=st.data())
    def extend_many(self, data: st.DataObject) -> None:
        live = sorted(self.reqs)
        ids: Any = data.draw(st.permutations(live)) if live else []
        ids = ids[: data.draw(st.integers(0, len(ids)))]
        bad = self.corrupt(data, ["ids", "n", "lookahead"])
        if bad == "ids":
            how = data.draw(st.sampled_from(["unknown", "dup", "str", "none", "tuple"]))
            if how == "unknown":
                ids = [*ids, self.draw_id(data, True)]
            elif how == "dup" and ids:
                ids = [*ids, ids[0]]
            elif how == "str":
                ids = data.draw(st.sampled_from(["a", "r1", "aa"]))
            elif how == "none":
                ids = data.draw(st.sampled_from([None, 5]))
            else:  # a tuple is a fine sequence of ids
                ids = tuple(ids)
        size = len(ids) if isinstance(ids, list | tuple) else 1
        n = self.draw_counts(data, size, st.integers(1, 4), bad == "n")
        la = self.draw_counts(data, size, st.integers(0, 2), bad == "lookahead")
        self.grow_many("extend_many", ids, n, la)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """A decode step: every live request gets one token (some verify drafts)."""
        ids = sorted(self.reqs)
        n = [data.draw(st.sampled_from([1, 1, 1, 2, 3])) for _ in ids]
        self.grow_many("decode", ids, n, data.draw(st.integers(0, 2)))

    def grow_many(self, name: str, ids: Any, n: Any, la: Any) -> None:
        """``extend_many(ids, n, la)`` against the model."""
        items: list[tuple[Req, int, int]] = []
        if not isinstance(ids, list | tuple):
            outcome = Outcome(must=(InvalidArgument,))
        elif (missing := first_unknown(ids, self.reqs)) is not ALL_LIVE:
            outcome = unknown(missing)
        elif len(set(ids)) != len(ids) or not (
            is_counts(n, len(ids), 1) and is_counts(la, len(ids), 0)
        ):
            outcome = Outcome(must=(InvalidArgument,))
        else:
            ns = np.broadcast_to(np.asarray(n, dtype=np.int64), len(ids)).tolist()
            las = np.broadcast_to(np.asarray(la, dtype=np.int64), len(ids)).tolist()
            items = [(self.reqs[r], a, b) for r, a, b in zip(ids, ns, las, strict=True)]
            if any(req.num_tokens + a + b > MAX_SEQ for req, a, b in items):
                outcome = Outcome(must=(SequenceTooLong,))
            elif not self.fits(items):
                outcome = Outcome(must=(OutOfBlocks,))
            else:
                outcome = Outcome()
        plan = self.grow_plan(items) if not outcome.must else None
        _, err = self.attempt(name, outcome, lambda: self.m.extend_many(ids, n, la))
        if err is None:
            self.check_slots(*plan)
            for req, a, b in items:
                self.grown(req, a, b)
            self.fill()

    def rewind_outcome(self, req: Req | None, n: Any, rid: Any) -> Outcome:
        """``rid``: the id it was called with (what names an unknown one)."""
        if req is None:
            return unknown(rid)
        if not is_count(n, 1) or n >= req.num_tokens:
            return Outcome(must=(InvalidArgument,))
        new_len = req.num_tokens - n
        c = self.m.parts.coord
        keep = blocks(new_len + req.lookahead)
        shared = False
        for g in range(len(self.windows)):
            pg = self.group_pool[g]
            held = c.tables[g, req.row, new_len // TPB : keep]
            held = held[held > self.empty]
            shared |= bool((c.cache.cached[pg][held] & (c.refs[pg][held] > 1)).any())
        for g, (window, sinks) in enumerate(self.windows):
            rel = req.released[g]
            first_needed = max(sinks, (new_len + 1 - window) // TPB) if window else 0
            if window is not None and rel > sinks and first_needed < rel:
                return Outcome(must=(InvalidRewind, RewindIntoSharedBlock))
        return Outcome(must=(RewindIntoSharedBlock,)) if shared else Outcome()

    def rewound(self, req: Req, n: int) -> None:
        req.num_tokens -= n
        req.blocks = min(req.blocks, blocks(req.num_tokens + req.lookahead))
        req.committed = min(req.committed, req.num_tokens)
        req.written = min(req.written, req.num_tokens)
        del req.seq[req.num_tokens :]
        del req.patterns[req.num_tokens :]

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        bad = self.corrupt(data, ["id", "n"])
        rid = self.draw_id(data, bad == "id")
        req = self.reqs.get(rid) if isinstance(rid, str) else None
        most = req.num_tokens if req else 4
        n = data.draw(st.sampled_from(EDGE) if bad == "n" else st.integers(1, max(most - 1, 1)))
        outcome = self.rewind_outcome(req, n, rid)
        plan = None
        if not outcome.must:
            plan = self.drop_plan(req, blocks(req.num_tokens - n + req.lookahead))
        info, err = self.attempt("rewind", outcome, lambda: self.m.rewind(rid, n))
        if err is None:
            self.check_slots(plan, [])
            self.rewound(req, int(n))
            assert info.num_tokens == req.num_tokens and info.num_committed == req.committed

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def commit(self, data: st.DataObject, rid: Any = None) -> None:
        """Commit the next tokens of a request (of ``rid``: all of them, a prefill done)."""
        prefill = rid is not None
        bad = None if prefill else self.corrupt(data, ["id", "tokens", "too_many"])
        rid = rid if prefill else self.draw_id(data, bad == "id")
        req = self.reqs.get(rid) if isinstance(rid, str) else None
        room = req.num_tokens - req.committed if req else 3
        k = room if prefill else data.draw(st.sampled_from([room]) | st.integers(0, room))
        tokens: Any = req.seq[req.committed : req.committed + k] if req else [1] * k
        if bad == "too_many":
            tokens = [*(req.seq[req.committed :] if req else []), 1]
        elif bad == "tokens":
            tokens = data.draw(st.sampled_from([[-1], [2**31], [1.5], "ab", 5, None, [None]]))
        if req is None:
            outcome = unknown(rid)
        elif not is_tokens(tokens) or req.committed + len(tokens) > req.num_tokens:
            outcome = Outcome(must=(InvalidArgument,))
        else:
            outcome = Outcome()
        info, err = self.attempt("commit", outcome, lambda: self.m.commit(rid, tokens))
        if err is None:
            self.committed(req, len(tokens))
            assert info.num_committed == req.committed

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject, finish: bool = False) -> None:
        """Free a request (an unknown id now and then); ``finish``: a live one."""
        rid = self.draw_id(data, not finish and rarely(data, 6))
        known = isinstance(rid, str) and rid in self.reqs
        outcome = Outcome() if known else unknown(rid)
        plan = self.drop_plan(self.reqs[rid], 0) if known else None
        _, err = self.attempt("free", outcome, lambda: self.m.free(rid))
        if err is None:
            self.check_slots(plan, [])
            del self.reqs[rid]

    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        bad = self.corrupt(data, ["tokens", "lora"])
        family, prompt = self.draw_prompt(data, data.draw(st.integers(0, 30)))
        scope = (data.draw(st.sampled_from(LORAS)), data.draw(st.sampled_from(SALTS)))
        if self.shared and data.draw(st.booleans()):  # a committed prefix, maybe in its scope
            shared_scope, _, head = data.draw(st.sampled_from(self.shared[-3:]))
            prompt = head[: data.draw(st.integers(1, len(head)))] + prompt[:2]
            scope = shared_scope if data.draw(st.booleans()) else scope
        tokens: Any = prompt
        if bad == "tokens":
            tokens = data.draw(st.sampled_from([[-1], [2**31] * 5, "abcd", 5, None, [1.5] * 5]))
        lora = data.draw(st.sampled_from(BAD_LORAS)) if bad == "lora" else scope[0]
        salt = scope[1]
        kw: dict[str, Any] = {"lora_id": lora, "cache_salt": salt}
        if rarely(data, 4):  # keys another tenant published, or junk
            kw["block_keys"] = block_keys(prompt, TPB, cache_salt="attacker")
        sequence = isinstance(tokens, list | tuple | np.ndarray)
        if sequence and len(tokens) == 0:
            outcome = Outcome(may=(InvalidArgument,))  # nothing to look up: 0 or refused
        elif "block_keys" in kw:
            # Given keys, a probe reads only the prompt's length: it claims nothing, so it
            # need not check the ids (allocate does, for the commits that will hash them).
            valid = sequence and valid_lora(lora) and len(kw["block_keys"]) == len(tokens) // TPB
            outcome = Outcome(may=(InvalidArgument,)) if valid else Outcome(must=(InvalidArgument,))
        else:
            outcome = Outcome() if bad is None else Outcome(must=(InvalidArgument,))
        hit, err = self.attempt("probe", outcome, lambda: self.m.probe(tokens, **kw), readonly=True)
        if err is None and "block_keys" in kw:
            assert hit == 0, "keys of another scope hit"
        elif err is None and len(tokens):
            probe = Req(0, 0, 0, 0, [], prompt, family, (lora, salt), (), 0, None, (), {})
            self.check_hit(probe, prompt, hit)
            event(f"probe hit: {hit > 0}")

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def copy_tokens(self, data: st.DataObject) -> None:
        m = self.m
        live = sorted(self.reqs)
        ops = []
        for _ in range(data.draw(st.integers(0, 6)) if live else 0):
            rid = data.draw(st.sampled_from(live))
            req = self.reqs[rid]
            cap = req.num_tokens + req.lookahead
            low = min(req.committed // TPB * TPB, cap - 1)  # past published blocks
            src = data.draw(st.integers(0, cap - 1))
            dst = data.draw(st.integers(low, cap - 1) | st.integers(0, cap - 1))
            ops.append((rid, src, dst))
            if rarely(data, 4) and dst:
                ops.append((rid, dst, dst - 1))  # a chain: dst - 1 <- dst <- src
        ids: Any = [r for r, _, _ in ops]
        src: Any = [s for _, s, _ in ops]
        dst: Any = [d for _, _, d in ops]
        bad = self.corrupt(data, ["ids", "positions", "short", "unknown"])
        if bad == "ids":
            ids = data.draw(st.sampled_from(["a", None]))
        elif bad == "positions" and ops:
            i = data.draw(st.integers(0, len(ops) - 1))
            edge = data.draw(st.sampled_from(["capacity", -1, 2**63, True]))
            q = self.reqs[ids[i]]
            which = src if data.draw(st.booleans()) else dst
            which[i] = q.num_tokens + q.lookahead if edge == "capacity" else edge
        elif bad == "short" and ops:
            dst = dst[:-1]
        elif bad == "unknown":
            ids, src, dst = [*ids, self.draw_id(data, True)], [*src, 0], [*dst, 0]
        form = data.draw(st.sampled_from(["list", "list", "int64", "uint64"]))
        if form != "list" and all(is_count(v, 0) for v in src + dst):
            dtype = np.int64 if form == "int64" else np.uint64
            src, dst = np.array(src, dtype=dtype), np.array(dst, dtype=dtype)
        outcome = self.copy_outcome(ids, src, dst)
        expect = None
        if not outcome.must:
            # By value: every destination gets what its source held before the call. Layer
            # groups of one pool group share its pools (each holds its own slots there).
            before = self.pools()
            expect = {pid: view.copy() for pid, view in before.items()}
            tables = m.parts.coord.tables
            for r, s, d in zip(ids, src, dst, strict=True):
                row, s, d = self.reqs[r].row, int(s), int(d)
                for g, pids in enumerate(self.group_pools):
                    s_slot, d_slot = tables[g, row, s // TPB], tables[g, row, d // TPB]
                    for pid in pids:
                        expect[pid][d_slot, :, d % TPB, :] = before[pid][s_slot, :, s % TPB, :]
        _, err = self.attempt(
            "copy_tokens",
            outcome,
            lambda: m.copy_tokens(ids, src, dst),
            writes=True,
            readonly=True,
        )
        if err is None:
            for pid, view in self.pools().items():
                assert np.array_equal(expect[pid], view), "copy_tokens moved other bytes"
            # The engine relocated the true KV of those tokens: computed positions keep
            # their patterns (a copy over computed KV is the scheduler's business).
            for r, d in zip(ids, dst, strict=True):
                req = self.reqs[r]
                if int(d) < req.written:
                    self.write(req, np.array([int(d)]))

    def copy_outcome(self, ids: Any, src: Any, dst: Any) -> Outcome:
        if not isinstance(ids, list):
            return Outcome(must=(InvalidArgument,))
        if (missing := first_unknown(ids, self.reqs)) is not ALL_LIVE:
            return unknown(missing)
        if not (is_counts(src, len(ids), 0) and is_counts(dst, len(ids), 0)):
            return Outcome(must=(InvalidArgument,))
        reqs = [self.reqs[r] for r in ids]
        caps = [q.num_tokens + q.lookahead for q in reqs]
        pairs = list(zip(ids, [int(d) for d in dst], strict=True))
        if any(int(s) >= c or int(d) >= c for s, d, c in zip(src, dst, caps, strict=True)):
            return Outcome(must=(InvalidArgument,))
        if len(set(pairs)) != len(pairs):
            return Outcome(must=(InvalidArgument,))
        c = self.m.parts.coord
        dead = shared = False
        for q, s, d in zip(reqs, src, dst, strict=True):
            for g, pg in enumerate(self.group_pool):
                s_slot = c.tables[g, q.row, int(s) // TPB]
                d_slot = c.tables[g, q.row, int(d) // TPB]
                dead |= s_slot <= self.empty or d_slot <= self.empty
                if d_slot > self.empty:
                    shared |= c.refs[pg][d_slot] > 1 or bool(c.cache.cached[pg][d_slot])
        if dead:
            return Outcome(must=(InvalidArgument,))
        return Outcome(must=(CopyIntoSharedBlock,)) if shared else Outcome()

    # -- step --------------------------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        m = self.m
        start = {r: (q.num_tokens, q.committed) for r, q in self.reqs.items()}
        #: Requests whose in-step commits the engine could not have computed before the step.
        touched: set[str] = set()
        ops: list[Any] = []
        prompts: list[list[int]] = []
        count = st.integers(1, 5) | st.sampled_from([0, -1, 2**31, 2**63, 2**64])
        for _ in range(data.draw(st.integers(1, 8))):
            kind = data.draw(
                st.sampled_from(["extend"] * 4 + ["allocate", "rewind", "commit", "free"])
            )
            rid = self.draw_id(data, rarely(data, 6))
            if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID:
                rid = "r6"
            prompt: list[int] = []
            op: dict[str, Any] = {"op": kind, "request_id": rid}
            if kind == "extend":
                op |= {
                    "num_new_tokens": data.draw(count),
                    "lookahead": data.draw(st.integers(0, 2)),
                }
            elif kind == "allocate":
                rid = data.draw(st.sampled_from(IDS))
                _, prompt = self.draw_prompt(data, data.draw(st.integers(1, 20)))
                op |= {
                    "request_id": rid,
                    "num_tokens": len(prompt),
                    "lookahead": data.draw(st.integers(0, 2)),
                }
                op |= {
                    "lora_id": data.draw(st.sampled_from(LORAS)),
                    "cache_salt": data.draw(st.sampled_from(SALTS)),
                }
                plain = [(scope, head) for scope, items, head in self.shared[-3:] if not items]
                if plain and data.draw(st.booleans()):  # a committed prefix: likely a hit
                    (lora, salt), head = data.draw(st.sampled_from(plain))
                    prompt = head + prompt[: data.draw(st.integers(1, 4))]
                    op |= {"num_tokens": len(prompt), "lora_id": lora, "cache_salt": salt}
                if data.draw(st.booleans()):
                    op["token_ids"] = prompt
                touched.add(rid)
            elif kind == "rewind":
                op["num_tokens"] = data.draw(count)
                touched.add(rid)
            elif kind == "commit":
                if rid not in start or rid in touched:
                    continue
                n_tokens, done = start[rid]
                k = data.draw(st.integers(0, n_tokens - done))
                op["token_ids"] = self.reqs[rid].seq[done : done + k]
                touched.add(rid)
            else:
                touched.add(rid)
            prompts.append(prompt)
            if rarely(data, 4):  # the model form of the op
                model = {"allocate": AllocateOp, "extend": ExtendOp, "rewind": RewindOp}
                model |= {"commit": CommitOp, "free": FreeOp}
                ops.append(model[kind](**{k: v for k, v in op.items() if k != "op"}))
            else:
                ops.append(op)
        if data.draw(st.booleans()):  # a scheduler's step ends with a decode of every request
            for rid in sorted(self.reqs):
                ops.append(ExtendOp(request_id=rid, num_new_tokens=data.draw(st.integers(1, 2))))
                prompts.append([])
        atomic, brief = data.draw(st.booleans()), data.draw(st.booleans())
        if rarely(data, 8):  # refused by validation, before any op runs
            bad_op = data.draw(
                st.sampled_from(
                    [
                        {"op": "extend", "request_id": "a", "num_new_tokens": True},
                        {"op": "extend", "request_id": "a", "num_new_tokens": np.int64(1)},
                        {"op": "rewind", "request_id": 5, "num_tokens": 1},
                        {"op": "jump", "request_id": "a"},
                        {"op": "free"},
                        "free",
                    ]
                )
            )
            ops.insert(data.draw(st.integers(0, len(ops))), bad_op)
            self.attempt(
                "step refused", Outcome(must=(InvalidArgument,)), lambda: m.step(ops, atomic, brief)
            )
            return
        plain = [op if isinstance(op, dict) else op.model_dump() for op in ops]
        twin = copy.deepcopy(m)
        expected = []
        for op in plain:
            expected.append(self.run_alone(twin, op))
            if atomic and not expected[-1][0]:
                break
        failed = atomic and bool(expected) and not expected[-1][0]
        before, memory = self.snapshot(), self.memory()
        results = m.step(ops, atomic=atomic, brief=brief)
        assert len(results) == len(ops)
        assert self.memory() == memory, "a step changed pool bytes"
        if failed:
            event("step: aborted")
            i = len(expected) - 1
            assert self.snapshot() == before, "a failed all-or-nothing step changed the state"
            assert not any(r.ok for r in results)
            assert results[i].error.code == expected[i][1]
            for j, r in enumerate(results):
                if j != i:
                    assert r.error.code == StepAborted.code and r.error.detail["failed_op"] == i
            return
        event(f"step: {'all' if all(r.ok for r in results) else 'not all'} ok")
        for op, r, (ok, code, info) in zip(plain, results, expected, strict=True):
            assert r.ok == ok and (r.error.code if r.error else None) == code, (op, r, code)
            if ok and not (brief and op["op"] == "extend"):
                got = None if r.request is None else r.request.model_dump()
                assert got == info, (op, got, info)
        self.same_as_twin(twin)
        for op, r, prompt in zip(plain, results, prompts, strict=True):
            if r.ok:
                self.apply(op, r, prompt)
        self.fill()

    @staticmethod
    def run_alone(twin: KVCacheManager, op: dict[str, Any]) -> tuple[bool, str | None, Any]:
        """One op of a step on the twin, through the single-op API."""
        kind, rid = op["op"], op["request_id"]
        try:
            if kind == "allocate":
                info = twin.allocate(
                    rid,
                    op["num_tokens"],
                    op.get("token_ids"),
                    op.get("lookahead", 0),
                    op.get("lora_id"),
                    op.get("cache_salt"),
                )
            elif kind == "extend":
                info = twin.extend(rid, op["num_new_tokens"], op.get("lookahead", 0))
            elif kind == "rewind":
                info = twin.rewind(rid, op["num_tokens"])
            elif kind == "commit":
                info = twin.commit(rid, op["token_ids"])
            else:
                twin.free(rid)
                info = None
        except KVCMError as exc:
            return False, exc.code, None
        return True, None, None if info is None else info.model_dump()

    def same_as_twin(self, twin: KVCacheManager) -> None:
        """A step ends where its ops run one by one end, up to which free slot went where
        (a batch of extends takes slots group by group, and releases before it takes)."""
        m = self.m
        assert m.request_ids() == twin.request_ids()
        for r in m.request_ids():
            assert m.request(r) == twin.request(r)
            assert m.committed_tokens(r) == twin.committed_tokens(r)
            mine, theirs = m.block_table(r), twin.block_table(r)
            assert [[s < 0 for s in b] for b in mine] == [[s < 0 for s in b] for b in theirs]
        for pg in range(len(self.sharing)):
            assert m.num_free_blocks(pg) == twin.num_free_blocks(pg)
        a, b = m.stats().prefix_cache, twin.stats().prefix_cache
        assert (a.queries, a.query_tokens, a.hit_tokens) == (
            b.queries,
            b.query_tokens,
            b.hit_tokens,
        )

    def apply(self, op: dict[str, Any], result: Any, prompt: list[int]) -> None:
        """Model of one successful op of a step (allocate: ``prompt`` is its true tokens)."""
        kind, rid = op["op"], op["request_id"]
        if kind == "allocate":
            if rid in self.reqs:  # an identical retry
                return
            tokens = op.get("token_ids")
            info = result.request
            scope = (op.get("lora_id"), op.get("cache_salt"))
            n, la = op["num_tokens"], op.get("lookahead", 0)
            family = next((f for f, fam in enumerate(FAMILIES) if fam[: len(prompt)] == prompt), 0)
            req = Req(
                row=info.row,
                num_tokens=0,
                lookahead=0,
                blocks=0,
                released=[s for _, s in self.windows],
                seq=list(prompt),
                family=family,
                scope=scope,
                mm=(),
                hits=info.num_hit_tokens,
                first=info,
                args=(n, la, tokens, *scope, ()),
                raw={"num_tokens": n, "token_ids": tokens, "lookahead": la}
                | {"lora_id": scope[0], "cache_salt": scope[1]},
            )
            if tokens is not None:
                self.queries += 1
                self.query_tokens += n
                self.hit_tokens += info.num_hit_tokens
                self.check_hit(req, tokens, info.num_hit_tokens)
            else:
                assert info.num_hit_tokens == 0
            req.num_tokens = req.committed = req.written = req.hits
            req.blocks = req.hits // TPB
            self.grown(req, n - req.hits, la)
            self.reqs[rid] = req
        elif kind == "extend":
            self.grown(self.reqs[rid], op["num_new_tokens"], op.get("lookahead", 0))
        elif kind == "rewind":
            self.rewound(self.reqs[rid], op["num_tokens"])
        elif kind == "commit":
            self.committed(self.reqs[rid], len(op["token_ids"]))
        else:
            del self.reqs[rid]

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        m = self.m
        if m is None:
            return
        c = m.parts.coord
        empty = self.empty
        tables = c.tables
        assert np.array_equal(m.page_tables().numpy(), tables)
        assert sorted(m.request_ids()) == sorted(self.reqs)
        rows = {req.row for req in self.reqs.values()}
        assert len(rows) == len(self.reqs) and all(0 <= r < MAX_REQUESTS for r in rows)
        for r in set(range(MAX_REQUESTS)) - rows:
            assert (tables[:, r, :] == empty).all(), "a row of no request holds a page"
        for rid, req in self.reqs.items():
            info = m.request(rid)
            cap = req.num_tokens + req.lookahead
            assert req.num_tokens >= 1 and cap <= MAX_SEQ
            assert (info.row, info.num_tokens, info.capacity) == (req.row, req.num_tokens, cap)
            assert (info.num_committed, info.num_hit_tokens) == (req.committed, req.hits)
            assert m.committed_tokens(rid) == req.seq[: req.committed]
            table = m.block_table(rid)
            for g, (window, sinks) in enumerate(self.windows):
                row = tables[g, req.row]
                assert len(table[g]) == req.blocks >= blocks(cap), (rid, g)
                assert (row[req.blocks :] == empty).all(), "a page past the request's blocks"
                assert table[g] == [s if s > empty else -1 for s in row[: req.blocks].tolist()]
                dead = [p for p, s in enumerate(table[g]) if s < 0]
                rel = req.released[g]
                want = list(range(sinks, rel)) if window is not None and rel > sinks else []
                assert dead == want, ("released run", rid, g, dead, want)
        usable = c.usable_slots()
        for pg, pool in enumerate(c.pools):
            groups = [g for g, p in enumerate(self.group_pool) if p == pg]
            holders = np.zeros(pool.num_slots, dtype=np.int64)
            owners = np.zeros(pool.num_slots, dtype=np.int64)  # holders outside a hit
            for req in self.reqs.values():
                mine = []
                for g in groups:
                    cells = tables[g, req.row, : req.blocks]
                    live = cells > empty
                    np.add.at(holders, cells[live], 1)
                    own = live & (np.arange(req.blocks) >= req.hits // TPB)
                    np.add.at(owners, cells[own], 1)
                    mine += cells[live].tolist()
                assert len(set(mine)) == len(mine), "a request holds a slot twice"
            refs = c.refs[pg]
            assert np.array_equal(holders, refs), "reference counts differ from the tables"
            shared = refs > 1
            assert c.cache.cached[pg][shared].all(), "a slot shared outside the prefix cache"
            assert (owners[shared] <= 1).all(), "a slot shared outside a prefix hit"
            free = pool.free_order()
            assert len(set(free.tolist())) == free.size == m.num_free_blocks(pg)
            assert (refs[free] == 0).all(), "a free slot is in a table"
            held = np.flatnonzero(refs)
            first = pool.num_slots - usable[pg]
            assert free.size + held.size == usable[pg]
            assert set(free.tolist()) | set(held.tolist()) == set(range(first, pool.num_slots))
            if empty == 0:
                assert refs[0] == 0 and 0 not in free
            assert c.cache.num_cached(pg) == int(c.cache.cached[pg].sum())
        assert m.num_free_blocks() == min(
            m.num_free_blocks(pg) // n for pg, n in enumerate(self.sharing)
        )
        st_ = m.stats().prefix_cache
        assert (st_.queries, st_.query_tokens, st_.hit_tokens) == (
            self.queries,
            self.query_tokens,
            self.hit_tokens,
        )
        pools = self.pools()
        if empty == 0:
            for view in pools.values():
                assert not view[0].any(), "the null page is not zero"
        for req in self.reqs.values():
            if not req.written:
                continue
            positions = np.arange(req.written)
            pats = self.patterns(req, req.written)
            for g, pids in enumerate(self.group_pools):
                live, slots = self.cells(req, g, positions)
                for view in (pools[pid] for pid in pids):
                    want = tiled([pats[p] for p in positions[live]], view.shape[3])
                    got = view[slots[live], :, positions[live] % TPB, :]
                    assert (got == want[:, None, :]).all(), "a request's KV was overwritten"


ManagerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVCM_PROPERTY_EXAMPLES", "100")),
    stateful_step_count=int(os.environ.get("KVCM_PROPERTY_STEPS", "40")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # No explain phase: its line tracing makes a failing run's report take minutes more.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
# A pass takes seconds; a failure's shrinking takes minutes (4.5 on the 2-core VM): room for
# it past the suite's per-test timeout, so that a failure is reported, not a timeout.
TestManagerMachine = pytest.mark.timeout(900)(ManagerMachine.TestCase)
