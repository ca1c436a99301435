from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvcm.__main__ import main


def test_default_run_prints_layout_and_sizing(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "bytes/token" in out and "131072" in out  # 32 layers x 2 x 8 x 128 x 2 bytes
    assert "max requests" in out


def test_config_file_and_seq_len(tmp_path: Path) -> None:
    cfg = {
        "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 64}],
        "num_blocks": 10,
        "max_seq_len": 256,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    run = subprocess.run(
        [sys.executable, "-m", "kvcm", "--config", str(path), "--seq-len", "256"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [ln.split() for ln in run.stdout.splitlines()]
    # Window 64 with 16-token blocks costs 5 blocks per request: 10 slots hold 2.
    assert ["256", "2", "memory", "256"] in lines


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"layers": [], "num_blocks": 1}))
    run = subprocess.run(
        [sys.executable, "-m", "kvcm", "--config", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "invalid config" in run.stderr
