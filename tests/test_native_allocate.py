"""A step's allocates in C (``allocate_one``, ``kvcm.allocation.start_op``) against the
Python path: the same results, blocks, rows, handles, committed bytes, prefix states,
retry records, stats and events, under the allocates engines send (prompts that share
prefixes, retries, duplicates, chunked prompts' commits, frees, pools that fill) and the
ones the C core leaves to Python (LoRA, salts, given keys, odd types, bad ids)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import CoreSpy, layer, manager, manager_state, same

from kvcm import KVCacheManager, native
from kvcm.allocation import FirstAllocation
from kvcm.hashing import block_keys, root_key
from kvcm.publish import PrefixState

pytestmark = [
    pytest.mark.skipif(not native.available(), reason="kvcm._native is not built"),
    pytest.mark.usefixtures("restore_native"),
]


def requests_state(m: KVCacheManager) -> list[Any]:
    """The per-request bookkeeping ``manager_state`` leaves out."""
    stats = m.parts.coord.cache.stats
    return [
        dict(m.parts.requests.rows),
        list(m.parts.requests.ids),
        list(m.parts.requests.free_rows),
        m.parts.requests.serial.copy(),
        m.parts.requests.hits.copy(),
        {rid: bytes(t) for rid, t in m.parts.requests.tokens.items()},
        dict(m.parts.requests.prefix),
        dict(m.parts.requests.first),
        (stats.queries, stats.query_tokens, stats.hit_tokens, stats.evictions),
        [{root: dict(keys) for root, keys in index.items()} for index in m.parts.coord.cache.index],
    ]


def test_the_worked_example_of_allocate_one() -> None:
    """allocate.c's example: 9 prompt tokens with 3 lookahead, tokens_per_block 4, an empty
    cache: 2 keys (the chain from the plain root), no hit, 3 blocks, row 0, then a request
    with the same first 8 tokens hits both blocks."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16)
    spy = CoreSpy(m)
    native.core = spy
    prompt = list(range(1, 10))
    out = m.step_columns(
        allocate=[{"request_id": "a", "num_tokens": 9, "token_ids": prompt, "lookahead": 3}]
    )
    first = m.parts.requests.first["a"]
    data = np.array(prompt, dtype="<i4").tobytes()
    assert first == FirstAllocation((9, 3, data, None, None, ()), "a", 0, 1 << 32, 0, -1)
    assert out.handles.tolist() == [1 << 32] and out.allocate_new_blocks.tolist() == [3]
    keys = block_keys(prompt, 4)
    assert m.parts.requests.prefix["a"] == PrefixState(root_key(), None, False, (), [], data, keys)
    assert m.block_table("a") == [[0, 1, 2]] and bytes(m.parts.requests.tokens["a"]) == b""
    m.commit("a", prompt)
    out = m.step_columns(allocate=[{"request_id": "b", "num_tokens": 9, "token_ids": prompt}])
    assert out.hit_tokens.tolist() == [8] and m.block_table("b") == [[0, 1, 3]]
    assert bytes(m.parts.requests.tokens["b"]) == data[:32] and m.parts.requests.committed[1] == 8
    assert m.parts.requests.prefix["b"].keys == keys and m.parts.coord.refs[0][[0, 1]].tolist() == [
        2,
        2,
    ]
    assert spy.results == {"allocate no hit": 1, "allocate hit": 1}
    assert out.infos[0] == m.request("b")


class _Steps:
    """Random step_columns calls, each made from the requests live now: allocates of every
    kind (most of the usual kind), frees, commits of a prompt's next ids or of a token,
    extends; sometimes all or nothing."""

    ODD: tuple[dict[str, Any], ...] = (
        {"lora_id": 7},
        {"cache_salt": "t"},
        {"token_ids": "given keys"},
        {"num_tokens": np.int64(5)},
        {"token_ids": [True, 2, 3, 4, 5]},
        {"token_ids": [1, 2, -3, 4, 5]},
        {"token_ids": [1, 2, 2**31, 4, 5]},
        {"token_ids": (1, 2, 3, 4, 5)},
        {"token_ids": [1, 2, 3]},  # not num_tokens ids
        {"num_tokens": 0},
        {"num_tokens": 10**6},  # past max_seq_len
        {"lookahead": -1},
        {"multimodal": [{"digest": "d", "start": 0, "length": 2}]},
    )

    def __init__(self, seed: int, tpb: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tpb = tpb
        self.prompts = [self.rng.integers(0, 6, 48).tolist() for _ in range(3)]
        self.prompt_of: dict[str, list[int]] = {}
        self.counter = 0

    def allocate(self, live: list[str]) -> dict[str, Any]:
        rng = self.rng
        r = rng.random()
        if live and r < 0.1:  # a retry of a live id (the same arguments or others)
            return {"request_id": live[int(rng.integers(len(live)))], "num_tokens": 5}
        self.counter += 1
        rid = f"r{self.counter}"
        n = int(rng.integers(1, 40))
        op: dict[str, Any] = {"request_id": rid, "num_tokens": n}
        if r < 0.75:
            op["token_ids"] = self.prompts[int(rng.integers(3))][:n]
        if rng.random() < 0.4:
            op["lookahead"] = int(rng.integers(0, 9))
        if rng.random() < 0.12:
            extra = dict(self.ODD[int(rng.integers(len(self.ODD)))])
            if extra.get("token_ids") == "given keys":
                tokens = self.prompts[0][:n]
                extra = {"token_ids": tokens, "block_keys": block_keys(tokens, self.tpb)}
            elif "token_ids" in extra or "multimodal" in extra:
                op["num_tokens"] = 5
            op.update(extra)
        if type(op.get("token_ids")) is list:
            self.prompt_of[rid] = list(op["token_ids"])
        return op

    def step(self, m: KVCacheManager) -> dict[str, Any]:
        rng = self.rng
        live = m.request_ids()
        free = [rid for rid in live if rng.random() < (0.4 if len(live) > 6 else 0.1)]
        rest = [rid for rid in live if rid not in free]
        commit = [rid for rid in rest if rng.random() < 0.3]
        extend = [rid for rid in rest if rid not in commit and rng.random() < 0.5]
        return {
            "allocate": [self.allocate(live) for _ in range(int(rng.integers(0, 4)))],
            "free": free,
            "commit": commit,
            "extend": extend,
            "atomic": bool(rng.random() < 0.1),
        }


def _run(m: KVCacheManager, step: dict[str, Any], prompt_of: dict[str, list[int]]) -> Any:
    """One step by handle (ids resolved on this manager); returns what a caller sees."""
    handle = {rid: info.handle for rid in m.request_ids() for info in [m.request(rid)]}
    commits = [rid for rid in step["commit"] if rid in handle]
    tokens = []
    for rid in commits:
        have = m.request(rid)
        ids = prompt_of.get(rid, [])[have.num_committed : have.num_tokens]
        tokens.append(ids or [have.num_tokens % 5])
    out = m.step_columns(
        free=[handle.get(rid, 0) for rid in step["free"]],
        commit=[handle[rid] for rid in commits],
        commit_tokens=tokens,
        extend=[handle[rid] for rid in step["extend"] if rid in handle],
        allocate=step["allocate"],
        atomic=step["atomic"],
    )
    return (
        {s: a.tolist() for s, a in out.status.items()},
        out.handles.tolist(),
        out.hit_tokens.tolist(),
        out.allocate_new_blocks.tolist(),
        [(e.section, e.index, e.error.code) for e in out.errors],
        out.infos,
        out.allocated_ids,
        out.freed_ids,
    )


@pytest.mark.parametrize(
    ("layers", "kw", "edits"),
    [
        ([layer(0)], {"tokens_per_block": 4, "num_blocks": 48}, False),
        (
            [layer(0), layer(1, owner="draft")],
            {"tokens_per_block": 1, "null_page": True, "num_blocks": 160},
            True,
        ),
        (
            [layer(0), layer(1, owner="draft", head_dim=8)],
            {"tokens_per_block": 3, "num_blocks": 44},
            True,
        ),
        ([layer(0), layer(1, sliding_window=8)], {"tokens_per_block": 4, "num_blocks": 60}, False),
        ([layer(0), layer(1, reuse="none")], {"tokens_per_block": 2, "num_blocks": 90}, True),
    ],
    ids=[
        "one layer group",
        "two layer groups in one pool group, null page, edits",
        "two layer groups in two pool groups, edits",
        "a window: prompts in Python",
        "a group without reuse: prompts in Python, edits",
    ],
)
def test_random_steps_allocate_alike_in_c_and_in_python(
    layers: list[dict[str, Any]], kw: dict[str, Any], edits: bool
) -> None:
    """300 random steps on two managers, the C core on and off: equal outcomes (statuses,
    handles, hits, new blocks, errors, infos) and equal state after each step."""
    ms = {on: manager(layers, max_requests=12, max_seq_len=64, **kw) for on in (True, False)}
    if edits:
        for m in ms.values():
            m.parts.coord.edits = []  # as with a CUDA device
    spy = CoreSpy(ms[True])
    steps = _Steps(11, kw["tokens_per_block"])
    for i in range(300):
        step = steps.step(ms[True])
        got = {}
        for on, m in ms.items():
            native.use(on)
            native.core = spy if on else None
            got[on] = _run(m, step, steps.prompt_of)
        assert got[True] == got[False], i
        assert same(manager_state(ms[True]), manager_state(ms[False])), i
        assert same(requests_state(ms[True]), requests_state(ms[False])), i
    results = spy.results
    assert results["allocate no hit"] > 30 and results["allocate python"] > 20, results
    windowed_or_unreused = any("sliding_window" in spec or "reuse" in spec for spec in layers)
    if windowed_or_unreused:
        assert results["allocate hit"] == 0, results  # prompts are Python's there
        assert results["allocate keyed"] == 0, results
    else:
        assert results["allocate hit"] > 20, results
        assert results["allocate keyed"] > 20, results  # prompts keyed two at a time


def test_allocate_one_leaves_to_python_what_it_does_not_run() -> None:
    """None and nothing changed: a retry or a duplicate id, no free row, a request that
    does not fit, a prompt without the SHA extensions' path; a manager out of shape is an
    error."""
    native.use(True)
    m = manager([layer(0)], num_blocks=6, max_requests=2)
    core = native._built
    from kvcm.allocation import c_args

    fast = c_args(m.parts)
    assert fast is not None
    op = {
        "request_id": "a",
        "num_tokens": 5,
        "token_ids": None,
        "lookahead": 0,
        "lora_id": None,
        "cache_salt": None,
        "multimodal": None,
        "block_keys": None,
    }
    first = core.allocate_one(op, m.parts.requests, *fast)[0]
    assert first.row == 0 and m.request_ids() == ["a"]
    before = manager_state(m), requests_state(m)

    def refused(**change: Any) -> None:
        assert core.allocate_one({**op, **change}, m.parts.requests, *fast) is None, change
        assert same(manager_state(m), before[0]) and same(requests_state(m), before[1])

    refused()  # "a" again: a retry is Python's
    refused(request_id="b", num_tokens=20)  # 5 blocks: 4 free
    refused(request_id="b", token_ids=list(range(5)), num_tokens=5) if not fast[-1] else None
    refused(request_id="b", lookahead=True)
    refused(request_id="", num_tokens=1)
    refused(request_id="x" * 257)
    m.allocate("b", 1)
    before = manager_state(m), requests_state(m)
    refused(request_id="c")  # no free row
    with pytest.raises(ValueError):
        core.allocate_one(op, m.parts.requests, *fast[:5], fast[5], b"short", *fast[7:])


@pytest.mark.parametrize("on", [True, False], ids=["C core", "Python"])
def test_a_row_s_serial_wraps_to_1_after_max_serial(on: bool) -> None:
    """Handles stay below 2**63: a row whose serial is MAX_SERIAL (2**31 - 1 allocations,
    or a large serial base) gives its next request serial 1, on both paths, and that handle
    works; the freed request's handle names nothing."""
    from kvcm.request_table import MAX_SERIAL

    native.use(on)
    m = manager([layer(0)], num_blocks=16, max_requests=2)
    m.parts.requests.serial[:] = MAX_SERIAL - 1
    old = m.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}]).handles[0]
    assert old == MAX_SERIAL << 32 | 0
    m.step_columns(free=[old])
    out = m.step_columns(allocate=[{"request_id": "b", "num_tokens": 5}])
    assert out.ok and out.handles.tolist() == [1 << 32 | 0] and m.parts.requests.serial[0] == 1
    assert m.step_columns(extend=out.handles).ok
    assert m.step_columns(extend=[old]).status["extend"].tolist() != [0]


def test_allocate_one_refuses_a_request_past_max_seq_len_that_its_blocks_would_hold() -> None:
    """tokens_per_block 3, max_seq_len 64: a row holds 22 blocks (66 tokens), so 64 tokens
    with 1 lookahead would fit the table but not max_seq_len: None, and Python names it."""
    native.use(True)
    m = manager([layer(0)], tokens_per_block=3, num_blocks=60, max_seq_len=64)
    from kvcm.allocation import c_args

    op = {"request_id": "a", "num_tokens": 64, "token_ids": None, "lookahead": 1}
    op |= {"lora_id": None, "cache_salt": None, "multimodal": None, "block_keys": None}
    assert native._built.allocate_one(op, m.parts.requests, *c_args(m.parts)) is None
    out = m.step_columns(allocate=[op])
    assert [e.error.code for e in out.errors] == ["sequence_too_long"]
    assert (
        native._built.allocate_one({**op, "lookahead": 0}, m.parts.requests, *c_args(m.parts))
        is not None
    )


def test_allocate_one_changes_nothing_when_a_record_cannot_be_made() -> None:
    """A PrefixState or FirstAllocation that cannot be made (no memory, a class without the
    fields, not a class), after a hit tombstoned free cached slots: the error, the queue,
    refs and records as they were; the next call runs."""
    native.use(True)
    m = manager([layer(0), layer(1, owner="draft", head_dim=8)], num_blocks=16)
    prompt = list(range(9))
    m.allocate("a", 9, token_ids=prompt)
    m.commit("a", prompt)
    m.free("a")  # 2 blocks per group cached and free
    from kvcm.allocation import c_args

    fast = c_args(m.parts)
    op = {"request_id": "b", "num_tokens": 9, "token_ids": prompt, "lookahead": 0}
    op |= {"lora_id": None, "cache_salt": None, "multimodal": None, "block_keys": None}

    class Broken:  # its instances cannot be made (as without memory)
        def __new__(cls, *_: object) -> Any:
            raise MemoryError

    class Fieldless:  # a record missing the fields allocate_one sets
        __slots__ = ()

    def broken(*_: object) -> None:  # not a class at all
        raise MemoryError

    before = manager_state(m), requests_state(m)
    for at in (0, 1):
        for cls, error in ((Broken, MemoryError), (Fieldless, AttributeError), (broken, TypeError)):
            classes = list(fast[5])
            classes[at] = cls
            with pytest.raises(error):
                native._built.allocate_one(
                    op, m.parts.requests, *fast[:5], tuple(classes), *fast[6:]
                )
            assert same(manager_state(m), before[0]) and same(requests_state(m), before[1])
    first, hit, _, _ = native._built.allocate_one(op, m.parts.requests, *fast)
    assert hit == 2 and first.row == m.parts.requests.rows["b"]


@pytest.mark.parametrize("extensions", [True, False], ids=["SHA extensions", "portable"])
def test_two_key_chains_hashed_together_equal_each_alone(extensions: bool) -> None:
    """``sha256_chain2`` against ``sha256_chain`` and hashlib: chains of unequal lengths
    (0 to 9 blocks, a partial block left over), both implementations."""
    import hashlib
    import random

    core = native._built
    rng = random.Random(7)
    try:
        core.use_sha_extensions(extensions)
        for _ in range(200):
            step = rng.choice([4, 16, 64])
            pa, pb = rng.randbytes(32), rng.randbytes(32)
            da = rng.randbytes(step * rng.randint(0, 9) + rng.randint(0, step - 1))
            db = rng.randbytes(step * rng.randint(0, 9) + rng.randint(0, step - 1))
            ka, kb = core.sha256_chain2(pa, da, pb, db, step)
            assert ka == core.sha256_chain(pa, da, step) and kb == core.sha256_chain(pb, db, step)
            key = pb
            for i in range(len(db) // step):
                key = hashlib.sha256(key + db[i * step : (i + 1) * step]).digest()
                assert kb[i] == key
    finally:
        core.use_sha_extensions(True)


def test_prompt_keys_keys_what_allocate_one_would_and_nothing_else() -> None:
    """Per op: the prompt's int32 bytes and its full blocks' keys (chained from the plain
    root), or None where ``allocate_one`` would not key it: no prompt, LoRA, a salt, given
    keys, ids not as long as ``num_tokens``, ids out of int32 (Python names them), a tuple
    of ids, an op that is not a dict. Odd and even numbers of prompts, a prompt shorter than
    a block (no keys)."""
    core = native._built
    root = root_key()
    prompt = list(range(100, 140))

    def op(n: int, **extra: Any) -> dict[str, Any]:
        base = {"request_id": "x", "num_tokens": n, "token_ids": prompt[:n], "lookahead": 0}
        return {**base, **{k: None for k in ("lora_id", "cache_salt", "multimodal")}, **extra}

    ops = [
        op(40),
        op(5, token_ids=None),
        op(9),
        op(9, lora_id=3),
        op(9, cache_salt="s"),
        op(9, block_keys=[b"k" * 32, b"k" * 32]),
        op(9, token_ids=prompt[:8]),
        op(2, token_ids=[1, -1]),
        op(9, token_ids=tuple(prompt[:9])),
        op(3),
        op(16),
    ]
    out = core.prompt_keys([*ops, "not an op"], root, 4)
    kept = [i for i, got in enumerate(out) if got is not None]
    assert kept == [0, 2, 9, 10]
    for i in kept:
        ids = ops[i]["token_ids"]
        data = np.array(ids, dtype="<i4").tobytes()
        assert out[i] == (data, block_keys(ids, 4)) and out[i][1] == core.sha256_chain(
            root, data, 16
        )
    assert out[9][1] == []  # 3 tokens: no full block
    for n in (1, 2, 3):  # one prompt alone, a pair, a pair and one alone
        got = core.prompt_keys([op(40), op(12), op(20)][:n], root, 4)
        assert [g[1] for g in got] == [block_keys(prompt[:k], 4) for k in (40, 12, 20)][:n]
    with pytest.raises(ValueError):
        core.prompt_keys([op(4)], b"short", 4)


def test_allocate_one_refuses_keys_that_are_not_this_prompt_s() -> None:
    """``keyed`` of another length (bytes or keys) is a caller's bug: a ValueError, and
    nothing changed; the right ones allocate as without them."""
    native.use(True)
    m = manager([layer(0)], num_blocks=16)
    from kvcm import allocation

    fast = allocation.c_args(m.parts)
    prompt = list(range(1, 10))
    op = {"request_id": "a", "num_tokens": 9, "token_ids": prompt, "lookahead": 0}
    op |= {k: None for k in ("lora_id", "cache_salt", "multimodal", "block_keys")}
    good = native._built.prompt_keys([op], root_key(), 4)[0]
    before = requests_state(m)
    for bad in ((good[0][:-4], good[1]), (good[0], good[1][:1]), good[1], (good[0],)):
        with pytest.raises(ValueError, match="keyed"):
            native._built.allocate_one(op, m.parts.requests, *fast, bad)
        assert same(requests_state(m), before)
    first = native._built.allocate_one(op, m.parts.requests, *fast, good)[0]
    assert (
        m.parts.requests.prefix["a"].prompt_keys == block_keys(prompt, 4)
        and first.handle == 1 << 32
    )


#: What ``_survives`` runs first: a manager ``m`` with the C core, ``fast``: its
#: ``allocate_one`` arguments, ``root_key``.
_CHILD_SETUP = """
from kvcm import KVCacheManager, allocation, native
from kvcm.hashing import root_key
native.use(True)
m = KVCacheManager({"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
                    "tokens_per_block": 4, "num_blocks": 64, "max_requests": 4,
                    "max_seq_len": 64})
fast = allocation.c_args(m.parts)
"""


def _survives(code: str) -> None:
    """``_CHILD_SETUP``, then ``code``, in an interpreter of its own (a crash must not take
    the tests down): it exits 0 and prints "survived"."""
    import subprocess
    import sys
    import textwrap

    program = _CHILD_SETUP + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr)


def test_allocate_one_refuses_a_class_without_instances() -> None:
    """A type Python cannot instantiate (no ``tp_new``: a list iterator) as a record class:
    a TypeError, not a crash."""
    _survives(
        """
        op = {"request_id": "c", "num_tokens": 9, "token_ids": list(range(9)), "lookahead": 0,
              "lora_id": None, "cache_salt": None, "multimodal": None, "block_keys": None}
        for at in (0, 1):
            classes = list(fast[5])
            classes[at] = type(iter([]))
            try:
                table = m.parts.requests
                native._built.allocate_one(op, table, *fast[:5], tuple(classes), *fast[6:])
            except TypeError:
                pass
            else:
                raise SystemExit("no TypeError")
        assert m.request_ids() == []
        print("survived")
        """
    )


def test_prompt_keys_survives_its_ops_list_changing_under_it() -> None:
    """An op whose key lookup runs Python code (a key's ``__eq__`` on a hash collision) that
    empties the list ``prompt_keys`` was given: it works on a snapshot, no crash."""
    _survives(
        """
        ops = []
        class Evil:
            def __hash__(self):
                return hash("token_ids")
            def __eq__(self, other):
                ops.clear()
                return False
        def op(n):
            return {"request_id": "x", "num_tokens": n, "token_ids": list(range(n)),
                    "lookahead": 0, "lora_id": None, "cache_salt": None, "multimodal": None,
                    "block_keys": None}
        ops.extend([op(40), {Evil(): 1}] + [op(40) for _ in range(50)])
        out = native._built.prompt_keys(ops, root_key(), 4)
        assert len(out) == 52 and out[1] is None and len(out[2][1]) == 10
        print("survived")
        """
    )


def test_a_failing_prompt_keys_leaves_each_allocate_its_own_keys() -> None:
    """``prompt_keys`` failing (as without memory) does not escape the step, whose frees
    have run: each allocate keys its own prompt, and the step answers as without it."""
    from kvcm import allocation

    class FailingPromptKeys:
        def __init__(self, core: Any) -> None:
            self._core = core

        def __getattr__(self, name: str) -> Any:
            return getattr(self._core, name)

        def prompt_keys(self, *args: Any) -> Any:
            raise MemoryError

    def op(rid: str, n: int) -> dict[str, Any]:
        return {"request_id": rid, "num_tokens": n, "token_ids": list(range(1, n + 1))}

    native.use(True)
    m = manager([layer(0)], num_blocks=64)
    assert allocation.c_args(m.parts) is not None and allocation.c_args(m.parts)[-1]  # prompts in C
    (h,) = m.step_columns(allocate=[op("a", 5)]).handles.tolist()
    native.core = FailingPromptKeys(native._built)
    out = m.step_columns(free=[h], allocate=[op("b", 9), op("c", 9)])
    assert out.ok and out.status["free"].tolist() == [0] and out.allocated_ids == ["b", "c"]
    assert m.parts.requests.prefix["c"].prompt_keys == block_keys(list(range(1, 10)), 4)


def test_allocate_one_and_prompt_keys_hold_an_op_s_values_across_its_lookups() -> None:
    """A key whose ``__eq__`` (a hash collision with "lora_id", looked up after the request
    id, counts and prompt) drops the op's values: both hold what they looked up, no crash,
    and nothing packs a list that took the freed one's place."""
    _survives(
        """
        keep = []
        class Evil:
            def __hash__(self):
                return hash("lora_id")
            def __eq__(self, other):
                op["request_id"] = None
                op["token_ids"] = None
                keep.append([7] * 8)  # a new list may take the freed one's memory
                return False
        op = {"request_id": "".join(["req", "-x"]), "num_tokens": 8,
              "token_ids": list(range(8)), "lookahead": 0, Evil(): 0}
        (got,) = native._built.prompt_keys([op], root_key(), 4)
        mine = b"".join(i.to_bytes(4, "little") for i in range(8))
        assert got is None or got[0] == mine, got
        op = {"request_id": "".join(["req", "-y"]), "num_tokens": 9,
              "token_ids": list(range(9)), "lookahead": 0, Evil(): 0}
        try:
            native._built.allocate_one(op, m.parts.requests, *fast)
        except Exception:
            pass
        print("survived")
        """
    )
