"""Load test of the kvcm service over loopback (httpx.AsyncClient), with an in-process baseline.

  python bench/loadtest.py                     # starts its own server, runs every mode (~1 min)
  python bench/loadtest.py --quick             # a smoke run (seconds)
  python bench/loadtest.py --url http://127.0.0.1:8470 --scenario step --mode open --rate 300

Scenarios:

- ``step``: a scheduler with ``--requests`` running requests (256) sends one ``POST /v1/step``
  per scheduler step: +1 token for every request (allocations happen when a request crosses a
  block boundary); a request that reached its target length is freed and replaced by a new
  one (prompt 32-512 tokens, 16-256 generated) in the same step.
- ``single``: one op per call (allocate, a few extends, free), per worker.

Modes: ``closed`` (fixed concurrency: each worker sends its next call when the previous one
answered) and ``open`` (calls start on a fixed schedule, ``--rate`` per second, whether or not
earlier ones answered; latency counts from the scheduled start, so a stalled server shows up
as latency, not as a lower rate). Each run has a warm-up that is not measured.

After the runs every request is freed and the service's stats must show zero used blocks and
zero requests (leaks are reported). The in-process baseline runs the same step sequence on a
``KVCacheManager`` in this process (``manager.step(ops)`` with the same dict ops), so the
table shows what HTTP adds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

TPB = 16
LAYERS = [{"layer_id": i, "num_kv_heads": 1, "head_dim": 64} for i in range(4)]
HEADERS = {"content-type": "application/json"}


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    if not samples:
        return (float("nan"),) * 3
    p = np.percentile(np.asarray(samples) * 1e3, [50, 90, 99])
    return float(p[0]), float(p[1]), float(p[2])


@dataclass
class Scheduler:
    """One scheduler's running requests and the next step it sends (no I/O here)."""

    name: str
    num_requests: int
    rng: np.random.Generator
    lengths: dict[str, int] = field(default_factory=dict)
    targets: dict[str, int] = field(default_factory=dict)
    counter: int = 0

    def _new(self) -> dict[str, Any]:
        rid = f"{self.name}-{self.counter}"
        self.counter += 1
        prompt = int(self.rng.integers(32, 513))
        self.lengths[rid] = prompt
        self.targets[rid] = prompt + int(self.rng.integers(16, 257))
        return {"op": "allocate", "request_id": rid, "num_tokens": prompt}

    def start_ops(self) -> list[dict[str, Any]]:
        return [self._new() for _ in range(self.num_requests)]

    def next_ops(self) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = []
        for rid in list(self.lengths):
            if self.lengths[rid] >= self.targets[rid]:
                ops.append({"op": "free", "request_id": rid})
                del self.lengths[rid], self.targets[rid]
                ops.append(self._new())
            else:
                self.lengths[rid] += 1
                ops.append({"op": "extend", "request_id": rid, "num_new_tokens": 1})
        return ops

    def end_ops(self) -> list[dict[str, Any]]:
        return [{"op": "free", "request_id": rid} for rid in self.lengths]


class Run:
    def __init__(self, name: str) -> None:
        self.name = name
        self.latencies: list[float] = []
        self.ops = 0
        self.errors = 0
        self.elapsed = 0.0

    def row(self) -> dict[str, Any]:
        p50, p90, p99 = percentiles(self.latencies)
        n = len(self.latencies)
        return {
            "run": self.name,
            "calls": n,
            "calls_per_s": n / self.elapsed if self.elapsed else 0.0,
            "ops_per_s": self.ops / self.elapsed if self.elapsed else 0.0,
            "p50_ms": p50,
            "p90_ms": p90,
            "p99_ms": p99,
            "errors": self.errors,
        }


class HttpxClient:
    """httpx.AsyncClient (a keep-alive pool shared by all workers)."""

    name = "httpx"

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        resp = await self.http.post(path, content=body, headers=HEADERS)
        return resp.status_code, resp.content

    async def get(self, path: str) -> tuple[int, bytes]:
        resp = await self.http.get(path)
        return resp.status_code, resp.content

    async def aclose(self) -> None:
        """Shared pool: closed by its owner."""


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on one asyncio connection (one call at a time).

    It measures the service without a client library's per-call cost: the same bytes on the
    wire as httpx sends, parsed only as far as Content-Length.
    """

    name = "raw"

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _call(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(head + body)
        status_line = await self.reader.readuntil(b"\r\n")
        headers = await self.reader.readuntil(b"\r\n\r\n")
        match = re.search(rb"(?i)content-length: *(\d+)", headers)
        length = int(match.group(1)) if match else 0
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        return await self._call(head, body)

    async def get(self, path: str) -> tuple[int, bytes]:
        return await self._call(f"GET {path} HTTP/1.1\r\nhost: {self.host}\r\n\r\n".encode(), b"")

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def _step(
    client: Any, ops: list[dict[str, Any]], run: Run | None, brief: bool = False
) -> None:
    status, content = await client.post("/v1/step", orjson.dumps({"ops": ops, "brief": brief}))
    failed = status != 200
    if not failed:
        results = orjson.loads(content)["results"]
        failed = len(results) != len(ops) or not all(r["ok"] for r in results)
    if run is not None:
        run.ops += len(ops)
        run.errors += failed
    elif failed:
        raise RuntimeError(f"setup step failed: {status} {content[:300]!r}")


async def step_closed(
    connect: Any, scheds: list[Scheduler], warmup: float, duration: float, brief: bool = False
) -> Run:
    run = Run(f"step closed c={len(scheds)}" + (" brief" if brief else ""))

    async def worker(s: Scheduler) -> None:
        client = connect()
        end_warm = time.perf_counter() + warmup
        while time.perf_counter() < end_warm:
            await _step(client, s.next_ops(), None, brief)
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            ops = s.next_ops()
            t0 = time.perf_counter()
            await _step(client, ops, run, brief)
            run.latencies.append(time.perf_counter() - t0)
        await client.aclose()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in scheds))
    run.elapsed = time.perf_counter() - t0 - warmup
    return run


async def step_open(
    connect: Any, scheds: list[Scheduler], rate: float, warmup: float, duration: float
) -> Run:
    """Steps start every 1/rate s, round-robin over schedulers (each sends one at a time)."""
    run = Run(f"step open {rate:g}/s k={len(scheds)}")
    locks = [asyncio.Lock() for _ in scheds]
    clients = [connect() for _ in scheds]
    start = time.perf_counter()
    total = int((warmup + duration) * rate)
    tasks = []

    async def fire(i: int, due: float) -> None:
        k = i % len(scheds)
        async with locks[k]:
            ops = scheds[k].next_ops()
            measured = due - start >= warmup
            await _step(clients[k], ops, run if measured else None)
        if measured:
            run.latencies.append(time.perf_counter() - due)

    for i in range(total):
        due = start + i / rate
        # Sleep to 2 ms before the due time, then yield until it: epoll's millisecond timeout
        # would otherwise start calls up to 1 ms late and count that as latency.
        if due - time.perf_counter() > 0.002:
            await asyncio.sleep(due - time.perf_counter() - 0.002)
        while time.perf_counter() < due:
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(fire(i, due)))
    await asyncio.gather(*tasks)
    run.elapsed = time.perf_counter() - start - warmup
    for client in clients:
        await client.aclose()
    return run


async def single_closed(
    connect: Any, concurrency: int, warmup: float, duration: float, seed: int
) -> tuple[Run, dict[str, list[float]]]:
    run = Run(f"single-op closed c={concurrency}")
    by_op: dict[str, list[float]] = {"allocate": [], "extend": [], "free": []}

    async def call(client: Any, path: str, body: dict[str, Any], measured: bool) -> None:
        t0 = time.perf_counter()
        status, _ = await client.post(path, orjson.dumps(body))
        if measured:
            dt = time.perf_counter() - t0
            run.latencies.append(dt)
            by_op[path.rsplit("/", 1)[1]].append(dt)
            run.ops += 1
            run.errors += status >= 300

    async def worker(w: int) -> None:
        client = connect()
        rng = np.random.default_rng(seed + w)
        t_start = time.perf_counter()
        i = 0
        while (now := time.perf_counter()) < t_start + warmup + duration:
            measured = now >= t_start + warmup
            rid = f"single-{w}-{i}"
            i += 1
            prompt = int(rng.integers(32, 513))
            await call(client, "/v1/allocate", {"request_id": rid, "num_tokens": prompt}, measured)
            for _ in range(4):
                await call(client, "/v1/extend", {"request_id": rid, "num_new_tokens": 1}, measured)
            await call(client, "/v1/free", {"request_id": rid}, measured)
        await client.aclose()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    run.elapsed = time.perf_counter() - t0 - warmup
    return run, by_op


def in_process(num_requests: int, steps: int, seed: int) -> dict[str, float]:
    """p50 (ms) of the same step sequence in process: ``manager.step(ops)`` (typed results),
    ``step_plain`` (dict results, what the service runs) full and brief, and ``extend_many``
    over the same number of requests (the pure decode step)."""
    from kvcm import KVCacheManager
    from kvcm.ops import plain_ops

    out = {}
    for name in ("step", "step_plain", "step_plain_brief"):
        m = KVCacheManager(_config(num_requests, 1))
        s = Scheduler("inproc", num_requests, np.random.default_rng(seed))
        m.step(s.start_ops())
        times = []
        for _ in range(steps):
            ops = s.next_ops()
            t0 = time.perf_counter()
            if name == "step":
                m.step(ops)
            else:
                m.step_plain(plain_ops(ops) or [], brief=name.endswith("brief"))
            times.append(time.perf_counter() - t0)
        out[name] = percentiles(times)[0]
    m2 = KVCacheManager(_config(num_requests, 1))
    ids = [f"r{i}" for i in range(num_requests)]
    for i, rid in enumerate(ids):
        m2.allocate(rid, 100 + i)
    decode = []
    for _ in range(steps):
        t0 = time.perf_counter()
        m2.extend_many(ids)
        decode.append(time.perf_counter() - t0)
    out["extend_many"] = percentiles(decode)[0]
    return out


def _config(num_requests: int, schedulers: int) -> dict[str, Any]:
    # Requests reach at most 512 + 256 tokens = 48 blocks; the pool holds every request at
    # its longest with room to spare, so no step of the load test runs out of blocks.
    rows = num_requests * schedulers + 64
    return {
        "layers": LAYERS,
        "tokens_per_block": TPB,
        "max_requests": rows,
        "max_seq_len": 1024,
        "num_blocks": rows * 50,
    }


def start_server(
    num_requests: int, schedulers: int, *extra: str
) -> tuple[str, subprocess.Popen[str], Path]:
    """``kvcm serve`` for ``schedulers`` x ``num_requests`` requests, plus the ``extra`` flags,
    once ready; returns its URL, the process and its temporary directory."""
    cfg = _config(num_requests, schedulers)
    tmp = Path(tempfile.mkdtemp(prefix="kvcm-load-"))
    (tmp / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcm",
            "serve",
            "--config",
            str(tmp / "config.json"),
            "--port",
            "0",
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"serving on (\S+)", line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"server did not start: {line}")
    url = match.group(1)
    for _ in range(600):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return url, proc, tmp
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server never became ready")


async def floor(connect: Any, n: int = 300) -> float:
    """p50 of GET /livez (ms): what one call costs with this client and no work behind it."""
    client = connect()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await client.get("/livez")
        times.append(time.perf_counter() - t0)
    await client.aclose()
    return percentiles(times[n // 10 :])[0]


async def main_async(args: argparse.Namespace, url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"livez_p50_ms": {}}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:
        connectors = {"httpx": lambda: HttpxClient(http), "raw": lambda: RawClient(host, int(port))}
        chosen = list(connectors) if args.client == "both" else [args.client]
        nsched = max(args.concurrency, 1)
        scheds = [
            Scheduler(f"s{k}", args.requests, np.random.default_rng(args.seed + k))
            for k in range(nsched)
        ]
        setup = HttpxClient(http)
        for s in scheds:
            ops = s.start_ops()
            for i in range(0, len(ops), 64):
                await _step(setup, ops[i : i + 64], None)
        for name in chosen:
            connect = connectors[name]
            extra["livez_p50_ms"][name] = await floor(connect)
            runs: list[Run] = []
            if args.scenario in ("step", "all"):
                if args.mode in ("closed", "all"):
                    runs.append(await step_closed(connect, scheds[:1], args.warmup, args.duration))
                    runs.append(
                        await step_closed(connect, scheds[:1], args.warmup, args.duration, True)
                    )
                    if nsched > 1:
                        runs.append(await step_closed(connect, scheds, args.warmup, args.duration))
                if args.mode in ("open", "all"):
                    runs.append(
                        await step_open(connect, scheds, args.rate, args.warmup, args.duration)
                    )
            if args.scenario in ("single", "all"):
                run, by_op = await single_closed(
                    connect, args.concurrency, args.warmup, args.duration, args.seed
                )
                runs.append(run)
                extra.setdefault("single_op_p50_ms", {})[name] = {
                    k: percentiles(v)[0] for k, v in by_op.items()
                }
            rows += [{"client": name, **r.row()} for r in runs]
        for s in scheds:
            ops = s.end_ops()
            for i in range(0, len(ops), 256):
                await _step(setup, ops[i : i + 256], None)
        stats = (await http.get("/v1/stats")).json()
        extra["leaked_blocks"] = sum(stats["used_blocks"].values())
        extra["requests_left"] = stats["num_requests"]
        metrics = (await http.get("/metrics")).text
    extra["server_step_p50_ms"] = _histogram_p50(metrics, "/v1/step")
    return {"rows": rows, **extra}


def _histogram_p50(metrics: str, route: str) -> float:
    """Upper bucket bound holding the median of the manager time of ``route`` (ms)."""
    pattern = rf'kvcm_op_duration_seconds_bucket{{le="([^"]+)",route="{re.escape(route)}"}} (\S+)'
    buckets = [(float(le), float(n)) for le, n in re.findall(pattern, metrics)]
    if not buckets:
        return float("nan")
    total = buckets[-1][1]
    return next(le for le, n in buckets if n >= total / 2) * 1e3


def report(result: dict[str, Any], num_requests: int) -> str:
    lines = [
        f"{'client':<7}{'run':<26}{'calls':>7}{'calls/s':>9}{'ops/s':>10}{'p50 ms':>9}"
        f"{'p90 ms':>9}{'p99 ms':>9}{'errors':>7}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['client']:<7}{r['run']:<26}{r['calls']:>7}{r['calls_per_s']:>9.0f}"
            f"{r['ops_per_s']:>10.0f}{r['p50_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['p99_ms']:>9.3f}"
            f"{r['errors']:>7}"
        )
    for name, ms in result["livez_p50_ms"].items():
        lines.append(f"{name}: GET /livez p50 {ms:.3f} ms (the client's floor per call)")
    for name, by_op in result.get("single_op_p50_ms", {}).items():
        ops = ", ".join(f"{k} {v:.3f}" for k, v in by_op.items())
        lines.append(f"{name}: single-op p50 ms: {ops}")
    lines += [
        f"server: manager time per step p50 <= {result['server_step_p50_ms']:.3f} ms "
        "(histogram bucket bound)",
        f"in-process, same steps ({num_requests} requests), p50 ms: "
        + ", ".join(f"{k} {v:.3f}" for k, v in result["in_process_p50_ms"].items()),
        f"after the run: {result['leaked_blocks']} leaked blocks, "
        f"{result['requests_left']} requests left",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing server (default: start one)")
    parser.add_argument("--scenario", choices=["step", "single", "all"], default="all")
    parser.add_argument("--mode", choices=["closed", "open", "all"], default="all")
    parser.add_argument("--requests", type=int, default=256, help="running requests per scheduler")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rate", type=float, default=300.0, help="open-loop steps per second")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--client", choices=["httpx", "raw", "both"], default="both", help="load generator"
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds, for CI smoke tests")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup, args.requests, args.concurrency = 0.5, 0.2, 32, 2
        args.rate = 50.0
    proc = None
    url = args.url
    if url is None:
        url, proc, _ = start_server(args.requests, max(args.concurrency, 1))
    try:
        result = asyncio.run(main_async(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    inproc = in_process(args.requests, 300 if not args.quick else 30, args.seed)
    result |= {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, "
        f"Python {platform.python_version()}",
        "requests_per_scheduler": args.requests,
        "in_process_p50_ms": inproc,
    }
    print(report(result, args.requests))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if (
        result["leaked_blocks"]
        or result["requests_left"]
        or any(r["errors"] for r in result["rows"])
    ):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
