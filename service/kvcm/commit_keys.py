"""Block keys of a commit, reusing the keys ``allocate`` computed for the prompt.

``allocate`` with ``token_ids`` keys every full block of the prompt (to look up the prefix
cache); the request keeps those keys with the prompt's int32 bytes. Keys a caller gave
(``block_keys``) are never kept: they are untrusted input (a client could pass keys of other
tokens), and even those that hit prove only that the key is cached, not that it is the key of
these tokens; a commit after a rewind below the hit would then publish the request's own
tokens under another prompt's key. Commits of such a request hash their blocks. A commit that
fills blocks with the prompt's own tokens takes the kept keys instead of hashing again.
Block b's kept key is reused only when both hold:

- its parent, the key of block b - 1 of the committed tokens (the root for block 0), is the
  prompt's key of block b - 1: the chain then proves that every earlier committed token is the
  prompt's (a rewind below the prompt followed by other tokens changes the parent for good);
- its committed tokens are the prompt's tokens of block b (one ``bytes`` comparison).

Every other block, and every block past the prompt's full blocks, is hashed from the committed
tokens. So nothing has to be dropped at a rewind: a kept key is only ever used for exactly
the tokens it was computed from.

Worked example (tokens_per_block 4): a prompt of 10 tokens keeps keys k0, k1 (blocks [0, 4)
and [4, 8); tokens 8 and 9 fill no block). A commit of its 10 tokens then 2 generated ones
fills blocks 0..2: k0 and k1 are reused, block 2 (prompt tokens 8, 9 and the 2 generated) is
hashed with parent k1. Had the engine rewound to 5 tokens and committed other tokens 5..7,
block 1's tokens differ from the prompt's: it is hashed, and so is every later block, since
their parent is no longer k1.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import hashing
from .hashing import MultimodalItem


def commit_keys(
    parent: bytes,
    data: bytes,
    first: int,
    tokens_per_block: int,
    multimodal: Sequence[MultimodalItem],
    prompt: bytes,
    prompt_keys: list[bytes],
) -> list[bytes]:
    """Keys of the full blocks of ``data`` (committed token ids as int32 bytes, starting at
    block ``first``, whose parent key is ``parent``), reusing ``prompt_keys`` (the keys of the
    full blocks of ``prompt``, its int32 bytes) where the module doc allows.

    The common case, a commit of prompt tokens, costs one comparison of the committed bytes
    with the prompt's; blocks are compared one by one only when the two differ.
    """
    step = 4 * tokens_per_block
    count = len(data) // step
    limit = min(count, len(prompt_keys) - first)
    same = 0
    # Block 0's parent is the root, which the prompt's keys were made with (kvcm hashed them,
    # or they were found in this scope's cache).
    if limit > 0 and (first == 0 or prompt_keys[first - 1] == parent):
        start = first * step
        if data[: limit * step] == prompt[start : start + limit * step]:
            same = limit
        else:
            view, kept = memoryview(data), memoryview(prompt)[start:]
            while (
                same < limit
                and view[same * step : (same + 1) * step] == kept[same * step : (same + 1) * step]
            ):
                same += 1
    keys = prompt_keys[first : first + same]
    if same < count:
        keys += hashing.chain_keys(
            keys[-1] if same else parent,
            data[same * step : count * step],
            tokens_per_block,
            first + same,
            multimodal,
        )
    return keys
