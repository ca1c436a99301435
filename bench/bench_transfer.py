"""KV moves between two sidecars over NIXL: kvcm's pull against NIXL's raw READ and a memcpy.

  python bench/bench_transfer.py                      # 1 GiB, 4096 and 32768 tokens, 5 repeats
  python bench/bench_transfer.py --skip-32k --json out.json
  python bench/bench_transfer.py --gib 0.01 --tokens 256 --repeat 1 --skip-32k   # smoke run

Two processes, both started here (multiprocessing spawn): a prefill sidecar P (a child) and
a decode sidecar D (this process), each a ``KVCacheManager`` with ``transfer="nixl"`` on the
CPU, so every move is DRAM to DRAM over UCX between two processes of one host. Layout:
Llama-3-8B-shaped, 32 layers of 8 KV heads x 128, fp16, K and V, 16 tokens per block: one
pool whose 2 MiB slot holds a block of every layer (128 KiB per token). P fills its pool
with distinct 8-byte words once; D's pool is touched (zeroed) up front, as a serving
sidecar's would be.

Measured, rounds interleaved (each round runs every way once, kvcm and the raw READ in
alternating order; the median of ``--repeat`` rounds after a warm-up round, which also
verifies the bytes):

- ``kvcm pull``: P allocates, commits and ``hand_off``s a request of fresh tokens
  (untimed); D times from its ``pull(rid, export)`` call until ``transfer_status`` says
  ``ready``: the checks, the allocation, the READ per pool with a descriptor per block, and
  the commit that publishes the blocks. D frees the request after each round (its blocks
  stay cached; the next round's fresh tokens evict them).
- ``raw NIXL, same descriptors``: the same READ posted on D's own NIXL agent (the one kvcm
  uses, to the same peer): descriptor lists built, ``initialize_xfer``, ``transfer``, a spin
  on ``check_xfer_state`` and the release, with the descriptors of the last kvcm pull.
- ``raw NIXL, one descriptor`` (the ``--gib`` size only): one contiguous READ of the same
  bytes (P's pool start into D's).
- ``memcpy`` (the ``--gib`` size only): the same bytes copied in one process (D), by
  ``numpy.copyto`` (one thread) and by ``torch.Tensor.copy_`` (torch's threads).

The ``--gib`` request (default 1 GiB: 8192 tokens) measures bandwidth against the raw
READ (target: kvcm >= 90% of it); the ``--tokens`` requests (default 4096 tokens, 512 MiB,
and 32768 tokens, 4 GiB; ``--skip-32k`` drops 32768) measure a pull's latency. Bytes are
verified once per size and way (a CRC-32 of D's destination against one computed in P
over the source, outside the timed region; D's destination is zeroed first). GB/s is 10^9
bytes a second, at the median. P waits for commands in 1 ms sleeps and polls its transfers
between them (it frees a handed-off request on D's message), the same during every way.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise

LAYERS, HEADS, HEAD_DIM, TPB = 32, 8, 128, 16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # K and V, fp16: 128 KiB
SLOT_BYTES = TOKEN_BYTES * TPB  # 2 MiB
SLACK_BLOCKS = 4
DEADLINE_S = 600.0

T0 = time.perf_counter()


def _progress(message: str) -> None:
    print(
        f"[bench_transfer {time.perf_counter() - T0:6.1f}s] {message}", file=sys.stderr, flush=True
    )


def _config(num_blocks: int, max_seq_len: int, name: str) -> dict[str, Any]:
    return {
        "layers": [
            {"layer_id": i, "num_kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "fp16"}
            for i in range(LAYERS)
        ],
        "tokens_per_block": TPB,
        "num_blocks": num_blocks,
        "max_requests": 8,
        "max_seq_len": max_seq_len,
        "device": "cpu",
        "transfer": "nixl",
        "transfer_name": name,
    }


def _digest_slots(pool: torch.Tensor, slots: list[int]) -> int:
    """CRC-32 of the slots' bytes in this order (the pool's words are distinct: a block out
    of place changes it)."""
    crc = 0
    for s in slots:
        crc = zlib.crc32(pool[s].numpy(), crc)
    return crc


def _digest_range(pool: torch.Tensor, nbytes: int) -> int:
    return zlib.crc32(pool.view(-1)[:nbytes].numpy())


# -- the prefill sidecar (child process) -------------------------------------------------------


def prefill(conn: Any, num_blocks: int, max_seq_len: int) -> None:
    """P: a manager over a filled pool, answering D's commands until ``stop``."""
    from kvcm import KVCacheManager

    m = KVCacheManager(_config(num_blocks, max_seq_len, "prefill"), check_budget=False)
    pool = m.memory.tensors[0]
    words = pool.view(-1).view(torch.int64)
    torch.arange(1, words.numel() + 1, out=words)  # every 8-byte word distinct
    conn.send(("ok", m.transfer_agent().model_dump()))
    while True:
        if not conn.poll(0.001):
            m.poll_transfers()
            continue
        command, *args = conn.recv()
        try:
            if command == "stop":
                m.close()
                conn.send(("ok", None))
                return
            if command == "export":  # (request id, first token, tokens)
                rid, first, n = args
                limit = time.monotonic() + 60
                while m.transfers_busy:  # the last hand-off: freed on D's message
                    if time.monotonic() > limit:
                        raise TimeoutError("the previous hand-off was never released")
                    m.poll_transfers()
                    time.sleep(0.001)
                tokens = list(range(first, first + n))
                m.allocate(rid, n, tokens)
                m.commit(rid, tokens)
                answer: Any = m.hand_off(rid, DEADLINE_S).model_dump()
            elif command == "digest_slots":
                answer = _digest_slots(pool, args[0])
            elif command == "digest_range":
                answer = _digest_range(pool, args[0])
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", answer))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Peer:
    """D's end of the pipe to P."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        return self.answer()

    def answer(self) -> Any:
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"the prefill process failed:\n{value}")
        return value


# -- the decode sidecar (this process) ---------------------------------------------------------


class Decode:
    """D: the manager, its NIXL agent, and the ways to move a request's bytes."""

    def __init__(self, m: Any, peer: Peer, peer_name: str) -> None:
        self.m = m
        self.peer = peer
        self.peer_name = peer_name
        self.agent = m.parts.transfers.engine.agent
        self.pool = m.memory.tensors[0]
        self.next_token = 1
        self.rounds = 0
        self.peer_base = 0  # P's pool address (its export's region)

    def export(self, n: int) -> Any:
        from kvcm_client.transfer import KVExport

        self.rounds += 1
        rid = f"r{self.rounds}"
        dump = self.peer.ask("export", rid, self.next_token, n)
        self.next_token += n
        return KVExport.model_validate(dump)

    def kvcm_pull(self, n: int, verify: bool) -> tuple[float, float, np.ndarray, np.ndarray]:
        """One timed pull of a fresh ``n``-token request: its time, the time until ``pull``
        returned, and the raw READ's descriptors (D's slots, P's slots) for the same blocks."""
        export = self.export(n)
        rid = export.request_id
        t0 = time.perf_counter()
        state = self.m.pull(rid, export, deadline_s=DEADLINE_S)
        posted = time.perf_counter() - t0
        while state.state == "pulling":
            state = self.m.transfer_status([rid])[0]
        dt = time.perf_counter() - t0
        if state.state != "ready":
            raise RuntimeError(f"pull {rid} ended {state.state}: {state.error}")
        blocks = -(-n // TPB)
        local = self.m.block_table(rid)[0][:blocks]
        remote = export.blocks[0][:blocks]
        if state.bytes != blocks * SLOT_BYTES:
            raise RuntimeError(f"pull {rid} moved {state.bytes} bytes, not {blocks * SLOT_BYTES}")
        if verify:
            self.peer.conn.send(("digest_slots", remote))
            mine = _digest_slots(self.pool, local)
            if self.peer.answer() != mine:
                raise RuntimeError(f"kvcm pull of {n} tokens: the bytes differ")
        self.m.free(rid)
        region = export.regions[0]
        local_rows = self._descs([self.pool.data_ptr() + s * SLOT_BYTES for s in local])
        remote_rows = self._descs([region.address + s * region.slot_bytes for s in remote])
        return dt, posted, local_rows, remote_rows

    @staticmethod
    def _descs(addresses: list[int], size: int = SLOT_BYTES) -> np.ndarray:
        out = np.empty((len(addresses), 3), dtype=np.int64)
        out[:, 0] = addresses
        out[:, 1] = size
        out[:, 2] = 0
        return out

    def raw_read(self, local: np.ndarray, remote: np.ndarray) -> tuple[float, float]:
        """NIXL's READ of ``remote`` rows into ``local`` rows, start to release; and the
        time until ``transfer`` returned."""
        agent = self.agent
        t0 = time.perf_counter()
        ldescs = agent.get_xfer_descs(local, "DRAM")
        rdescs = agent.get_xfer_descs(remote, "DRAM")
        handle = agent.initialize_xfer("READ", ldescs, rdescs, self.peer_name)
        state = agent.transfer(handle)
        posted = time.perf_counter() - t0
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        dt = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended {state}")
        return dt, posted

    def verify_raw(self, local: np.ndarray, remote: np.ndarray, what: str) -> None:
        """Zero D's destination, READ it again (untimed), compare digests."""
        base = self.pool.data_ptr()
        flat = self.pool.view(-1).numpy()
        for address, size, _ in local:
            flat[int(address) - base : int(address) - base + int(size)] = 0
        self.raw_read(local, remote)
        if len(local) == 1:  # the contiguous READ: pool starts
            self.peer.conn.send(("digest_range", int(local[0, 1])))
            mine = _digest_range(self.pool, int(local[0, 1]))
        else:
            slots = [(int(a) - base) // SLOT_BYTES for a in local[:, 0]]
            peer_slots = [(int(a) - self.peer_base) // SLOT_BYTES for a in remote[:, 0]]
            self.peer.conn.send(("digest_slots", peer_slots))
            mine = _digest_slots(self.pool, slots)
        if self.peer.answer() != mine:
            raise RuntimeError(f"{what}: the bytes differ")


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _row(
    name: str,
    nbytes: int,
    descriptors: int | str,
    samples: list[float],
    raw: float | None,
    posted: list[float] | None = None,
) -> dict[str, Any]:
    med = _median(samples)
    return {
        "posted_median_ms": _median(posted) * 1e3 if posted else None,
        "way": name,
        "bytes": nbytes,
        "descriptors": descriptors,
        "samples_s": samples,
        "median_ms": med * 1e3,
        "min_ms": min(samples) * 1e3,
        "gb_s": nbytes / med / 1e9,
        "of_raw": (raw / med) if raw else None,
    }


def measure_size(
    d: Decode, tokens: int, label: str, repeat: int, baselines: bool
) -> list[dict[str, Any]]:
    """Warm-up round (verifying every way), then ``repeat`` interleaved rounds."""
    nbytes = -(-tokens // TPB) * SLOT_BYTES
    blocks = nbytes // SLOT_BYTES
    _progress(f"{label}: warm-up and verification ({nbytes / 2**20:.0f} MiB, {blocks} blocks)")
    _, _, local, remote = d.kvcm_pull(tokens, verify=True)
    _progress(f"{label}: kvcm pull verified")
    d.verify_raw(local, remote, f"raw READ of {label}")
    _progress(f"{label}: raw READ verified")
    contiguous = (d._descs([d.pool.data_ptr()], nbytes), d._descs([d.peer_base], nbytes))
    src = d.pool.view(-1)[:nbytes]
    dst = None
    if baselines:
        d.verify_raw(*contiguous, what=f"contiguous raw READ of {label}")
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        np.copyto(dst.numpy(), src.numpy())
        dst.zero_()
        dst.copy_(src)
        if not torch.equal(dst, src):
            raise RuntimeError("memcpy: the bytes differ")
        _progress(f"{label}: contiguous READ and memcpy verified")
    kvcm: list[float] = []
    raw: list[float] = []
    raw1: list[float] = []
    kvcm_posted: list[float] = []
    raw_posted: list[float] = []
    npcopy: list[float] = []
    tcopy: list[float] = []
    for r in range(repeat):
        _progress(f"{label}: round {r + 1} of {repeat}")
        raw_first = r % 2 == 1  # alternate the order: a load that comes and goes hits both
        if raw_first:  # the last pull's descriptors
            dt, posted = d.raw_read(local, remote)
            raw.append(dt)
            raw_posted.append(posted)
        dt, posted, local, remote = d.kvcm_pull(tokens, verify=False)
        kvcm.append(dt)
        kvcm_posted.append(posted)
        if not raw_first:
            dt, posted = d.raw_read(local, remote)
            raw.append(dt)
            raw_posted.append(posted)
        if baselines:
            assert dst is not None
            raw1.append(d.raw_read(*contiguous)[0])
            t0 = time.perf_counter()
            np.copyto(dst.numpy(), src.numpy())
            npcopy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            tcopy.append(time.perf_counter() - t0)
    base = _median(raw)
    rows = [
        # paired_of_raw: each round's raw / kvcm, the median (steadier under load than the
        # medians' ratio)
        _row(f"kvcm pull, {label}", nbytes, blocks, kvcm, base, kvcm_posted)
        | {"paired_of_raw": _median([b / a for a, b in zip(kvcm, raw, strict=True)])},
        _row(f"raw NIXL READ, same {blocks} descriptors", nbytes, blocks, raw, base, raw_posted),
    ]
    if baselines:
        threads = torch.get_num_threads()
        rows += [
            _row("raw NIXL READ, one contiguous descriptor", nbytes, 1, raw1, base),
            _row("memcpy in one process (numpy.copyto)", nbytes, "-", npcopy, base),
            _row(f"torch copy_ in one process ({threads} threads)", nbytes, "-", tcopy, base),
        ]
    return rows


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per size")
    parser.add_argument("--gib", type=float, default=1.0, help="bandwidth request, GiB")
    parser.add_argument(
        "--tokens", default="4096,32768", help="latency requests, tokens (comma-separated)"
    )
    parser.add_argument("--skip-32k", action="store_true", help="drop 32768 from --tokens")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    bw_blocks = max(1, round(args.gib * 2**30 / SLOT_BYTES))
    bw_tokens = bw_blocks * TPB
    latency = [int(t) for t in args.tokens.split(",") if t.strip()]
    if args.skip_32k:
        latency = [t for t in latency if t != 32768]
    biggest = max([bw_tokens, *latency])
    num_blocks = -(-biggest // TPB) + SLACK_BLOCKS
    pool_bytes = num_blocks * SLOT_BYTES
    need = 2 * pool_bytes + bw_blocks * SLOT_BYTES + (2 << 30)  # + the processes
    if need > 0.9 * _mem_available():
        sys.exit(
            f"bench_transfer: needs about {need / 2**30:.1f} GiB (two pools of "
            f"{pool_bytes / 2**30:.2f} GiB and a memcpy buffer), "
            f"{_mem_available() / 2**30:.1f} GiB available: pass --skip-32k or smaller --tokens"
        )

    load_before = os.getloadavg()
    _progress(f"starting the prefill process (pools of {pool_bytes / 2**30:.2f} GiB each)")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(child, num_blocks, 16 * num_blocks), daemon=True)
    proc.start()
    from kvcm import KVCacheManager

    m = KVCacheManager(_config(num_blocks, 16 * num_blocks, "decode"), check_budget=False)
    m.memory.tensors[0].zero_()  # touched, as a serving sidecar's pool is
    peer = Peer(parent)
    agent = peer.answer()
    d = Decode(m, peer, m.connect_peer(agent["metadata"]))
    results: list[dict[str, Any]] = []
    try:
        first = d.export(TPB)  # P's pool address, for the contiguous READ
        d.peer_base = first.regions[0].address
        m.pull(first.request_id, first, deadline_s=DEADLINE_S)
        while m.transfer_status([first.request_id])[0].state == "pulling":
            pass
        m.free(first.request_id)
        size = bw_blocks * SLOT_BYTES
        shown = f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size / 2**20:g} MiB"
        gib_label = f"{shown} ({bw_tokens} tokens)"
        results += measure_size(d, bw_tokens, gib_label, args.repeat, baselines=True)
        for n in latency:
            label = f"{n}-token request"
            results += measure_size(d, n, label, args.repeat, baselines=False)
    finally:
        try:
            peer.ask("stop")
        finally:
            proc.join(30)
            m.close()
    load_after = os.getloadavg()

    print(
        f"# bench_transfer {time.strftime('%Y-%m-%d')} {platform.machine()}, "
        f"{os.cpu_count()} cores, CPU DRAM to DRAM over UCX; Llama-3-8B-shaped layout "
        f"(2 MiB blocks of 16 tokens); median of {args.repeat}; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print()
    print(
        "| way | MiB | descriptors | median ms | min ms | GB/s | of raw NIXL (same descriptors) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in results:
        share = f"{row['of_raw']:.0%}" if row["of_raw"] is not None else "-"
        print(
            f"| {row['way']} | {row['bytes'] / 2**20:.0f} | {row['descriptors']} | "
            f"{row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['gb_s']:.2f} | {share} |"
        )
    kvcm, raw = results[0], results[1]
    ratio = kvcm["of_raw"]
    print()
    print(
        f"kvcm / raw NIXL (same descriptors), {kvcm['bytes'] / 2**20:g} MiB: {ratio:.1%} "
        f"(target >= 90%: {'met' if ratio >= 0.9 else 'not met'}); round by round, the "
        f"median of raw / kvcm: {kvcm['paired_of_raw']:.1%}"
    )
    print(
        f"pull() returned after {kvcm['posted_median_ms']:.1f} of {kvcm['median_ms']:.1f} ms "
        f"(raw NIXL's transfer(): {raw['posted_median_ms']:.1f} of {raw['median_ms']:.1f} ms)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "layout": {
                        "layers": LAYERS,
                        "kv_heads": HEADS,
                        "head_dim": HEAD_DIM,
                        "dtype": "fp16",
                        "tokens_per_block": TPB,
                        "slot_bytes": SLOT_BYTES,
                    },
                    "repeat": args.repeat,
                    "load_average": {"before": load_before, "after": load_after},
                    "kvcm_of_raw": ratio,
                    "kvcm_of_raw_paired": kvcm["paired_of_raw"],
                    "rows": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
