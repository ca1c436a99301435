"""Tables and views: what a kernel reads of one manager's state.

The page tables on the manager's device, page indices and slot mappings of requests, the
pointer tables of the pools, token copies between positions, the views aliasing the pools,
the layout description and the descriptors a consumer of shared pools maps (those two in
``views_layout``). ``KVCacheManager``
owns one and delegates to it; it reads the coordinator's bookkeeping and never changes it (the
device tables apply its edits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import kvcm_kernels
from kvcm_client.errors import CopyIntoSharedBlock, InvalidArgument, UnknownLayer
from kvcm_client.models import (
    ManagerConfig,
    Role,
)

from . import native
from .context_parallel import local_count, local_lengths, local_positions
from .coordinator import Coordinator, segments
from .counts import _count, _counts
from .device_tables import DeviceTables, Uploader
from .ids import LayerId, PoolGroupId
from .layout import BufferPlacement, Layout
from .mapped_items import MappedItems, expand_items, mapped_total
from .pools import PoolMemory
from .views_layout import LayoutDescriptors


@dataclass(frozen=True, slots=True)
class RaggedPages:
    """Requests' pages of one (layer, role) as FlashInfer's paged-KV CSR: int32 tensors on the
    manager's device (``TablesAndViews.ragged_page_indices`` says what each holds).

    Request i's pages are ``indices[indptr[i]:indptr[i + 1]]``; its first ``num_sink_pages[i]``
    are sink pages (blocks 0, 1, ...), the rest start at position ``first_token[i]``, one block
    after another; its last page holds ``last_page_len[i]`` tokens.
    """

    indptr: torch.Tensor  #: ``[n + 1]``, 0 first
    indices: torch.Tensor  #: ``[indptr[-1]]`` kernel-mode page indices
    last_page_len: torch.Tensor  #: ``[n]``, 1..tokens_per_block (0: no page)
    first_token: torch.Tensor  #: ``[n]``, position of the first token of the first window page
    num_sink_pages: torch.Tensor  #: ``[n]``, the sink pages that come first


class TablesAndViews(LayoutDescriptors):
    """The manager's tables and views component (one per manager generation)."""

    #: ``ragged_page_indices``' result (``kvcm.views.RaggedPages``), named here too so that
    #: the methods delegating to this component can name it as ``TablesAndViews.RaggedPages``.
    RaggedPages = RaggedPages

    def __init__(
        self,
        config: ManagerConfig,
        layout: Layout,
        device: torch.device,
        memory: PoolMemory,
        slots: dict[PoolGroupId, int],
        coord: Coordinator,
        tables: DeviceTables,
        rows_of: Callable[[Sequence[str]], np.ndarray],
        cp_rank: int = 0,
    ) -> None:
        """``rows_of`` maps request ids to page-table rows (the manager's, which refuses
        unknown ids). ``cp_rank``: this rank's context-parallel rank; its tables, slot
        mappings and lengths are then of its own pages (``kvcm.context_parallel``)."""
        self.config = config
        self.cp = config.context_parallel
        self.cp_rank = cp_rank
        self.layout = layout
        self.device = device
        self.memory = memory
        self._slots = slots
        self._coord = coord
        self._tables = tables
        self._rows_of = rows_of
        self.tokens_per_block = config.tokens_per_block
        self.max_blocks_per_request = config.max_blocks_per_request
        #: The bound of a slot mapping's ``pad_to`` (the manager's ``max_step_tokens``).
        self.max_step_tokens = config.max_requests * config.max_seq_len
        #: Role index of the pointer tables: ``describe().roles`` order.
        self.role_index = {role: i for i, role in enumerate(layout.roles)}
        #: Slots below this are no page in the kernels' eyes: 0 (-1 only), or 1 (null page).
        self._min_live = coord.empty + 1
        self._upload = None if device.type == "cpu" else Uploader(device, torch.int64)
        self._pointer_table, self._layer_pool_map, self._layer_pointers = self._build_pointers()
        self._copy_pools = [
            kvcm_kernels.TokenCopyPool(
                group=g.group_id,
                memory=memory.tensors[pid],
                bytes_per_buffer=pool.bytes_per_buffer,
                num_buffers=pool.num_buffers,
            )
            for g in layout.layer_groups
            for pool, pid in zip(g.pools, g.physical_pools, strict=True)
        ]

    # -- tables ------------------------------------------------------------------------------

    def page_table(self, layer_group: int) -> torch.Tensor:
        """The int32 ``[max_requests, describe().page_table_width]`` table on the manager's
        device (``max_blocks_per_request`` wide but for context-parallel ranks); -1 where
        there is no page, or 0 (the null page) with ``null_page``."""
        if not 0 <= layer_group < len(self.layout.layer_groups):
            raise InvalidArgument(f"no layer group {layer_group}", layer_group=layer_group)
        return self._tables.sync()[layer_group]

    def page_tables(self) -> torch.Tensor:
        """All layer groups' tables as one int32 ``[groups, max_requests, max_blocks]``."""
        return self._tables.sync()

    def sync_tables(self) -> None:
        """Bring the device tables up to date now (one launch on CUDA; nothing on the CPU).

        Every manager call that reads the tables does this itself; a consumer that reads the
        tables' memory directly calls it once per step.
        """
        self._tables.sync()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        if self._upload is None:
            return torch.from_numpy(array)
        return self._upload(array)

    def placement(self, layer_id: int, role: str) -> BufferPlacement:
        """Where (layer, role) lives; ``UnknownLayer`` for a layer without KV cache (named if
        the layout dropped it), ``InvalidArgument`` for a role the layer lacks."""
        try:
            return self.layout.placements[(LayerId(layer_id), role)]
        except (KeyError, TypeError):
            pass
        layer = self.layout.layers.get(LayerId(layer_id))
        if layer is None:
            reason = self.layout.dropped.get(LayerId(layer_id))
            if reason is not None:
                raise UnknownLayer(
                    f"layer {layer_id} has no KV cache ({reason}); it was dropped from the "
                    "layout (describe().dropped_layers)",
                    layer_id=layer_id,
                    reason=reason,
                )
            raise UnknownLayer(f"unknown layer {layer_id}", layer_id=layer_id)
        raise InvalidArgument(
            f"layer {layer_id} has no role {role!r}; it has {list(layer.roles())}",
            layer_id=layer_id,
            role=str(role),
        )

    def page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: Role = "key",
        mode: Literal["slot", "kernel"] = "slot",
        per_layer: bool = False,
    ) -> torch.Tensor:
        """int32 ``[len(request_ids), describe().page_table_width]`` page indices, -1 = no
        page.

        ``slot``: the slot itself (use with the layer view's page stride). ``kernel``:
        slot x num_buffers / kv_factor of the layer's pool, plus the layer's page offset in the
        slot when ``per_layer`` (the index into the whole pool seen as pages of one layer).
        With ``null_page`` there is no -1: no page is slot 0, whose kernel-mode index is 0, or
        the layer's page offset in per-layer mode, a page inside the zeroed slot 0 either way.
        """
        place = self.placement(layer_id, role)
        if mode not in ("slot", "kernel"):
            raise InvalidArgument(f"mode must be 'slot' or 'kernel', got {mode!r}", mode=mode)
        if per_layer and mode != "kernel":
            raise InvalidArgument("per_layer needs mode='kernel'", mode=mode)
        rows = self._to_device(self._rows_of(request_ids))
        table = self._tables.sync()[place.layer_group]
        if mode == "slot":
            return table.index_select(0, rows)
        return kvcm_kernels.kernel_page_indices(
            table,
            rows,
            place.num_buffers // place.kv_factor,
            place.page_offset if per_layer else 0,
        )

    def ragged_page_indices(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        role: Role = "key",
        per_layer: bool = False,
    ) -> RaggedPages:
        """The requests' pages as FlashInfer's ragged (CSR) paged-KV arrays: ``RaggedPages``
        of int32 tensors on the manager's device.

        - ``indices``: each request's pages in order, the kernel-mode indices of
          ``page_indices(request_ids, layer_id, role, mode="kernel", per_layer=per_layer)`` (so
          a key-only layer and a key/value layer of one pool are in different index spaces):
          that row's entries with a page (not -1, nor the null page) among the blocks that hold
          the request's tokens. Blocks held only for lookahead (past ``ceil(num_tokens /
          tokens_per_block)``) hold no token yet and are left out.
        - ``indptr``: ``[n + 1]``, request i's pages are ``indices[indptr[i]:indptr[i + 1]]``.
        - ``last_page_len``: tokens in each request's last listed page, 1..tokens_per_block
          (FlashInfer's convention); 0 only where a request lists no page (with context
          parallelism, none of its blocks is on this rank: a request has 1 token at least).
        - ``num_sink_pages``: how many of the listed pages are the layer group's sink blocks
          (blocks below ``sink_blocks``; 0 for full attention): they come first.
        - ``first_token``: the position of the first token of the first listed page after the
          sinks; the pages after the sinks are consecutive blocks, so listed page k >=
          ``num_sink_pages`` holds positions from ``first_token + (k - num_sink_pages) *
          tokens_per_block`` on, and page k < ``num_sink_pages`` from ``k * tokens_per_block``.
          0 when there is no such page, and always 0 for full attention (its first page is
          block 0).

        Worked example (tokens_per_block 4; window 8 with 1 sink token, so 1 sink block): a
        request decoded from 16 to 19 tokens; its history 18 released block 1 ((18 + 1 - 8)
        // 4 = 2), so its window group's block table is [a, -1, c, d, e] (blocks 0..4 hold
        its tokens, ceil(19 / 4) = 5): 4 pages, the kernel indices of [a, c, d, e];
        last_page_len 19 - 4 * 4 = 3; num_sink_pages 1 (block 0); first_token 2 * 4 = 8
        (block 2's first token). So its KV positions are 0..3 (the sink) and 8..18. A
        full-attention layer lists all 5 blocks, first_token 0, num_sink_pages 0,
        last_page_len 3.

        With context parallelism (``m.rank(r)``) the pages are this rank's: local entries j,
        global block j * cp + r; ``first_token`` is a global position (r * tokens_per_block
        for full attention on rank r), and page k past the sinks is cp blocks after page
        k - 1.

        Errors are page_indices': ``UnknownLayer``, ``InvalidArgument`` for a role the layer
        lacks, ``UnknownRequest``, ``RequestSuspended``; nothing changes.
        """
        return self.ragged_rows(self._rows_of(request_ids), layer_id, role, per_layer)

    def ragged_rows(
        self, rows: np.ndarray, layer_id: int, role: Role = "key", per_layer: bool = False
    ) -> RaggedPages:
        """``ragged_page_indices`` of page-table rows the caller checked (a step's mapped
        requests, ``step_columns(ragged_layers=...)``)."""
        place = self.placement(layer_id, role)
        group = place.layer_group
        c = self._coord
        lengths = c.num_tokens[rows]
        sinks = self.layout.layer_groups[group].sink_blocks
        n = rows.size
        # Each request's pages from the bookkeeping: blocks [0, min(S, b)) and [max(S,
        # released_end), b) of the b that hold its tokens. Their indptr places the pages on
        # CUDA (no scan, no wait for the device); the CPU reference checks it.
        blocks = -(-lengths // self.tokens_per_block)
        head = np.minimum(sinks, blocks)
        tail = np.maximum(sinks, c.released_end[group][rows])
        rank, cp = self.cp_rank, self.cp
        listed = local_count(head, cp, rank) + np.maximum(
            0, local_count(blocks, cp, rank) - local_count(tail, cp, rank)
        )
        table = self._tables.sync()[group]
        packed = np.zeros(3 * n + 1, dtype=np.int64)  # rows | lengths | indptr
        packed[:n], packed[n : 2 * n] = rows, lengths
        np.cumsum(listed, out=packed[2 * n + 1 :])
        staged = self._to_device(packed)
        return RaggedPages(
            *kvcm_kernels.ragged_page_indices(
                table,
                staged[:n],
                staged[n : 2 * n],
                self.tokens_per_block,
                place.num_buffers // place.kv_factor,
                place.page_offset if per_layer else 0,
                sink_blocks=sinks,
                min_live=self._min_live,
                cp=cp,
                cp_rank=rank,
                total=int(packed[-1]),
                indptr=staged[2 * n :],
            )
        )

    def slot_mapping(
        self,
        request_ids: Sequence[str],
        layer_id: int,
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """int64 ``[pad_to]`` slot mapping of the last ``num_tokens`` positions of each request.

        By default each request maps the tokens added by its latest allocate/extend (the
        tokens computed in this step). Positions in released sliding-window blocks map to -1,
        with the null page too: no token's KV is ever written into the null page. ``pad_to``
        is at most ``max_step_tokens`` (max_requests x max_seq_len).
        """
        group = self.placement(layer_id, "key").layer_group
        return self._slot_mapping(request_ids, num_tokens, pad_to, group)

    def slot_mappings(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """``slot_mapping`` for every layer group at once: int64 ``[groups, pad_to]``."""
        return self._slot_mapping(request_ids, num_tokens, pad_to, None)

    def _slot_mapping(
        self,
        request_ids: Sequence[str],
        num_tokens: int | Sequence[int] | None,
        pad_to: int | None,
        group: int | None,
    ) -> torch.Tensor:
        rows = self._rows_of(request_ids)
        c = self._coord
        length = c.num_tokens[rows]
        if num_tokens is None:
            counts = length - c.history[rows]
        else:
            counts = _counts("num_tokens", num_tokens, rows.size, 0)
            if rows.size and bool((counts > length).any()):
                raise InvalidArgument("num_tokens exceeds a request's length")
        total = int(counts.sum())
        if pad_to is not None and _count("pad_to", pad_to, 0, self.max_step_tokens) < total:
            raise InvalidArgument(f"pad_to={pad_to} is below the {total} tokens", pad_to=pad_to)
        return self.map_tokens((rows, length - counts, counts), pad_to, group)

    def map_tokens(
        self, items: MappedItems, pad_to: int | None = None, group: int | None = None
    ) -> torch.Tensor:
        """The slot mapping of a step's mapped ``items`` (``MappedItems``: explicit
        positions, or a decode batch's handles), item after item: int64 ``[groups,
        pad_to]`` (``[pad_to]`` for one ``group``), ``pad_to`` at least the tokens (default:
        exactly them). The caller checked the rows and ranges. On CUDA one launch also
        applies the table edits pending since the last one (packed and launched by the C
        core where it is built); on the CPU, whose tables are the manager's arrays, one C
        call maps them (numpy without the C core).

        Example (tokens_per_block 4, one group): rows [3, 0], starts [6, 0], counts [1, 2],
        row 3's table [5, 9, ...], row 0's [2, ...]: position 6 of row 3 is slot 9 offset 2
        (38), positions 0 and 1 of row 0 are 8 and 9: [[38, 8, 9]].
        """
        total = mapped_total(items)
        if pad_to is None:
            pad_to = total
        edits = self._tables.take_pending()
        tables = self._tables.tensor
        host = not edits.size and self._tables.on_host  # the manager's own arrays
        if host and self.cp == 1 and native.core is not None:  # one C call
            # (one rank's CPU tables are the coordinator's own arrays)
            return self._map_host(self._coord.tables, items, total, pad_to, group)
        first, groups = group or 0, (len(tables) if group is None else 1)
        if self.cp == 1 and not host and native.core is not None:
            out = self._tables.map_launch(native.core, items, total, edits, pad_to, first, groups)
            if out is not None:
                return out if group is None else out[0]
        rows, starts, counts = expand_items(items)
        n = rows.size
        items_of: np.ndarray | slice = slice(None)
        if total == n and (not n or counts.min() == 1):  # a token each (decode): no segments
            positions = starts
        else:
            items_of, offsets = segments(counts)
            positions = starts[items_of] + offsets
        if self.cp > 1:  # this rank's pages only: other ranks' tokens map to -1
            width = self._tables.tensor.shape[2]
            positions = local_positions(
                positions, self.tokens_per_block, self.cp, self.cp_rank, width
            )
        if host:
            window = tables.numpy()[first : first + groups]
            mapped = kvcm_kernels.slot_mapping_host(
                window, rows[items_of], positions, self.tokens_per_block, pad_to, self._min_live
            )
            return torch.from_numpy(mapped if group is None else mapped[0])
        # rows | query_start_loc | positions | pending table edits in one pinned buffer, read
        # in place by one launch that applies the edits and maps the slots (on CUDA).
        qsl, at = n + 1, 2 * n + 1  # where query_start_loc ends, where positions start
        ends = (n, at, at + total, at + total + edits.size)
        uploader = self._tables.uploader
        size = ends[3]
        packed = np.empty(size, dtype=np.int64) if uploader is None else uploader.reserve(size)
        packed[:n] = rows
        packed[n] = 0
        np.cumsum(counts, out=packed[qsl:at])
        packed[at : ends[2]] = positions
        packed[ends[2] :] = edits.reshape(-1)
        launch = self._tables.launch
        if launch is not None and uploader is not None:
            out = torch.empty((groups, pad_to), dtype=torch.int64, device=tables.device)
            stream = kvcm_kernels.current_stream_handle(launch.index)
            if launch(
                uploader.address,
                n,
                total,
                len(edits),
                self.tokens_per_block,
                first,
                out,
                self._min_live,
                stream,
            ):
                uploader.commit(stream)
                if edits.shape[0]:
                    self._tables.edits_queued()
                return out if group is None else out[0]
        staged = torch.from_numpy(packed) if uploader is None else uploader.staged(size)
        out = kvcm_kernels.apply_edits_and_map_slots(
            tables,
            staged[ends[2] :].view(-1, 4),
            staged[: ends[0]],
            staged[ends[0] : ends[1]],
            staged[ends[1] : ends[2]],
            self.tokens_per_block,
            pad_to,
            first_group=first,
            num_groups=groups,
            min_live=self._min_live,
        )
        if uploader is not None:
            uploader.commit()
        if edits.shape[0]:
            self._tables.edits_queued()
        return out if group is None else out[0]

    def map_tokens_host(self, items: MappedItems) -> torch.Tensor:
        """``map_tokens`` (every group, no padding) from the host's tables, the coordinator's
        bookkeeping that the device tables follow edit for edit: the same values as a host
        tensor, with no device work and no wait (``step_columns(stream_ordered=True)``, on
        one rank without context parallelism)."""
        total = mapped_total(items)
        return self._map_host(self._coord.tables, items, total, total, None)

    def _map_host(
        self,
        tables: np.ndarray,
        items: MappedItems,
        total: int,
        pad_to: int,
        group: int | None,
    ) -> torch.Tensor:
        """The slot mapping of ``map_tokens`` from host ``tables`` (one rank's, not context
        parallel): one C call, or numpy without the C core."""
        window = tables if group is None else tables[group : group + 1]
        if native.core is None:
            rows, starts, counts = expand_items(items)
            items_of, offsets = segments(counts)
            mapped = kvcm_kernels.slot_mapping_host(
                window,
                rows[items_of],
                starts[items_of] + offsets,
                self.tokens_per_block,
                pad_to,
                self._min_live,
            )
            return torch.from_numpy(mapped if group is None else mapped[0])
        mapped = np.empty((len(window), total), dtype=np.int64)
        native.core.map_slots(
            window,
            window.shape[1],
            window.shape[2],
            items,
            self.tokens_per_block,
            self._min_live,
            mapped,
        )
        if pad_to > total:
            mapped = np.concatenate(
                [mapped, np.full((len(window), pad_to - total), -1, np.int64)], axis=1
            )
        return torch.from_numpy(mapped if group is None else mapped[0])

    def copy_tokens(
        self,
        request_ids: Sequence[str],
        src_positions: Sequence[int],
        dst_positions: Sequence[int],
    ) -> None:
        """Copy the KV of token ``src_positions[i]`` to ``dst_positions[i]`` of request i.

        Every layer's key, value and scale entries move: the primitive that relocates the
        accepted path of (tree) speculation onto the positions after the verified prefix. The
        copy is by value, all reads before all writes, so chains (45 -> 44, 46 -> 45), cycles
        (a swap) and repeated sources mean what they say: ``dst[i]`` gets what ``src[i]`` held
        before the call. Destinations must be distinct (two writes to one token would be
        ambiguous).

        Positions must lie in the request's capacity and in blocks it holds in every layer
        group (a sliding window may have released them). A destination may not lie in a block
        other requests share or that the prefix cache publishes, in any layer group
        (``CopyIntoSharedBlock``): that KV is what other requests read, or will get on a hit,
        for the tokens it was computed from. Sources there are fine. All or nothing: on any
        refusal no byte changes.
        """
        if self.cp > 1:
            raise InvalidArgument(
                "copy_tokens does not combine with context parallelism yet (a token's KV "
                "lives on the rank of its block)",
                context_parallel=self.cp,
            )
        rows = self._rows_of(request_ids)
        n = rows.size
        src = _counts("src_positions", src_positions, n, 0)
        dst = _counts("dst_positions", dst_positions, n, 0)
        c = self._coord
        capacity = c.num_tokens[rows] + c.lookahead[rows]
        if n and bool(((src >= capacity) | (dst >= capacity)).any()):
            raise InvalidArgument("a position lies past its request's capacity")
        span = self.config.max_seq_len
        src_keys, dst_keys = rows * span + src, rows * span + dst
        if np.unique(dst_keys).size != n:
            raise InvalidArgument("destinations must be distinct")
        self._held_slots(rows, src)
        self._refuse_shared(request_ids, dst, self._held_slots(rows, dst))
        ops = np.stack([rows, src, dst], axis=1)
        # No destination is read (one launch on CUDA) when no (row, position) is both: equal
        # bytes are equal pairs, since a destination's block is this request's alone.
        disjoint = not bool(np.isin(dst_keys, src_keys).any())
        kvcm_kernels.copy_tokens(
            self._tables.sync(),
            self._to_device(ops),
            self._copy_pools,
            self.tokens_per_block,
            disjoint=disjoint,
            min_live=self._min_live,
        )

    def context_lengths(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32 ``[len(request_ids)]`` tokens of each request this rank's attention reads:
        its length, or with context parallelism the tokens of this rank's blocks (the
        rank's local pages are full but for its last one). Example (cp 2, 4 tokens per
        block): a request of 10 tokens has 6 on CP rank 0 (blocks 0 and 2), 4 on rank 1."""
        rows = self._rows_of(request_ids)
        length = self._coord.num_tokens[rows]
        if self.cp > 1:
            length = local_lengths(length, self.tokens_per_block, self.cp, self.cp_rank)
        return self._to_device(length.astype(np.int64)).to(torch.int32)

    def released_pages(self, request_ids: Sequence[str], layer_id: int) -> torch.Tensor:
        """int32 ``[len(request_ids), 2]``: each request's [start, end) of page-table
        entries of the layer that its sliding window released (no page there: -1, or the
        null page), in this rank's entries. A window's released run is global blocks
        [sink_blocks, released_end); a context-parallel rank r holds of them its local
        entries [ceil((sink_blocks - r) / cp), ceil((released_end - r) / cp)). Full
        attention releases nothing: [0, 0) for sinkless groups, [S, S) otherwise."""
        group = self.placement(layer_id, "key").layer_group
        rows = self._rows_of(request_ids)
        sinks = self.layout.layer_groups[group].sink_blocks
        end = self._coord.released_end[group][rows]
        ranges = np.stack([np.full(rows.size, sinks, dtype=np.int64), end], axis=1)
        if self.cp > 1:
            ranges = local_count(ranges, self.cp, self.cp_rank)
        return self._to_device(ranges.astype(np.int64)).to(torch.int32)

    def _held_slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots ``[layer groups, n]`` of the blocks holding each row's position; refuses a
        position whose block a layer group has released (a sliding window's stale block)."""
        slots = self._coord.tables[:, rows, positions // self.tokens_per_block]
        dead = slots <= self._coord.empty
        if dead.any():
            g = int(np.nonzero(dead)[0][0])
            raise InvalidArgument(
                f"a position lies in a block layer group {g} released", layer_group=g
            )
        return slots

    def _refuse_shared(
        self, request_ids: Sequence[str], dst: np.ndarray, slots: np.ndarray
    ) -> None:
        """Raise ``CopyIntoSharedBlock`` if a destination block (``slots`` per layer group) is
        held by more than one request or published in the prefix cache.

        A published block held only by this request is refused too: its KV is what the next
        hit on its key gets, and only blocks whose tokens are all committed are published, so
        the copy would overwrite committed KV. A scheduler that means it rewinds first (which
        takes a block this request holds alone out of the cache), then copies.
        """
        c = self._coord
        for g in range(slots.shape[0]):
            pg = c.group_pool[g]
            refs = c.refs[pg][slots[g]]
            published = c.cache.cached[pg][slots[g]]
            bad = (refs > 1) | published
            if bad.any():
                i = int(np.argmax(bad))
                why = "other requests share" if refs[i] > 1 else "the prefix cache publishes"
                raise CopyIntoSharedBlock(
                    f"copying into position {int(dst[i])} of {request_ids[i]!r} would "
                    f"overwrite a block {why} (layer group {g})",
                    request_id=str(request_ids[i]),
                    position=int(dst[i]),
                    layer_group=g,
                    holders=int(refs[i]),
                    published=bool(published[i]),
                )

    def _build_pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lay = self.layout
        pointers = torch.zeros((len(lay.pools), 2), dtype=torch.int64)
        for pool in lay.pools:
            base = self.memory.base_address(pool.pool_id)
            pointers[pool.pool_id, 0] = base
            if pool.kv_factor == 2:
                pointers[pool.pool_id, 1] = base + pool.bytes_per_buffer
        pool_map = torch.full((lay.num_layer_ids, len(lay.roles), 2), -1, dtype=torch.int32)
        # The role's column in its page: the value (or value_scale) is the second of a
        # key/value page; every other role is first (extra roles are key-only pages).
        page_role = torch.zeros(len(lay.roles), dtype=torch.int32)
        for (lid, role), place in lay.placements.items():
            r = self.role_index[role]
            pool_map[lid, r, 0] = place.pool
            pool_map[lid, r, 1] = place.page_offset
            page_role[r] = place.buffer_index % place.kv_factor
        page_bytes = torch.tensor(
            [p.kv_factor * p.bytes_per_buffer for p in lay.pools], dtype=torch.int64
        )
        dev = self.device
        pointers, pool_map = pointers.to(dev), pool_map.to(dev)
        return (
            pointers,
            pool_map,
            kvcm_kernels.layer_pointers(pointers, pool_map, page_bytes.to(dev), page_role.to(dev)),
        )

    def pointer_table(self) -> torch.Tensor:
        """int64 ``[num_pools, 2]``: base address per (pool, role in page).

        Column 0 is the first role of a page (key, key_scale or an extra role), column 1 the
        second (value or value_scale; 0 for key-only pools). The page of (layer, role, slot)
        starts at ``pointer_table[pool, c] + (slot * num_buffers / kv_factor + page_offset) *
        kv_factor * bytes_per_buffer``, with (pool, page_offset) from ``layer_pool_map`` and c
        1 for value and value_scale, else 0.
        Example: pool K0 V0 K1 V1 of 256-byte buffers at base B: layer 1's value in slot 3 is
        at B + 256 + (3 * 2 + 1) * 512 = B + 3840 = B + 3 * 1024 + 3 * 256.
        """
        return self._pointer_table

    def layer_pool_map(self) -> torch.Tensor:
        """int32 ``[max_layer_id + 1, R, 2]``: (pool, page offset) per (layer, role); -1 absent.

        Roles are indexed in ``describe().roles`` order: ``kvcm_client.models.ROLES`` (key,
        value, key_scale, value_scale), then the sorted distinct extra roles of the model.
        """
        return self._layer_pool_map

    def layer_pointer_table(self) -> torch.Tensor:
        """int64 ``[max_layer_id + 1, R]``: address of (layer, role) in slot 0; 0 if absent.

        Slot s of that buffer is at this address + s * slot_bytes of its pool.
        """
        return self._layer_pointers

    # -- memory views ------------------------------------------------------------------------

    def kv_view(self, layer_id: int) -> torch.Tensor:
        """``[num_slots, (kv_factor,) tokens_per_block, heads, head_dim]`` aliasing the pool."""
        self.placement(layer_id, "key")
        return self.memory.kv_view(LayerId(layer_id))

    def layer_view(self, layer_id: int, role: Role) -> torch.Tensor:
        """``[num_slots, tokens_per_block, heads, head_dim]`` (scales: ``[..., heads*dim/16]``).

        ``role`` is key, value, a scale role or an extra buffer's role (its own heads and dims).
        """
        self.placement(layer_id, role)
        return self.memory.layer_view(LayerId(layer_id), role)
