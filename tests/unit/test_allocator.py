"""The malloc settings msjax gives its training processes (msjax.allocator): jemalloc preloaded
where it is installed, glibc's huge pages always, what the environment already sets kept, and
MSJAX_ALLOCATOR's choices."""

from __future__ import annotations

import pytest

from msjax.allocator import (
    ALLOCATOR_VAR,
    FORMER_OPT_OUT_VAR,
    JEMALLOC_CONF,
    JEMALLOC_CONF_VAR,
    PRELOAD_VAR,
    TUNABLES_VAR,
    allocator_choice,
    allocator_env,
    allocator_record,
    jemalloc_library,
    on_glibc,
)
from msjax.errors import ConfigError

pytestmark = pytest.mark.skipif(not on_glibc(), reason="the settings are for Linux with glibc")


def test_glibc_tunables_are_kept_and_a_chosen_hugetlb_value_wins():
    kept = allocator_env({TUNABLES_VAR: "glibc.malloc.arena_max=2"})
    assert kept[TUNABLES_VAR] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    chosen = allocator_env({TUNABLES_VAR: "glibc.malloc.hugetlb=0"})
    assert chosen[TUNABLES_VAR] == "glibc.malloc.hugetlb=0"


def test_auto_preloads_jemalloc_where_it_is_installed_before_what_is_preloaded():
    env = allocator_env({PRELOAD_VAR: "libfoo.so"})
    if jemalloc_library() is None:
        assert env[PRELOAD_VAR] == "libfoo.so" and JEMALLOC_CONF_VAR not in env
        return
    assert env[PRELOAD_VAR] == f"{jemalloc_library()}:libfoo.so"
    assert env[JEMALLOC_CONF_VAR] == JEMALLOC_CONF
    chosen = allocator_env({JEMALLOC_CONF_VAR: "narenas:4"})
    assert chosen[JEMALLOC_CONF_VAR] == "narenas:4"
    already = allocator_env({PRELOAD_VAR: "/opt/lib/libjemalloc.so"})
    assert already[PRELOAD_VAR] == "/opt/lib/libjemalloc.so"


def test_glibc_leaves_out_jemalloc_and_off_leaves_the_environment_as_it_is():
    glibc = allocator_env({ALLOCATOR_VAR: "glibc"})
    assert PRELOAD_VAR not in glibc and glibc[TUNABLES_VAR] == "glibc.malloc.hugetlb=1"
    assert allocator_env({ALLOCATOR_VAR: "off"}) == {ALLOCATOR_VAR: "off"}
    assert allocator_env({FORMER_OPT_OUT_VAR: "0", TUNABLES_VAR: "a=1"})[TUNABLES_VAR] == "a=1"


def test_a_bad_choice_is_one_error_naming_the_choices():
    with pytest.raises(ConfigError, match="MSJAX_ALLOCATOR='jemallok': expected one of auto"):
        allocator_choice({ALLOCATOR_VAR: "jemallok"})
    assert allocator_choice({ALLOCATOR_VAR: " GLIBC "}) == "glibc"


def test_the_record_says_what_this_process_runs_with():
    record = allocator_record({TUNABLES_VAR: "glibc.malloc.hugetlb=1", ALLOCATOR_VAR: "glibc"})
    assert record["malloc"] == "glibc"  # the test process itself runs on glibc's malloc
    assert record["choice"] == "glibc" and record["malloc_hugetlb"] is True
    off = allocator_record({FORMER_OPT_OUT_VAR: "0"})
    assert off["choice"] == "off" and off["malloc_hugetlb"] is False
