"""The ``kvcm`` command: ``kvcm serve`` (the default) runs the sidecar, ``kvcm estimate`` sizes,
``kvcm router`` and ``kvcm route`` run and ask a router (``kvcm.router.cli``).

Every flag has a ``KVCM_<NAME>`` environment variable (flags win); see ``kvcm serve --help``.
With no model source ``kvcm serve`` starts without a model on http://127.0.0.1:8470 and waits
for one to be registered (``POST /v1/model``); ``--default-model`` serves the embedded default
model (Llama-3-8B-like, 1 GiB of KV on the CPU) instead. ``kvcm estimate`` sizes the default
model when given no source.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvcm_client.errors import KVCMError

from . import native
from .cli_support import CommandError, bind_tcp, text_table
from .router.cli import add_commands as add_router_commands
from .router.cli import run_route, run_router
from .server import unix_socket
from .server.settings import Settings
from .server.unix_socket import OwnSocket

if TYPE_CHECKING:
    from .manager import KVCacheManager

# torch, numpy and the manager are imported where they are used (estimate, serve), not here:
# "kvcm --help" and flag errors answer without loading them.

#: Flags shared by both commands: (flag, Settings field, argparse options).
_MODEL_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--config", {"type": Path, "help": "JSON ManagerConfig file"}),
    ("--layers", {"type": Path, "help": "JSON file with a list of layer specs"}),
    (
        "--model-config",
        {"type": Path, "dest": "hf_model_config", "help": "Hugging Face config.json"},
    ),
    (
        "--default-model",
        {
            "action": "store_const",
            "const": True,
            "help": "serve the embedded default model (Llama-3-8B-like) when no other source "
            "is given (default: no model until one is registered with POST /v1/model)",
        },
    ),
    ("--kv-dtype", {"help": "KV dtype (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, nvfp4)"}),
    ("--tensor-parallel", {"type": int, "help": "ranks the KV heads are split over"}),
    ("--memory", {"help": "KV budget, e.g. 8GiB or 512MiB"}),
    ("--host-memory", {"help": "a host tier for evicted cached blocks, e.g. 32GiB"}),
    ("--num-blocks", {"type": int, "help": "slots per pool group (instead of --memory)"}),
    ("--tokens-per-block", {"type": int}),
    ("--device", {"help": "cpu or cuda[:N]"}),
    ("--max-requests", {"type": int}),
    (
        "--max-seq-len",
        {
            "type": int,
            "help": "longest request in tokens (default 4096; with --model-config, the model's "
            "max_position_embeddings)",
        },
    ),
    (
        "--max-prefill-chunk",
        {"type": int, "help": "most new tokens one op adds (sizing; default: a whole prompt)"},
    ),
    ("--max-lookahead", {"type": int, "help": "draft slots per request (sizing; default 0)"}),
    (
        "--share",
        {
            "action": "store_const",
            "const": True,
            "help": "map pools and page tables for other processes (CUDA: IPC; needs CuPy)",
        },
    ),
    (
        "--no-share",
        {
            "action": "store_const",
            "const": False,
            "dest": "share",
            "help": "keep the pools private (default: POSIX shared memory on the CPU)",
        },
    ),
    (
        "--null-page",
        {
            "action": "store_const",
            "const": True,
            "help": "reserve slot 0 as a zeroed null page that tables show where there is no "
            "page, for kernels that read whole tiles of pages (the default, except for a "
            "--config file that does not turn it on)",
        },
    ),
    (
        "--no-null-page",
        {
            "action": "store_const",
            "const": False,
            "dest": "null_page",
            "help": "no null page: -1 where there is no page, every slot usable",
        },
    ),
    (
        "--no-kv-events",
        {
            "action": "store_const",
            "const": False,
            "dest": "kv_events",
            "help": "record no KV events (GET /v1/events answers kv_events_disabled): for a "
            "replica no router follows",
        },
    ),
]
_SERVE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--host", {"help": "bind address (default 127.0.0.1: loopback only)"}),
    ("--port", {"type": int, "help": "TCP port (default 8470; 0 picks a free one)"}),
    ("--uds", {"type": Path, "help": "serve on this Unix socket instead of TCP"}),
    (
        "--step-socket",
        {"type": Path, "help": "also serve the step channel on this Unix socket (0660)"},
    ),
    (
        "--step-poll-us",
        {
            "type": float,
            "help": "poll up to this long for a step channel client's next frame after an "
            "answer, where its last one came that soon (300; 0: never)",
        },
    ),
    (
        "--step-spin-s",
        {
            "type": float,
            "help": "busy-poll mode: after each answer poll this long for the step channel's "
            "next frame (e.g. 0.1; burns a core while steps come: pin the sidecar to its "
            "own; 0: off)",
        },
    ),
    (
        "--kv-events-zmq",
        {
            "help": "also publish KV events in vLLM's format on a ZeroMQ PUB socket bound "
            "here, e.g. tcp://127.0.0.1:5557 (needs pyzmq)"
        },
    ),
    (
        "--metrics-port",
        {"type": int, "help": "also serve /livez, /readyz, /metrics (only) on this TCP port"},
    ),
    ("--metrics-host", {"help": "bind address of --metrics-port (default 127.0.0.1)"}),
    ("--lease-ttl", {"type": float, "help": "default session lease in seconds (30)"}),
    (
        "--request-timeout",
        {"type": float, "help": "seconds a request may take to arrive whole (10)"},
    ),
    (
        "--max-body-bytes",
        {"type": int, "help": "request body limit (default: room for a max_seq_len prompt)"},
    ),
    (
        "--transfer",
        {
            "choices": ["nixl"],
            "help": "a transfer endpoint: peers pull this sidecar's KV and it pulls theirs "
            "(NIXL: pip install 'kvcm[transfer]'; needs KVCM_API_TOKEN; "
            "docs/disaggregation.md)",
        },
    ),
    ("--transfer-name", {"help": "this sidecar's name among its peers (default kvcm)"}),
    (
        "--peer",
        {
            "action": "append",
            "help": "a peer this sidecar may pull from, NAME=URL (repeatable); its token from "
            "KVCM_PEER_TOKEN_<NAME> or KVCM_PEER_TOKEN",
        },
    ),
    ("--log-level", {"help": "debug, info, warning, error"}),
    ("--access-log", {"action": "store_const", "const": True, "help": "log every request"}),
]
SERVE_FLAGS = [flag for flag, _ in _MODEL_FLAGS + _SERVE_FLAGS]


def _add(parser: argparse.ArgumentParser, flags: list[tuple[str, dict[str, Any]]]) -> None:
    for flag, options in flags:
        parser.add_argument(flag, **{"default": None, **options})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcm", description="kvcm: a KV-cache manager for LLM inference, run as a sidecar"
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the HTTP service (the default command)")
    _add(serve, _MODEL_FLAGS + _SERVE_FLAGS)
    estimate = sub.add_parser("estimate", help="print the layout and the sizing table")
    _add(estimate, _MODEL_FLAGS)
    estimate.add_argument(
        "--seq-len", type=int, action="append", help="sequence lengths to size (repeatable)"
    )
    add_router_commands(sub)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    skip = {"command", "seq_len"}
    given = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    # A budget flag replaces the other kind of budget from the environment.
    if "memory" in given:
        given.setdefault("num_blocks", None)
    if "num_blocks" in given:
        given.setdefault("memory", None)
    return Settings(**given)


def report(manager: KVCacheManager, seq_lens: list[int]) -> str:
    """The layout (layer groups, pool groups) and max requests per sequence length."""
    info = manager.describe()
    cfg = manager.config
    chunk = cfg.max_prefill_chunk or "whole prompts"
    out = [
        f"device {info.device}, {info.tokens_per_block} tokens per block; sized for ops of "
        f"at most {chunk} new tokens, lookahead {cfg.max_lookahead}"
    ]
    if info.dropped_layers:
        dropped = ", ".join(f"{d.layer_id} ({d.reason})" for d in info.dropped_layers)
        out[0] += f"; dropped layers: {dropped}"
    out.append(
        text_table(
            [["layer group", "layers", "window", "sink blocks", "pool group", "bytes/token"]]
            + [
                [
                    str(g.group_id),
                    str(len(g.layer_ids)),
                    str(g.sliding_window or "full"),
                    str(g.sink_blocks),
                    str(g.pool_group),
                    str(g.bytes_per_token),
                ]
                for g in info.layer_groups
            ]
        )
    )
    out.append(
        text_table(
            [["pool group", "slots", "slot bytes", "GiB"]]
            + [
                [
                    str(pg.pool_group_id),
                    str(pg.num_slots),
                    str(pg.slot_bytes),
                    f"{pg.num_slots * pg.slot_bytes / 2**30:.3f}",
                ]
                for pg in info.pool_groups
            ]
        )
    )
    rows = [["seq_len", "max requests", "limited by", "max tokens (one request)"]]
    for seq_len in seq_lens:
        est = manager.estimate(seq_len)
        rows.append([str(seq_len), str(est.max_requests), est.limited_by, str(est.max_tokens)])
    out.append(text_table(rows))
    return "\n\n".join(out)


#: The longest Unix socket path bind() takes (``sun_path``: 108 bytes on Linux, 104 elsewhere).
_SUN_PATH = 108 if sys.platform.startswith("linux") else 104


def check_socket_path(flag: str, path: Path) -> None:
    """Refuse, naming ``flag``, a Unix socket path that cannot be bound: bind() says only "No
    such file or directory" for a missing folder, and the step socket is bound in the
    application's startup, where a failure is a uvicorn traceback. Checked before the model is
    built, so that a wrong path fails at once."""
    folder = path.parent
    if not folder.exists():
        raise CommandError(
            f"{flag} {path}: the folder {folder} does not exist (create it, or choose another path)"
        )
    if not folder.is_dir():
        raise CommandError(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} {path}: cannot create a socket in {folder}: permission denied")
    size = len(os.fsencode(path))
    if size > _SUN_PATH:
        raise CommandError(
            f"{flag} {path}: too long for a Unix socket ({size} bytes, at most {_SUN_PATH}): "
            "choose a shorter path"
        )


def _bind(settings: Settings) -> tuple[socket.socket, str, OwnSocket | None]:
    """Bind the listening socket here, so ``--port 0`` can report the port it got. For
    ``--uds`` (its path checked already: ``check_socket_path``), also the socket file made,
    for ``serve`` to remove at exit."""
    if settings.uds is not None:
        path = settings.uds
        try:
            sock, own = unix_socket.bind(path, "--uds")
        except FileExistsError as exc:  # a live socket, or not a socket: the message says
            raise CommandError(str(exc)) from None
        except OSError as exc:
            raise CommandError(f"--uds {path}: cannot bind: {exc.strerror or exc}") from None
        return sock, f"unix:{path}", own
    sock, url = bind_tcp(settings.host, settings.port)
    return sock, url, None


def _say(line: str) -> None:
    """Print a status line; where stdout's reader is gone (``kvcm serve | head -1``), go on
    serving with stdout silenced instead of failing on the next line."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    """Point stdout at /dev/null once its reader is gone, so that nothing written later, nor
    the flush at exit, fails again (Python would print "Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a file descriptor (a test's capture)
        pass


def _app(settings: Settings) -> Any:
    """The app (``app_from_settings``), with a ZeroMQ bind failure or a missing pyzmq named as
    ``--kv-events-zmq``'s: pyzmq's own errors do not say which option they come from."""
    from .server.app import app_from_settings

    if settings.kv_events_zmq is None:
        return app_from_settings(settings)
    flag = f"--kv-events-zmq {settings.kv_events_zmq}"
    try:
        import zmq
    except ImportError:
        raise CommandError(f"{flag}: needs pyzmq (pip install pyzmq)") from None
    try:
        return app_from_settings(settings)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "address already in use (another kvcm? choose another address)"
        elif exc.errno == errno.EINVAL:
            why = "not an endpoint ZeroMQ can bind (e.g. tcp://127.0.0.1:5557)"
        else:
            why = str(exc.strerror or exc).lower()
        raise CommandError(f"{flag}: cannot bind: {why}") from None


def serve(settings: Settings) -> int:
    """Run the service until SIGTERM or SIGINT, then shut down gracefully and return 0.

    Both signals end alike, quietly, with 0, whenever they come (``_StopRequest`` before the
    server handles them): uvicorn would re-raise the signal after its shutdown, which kills the
    process by SIGTERM, and makes SIGINT a ``KeyboardInterrupt`` traceback out of the asyncio
    runner. The ``--uds`` socket file is removed at exit (the step channel removes its own);
    only the file this process created, never one that replaced it."""
    stop = _StopRequest()
    try:
        with stop.handling():
            return _serve(settings, stop)
    except KeyboardInterrupt:
        return 0


def _serve(settings: Settings, stop: _StopRequest) -> int:
    import uvicorn

    from .server.app import create_probe_app
    from .server.protocol import with_deadline

    class MainServer(uvicorn.Server):
        """The API server: at SIGTERM/SIGINT, open long-polls answer before uvicorn waits for
        connections to close (cut off, they would end as errors)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.kvcm.begin_shutdown()
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            """uvicorn's, less its re-raising of the signal once shut down: a stop that was
            asked for and done is a success, whichever of the two signals asked."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            if stop.requested:  # a signal during the start whose KeyboardInterrupt was lost
                self.handle_exit(signal.SIGTERM, None)
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    class ProbeServer(uvicorn.Server):
        """The probe listener: the main server owns the signals and stops it on exit."""

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    # The paths first: a wrong one fails at once, not after the model is built.
    if settings.uds is not None:
        check_socket_path("--uds", settings.uds)
    if settings.step_socket is not None:
        check_socket_path("--step-socket", settings.step_socket)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = _app(settings)
    if settings.uds is None and settings.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("kvcm").warning(
            "binding to %s: reachable beyond this host%s",
            settings.host,
            "" if settings.api_token else "; set KVCM_API_TOKEN to require a token",
        )
    if settings.step_socket is not None:
        try:  # a live one: refused here, before anything starts
            unix_socket.clear_stale(settings.step_socket, "--step-socket")
        except FileExistsError as exc:
            raise CommandError(str(exc)) from None
    sock, url, own = _bind(settings)
    probe_sock: socket.socket | None = None
    try:
        # Listen before printing the URL: a client that connects at once waits in the backlog
        # until the server accepts, instead of being refused.
        sock.listen(2048)
        config = uvicorn.Config(
            app,
            log_level=settings.log_level,
            access_log=settings.access_log,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=5,
            http=with_deadline(settings.request_timeout),
            workers=1,  # the pools and the state live in this one process
        )
        main = MainServer(config)
        probe: uvicorn.Server | None = None
        if settings.metrics_port is not None:
            probe_sock, probe_url = bind_tcp(
                settings.metrics_host, settings.metrics_port, "--metrics-port", "--metrics-host"
            )
            probe_sock.listen(128)
            probe = ProbeServer(
                uvicorn.Config(
                    create_probe_app(app),
                    log_level="warning",
                    lifespan="off",
                    http=with_deadline(settings.request_timeout),
                )
            )
            _say(f"kvcm: probes and metrics on {probe_url}")
        _say(f"kvcm: serving on {url}")
        _say(f"kvcm: step path in {native.summary()}")

        async def run() -> None:
            if probe is None:
                await main.serve(sockets=[sock])
                return
            probing = asyncio.create_task(probe.serve(sockets=[probe_sock]))
            try:
                await main.serve(sockets=[sock])
            finally:
                probe.should_exit = True
                await probing

        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(run())
    finally:
        sock.close()
        if probe_sock is not None:
            probe_sock.close()
        if own is not None:
            own.remove()
    return 0


class _StopRequest:
    """SIGINT and SIGTERM while the server does not handle them (starting, or done): each one
    is recorded and raises ``KeyboardInterrupt``, so that the start stops where it is and the
    ``finally`` blocks run (the socket file is removed); ``serve`` then ends quietly with 0.
    (SIGTERM's default action would kill the process on the spot, leaving the socket file;
    SIGINT's ``KeyboardInterrupt`` would end in a traceback.)

    A ``KeyboardInterrupt`` raised where Python ignores exceptions (a ``__del__``, a weakref
    callback) is lost, and the start would go on to serve: ``requested`` stays set, and the
    server stops as soon as it handles signals itself (``MainServer.capture_signals``)."""

    def __init__(self) -> None:
        self.requested = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Handle both signals inside this block (the main thread's only: signals are
        delivered there; elsewhere, as before)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._handler) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


#: Settings fields whose flag is not the field's name with dashes.
_FLAG_OF = {"hf_model_config": "--model-config", "api_token": "KVCM_API_TOKEN"}


def describe_errors(exc: ValidationError) -> str:
    """Validation errors for people: the flag (or variable), the rule and its stable type, one
    per line, with no input dumps or documentation links."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = [str(p) for p in err.get("loc", ())]
        field = loc[0] if loc else ""
        if exc.title == "Settings" and field:
            where = _FLAG_OF.get(field, "--" + field.replace("_", "-"))
            if len(loc) > 1:
                where += " (" + ".".join(loc[1:]) + ")"
        else:
            where = ".".join(loc) or "config"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{where}: {msg} ({err.get('type', 'invalid')})")
    return "\n  ".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the ``kvcm`` command ``argv`` and return its exit status: 0, or 2 for an error a
    person fixes (one line on stderr, no traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    if args.command == "router":
        return run_router(args)
    if args.command == "route":
        return run_route(args)
    try:
        if args.command == "estimate":
            return estimate(_settings(args), args.seq_len)
        return serve(_settings(args))
    except KeyboardInterrupt:
        # Ctrl-C on an estimate (serve handles its own): quietly, with the status a shell
        # gives a command SIGINT stopped.
        return 128 + signal.SIGINT
    except BrokenPipeError:
        if args.command != "estimate":  # serve silences its stdout itself (_say): a bug
            raise
        # stdout's reader left (kvcm estimate | head -1): it has what it wanted, and nothing
        # failed that a script should stop for (with set -o pipefail, a nonzero status would
        # fail a pipeline that did what was asked), so end quietly with 0.
        _silence_stdout()
        return 0
    except ValidationError as exc:
        print(f"kvcm: invalid config: {describe_errors(exc)}", file=sys.stderr)
        return 2
    except KVCMError as exc:
        print(f"kvcm: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"kvcm: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvcm: cannot {args.command}: {exc}", file=sys.stderr)
        return 2


def estimate(settings: Settings, seq_lens: list[int] | None) -> int:
    """``kvcm estimate``: print the layout and the sizing table (of the default model where
    ``settings`` name no source), and a warning where the budget is too small to serve."""
    from .manager import KVCacheManager

    if not settings.has_model:
        print("no model source given: sizing the embedded default model\n")
        settings = settings.model_copy(update={"default_model": True})
    config = settings.manager_config().model_copy(update={"share": False})
    manager = KVCacheManager(config, check_budget=False)
    longest = config.max_seq_len - config.max_lookahead
    sizes = seq_lens or sorted({min(n, longest) for n in (1024, 4096, longest)})
    print(report(manager, sizes))
    try:
        manager.check_budget()
    except KVCMError as exc:
        print(f"\nwarning: {exc.code}: {exc.message}")
    return 0
