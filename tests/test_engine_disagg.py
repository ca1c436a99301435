"""A real model across two sidecars: prefill on one ``kvcm serve --transfer nixl``, decode on
another, each engine in its own process attached to its own sidecar's pools (and state
slots); the decode engine pulls each request's KV from the prefill sidecar, fetches the
shared system prompt from it for the requests that skipped prefill, and its greedy tokens
equal transformers' ``generate`` (kvcm_engine.disagg, docs/disaggregation.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import ROOT, serve_process

from kvcm_engine import HYBRIDS, hybrid_unsupported

pytest.importorskip("nixl_cu12", reason="the transfer extra (nixl-cu12) is not installed")

pytestmark = pytest.mark.slow  # two sidecars and two engine processes per model


def engine(role: str, url: str, token: str, handoffs: Path, model: str) -> dict[str, object]:
    env = {
        **os.environ,
        "KVCM_API_TOKEN": token,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "examples" / "engine"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcm_engine.disagg",
            role,
            "--sidecar",
            url,
            "--handoffs",
            str(handoffs),
            "--model",
            model,
            "--peer",
            "prefill",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sidecars() -> Iterator[tuple[str, str]]:
    """The two sidecars, started with no model: each model's engines register theirs (a new
    generation, so a new transfer agent, every time)."""
    with (
        serve_process(
            "--transfer",
            "nixl",
            "--transfer-name",
            "prefill",
            env={"KVCM_API_TOKEN": "tok-p"},
            model=False,
        ) as (prefill_url, _, _),
        serve_process(
            "--transfer",
            "nixl",
            "--transfer-name",
            "decode",
            "--peer",
            f"prefill={prefill_url}",
            env={"KVCM_API_TOKEN": "tok-d", "KVCM_PEER_TOKEN_PREFILL": "tok-p"},
            model=False,
        ) as (decode_url, _, _),
    ):
        yield prefill_url, decode_url


@pytest.mark.parametrize("model", ["llama", "gemma3", "qwen3_next"])
def test_prefill_and_decode_on_two_sidecars(
    model: str, sidecars: tuple[str, str], tmp_path: Path
) -> None:
    """Llama; Gemma-3 (sliding-window layers: the released window blocks are released on
    the decode side too); Qwen3-Next (state layers: the live state moves with the blocks,
    a fetch brings the peer's checkpoint)."""
    if model in HYBRIDS and (why := hybrid_unsupported()) is not None:
        pytest.skip(why)
    handoffs = tmp_path / "handoffs.json"
    prefill_url, decode_url = sidecars
    first = engine("prefill", prefill_url, "tok-p", handoffs, model)
    assert first["handed_off"] == first["requests"] == 9
    second = engine("decode", decode_url, "tok-d", handoffs, model)
    assert second["match"] == "12/12", second
    assert second["pulls"] == 9 and second["pull_failures"] == 0
    assert second["fetched_tokens"] > 0 and second["moved_blocks"] > 0
    for url in (prefill_url, decode_url):
        stats = httpx.get(f"{url}/v1/stats").json()
        # Every request gone (the prefill side's pins released by the pulls) and
        # every block back.
        assert stats["num_requests"] == 0, (url, stats)
        assert stats["request_free_blocks"] == stats["request_total_blocks"]
