"""parallel.device.TurnGroup on the CPU: N ranks as threads that take turns (the way DeviceLocalGroup runs CUDA ranks
on one GPU). Its collectives against NumPy's own answers, its one-rank-at-a-time order, errors and the CPU engine's
tensor-parallel forward through it against comm.LocalGroup's."""
import threading

import numpy as np
import pytest

from kuiper_py import synth
from kuiper_py.export import export
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps
from kuiper_py.parallel.comm import Communicator, LocalGroup
from kuiper_py.parallel.device import TurnGroup
from kuiper_py.parallel.group import ParallelModel


@pytest.mark.parametrize("size", [1, 2, 4])
def test_collectives(size):
    rng = np.random.default_rng()
    xs = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(size)]
    logits = [rng.standard_normal(7).astype(np.float32) for _ in range(size)]
    logits[-1][3] = logits[0][1] = max(v.max() for v in logits) + 1  # a tie across ranks: the lower id
    g = TurnGroup(size)

    def rank(r):
        c = g.comm(r)
        assert isinstance(c, Communicator)
        s = c.all_reduce_sum(xs[r])
        cat = c.all_gather(xs[r], axis=-1)
        best = c.argmax(logits[r], 7 * r)
        c.barrier()
        return s, cat, best
    want_sum = xs[0].copy()
    for x in xs[1:]:
        want_sum += x
    for s, cat, best in g.run(rank):
        assert np.array_equal(s, want_sum)
        assert np.array_equal(cat, np.concatenate(xs, axis=-1))
        assert best == int(np.argmax(np.concatenate(logits)))


def test_one_rank_at_a_time_in_rank_order():
    g, lock = TurnGroup(4), threading.Lock()
    active, log = [0], []

    def rank(r):
        for step in range(3):
            with lock:
                active[0] += 1
                assert active[0] == 1
                log.append((step, r))
                active[0] -= 1
            g.comm(r).all_reduce_sum(np.zeros(1))
    g.run(rank)
    assert log == [(s, r) for s in range(3) for r in range(4)]


def test_an_error_in_one_rank_ends_every_rank():
    g = TurnGroup(3)

    def rank(r):
        c = g.comm(r)
        c.barrier()
        if r == 1:
            raise ValueError("rank 1 failed")
        c.barrier()
        return r
    with pytest.raises(ValueError, match="rank 1 failed"):
        g.run(rank)
    assert g.run(lambda r: r) == [0, 1, 2]  # the group runs again afterwards


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("turns")
    out = {}
    for kind, preset in (("dense", "tiny"), ("moe", "tiny-moe")):
        d = synth.make_checkpoint(root / preset, preset, seed=3, n_shards=1, group_size=32, tokenizer=False)
        export(d, root / f"{preset}.bin", progress=False, log=lambda m: None)
        out[kind] = load(root / f"{preset}.bin")
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_cpu_engine_through_turns_equals_local_group(files, kind, tp):
    """The same ranks, the same sums in rank order: the same bits as the lock-step threads, prefill and decode."""
    mf = files[kind]
    ids = [int(t) for t in np.random.default_rng().integers(0, 151643, size=6)]
    got = {}
    for name, group in (("local", LocalGroup(tp)), ("turns", TurnGroup(tp))):
        m = ParallelModel(mf, NumpyOps, tp, 16, group=group)
        got[name] = [m.prefill(ids, all_logits=True), m.decode(ids[0]), m.decode(ids[1])]
    for a, b in zip(got["local"], got["turns"]):
        assert np.array_equal(a, b)
    one = Qwen3(mf, NumpyOps, 16).prefill(ids, all_logits=True)
    assert np.abs(got["turns"][0] - one).max() < 1e-3 * np.abs(one).max()
