"""The backend interface (kuiper_py.backend): what a step carries, and both backends declaring the Protocol's members
(CPU; the CUDA backend's class is checked without a GPU)."""
import pytest

from kuiper_py.backend import SAMPLED_TOKEN, Backend, PagedBackend, Seq, Step
from kuiper_py.loader import load
from kuiper_py.model import Qwen3
from kuiper_py.ops_numpy import NumpyOps


def _members():
    return set(Backend.__annotations__) | {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}


def test_a_step_carries_each_sequences_tokens_position_and_slot():
    one = Step.single([5, 6, 7], 12)
    assert one.batch == 1 and one.n_tokens == 3 and one.one() == Seq((5, 6, 7), 12, 0)
    two = Step((Seq((1,), 40, 0), Seq((2, 3), 7, 1)))
    assert two.batch == 2 and two.n_tokens == 3 and [s.slot for s in two.seqs] == [0, 1]
    with pytest.raises(NotImplementedError, match="one sequence a step"):
        two.one()
    with pytest.raises(NotImplementedError):
        Step.single([1], 0, slot=3).one()  # (kernels that serve slot 0 only)


def test_the_cpu_backend_is_a_backend(tiny_bin):
    mf = load(tiny_bin)
    ops = NumpyOps(mf.args, mf.weights, 16)
    assert isinstance(ops, Backend) and isinstance(ops, PagedBackend)
    assert not ops.graphs and not ops.queues_draws and ops.max_batch > 1 and ops.SAMPLED_TOKEN == SAMPLED_TOKEN
    assert ops.prefill_graph(Step.single([1, 2], 0), lambda ids: None) is None
    assert ops.warm_prefill_graphs(lambda ids: None) == [] and ops.warm_decode_graphs(lambda pos0: None, 10) == []


def test_the_cuda_backend_declares_every_member():
    from kuiper_py.ops_cupy import CupyOps
    instance_only = {"args", "weights", "graphs"}  # (set in __init__)
    assert not {m for m in _members() - instance_only if not hasattr(CupyOps, m)}
    assert CupyOps.queues_draws and CupyOps.max_batch == 64 and CupyOps.SAMPLED_TOKEN == SAMPLED_TOKEN
    # (a PagedBackend: Steps of up to 64 sequences over a pool of KV blocks)
    assert all(callable(getattr(CupyOps, m, None)) for m in ("kv_pool_blocks", "alloc_blocks"))


def test_a_cpu_model_takes_a_step_of_two_sequences_as_an_error(tiny_bin):
    """The forward hands the backend Steps; several sequences need block tables into a paged pool (the contiguous
    cache holds one)."""
    mf = load(tiny_bin)
    m = Qwen3(mf, NumpyOps, 16)
    with pytest.raises(NotImplementedError):
        m.ops.begin_step(Step((Seq((1,), 0), Seq((2,), 0, 1))))
    logits = m.prefill([1, 2, 3])
    assert logits.shape == (mf.args.vocab_size,) and m.pos == 3


def test_the_cuda_backends_parts_define_each_method_once():
    """CupyOps is put together from parts (weight upload, graphs, device draws, paged steps): a method name two parts
    define resolves to one of them for both callers, which no test of either part alone would see."""
    from kuiper_py.cuda.backend import CupyOps
    owner = {}
    for part in CupyOps.__bases__:
        for name, v in vars(part).items():
            if callable(v) and not name.startswith("__"):
                assert name not in owner, f"{name} is defined by {owner[name].__name__} and {part.__name__}"
                owner[name] = part
