"""The documentation names what the code has: every KUIPER_* setting the package mentions has a row in
docs/RUNTIME.md's tables, every row names a setting some source still mentions, and every tool the README,
docs/RUNTIME.md and models.md name exists (and every tool is named in one of them)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"KUIPER_[A-Z0-9_]*[A-Z0-9]")


def _mentioned(paths) -> set[str]:
    return {m for p in paths for m in NAME.findall(p.read_text())}


def _table_rows() -> set[str]:
    text = (ROOT / "docs" / "RUNTIME.md").read_text()
    return set(re.findall(r"^\| `(KUIPER_[A-Z0-9_]+)` \|", text, flags=re.M))


def test_every_setting_the_package_mentions_is_documented():
    missing = _mentioned((ROOT / "kuiper_py").glob("*.py")) - _table_rows()
    assert not missing, f"add rows to docs/RUNTIME.md for {sorted(missing)}"


def test_every_documented_setting_is_still_in_the_sources():
    sources = [*(ROOT / "kuiper_py").glob("*.py"), *(ROOT / "kernels_cu").glob("*.cu*")]
    stale = _table_rows() - _mentioned(sources)
    assert not stale, f"docs/RUNTIME.md documents settings no source mentions: {sorted(stale)}"


def test_the_named_tools_exist_and_every_tool_is_named():
    docs = "".join((ROOT / f).read_text() for f in ("README.md", "docs/RUNTIME.md", "models.md"))
    named = set(re.findall(r"tools/[A-Za-z0-9_]+\.(?:py|sh)", docs))
    assert named, "no tool named at all: the pattern is wrong"
    assert not {t for t in named if not (ROOT / t).is_file()}, "documentation names tools that do not exist"
    tools = {f"tools/{p.name}" for p in (ROOT / "tools").iterdir() if p.suffix in (".py", ".sh")}
    assert not tools - named, f"tools no document names: {sorted(tools - named)}"
