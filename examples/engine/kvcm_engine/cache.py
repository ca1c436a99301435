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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    attachment's ``layer_view``); ``states``: the recurrent layers' states, for a hybrid;
    ``state_ids``: the kvcm state layer of each of the model's recurrent layers, by the
    model's layer index (default: the same id; Falcon-H1's mixer of layer i is kvcm's state
    layer ``num_hidden_layers + i``, its attention keeping id i).
    """

    def __init__(
        self,
        view: Callable[[int, str], torch.Tensor],
        layers: dict[int, LayerInfo],
        tables: StepTables,
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
        """Store ``[R, heads, Q, dim]`` new keys and values; return ``[R, heads, L, dim]``."""
        info = self._layers[layer_idx]
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
