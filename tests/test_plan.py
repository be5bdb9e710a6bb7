"""Plans and their verifier: every topology, world and root count verifies; broken plans don't."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sparkccl.plan.build import build_all, build_plan
from sparkccl.plan.geometry import (
    ALIGN, PIECES, ROOT_SPLIT_MIN, Part, cut, piece_bounds, split_point, sub_range,
)
from sparkccl.plan.model import OnFlag, OnPublish, Op, Region, decode_flag_word, flag_word
from sparkccl.plan.verify import (
    ALL_REDUCE, Collective, PlanError, default_sequence, lower_bound, verify, verify_plans,
)
from sparkccl.plan.waits import (
    PART_NONE, PART_WHOLE, ce_words, max_wait_words, part_code, part_of, wait_parts, wait_table,
)

WORLDS = range(2, 9)


# -- geometry --------------------------------------------------------------------------

@pytest.mark.parametrize("granule", [16, 48, 8192])
def test_pieces_tile_the_slice_on_granule_boundaries(granule):
    for size in list(range(0, 600)) + [4096 * 3 + 5, 1 << 20, (1 << 20) + 1]:
        if granule != 16:
            size = (size % 50) * granule
        bounds = [piece_bounds(size, c, granule) for c in range(PIECES)]
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        for (lo, hi), (lo2, _) in zip(bounds, bounds[1:]):
            assert lo <= hi == lo2
            assert lo % granule == 0 or lo == size
        assert max(hi - lo for lo, hi in bounds) <= -(-size // PIECES) + granule


def test_split_point_is_half_rounded_up_to_16():
    assert split_point(0, 40) == 32
    assert split_point(0, 10) == 10
    assert split_point(16, 16 + 33) == 16 + 32
    assert split_point(0, 0) == 0
    for n in range(0, 300):
        h = split_point(100, 100 + n)
        assert 100 <= h <= 100 + n
        assert (h - 100) % ALIGN == 0 or h == 100 + n


def test_parts_tile_a_piece():
    for n in (0, 1, 17, 100, 1000):
        for roots in (1, 2):
            for halves in (1, 2):
                spans = sorted(sub_range(64, 64 + n, Part(k, roots, h, halves))
                               for k in range(roots) for h in range(halves))
                assert spans[0][0] == 64 and spans[-1][1] == 64 + n
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_small_pieces_go_whole_on_root_0():
    """A piece of at most ROOT_SPLIT_MIN bytes is not split between two roots (root 0 carries
    it, root 1's range is empty, its flag goes alone); a larger one is, at split_point; the
    direction halves split either way."""
    for n in (0, 16, 1000, ROOT_SPLIT_MIN, ROOT_SPLIT_MIN + 16, 4 * ROOT_SPLIT_MIN):
        r0, r1 = (sub_range(64, 64 + n, Part(k, 2, 0, 1)) for k in (0, 1))
        if n <= ROOT_SPLIT_MIN:
            assert r0 == (64, 64 + n) and r1 == (64 + n, 64 + n), n
        else:
            assert r0 == (64, split_point(64, 64 + n)) and r1 == (r0[1], 64 + n), n
        h0, h1 = (sub_range(64, 64 + n, Part(0, 1, h, 2)) for h in (0, 1))
        assert h0 == (64, split_point(64, 64 + n)) and h1 == (h0[1], 64 + n), n


def test_flag_words_decode():
    for w in WORLDS:
        seen = set()
        for op in Op:
            for o in range(w):
                for ch in (0, 1):
                    for root in (0, 1):
                        word = flag_word(w, op, o, ch, root)
                        assert decode_flag_word(w, word) == (op, o, ch, root)
                        seen.add(word)
        assert seen == set(range(len(seen)))


# -- every combination verifies ---------------------------------------------------------

@pytest.mark.parametrize("roots", [1, 2])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("topology", ["mesh", "ring"])
def test_plans_verify(topology, world, roots):
    """The default sequence mixes fused all-reduces (both ops under one seq) with the other
    collectives; the union plan's busiest port meets its bound too."""
    assert ALL_REDUCE in {c.kind for c in default_sequence()}
    report = verify(topology, world, roots)
    for op in (*Op, ALL_REDUCE):
        assert report.max_port_load(op) == pytest.approx(lower_bound(op, topology, world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("topology", ["mesh", "ring"])
def test_plans_verify_at_many_sizes(topology, world):
    """Each size, alone and in a row with the others, for every kind of collective."""
    sizes = [1, 2, 15, 16, 17, 31, 33, 127, 128, 129, 255, 257, 1023, 1025, 4096 + 48, 99991]
    seq = [Collective(k, s) for s in sizes for k in ("AG", "RS")]
    seq += [Collective(ALL_REDUCE, s) for s in sizes[::3]]
    seq += [Collective("FIN", rows * rb, rb) for rows, rb in ((8, 16), (9, 32), (64, 8192))]
    verify_plans(build_all(topology, world, 2), seq)


def test_all_reduce_bound_is_the_two_halves():
    """Mesh: each rank sends and receives 2 (W-1)/W of the vector (2 (W-1) chunks); ring: the
    reduce-scatter's raw-relay bound plus the all-gather's."""
    for w in WORLDS:
        assert lower_bound(ALL_REDUCE, "mesh", w) == 2 * (w - 1)
        assert lower_bound(ALL_REDUCE, "ring", w) == (lower_bound(Op.RS, "ring", w)
                                                      + lower_bound(Op.AG, "ring", w))
    assert lower_bound(ALL_REDUCE, "ring", 4) == 3.5


def test_ring_world4_loads_match_spec():
    ag = verify("ring", 4, 2)
    assert ag.max_port_load(Op.AG) == 1.5
    assert ag.max_port_load(Op.RS) == 2.0
    # Every port of every rank carries the same load, both ways.
    assert set(ag.port_out.values()) | set(ag.port_in.values()) == {1.5, 2.0, 3.5}
    assert ag.max_port_load(ALL_REDUCE) == 3.5  # the fused all-reduce: both, on every port


def test_ring_talks_only_to_neighbours_and_world4_relays_through_own_block():
    for w in WORLDS:
        for r in range(w):
            p = build_plan("ring", w, r, 2)
            assert {c.peer for c in p.connections} <= {(r + 1) % w, (r - 1) % w}
    p = build_plan("ring", 4, 1, 2)
    staged = [it for s in p.streams_of(Op.RS) for it in s.items
              if s.origin == 1 and it.dst_region == Region.RS_RECV and it.dst_block in (1, 2, 0)
              and it.src_block == 3]
    # Chunk r+2 goes half each way into the neighbour's own RS recv position (docs/CONTRACT.md §3).
    assert {(it.dst_block, it.part.half) for it in staged} == {(2, 0), (0, 1)}
    assert build_plan("ring", 4, 0, 2).rs_recv_blocks == 4


def test_mesh_serves_peers_in_staggered_order():
    p = build_plan("mesh", 5, 2, 1)
    assert [c.peer for c in p.connections] == [3, 4, 0, 1]


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="topology"):
        build_plan("torus", 4, 0)
    with pytest.raises(ValueError, match="world"):
        build_plan("mesh", 9, 0)
    with pytest.raises(ValueError, match="roots"):
        build_plan("mesh", 4, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        build_plan("mesh", 4, 4)


# -- broken plans are caught ------------------------------------------------------------

def _mutate(plans, rank, stream_index, **changes):
    plans = list(plans)
    p = plans[rank]
    streams = list(p.streams)
    streams[stream_index] = dataclasses.replace(streams[stream_index], **changes)
    plans[rank] = dataclasses.replace(p, streams=tuple(streams))
    return plans


def _first(plan, pred):
    return next(i for i, s in enumerate(plan.streams) if pred(s))


@pytest.mark.parametrize("topology", ["mesh", "ring"])
def test_byte_delivered_twice_is_caught(topology):
    plans = build_all(topology, 4, 2)
    k = _first(plans[0], lambda s: s.op == Op.RS)
    st = plans[0].streams[k]
    broken = _mutate(plans, 0, k, items=st.items + st.items[:1])
    with pytest.raises(PlanError, match="delivered twice"):
        verify_plans(broken)


def test_flag_with_two_writers_is_caught():
    plans = build_all("mesh", 3, 2)
    a = _first(plans[0], lambda s: s.op == Op.AG)
    # Make rank 0's second AG stream (other root) write the first one's flag word.
    b = _first(plans[0], lambda s: s.op == Op.AG and s.conn != plans[0].streams[a].conn
               and plans[0].connections[s.conn].peer == plans[0].connections[
                   plans[0].streams[a].conn].peer)
    broken = _mutate(plans, 0, b, dst_flag=plans[0].streams[a].dst_flag)
    with pytest.raises(PlanError, match="two writers"):
        verify_plans(broken)


@pytest.mark.parametrize("op", [Op.AG, Op.RS])
def test_relay_before_its_flag_is_caught(op):
    plans = build_all("ring", 4, 2)
    k = _first(plans[1], lambda s: s.op == op and isinstance(s.trigger, OnFlag))
    # Fire on this rank's own publish instead of on the flag that carried the bytes here.
    broken = _mutate(plans, 1, k, trigger=OnPublish(frozenset({1})))
    with pytest.raises(PlanError, match="before"):
        verify_plans(broken)


def test_relay_on_the_wrong_flag_is_caught():
    plans = build_all("ring", 4, 2)
    k = _first(plans[1], lambda s: s.op == Op.AG and isinstance(s.trigger, OnFlag))
    w = plans[1].streams[k].trigger.word
    other_root = w ^ 1  # same origin and channel, the other root's connection
    broken = _mutate(plans, 1, k, trigger=OnFlag(other_root))
    # Slices whose pieces both roots carry: the relay fires on a flag that proves nothing
    # about the bytes it forwards.
    with pytest.raises(PlanError, match="before a flag that proves"):
        verify_plans(broken, default_sequence(sizes=(65537, 100000)))
    # Small slices leave root 1 idle: that flag never comes.
    with pytest.raises(PlanError, match="deadlock"):
        verify_plans(broken)


def test_missing_stream_is_caught():
    plans = list(build_all("ring", 5, 2))
    p = plans[2]
    k = _first(p, lambda s: s.op == Op.RS and isinstance(s.trigger, OnFlag))
    plans[2] = dataclasses.replace(p, streams=p.streams[:k] + p.streams[k + 1:])
    with pytest.raises(PlanError, match="deadlock|nobody writes|received"):
        verify_plans(plans)


def test_wrong_destination_block_is_caught():
    plans = build_all("mesh", 4, 1)
    k = _first(plans[0], lambda s: s.op == Op.RS)
    st = plans[0].streams[k]
    it = dataclasses.replace(st.items[0], src_block=(st.items[0].src_block + 1) % 4)
    broken = _mutate(plans, 0, k, items=(it,),
                     trigger=OnPublish(frozenset({it.src_block})))
    with pytest.raises(PlanError, match="expected rank 0's block"):
        verify_plans(broken)


def test_relay_item_naming_another_chunk_is_caught():
    """A relay of a sized all-to-all cuts its parts at the length of chunk ``target`` (the
    origin's call entry): an item naming another chunk than the bytes it carries would cut
    them at the wrong length."""
    plans = build_all("ring", 4, 2)
    k = _first(plans[1], lambda s: s.op == Op.RS and isinstance(s.trigger, OnFlag))
    st = plans[1].streams[k]
    it = dataclasses.replace(st.items[0], target=(st.items[0].target + 1) % 4)
    with pytest.raises(PlanError, match="as chunk"):
        verify_plans(_mutate(plans, 1, k, items=(it, *st.items[1:])))


@pytest.mark.parametrize("region", [Region.AG, Region.RS_SEND, Region.RS_RECV])
def test_too_few_slots_are_caught(region):
    slots = {Region.AG: 3, Region.RS_SEND: 2, Region.RS_RECV: 2}
    slots[region] = 1
    with pytest.raises(PlanError, match="slot reuse"):
        verify_plans(build_all("ring", 4, 2), default_sequence(), slots)


def test_fused_all_reduces_back_to_back():
    """All-reduces alone, each using both regions under its seq: proven with the protocol's
    slots. Even one AG slot is proven safe here (a rank's all-gather part of seq s+1 waits
    for every rank's reduce-scatter part of s+1, sent after each finished s), so the three
    AG slots matter only for all-gathers between them (test_too_few_slots_are_caught, whose
    default sequence holds all-reduces too); one RS slot is caught."""
    seq = [Collective(ALL_REDUCE, s) for s in (4096, 17, 1 << 16, 48, 4096, 1000, 99, 4112)]
    plans = build_all("ring", 4, 2)
    verify_plans(plans, seq)
    verify_plans(plans, seq, {Region.AG: 1, Region.RS_SEND: 2, Region.RS_RECV: 2})
    for region in (Region.RS_SEND, Region.RS_RECV):
        slots = {Region.AG: 3, Region.RS_SEND: 2, Region.RS_RECV: 2}
        slots[region] = 1
        with pytest.raises(PlanError, match="slot reuse"):
            verify_plans(plans, seq, slots)


def test_fused_all_reduce_waits_for_its_reduce_scatter_part():
    """A relay of the reduce-scatter part that never fires (its trigger is a word nobody
    writes): the rank behind it never gets piece 0 of its chunk, so it never publishes its
    all-gather part, and the verifier names the deadlock."""
    plans = build_all("ring", 4, 2)
    k = _first(plans[1], lambda s: s.op == Op.RS and isinstance(s.trigger, OnFlag))
    broken = _mutate(plans, 1, k, trigger=OnFlag(flag_word(4, Op.RS, 1, 0, 0)))
    with pytest.raises(PlanError, match="deadlock: rank .* never finishes AR seq 0"):
        verify_plans(broken, [Collective(ALL_REDUCE, 4096)])


# -- what each wait word carries (plan/waits.py) ---------------------------------------

def test_wait_parts_cover_every_piece_once():
    """wait_parts: each source's words carry disjoint parts that tile a piece, for every
    topology and world; the reduce-scatter split covers the piece once too."""
    for topology in ("mesh", "ring"):
        for world in range(2, 9):
            for roots in (1, 2):
                for r in range(world):
                    plan = build_plan(topology, world, r, roots)
                    maxw = max_wait_words(plan)
                    t = wait_parts(plan, maxw)
                    for op in (0, 1):
                        for S in (0, 16, 48, 1000 * 16 + 32, 123456 * 16):
                            for c in range(PIECES):
                                lo, hi = piece_bounds(S, c)
                                rows = [i for i in range(world) if i != r] + [world]
                                for i in rows:
                                    got = []
                                    for code in t[op][i]:
                                        if code:
                                            got.append(sub_range(lo, hi, part_of(code)))
                                    got = sorted(x for x in got if x[1] > x[0])
                                    cover = [lo] + [b for a, b in got]
                                    assert [a for a, b in got] == cover[:-1] and cover[-1] == hi \
                                        or (lo == hi and not got), (topology, world, r, op, i)


def test_part_codes_round_trip_and_cut_clamps_to_the_data():
    for part in (Part(0, 1, 0, 1), Part(1, 2, 0, 2), Part(0, 2, 1, 2), Part(1, 2, 1, 1)):
        assert part_of(part_code(part)) == part
    assert PART_WHOLE == part_code(Part(0, 1, 0, 1)) and PART_NONE == 0
    lo, hi = piece_bounds(1000, 3)
    assert cut(lo, hi, Part(0, 1, 0, 1), 10_000) == (lo, hi)
    assert cut(lo, hi, Part(1, 2, 0, 1), lo + 5) == (lo + 5, lo + 5)  # all padding
    a, e = sub_range(lo, hi, Part(0, 2, 1, 2))
    assert cut(lo, hi, Part(0, 2, 1, 2), a + 3) == (a, a + 3)


def test_wait_table_lists_every_source_word():
    plan = build_plan("ring", 4, 1, 2)
    maxw = max_wait_words(plan)
    t = wait_table(plan, maxw)
    for op in Op:
        for i, words in enumerate(plan.waits[op]):
            assert t[int(op)][i] == list(words) + [-1] * (maxw - len(words))


def test_ce_words_keep_a_sum_whose_word_no_source_sends():
    W, maxw = 2, 3
    waits = [[-1] * maxw for _ in range(W)]
    waits[1][0] = 7  # source 1 sends word 0 only
    parts = [[PART_NONE] * maxw for _ in range(W + 1)]
    parts[1][0] = PART_WHOLE
    parts[W][maxw - 1] = PART_WHOLE  # the reduce-scatter sums after the last word
    assert ce_words(waits, parts, 0, reduce=True) == [
        (0, [(1, Part(0, 1, 0, 1))], False), (maxw - 1, [], True)]
    assert ce_words(waits, parts, 0, reduce=False) == [(0, [(1, Part(0, 1, 0, 1))], False)]


def test_plan_layer_needs_no_native_module():
    """Plans, layout and geometry are pure Python: they import (and read protocol.h) with
    the native module unavailable."""
    code = ("import sys; sys.modules['sparkccl._native'] = None; "
            "import sparkccl.plan.waits as w, sparkccl.layout as L; "
            "from sparkccl.plan import build_plan; p = build_plan('mesh', 3, 0, 2); "
            "print(w.max_wait_words(p), L.FLAGS_OFFSET)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "20480"


# -- the command ------------------------------------------------------------------------

def _plan_cli(*args):
    out = subprocess.run([sys.executable, "-m", "sparkccl.cli", "plan", *args],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def test_cli_ring4_port_loads():
    ag = _plan_cli("--collective", "all_gather", "--topology", "ring", "--world", "4")
    assert ag[-1] == "max port load: 1.5 slices (lower bound 1.5)"
    assert any(line.startswith("verifier: passed") for line in ag)
    rs = _plan_cli("--collective", "reduce_scatter", "--topology", "ring", "--world", "4")
    assert rs[-1] == "max port load: 2 slices (lower bound 2)"


def test_cli_mesh8_roots1():
    out = _plan_cli("--collective", "reduce_scatter", "--topology", "mesh", "--world", "8",
                    "--roots", "1")
    assert out[-1] == "max port load: 7 slices (lower bound 7)"


def test_plan_summary_of_the_fused_all_reduce():
    """`sparkccl plan --collective all_reduce`: the union plan's loads against its bound."""
    from sparkccl.plan.report import plan_summary
    text, ok = plan_summary("all_reduce", "ring", 3)
    assert ok and "verifier: passed" in text
    assert "max port load: 2 slices (lower bound 2)" in text
    assert "8 streams for this collective (0 relays)" in text
