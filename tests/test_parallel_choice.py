"""--tp N's startup choice between NCCL and the one-shot all-reduce (parallel.device.gpu_group), on the CPU with
stand-in groups: the faster by the timer is kept, NCCL alone where any two GPUs lack peer access, the choice logged."""
import sys
import types

import pytest

from kuiper_py.parallel import device


class _Group:
    made: list = []

    def __init__(self, size):
        self.size, self.oneshot = size, True
        _Group.made.append(type(self).__name__)


class _Peer(_Group):
    pass


class _Nccl(_Group):
    pass


@pytest.fixture
def fake_gpus(monkeypatch):
    peer = {"ok": True}
    rt = types.SimpleNamespace(deviceCanAccessPeer=lambda d, p: peer["ok"])
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))
    monkeypatch.setattr(device, "PeerGroup", _Peer)
    monkeypatch.setattr(device, "NcclGroup", _Nccl)
    logs = []
    monkeypatch.setattr("kuiper_py.generate.log", logs.append)
    _Group.made = []
    return peer, logs


@pytest.mark.parametrize("t_one, t_nccl", [(5e-6, 9e-6), (9e-6, 5e-6), (7e-6, 7e-6)])
def test_the_faster_all_reduce_is_kept(fake_gpus, t_one, t_nccl):
    _, logs = fake_gpus
    seen = []

    def timer(group, nbytes):
        seen.append((group.oneshot, nbytes))
        return t_one if group.oneshot else t_nccl

    g = device.gpu_group(4, 8192, timer=timer)
    assert isinstance(g, _Peer) and _Group.made == ["_Peer"]
    assert seen == [(True, 8192), (False, 8192)]
    assert g.oneshot == (t_one < t_nccl)  # (a tie keeps NCCL)
    assert len(logs) == 1 and ("one-shot" if g.oneshot else "NCCL") in logs[0].rsplit(":", 1)[1]
    assert f"{t_one * 1e6:.1f}" in logs[0] and f"{t_nccl * 1e6:.1f}" in logs[0]


def test_no_peer_access_is_nccl_untimed(fake_gpus):
    peer, logs = fake_gpus
    peer["ok"] = False
    g = device.gpu_group(2, 8192, timer=lambda *a: pytest.fail("timed without peer access"))
    assert isinstance(g, _Nccl) and _Group.made == ["_Nccl"] and "no peer access" in logs[0]


def test_a_one_shot_form_that_fails_to_start_is_nccl(fake_gpus, monkeypatch):
    _, logs = fake_gpus

    class _Broken(_Peer):
        def __init__(self, size):
            raise RuntimeError("peer access refused")

    monkeypatch.setattr(device, "PeerGroup", _Broken)
    g = device.gpu_group(2, 8192, timer=lambda *a: pytest.fail("timed a form that did not start"))
    assert isinstance(g, _Nccl) and "peer access refused" in logs[0]
