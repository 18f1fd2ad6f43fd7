"""The malloc vLLM's processes start with on a CPU (``tcmalloc_preload``),
and how a process tells which one it runs on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blend_integrations.engines.vllm_host import ALLOCATOR_ENV, tcmalloc_library, tcmalloc_preload

INSTALLED = tcmalloc_library()


def test_tcmalloc_goes_first_and_keeps_what_was_preloaded():
    preload = tcmalloc_preload({"LD_PRELOAD": "/opt/libgomp.so.1"})
    if INSTALLED is None:  # `make test` installs it (as root); elsewhere the system's malloc stays
        assert preload is None
    else:
        assert preload == f"{INSTALLED}:/opt/libgomp.so.1"
        assert tcmalloc_preload({}) == INSTALLED


@pytest.mark.parametrize(
    "environ",
    [
        {ALLOCATOR_ENV: "system"},
        {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    ],
)
def test_nothing_is_preloaded_when_asked_not_to_or_an_allocator_is_there(environ):
    assert tcmalloc_preload(environ) is None


def test_an_unknown_allocator_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\$BLEND_CPU_ALLOCATOR must be one of tcmalloc, system, got 'jemalloc'"):
        tcmalloc_preload({ALLOCATOR_ENV: "jemalloc"})


def test_a_process_started_with_the_preload_runs_on_tcmalloc():
    """What vLLM's processes get: a Python started with the preload maps
    tcmalloc, one started without it the system's malloc."""
    code = "from blend_integrations.engines.vllm_host import process_allocator; print(process_allocator())"

    def allocator(preload: str | None) -> str:
        env = {"PATH": "/usr/bin:/bin"} | ({"LD_PRELOAD": preload} if preload else {})
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout

    assert allocator(None).strip() == "system"
    preload = tcmalloc_preload({})
    assert allocator(preload).strip() == ("tcmalloc" if INSTALLED else "system")
