"""The step channel at an engine's cadence, against the floor: a bare echo at the same cadence.

  python bench/bench_cadence.py                  # 5 ms and back to back, 2000 steps (~2 min)
  python bench/bench_cadence.py --gap-ms 10 --steps 1000
  python bench/bench_cadence.py --quick          # a smoke run
  python bench/bench_cadence.py --device cuda:0 --map-slots   # a GPU sidecar, with mappings
  python bench/bench_cadence.py --one-client-cpu   # the client pinned to one core (many cores)

An engine calls its KV-cache manager once per forward pass, every 5-30 ms, not back to back:
between two steps the service sleeps, and a sleeping service pays a wake-up and cold caches
on the next step. The floor for that is what a bare Python echo over a Unix socket pays at
the same cadence, measured here in the same run: a 4 KiB frame, echoed by a server that
blocks in ``recv`` (what a service that sleeps between frames can hope for) and by one that
busy-polls a non-blocking socket for ``--spin-s`` after each frame (what a service on a core
of its own can; it blocks again after that, so that it burns no core while the others run).
Then the step itself: ``decode_step(handles)`` (``step_columns(extend=handles)``'s shortest
path) of 256 requests (+1 token each, the decode step) from the typed client over the step
channel of a ``kvcm serve``, in its default mode
(it sleeps between steps: adaptive polls and the client's doorbell only), in its busy-poll
mode (``--step-spin-s``: it polls for the next frame for that long after each answer), and in
busy-poll mode with the client's frames through the shared-memory ring (``step_ring=True``),
measured against the busy echo too: the floor of a Python round trip over a socket. On a
CUDA device (``--device cuda:0``) a last variant runs the ring with ``stream_ordered=True``
(docs/shared-memory.md#stream-ordered-steps): the sidecar shares its tables and answers
without waiting for the device.

Every variant runs at each cadence (``--gap-ms``, and 0: back to back), alternating in
blocks so the machine's drift hits them alike. Per variant: p50, p99 and p99.9 of the round
trip in microseconds, the ratio of the step's to the echo's (the blocking echo's for the
default mode, the busy one's for the busy-poll mode and the ring), and the CPU the server
used per wall second (1.0: a whole core), from /proc.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

from kvcm_client import KVCacheClient

ROOT = Path(__file__).resolve().parent.parent
FRAME = 4096
REQUESTS = 256
BLOCK = 100

#: The echo server: blocking, or busy-polling for ``SPIN_S`` after each frame (then blocking
#: until the next, as the busy-poll mode does, so that it burns no core while the other
#: variants run).
ECHO = r"""
import socket, struct, sys, time
path, spin_s = sys.argv[1], float(sys.argv[2])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
spin_until = 0.0

def read(n):
    global spin_until
    data = b""
    while len(data) < n:
        busy = time.monotonic() < spin_until
        conn.setblocking(not busy)
        try:
            chunk = conn.recv(n - len(data))
        except BlockingIOError:
            continue  # look again at once
        if not chunk:
            sys.exit(0)
        data += chunk
    return data

while True:
    (size,) = struct.unpack("<I", read(4))
    body = read(size)
    conn.sendall(struct.pack("<I", size) + body)
    spin_until = time.monotonic() + spin_s
"""


#: Pinned (the default on two or more CPUs): the busy-polling servers (the busy echo, kvcm's
#: busy-poll mode and ring) on the last CPU this process may use and the client on the others,
#: as busy-poll mode is meant to be deployed (a core of the sidecar's own; docs/step-channel.md).
#: Unpinned, a doorbell's wake-up may put the server on the client's CPU (the kernel's
#: wake-affine placement), and a client that then polls for its answer holds the core the
#: server needs: ~0.3 ms a call until the balancer moves one. The servers that sleep between
#: frames (the blocking echo, kvcm's default mode) stay unpinned: pinned, each wake-up would
#: cross CPUs, which is not how they are deployed.
PIN: dict[str, set[int]] = {}


def _pinned(busy: bool) -> Callable[[], None] | None:
    """What a server's child runs before exec: onto the server's CPU, if pinning and busy."""
    if not PIN or not busy:
        return None
    cpus = PIN["server"]
    return lambda: os.sched_setaffinity(0, cpus)


def _cpu_seconds(pid: int) -> float:
    """CPU seconds a process has run so far, every thread (/proc/PID/schedstat: ns, where
    /proc/PID/stat counts 10 ms ticks, too coarse for a block of back-to-back calls)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


class Variant:
    """One thing timed at a cadence: ``call()`` makes one round trip; ``pid`` is the server
    whose CPU is counted; ``spin_s``: how long the server busy-polls after a call (the next
    variant waits that out, so that no variant runs beside another's spinning server)."""

    def __init__(self, name: str, pid: int, call: Callable[[], None], spin_s: float) -> None:
        self.name = name
        self.pid = pid
        self.call = call
        self.spin_s = spin_s
        self.times: dict[float, list[float]] = {}
        self.cpu: dict[float, tuple[float, float]] = {}  # gap -> (cpu seconds, wall seconds)

    def block(self, gap_s: float, n: int) -> None:
        times = self.times.setdefault(gap_s, [])
        # One call first, untimed: the first after the pause between blocks pays the server's
        # wake-up (the doorbell's case, docs/step-channel.md), which an engine at a steady
        # cadence does not; timed, it would be each block's first call: 1% of them, the p99.
        self.call()
        if gap_s:
            time.sleep(gap_s)
        cpu0, wall0 = _cpu_seconds(self.pid), time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            self.call()
            times.append(time.perf_counter() - t0)
            if gap_s:
                time.sleep(gap_s)
        cpu, wall = self.cpu.get(gap_s, (0.0, 0.0))
        self.cpu[gap_s] = (
            cpu + _cpu_seconds(self.pid) - cpu0,
            wall + time.perf_counter() - wall0,
        )
        if self.spin_s:
            time.sleep(self.spin_s + 0.02)  # its server's spin runs out before the next


@contextmanager
def echo_server(tmp: Path, spin_s: float) -> Iterator[Variant]:
    busy = spin_s > 0
    path = tmp / f"echo-{'busy' if busy else 'blocking'}.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO, str(path), str(spin_s)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_pinned(busy),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        frame = struct.pack("<I", FRAME - 4) + os.urandom(FRAME - 4)

        def call() -> None:
            client.sendall(frame)
            got = 0
            while got < FRAME:
                got += len(client.recv(FRAME - got))

        name = f"echo, {'busy-polling' if busy else 'blocking'} server"
        yield Variant(name, proc.pid, call, spin_s)
        client.close()
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def kvcm_server(
    tmp: Path,
    name: str,
    spin_s: float,
    steps: int,
    device: str = "cpu",
    map_slots: bool = False,
    ring: bool = False,
    stream_ordered: bool = False,
) -> Iterator[Variant]:
    """``kvcm serve`` on ``device`` with a step channel and room for 256 requests to grow by
    ``steps`` tokens each; the variant is the typed client's decode step over the channel
    (with the engine's slot mappings in the answer with ``map_slots``; through the
    shared-memory ring with ``ring``; answered without waiting for the device with
    ``stream_ordered``, on a CUDA sidecar that shares its tables)."""
    layers = tmp / "layers.json"
    layers.write_text(json.dumps([{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}]))
    sock = tmp / f"{len(list(tmp.glob('*.sock')))}.sock"
    seq = 32 + steps + 64
    blocks = REQUESTS * (-(-seq // 16)) + 64
    cmd = [sys.executable, "-m", "kvcm", "serve", "--port", "0", "--layers", str(layers)]
    cmd += ["--num-blocks", str(blocks), "--max-requests", str(REQUESTS)]
    cmd += ["--max-seq-len", str(seq), "--step-socket", str(sock), "--log-level", "warning"]
    cmd += ["--device", device]
    if spin_s:
        cmd += ["--step-spin-s", str(spin_s)]
    if stream_ordered:
        cmd += ["--share"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_pinned(spin_s > 0),
    )
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            if "serving on" in line:
                url = line.split("serving on", 1)[1].split()[0]
                break
        if url is None:
            raise RuntimeError(f"kvcm serve exited with {proc.wait()}")
        with KVCacheClient(url, step_socket=sock, step_ring=ring) as kv:
            out = kv.step_columns(
                allocate=[{"request_id": f"r{i}", "num_tokens": 32} for i in range(REQUESTS)]
            )
            handles = array("q", out.handles)
            if ring and not kv.ring_attached:
                raise RuntimeError(f"{name}: the service gave no ring")

            flags = {"map_slots": map_slots, "stream_ordered": stream_ordered}
            decode = (  # an engine's decode step (a tree from before it: its step_columns)
                partial(kv.decode_step, handles, **flags)
                if hasattr(kv, "decode_step")
                else partial(kv.step_columns, extend=handles, **flags)
            )

            def call() -> None:
                step = decode()
                if not step.ok:
                    raise RuntimeError(f"{name}: a decode step failed")

            yield Variant(name, proc.pid, call, spin_s)
    finally:
        proc.terminate()
        proc.wait(10)


def _row(v: Variant, gap: float, floor: Variant | None) -> str:
    t = np.asarray(v.times[gap]) * 1e6
    p50, p99, p999 = np.percentile(t, [50, 99, 99.9])
    cpu, wall = v.cpu[gap]
    ratio = "-"
    if floor is not None:
        f50, f99 = np.percentile(np.asarray(floor.times[gap]) * 1e6, [50, 99])
        ratio = f"{p50 / f50:.2f}x / {p99 / f99:.2f}x"
    return f"| {v.name} | {p50:.0f} | {p99:.0f} | {p999:.0f} | {ratio} | {cpu / wall:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gap-ms", type=float, default=5.0, help="the engine's cadence")
    parser.add_argument("--steps", type=int, default=2000, help="timed calls per variant")
    parser.add_argument("--spin-s", type=float, default=0.1, help="the busy-poll mode's spin")
    parser.add_argument("--quick", action="store_true", help="200 steps")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave the servers and the client unpinned"
    )
    parser.add_argument(
        "--one-client-cpu",
        action="store_true",
        help="the client on the first CPU alone (an engine pinned to a core), not on every CPU "
        "but the servers'",
    )
    parser.add_argument("--device", default="cpu", help="the sidecar's device (cuda:0: a GPU)")
    parser.add_argument(
        "--map-slots", action="store_true", help="the step answers the slot mappings too"
    )
    args = parser.parse_args()
    steps = 200 if args.quick else args.steps
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and not args.no_pin:
        PIN["server"] = {cpus[-1]}
        PIN["client"] = {cpus[0]} if args.one_client_cpu else set(cpus[:-1])
        os.sched_setaffinity(0, PIN["client"])
    gaps = [args.gap_ms / 1000, 0.0]
    with tempfile.TemporaryDirectory(prefix="kvcm-cad-") as name:
        tmp = Path(name)
        with (
            echo_server(tmp, 0.0) as blocking,
            echo_server(tmp, args.spin_s) as busy,
            kvcm_server(
                tmp, "kvcm step channel, default", 0.0, 3 * steps, args.device, args.map_slots
            ) as default,
            kvcm_server(
                tmp,
                "kvcm step channel, busy-poll mode",
                args.spin_s,
                3 * steps,
                args.device,
                args.map_slots,
            ) as spin,
            kvcm_server(
                tmp,
                "kvcm step ring (busy-poll mode, shared memory)",
                args.spin_s,
                3 * steps,
                args.device,
                args.map_slots,
                ring=True,
            ) as ring,
            (
                kvcm_server(
                    tmp,
                    "kvcm step ring, stream-ordered (no device wait)",
                    args.spin_s,
                    3 * steps,
                    args.device,
                    args.map_slots,
                    ring=True,
                    stream_ordered=True,
                )
                if args.device.startswith("cuda")
                else contextlib.nullcontext()
            ) as ordered,
        ):
            variants = [blocking, busy, default, spin, ring, *([ordered] if ordered else [])]
            for gap in gaps:
                for v in variants:  # warm-up
                    v.block(gap, 20)
                    v.times[gap].clear()
                    v.cpu[gap] = (0.0, 0.0)
                done = 0
                while done < steps:
                    n = min(BLOCK, steps - done)
                    for v in variants:
                        v.block(gap, n)
                    done += n
    floors = {default.name: blocking, spin.name: busy, ring.name: busy}
    if ordered is not None:
        floors[ordered.name] = busy
    print(f"# bench_cadence {platform.node()} {platform.processor() or platform.machine()}")
    pinned = f"busy servers on CPU {sorted(PIN['server'])}, client on {sorted(PIN['client'])}"
    print(pinned if PIN else "unpinned")
    mapped = " with map_slots" if args.map_slots else ""
    print(
        f"{REQUESTS}-request decode step_columns{mapped} on {args.device}; {steps} calls per "
        "variant and cadence"
    )
    for gap in gaps:
        cadence = f"a call every {gap * 1000:g} ms" if gap else "back to back"
        print(f"\n{cadence}")
        print("| variant | p50 us | p99 us | p99.9 us | / its echo, p50 / p99 | server CPU |")
        print("|---|---|---|---|---|---|")
        for v in variants:
            print(_row(v, gap, floors.get(v.name)))


if __name__ == "__main__":
    main()
