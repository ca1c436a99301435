"""Block keys for prefix reuse: a SHA-256 chain over token blocks, seeded by the extra keys.

The key of block i is ``SHA-256(key of block i-1 || its token ids as int32 LE || multimodal
tags)``; block 0's parent is the root ``SHA-256("kvcm/v1/root" || extra keys)``. The parent
(32 bytes) and the tokens (4 x tokens_per_block bytes) have fixed sizes, so the input needs no
separators; each multimodal tag starts with ``"M"``.
Extra keys are type-tagged so that no two different values encode alike: LoRA id ``"Li"`` +
int64 or ``"Ls"`` + length + UTF-8, cache salt ``"S"`` + length + UTF-8. Different salts or
LoRA ids give different roots, so they never share a block. A multimodal item (an image's
placeholder tokens, ``start`` and ``length`` in the prompt) tags every block it overlaps with
``"M"`` + its digest + its start relative to the block (negative when it began in an earlier
block), so the same tokens with different images, or the same image at another offset, give
different keys.

Keys depend on nothing but these bytes: they are equal across processes, restarts and
machines, so a router can compute them with ``block_keys`` and match the KV events a kvcm
publishes. Only full blocks have keys.

Worked example (tokens_per_block 2): tokens [5, 6, 7] have one full block; its key is
``sha256(root + (5).to_bytes(4, "little") + (6).to_bytes(4, "little"))``; token 7 is not
part of any key until the block is full.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import numpy as np

from kvcm_client.errors import InvalidArgument

from . import native

KEY_BYTES = 32
_ROOT_TAG = b"kvcm/v1/root"


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """A multimodal input occupying prompt positions [start, start + length)."""

    digest: str
    start: int
    length: int


def _text(tag: bytes, value: str) -> bytes:
    data = value.encode()
    return tag + struct.pack("<I", len(data)) + data


def root_key(lora_id: int | str | None = None, cache_salt: str | None = None) -> bytes:
    """The parent of block 0 for these extra keys."""
    if lora_id is None and cache_salt is None:
        return _PLAIN_ROOT  # most requests: no hash needed
    seed = bytearray(_ROOT_TAG)
    if lora_id is not None:
        if isinstance(lora_id, bool) or not isinstance(lora_id, int | str):
            raise InvalidArgument("lora_id must be an int, a str or None", lora_id=None)
        if isinstance(lora_id, int) and not -(2**63) <= lora_id < 2**63:
            raise InvalidArgument("an int lora_id must fit in 64 bits (signed)", lora_id=None)
        seed += (
            b"Li" + struct.pack("<q", lora_id)
            if isinstance(lora_id, int)
            else _text(b"Ls", lora_id)
        )
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise InvalidArgument("cache_salt must be a str or None", cache_salt=None)
        seed += _text(b"S", cache_salt)
    return sha256(bytes(seed)).digest()


#: The root of requests without a LoRA or a salt.
_PLAIN_ROOT = sha256(_ROOT_TAG).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes, refusing what is not an int in [0, 2**31).

    One C-level pass (``struct.pack``): prompts are thousands of tokens, and a Python loop
    over them would cost more than everything else an allocate does.
    """
    core = native.core
    if core is not None:
        packed = core.pack_tokens(token_ids)  # None: not a list of ids in range; see below
        if packed is not None:
            return packed
    if isinstance(token_ids, str | bytes):
        raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
    try:
        data = struct.pack(f"<{len(token_ids)}i", *token_ids)
    except (struct.error, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"token ids must be ints in [0, 2**31): {exc}") from None
    if data:
        # A decode-time commit has a few ids: min() beats a numpy call there.
        short = len(token_ids) <= 64 and type(token_ids) is list
        low = min(token_ids) if short else int(np.frombuffer(data, dtype="<i4").min())
        if low < 0:
            raise InvalidArgument("token ids must be >= 0")
    return data


def token_data(value: Any) -> bytes:
    """Validated token ids as int32 bytes, for any sequence or array (``token_bytes``): what
    a commit keeps (it makes no int per token)."""
    if type(value) is not list and not isinstance(value, Sequence | np.ndarray):
        raise InvalidArgument("token_ids must be a sequence of ints", token_ids=None)
    return token_bytes(value)


def token_ids_of(value: Any) -> tuple[list[int], bytes]:
    """Validated token ids as plain ints and as the int32 bytes block keys hash.

    Python counts a bool as an int, and so does this check; the wire refuses bools.
    """
    data = token_data(value)
    return np.frombuffer(data, dtype="<i4").tolist(), data


def _multimodal_tags(
    items: Sequence[MultimodalItem], num_blocks: int, tokens_per_block: int
) -> dict[int, bytes]:
    tags: dict[int, bytearray] = {}
    for item in items:
        first = item.start // tokens_per_block
        last = min((item.start + item.length - 1) // tokens_per_block, num_blocks - 1)
        for b in range(first, last + 1):
            offset = item.start - b * tokens_per_block
            tags.setdefault(b, bytearray()).extend(
                _text(b"M", item.digest) + struct.pack("<i", offset)
            )
    return {b: bytes(t) for b, t in tags.items()}


def chain_keys(
    parent: bytes,
    tokens: bytes,
    tokens_per_block: int,
    first_block: int = 0,
    multimodal: Sequence[MultimodalItem] = (),
) -> list[bytes]:
    """Keys of the full blocks in ``tokens`` (int32 bytes starting at block ``first_block``).

    ``parent`` is the key of block ``first_block - 1`` (the root for block 0); multimodal
    items are in prompt positions.
    """
    step = 4 * tokens_per_block
    core = native.core
    if core is not None and core.HAVE_SHA_EXTENSIONS and not multimodal:
        return core.sha256_chain(parent, tokens, step)
    count = len(tokens) // step
    tags = _multimodal_tags(multimodal, first_block + count, tokens_per_block) if multimodal else {}
    blocks = [tokens[i : i + step] for i in range(0, count * step, step)]
    for b, tag in tags.items():
        if first_block <= b < first_block + count:
            blocks[b - first_block] += tag
    # The hot loop of prefix reuse: SHA-256 itself is about half of it (bytes slices made up
    # front and local names keep the rest small).
    keys: list[bytes] = []
    append, digest = keys.append, sha256
    for block in blocks:
        parent = digest(parent + block).digest()
        append(parent)
    return keys


def block_keys(
    token_ids: Sequence[int],
    tokens_per_block: int,
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
    multimodal: Sequence[MultimodalItem | dict[str, object]] | None = None,
) -> list[bytes]:
    """The 32-byte key of every full block of ``token_ids``, in order (public: for routers)."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise InvalidArgument("tokens_per_block must be an int")
    if tokens_per_block < 1:
        raise InvalidArgument("tokens_per_block must be >= 1")
    return chain_keys(
        root_key(lora_id, cache_salt),
        token_bytes(token_ids),
        tokens_per_block,
        multimodal=multimodal_items(multimodal),
    )


def multimodal_items(
    items: Sequence[MultimodalItem | dict[str, object] | object] | None,
) -> tuple[MultimodalItem, ...]:
    """Items as ``MultimodalItem``: from themselves, dicts, or objects with the same fields
    (the wire model ``MultimodalInput``).

    Every item is checked here, where a request gets them, not when its blocks are hashed:
    a request allocated without token ids keeps its items for its later commits, and an item
    refused only then would make every one of them fail.
    """
    if items is None:
        return ()
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidArgument("multimodal must be a list of items", multimodal=None)
    out = []
    for item in items:
        try:
            if isinstance(item, dict):
                digest, start, length = item["digest"], item["start"], item["length"]
            else:
                digest, start, length = item.digest, item.start, item.length  # type: ignore[attr-defined]
        except (KeyError, TypeError, AttributeError):
            raise InvalidArgument("multimodal items need digest, start and length") from None
        if not isinstance(digest, str) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (start, length)
        ):
            raise InvalidArgument("multimodal digest must be a str, start and length ints")
        if start < 0 or length <= 0:
            raise InvalidArgument(
                "a multimodal item needs start >= 0 and length > 0", start=start, length=length
            )
        out.append(MultimodalItem(digest, start, length))  # type: ignore[arg-type]
    return tuple(out)
