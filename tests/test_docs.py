"""README.md and docs/: their commands run, their links stay in the repository, their tables are recorded.

Every fenced ``bash`` block carries one mark after the language (```` ```bash runnable ````):

* ``runnable``: run as written from the repository root, with this interpreter's ``bin/`` first on ``PATH`` (as
  after ``source .venv/bin/activate``); it must exit 0.
* ``server``: run the same way while ``jaxserve serve --port 8000`` (the documented command) is up; when port
  8000 is taken, the server gets a free port and the block's ``127.0.0.1:8000`` is rewritten to it.
* ``fresh-clone`` (``make run`` / ``make test``, which install into ``.venv``), ``needs-server`` (a server left
  running), ``needs-gpu``, ``needs-tpu``, ``needs-hosts``, ``needs-minutes`` (a TPU compile that
  ``tests/test_aot.py`` covers), ``needs-cluster`` (kubectl and a Kubernetes cluster; ``tests/test_deploy.py`` checks
  the manifests): not run here.

Every ``jaxserve`` command of every block, run or not, must parse with the real command-line parser, and every
``jaxserve SUBCOMMAND`` the README names must answer ``--help``. ``python`` blocks marked ``runnable`` run in order in
one interpreter per file; those marked ``server`` run against the server.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import DEFAULT_ENGINE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
RUN_TAGS = {"runnable", "server"}
OTHER_TAGS = {"fresh-clone", "needs-server", "needs-gpu", "needs-tpu", "needs-hosts", "needs-minutes", "needs-cluster"}
SERVE_COMMAND = "jaxserve serve --port 8000"
BLOCK_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    tags: tuple[str, ...]
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append(Block(path, start, m.group(1), tuple(m.group(2).split()), "\n".join(body) + "\n"))
        i += 1
    return out


BLOCKS = [b for path in DOCS for b in _blocks(path)]
BASH = [b for b in BLOCKS if b.lang == "bash"]


def _prose(path: Path) -> str:
    """The text outside fenced blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", _prose_code(path))


def _prose_code(path: Path) -> str:
    """The text outside fenced blocks (inline code kept)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def _commands(text: str) -> list[list[str]]:
    """The simple commands of a bash block (continuations joined, comments dropped, split at | && || ;), without
    leading environment assignments."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        cmd: list[str] = []
        for tok in shlex.split(line, comments=True) + ["|"]:
            if tok in ("|", "||", "&&", ";", "&"):
                while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def _jaxserve_args(cmd: list[str]) -> list[str] | None:
    if cmd[0] == "jaxserve":
        return cmd[1:]
    if cmd[:3] in (["python", "-m", "jaxserve"], ["python3", "-m", "jaxserve"]):
        return cmd[3:]
    return None


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(argv: list[str], block: Block, timeout: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode}):\n{block.text}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    )
    return result


# ---------------------------------------------------------------------------------------------------- static checks
def test_readme_starts_with_the_two_commands():
    first = README.read_text().lstrip().splitlines()[0]
    assert first.startswith("```bash"), first
    assert [c[:2] for c in _commands(_blocks(README)[0].text)] == [["make", "run"], ["make", "test"]]


def test_nothing_points_at_shared_or_outside_the_repository():
    for path in DOCS:
        text = path.read_text()
        assert "shared/" not in text, path
        prose = _prose(path)
        assert not re.search(r"https?://", prose), f"{path}: a link outside the repository"
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            assert not re.match(r"^[a-z]+:", target), f"{path}: {target}"
            assert (path.parent / target.split("#")[0]).exists(), f"{path}: broken link {target}"


def test_docs_are_linked_from_the_readme():
    readme = README.read_text()
    for path in DOCS[1:]:
        assert f"docs/{path.name}" in readme, f"README does not link docs/{path.name}"


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.id)
def test_bash_block_is_marked_and_its_jaxserve_commands_parse(block):
    from jaxserve.cli import build_parser

    assert len(block.tags) == 1 and block.tags[0] in RUN_TAGS | OTHER_TAGS, f"{block.id}: mark it ({block.tags})"
    for cmd in _commands(block.text):
        args = _jaxserve_args(cmd)
        if args is None:
            continue
        try:
            build_parser().parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{block.id}: {shlex.join(cmd)} does not parse (exit {e.code})")


def test_readme_subcommands_answer_help():
    named = set()
    commands = [cmd for b in _blocks(README) if b.lang == "bash" for cmd in _commands(b.text)]
    for span in re.findall(r"`([^`\n]*)`", _prose_code(README)):
        if re.match(r"^(python3? -m )?jaxserve [a-z]", span):
            commands.append(shlex.split(span))
    for cmd in commands:
        args = _jaxserve_args(cmd)
        if args and re.match("^[a-z]+$", args[0]):
            named.add(" ".join(args[:2]) if args[0] == "bench" else args[0])
    assert {"generate", "chat", "convert", "serve", "bench serve", "plan"} <= named
    for sub in sorted(named):
        result = subprocess.run(
            [str(BIN / "jaxserve"), *sub.split(), "--help"], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"jaxserve {sub} --help: {result.stderr[-2000:]}"


def test_readme_lists_every_engine_setting():
    from jaxserve.config import EngineConfig

    readme = README.read_text()
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f"`{f.name}`" not in readme]
    assert not missing, f"README's engine settings lack {missing}"


def test_benchmark_tables_are_recorded_in_results():
    results = set((ROOT / "bench" / "RESULTS.md").read_text().splitlines())
    rows = [line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines() if line.startswith("|")]
    assert len(rows) > 40
    stale = [row for row in rows if row not in results]
    assert not stale, f"rows of docs/benchmarks.md not in bench/RESULTS.md (copy the latest tables): {stale[:3]}"


def _make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """The Makefile's rules: target -> (prerequisites, recipe lines), ``$(VENV)`` as ``.venv``."""
    rules, targets = {}, []
    for line in (ROOT / "Makefile").read_text().replace("$(VENV)", ".venv").splitlines():
        if line.startswith("\t"):
            for t in targets:
                rules[t][1].append(line.strip())
            continue
        m = re.match(r"^([^\s:=#][^:=]*?)\s*:(?!=)\s*(.*)$", line)
        targets = m.group(1).split() if m and "=" not in m.group(2) else []  # not a target-specific variable
        for t in targets:
            rules[t] = (m.group(2).split("#")[0].split(), [])
    return rules


def _installed_extras(rules, target: str) -> set[str]:
    """The extras of this project that ``make TARGET`` pip-installs (``-e '.[a,b]'``), through its prerequisites."""
    prereqs, recipe = rules.get(target, ([], []))
    extras = set()
    for line in recipe:
        for spec in re.findall(r"-e\s+['\"]?\.\[([\w,-]+)\]", line):
            extras |= set(spec.split(","))
    for p in prereqs:
        extras |= _installed_extras(rules, p)
    return extras


def test_make_run_installs_what_the_readme_commands_need():
    """The README's commands run in the .venv that ``make run`` (its first block) installs: ``jaxserve bench serve``
    imports httpx, so ``make run`` installs the extra that provides it. Without it the README's block failed with
    "jaxserve bench serve needs httpx" in an environment ``make run`` made."""
    import inspect

    from jaxserve.benchmarks import serve

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")

    assert ["make", "run"] in [c[:2] for c in _commands(_blocks(README)[0].text)]
    readme_commands = [c for b in _blocks(README) if b.lang == "bash" for c in _commands(b.text)]
    assert any(_jaxserve_args(c)[:2] == ["bench", "serve"] for c in readme_commands if _jaxserve_args(c))
    needed = set(re.findall(r'_require\("(\w+)"\)', inspect.getsource(serve.main))) - {"matplotlib"}  # --plot's
    assert "httpx" in needed
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    providing = {
        m: {e for e, reqs in extras.items() if e != "dev" and any(re.match(rf"{m}\b", r) for r in reqs)} for m in needed
    }
    installed = _installed_extras(_make_rules(), "run")
    missing = {m: sorted(e) for m, e in providing.items() if not e & installed}
    assert not missing, f"make run installs the extras {sorted(installed)}; jaxserve bench serve needs {missing}"


@pytest.mark.multidevice  # the engine's refusal of 4 stages for 30 layers comes once 4 devices exist
def test_parallelism_split_says_what_the_engine_serves():
    """docs/parallelism.md's "The split" gives an example split (L layers over S stages): jaxserve plan's stage sizes
    as written, and, where the engine refuses it, the engine's own error quoted word for word."""
    from jaxserve import LLM
    from jaxserve.parallel.pipeline import stage_layers

    (para,) = [
        p for p in (ROOT / "docs" / "parallelism.md").read_text().split("\n\n") if p.startswith("**The split.**")
    ]
    para = " ".join(para.split())
    layers, stages, sizes = re.search(r"(\d+) layers over (\d+) stages: ([\d, ]+\d)", para).groups()
    layers, stages = int(layers), int(stages)
    assert [len(r) for r in stage_layers(layers, stages)] == [int(n) for n in sizes.split(", ")], para
    assert layers == 30, "the example is the default model's 30 layers"
    try:
        LLM(pipeline_parallel_size=stages, **DEFAULT_ENGINE)  # the weights are not read: refused before, or not at all
    except ValueError as e:
        assert f"`{e}`" in para, (
            f"the engine refuses {layers} layers over {stages} stages with:\n{e}\nnot quoted in:\n{para}"
        )
    else:
        pytest.fail(f"{layers} layers over {stages} stages were served; expected the doc's refusal")


# ---------------------------------------------------------------------------------------------------- running them
@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BASH if b.tags == ("runnable",)], ids=lambda b: b.id)
def test_runnable_bash_block(block):
    commands = _commands(block.text)
    if commands and all(cmd[0] == "pytest" for cmd in commands):
        # A block of pytest commands selects tests of this suite, which this run executes anyway: each command
        # must select at least one test (collected, as the documented command would run them), not run them twice.
        for cmd in commands:
            out = _run([str(BIN / "pytest"), *cmd[1:], "--collect-only", "-p", "no:cacheprovider"], block).stdout
            selected = re.search(r"^(\d+)(?:/\d+)? tests? collected", out, flags=re.M)
            assert selected and int(selected.group(1)) > 0, (
                f"{block.id}: {shlex.join(cmd)} selects no test:\n{out[-3000:]}"
            )
        return
    _run(["bash", "-euo", "pipefail", "-c", block.text], block)


PY_FILES = sorted({b.path for b in BLOCKS if b.lang == "python" and b.tags == ("runnable",)})


def _py_file(path: Path):
    """A file whose runnable Python asks for several CPU devices (``os.environ.setdefault("XLA_FLAGS", ...)``, so the
    test run's own XLA_FLAGS win: docs/parallelism.md's pipeline stages) is marked multidevice."""
    several = any(
        "xla_force_host_platform_device_count" in b.text
        for b in _blocks(path)
        if b.lang == "python" and b.tags == ("runnable",)
    )
    return pytest.param(path, marks=pytest.mark.multidevice) if several else path


# Run after a block that constrains ``out`` to the JSON schema ``schema``: the output must be complete JSON that an
# independent validator (jsonschema) accepts, not text cut by max_tokens.
JSON_SCHEMA_EXAMPLE = 'structured_outputs={"json": schema}'
JSON_SCHEMA_CHECK = """
import json as _json, jsonschema as _jsonschema
_done = out[0].outputs[0]
assert _done.finish_reason == "stop", f"the JSON-schema example ended by {_done.finish_reason}: {_done.text!r}"
_jsonschema.validate(_json.loads(_done.text), schema)
print("JSON-schema example: valid", _done.text)
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", [_py_file(p) for p in PY_FILES], ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_python_blocks(path):
    blocks = [b for b in _blocks(path) if b.lang == "python" and b.tags == ("runnable",)]
    texts = [t for b in blocks for t in (b.text, JSON_SCHEMA_CHECK if JSON_SCHEMA_EXAMPLE in b.text else "")]
    assert path != README or JSON_SCHEMA_CHECK in texts, f"README's JSON-schema example ({JSON_SCHEMA_EXAMPLE}) is gone"
    out = _run([sys.executable, "-c", "\n".join(texts)], blocks[0]).stdout
    assert out.count("JSON-schema example: valid") == texts.count(JSON_SCHEMA_CHECK)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    """``jaxserve serve --port 8000`` as the README writes it (another port if 8000 is taken), until /health
    answers; at the end, SIGTERM must drain it and exit 0."""
    assert SERVE_COMMAND in README.read_text()
    with socket.socket() as s:
        port = 8000 if s.connect_ex(("127.0.0.1", 8000)) != 0 else _free_port()
    argv = shlex.split(SERVE_COMMAND.replace("8000", str(port)))
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as f:  # a file, not a pipe: nobody reads the log while the server runs
        proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], cwd=ROOT, env=_env(), stdout=f, stderr=f)
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{SERVE_COMMAND} exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{SERVE_COMMAND} did not become healthy"
            time.sleep(1)
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, f"SIGTERM: exit {proc.returncode}: {log.read_text()[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.tags == ("server",)], ids=lambda b: b.id)
def test_server_block(block, server_port):
    text = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{server_port}")
    argv = ["bash", "-euo", "pipefail", "-c", text] if block.lang == "bash" else [sys.executable, "-c", text]
    _run(argv, block)
