"""The allocator setting msjax gives its training processes: GLIBC_TUNABLES with glibc's huge
pages, other entries kept, a chosen value and the opt-out respected (msjax.allocator)."""

from __future__ import annotations

from msjax.allocator import (
    OPT_OUT_VAR,
    TUNABLES_VAR,
    allocator_env,
    allocator_record,
    on_glibc,
)


def test_other_glibc_tunables_are_kept_and_a_chosen_hugetlb_value_wins():
    if not on_glibc():
        assert allocator_env({TUNABLES_VAR: "x=1"}) == {TUNABLES_VAR: "x=1"}
        return
    kept = allocator_env({TUNABLES_VAR: "glibc.malloc.arena_max=2"})
    assert kept[TUNABLES_VAR] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    chosen = allocator_env({TUNABLES_VAR: "glibc.malloc.hugetlb=0"})
    assert chosen[TUNABLES_VAR] == "glibc.malloc.hugetlb=0"
    assert allocator_env({})[TUNABLES_VAR] == "glibc.malloc.hugetlb=1"


def test_the_opt_out_leaves_the_environment_as_it_is():
    assert TUNABLES_VAR not in allocator_env({OPT_OUT_VAR: "0"})
    assert allocator_env({OPT_OUT_VAR: "off", TUNABLES_VAR: "a=1"})[TUNABLES_VAR] == "a=1"


def test_the_record_says_whether_huge_pages_were_on():
    on = allocator_record({TUNABLES_VAR: "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert on["malloc_hugetlb"] is on_glibc() and on["opted_out"] is False
    off = allocator_record({OPT_OUT_VAR: "0"})
    assert off == {TUNABLES_VAR: "", "malloc_hugetlb": False, "opted_out": True}
