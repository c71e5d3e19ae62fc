"""The decode GEMV's split-K rule (ops_cupy.gemv_split / o_split) on a mocked SM count, and launch arguments the host
builds (the launches mocked): no GPU needed."""
import math

import pytest

from kuiper_py.cuda import settings as cfg
import kuiper_py.ops_cupy as oc
from reference import patch, tune


@pytest.fixture
def sms(monkeypatch):
    def set_count(n, name="mocked GPU"):
        patch(monkeypatch, "sm_count", lambda: n)
        patch(monkeypatch, "device_name", lambda: name)
    return set_count


@pytest.mark.parametrize("n_sm", [132, 114, 78])
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (8192, 5120), (2048, 5120)])
def test_gemv_split_covers_k_in_whole_steps(sms, n_sm, K, N):
    sms(n_sm)
    tiles = math.ceil(N / oc.GEMV_COLS)
    S, rps = oc.gemv_split(K, tiles)
    assert rps % oc.GEMV_STEP == 0 and S * rps >= K > (S - 1) * rps
    # fewer blocks per SM never means more splits (gemv_partial_size sizes the buffer at the default)
    for per_sm in (1.0, 2.0, 3.0, oc.gemv_blocks_per_sm(K, tiles)):
        assert oc.gemv_split(K, tiles, per_sm)[0] <= S


def test_o_split_coarse_only_up_to_its_attention_split_bound(sms):
    sms(132)
    # Qwen3-8B's o projection (K = 32 heads x 128, N = 4096: 16 column tiles);
    # with gemv_merge_span's merge the bound covers every split count of a 40960-position cache
    coarse, fine = oc.o_split(4096, 16, 33), oc.o_split(4096, 16, 65)
    assert oc.o_split(4096, 16, oc.GEMV_O_MERGE_COARSE_SPLITS, merge=True) == coarse
    assert oc.o_split(4096, 16, oc.GEMV_O_MERGE_COARSE_SPLITS + 1, merge=True) == fine
    assert fine == oc.gemv_split(4096, 16)
    if cfg.SETTINGS.gemv_o_blocks_per_sm == 3 and oc.gemv_blocks_per_sm(4096, 16) == 4:
        assert coarse == (16, 256) and fine == (32, 128)
    assert oc.o_split(4096, 16, oc.GEMV_O_COARSE_SPLITS) == coarse
    assert oc.o_split(4096, 16, oc.GEMV_O_COARSE_SPLITS + 1) == fine
    # with no split count, the coarsest split o may take: the checks that o's rows fit use it
    for K, tiles in ((4096, 16), (8192, 20), (4096, 8 + 3), (2048, 4)):
        rows = oc.o_split(K, tiles)[1]
        assert rows >= oc.o_split(K, tiles, 1)[1] and rows >= oc.o_split(K, tiles, 1000)[1]


# Qwen3 dense FFN shapes (hidden D, intermediate I) and their splits on 132 SMs at 4 and 3 blocks per SM
# (gate/up at 4, at 3), (down at 4, at 3)
FFN_SPLITS = {(2560, 9728): ((7, 384), (5, 512), (38, 256), (38, 256)),
              (4096, 12288): ((6, 768), (4, 1024), (32, 384), (24, 512)),
              (5120, 17408): ((4, 1280), (3, 1792), (23, 768), (20, 896)),
              (5120, 25600): ((3, 1792), (3, 1792), (25, 1024), (20, 1280))}


@pytest.mark.parametrize("D,I", list(FFN_SPLITS))
def test_lower_target_keeps_the_split_floor(sms, monkeypatch, D, I):
    sms(132)
    tune(monkeypatch, gemv_min_splits=3)
    gu, dn = 2 * math.ceil(I / oc.GEMV_COLS), math.ceil(D / oc.GEMV_COLS)
    assert (oc.gemv_split(D, gu, 4.0), oc.gemv_split(D, gu, 3.0), oc.gemv_split(I, dn, 4.0),
            oc.gemv_split(I, dn, 3.0)) == FFN_SPLITS[(D, I)]
    # the floor never adds splits beyond the base target's, and never acts at the base
    for per_sm in (1.0, 2.0, 3.0):
        S = oc.gemv_split(D, gu, per_sm)[0]
        assert min(3, oc.gemv_split(D, gu, 4.0)[0]) <= S <= oc.gemv_split(D, gu, 4.0)[0]


@pytest.mark.parametrize("name,tuned", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False),
                                        ("NVIDIA A100-SXM4-80GB", False)])
def test_device_tuning_is_keyed_on_the_gpu_name_and_shape(sms, monkeypatch, name, tuned):
    sms(132, name)
    tune(monkeypatch, gemv_blocks_per_sm=None)  # the table decides
    tune(monkeypatch, device_tables={"H200": {"ffn_off": {(4096, 12288)}, "gemv_blocks_per_sm": {
        (4096, 24576): 3.0, (12288, 4096): 3.0}}})
    # Qwen3-8B's gate|up (K 4096, 2 x 48 tiles) and down (K 12288, 16 tiles) take the GPU's entry ...
    for K, tiles, at3 in ((4096, 96, (4, 1024)), (12288, 16, (24, 512))):
        assert oc.gemv_blocks_per_sm(K, tiles) == (3.0 if tuned else 4.0)
        assert oc.gemv_split(K, tiles) == (at3 if tuned else oc.gemv_split(K, tiles, 4.0))
    assert ((4096, 12288) in oc.device_tuning().get("ffn_off", ())) == tuned
    # ... other shapes (8B's q|k|v and o, 14B's FFN) keep the base target
    for K, tiles in ((4096, 24), (4096, 16), (5120, 136), (17408, 20)):
        assert oc.gemv_blocks_per_sm(K, tiles) == 4.0
    # the environment's value overrides the table
    tune(monkeypatch, gemv_blocks_per_sm=4.0)
    assert oc.gemv_blocks_per_sm(4096, 96) == 4.0 and oc.gemv_split(4096, 96) == (6, 768)


def test_device_tuning_table_is_well_formed():
    # targets below the base only (a lower target never gives more splits: gemv_partial_size relies on it)
    for key, t in cfg.SETTINGS.device_tables.items():
        assert set(t) <= {"ffn_off", "gemv_blocks_per_sm", "attn_min_chunk", "attn_short", "o_merge", "attn_cm",
                          "rows_wgmma_min"} and key
        for (K, N), rows in t.get("rows_wgmma_min", {}).items():  # (2..16: the rows gemv_rows would take)
            assert isinstance(rows, int) and 2 <= rows <= 16 and K % 32 == 0 and N % 8 == 0
        for (K, N), per_sm in t.get("gemv_blocks_per_sm", {}).items():
            assert 0 < per_sm <= oc.GEMV_BASE_BLOCKS_PER_SM and K % oc.GEMV_STEP == 0 and N % oc.GEMV_COLS == 0
        for (D, H, KV, hd), keys in t.get("attn_min_chunk", {}).items():
            assert isinstance(keys, int) and keys >= 1 and H % KV == 0 and D % 32 == 0 and hd in (64, 128)
        for (D, H, KV, hd), keys in t.get("attn_short", {}).items():
            keys = (keys,) if isinstance(keys, int) else keys
            assert isinstance(keys, tuple) and keys and all(isinstance(b, int) and b >= 1 for b in keys)
            assert list(keys) == sorted(set(keys)) and H % KV == 0
        assert all(H % KV == 0 and hd in (64, 128) for D, H, KV, hd in t.get("o_merge", ()))
        # the clusters' merge serves only the short-context graph (its splits capped at ATTN_CM_MAX)
        assert all(shape in t.get("attn_short", {}) for shape in t.get("attn_cm", ()))
        # a second short bound paid only with the clusters' merge (+1.1% without it)
        assert all(shape in t.get("attn_cm", ()) for shape, keys in t.get("attn_short", {}).items()
                   if not isinstance(keys, int) and len(keys) > 1)


def test_attn_short_regime_follows_the_table_and_the_override(sms, monkeypatch):
    from types import SimpleNamespace
    a8b = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    tune(monkeypatch, device_tables={"H100": {"attn_short": {(4096, 32, 8, 128): 1024}}})
    tune(monkeypatch, attn_short=None)
    sms(132, "NVIDIA H100 80GB HBM3")
    assert oc.attn_short(a8b) == (1024,)
    sms(132, "NVIDIA H200")
    assert oc.attn_short(a8b) == ()
    tune(monkeypatch, device_tables={"H200": {"attn_short": {(4096, 32, 8, 128): (512, 1024)}}})
    assert oc.attn_short(a8b) == (512, 1024)
    tune(monkeypatch, attn_short=(300,))  # the setting wins everywhere
    assert oc.attn_short(a8b) == (300,)
    tune(monkeypatch, attn_short=(1024, 300, 300))  # any order, repeats once
    assert oc.attn_short(a8b) == (300, 1024)
    tune(monkeypatch, attn_short=())
    sms(132, "NVIDIA H100 80GB HBM3")
    assert oc.attn_short(a8b) == ()


@pytest.mark.parametrize("cm", [False, True])
def test_short_regimes_pick_their_bound_and_split_count(cm):
    """Each short-context bound is a regime: n_keys goes to the first bound at or above it, whose keys set the
    split count (capped by the capacity's and, with the clusters' merge, by ATTN_CM_MAX); past the last bound
    the capacity's regime and split count."""
    from kuiper_py.cuda.ops.gemv import decode_regime
    from kuiper_py.cuda.plan import split_count
    bounds = (512, 1024)
    regime = lambda n: decode_regime(bounds, 33000, n)  # noqa: E731 (DecodePlan.regime at a 33000-key capacity)
    split = lambda n, chunk=32: split_count(bounds, 33, chunk, cm, n)  # noqa: E731 (DecodePlan.split_count)
    assert [regime(n) for n in (1, 512, 513, 1024, 1025)] == [512, 512, 1024, 1024, 33000]
    assert [split(n) for n in (1, 512, 513, 1024, 1025)] == [16, 16, 16 if cm else 32, 16 if cm else 32, 33]
    assert [split(n, 64) for n in (512, 1024, 5000)] == [8, 16, 33]
    bounds = ()
    assert regime(5) == 33000 and split(5) == 33


def test_attn_min_chunk_follows_the_table(sms, monkeypatch):
    from types import SimpleNamespace
    a8b = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    a30 = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    tune(monkeypatch, device_tables={"H100": {"attn_min_chunk": {(4096, 32, 8, 128): 64}}})
    tune(monkeypatch, attn_min_chunk=0)
    sms(132, "NVIDIA H100 80GB HBM3")
    assert oc.attn_min_chunk(a8b) == 64 and oc.attn_min_chunk(a30) == oc.DECODE_MIN_CHUNK == 32
    sms(132, "NVIDIA H200")
    assert oc.attn_min_chunk(a8b) == 32
    tune(monkeypatch, attn_min_chunk=48)  # the setting wins everywhere
    assert oc.attn_min_chunk(a8b) == oc.attn_min_chunk(a30) == 48


def test_ffn_off_entry_turns_off_only_the_cluster_launch(sms, monkeypatch):
    """DEVICE_TUNING's ffn_off drops the one-launch FFN's cluster launch under DECODE_FFN=auto (the
    separate GEMVs instead), but the form without a cluster launch (ffn_global_plan) is taken first where it
    applies; DECODE_FFN=1 keeps the cluster launch."""
    from types import SimpleNamespace
    sms(132, "NVIDIA H200")
    tune(monkeypatch, device_tables={"H200": {"ffn_off": {(4096, 12288)}}})
    patch(monkeypatch, "pdl_enabled", lambda: True)
    patch(monkeypatch, "cu_occupancy_clusters", lambda: object())
    cluster = {"CL": 8, "TB": 2, "kind": "cluster"}
    patch(monkeypatch, "ffn_first_fit", lambda kernel, D, n: (dict(cluster), "cluster"))
    glob = {"applies": False}

    def global_plan(plan, n, at_cap_only=False):
        return (dict(plan, kind="global"), "global") if glob["applies"] else (None, "not at the cap")
    patch(monkeypatch, "ffn_global_plan", global_plan)
    a8b = SimpleNamespace(hidden_size=4096, intermediate_size=12288, group_size=128)
    a14 = SimpleNamespace(hidden_size=5120, intermediate_size=17408, group_size=128)
    tune(monkeypatch, decode_ffn="auto")
    plan, why = oc.decode_ffn_plan(a8b)
    assert plan is None and "H200" in why
    assert oc.decode_ffn_plan(a14)[0]["kind"] == "cluster"  # a shape the table does not name
    glob["applies"] = True
    assert oc.decode_ffn_plan(a8b)[0]["kind"] == "global"
    tune(monkeypatch, ffn_global="0")
    assert oc.decode_ffn_plan(a8b)[0] is None
    tune(monkeypatch, decode_ffn="1")
    assert oc.decode_ffn_plan(a8b)[0]["kind"] == "cluster"


@pytest.mark.parametrize("D,G,E,qkv", [(4096, 24576, 0, 6144), (2048, 12288, 128, 5120), (512, 1024, 7, 768),
                                       (128, 256, 1, 256)])
def test_decode_acc_layout_parts_aligned_and_disjoint(D, G, E, qkv):
    """The accumulators' parts tile the buffer in order (z padded to even), each pair-loaded part starts
    16-byte aligned even for an odd expert count, and the two cleared halves cover exactly their parts."""
    size, p = oc.decode_acc_layout(D, G, E, qkv)
    order = ["acc_o", "acc_gu", "acc_z", "acc_d", "acc_qkv"]
    widths = [D, G, E, D, qkv]
    assert [p[n].stop - p[n].start for n in order] == widths
    assert p["acc_o"].start == 0 and p["acc_qkv"].stop == size == D + G + E + E % 2 + D + qkv
    for a, b in zip(order, order[1:]):
        assert p[b].start - p[a].stop == (E % 2 if a == "acc_z" else 0)
    for n in ("acc_o", "acc_gu", "acc_d", "acc_qkv"):
        assert p[n].start % 2 == 0, n  # int64: an even index is a 16-byte boundary
    assert p["acc_o_gu"] == slice(0, p["acc_d"].start) and p["acc_d_qkv"] == slice(p["acc_d"].start, size)


def test_draw_plan_blocks_and_candidate_room(monkeypatch):
    """sample_token_mb serves greedy and top-k up to its per-block candidate room (blocks x room within
    the last block's shared memory); anything else, or a vocabulary one block covers, takes sample_token."""
    from kuiper_py.sampling import SamplingParams
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    assert oc.draw_plan(151669, greedy) == (10, 409)
    assert oc.draw_plan(151669, SamplingParams()) == (10, 409)  # the defaults: top-k 20
    assert oc.draw_plan(151669, SamplingParams(top_k=409)) == (10, 409)
    assert oc.draw_plan(151669, SamplingParams(top_k=410)) is None
    assert oc.draw_plan(151669, SamplingParams(top_k=0)) is None  # top-p alone scans every logit
    assert oc.draw_plan(16384, greedy) is None and oc.draw_plan(16385, greedy) == (2, 1024)
    assert oc.draw_plan(16385, SamplingParams(top_k=1025)) is None
    for n in (16385, 50000, 151669, 262144, 4194304):
        G, cap = oc.draw_plan(n, greedy)
        assert (G - 1) * oc.SMP_CHUNK < n <= G * oc.SMP_CHUNK and G * cap <= oc.SMP_CAND and cap <= oc.SMP_THREADS
    tune(monkeypatch, sample_mb=False)
    assert oc.draw_plan(151669, greedy) is None


# the on/off choices per attention shape (_shape_switch): the listed GPU, one that lists nothing for the shape
@pytest.mark.parametrize("choice,override,listed,other", [
    ("o_merge", "gemv_o_merge", "NVIDIA H100 80GB HBM3", "NVIDIA H200"),
    ("attn_cm", "attn_cm", "NVIDIA H200", "NVIDIA H100 80GB HBM3")])
def test_shape_choice_follows_the_table_and_the_override(sms, monkeypatch, choice, override, listed, other):
    from types import SimpleNamespace
    a8b = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    a14b = SimpleNamespace(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128)
    on = getattr(oc, choice)
    tune(monkeypatch, device_tables={listed.split()[1]: {choice: {(4096, 32, 8, 128)}}})
    tune(monkeypatch, **{override: None})
    sms(132, listed)
    assert on(a8b) and not on(a14b)
    sms(132, other)
    assert not on(a8b)
    tune(monkeypatch, **{override: True})  # the setting wins everywhere
    assert on(a8b) and on(a14b)
    tune(monkeypatch, **{override: False})
    sms(132, listed)
    assert not on(a8b)
    tune(monkeypatch, gemv_o_merge=True)  # the setting wins everywhere
    assert oc.o_merge(a8b) and oc.o_merge(a14b)
    tune(monkeypatch, gemv_o_merge=False)
    sms(132, "NVIDIA H100 80GB HBM3")
    assert not oc.o_merge(a8b)


@pytest.mark.parametrize("static,fits", [(1024, True), (64 * 1024, False)])
def test_moe_rmma_form_asks_the_fit_once_per_device(sms, monkeypatch, static, fits):
    """moe_route_mma's 16-warp form where its shared memory (dynamic stages + the kernel's static bytes) fits the
    device's opt-in limit, else the 8-warp form; above moe_route_wide_t() tokens always 8 warps. The kernel's static
    size is asked once per device and instantiation, not per prefill layer."""
    sms(132)
    asked = []

    class Fn:
        @property
        def shared_size_bytes(self):
            asked.append(1)
            return static

    patch(monkeypatch, "_RMMA_FITS", {})
    tune(monkeypatch, moe_route_wide_t=None)
    patch(monkeypatch, "current_device_id", lambda: 0)
    patch(monkeypatch, "smem_optin", lambda: 227 * 1024)
    patch(monkeypatch, "raw_kernel", lambda family, name: Fn())
    wide = ("moe_route_mma<4, 4>", 16) if fits else ("moe_route_mma<4, 2>", 8)
    for _ in range(3):
        assert oc.moe_rmma_form(128, 128) == wide
        assert oc.moe_rmma_form(16 * 132 + 1, 128) == ("moe_route_mma<4, 2>", 8)
    assert len(asked) == 1
    assert oc.moe_rmma_form(128, 256) == (("moe_route_mma<8, 2>", 16) if fits else ("moe_route_mma<8, 1>", 8))
    assert len(asked) == 2


def test_int32_arguments_made_once_and_range_checked_every_time():
    """_i: each kernel size's np.int32 made once (the same object again), the value and type as np.int32(v) for
    ints, bools and NumPy integers; a value outside int32 refused on every call, never kept."""
    import numpy as np
    from kuiper_py.errors import KuiperError
    for v in (0, 1, -7, 4096, 2**31 - 1, -2**31, True, np.int64(12288), np.uint32(5)):
        a = oc._i(v)
        assert type(a) is np.int32 and a == np.int32(v) and oc._i(v) is a
    for v in (2**31, -2**31 - 1, np.int64(2**40)):
        for _ in range(2):
            with pytest.raises(KuiperError, match="int32 range"):
                oc._i(v)
        assert v not in oc._I32


def test_gemm_matrix_records_shared_by_shape_and_dropped_with_the_weights():
    """mats_record: one entry per tuple of matrices (the same list again), a shape signature that two layers' q|k|v
    share (so a new prompt length plans the shape once), and no reference that keeps a model's weights alive: the
    entry goes when a matrix is collected."""
    import gc
    import weakref
    import numpy as np
    from kuiper_py.loader import AwqLinear

    def lin(K, N):
        return AwqLinear(np.zeros((K, N // 8), np.int32), np.zeros((K // 128, N // 8), np.int32),
                         np.ones((K // 128, N), np.float16), 128)
    a, b = (lin(2048, 4096), lin(2048, 512), lin(2048, 512)), (lin(2048, 4096), lin(2048, 512), lin(2048, 512))
    ra, rb = oc.mats_record(a), oc.mats_record(b)
    assert oc.mats_record(a) is ra and ra is not rb
    assert ra[0] == rb[0] == (((2048, 4096), (2048, 512), (2048, 512)), 128, True)
    assert oc.mats_record(a[:1])[0] == (((2048, 4096),), 128, True) and not oc.mats_record((lin(2048, 384),))[0][2]
    key, alive = tuple(map(id, a)), weakref.ref(a[1])
    assert key in oc._MATS
    del a, ra
    gc.collect()
    assert alive() is None and key not in oc._MATS


def test_fused_gemm_plan_shared_by_layers_arguments_per_layer(monkeypatch):
    """tma_gemm (the launch mocked): two layers' q|k|v of one shape share one plan (build called once), and each
    launch carries its own layer's matrices (_mat_slots) between x's descriptor and out, then the plan's tail."""
    import numpy as np
    from kuiper_py.loader import AwqLinear

    def lin(K, N):
        return AwqLinear(np.zeros((K, N // 8), np.int32), np.zeros((K // 128, N // 8), np.int32),
                         np.ones((K // 128, N), np.float16), 128)
    layers = [(lin(2048, 4096), lin(2048, 512), lin(2048, 512)) for _ in range(2)]
    launches, builds = [], []
    patch(monkeypatch, "current_device_id", lambda: 0)
    patch(monkeypatch, "tma_map_2d", lambda a, rows, cols: ("map", rows))
    patch(monkeypatch, "launch_ex", lambda fn, grid, block, args, smem: launches.append((fn, args)))
    x, out = np.zeros((100, 2048), np.float16), np.zeros((100, 5120), np.float16)
    cache = {}

    def build():
        builds.append(1)
        return "fn", (1,), (128,), 0, 64, ("tail",)
    for mats in layers * 2:
        oc.tma_gemm(cache, x, mats, out, ("s",), build)
    assert len(builds) == 1 and len(cache) == 1 and len(launches) == 4
    for (fn, args), mats in zip(launches, layers * 2):
        assert fn == "fn" and args[0] == ("map", 64) and args[-2] is out and args[-1] == "tail"
        slots = args[1:-2]
        assert len(slots) == 12 and all(slots[4 * i] is m.qweight and slots[4 * i + 2] is m.scales and slots[4 * i + 3] == m.N
                                        for i, m in enumerate(mats))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("splits", [1, 4])
def test_moe_route_passes_the_maps_to_its_last_block(monkeypatch, fused, splits):
    """moe_route (the launch mocked, NumPy arrays for CuPy's): with maps and MOE_ROUTE_MAPS, one moe_route_mma launch
    whose arguments end with the arrival counter, the tile rows and the five map arrays in moe_expert_maps' order;
    with MOE_ROUTE_MAPS off, null pointers there and then moe_maps over the same arrays and tile; without maps, null
    pointers and no moe_maps. With S splits, moe_route_mma_split over a (tiles, S) grid and two more arguments, the
    partial logits [S, T, E] and the tile counters; with one, moe_route_mma and nothing more. The dynamic shared memory
    is allowed for the instantiation launched."""
    import numpy as np
    T, D, E, k, tile = 40, 512, 128, 8, 128  # (D: 16 chunks, 4 per split over 4 K parts)
    launches, maps_calls = [], []
    counter, tile_counters = np.zeros(1, np.int32), np.zeros(oc.MOE_ROUTE_MAX_TILES, np.int32)
    patch(monkeypatch, "cp", np)
    tune(monkeypatch, moe_router="mma")
    tune(monkeypatch, moe_route_maps=fused)
    tune(monkeypatch, moe_route_splits=str(splits))
    patch(monkeypatch, "moe_rmma_form", lambda T, E: ("moe_route_mma<4, 4>", 16))
    patch(monkeypatch, "raw_kernel", lambda family, name: name)
    allowed = []
    patch(monkeypatch, "allow_dynamic_smem", lambda fn, n: allowed.append((fn, n)))
    patch(monkeypatch, "moe_route_counter", lambda: counter)
    patch(monkeypatch, "moe_route_tile_counters", lambda: tile_counters)
    patch(monkeypatch, "kernel", lambda family, name: lambda grid, block, args, shared_mem=0: launches.append(
        (name, grid, block, args, shared_mem)))
    patch(monkeypatch, "moe_maps", lambda ids, n_experts, out=None, tile_m=64: maps_calls.append(
        (ids, n_experts, out, tile_m)))
    x, router = np.zeros((T, D), np.float16), np.zeros((E, D), np.float16)
    lg, ids, w = np.zeros((T, E), np.float32), np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    arrays = tuple(np.zeros(m, np.int32) for m in (E, E + 1, E + 1, T * k, T * k))
    for maps in ((tile, *arrays), None):
        del launches[:], maps_calls[:]
        assert oc.moe_route(x, router, k, True, lg, ids, w, maps=maps) == (ids, w)
        (name, grid, block, args, smem), = launches
        assert name == ("moe_route_mma<4, 4>" if splits == 1 else "moe_route_mma_split<4, 4>")
        assert grid == (3, splits) and block == (512,) and smem == oc.moe_rmma_smem(16)
        assert allowed[-1] == (name, smem)  # (the launched instantiation's opt-in: its stages pass 48 KB)
        assert args[:5] == (x, router, lg, ids, w) and [int(a) for a in args[5:10]] == [T, D, E, k, 1]
        tail = args[10:]
        assert len(tail) == (7 if splits == 1 else 9)
        if splits > 1:
            assert tail[7].shape == (splits, T, E) and tail[7].dtype == np.float32 and tail[8] is tile_counters
        if maps is not None and fused:
            assert tail[0] is counter and int(tail[1]) == tile and all(a is b for a, b in zip(tail[2:7], arrays))
            assert maps_calls == []
        else:
            assert all(int(a) == 0 for a in tail[:7])
            if maps is None:
                assert maps_calls == []
            else:
                (got_ids, n_exp, out, tile_m), = maps_calls
                assert got_ids is ids and n_exp == E and tile_m == tile and all(a is b for a, b in zip(out, arrays))


@pytest.mark.parametrize("T,warps,ng,want", [(128, 16, 4, 8), (512, 16, 4, 4), (2048, 16, 4, 1), (16, 16, 8, 8),
                                           (4096, 8, 4, 1), (300, 16, 4, 6), (96, 8, 4, 8)])
def test_moe_route_splits_fill_one_wave(sms, monkeypatch, T, warps, ng, want):
    """moe_route_splits: the 16-token tiles times their K splits stay one wave (one 16-warp block or two 8-warp blocks
    per SM of 132), at most MOE_ROUTE_SPLIT_MAX (8), every warp of a split at least one 32-wide chunk of D (2048)."""
    sms(132)
    tune(monkeypatch, moe_route_splits="auto")
    tune(monkeypatch, moe_route_split_max=8)
    got = oc.moe_route_splits(T, 2048, warps, ng)
    assert got == want
    tiles = -(-T // 16)
    assert got == 1 or tiles * got <= 132 * (1 if warps == 16 else 2)
    assert (2048 // 32) // (warps // ng) >= got
    tune(monkeypatch, moe_route_splits="3")
    assert oc.moe_route_splits(T, 2048, warps, ng) == 3
    assert oc.moe_route_splits(T, 96, warps, ng) == 1  # 3 chunks of D, 4 K parts: no split has a chunk per warp
    assert oc.moe_route_splits(1, 2048, warps, ng) == 1  # one token never splits



@pytest.mark.parametrize("inter,group,fits", [(768, 128, True), (1536, 128, True), (832, 128, False), (768, 64, False)])
def test_moe_experts_tile_takes_tc_below_the_mean(monkeypatch, inter, group, fits):
    """moe_experts_tile on the Hopper path: gemm_moe_tc's tiles (16 rows up to MOE_TC_T16_MAX rows per expert on the
    mean, 32 above) up to MOE_TC_MAX_MEAN, gemm_moe_rs's (64 / 128) past it, with MOE_TC off, or where the shapes
    do not fit gemm_moe_tc (an intermediate size not of whole 256-column tiles, a group under 128); the mma.sync
    path's GEMM_BM off the Hopper path. Shapes only: the stacks hold empty arrays."""
    import numpy as np
    from kuiper_py.loader import AwqStack
    E, D = 128, 2048
    w13 = AwqStack(np.empty((E, 0, 2 * inter // 8), np.int32), None, np.empty((E, 0, 2 * inter), np.float16), group)
    w2 = AwqStack(np.empty((E, inter, 0), np.int32), None, np.empty((E, 0, D), np.float16), group)
    tune(monkeypatch, moe_tc="auto")
    tune(monkeypatch, moe_tc_max_mean=48)
    tune(monkeypatch, moe_tc_t16_max=10)
    tune(monkeypatch, moe_rs_bt128_from=60)
    for n, tc in ((8, 16), (10 * E, 16), (10 * E + 1, 32), (48 * E, 32), (48 * E + 1, None), (60 * E, None)):
        want = tc if fits and tc else oc.moe_rs_tile(n, E)
        assert oc.moe_experts_tile(w13, w2, n, rs=True) == (True, want), n
        assert oc.moe_experts_tile(w13, w2, n, rs=False) == (False, oc.GEMM_BM)
    tune(monkeypatch, moe_tc="0")
    assert oc.moe_experts_tile(w13, w2, 8, rs=True) == (True, 64)
