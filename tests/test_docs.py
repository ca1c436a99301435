"""The examples in README.md, client/README.md and docs/*.md run as written.

The conventions these tests hold every doc to:

- Every fence names its language (```python, ```bash, ```text, ...). A Python example is
  fenced as ``python`` (or ``py``, ``python3``), never as another language.
- Every Python block runs, in its doc's order, each in a fresh namespace, from the repository
  root. A block that cannot run here (it needs a server on a fixed port, say) is marked by an
  HTML comment on the line right above its opening fence, which states why:
  ``<!-- not run: needs the server started above -->``. A marked block must still compile.
  A marker that is not right above a Python fence is an error.
- In docs/*.md and client/README.md a line ``print(...)  # TEXT`` claims what it prints:
  TEXT, or TEXT followed by ": " or "; " and an explanation; and such a line must print.
  README.md's comments explain more than they quote: its examples' output has its own test.
- Shell blocks (bash, sh, shell, console) are parsed, not run (line continuations joined,
  comments dropped): every ``kvcm ...`` command (also ``python -m kvcm`` and
  ``bash scripts/run ...``, which passes its arguments to kvcm) must parse with
  ``kvcm.cli.build_parser()``, and a ``--uds`` or ``--step-socket`` socket's folder must exist
  or be made by a ``mkdir`` earlier in the block (kvcm does not make it).
- Every ``pip install``, in a shell block or an inline code span, installs kvcm and
  kvcm-client from a clone or git, never by name (they are on no package index), and one that
  installs torch (torch itself, kvcm, or kvcm-client's ``attach`` extra) pins it with
  ``-c constraints.txt``.
- No doc shows a private-range IPv4 address (10/8, 172.16/12, 192.168/16): examples use
  loopback or host names.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import ipaddress
import re
import shlex
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcm.cli import build_parser

pytestmark = pytest.mark.slow  # every doc example, some starting servers

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "client" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
# pip install options that take a value (the value is not a requirement).
PIP_VALUE_OPTIONS = {
    "-r",
    "--requirement",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--src",
    "--upgrade-strategy",
    "--platform",
    "--python-version",
    "--config-settings",
}


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its text, where its first line is in the doc."""

    path: Path
    lang: str
    text: str
    first_line: int  # 1-based line of the block's first content line
    not_run: str | None  # the marker's reason; None when unmarked


@dataclass(frozen=True)
class Doc:
    path: Path
    blocks: list[Block]
    prose: str  # the text outside fences (fenced lines blanked), for inline code spans
    stray_markers: list[int]  # lines of not-run markers right above no Python fence


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def parse_doc(path: Path, text: str | None = None) -> Doc:
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    prose: list[str] = []
    stray: list[int] = []  # 1-based lines
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        fence, lang = m["fence"], (m["info"].split() or [""])[0].lower()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence[0] * len(fence))
            and not lines[end].strip().lstrip(fence[0])
        ):
            end += 1
        marker = NOT_RUN.match(lines[i - 1]) if i and lang in PYTHON else None
        text = "\n".join(line.removeprefix(m["indent"]) for line in lines[i + 1 : end])
        reason = marker["reason"] if marker else None
        blocks.append(Block(path, lang, text + "\n", i + 2, reason))
        prose.extend([""] * (min(end, len(lines) - 1) - i + 1))
        i = end + 1
    for k, line in enumerate(lines):
        if NOT_RUN.match(line) and not (
            k + 1 < len(lines)
            and (m := FENCE.match(lines[k + 1]))
            and (m["info"].split() or [""])[0].lower() in PYTHON
        ):
            stray.append(k + 1)
    return Doc(path, blocks, "\n".join(prose), stray)


def test_the_docs_are_all_found() -> None:
    names = {rel(p) for p in DOCS}
    assert {"README.md", "client/README.md", "docs/service.md", "docs/router.md"} <= names


# -- Python blocks ------------------------------------------------------------------------


def claimed_output(block: Block) -> dict[tuple[int, int], str]:
    """Doc lines (first, last) of each ``print(...)  # TEXT`` call in the block -> TEXT."""
    comments = {
        tok.start[0]: tok.string.removeprefix("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(block.text).readline)
        if tok.type == tokenize.COMMENT
    }
    claims: dict[tuple[int, int], str] = {}
    for node in ast.walk(ast.parse(block.text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            end = node.end_lineno or node.lineno
            if node.func.id == "print" and end in comments:
                offset = block.first_line - 1
                claims[(node.lineno + offset, end + offset)] = comments[end]
    return claims


def claim_holds(printed: str, claim: str) -> bool:
    """The comment claims exactly the printed text, or it and then an explanation."""
    return claim == printed or (
        claim.startswith(printed) and claim[len(printed) :].startswith((": ", "; "))
    )


def run_block(block: Block) -> list[tuple[int, str]]:
    """Run a Python block as the doc shows it; return (doc line, text) of each print."""
    printed: list[tuple[int, str]] = []
    filename = str(block.path)

    def recording_print(
        *args: Any, sep: str | None = " ", end: str | None = "\n", **kw: Any
    ) -> None:
        print(*args, sep=sep, end=end, **kw)
        if kw.get("file") in (None, sys.stdout):
            frame = sys._getframe(1)
            while frame.f_code.co_filename != filename and frame.f_back is not None:
                frame = frame.f_back
            printed.append((frame.f_lineno, (sep or " ").join(map(str, args))))

    # Padded with blank lines so that tracebacks and frames name the doc's own line numbers.
    source = "\n" * (block.first_line - 1) + block.text
    namespace: dict[str, Any] = {"__name__": "__main__", "print": recording_print}
    exec(compile(source, filename, "exec"), namespace)
    return printed


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_doc_python_examples_run(
    path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    doc = parse_doc(path)
    for block in doc.blocks:
        if block.lang not in PYTHON:
            continue
        where = f"{rel(path)}:{block.first_line}"
        if block.not_run is not None:
            assert len(block.not_run) >= 10, f"{where}: say why the block does not run"
            compile(block.text, str(path), "exec")  # it must still be Python
            continue
        printed = run_block(block)
        if path.name == "README.md" and path.parent == ROOT:
            continue  # README.md's comments explain more than they quote: its own test
        for (first, last), claim in claimed_output(block).items():
            texts = [text for line, text in printed if first <= line <= last]
            assert texts, f"{rel(path)}:{first} never printed what its comment says: {claim!r}"
            for text in texts:
                assert claim_holds(text, claim), (
                    f"{rel(path)}:{first} prints {text!r}, its comment says {claim!r}"
                )


def test_not_run_markers_mark_python_blocks() -> None:
    for path in DOCS:
        assert parse_doc(path).stray_markers == [], (
            f"{rel(path)}: a not-run marker marks no Python block"
        )


def test_readme_example_prints_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = [b for b in parse_doc(ROOT / "README.md").blocks if b.lang in PYTHON]
    run_block(blocks[0])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "[0, -1, -1]"
    assert out[2] == "torch.Size([1, 64])"
    assert out[4] == "sequence_too_long"
    assert [text for _, text in run_block(blocks[1])] == ["True [0, 0, 0, 0]"]


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_fences_name_their_language(path: Path) -> None:
    for block in parse_doc(path).blocks:
        where = f"{rel(path)}:{block.first_line - 1}"
        assert block.lang, f"{where}: a fence without a language (```text for output)"
        if block.lang not in PYTHON:
            assert not looks_like_python(block.text), (
                f"{where}: a Python example fenced as {block.lang}"
            )


def looks_like_python(text: str) -> bool:
    """Valid Python that starts with an import: an example, whatever its fence says."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if not re.match(r"(from|import)\s", first):
        return False
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


# -- shell blocks and pip lines -----------------------------------------------------------


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", text)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        current: list[str] = []
        for token in lex:
            if token and set(token) <= set("();<>|&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    out = []
    for argv in commands:
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            argv = argv[1:]  # VAR=value before the command
        if argv:
            out.append(argv)
    return out


def kvcm_args(argv: list[str]) -> list[str] | None:
    """The arguments kvcm gets from this command, or None if it does not run kvcm."""
    name = Path(argv[0]).name
    if name == "kvcm":
        args = argv[1:]
    elif re.fullmatch(r"python[0-9.]*", name) and argv[1:3] == ["-m", "kvcm"]:
        args = argv[3:]
    elif (name in ("bash", "sh") and argv[1:2] == ["scripts/run"]) or argv[0] == "scripts/run":
        args = argv[2:] if name in ("bash", "sh") else argv[1:]
    else:
        return None
    # As kvcm.cli.main: no arguments, or a flag first, means "serve".
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["serve", *args]
    return args


def pip_install_args(argv: list[str]) -> list[str] | None:
    name = Path(argv[0]).name
    if name in ("pip", "pip3"):
        rest = argv[1:]
    elif re.fullmatch(r"python[0-9.]*", name) and argv[1:3] == ["-m", "pip"]:
        rest = argv[3:]
    else:
        return None
    return rest[1:] if rest[:1] == ["install"] else None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(spec: str) -> tuple[str, set[str], bool]:
    """(normalized name, extras, from a package index) of one requirement."""
    head, at, _url = spec.partition("@")
    if at and not head.strip().startswith((".", "/", "~")):  # name[extras] @ URL
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?\s*", head)
        assert m, f"cannot read the requirement {spec!r}"
        return _norm(m[1]), {_norm(e) for e in (m[2] or "").split(",") if e.strip()}, False
    if spec.startswith((".", "/", "~")) or "/" in spec.split("[")[0]:  # a folder
        folder, _, extras = spec.partition("[")
        where = (ROOT / folder).resolve()
        name = {ROOT: "kvcm", ROOT / "client": "kvcm-client"}.get(where, where.name)
        return name, {_norm(e) for e in extras.rstrip("]").split(",") if e.strip()}, False
    m = re.match(r"([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", spec)
    assert m, f"cannot read the requirement {spec!r}"
    return _norm(m[1]), {_norm(e) for e in (m[2] or "").split(",") if e.strip()}, True


def pip_problems(args: list[str]) -> list[str]:
    """What is wrong with ``pip install ARGS`` by the docs' rules (nothing: [])."""
    constrained = False
    specs: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "--constraint"):
            constrained |= i + 1 < len(args) and Path(args[i + 1]).name == "constraints.txt"
            i += 2
        elif arg.startswith("--constraint=") or re.match(r"-c[^-]", arg):
            value = arg.removeprefix("--constraint=") if arg.startswith("--") else arg[2:]
            constrained |= Path(value).name == "constraints.txt"
            i += 1
        elif arg in ("-e", "--editable"):
            specs.append(args[i + 1])
            i += 2
        elif arg in PIP_VALUE_OPTIONS:
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            specs.append(arg)
            i += 1
    problems = []
    for spec in specs:
        name, extras, from_index = requirement(spec)
        if from_index and name in ("kvcm", "kvcm-client"):
            problems.append(
                f"{spec!r}: {name} is on no package index; install it from a clone "
                "(pip install -c constraints.txt -e ./client -e .) or git"
            )
        torch = name in ("torch", "kvcm") or (name == "kvcm-client" and "attach" in extras)
        if torch and not constrained:
            problems.append(f"{spec!r} installs torch: pin it with -c constraints.txt")
    return problems


def parse_kvcm(args: list[str]) -> argparse.Namespace | str | None:
    """``kvcm ARGS`` parsed; the parser's complaint if it does not parse; None for --help."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        return (err.getvalue().strip().splitlines() or [f"exit status {exc.code}"])[-1]


def socket_folders(ns: argparse.Namespace) -> list[Path]:
    """The folders of the Unix sockets a parsed kvcm command binds."""
    paths = (getattr(ns, "uds", None), getattr(ns, "step_socket", None))
    return list(dict.fromkeys(Path(p).parent for p in paths if p))


def shell_problems(block: Block) -> list[str]:
    problems = []
    made: set[Path] = set()
    for argv in shell_commands(block.text):
        if Path(argv[0]).name == "mkdir":
            made |= {Path(a) for a in argv[1:] if not a.startswith("-")}
        args = kvcm_args(argv)
        parsed = parse_kvcm(args) if args is not None else None
        if isinstance(parsed, str):
            problems.append(f"{shlex.join(argv)}: {parsed}")
        elif parsed is not None:
            for folder in socket_folders(parsed):
                if not (folder in made or ("$" not in str(folder) and folder.is_dir())):
                    problems.append(
                        f"{shlex.join(argv)}: {folder} does not exist and the block "
                        "does not make it (mkdir -p)"
                    )
        pip = pip_install_args(argv)
        if pip is not None:
            problems += [f"{shlex.join(argv)}: {p}" for p in pip_problems(pip)]
    return problems


def inline_pip_commands(prose: str) -> list[list[str]]:
    """The ``pip install`` commands of a doc's inline code spans."""
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)
    commands = []
    for span in spans:
        text = " ".join(span.split())
        if re.match(r"(\S*/)?(pip3?|python[0-9.]* -m pip) install ", text):
            commands += shell_commands(text)
    return commands


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_doc_shell_commands_are_valid(path: Path) -> None:
    doc = parse_doc(path)
    problems = []
    for block in doc.blocks:
        if block.lang in SHELL:
            problems += [f"{rel(path)}:{block.first_line}: {p}" for p in shell_problems(block)]
    for argv in inline_pip_commands(doc.prose):
        pip = pip_install_args(argv)
        assert pip is not None
        problems += [f"{rel(path)}: `{shlex.join(argv)}`: {p}" for p in pip_problems(pip)]
    assert problems == []


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_docs_show_no_private_addresses(path: Path) -> None:
    found = []
    for match in re.finditer(r"(?<![\d.])\d{1,3}(?:\.\d{1,3}){3}(?![\d.])", path.read_text()):
        try:
            address = ipaddress.ip_address(match[0])
        except ValueError:
            continue
        if any(address in net for net in PRIVATE):
            found.append(match[0])
    assert found == [], f"{rel(path)}: use loopback or host names, not {found}"


# -- the checkers themselves --------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("pip install ./client", None),
        ("pip install 'kvcm-client @ git+https://example.com/kvcm#subdirectory=client'", None),
        ("pip install './client[attach]'", "installs torch"),
        ("pip install -c constraints.txt './client[attach]'", None),
        ("pip install 'kvcm[router]'", "on no package index"),
        ("pip install kvcm-client", "on no package index"),
        ("pip install -e ./client -e '.[router]'", "installs torch"),
        ("pip install -c constraints.txt -e ./client -e '.[router]'", None),
        (".venv/bin/python -m pip install -c constraints.txt -e .", None),
        ("python -m pip install torch", "installs torch"),
        ("pip install --constraint=constraints.txt torch", None),
        ("pip install -r requirements.txt", None),
    ],
)
def test_pip_rules(command: str, problem: str | None) -> None:
    (argv,) = shell_commands(command)
    args = pip_install_args(argv)
    assert args is not None
    found = pip_problems(args)
    assert (found == []) if problem is None else any(problem in p for p in found), found


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("kvcm serve --port 8470 --memory 4GiB", True),
        ("kvcm serve --port 8470 ...", False),
        ("kvcm serve --no-such-flag", False),
        ("bash scripts/run --port 8470   # comment: kvcm --bad", True),
        ("FOO=1 .venv/bin/kvcm estimate --seq-len 4096 &", True),
        ("python -m kvcm route --router http://127.0.0.1:8480", False),  # no prompt given
        ("kvcm route --router http://127.0.0.1:8480 --token-ids 1,2", True),
        ("kvcm serve --step-socket /no/such/folder/step.sock", False),
        ("mkdir -p /no/such/folder\nkvcm serve --step-socket /no/such/folder/step.sock", True),
        ("kvcm serve --uds kvcm.sock", True),
        ("kvcm --help", True),
        ("kvcm estimate --seq-len many", False),
        ("kvcm router --sidecar a=http://a:8470 \\\n  --redis-url redis://r:6379/0", True),
    ],
)
def test_shell_rules(text: str, ok: bool) -> None:
    problems = shell_problems(Block(ROOT / "x.md", "bash", text, 1, None))
    assert (problems == []) is ok, problems


def test_claims_and_markers() -> None:
    assert claim_holds("[1, 2, 3]", "[1, 2, 3]: block 0 is the null page")
    assert claim_holds("{0: 255}", "{0: 255}: 256 slots")
    assert not claim_holds("[1, 2, 3]", "[0, 1, 2]")
    assert not claim_holds("2", "20")
    doc = (
        "<!-- not run: needs a server -->\n```bash\nls\n```\n\n```\nx\n```\n"
        "<!-- not run: needs a GPU here -->\n```python\nimport cupy\n```\n"
        "<!-- not run: a blank line apart -->\n\n```python\nimport cupy\n```\n"
    )
    parsed = parse_doc(ROOT / "x.md", doc)
    assert parsed.stray_markers == [1, 13]
    assert [(b.lang, b.first_line, b.not_run) for b in parsed.blocks] == [
        ("bash", 3, None),
        ("", 7, None),
        ("python", 11, "needs a GPU here"),
        ("python", 16, None),
    ]
    assert looks_like_python("from kvcm_client import KVCacheClient\nKVCacheClient('x')\n")
    assert not looks_like_python("import the layouts as they are\n")
    assert not looks_like_python("rank  sidecar  hit tokens\n")
