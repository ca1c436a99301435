"""How ``kvcm`` fails and stops: errors that name what failed (an address, a flag, a path) in
one line without a traceback, SIGINT ending like SIGTERM, the socket files the service made
(and only those) removed at exit, a closed stdout, and the probe port's errors.

Process tests wait generously (the machine may be busy) and assert only what the code
guarantees, never how fast it does it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import serve_process

from kvcm.cli import main

pytestmark = pytest.mark.slow  # real kvcm serve processes: signals, sockets and start errors

FIXTURES = Path(__file__).parent / "fixtures" / "models"
#: Seconds a process test waits for a step whose speed it does not measure.
PATIENCE = 120


@pytest.fixture
def listening() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one line ``kvcm ARGV`` printed on stderr, asserting exit status 2 and no more."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


# -- errors that name what failed ----------------------------------------------------------------


def test_a_busy_port_names_the_address_and_the_flag(
    capsys: pytest.CaptureFixture[str], listening: int
) -> None:
    err = _error(capsys, ["serve", "--port", str(listening)])
    assert err == (
        f"kvcm: cannot listen on 127.0.0.1:{listening}: address already in use "
        "(another kvcm? choose another --port)"
    )
    # The probe port's own flag, once the API port is bound (and closed again).
    err = _error(capsys, ["serve", "--port", "0", "--metrics-port", str(listening)])
    assert err.endswith(
        f"127.0.0.1:{listening}: address already in use (another kvcm? "
        "choose another --metrics-port)"
    )


def test_a_busy_kv_events_endpoint_names_its_option(
    capsys: pytest.CaptureFixture[str], listening: int
) -> None:
    pytest.importorskip("zmq")
    endpoint = f"tcp://127.0.0.1:{listening}"
    err = _error(capsys, ["serve", "--port", "0", "--kv-events-zmq", endpoint])
    assert err.startswith(f"kvcm: --kv-events-zmq {endpoint}: cannot bind: address already in")


@pytest.mark.parametrize("flag", ["--uds", "--step-socket"])
def test_a_socket_path_in_a_missing_folder_names_the_flag_and_the_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str
) -> None:
    """Before: "No such file or directory" for ``--uds``, and a uvicorn startup traceback
    (exit status 3) for ``--step-socket``, bound in the application's startup."""
    folder = tmp_path / "no" / "such"
    err = _error(capsys, ["serve", "--port", "0", flag, str(folder / "kvcm.sock")])
    assert err == (
        f"kvcm: {flag} {folder / 'kvcm.sock'}: the folder {folder} does not exist (create it, "
        "or choose another path)"
    )


def test_a_uds_path_that_is_not_a_socket_is_refused_and_left_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    err = _error(capsys, ["serve", "--uds", str(path)])
    assert (
        err == f"kvcm: --uds {path}: exists and is not a socket (remove it, or choose another path)"
    )
    assert path.read_text() == "mine"


def test_a_zero_budget_names_the_flag_not_the_config_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = _error(capsys, ["estimate", "--memory", "0"])
    assert err.startswith("kvcm: invalid config: --memory: Input should be greater than 0")
    assert "memory_bytes" not in err
    monkeypatch.setenv("KVCM_HOST_MEMORY", "0")
    err = _error(capsys, ["estimate"])
    assert "--host-memory: Input should be greater than 0" in err and "_bytes" not in err


def _write(path: Path, content: object) -> Path:
    path.write_text(json.dumps(content))
    return path


MANAGER_CONFIG = {"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}], "num_blocks": 8}


@pytest.mark.parametrize(
    "flag,content,meant",
    [
        ("--config", "llama-3.1-8b.json", "--model-config"),
        ("--config", "gemma-3-4b-it.json", "--model-config"),  # a multimodal wrapper
        ("--config", MANAGER_CONFIG["layers"], "--layers"),
        ("--layers", MANAGER_CONFIG, "--config"),
        ("--model-config", MANAGER_CONFIG, "--config"),
    ],
)
def test_a_model_file_given_to_the_wrong_flag_names_the_right_one(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flag: str,
    content: object,
    meant: str,
) -> None:
    """Before: a Hugging Face config given to ``--config`` printed a line per key of it, and a
    list of layers a ``ValueError`` traceback; neither named the flag meant."""
    if isinstance(content, str):
        path = FIXTURES / content
    else:
        path = _write(tmp_path / "model.json", content)
    err = _error(capsys, ["estimate", flag, str(path)])
    assert err.startswith(f"kvcm: invalid_argument: {flag} {path} looks like ")
    assert f"give it with {meant} " in err


def test_a_kv_dtype_over_a_config_without_layers_is_an_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _write(tmp_path / "cfg.json", {"num_blocks": 8})
    err = _error(capsys, ["estimate", "--config", str(path), "--kv-dtype", "fp16"])
    assert err == "kvcm: invalid config: layers: Field required (missing)"


def test_an_estimate_whose_reader_left_ends_quietly_with_0() -> None:
    """``kvcm estimate | head -1``: the reader has what it asked for. Before: "kvcm: cannot
    serve: [Errno 32] Broken pipe" and status 2. Here stdout is a pipe whose reader is gone
    before it starts, so that every write fails, whatever the timing."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcm", "estimate"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=PATIENCE,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


# -- stopping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_stop_alike_and_remove_the_sockets(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C ends as SIGTERM does: a graceful shutdown, exit status 0, no traceback, and the
    socket files the service made removed. Before: SIGINT ended in a ``KeyboardInterrupt``
    traceback (status 130 in a shell), SIGTERM with death by the signal, both leaving the
    ``--uds`` file."""
    uds, step = tmp_path / "kvcm.sock", tmp_path / "step.sock"
    args = ("--uds", str(uds), "--step-socket", str(step))
    with serve_process(*args, uds=uds, model=False) as (_, proc, lines):
        assert uds.is_socket() and step.is_socket()
        proc.send_signal(sig)
        proc.wait(PATIENCE)
        proc.drain.join(PATIENCE)  # type: ignore[attr-defined]
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "Application shutdown complete" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert not uds.exists() and not step.exists()


def test_another_services_socket_is_neither_taken_over_nor_removed(tmp_path: Path) -> None:
    """A second ``kvcm serve`` on a live ``--uds`` or ``--step-socket`` is refused (it used
    to unlink the ``--uds`` one and serve there, cutting the first service off); and at exit
    a service removes its socket files only while they are still the ones it made."""
    uds, step = tmp_path / "kvcm.sock", tmp_path / "step.sock"
    args = ("--uds", str(uds), "--step-socket", str(step))
    with serve_process(*args, uds=uds, model=False) as (_, proc, lines):
        for flag, path, other_args in (
            ("--uds", uds, ()),
            ("--step-socket", step, ("--uds", str(tmp_path / "other.sock"))),
        ):
            second = subprocess.run(
                [sys.executable, "-m", "kvcm", "serve", *other_args, flag, str(path)],
                capture_output=True,
                text=True,
                timeout=PATIENCE,
            )
            assert second.returncode == 2 and "Traceback" not in second.stderr
            assert second.stderr.endswith(
                f"kvcm: {flag} {path}: another process serves on it (another kvcm? stop it, "
                "or choose another path)\n"
            )
        transport = httpx.HTTPTransport(uds=str(uds))
        with httpx.Client(base_url="http://kvcm", transport=transport) as http:
            assert http.get("/livez").status_code == 200  # the first one still has it
        # Someone removes the service's socket files and binds the paths for other servers.
        uds.unlink()
        step.unlink()
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other,
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other_step,
        ):
            other.bind(str(uds))
            other.listen(1)
            other_step.bind(str(step))
            other_step.listen(1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(PATIENCE)
            assert proc.returncode == 0, "".join(lines)
            for path in (uds, step):
                assert path.is_socket()  # the other servers': still there
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                    client.connect(str(path))  # and still theirs


#: ``kvcm serve`` with a signal sent to itself at a chosen point of its start (argv[1]):
#: "bound" (the --uds socket bound, the server not yet handling signals) or "lost" (the same,
#: with the ``KeyboardInterrupt`` swallowed, as one raised in a ``__del__`` is).
STOP_DURING_START = """
import os, signal, sys
import kvcm.native
where, sig, uds = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
summary = kvcm.native.summary
def stop_here():
    assert os.path.exists(uds)
    try:
        os.kill(os.getpid(), sig)
    except KeyboardInterrupt:
        if where != "lost":
            raise
    return summary()
kvcm.native.summary = stop_here
from kvcm.cli import main
raise SystemExit(main(["serve", "--uds", uds]))
"""


@pytest.mark.parametrize("where", ["bound", "lost"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_start_stops_it_quietly(tmp_path: Path, where: str, sig: str) -> None:
    """A signal before the server handles signals (the socket already bound) stops the start:
    status 0, no traceback, the socket file removed. Where its ``KeyboardInterrupt`` is lost,
    the server stops as soon as it handles signals, instead of serving on. Before: SIGTERM
    killed the process (socket left), SIGINT printed a traceback."""
    uds = tmp_path / "kvcm.sock"
    proc = subprocess.run(
        [sys.executable, "-c", STOP_DURING_START, where, sig, str(uds)],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert not uds.exists()
    started = "Application startup complete" in proc.stderr
    assert started == (where == "lost")  # (a lost one: it starts, then stops at once)


# -- the probe port ------------------------------------------------------------------------------


def test_the_probe_port_answers_unknown_paths_with_the_error_shape(tmp_path: Path) -> None:
    """docs/service.md: every error is ``{"code", "message", "detail"}``. Before, the probe
    port answered FastAPI's ``{"detail": "Not Found"}``."""
    args = ("--metrics-port", "0")
    with serve_process(*args, model=False) as (_, _proc, lines):
        probe = next(ln.split()[-1] for ln in lines if "probes and metrics on" in ln)
        missing = httpx.get(f"{probe}/v1/model", timeout=PATIENCE)
        assert missing.status_code == 404
        assert missing.json() == {
            "code": "not_found",
            "message": "no route /v1/model",
            "detail": {},
        }
        wrong = httpx.post(f"{probe}/livez", timeout=PATIENCE)
        assert wrong.status_code == 405 and wrong.json()["code"] == "method_not_allowed"
        assert "GET" in wrong.headers["allow"]
        assert httpx.get(f"{probe}/livez", timeout=PATIENCE).status_code == 200


def test_ctrl_c_on_scripts_run_reaches_the_service_and_ends_quietly(tmp_path: Path) -> None:
    """``bash scripts/run`` (the real script, with its setup step and the virtualenv's
    ``kvcm`` stubbed out) execs the service, so that the SIGINT a terminal sends reaches it
    and ends it as above."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/run").write_bytes((root / "scripts/run").read_bytes())
    (tmp_path / "scripts/setup").write_text("#!/usr/bin/env bash\n")  # installed already
    kvcm = tmp_path / ".venv/bin/kvcm"
    kvcm.parent.mkdir(parents=True)
    kvcm.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -m kvcm "$@"\n')
    kvcm.chmod(0o755)
    uds = tmp_path / "kvcm.sock"
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "scripts/run"), "serve", "--uds", str(uds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KVCM_DEFAULT_MODEL": "0"},  # no model: a quick start
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any("Application startup complete" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        out = "".join(lines) + proc.communicate(timeout=PATIENCE)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert not uds.exists()
