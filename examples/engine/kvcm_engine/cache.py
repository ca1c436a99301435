"""A transformers cache object whose storage is kvcm's pools, indexed by kvcm's tables.

transformers' attention modules call ``cache.update(key, value, layer_idx)`` with the step's
new keys and values and attend to whatever it returns. ``KVCMCache.update`` writes the new
ones at kvcm's slot mapping into the layer's pool view and returns the request's history
gathered through kvcm's page table, so the model's own attention code (its projections, RoPE,
softcapping, GQA and MLA up-projection) runs unchanged on kvcm's memory. MLA layers (DeepSeek)
hand the cache their compressed latent and rotary key; kvcm stores the two side by side as
one key-only page (kv_lora_rank + qk_rope_head_dim values), as its layer spec says.

A forward is a padded batch of R requests and Q query columns, left-padded so that every
request's last new token sits in column Q - 1 (the one whose logits pick the next token).
Worked example (tokens_per_block 4, one full-attention group): a request with 6 tokens
cached and 2 new ones in a batch of Q = 3 has queries at columns 1, 2 = positions 6, 7; its
slot mapping from kvcm is [22, 23] (slot 5, offsets 2 and 3), so its keys go to
``view[5, 2]`` and ``view[5, 3]``; its history is positions 0..7, read from page-table row
entries [p // 4] at offsets p % 4: with the row [9, 5, ...] position 6 is ``view[5, 2]``.
A sliding-window group with window W reads positions from ``first_query - W + 1`` on only.

``StepTables.build`` refuses (``CacheMiss``) a step in which the model needs a position whose
page kvcm does not hold: a window released too early or a missing page would otherwise only
show as wrong tokens.

Recurrent layers (a hybrid model's gated delta nets and Mamba mixers) ask the cache for their
conv window and recurrent state (``get_conv_state``, ``get_recurrent_state``) and hand back
the new ones (``update_conv_state``, ``update_recurrent_state``, or in place in a one-token
step). ``StepStates`` gathers the forward's requests' live states from kvcm's state views (their
state slots) before the forward and writes them back after it. kvcm keeps ``kernel - 1`` past
inputs per conv window (transformers' own cache keeps ``kernel``; the oldest one never enters
an output): a forward's causal conv runs over ``[window, new inputs]``, so its outputs for the
new inputs are the ones a dense cache gives, and the window kept is the last ``kernel - 1``
columns of that. Worked example (kernel 4, a request in state slot 2 computing 5 tokens): the
conv input is slot 2's 3 columns then the 5 new ones (8 columns), the conv's last 5 outputs
are the tokens', and slot 2 gets columns 5..7 back.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class CacheMiss(RuntimeError):
    """The model needs a key that kvcm's page table does not point to."""


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """What the cache needs of one layer's kvcm spec."""

    group: int
    kv_factor: int
    window: int | None


@dataclass(frozen=True, slots=True)
class GroupTables:
    """One layer group's reads and writes in a forward.

    ``read_blocks``/``read_offsets`` ``[R, L]``: where history column k of each request lives;
    ``read_keep`` ``[R, L, 1, 1]``: the columns that hold a written key. A masked column still
    enters ``q @ k`` before the additive mask, and the unwritten tail of a block may hold
    anything, NaN included: with the null page the other columns read its zeros (slot 0,
    offset 0) and ``read_keep`` is None; without it they are zeroed after the gather;
    ``write_blocks``/``write_offsets`` ``[N]`` with ``write_rows``/``write_cols``: where each
    of the N new tokens goes (tokens kvcm maps to -1, released by a window, are left out);
    ``mask`` ``[R, 1, Q, L]``: additive (0 = attend, dtype min = masked).
    """

    read_blocks: torch.Tensor
    read_offsets: torch.Tensor
    read_keep: torch.Tensor | None
    write_rows: torch.Tensor
    write_cols: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepTables:
    """Everything a forward reads from kvcm, per layer group."""

    groups: list[GroupTables]

    @staticmethod
    def build(
        page_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        rows: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        windows: Sequence[int | None],
        tokens_per_block: int,
        null_page: bool,
        dtype: torch.dtype,
    ) -> StepTables:
        """Tables for requests at page-table ``rows`` that have ``starts[i]`` tokens cached and
        compute ``counts[i]`` new ones; ``slot_mapping`` ``[groups, sum(counts)]`` is kvcm's
        for those new tokens, request after request; ``windows[g]`` is group g's window."""
        device = page_tables.device
        tpb = tokens_per_block
        r = len(rows)
        q = max(counts)
        start = torch.tensor(starts, device=device)
        count = torch.tensor(counts, device=device)
        end = start + count
        row = torch.tensor(rows, device=device)
        # Query column j of request i is position start + j - (q - count) (left padding).
        col = torch.arange(q, device=device)
        qpos = start[:, None] + col[None, :] - (q - count)[:, None]
        real = qpos >= start[:, None]
        # New token t (flat, request-major) is request req[t] at column cols[t].
        req = torch.repeat_interleave(torch.arange(r, device=device), count)
        first = torch.cumsum(count, 0) - count
        cols = (q - count)[req] + torch.arange(int(count.sum()), device=device) - first[req]
        slot_mapping = slot_mapping.to(device)
        empty = 0 if null_page else -1
        min_value = torch.finfo(dtype).min
        out = []
        for g, window in enumerate(windows):
            lo = torch.zeros_like(start) if window is None else (start - window + 1).clamp(min=0)
            width = int((end - lo).max())
            pos = lo[:, None] + torch.arange(width, device=device)[None, :]  # [R, L]
            valid = pos < end[:, None]
            block = (pos // tpb).clamp(max=page_tables.shape[-1] - 1)
            pages = page_tables[g][row[:, None], block].long()
            held = pages > empty
            allowed = valid[:, None, :] & (pos[:, None, :] <= qpos[:, :, None])
            if window is not None:
                allowed &= qpos[:, :, None] - pos[:, None, :] < window
            allowed &= real[:, :, None]
            missing = allowed & ~held[:, None, :]
            if bool(missing.any()):
                i, _, k = (int(x[0]) for x in missing.nonzero(as_tuple=True))
                raise CacheMiss(
                    f"layer group {g}: position {int(pos[i, k])} of the request in page-table "
                    f"row {rows[i]} is needed but its page-table entry is "
                    f"{int(pages[i, k])}"
                )
            # Padding queries attend to column 0 only, so that no row is all masked (NaN).
            allowed[:, :, 0] |= ~real
            keep = valid & held
            slots = slot_mapping[g]
            new = slots >= 0
            out.append(
                GroupTables(
                    read_blocks=torch.where(keep, pages, 0),
                    read_offsets=torch.where(keep, pos % tpb, 0),
                    read_keep=None if null_page else keep[:, :, None, None],
                    write_rows=req[new],
                    write_cols=cols[new],
                    write_blocks=slots[new] // tpb,
                    write_offsets=slots[new] % tpb,
                    mask=torch.where(allowed, 0.0, min_value).to(dtype)[:, None],
                )
            )
        return StepTables(out)


@dataclass(slots=True)
class PagedTables:
    """What a forward on the paged-attention kernels reads from kvcm (CUDA; see
    ``kvcm_kernels.paged_attention``): no gather tables and no mask, only the kvcm tables as
    they are and one small column per request.

    ``page_tables`` ``[groups, max_requests, max_blocks]`` (kvcm's, read in place);
    ``slot_mapping`` ``[groups, sum(counts)]`` int64 on the device; ``meta`` int32 ``[4, R]``
    (page-table row, cached length, new tokens, first new token in the slot mapping);
    ``windows[g]`` group g's window; ``empty`` the table entry of no page (0 with the null
    page, else -1); ``miss`` int32 ``[groups]``, set by a kernel that needs a position whose
    page is gone (checked after the forward: ``CacheMiss``); ``attended`` the layers whose
    attention ran on the kernel in this forward (a model whose attention bypassed it is an
    error, not wrong tokens).
    """

    page_tables: torch.Tensor
    slot_mapping: torch.Tensor
    meta: torch.Tensor
    windows: Sequence[int | None]
    empty: int
    miss: torch.Tensor
    miss_of: list[torch.Tensor] = field(default_factory=list)
    """``miss[g : g + 1]`` per group (made once per forward, not per layer)."""
    stored: set[int] = field(default_factory=set)
    attended: set[int] = field(default_factory=set)

    @staticmethod
    def build(
        page_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        rows: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        windows: Sequence[int | None],
        null_page: bool,
    ) -> PagedTables:
        """The same arguments as ``StepTables.build`` (less the dtype and block size)."""
        device = page_tables.device
        miss = torch.zeros(len(windows), dtype=torch.int32, device=device)
        return PagedTables(
            page_tables,
            slot_mapping.to(device=device, dtype=torch.int64).contiguous(),
            _kernels().step_meta(list(rows), list(starts), list(counts), device),
            windows,
            0 if null_page else -1,
            miss,
            [miss[g : g + 1] for g in range(len(windows))],
        )


def missing_group(miss: Sequence[int]) -> int | None:
    """The first layer group whose kernel flagged a missing page (``PagedTables.miss`` read
    back): ``[0, 1, 1]`` gives 1."""
    return next((g for g, m in enumerate(miss) if m), None)


#: The paged forward in progress (``KVCMCache.paged_forward``), for the attention function.
_ACTIVE: contextvars.ContextVar[KVCMCache | None] = contextvars.ContextVar(
    "kvcm_paged_forward", default=None
)

#: The name under which the paged attention function is registered with transformers.
ATTENTION = "kvcm_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function ``kvcm_paged``: the layer's attention over kvcm's
    pages (``KVCMCache.attend``) inside an engine's paged forward; transformers' own SDPA
    anywhere else."""
    cache = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    if cache is None or layer is None or not cache.is_paged(layer):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return cache.attend(layer, query, scaling, softcap), None


@functools.cache
def _kernels() -> Any:
    """``kvcm_kernels.paged_attention``, imported at the first paged forward."""
    from kvcm_kernels import paged_attention

    return paged_attention


@functools.cache
def register_attention() -> str:
    """Register ``paged_attention_forward`` with transformers (once); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)
    try:  # masks are passed ready-made; a mask made by the model anyway is SDPA's
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    except (ImportError, KeyError):
        pass
    return ATTENTION


class StepStates:
    """The live states of one forward's requests: per state layer its conv window
    ``[R, conv_dim, kernel - 1]`` and recurrent state, gathered from kvcm's state views at
    the requests' state slots, updated by the forward, written back by ``write_back``.

    ``view(layer_id, buffer)`` is kvcm's state view ``[slots, *shape]`` (the manager's or an
    attachment's ``state_view``); ``buffers[layer_id]`` names the layer's conv buffer, then
    its recurrent one (``kvcm.hf_state``'s order).
    """

    def __init__(
        self,
        view: Callable[[int, str], torch.Tensor],
        buffers: dict[int, tuple[str, str]],
        slots: torch.Tensor,
    ) -> None:
        self._views = {layer: (view(layer, c), view(layer, r)) for layer, (c, r) in buffers.items()}
        self._slots = slots = slots.to(next(iter(self._views.values()))[0].device)
        #: Per layer: [conv window, recurrent state] of the batch (gathered copies).
        self.states = {
            layer: [conv[slots], recurrent[slots]]
            for layer, (conv, recurrent) in self._views.items()
        }

    def write_back(self) -> None:
        """Store every layer's updated states in the requests' state slots."""
        for layer, (conv, recurrent) in self._views.items():
            new_conv, new_recurrent = self.states[layer]
            conv[self._slots] = new_conv.to(conv.dtype)
            recurrent[self._slots] = new_recurrent.to(recurrent.dtype)


class KVCMCache:
    """The ``cache`` argument of a transformers model forward, backed by kvcm.

    ``view(layer_id, role)`` is kvcm's pool view of that layer and role
    ``[num_slots, tokens_per_block, heads, head_dim]`` (the in-process manager's or an
    attachment's ``layer_view``); ``tables``: a ``StepTables`` (the gather path: ``update``
    returns the gathered history, the model's own attention runs on it) or a ``PagedTables``
    (the kernel path: ``update`` stores the new keys and values, and the layer's attention,
    ``paged_attention_forward``, reads the pages in place); ``states``: the recurrent layers'
    states, for a hybrid;
    ``state_ids``: the kvcm state layer of each of the model's recurrent layers, by the
    model's layer index (default: the same id; Falcon-H1's mixer of layer i is kvcm's state
    layer ``num_hidden_layers + i``, its attention keeping id i).
    """

    def __init__(
        self,
        view: Callable[[int, str], torch.Tensor],
        layers: dict[int, LayerInfo],
        tables: StepTables | PagedTables,
        states: StepStates | None = None,
        state_ids: dict[int, int] | None = None,
    ) -> None:
        self._view = view
        self._layers = layers
        self._tables = tables
        self._states = states
        self._state_ids = state_ids or {}

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[R, heads, Q, dim]`` new keys and values; return ``[R, heads, L, dim]``
        (the gather path) or, on the kernel path, the new ones as they are (the attention
        reads the pages)."""
        info = self._layers[layer_idx]
        if self.is_paged(layer_idx):
            p = self._tables
            assert isinstance(p, PagedTables)
            key_view, value_view = self._view(layer_idx, "key"), self._view(layer_idx, "value")
            _kernels().store_kv(
                key_states, value_states, key_view, value_view, p.slot_mapping[info.group], p.meta
            )
            p.stored.add(layer_idx)
            return key_states, value_states
        assert isinstance(self._tables, StepTables)
        t = self._tables.groups[info.group]
        latent = info.kv_factor == 1
        if latent:  # MLA: latent and rotary key side by side in one key-only page
            parts = (key_states.shape[-1], value_states.shape[-1])
            key_states = torch.cat((key_states, value_states), dim=-1)
        roles = ("key",) if latent else ("key", "value")
        history = []
        for role, states in zip(roles, (key_states, value_states), strict=False):
            view = self._view(layer_idx, role)
            new = states.transpose(1, 2)[t.write_rows, t.write_cols]  # [N, heads, dim]
            view[t.write_blocks, t.write_offsets] = new.to(view.dtype)
            read = view[t.read_blocks, t.read_offsets].to(states.dtype)
            if t.read_keep is not None:
                read = torch.where(t.read_keep, read, 0)
            history.append(read.transpose(1, 2))
        if latent:
            return tuple(torch.split(history[0], parts, dim=-1))  # type: ignore[return-value]
        return history[0], history[1]

    # -- the kernel path ---------------------------------------------------------------------

    def is_paged(self, layer_idx: int) -> bool:
        """Whether the layer runs on the paged-attention kernel in this forward (a key/value
        layer in a forward on ``PagedTables``; an MLA latent is gathered)."""
        info = self._layers.get(layer_idx)
        return isinstance(self._tables, PagedTables) and info is not None and info.kv_factor == 2

    def attend(
        self, layer_idx: int, query: torch.Tensor, scale: float | None, softcap: float | None
    ) -> torch.Tensor:
        """The layer's attention ``[R, Q, q_heads, dim]`` for ``query`` ``[R, q_heads, Q,
        dim]`` over its pages (the keys and values ``update`` stored are among them)."""
        p = self._tables
        assert isinstance(p, PagedTables)
        if layer_idx not in p.stored:
            raise RuntimeError(f"layer {layer_idx} attends before its keys were stored")
        info = self._layers[layer_idx]
        g = info.group
        p.attended.add(layer_idx)
        return _kernels().paged_attention(
            query,
            self._view(layer_idx, "key"),
            self._view(layer_idx, "value"),
            p.page_tables[g],
            p.meta,
            scale=scale,
            window=p.windows[g],
            softcap=softcap,
            empty=p.empty,
            miss=p.miss_of[g],
        )

    def paged_forward(self, configs: Sequence[Any]) -> _PagedForward:
        """A context in which the model's attention runs on the kernel: the configs of its
        attention modules name ``kvcm_paged`` (their own implementation comes back after)."""
        return _PagedForward(self, configs)

    # -- recurrent layers (the interface transformers' linear-attention layers call) ------

    def is_recording_past(self, layer_idx: int) -> bool:
        """Never: a recurrent state cannot be cropped back; kvcm's checkpoints go back."""
        return False

    def _state(self, layer_idx: int) -> list[torch.Tensor]:
        assert self._states is not None, "a recurrent layer in a model without state layers"
        return self._states.states[self._state_ids.get(layer_idx, layer_idx)]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        """The batch's conv windows ``[R, conv_dim, kernel - 1]`` (zeros for a new request:
        the zero padding transformers gives a first forward); a one-token step updates them
        in place."""
        return self._state(layer_idx)[0]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._state(layer_idx)[1]

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_: Any
    ) -> torch.Tensor:
        """A multi-token forward's conv input: the window, then the new inputs
        ``[R, conv_dim, Q]``; keeps the last ``kernel - 1`` columns as the new window."""
        state = self._state(layer_idx)
        full = torch.cat([state[0], conv_states.to(state[0].dtype)], dim=-1)
        state[0] = full[..., -state[0].shape[-1] :]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_: Any
    ) -> torch.Tensor:
        self._state(layer_idx)[1] = recurrent_states
        return recurrent_states


class _PagedForward:
    """``KVCMCache.paged_forward``: makes the cache the active one and switches the configs'
    attention implementation to ``kvcm_paged`` for the forward; on a clean exit, every layer
    whose keys were stored must have attended on the kernel."""

    def __init__(self, cache: KVCMCache, configs: Sequence[Any]) -> None:
        self._cache = cache
        self._configs = configs
        self._saved: list[Any] = []
        self._token: contextvars.Token[KVCMCache | None] | None = None

    def __enter__(self) -> KVCMCache:
        name = register_attention()
        self._saved = [c._attn_implementation for c in self._configs]
        for c in self._configs:
            c._attn_implementation = name
        self._token = _ACTIVE.set(self._cache)
        return self._cache

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        assert self._token is not None
        _ACTIVE.reset(self._token)
        for c, saved in zip(self._configs, self._saved, strict=True):
            c._attn_implementation = saved
        p = self._cache._tables
        if exc_type is None and isinstance(p, PagedTables) and p.stored - p.attended:
            raise RuntimeError(
                f"layers {sorted(p.stored - p.attended)} stored keys but their attention did "
                "not run on kvcm's paged-attention function: this model calls its attention "
                "another way; run the engine with attention='gather'"
            )
