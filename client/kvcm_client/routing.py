"""Wire models of ``kvcm router`` (docs/router.md): a prompt in, each sidecar's score out.

The router keeps one prefix index for many sidecars of one model and answers, for a prompt,
how much of it each sidecar holds. A score counts blocks the way the sidecar's own ``probe``
does (``hit_blocks``: device or host; ``device_hit_blocks``: the device alone), so the best
sidecar is the one whose ``allocate`` would reuse the most. ``groups`` breaks it down per
layer group: the run of the prompt's blocks from block 0 that the group holds on the device,
and how many more it holds on the device or the host after that run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Strict, model_validator

from .models import Count, MultimodalInput
from .specs import _Frozen


class RouteRequest(_Frozen):
    """A prompt: ``token_ids`` (hashed by the router with ``lora_id``, ``cache_salt`` and
    ``multimodal``, exactly as the sidecars hash them) or ``block_keys`` (hex, computed by
    the caller with ``kvcm.block_keys``: they already hold the LoRA id and salt)."""

    token_ids: list[Count] | None = None
    block_keys: list[str] | None = None
    lora_id: Annotated[int, Strict()] | Annotated[str, Strict()] | None = None
    cache_salt: Annotated[str, Strict()] | None = None
    multimodal: list[MultimodalInput] | None = None
    fetch_plan: Annotated[bool, Strict()] = False
    """Also answer ``plan``: the least loaded sidecar, and what it should fetch from the one
    that holds the longest prefix (docs/disaggregation.md)."""

    @model_validator(mode="after")
    def _one_prompt(self) -> RouteRequest:
        if (self.token_ids is None) == (self.block_keys is None):
            raise ValueError("give exactly one of token_ids and block_keys")
        extras = (self.lora_id, self.cache_salt, self.multimodal)
        if self.block_keys is not None and any(x is not None for x in extras):
            raise ValueError(
                "lora_id, cache_salt and multimodal go with token_ids: block keys hold them"
            )
        return self


class GroupHit(_Frozen):
    """One layer group of one sidecar: ``device_blocks`` is the run of the prompt's blocks
    from block 0 it holds on the device; ``host_blocks`` how many follow that run on the
    device or the host tier (what onboarding would bring back)."""

    layer_group: int
    device_blocks: int
    host_blocks: int


class SidecarScore(_Frozen):
    """What one sidecar holds of the prompt, and its load.

    ``hit_blocks``: the longest prefix whose needed blocks every layer group holds on the
    device or the host (a sliding-window group needs only its sinks and last blocks), at
    most the blocks a request reuses (``num_blocks``); ``device_hit_blocks``: the same on
    the device alone (what ``probe`` answers, in blocks). ``free_blocks`` (what one new
    request can get) and ``running_requests`` come from the sidecar's ``/v1/stats``, at most
    a poll interval old; None before the first answer."""

    sidecar: str
    url: str
    generation: str
    hit_blocks: int
    device_hit_blocks: int
    hit_tokens: int
    groups: list[GroupHit]
    free_blocks: int | None
    running_requests: int | None


class FetchPlan(_Frozen):
    """Where to run a request by load, and what to fetch first.

    ``run_on`` is the least loaded sidecar (fewest running requests, then most free
    blocks, then by name); ``fetch_from`` the one holding the longest prefix on its device,
    when it holds more than ``run_on`` does (else None and ``fetch_blocks`` 0). The
    scheduler then calls ``fetch(..., peer=fetch_from)`` on ``run_on`` (whose ``--peer``
    list must name it alike). Example: a holds 10 blocks and runs 8 requests, b holds 2 and
    runs 1: run on b, fetch 8 blocks from a."""

    run_on: str
    run_on_url: str
    fetch_from: str | None
    fetch_from_url: str | None
    fetch_blocks: int
    hit_blocks: int
    """Blocks ``run_on`` reuses once the fetch is done (its own hit, or the peer's)."""


class RouteResult(_Frozen):
    """Scores of the sidecars the router follows, best first: more ``hit_blocks``, then
    more ``device_hit_blocks``, fewer ``running_requests``, more ``free_blocks``, then by
    name. ``num_blocks``: how many of the prompt's blocks a request could reuse (all full
    blocks but one that holds the last token, given token ids)."""

    tokens_per_block: int
    num_blocks: int
    scores: list[SidecarScore]
    plan: FetchPlan | None = None
    """With ``fetch_plan``: where to run and what to fetch (None without a sidecar whose
    load is known)."""


SidecarState = Literal["connecting", "syncing", "following", "refused", "unreachable"]


class SidecarStatus(_Frozen):
    """How the router follows one sidecar. ``state``: ``connecting`` (no answer yet),
    ``syncing`` (loading a snapshot), ``following`` (in the index, scored), ``refused``
    (another model: ``error`` says why), ``unreachable`` (``error`` holds the last
    failure; it was following before if ``generation`` is set)."""

    name: str
    url: str
    state: SidecarState
    generation: str | None = None
    last_seq: int | None = None
    snapshots: int = 0
    error: str | None = None
    free_blocks: int | None = None
    running_requests: int | None = None


class Sidecars(_Frozen):
    sidecars: list[SidecarStatus]
