"""Print the CUDA IPC consumer's worst difference from dense attention (run on a GPU machine).

  python bench/shared_cuda_check.py     # starts kvcm serve --device cuda:0, maps it, decodes

The same check as tests/gpu/test_shared_cuda.py, with the figures printed for bench/RESULTS.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from servers import serve_process  # noqa: E402
from test_shared_consumer import decode_against_dense, write_config  # noqa: E402

from kvcm_client import KVCacheClient  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), "cuda:0")
        with serve_process("--config", str(config)) as (url, _, _):
            with KVCacheClient(url) as kv:
                layout = kv.pools()
            t0 = time.perf_counter()
            worst = decode_against_dense(url, steps=100)
            elapsed = time.perf_counter() - t0
    kinds = sorted({s.kind for s in layout.pools})
    print(f"device {layout.device}, segments {kinds}, {len(layout.pools)} pools")
    print(f"prefill + 100 decode steps, 3 requests, 4 layers: worst |paged - dense| = {worst:.2e}")
    print(f"wall time of the check: {elapsed:.1f} s")


if __name__ == "__main__":
    main()
