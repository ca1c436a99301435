"""A decode step's frame seen again: the step channel's way past parsing for the frame an
engine sends every forward pass (docs/step-channel.md#a-decode-step-seen-again).

An engine's decode steps differ only in their handles: the client packs every such frame
from the same msgpack pieces around the handles' bytes (``kvcm_client.step_channel.
DecodeFrames``). The service keeps the last decode step's frame cut the same way, around the
one place its handles' bytes sit, and a frame of the same length with the same bytes before
and after that place is the same map with other handles: msgpack reads the bytes before
them as it did, the ``bin`` header that is part of them gives the handles the same length,
and the bytes after them as it did. Such a frame skips the unpacking and the checks whose
answer its bytes fix (its keys, op, args, flags and counts); what depends on the service's
state (the pinned generation, the token, the step itself) runs as for any frame.

Nothing is trusted that the bytes do not prove: the cut is learnt from a frame the service
parsed itself, and only where the handles' bytes occur once in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcm_client.step_channel import bin_header


@dataclass(frozen=True, slots=True)
class RepeatFrame:
    """A parsed decode step's frame cut around its handles' bytes.

    Example: a frame whose body is ``P + b"\\xc4\\x10" + H + S`` (``H``: two int64 handles,
    16 bytes, after msgpack's bin-8 header) has ``prefix = P + b"\\xc4\\x10"``, ``at =
    len(prefix)``, ``count = 16``, ``suffix = S``; a body ``prefix + H2 + suffix`` with
    ``len(H2) == 16`` fits it, and its handles are ``body[at : at + 16]``."""

    prefix: bytes
    suffix: bytes
    at: int
    count: int
    size: int
    #: The learnt frame's parsed map (a fitting frame's is this with its own handles).
    message: dict[str, Any]
    #: Its decode step's arguments but the handles, as ``ServiceState.decode_step`` takes
    #: them: (num_new_tokens, lookahead, (map_slots, table_edits, stream_ordered), session),
    #: each as it came (a fitting frame's bytes fix them all).
    call: tuple[Any, Any, tuple[Any, Any, Any], Any]

    @classmethod
    def learn(cls, body: bytes, message: dict[str, Any]) -> RepeatFrame | None:
        """The cut of ``body``, whose parsed map is ``message`` with ``args["extend"]`` as
        bytes; None where the handles' bytes with their bin header occur more than once
        (or not at all) in it, so the place cannot be told from the bytes."""
        handles = message["args"]["extend"]
        n = len(handles)
        kind = bin_header(n)
        field = kind + handles
        start = body.find(field)
        if start < 0 or body.find(field, start + 1) >= 0:
            return None
        at = start + len(kind)
        call = (*decode_args(message["args"]), message.get("session"))
        return cls(body[:at], body[at + n :], at, n, len(body), message, call)

    def fits(self, body: bytes) -> bool:
        """Whether ``body`` is the learnt frame with other handles' bytes."""
        return (
            len(body) == self.size and body.startswith(self.prefix) and body.endswith(self.suffix)
        )

    def handles(self, body: bytes) -> bytes:
        """A fitting body's handles' bytes (a copy: aligned, as msgpack's are)."""
        return body[self.at : self.at + self.count]


def decode_args(args: dict[str, Any]) -> tuple[Any, Any, tuple[Any, Any, Any]]:
    """A decode step's counts and flags as its frame's args give them, defaults filled in
    (``step_columns``' own): (num_new_tokens, lookahead, (map_slots, table_edits,
    stream_ordered)), unchecked. The step channel reads a decode frame's args so, and the
    learnt frame keeps them so (``RepeatFrame.call``)."""
    get = args.get
    flags = (get("map_slots", False), get("table_edits", False), get("stream_ordered", False))
    return get("num_new_tokens", 1), get("lookahead", 0), flags
