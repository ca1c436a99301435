"""Commit reuses the block keys allocate computed for the prompt, and hashes only the rest.

Every test checks the exact published keys against ``kvcm.block_keys`` of the committed tokens,
and counts the blocks ``chain_keys`` hashes after allocate.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers import layer, manager

import kvcm.hashing
from kvcm import KVCacheManager, block_keys
from kvcm_client.errors import InvalidArgument, KVCMError, KVEventsDisabled

TPB = 16
PROMPT = list(range(1000, 1066))  # 66 tokens: 4 full blocks and 2 tokens


def m16(**kw: Any) -> KVCacheManager:
    return manager([layer(0)], tokens_per_block=TPB, num_blocks=32, max_seq_len=256, **kw)


def published(m: KVCacheManager) -> list[str]:
    """Keys of every block_stored event, in order (one layer group)."""
    return [k for e in m.events().events if e.kind == "block_stored" for k in e.block_keys]


def hexed(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Blocks ``chain_keys`` hashes from now on (one entry per call; ``block_keys`` in a test
    hashes too, so tests read this before they compute expected keys)."""
    calls: list[int] = []
    real = kvcm.hashing.chain_keys

    def counting(*args: Any, **kwargs: Any) -> list[bytes]:
        keys = real(*args, **kwargs)
        calls.append(len(keys))
        return keys

    monkeypatch.setattr(kvcm.hashing, "chain_keys", counting)
    yield calls


def test_a_commit_of_the_prompt_publishes_its_keys_without_hashing(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    hashed.clear()  # whatever allocate hashed
    m.commit("a", PROMPT)
    assert sum(hashed) == 0
    assert published(m) == hexed(block_keys(PROMPT, TPB))
    # Generated tokens past the prompt are hashed: block 4 holds 2 prompt and 14 new tokens.
    gen = list(range(5000, 5014))
    m.extend("a", 14)
    hashed.clear()
    m.commit("a", gen)
    assert hashed == [1]
    assert published(m) == hexed(block_keys([*PROMPT, *gen], TPB))


def test_chunked_commits_reuse_the_kept_keys(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    hashed.clear()
    for i in range(0, 66, 7):  # chunks that straddle block boundaries
        m.commit("a", PROMPT[i : i + 7])
    assert sum(hashed) == 0
    assert published(m) == hexed(block_keys(PROMPT, TPB))


def test_other_tokens_than_the_prompt_publish_their_own_keys(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    other = [*PROMPT[:40], 7, *PROMPT[41:]]  # block 2 differs, blocks 3 on have its tokens
    hashed.clear()
    m.commit("a", other)
    assert hashed == [2]  # blocks 2 and 3: block 3's parent is not the prompt's
    assert published(m) == hexed(block_keys(other, TPB))
    assert published(m)[:2] == hexed(block_keys(PROMPT, TPB))[:2]


def test_a_rewind_below_the_prompt_then_other_tokens_hashes_them(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    m.commit("a", PROMPT)
    m.rewind("a", 66 - 20)  # 20 tokens left: block 1 and on are taken out of the cache
    other = [9] * 12  # tokens 20..31: block 1 now differs from the prompt's
    m.extend("a", 12)
    hashed.clear()
    m.commit("a", other)
    assert hashed == [1]
    seq = [*PROMPT[:20], *other]
    assert m.committed_tokens("a") == seq
    assert published(m)[-1] == block_keys(seq, TPB)[1].hex()
    # Block 2 gets the prompt's own tokens, but its parent is block 1 of other tokens.
    m.extend("a", 16)
    hashed.clear()
    m.commit("a", PROMPT[32:48])
    assert hashed == [1]
    assert published(m)[-1] == block_keys([*seq, *PROMPT[32:48]], TPB)[2].hex()
    assert published(m)[-1] != block_keys(PROMPT, TPB)[2].hex()


def test_a_rewind_then_the_prompt_again_reuses_the_kept_keys(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    m.commit("a", PROMPT[:40])
    m.rewind("a", 66 - 20)
    m.extend("a", 46)
    hashed.clear()
    m.commit("a", PROMPT[20:])
    assert sum(hashed) == 0
    keys = hexed(block_keys(PROMPT, TPB))
    assert published(m) == [*keys[:2], *keys[1:]]  # block 1 was taken out, then published again


@pytest.mark.parametrize(
    "extras",
    [
        {"lora_id": 7},
        {"lora_id": "adapter"},
        {"cache_salt": "tenant"},
        {"multimodal": [{"digest": "img", "start": 10, "length": 30}]},
        {"lora_id": 3, "cache_salt": "t", "multimodal": [{"digest": "d", "start": 0, "length": 5}]},
    ],
)
def test_extra_keys_are_in_the_kept_keys(hashed: list[int], extras: dict[str, Any]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT, **extras)
    hashed.clear()
    m.commit("a", PROMPT)
    assert sum(hashed) == 0
    assert published(m) == hexed(block_keys(PROMPT, TPB, **extras))
    # Another prompt's blocks past its hit are its own, hashed with the same extras.
    other = [*PROMPT[:33], *[5] * 33]
    assert m.allocate("b", 66, token_ids=other, **extras).num_hit_tokens == 32
    m.commit("b", other[32:])
    assert published(m)[-2:] == hexed(block_keys(other, TPB, **extras))[2:]
    assert published(m)[-2:] != published(m)[2:4]


def test_caller_given_block_keys_are_looked_up_but_never_published(hashed: list[int]) -> None:
    """``block_keys`` save allocate's hashing; past the hit they are the client's word, so the
    commit hashes those blocks itself: another scope's keys sent as this prompt's keys are
    never published (before, a later probe with them hit)."""
    m = m16()
    honest = block_keys(PROMPT, TPB)
    lying = block_keys(PROMPT, TPB, cache_salt="attacker")
    hashed.clear()
    m.allocate("a", 66, token_ids=PROMPT, block_keys=lying)
    m.allocate("b", 66, token_ids=[*PROMPT[:65], 1], block_keys=hexed(honest))  # the wire form
    assert sum(hashed) == 0  # lookups only
    m.commit("a", PROMPT)
    assert published(m) == hexed(honest)
    assert sum(hashed) == len(honest) == 4
    assert m.probe(PROMPT, block_keys=lying) == 0
    assert m.probe(PROMPT) == m.probe(PROMPT, block_keys=honest) == 64


def test_block_keys_of_another_size_are_refused_and_change_nothing() -> None:
    m = m16()
    keys = block_keys(PROMPT, TPB)
    for bad in ([*keys[:3], keys[3][:31]], ["ab", *hexed(keys[1:])], [*keys[:3], 5]):
        with pytest.raises(InvalidArgument, match="32-byte keys"):
            m.allocate("a", 66, token_ids=PROMPT, block_keys=bad)
    assert m.request_ids() == [] and m.num_free_blocks() == 32


def test_a_hit_then_the_rest_of_the_prompt_reuses_the_kept_keys(hashed: list[int]) -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    m.commit("a", PROMPT[:40])  # blocks 0 and 1
    longer = [*PROMPT, *range(1, 31)]  # 96 tokens: 6 blocks
    b = m.allocate("b", 96, token_ids=longer)
    assert b.num_hit_tokens == 32
    hashed.clear()
    m.commit("b", longer[32:])
    assert sum(hashed) == 0
    assert published(m) == hexed(block_keys(longer, TPB))


def test_without_token_ids_at_allocate_commits_hash() -> None:
    m = m16()
    m.allocate("a", 66)
    m.commit("a", PROMPT)
    assert published(m) == hexed(block_keys(PROMPT, TPB))


def test_kv_events_off_records_nothing_and_events_say_so() -> None:
    m = m16(kv_events=False)
    m.allocate("a", 66, token_ids=PROMPT)
    m.commit("a", PROMPT)
    m.free("a")
    assert m.probe(PROMPT) == 64  # blocks are still published, only no event is recorded
    assert m.last_event_seq == 0 and len(m.parts.coord.cache.log.events) == 0
    with pytest.raises(KVEventsDisabled) as err:
        m.events()
    assert err.value.code == "kv_events_disabled" and err.value.status == 409


def test_events_are_built_from_compact_records_only_when_read() -> None:
    m = m16()
    m.allocate("a", 66, token_ids=PROMPT)
    m.commit("a", PROMPT)
    (record,) = m.parts.coord.cache.log.events
    assert record[:4] == (1, "block_stored", 0, block_keys(PROMPT, TPB))
    (event,) = m.events().events
    assert event.token_ids == PROMPT[:64] and event.parent_key is None


def test_commit_many_is_a_loop_of_commit() -> None:
    a, b = m16(), m16()
    prompts = {"x": PROMPT, "y": [*PROMPT[:20], *range(1, 47)], "z": list(range(7, 30))}
    for m in (a, b):
        for rid, prompt in prompts.items():
            m.allocate(rid, len(prompt), token_ids=prompt)
    for rid, prompt in prompts.items():
        a.commit(rid, prompt[:40])
    b.commit_many(list(prompts), [p[:40] for p in prompts.values()])
    assert a.events().events == b.events().events
    for rid in prompts:
        assert a.request(rid) == b.request(rid)
        assert a.committed_tokens(rid) == b.committed_tokens(rid)


@pytest.mark.parametrize(
    ("ids", "tokens", "code"),
    [
        (["x", "nope"], [[1], [1]], "unknown_request"),
        (["x", "x"], [[1], [1]], "invalid_argument"),  # ids must be distinct
        (["x", "y"], [[1]], "invalid_argument"),  # one token list per id
        (["x", "y"], [[1], [-1]], "invalid_argument"),
        (["x", "y"], [[1], "ab"], "invalid_argument"),
        (["x", "y"], [[1], list(range(67))], "invalid_argument"),  # y has 66 tokens
        (["x"], "ab", "invalid_argument"),
    ],
)
def test_a_refused_commit_many_commits_nothing(ids: list[str], tokens: Any, code: str) -> None:
    m = m16()
    m.allocate("x", 66, token_ids=PROMPT)
    m.allocate("y", 66, token_ids=PROMPT)
    with pytest.raises(KVCMError) as err:
        m.commit_many(ids, tokens)
    assert err.value.code == code
    assert m.committed_tokens("x") == m.committed_tokens("y") == []
    assert m.last_event_seq == 0
