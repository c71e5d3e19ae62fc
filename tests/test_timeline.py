"""tools/timeline_decode.py's tables from synthetic block records (no GPU): every phase of a block is
known, so each column is checked against the value it must have, to the timer's 32 ns."""
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import timeline_decode as tl  # noqa: E402

T0 = 1_795_452_701_454_129_120  # a real %globaltimer reading (ns): float64 resolves it to 256 ns only
LAYERS, GX, GY, SM = 6, 4, 3, 4  # a launch: 4 column tiles x 3 splits, on 4 SMs: waves = splits
GAP = 100_000  # ns between launches' waits


def block_times(x, y):
    """Entry, wait, prologue done, loop done, end of block (x, y) relative to its launch's first wait."""
    wait = 32 * x
    pro = wait + 500 + 32 * y
    loop = pro + 2000 + 100 * y
    return [-1000 * (3 - y), wait, pro, loop, loop + 64]


def records(sm_of=lambda x, y: (y * GX + x) % SM):
    rows, tags = [], []
    for j in range(LAYERS * 5):
        base = T0 + j * GAP
        tag = "attn" if j % 5 == 1 else "gemv"
        for y in range(GY):
            for x in range(GX):
                sm = sm_of(x, y)
                rows.append([1000 + j, sm | ((x + 1024 * y) << 8), *[base + v for v in block_times(x, y)], GX * GY])
                tags.append(tag)
    return np.array(rows, np.int64), np.array(tags)


def test_kernel_table_columns():
    rec, tags = records()
    table = tl.kernel_table(rec, tags, LAYERS)
    assert list(table) == tl.DENSE_KINDS
    t = np.array([[block_times(x, y) for x in range(GX)] for y in range(GY)]).reshape(-1, 5)
    end = t[:, 4]
    want = [GX * GY, 32 * (GX - 1), np.median(t[:, 2] - t[:, 1]), np.median(t[:, 3] - t[:, 2]), end.min(),
            np.median(end), np.percentile(end, 90), end.max(), GAP - end.max()]
    for kind, got in table.items():
        assert got[0] == want[0], kind
        np.testing.assert_allclose(got[1:], np.array(want[1:]) / 1000.0, atol=1e-9, err_msg=kind)
    # the spread is 96 ns: it would read 0 or 256 if the absolute times went through float64 first
    assert abs(table["o"][1] - 0.096) < 1e-9


def test_wave_table_groups_by_residency():
    rec, tags = records()
    waves = tl.wave_table(rec, tags, LAYERS, SM)
    assert list(waves) == tl.DENSE_KINDS
    for kind, ws in waves.items():
        assert list(ws) == list(range(GY)), kind
        for y, got in ws.items():
            t = np.array([block_times(x, y) for x in range(GX)])
            want = [GX, t[:, 0].mean(), t[:, 2].mean(), (t[:, 3] - t[:, 2]).mean(), t[:, 4].mean(), t[:, 4].max()]
            assert got[0] == want[0]
            np.testing.assert_allclose(got[1:], np.array(want[1:]) / 1000.0, atol=1e-9, err_msg=f"{kind} {y}")


def test_rank_table_groups_by_entry_order_on_each_sm():
    # two SMs holding 6 blocks each (columns 0, 2 and 1, 3 of every split), and split 0 entering last
    # (100 ns before its launch's first wait): ranks by entry stamp, ties (a split's two blocks on one SM)
    # by linear index, so rank r holds split (1, 1, 2, 2, 0, 0)[r], columns 2 (r % 2) and 2 (r % 2) + 1
    rec, tags = records(lambda x, y: x % 2)
    y_of = (rec[:, 1] >> 18) & 1023
    late = y_of == 0
    rec[late, 2] = rec[late, 2] - block_times(0, 0)[0] - 100  # was 3000 ns before the first wait
    ranks = tl.rank_table(rec, tags, LAYERS)
    assert list(ranks) == tl.DENSE_KINDS
    for kind, gs in ranks.items():
        assert list(gs) == [(6, r) for r in range(6)], kind
        for (_, r), got in gs.items():
            y, x0 = (1, 1, 2, 2, 0, 0)[r], 2 * (r % 2)
            t = np.array([block_times(x, y) for x in (x0, x0 + 1)], float)  # one block on each SM
            if y == 0:
                t[:, 0] = -100
            want = [2, t[:, 0].mean(), t[:, 2].mean(), (t[:, 3] - t[:, 2]).mean(), t[:, 4].mean(), t[:, 4].max()]
            assert got[0] == want[0]
            np.testing.assert_allclose(got[1:], np.array(want[1:]) / 1000.0, atol=1e-9, err_msg=f"{kind} {r}")
    # the stamps, not the order of the records, set the rank
    perm = np.random.default_rng(0).permutation(len(rec))
    again = tl.rank_table(rec[perm], tags[perm], LAYERS)
    assert all(np.array_equal(again[k][g], ranks[k][g]) for k in ranks for g in ranks[k])


def test_launches_sharing_an_id_split_by_grid_size():
    # every launch of a kind given one id (the MoE FFN under KUIPER_MOE_DIAG_SHARED: all layers read one
    # layer's experts): the same launches, in the same order, as with an id per launch
    rec, tags = records()
    shared = rec.copy()
    for tag in ("gemv", "attn"):
        shared[tags == tag, 0] = 7 if tag == "gemv" else 8
    got, want = tl.split_launches(shared, tags), tl.split_launches(rec, tags)
    assert len(got) == len(want) == LAYERS * 5
    for (t0, tag0, ix0), (t1, tag1, ix1) in zip(got, want):
        assert (t0, tag0) == (t1, tag1) and np.array_equal(ix0, ix1)
    table, ref = tl.kernel_table(shared, tags, LAYERS), tl.kernel_table(rec, tags, LAYERS)
    assert list(table) == list(ref) and all(np.array_equal(table[k], ref[k]) for k in ref)
    # a group whose records are not whole grids (some dropped) stays one launch
    cut = np.ones(len(rec), bool)
    cut[np.flatnonzero(tags == "attn")[0]] = False
    assert sum(tag == "attn" for _, tag, _ in tl.split_launches(shared[cut], tags[cut])) == 1


def test_layer_kinds():
    assert tl.layer_kinds(5 * 36, 36) == tl.DENSE_KINDS
    assert tl.layer_kinds(4 * 48, 48) == tl.FFN_KINDS
    assert tl.layer_kinds(7, 36) is None


def test_load_prints_tables(tmp_path):
    rec, tags = records()
    f = tmp_path / "t.npz"
    np.savez(f, rec=rec, tags=tags, n_layers=LAYERS, n_sm=SM)
    r = CliRunner().invoke(tl.main, ["--load", str(f), "--waves", "--ranks"])
    assert r.exit_code == 0, r.output
    assert "| gate/up | 12 | 0.10 |" in r.output and "| down | 2 | 4 | -1.00 |" in r.output
    assert "| o | 3 | 2 | 4 | -1.00 |" in r.output  # 3 blocks per SM, the last to enter: split 2
    old = tmp_path / "old.npz"  # saved before the layer count was recorded
    np.savez(old, rec=rec, tags=tags)
    r = CliRunner().invoke(tl.main, ["--load", str(old)])
    assert r.exit_code != 0 and "--layers" in r.output
    assert CliRunner().invoke(tl.main, ["--load", str(old), "--layers", str(LAYERS)]).exit_code == 0
