"""`kuiper bench -d/--n-depth` (llama-bench's context depth) on the CPU with the tiny synthetic model, with and
without --batch: the rows' names and JSON fields, what the backend is asked to run (a D-token prompt per sequence,
then N decode steps of all B sequences at positions D..D+N-1), and refusals in one line."""
import json
import random

import pytest

from conftest import run_cli
from kuiper_py.cli import main
from kuiper_py.ops_numpy import NumpyOps


def _rows(tiny_bin, *args) -> list[dict]:
    r = run_cli("bench", "-m", tiny_bin, "--device", "cpu", "-r", "1", "-o", "json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_batch_rows_at_depths(tiny_bin):
    d = random.randint(5, 40)
    rows = _rows(tiny_bin, "-p", "4", "-n", "3", "-d", f"0,{d}", "--batch", "1,2")
    assert [(x["test"], x["n_prompt"], x["n_gen"], x["n_depth"], x["n_seq"]) for x in rows] == [
        ("pp4 @ b1", 4, 0, 0, 1), ("pp4 @ b2", 4, 0, 0, 2), ("tg3 @ b1", 0, 3, 0, 1), ("tg3 @ b2", 0, 3, 0, 2),
        (f"tg3 @ d{d} b1", 0, 3, d, 1), (f"tg3 @ d{d} b2", 0, 3, d, 2)]
    for x in rows:  # (one repetition: its tok/s times its seconds is the tokens it timed, over all sequences)
        tokens = x["n_seq"] * (x["n_prompt"] or x["n_gen"])
        assert x["avg_ts"] * x["avg_ns"] / 1e9 == pytest.approx(tokens, rel=1e-6), x["test"]


def test_single_sequence_rows_at_a_depth(tiny_bin):
    d = random.randint(5, 40)
    rows = _rows(tiny_bin, "-p", "4", "-n", "2,3", "-d", str(d))
    assert [(x["test"], x["n_depth"]) for x in rows] == [("pp4", 0), (f"tg2 @ d{d}", d), (f"tg3 @ d{d}", d)]
    assert all("n_seq" not in x for x in rows)
    csv = run_cli("bench", "-m", tiny_bin, "--device", "cpu", "-r", "1", "-p", "0", "-n", "2", "-d", str(d),
                  "-o", "csv")
    head, row = csv.stdout.splitlines()
    assert dict(zip(head.split(","), row.split(",")))["n_depth"] == str(d)


def _steps(tiny_bin, monkeypatch, *args) -> list[list[tuple[int, int]]]:
    """Each forward the bench runs: its sequences' (new tokens, positions already cached)."""
    seen = []
    begin = NumpyOps.begin_step

    def record(self, step):
        seen.append([(len(s.ids), s.pos0) for s in step.seqs])
        return begin(self, step)
    monkeypatch.setattr(NumpyOps, "begin_step", record)
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", str(tiny_bin), "--device", "cpu", "-r", "1", "-p", "0", *args])
    assert e.value.code == 0
    return seen


@pytest.mark.parametrize("batch", [None, 3])
def test_a_tg_row_at_depth_decodes_after_a_prompt_of_that_depth(tiny_bin, monkeypatch, capsys, batch):
    d, n = random.randint(17, 60), random.randint(2, 5)
    b = batch or 1
    seen = _steps(tiny_bin, monkeypatch, "-n", str(n), "-d", str(d), *(["--batch", str(batch)] if batch else []))
    one_run = [[(d, 0)] * b] + [[(1, d + i)] * b for i in range(n)]  # (the prompt in one step, then n decodes)
    assert seen == one_run * 2  # (the warm-up run, then the timed repetition)
    name = f"tg{n} @ d{d}" + (f" b{batch}" if batch else "")
    assert f"| {name} |" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("args, flag", [(["-d", "-1"], "--n-depth"), (["-d", "1,x"], "--n-depth"),
                                        (["-n", "8", "-d", "40960"], "-d 40960"),
                                        (["-n", "8", "-d", "40952"], "-d 40952"),  # (40952 + 9 drawn: one over)
                                        (["-n", "8", "-d", "40958", "--batch", "2"], "-d 40958")])
def test_a_bad_depth_is_one_error_line(tiny_bin, args, flag):
    r = run_cli("bench", "-m", tiny_bin, "--device", "cpu", "-p", "0", *args)
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kuiper: error: ")]
    assert len(errs) == 1 and flag in errs[0], r.stderr
    assert "loaded" not in r.stderr  # (refused before the model loads)
