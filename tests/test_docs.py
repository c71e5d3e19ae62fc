"""The documentation names what the code has: every KUIPER_* setting the package mentions has a row in
docs/RUNTIME.md's tables and every row names a setting some source still mentions; every tool a document names
exists (and every tool is named); every `kuiper` command and flag, and every flag given to a tool, in the reader
docs exists; the performance doc stays short, and no reader doc carries development history."""
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"KUIPER_[A-Z0-9_]*[A-Z0-9]")
TOOL = re.compile(r"tools/[A-Za-z0-9_]+\.(?:py|sh)")
# the docs written for readers: their commands must run as written, and they describe the product as it is (history
# belongs to git)
READER_DOCS = ("README.md", "docs/RUNTIME.md", "docs/PERFORMANCE.md", "models.md", "docs/FORMAT.md")
CHAIN = ("&&", "||", ";", "|")
PERFORMANCE_MAX_LINES = 300
README_MAX_LINES = 150  # install, use, test: the rest is in docs/


def _mentioned(paths) -> set[str]:
    return {m for p in paths for m in NAME.findall(p.read_text())}


def _table_rows() -> set[str]:
    text = (ROOT / "docs" / "RUNTIME.md").read_text()
    return set(re.findall(r"^\| `(KUIPER_[A-Z0-9_]+)` \|", text, flags=re.M))


def _commands(doc: str) -> list[list[str]]:
    """Each `python tools/X.py ...` or `kuiper CMD ...` in the doc's inline code and code blocks, split as a shell
    would; a chain (`kuiper synth ... && kuiper export ...`) gives each of its commands."""
    text = (ROOT / doc).read_text()
    spans = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [ln for block in spans for ln in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    found = []
    for ln in lines:
        ln = ln.strip()
        if not ln.startswith(("python tools/", "kuiper ")):
            continue
        argv = []
        for arg in [*shlex.split(ln), CHAIN[0]]:
            if arg not in CHAIN:
                argv.append(arg)
                continue
            if argv[:1] == ["kuiper"] or argv[:1] == ["python"] and argv[1:2] and argv[1].startswith("tools/"):
                found.append(argv)
            argv = []
    return found


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a)}


@cache
def _kuiper_help(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kuiper_py", cmd, "--help"], cwd=ROOT, capture_output=True, text=True)


def _has_option(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def _wrapped_command(source: str) -> str | None:
    """The `kuiper` command a tool hands its whole argv to (tools/make_synthetic.py: `main(["synth", *sys.argv[1:]])`),
    whose parser then owns the tool's options; None for a tool with options of its own."""
    m = re.search(r'main\(\["([a-z]+)", \*sys\.argv\[1:\]\]\)', source)
    return m and m[1]


def test_every_setting_the_package_mentions_is_documented():
    missing = _mentioned((ROOT / "kuiper_py").rglob("*.py")) - _table_rows()
    assert not missing, f"add rows to docs/RUNTIME.md for {sorted(missing)}"


def test_every_documented_setting_is_still_in_the_sources():
    sources = [*(ROOT / "kuiper_py").rglob("*.py"), *(ROOT / "kernels_cu").glob("*.cu*")]
    stale = _table_rows() - _mentioned(sources)
    assert not stale, f"docs/RUNTIME.md documents settings no source mentions: {sorted(stale)}"


def test_the_named_tools_exist_and_every_tool_is_named():
    docs = "".join((ROOT / f).read_text() for f in ("README.md", "docs/RUNTIME.md", "models.md", "docs/PERFORMANCE.md"))
    named = set(TOOL.findall(docs))
    assert named, "no tool named at all: the pattern is wrong"
    assert not {t for t in named if not (ROOT / t).is_file()}, "documentation names tools that do not exist"
    tools = {f"tools/{p.name}" for p in (ROOT / "tools").iterdir() if p.suffix in (".py", ".sh")}
    assert not tools - named, f"tools no document names: {sorted(tools - named)}"


def test_performance_doc_is_short_and_names_only_tools_that_exist():
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    assert len(text.splitlines()) <= PERFORMANCE_MAX_LINES
    named = set(TOOL.findall(text))
    assert "tools/bench_e2e.py" in named, "the pattern is wrong, or the doc lost its reproduction commands"
    assert not {t for t in named if not (ROOT / t).is_file()}


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("doc", READER_DOCS)
def test_reader_docs_carry_no_development_history(doc):
    text = (ROOT / doc).read_text()
    history = re.findall(r"\b(?:changes?|sessions?|issues?) #?\d+|\b20\d\d-\d\d-\d\d\b", text, flags=re.I)
    assert not history, f"{doc} cites development history (git holds it): {history[:5]}"


def test_models_table_cells_are_short():
    cells = [c.strip() for ln in (ROOT / "models.md").read_text().splitlines() if ln.startswith("|")
             for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
    assert cells, "models.md has no table"
    long = [c for c in cells if len(c) > 200]
    assert not long, f"models.md cells over 200 characters: {[c[:60] for c in long]}"


@pytest.mark.parametrize("doc", READER_DOCS)
def test_tool_commands_in_reader_docs_use_flags_the_tool_has(doc):
    for argv in _commands(doc):
        if argv[0] != "python":
            continue
        tool = ROOT / argv[1]
        assert tool.is_file(), f"{doc}: {argv[1]} does not exist"
        source = tool.read_text()
        unknown = {f for f in _flags(argv[2:]) if f'"{f}"' not in source}
        if unknown and (wrapped := _wrapped_command(source)):
            shown = _kuiper_help(wrapped)
            assert shown.returncode == 0, f"{argv[1]} hands its options to `kuiper {wrapped}`, which is no command"
            unknown = {f for f in unknown if not _has_option(shown.stdout, f)}
        assert not unknown, f"{doc}: {argv[1]} has no option {sorted(unknown)}"


@pytest.mark.parametrize("doc", READER_DOCS)
def test_kuiper_commands_in_reader_docs_exist_with_their_flags(doc):
    for argv in _commands(doc):
        if argv[0] != "kuiper":
            continue
        shown = _kuiper_help(argv[1])
        assert shown.returncode == 0, f"{doc}: `kuiper {argv[1]}` is not a command: {shown.stderr.strip()[-200:]}"
        unknown = {f for f in _flags(argv[2:]) if not _has_option(shown.stdout, f)}
        assert not unknown, f"{doc}: `kuiper {argv[1]}` has no option {sorted(unknown)}"


def test_reader_docs_find_commands_to_check():
    commands = [argv[:2] for doc in READER_DOCS for argv in _commands(doc)]
    assert ["kuiper", "generate"] in commands and ["python", "tools/bench_e2e.py"] in commands


@pytest.mark.parametrize("doc", READER_DOCS)
def test_reader_docs_link_to_files_that_exist(doc):
    path = ROOT / doc
    links = re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [ln for ln in links if not (path.parent / ln).exists()]
    assert not missing, f"{doc} links to missing files: {missing}"
