"""tools/ab_trees.py on the CPU (--rounds 0: its bench half needs a GPU): a tree against itself gives equal greedy
tokens, a tree whose bench_e2e times 3 prefills has the other's told to time as many, and a tree that would not run its
own package and kernels is refused in one line."""
import json
import shutil

from conftest import ROOT, run_python


def test_a_tree_against_itself_is_equal(tmp_path):
    r = run_python("tools/ab_trees.py", str(ROOT), "--models", "tiny", "--rounds", "0", "--tokens", "12",
                   "--first-run", "--dir", str(tmp_path), "--json", str(tmp_path / "ab.json"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "tiny: greedy 12 of 12 tokens equal" in r.stdout
    got = json.loads((tmp_path / "ab.json").read_text())["models"]["tiny"]
    assert got["greedy"] == {"equal": 12, "old": 12, "new": 12}
    assert got["prefill_reps"] == {"old": None, "new": None}  # (both benches take the option: each its default)
    for tree in ("old", "new"):  # (the CPU engine: no kernels, so no build time)
        assert [got["load"][tree][k]["load_s"] > 0 for k in ("first", "cached")] == [True, True]
    assert "| first load_s |" in r.stdout and "| cached load_s |" in r.stdout


def test_an_older_bench_sets_the_prefill_count_of_both(tmp_path):
    old, skip = tmp_path / "old", shutil.ignore_patterns("__pycache__")
    for d in ("kuiper_py", "tools"):
        shutil.copytree(ROOT / d, old / d, ignore=skip)
    # (the kernels where a wheel puts them: an editable install of this tree would hand the copy its kernels_cu)
    shutil.copytree(ROOT / "kernels_cu", old / "kuiper_py" / "kernels_cu", ignore=skip)
    bench = old / "tools" / "bench_e2e.py"
    bench.write_text(bench.read_text().replace("--prefill-reps", "--reps"))  # (a bench from before the option)
    r = run_python("tools/ab_trees.py", str(old), "--models", "tiny", "--rounds", "0", "--tokens", "4",
                   "--dir", str(tmp_path), "--json", str(tmp_path / "ab.json"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ab.json").read_text())["models"]["tiny"]["prefill_reps"] == {"old": None, "new": 3}


def test_a_tree_without_its_own_package_is_refused(tmp_path):
    (tmp_path / "old").mkdir()
    r = run_python("tools/ab_trees.py", str(tmp_path / "old"), "--models", "tiny", "--rounds", "0",
                   "--dir", str(tmp_path), cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "not inside it" in r.stderr.strip().splitlines()[-1] and not list(tmp_path.glob("ab-*"))
