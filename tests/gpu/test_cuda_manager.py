"""The manager on cuda:0 gives the same tables, indices and views as on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_copy_ops

from kvcm import KVCacheManager, OutOfBlocks, RequestLimitReached, native
from kvcm_client.errors import CopyIntoSharedBlock

LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "sliding_window": 12, "sink_tokens": 3},
    {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8},
    {
        "layer_id": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "kv_factor": 1,
        "extra_buffers": [
            {"role": "index_key", "num_heads": 1, "head_dim": 8, "dtype": "fp8_e4m3"}
        ],
    },
    {
        "layer_id": 3,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": "nvfp4",
        "extra_buffers": [{"role": "idx", "num_heads": 1, "head_dim": 16, "dtype": "nvfp4"}],
    },
    {"layer_id": 4, "num_kv_heads": 0, "head_dim": 8},  # attention-free: dropped
]


def _pair() -> tuple[KVCacheManager, KVCacheManager]:
    cfg = {
        "layers": LAYERS,
        "tokens_per_block": 4,
        "max_requests": 16,
        "max_seq_len": 128,
        "num_blocks": 200,
    }
    return KVCacheManager(cfg), KVCacheManager(cfg | {"device": "cuda:0"})


def test_cuda_manager_matches_cpu_on_random_ops() -> None:
    rng = np.random.default_rng(7)
    cpu, gpu = _pair()
    live: list[str] = []
    for step in range(300):
        if not live or rng.random() < 0.2:
            rid, n = f"r{step}", int(rng.integers(1, 30))
            for m in (cpu, gpu):
                try:
                    m.allocate(rid, n)
                except (OutOfBlocks, RequestLimitReached):
                    continue
            if rid in cpu.request_ids():
                live.append(rid)
        elif rng.random() < 0.1:
            rid = live.pop(int(rng.integers(len(live))))
            cpu.free(rid)
            gpu.free(rid)
        else:
            ids = [r for r in live if cpu.request(r).num_tokens < 120]
            outcomes = []
            for m in (cpu, gpu):
                try:
                    m.extend_many(ids)
                    outcomes.append(True)
                except OutOfBlocks:
                    outcomes.append(False)
            assert outcomes[0] == outcomes[1]
        if live:
            # The first read after ops applies their edits: fused with this slot mapping.
            if step % 2:
                a, b = cpu.slot_mapping(live, 1, pad_to=256), gpu.slot_mapping(live, 1, pad_to=256)
            else:
                a, b = cpu.slot_mappings(live), gpu.slot_mappings(live)
            assert torch.equal(a, b.cpu())
        for g in range(len(cpu.layout.layer_groups)):
            dev = gpu.page_table(g)
            assert dev.device.type == "cuda"
            assert torch.equal(dev.cpu(), cpu.page_table(g))
        if live:
            for lid, role in (
                (0, "value"),
                (2, "key"),
                (2, "index_key"),
                (3, "key_scale"),
                (3, "idx_scale"),
            ):
                for mode, per_layer in (("slot", False), ("kernel", False), ("kernel", True)):
                    a = cpu.page_indices(live, lid, role, mode=mode, per_layer=per_layer)
                    b = gpu.page_indices(live, lid, role, mode=mode, per_layer=per_layer)
                    assert torch.equal(a, b.cpu())
    assert torch.equal(cpu.layer_pointer_table().cpu() != 0, gpu.layer_pointer_table().cpu() != 0)


def test_cuda_pointer_tables_locate_every_view_extra_roles_included() -> None:
    _, gpu = _pair()
    roles = gpu.describe().roles
    assert roles[4:] == ("idx", "idx_scale", "index_key")
    table = gpu.layer_pointer_table().cpu()
    assert table.shape == (5, 7) and bool((table[4] == 0).all())  # layer 4 was dropped
    for (lid, role), _ in gpu.layout.placements.items():
        assert int(table[lid, roles.index(role)]) == gpu.layer_view(lid, role).data_ptr()


def test_cuda_copy_tokens_matches_cpu() -> None:
    """Relocations (tree paths, chains, cycles, repeated sources, reads of blocks shared
    through a prefix hit) and refusals leave the same bytes on cuda:0 as on the CPU."""
    rng = np.random.default_rng()
    cpu, gpu = _pair()
    for a, b in zip(cpu.memory.tensors, gpu.memory.tensors, strict=True):
        a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8))
        b.copy_(a)
    prompt = [int(t) for t in rng.integers(0, 1000, size=20)]
    for m in (cpu, gpu):
        m.allocate("p", 20, token_ids=prompt)
        m.commit("p", prompt)
        m.allocate("q", 23, token_ids=[*prompt, 1, 2, 3], lookahead=3)  # hits 20 tokens
        m.allocate("a", 20, lookahead=4)
        m.allocate("b", 9)
        m.extend_many(["a", "b"], [2, 1], [4, 0])
        m.extend("a", 20, lookahead=8)  # the window releases a's early blocks
    for _ in range(30):
        ops = random_copy_ops(rng, cpu)
        cpu.copy_tokens(*ops)
        gpu.copy_tokens(*ops)
    for ids, src, dst in ((["q", "a"], [20, 40], [3, 41]), (["p"], [19], [2])):
        for m in (cpu, gpu):
            with pytest.raises(CopyIntoSharedBlock):
                m.copy_tokens(ids, src, dst)
    for a, b in zip(cpu.memory.tensors, gpu.memory.tensors, strict=True):
        assert torch.equal(a, b.cpu())


def test_cuda_views_alias_device_pools() -> None:
    _, gpu = _pair()
    view = gpu.layer_view(1, "value")
    assert view.is_cuda
    view[7].fill_(3.0)
    pool = gpu.memory.tensors[gpu.layout.placements[(1, "value")].pool]
    offset = gpu.layout.placements[(1, "value")].offset_bytes
    chunk = pool[7, offset : offset + view[7].numel() * 2].view(view.dtype)
    assert bool((chunk == 3.0).all())
    assert gpu.pointer_table().is_cuda
    assert int(gpu.layer_pointer_table()[1, 1]) == view.data_ptr()


@pytest.mark.parametrize("path", ["c", "python", "reference"])
def test_columnar_steps_map_slots_with_one_launch_as_on_the_cpu(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random columnar steps with ``map_slots`` (chunks, lookahead, rejected drafts, frees,
    new requests, and decode steps of one count for all, whose items are their handles):
    the CUDA manager's mapping and tables equal the CPU manager's after every step, each
    step's edits and mapping in one driver launch, packed and made by the C core
    (``DeviceTables.map_launch``: ``c``) or by ``StepLaunch`` without it (``python``), or,
    with ``KVCM_KERNELS=reference``, in none of it (the torch reference)."""
    from kvcm.device_tables import DeviceTables
    from kvcm_kernels.step_tables import StepLaunch

    if path == "c" and not native.available():
        pytest.skip("kvcm._native is not built")
    by_c: list[bool] = []
    by_python: list[bool] = []
    real_c, real_python = DeviceTables.map_launch, StepLaunch.__call__

    def counted_c(self: DeviceTables, *args: object) -> torch.Tensor | None:
        out = real_c(self, *args)
        by_c.append(out is not None)
        return out

    def counted_python(self: StepLaunch, *args: object) -> bool:
        launched = real_python(self, *args)
        by_python.append(launched)
        return launched

    monkeypatch.setattr(DeviceTables, "map_launch", counted_c)
    monkeypatch.setattr(StepLaunch, "__call__", counted_python)
    if path == "reference":
        monkeypatch.setenv("KVCM_KERNELS", "reference")
    rng = np.random.default_rng(11)
    was = native.core is not None
    native.use(path != "python")
    try:
        cpu, gpu = _pair()
        live: list[int] = []
        decodes = 0
        for step in range(200):
            cols: dict[str, object] = {}
            decode = bool(live) and rng.random() < 0.3  # extends alone, one count for all
            if not decode and live and rng.random() < 0.15:
                cols["free"] = [live.pop(int(rng.integers(len(live))))]
            if not decode and live and rng.random() < 0.2:
                cols["rewind"] = [live[int(rng.integers(len(live)))]]
                cols["rewind_tokens"] = int(rng.integers(1, 3))
            if live:
                cols["extend"] = live
                cols["num_new_tokens"] = (
                    int(rng.integers(1, 3)) if decode else rng.integers(1, 6, len(live)).tolist()
                )
                cols["lookahead"] = int(rng.integers(0, 3))
            if not decode and len(live) < 12 and rng.random() < 0.4:
                cols["allocate"] = [
                    {"request_id": f"q{step}", "num_tokens": int(rng.integers(1, 20))}
                ]
            a = cpu.step_columns(**cols, map_slots=True)
            b = gpu.step_columns(**cols, map_slots=True)
            assert all((a.status[s] == b.status[s]).all() for s in a.status), step
            decodes += decode and not a.errors
            assert torch.equal(b.slot_mapping.cpu(), a.slot_mapping), step
            assert torch.equal(gpu.page_tables().cpu(), cpu.page_tables()), step
            gone = {
                h
                for h, s in zip(cols.get("extend", []), a.status.get("extend", []), strict=False)
                if s
            }
            live = [h for h in live if h not in gone] + [int(h) for h in a.handles if h]
    finally:
        native.use(was)
    assert decodes > 10
    if path == "c":
        assert by_c and all(by_c) and not by_python
    elif path == "python":
        assert not by_c and by_python and all(by_python)
    else:  # refused by both: the torch reference ran
        assert by_c and not any(by_c) and by_python and not any(by_python)


def test_decode_steps_behind_a_busy_stream_keep_their_staging_and_outputs() -> None:
    """The C launch's two reuses, with the device kept behind the host (a spin kernel
    before each block of 8 steps, whose mappings are all held until the block ends): a
    staging buffer (a ring of 4) is rewritten only after its last kernel read it (the wait
    in ``step_launch``), and a mapping the caller holds is never written again while one
    it dropped may be (``Outputs``). Every mapping equals the CPU manager's of its step,
    the ones held over the whole run included."""
    if not native.available():
        pytest.skip("kvcm._native is not built")
    cpu, gpu = _pair()
    handles = []
    for i in range(6):  # 6 x 75 tokens: the pools' 200 blocks of 4 hold them
        a = cpu.step_columns(allocate=[{"request_id": f"r{i}", "num_tokens": 5 + i}])
        b = gpu.step_columns(allocate=[{"request_id": f"r{i}", "num_tokens": 5 + i}])
        assert a.handles.tolist() == b.handles.tolist()
        handles.append(int(a.handles[0]))
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block in range(8):
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time: the host runs ahead
        maps = []
        for _ in range(8):
            a = cpu.step_columns(extend=handles, map_slots=True)
            b = gpu.step_columns(extend=handles, map_slots=True)
            assert not a.errors and not b.errors
            maps.append((b.slot_mapping, a.slot_mapping))
            del b
        held.append(maps[block % 8])
        for k, (device_mapping, want) in enumerate(maps):
            assert torch.equal(device_mapping.cpu(), want), (block, k)
        del maps  # the rest dropped: their outputs may be reused
    torch.cuda.synchronize()
    for device_mapping, want in held:
        assert torch.equal(device_mapping.cpu(), want)
    assert torch.equal(gpu.page_tables().cpu(), cpu.page_tables())


def test_a_rehearsed_decode_step_changes_nothing_on_cuda() -> None:
    """``rehearse_columns`` on a CUDA manager (busy-poll mode's rehearsal in a CUDA
    sidecar): it queues no table edit, and the steps after it map and edit as the CPU
    manager's, which was never rehearsed."""
    cpu, gpu = _pair()
    handles = []
    for i in range(6):
        a = cpu.step_columns(allocate=[{"request_id": f"r{i}", "num_tokens": 3 + 2 * i}])
        b = gpu.step_columns(allocate=[{"request_id": f"r{i}", "num_tokens": 3 + 2 * i}])
        handles.append(int(a.handles[0]))
        assert a.handles.tolist() == b.handles.tolist()
    for step in range(30):
        gpu.page_tables()  # the edits so far applied: a rehearsal must add none
        assert gpu.parts.coord.ops_since_take == 0
        for _ in range(3):
            gpu.rehearse_columns({"extend": handles, "lookahead": step % 2})
        assert gpu.parts.coord.ops_since_take == 0
        a = cpu.step_columns(extend=handles, lookahead=step % 2, map_slots=True)
        b = gpu.step_columns(extend=handles, lookahead=step % 2, map_slots=True)
        assert a.status["extend"].tolist() == b.status["extend"].tolist(), step
        assert torch.equal(b.slot_mapping.cpu(), a.slot_mapping), step
        assert torch.equal(gpu.page_tables().cpu(), cpu.page_tables()), step
