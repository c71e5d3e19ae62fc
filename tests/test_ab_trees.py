"""tools/ab_trees.py on the CPU (--rounds 0: its bench half needs a GPU): a tree against itself gives equal greedy
tokens, and a tree that would not run its own package and kernels is refused in one line."""
import json

from conftest import ROOT, run_python


def test_a_tree_against_itself_is_equal(tmp_path):
    r = run_python("tools/ab_trees.py", str(ROOT), "--models", "tiny", "--rounds", "0", "--tokens", "12",
                   "--dir", str(tmp_path), "--json", str(tmp_path / "ab.json"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "tiny: greedy 12 of 12 tokens equal" in r.stdout
    assert json.loads((tmp_path / "ab.json").read_text())["models"]["tiny"]["greedy"] == {"equal": 12, "old": 12,
                                                                                         "new": 12}


def test_a_tree_without_its_own_package_is_refused(tmp_path):
    (tmp_path / "old").mkdir()
    r = run_python("tools/ab_trees.py", str(tmp_path / "old"), "--models", "tiny", "--rounds", "0",
                   "--dir", str(tmp_path), cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "not inside it" in r.stderr.strip().splitlines()[-1] and not list(tmp_path.glob("ab-*"))
