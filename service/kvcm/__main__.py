"""``kvcm``: print the layout and the sizing table of a model spec.

With no arguments it uses the embedded default spec (a Llama-3-8B-like model: 32 full-attention
layers, 8 KV heads x 128, bf16, 1 GiB of KV on the CPU). ``--config FILE`` reads a JSON
``ManagerConfig``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from kvcm_client.errors import KVCMError
from kvcm_client.models import ManagerConfig

from .manager import KVCacheManager

DEFAULT_CONFIG: dict[str, object] = {
    "layers": [{"layer_id": i, "num_kv_heads": 8, "head_dim": 128} for i in range(32)],
    "tokens_per_block": 16,
    "device": "cpu",
    "max_requests": 256,
    "max_seq_len": 8192,
    "memory_bytes": 1 << 30,
}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(manager: KVCacheManager, seq_lens: list[int]) -> str:
    info = manager.describe()
    out = [f"device {info.device}, {info.tokens_per_block} tokens per block"]
    out.append(
        _table(
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
        _table(
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
    out.append(_table(rows))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcm", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="JSON ManagerConfig (default: embedded)")
    parser.add_argument(
        "--seq-len", type=int, action="append", help="sequence lengths to estimate (repeatable)"
    )
    args = parser.parse_args(argv)
    raw = json.loads(args.config.read_text()) if args.config else DEFAULT_CONFIG
    try:
        manager = KVCacheManager(ManagerConfig.model_validate(raw))
        seq_lens = args.seq_len or sorted({1024, 4096, manager.config.max_seq_len})
        print(report(manager, seq_lens))
    except ValidationError as exc:
        print(f"kvcm: invalid config: {exc}", file=sys.stderr)
        return 2
    except KVCMError as exc:
        print(f"kvcm: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
