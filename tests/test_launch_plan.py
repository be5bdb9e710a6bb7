"""Launch plans (sparkccl/dataplane/launch_plan.py and the native LaunchPlan): how a call's
pointers are marked, recorded and patched; what the native plan refuses. The plans'
replays themselves are tested with the data planes (tests/test_cuda_dataplane.py
test_launch_plans_*, on the CPU emulation and on the GPU)."""
import pytest

from sparkccl import _native as N
from sparkccl.dataplane.launch_plan import PlanSetting, U64, CallPtr, PlanCache, Recording, Slotted, plain


def test_offsets_of_a_call_pointer_stay_marked():
    p = CallPtr(1000, 1)
    q = p + 24
    assert type(q) is CallPtr and (int(q), q.arg, q.add) == (1024, 1, 24)
    r = 8 + q
    assert type(r) is CallPtr and (int(r), r.add) == (1032, 32)
    assert type(p + CallPtr(5, 0)) is int  # the sum of two call pointers is no pointer
    assert plain((p, 7, q)) == (1000, 7, 1024) and all(type(a) is int for a in plain((p, q)))


def test_a_slot_address_stays_a_term_of_seq():
    """Mode "ce" rows take an address in slot seq % n as base + (seq % n) * stride: offsets
    added to it keep the mark (numpy integers too), so the program holds no one call's slot;
    a call pointer added to it is no slot address any more."""
    import numpy as np
    from sparkccl.dataplane import ce_engine as E
    s = Slotted(0x10000, 3, 0x400, seq=7)
    assert int(s) == 0x10000 + 0x400
    t = 3 * 16 + (s + np.int64(8))
    assert type(t) is Slotted and int(t) == 0x10438 and (t.base, t.mod, t.stride, t.add) == \
        (0x10000, 3, 0x400, 56)
    assert E._sym(t) == (0x10038, E.T_MOD + E.CE_MODS.index(3), 0x400)
    assert E._sym(Slotted(0, 2, 64, seq=1) + 4) == (4, E.T_MOD + E.CE_MODS.index(2), 64)
    assert E._sym(CallPtr(0x9000, 1) + 32) == (32, E.T_ARG + 1, 1)
    assert E._sym(99) == (99, E.T_ZERO, 0)
    assert type(s + CallPtr(5, 0)) is int


def test_recording_patches_only_the_marked_parameters():
    src, dst = CallPtr(0x1000, 0), CallPtr(0x9000, 1)
    rec = Recording.of([("k1", 4, 256, (src, 5, dst + 64), False),
                        ("k2", 1, 32, (7, dst), False)])
    assert rec.rows == (("k1", 4, 256, (0x1000, 5, 0x9040), False),
                        ("k2", 1, 32, (7, 0x9000), False))
    # (launch, byte offset of the parameter word, call argument, addend)
    assert rec.patches == ((0, 0, 0, 0), (0, 16, 1, 64), (1, 8, 1, 0))
    assert rec.launches_for((0x2000, 0xA000)) == [("k1", 4, 256, [0x2000, 5, 0xA040]),
                                                  ("k2", 1, 32, [7, 0xA000])]
    neg = Recording.of([("k", 1, 32, (CallPtr(100, 0) + -16,), False)])  # below the pointer
    assert neg.patches == ((0, 0, 0, (-16) & U64),)
    assert neg.launches_for((200,))[0][3] == [184]


def test_a_struct_argument_is_patched_at_its_fields_offsets():
    """A kernel whose one parameter is a protocol.h kargs struct (by value): the recording
    keeps its words, and a call pointer's patch is the field's byte offset (protocol.h
    PUB_*), so a replay writes the call's pointer into that field."""
    from sparkccl import layout
    P = layout.protocol_constants()
    fields = {k[4:]: 0 for k in P if k.startswith("PUB_") and k != "PUB_BYTES"}
    fields.update(SRC=CallPtr(0x1000, 0) + 32, DST2=CallPtr(0x9000, 1), L=100, S=112)
    words = layout.pack_struct("PUB", fields)
    px = {k[3:]: 0 for k in P if k.startswith("PX_") and k != "PX_BYTES"}
    px.update(PUB=words, OUT=CallPtr(0x9000, 1) + 8)
    outer = layout.pack_struct("PX", px)
    assert len(words) * 8 == P["PUB_BYTES"] and len(outer) * 8 == P["PX_BYTES"]
    rec = Recording.of([("sccl_ag_proxy", 9, 512, tuple(outer), True)])
    assert rec.rows[0][4] is True and rec.rows[0][3][P["PUB_L"] // 8] == 100
    assert rec.patches == ((0, P["PUB_SRC"], 0, 32), (0, P["PUB_DST2"], 1, 0),
                           (0, P["PX_OUT"], 1, 8))
    got = rec.launches_for((0x2000, 0xA000))[0][3]
    assert (got[P["PUB_SRC"] // 8], got[P["PUB_DST2"] // 8], got[P["PX_OUT"] // 8]) == \
        (0x2020, 0xA000, 0xA008)
    with pytest.raises(ValueError):  # every field named, none left out
        layout.pack_struct("PUB", {"SRC": 1})
    with pytest.raises(ValueError):  # a nested struct that runs into the next field
        layout.pack_struct("PX", {**px, "PUB": words + [0]})


def test_cache_stores_only_declared_plannable_paths():
    cache = PlanCache(limit=2)
    with cache.planning("a", lambda rec: rec):
        cache.record("k", 1, 32, (CallPtr(1, 0),))  # not declared plannable
    assert "a" not in cache.plans and cache.stats["misses"] == 1
    with cache.planning("b", lambda rec: rec):
        cache.plannable()
        cache.called(0x301)
        cache.record("k", 1, 32, (CallPtr(1, 0),))
    plan, entries, direct, call = cache.plans["b"]
    assert plan.rows == (("k", 1, 32, (1,), False),)
    assert plan.patches == ((0, 0, 0, 0),) and (entries, direct, call) == (8, False, 0x301)
    with pytest.raises(RuntimeError):
        with cache.planning("c", lambda rec: rec):
            cache.plannable()
            cache.record("k", 1, 32, ())
            raise RuntimeError("the planning path failed")
    assert "c" not in cache.plans and not cache.recording()
    with cache.planning("d", lambda rec: rec):
        cache.plannable()
        cache.record("k", 1, 32, ())
    with cache.planning("e", lambda rec: rec):  # full (limit 2): all dropped, then e kept
        cache.plannable()
        cache.record("k", 1, 32, ())
    assert set(cache.plans) == {"e"}
    cache.invalidate()
    assert not cache.plans and cache.generation == 1 and cache.stats["invalidations"] == 1


def test_a_new_setting_drops_the_plans():
    """A plan's key is the collective's shape alone: every setting the planning reads drops
    the plans when it takes a new value (and only then), so no plan of the old value is
    replayed."""
    from sparkccl.dataplane import cuda as C
    dp = object.__new__(C.CudaDataPlane)
    dp.direct_mode = "auto"  # (before any plans exist: nothing to drop)
    dp.plans = PlanCache()
    for name in ("direct_mode", "phases", "on_failure", "max_publish_blocks", "max_wait_blocks",
                 "max_direct_blocks", "max_direct_wait_blocks", "ce_min_slice"):
        assert isinstance(getattr(C.CudaDataPlane, name), PlanSetting), name
        setattr(dp, name, 1)
        dp.plans.plans["shape"] = ("plan", 8, False, 0)
        before = dp.plans.stats["invalidations"]
        setattr(dp, name, 1)  # the same value: kept
        assert "shape" in dp.plans.plans and getattr(dp, name) == 1, name
        setattr(dp, name, 2)
        assert not dp.plans.plans and dp.plans.stats["invalidations"] == before + 1, name
        assert getattr(dp, name) == 2
    assert getattr(object.__new__(C.CudaDataPlane), "phases", None) is None  # unset: no value


def test_native_plan_refuses_what_it_cannot_launch():
    ok = [(1, 2, 32, [0, 0], False)]
    N.LaunchPlan(1, 1, ok, [(0, 8, 5, 8)])  # (made without CUDA: nothing is launched yet)
    N.LaunchPlan(1, 1, [(1, 2, 32, [0, 0, 0], True)], [(0, 16, 0, 0)])  # a struct's field
    for ctx, ev, kernels, patches in [
            (0, 1, ok, []),                        # no context
            (1, 1, [], []),                        # no kernels
            (1, 1, [(0, 2, 32, [0], False)], []),  # no function
            (1, 1, [(1, 0, 32, [0], False)], []),  # no blocks
            (1, 1, [(1, 2, 2048, [0], False)], []),  # too many threads
            (1, 1, [(1, 2, 32, [], True)], []),    # a struct of no bytes
            (1, 1, ok, [(1, 0, 0, 0)]),            # no launch 1
            (1, 1, ok, [(0, 16, 0, 0)]),           # no word at byte 16
            (1, 1, ok, [(0, 4, 0, 0)]),            # not a 64-bit word's offset
            (1, 1, ok, [(0, 0, 6, 0)])]:           # no call argument 6
        with pytest.raises(ValueError):
            N.LaunchPlan(ctx, ev, kernels, patches)
