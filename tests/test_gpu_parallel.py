"""The NCCL communicator (kuiper_py/parallel/nccl.py) as a group of one on one GPU: each collective gives what the
Communicator interface promises, on the rank's device and stream, through a rendezvous as a multi-node launch would
use it (device machine only)."""
import numpy as np
import pytest

from kuiper_py.parallel import nccl as kn
from kuiper_py.parallel.comm import Communicator, FileRendezvous, LocalRendezvous

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
if not kn.available():
    pytest.skip("CuPy without NCCL", allow_module_level=True)


@pytest.mark.parametrize("rendezvous", ["local", "file"])
def test_one_rank_collectives(tmp_path, rendezvous):
    rv = LocalRendezvous() if rendezvous == "local" else FileRendezvous(tmp_path / "nccl.id")
    comm = kn.NcclCommunicator(0, 1, rv, device=0)
    assert isinstance(comm, Communicator)
    rng = np.random.default_rng()
    try:
        for dtype in (np.float32, np.float16):
            x = cp.asarray(rng.standard_normal((3, 40)).astype(dtype))
            s = comm.all_reduce_sum(x)
            assert s.dtype == x.dtype and s.data.ptr != x.data.ptr
            assert cp.array_equal(s, x)
            assert cp.array_equal(comm.all_gather(x, axis=-1), x)
        v = rng.standard_normal(1000).astype(np.float32)
        v[[17, 600]] = v.max() + 1  # a tie: the lower id, as np.argmax
        assert comm.argmax(cp.asarray(v), 5000) == 5017
        comm.barrier()
    finally:
        comm.close()


def test_in_process_group_of_one():
    (comm,) = kn.NcclCommunicator.in_process([0])
    try:
        x = cp.arange(8, dtype=cp.float32)
        with kn.group():
            y = comm.all_reduce_sum(x)
        cp.cuda.get_current_stream().synchronize()
        assert cp.array_equal(y, x)
    finally:
        comm.close()


def test_unique_id_round_trips_through_bytes():
    uid = kn.nccl.get_unique_id()
    assert kn.uid_from_bytes(kn.uid_to_bytes(uid)) == uid
