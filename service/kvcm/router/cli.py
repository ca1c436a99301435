"""``kvcm router`` (run a router) and ``kvcm route`` (ask one), as subcommands of ``kvcm``.

Every ``kvcm router`` flag has a ``KVCM_ROUTER_<NAME>`` environment variable (flags win;
``KVCM_ROUTER_SIDECARS`` is comma-separated). The router calls the sidecars with
``KVCM_API_TOKEN`` when it is set (their events and snapshots need it then).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8480
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

#: (flag, argparse options); the default comes from KVCM_ROUTER_<FLAG> when set.
_ROUTER_FLAGS: list[tuple[str, dict[str, Any]]] = [
    (
        "--sidecar",
        {
            "action": "append",
            "dest": "sidecars",
            "help": "a sidecar to follow: URL or NAME=URL (repeatable; the name defaults to "
            "the URL)",
        },
    ),
    (
        "--redis-url",
        {
            "help": "keep the index in this Redis, e.g. redis://127.0.0.1:6379/0 (default: in "
            "this process; needs the router extra)"
        },
    ),
    ("--namespace", {"default": "kvcm", "help": "prefix of the router's Redis keys (kvcm)"}),
    ("--host", {"default": "127.0.0.1", "help": "bind address (default 127.0.0.1)"}),
    ("--port", {"type": int, "default": DEFAULT_PORT, "help": "TCP port (8480; 0 picks one)"}),
    (
        "--tokens-per-block",
        {"type": int, "help": "refuse sidecars with other block sizes (default: the first's)"},
    ),
    ("--poll-timeout", {"type": float, "default": 5.0, "help": "long-poll seconds (5)"}),
    ("--stats-interval", {"type": float, "default": 1.0, "help": "stats poll seconds (1)"}),
    ("--upkeep-interval", {"type": float, "default": 1.0, "help": "store check seconds (1)"}),
    ("--sweep-interval", {"type": float, "default": 10.0, "help": "Redis sweep seconds (10)"}),
    (
        "--lease",
        {
            "type": float,
            "default": 60.0,
            "help": "seconds a sidecar no router follows keeps its Redis entries (60)",
        },
    ),
    ("--max-body-bytes", {"type": int, "help": "request body limit (4 MiB)"}),
    ("--log-level", {"default": "info", "help": "debug, info, warning, error"}),
]


def _env_default(flag: str, options: dict[str, Any]) -> dict[str, Any]:
    name = "KVCM_ROUTER_" + flag.removeprefix("--").replace("-", "_").upper()
    if flag == "--sidecar":
        name = "KVCM_ROUTER_SIDECARS"
    value = os.environ.get(name)
    if value is None:
        return options
    if flag == "--sidecar":
        return {**options, "default": [s for s in value.split(",") if s]}
    convert = options.get("type", str)
    return {**options, "default": convert(value)}


def add_commands(sub: Any) -> None:
    """The ``router`` and ``route`` subcommands of ``kvcm``."""
    router = sub.add_parser("router", help="follow sidecars and score them for prompts")
    for flag, options in _ROUTER_FLAGS:
        router.add_argument(flag, **_env_default(flag, options))
    route = sub.add_parser("route", help="ask a router which sidecars hold a prompt")
    route.add_argument(
        "--router",
        default=os.environ.get("KVCM_ROUTER_URL", f"http://127.0.0.1:{DEFAULT_PORT}"),
        help="the router's URL (KVCM_ROUTER_URL)",
    )
    prompt = route.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--token-ids", help="token ids, comma- or space-separated")
    prompt.add_argument("--token-ids-file", type=Path, help="a JSON list of token ids (- stdin)")
    prompt.add_argument("--block-keys", help="block keys in hex, comma-separated")
    route.add_argument("--lora-id", help="LoRA id (an int if it is digits)")
    route.add_argument("--cache-salt")
    route.add_argument("--json", action="store_true", help="print the router's answer as JSON")


def _sidecars(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        name, given, url = spec.partition("=")
        if not given or "://" in name:  # a bare URL (which may hold an "=" itself)
            name = url = spec
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--sidecar {spec!r}: not an http(s) URL")
        if name in out:
            raise ValueError(f"--sidecar {name!r} given twice")
        out[name] = url.rstrip("/")
    return out


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvcm_client import AsyncKVCacheClient

    from ..cli_support import bind_tcp
    from ..server.protocol import with_deadline
    from .app import DEFAULT_BODY_LIMIT, create_router_app
    from .follower import Follower
    from .keyspace import ModelGate
    from .memory_store import MemoryStore
    from .redis_store import RedisStore
    from .service import Router
    from .store import IndexStore

    try:
        sidecars = _sidecars(args.sidecars or [])
        if not _NAMESPACE.fullmatch(args.namespace):
            raise ValueError(f"--namespace {args.namespace!r}: use letters, digits, _ . -")
    except ValueError as exc:
        print(f"kvcm router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per long-poll otherwise
    store: IndexStore = (
        MemoryStore()
        if args.redis_url is None
        else RedisStore(args.redis_url, args.namespace, lease_s=args.lease)
    )
    gate = ModelGate(args.tokens_per_block)
    followers = [
        Follower(
            name,
            url,
            AsyncKVCacheClient(url, retries=0, timeout=10.0),
            store,
            gate,
            poll_s=args.poll_timeout,
            stats_s=args.stats_interval,
        )
        for name, url in sidecars.items()
    ]
    router = Router(
        store, gate, followers, upkeep_s=args.upkeep_interval, sweep_s=args.sweep_interval
    )
    app = create_router_app(router, max_body_bytes=args.max_body_bytes or DEFAULT_BODY_LIMIT)
    try:
        sock, url = bind_tcp(args.host, args.port)
    except OSError as exc:
        print(f"kvcm router: cannot serve: {exc}", file=sys.stderr)
        return 2
    sock.listen(1024)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        http=with_deadline(10.0),
    )
    where = "in process" if args.redis_url is None else f"in redis (namespace {args.namespace})"
    print(f"kvcm router: index {where}; serving on {url}", flush=True)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0


def _token_ids(args: argparse.Namespace) -> list[int] | None:
    if args.token_ids is not None:
        return [int(t) for t in re.split(r"[,\s]+", args.token_ids.strip()) if t]
    if args.token_ids_file is not None:
        path = args.token_ids_file
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        ids = json.loads(text)
        if not isinstance(ids, list):
            raise ValueError("--token-ids-file must hold a JSON list of token ids")
        return ids
    return None


def run_route(args: argparse.Namespace) -> int:
    from kvcm_client.errors import KVCMError
    from kvcm_client.router import RouterClient

    from ..cli_support import text_table

    try:
        token_ids = _token_ids(args)
    except (ValueError, OSError) as exc:
        print(f"kvcm route: {exc}", file=sys.stderr)
        return 2
    keys = None if args.block_keys is None else [k for k in args.block_keys.split(",") if k]
    lora: int | str | None = args.lora_id
    if lora is not None and lora.isdigit():
        lora = int(lora)
    try:
        with RouterClient(args.router) as client:
            result = client.route(
                token_ids, block_keys=keys, lora_id=lora, cache_salt=args.cache_salt
            )
    except KVCMError as exc:
        print(f"kvcm route: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(result.model_dump_json(indent=2))
        return 0
    rows = [["rank", "sidecar", "hit tokens", "device blocks", "free blocks", "running"]]
    for i, s in enumerate(result.scores, 1):
        rows.append(
            [
                str(i),
                s.sidecar,
                str(s.hit_tokens),
                str(s.device_hit_blocks),
                "?" if s.free_blocks is None else str(s.free_blocks),
                "?" if s.running_requests is None else str(s.running_requests),
            ]
        )
    print(
        f"{result.num_blocks} reusable blocks of {result.tokens_per_block} tokens; "
        f"{len(result.scores)} sidecars, best first"
    )
    print(text_table(rows))
    return 0
