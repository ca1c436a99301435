"""``kvcm estimate`` and the model sources (flags, environment, files, HF configs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvcm import InvalidArgument
from kvcm.cli import _settings, build_parser, main
from kvcm.server.settings import Settings, parse_size

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def test_estimate_of_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no model source given: sizing the embedded default model\n")
    assert "bytes/token" in out and "131072" in out  # 32 layers x 2 x 8 x 128 x 2 bytes
    assert "max requests" in out


def test_estimate_with_a_config_file_and_seq_len(tmp_path: Path) -> None:
    cfg = {
        "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 64}],
        "num_blocks": 10,
        "max_seq_len": 256,
        "max_prefill_chunk": 1,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    run = subprocess.run(
        [sys.executable, "-m", "kvcm", "estimate", "--config", str(path), "--seq-len", "256"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [ln.split() for ln in run.stdout.splitlines()]
    # Window 64 with 16-token blocks costs 5 blocks per request: 10 slots hold 2.
    assert ["256", "2", "memory", "256"] in lines


@pytest.mark.parametrize(
    "content,needle",
    [
        ({"layers": [], "num_blocks": 1}, "invalid config"),
        ({"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}]}, "blocks_or_memory"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, content: object, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    run = subprocess.run(
        [sys.executable, "-m", "kvcm", "estimate", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and needle in run.stderr


def test_missing_and_non_json_files_are_errors_with_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--layers", str(tmp_path / "nope.json")]) == 2
    assert "invalid_argument" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["estimate", "--model-config", str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_sizes_parse_with_binary_and_decimal_units() -> None:
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2G") == 2 * 10**9
    assert parse_size("4096") == 4096
    with pytest.raises(InvalidArgument):
        parse_size("lots")


def test_flags_override_environment_which_overrides_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCM_MEMORY", "64MiB")
    monkeypatch.setenv("KVCM_TOKENS_PER_BLOCK", "32")
    monkeypatch.setenv("KVCM_PORT", "9000")
    s = Settings(tokens_per_block=8, default_model=True)
    cfg = s.manager_config()
    assert (cfg.memory_bytes, cfg.num_blocks, cfg.tokens_per_block) == (64 << 20, None, 8)
    assert (s.port, s.host) == (9000, "127.0.0.1")
    # A --num-blocks flag replaces the environment's memory budget; both at once is an error.
    cfg = _settings(
        build_parser().parse_args(["estimate", "--default-model", "--num-blocks", "100"])
    )
    assert (cfg.manager_config().memory_bytes, cfg.manager_config().num_blocks) == (None, 100)
    with pytest.raises(ValidationError, match="give one of memory"):
        Settings(num_blocks=100)


def test_layer_spec_file_and_kv_dtype_override(tmp_path: Path) -> None:
    path = tmp_path / "layers.json"
    path.write_text(json.dumps([{"layer_id": 3, "num_kv_heads": 2, "head_dim": 16}]))
    cfg = Settings(layers=path, kv_dtype="fp8_e4m3", num_blocks=4).manager_config()
    assert [(spec.layer_id, spec.dtype) for spec in cfg.layers] == [(3, "fp8_e4m3")]


def test_the_api_token_is_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_API_TOKEN", "s3cret-value")
    s = Settings()
    assert s.api_token is not None and s.api_token.get_secret_value() == "s3cret-value"
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.model_dump())


@pytest.mark.parametrize(
    "name,bytes_per_token,groups",
    [
        # 32 layers x K+V x 8 heads x 128 x 2 bytes (bf16)
        ("llama-3.1-8b.json", {0: 131072}, 1),
        # Gemma 2: 21 sliding (4096) + 21 full layers, 8 heads x 256, fp32 from torch_dtype
        ("gemma-2-9b.json", {0: 21 * 2 * 8 * 256 * 4, 1: 21 * 2 * 8 * 256 * 4}, 2),
        # gpt-oss: 12 sliding (128) + 12 full, 8 heads x 64, bf16
        ("gpt-oss-20b.json", {0: 12 * 2 * 8 * 64 * 2, 1: 12 * 2 * 8 * 64 * 2}, 2),
        # MLA: 27 key-only latents of 512 + 64 values, bf16
        ("deepseek-v2-lite.json", {0: 27 * 576 * 2}, 1),
    ],
)
def test_real_model_configs_give_the_expected_layout(
    name: str, bytes_per_token: dict[int, int], groups: int
) -> None:
    # max_seq_len would be the model's max_position_embeddings; 256 keeps the pools small.
    settings = Settings(hf_model_config=FIXTURES / name, num_blocks=16, max_seq_len=256)
    from kvcm import KVCacheManager

    m = KVCacheManager(settings.manager_config().model_copy(update={"share": False}))
    est = m.estimate(256)
    assert est.bytes_per_token == bytes_per_token
    assert len(m.layout.layer_groups) == groups


def test_window_patterns_and_tensor_parallel() -> None:
    from kvcm.model_config import UnsupportedModel, layers_from_hf_config

    gemma3 = {
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }
    layers = layers_from_hf_config({"text_config": gemma3}, tensor_parallel=2)
    assert [la.get("sliding_window") for la in layers] == ([1024] * 5 + [None]) * 2
    assert {la["num_kv_heads"] for la in layers} == {2}
    assert layers_from_hf_config(gemma3, tensor_parallel=8)[0]["num_kv_heads"] == 1  # replicated
    qwen = {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_size": 256,
        "sliding_window": 32,
        "use_sliding_window": True,
        "max_window_layers": 2,
    }
    assert [la.get("sliding_window") for la in layers_from_hf_config(qwen)] == [
        None,
        None,
        32,
        32,
    ]
    assert (
        layers_from_hf_config(qwen | {"use_sliding_window": False})[3].get("sliding_window") is None
    )
    assert layers_from_hf_config(qwen)[0]["head_dim"] == 64  # hidden 256 / 4 heads
    with pytest.raises(UnsupportedModel) as exc:
        layers_from_hf_config(qwen | {"layer_types": ["full_attention", "linear_attention"] * 2})
    assert exc.value.code == "unsupported_model" and exc.value.detail["layer_id"] == 1
    with pytest.raises(InvalidArgument):
        layers_from_hf_config(
            {"num_hidden_layers": 2, "num_attention_heads": 3, "head_dim": 8}, tensor_parallel=2
        )


def test_a_budget_below_one_max_seq_len_request_is_refused_by_serve_and_flagged_by_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The default model takes 128 KiB per token (2 MiB per block): 64 MiB are 32 slots, one of
    # them the null page, so they hold 31 blocks = 496 tokens; max_seq_len is 4096.
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcm",
            "serve",
            "--default-model",
            "--memory",
            "64MiB",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "insufficient_memory" in run.stderr
    assert "the largest max_seq_len this budget holds is 496" in run.stderr
    assert main(["estimate", "--memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "warning: insufficient_memory" in out and "holds is 496" in out
    # A max_seq_len the budget holds: no warning.
    assert main(["estimate", "--memory", "64MiB", "--max-seq-len", "496"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_estimate_reports_the_step_shape(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--max-prefill-chunk", "256", "--max-lookahead", "3", "--seq-len", "4000"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ops of at most 256 new tokens, lookahead 3" in out
    # 1 GiB = 512 slots of 2 MiB, 511 besides the null page; 4000 tokens + 3 draft slots take
    # 251 blocks: 2 requests. One request reaches max_seq_len less its draft slots (4093).
    assert ["4000", "2", "memory", "4093"] in [line.split() for line in out.splitlines()]


def test_serve_turns_the_null_page_on_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On for the embedded default, a layers file and an HF config; a ManagerConfig file says
    for itself; the flag and KVCM_NULL_PAGE override every source."""
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([{"layer_id": 0, "num_kv_heads": 2, "head_dim": 16}]))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"layers": json.loads(layers.read_text()), "num_blocks": 8}))
    hf = FIXTURES / "llama-3.1-8b.json"
    assert Settings(default_model=True).manager_config().null_page
    assert Settings(layers=layers).manager_config().null_page
    assert Settings(hf_model_config=hf).manager_config().null_page
    assert not Settings(config=plain).manager_config().null_page

    def parsed(*argv: str) -> bool:
        return _settings(build_parser().parse_args(["serve", *argv])).manager_config().null_page

    assert parsed("--config", str(plain), "--null-page")
    assert not parsed("--default-model", "--no-null-page")
    monkeypatch.setenv("KVCM_NULL_PAGE", "false")
    assert not parsed("--layers", str(layers))
    assert parsed("--layers", str(layers), "--null-page")  # the flag wins


def test_kv_events_are_on_unless_the_flag_the_env_or_a_registration_turns_them_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcm import KVCacheManager
    from kvcm.registration import to_config
    from kvcm_client.models import ModelRegistration

    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([{"layer_id": 0, "num_kv_heads": 2, "head_dim": 16}]))

    def parsed(*argv: str) -> Settings:
        return _settings(build_parser().parse_args(["serve", "--layers", str(layers), *argv]))

    assert parsed().manager_config().kv_events
    off = parsed("--no-kv-events")
    assert not off.manager_config().kv_events
    # A registered model takes the service's flag, unless it names its own.
    source = {"layers": json.loads(layers.read_text())}
    defaults = off.registration_defaults()
    assert not to_config(ModelRegistration.model_validate(source), defaults).kv_events
    own = ModelRegistration.model_validate(source | {"kv_events": True})
    assert to_config(own, defaults).kv_events
    # In process, the running manager lends its own.
    m = KVCacheManager(off.manager_config().model_copy(update={"share": False}))
    assert not m.register_model(layers=source["layers"], num_blocks=8).config.kv_events
    monkeypatch.setenv("KVCM_KV_EVENTS", "false")
    assert not parsed().manager_config().kv_events


def test_settings_errors_name_the_flag_without_pydantic_internals(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["estimate", "--max-requests", "-3"]) == 2
    err = capsys.readouterr().err
    assert "--max-requests: Input should be greater than 0" in err
    assert "pydantic" not in err and "http" not in err and "input_value" not in err
    for blank in ("", "  "):
        monkeypatch.setenv("KVCM_API_TOKEN", blank)
        assert main(["serve", "--port", "0"]) == 2  # refused before anything binds
        err = capsys.readouterr().err
        assert "KVCM_API_TOKEN is set but empty" in err


HEAVY = ("torch", "numpy", "cupy", "uvicorn", "fastapi")


def test_help_starts_without_torch_or_numpy() -> None:
    """``kvcm --help`` (and each command's) answers without importing torch, numpy or the
    server: a warm ``bash scripts/run --help`` takes a fraction of a second."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvcm", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "estimate" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()}
    assert "kvcm" in imported and not imported & set(HEAVY)
    probe = (
        "import sys\n"
        "from kvcm.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['estimate', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *HEAVY], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out.stderr
    import kvcm  # the lazy names still resolve

    assert kvcm.KVCacheManager.__module__ == "kvcm.manager" and "block_keys" in dir(kvcm)


def test_setup_runs_pip_only_when_the_install_changed(tmp_path: Path) -> None:
    """scripts/setup (run by scripts/run and scripts/test) skips pip when the stamp says the
    same pyproject files, constraints and extras are installed. The real script, with a fake
    interpreter that records what it is asked to run."""
    root = Path(__file__).resolve().parents[1]
    inputs = (
        "scripts/setup",
        "pyproject.toml",
        "setup.py",
        "service/kvcm/csrc/decode.c",
        "client/pyproject.toml",
        "constraints.txt",
    )
    for name in inputs:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((root / name).read_bytes())
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake-python"
    # "-m venv DIR" makes DIR/bin/python (this same fake); anything else is logged.
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; '
        "exit 0; fi\n"
        'if [ "$1" = --version ]; then echo Python 3.11; exit 0; fi\n'
        f'echo "$*" >>{log}\n'
    )
    fake.chmod(0o755)

    def setup(*args: str, **env: str) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        proc = subprocess.run(
            ["bash", "scripts/setup", *args],
            cwd=tmp_path,
            env={**os.environ, "PYTHON": str(fake), "KVCM_SETUP_FORCE": "0", **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return log.read_text().splitlines()[len(before) :] if log.exists() else []

    first = setup("test")
    assert [c.split()[-1] for c in first] == ["./client", ".[test]"]
    assert all(c.startswith("-m pip install") and "-c constraints.txt" in c for c in first)
    assert (tmp_path / ".venv/.kvcm-setup-stamp").read_text().splitlines()[1] == "test"
    assert setup("test") == []  # nothing changed: no pip
    assert setup() == []  # scripts/run: fewer extras than installed
    assert [c.split()[-1] for c in setup("gpu")] == ["./client", ".[gpu,test]"]
    assert setup("test,gpu") == [] and setup("gpu") == []
    with (tmp_path / "constraints.txt").open("a") as f:
        f.write("# changed\n")
    assert [c.split()[-1] for c in setup()] == ["./client", ".[gpu,test]"]
    assert setup() == []
    with (tmp_path / "service/kvcm/csrc/decode.c").open("a") as f:
        f.write("/* changed */\n")  # the C core is rebuilt by pip
    assert [c.split()[-1] for c in setup()] == ["./client", ".[gpu,test]"]
    assert setup() == []
    assert len(setup(KVCM_SETUP_FORCE="1")) == 2
