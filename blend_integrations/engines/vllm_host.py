"""Engines layer: how vLLM's processes run on a CPU host: the malloc they start
with (tcmalloc preloaded, ``$BLEND_CPU_ALLOCATOR``; the benchmarks' and the
tuner's commands restart themselves on it too) and, with tensor
parallelism, the CPUs of each rank (``VLLM_CPU_OMP_THREADS_BIND``)."""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from collections.abc import Mapping, Sequence

ALLOCATOR_ENV = "BLEND_CPU_ALLOCATOR"
ALLOCATORS = ("tcmalloc", "system")


def tcmalloc_preload(environ: Mapping[str, str] = os.environ) -> str | None:
    """``LD_PRELOAD`` with tcmalloc first, for processes about to start on a
    CPU, as vLLM's CPU install guide asks (its workers warn without it).
    glibc's malloc hands a prefill's large temporaries back to the kernel and
    faults them in again on the next one: about 200,000 page faults per full
    prefill of the benchmark's 3,126 tokens, and 15,000-30,000 per blend at
    0.15. tcmalloc keeps them. None on systems other than Linux, where
    ``LD_PRELOAD`` already names tcmalloc or jemalloc, where
    ``$BLEND_CPU_ALLOCATOR`` is "system", or where tcmalloc is not installed
    (Debian and Ubuntu: ``libtcmalloc-minimal4``)."""
    choice = environ.get(ALLOCATOR_ENV) or "tcmalloc"
    if choice not in ALLOCATORS:
        raise ValueError(f"${ALLOCATOR_ENV} must be one of {', '.join(ALLOCATORS)}, got {choice!r}")
    current = environ.get("LD_PRELOAD", "")
    if choice == "system" or not sys.platform.startswith("linux") or "tcmalloc" in current or "jemalloc" in current:
        return None
    lib = tcmalloc_library()
    if lib is None:
        return None
    return f"{lib}:{current}" if current else lib


def restart_on_tcmalloc(module: str, args: Sequence[str]) -> None:
    """Start ``python -m module args`` again in this process's place with
    tcmalloc preloaded (``os.execve``), where ``tcmalloc_preload`` gives one;
    return where it does not, and this process goes on as it is. The
    restarted process finds tcmalloc in ``LD_PRELOAD`` and goes on."""
    preload = tcmalloc_preload()
    if preload is not None:
        os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, "LD_PRELOAD": preload})


def tcmalloc_library() -> str | None:
    """The installed tcmalloc's library name (as ``LD_PRELOAD`` takes it), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def process_allocator() -> str:
    """The malloc this process runs on, from the libraries it has mapped:
    "tcmalloc", "jemalloc", or "system"."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
    except OSError:
        return "system"
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in mapped), "system")


CPU_BINDING_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_thread_binding(tensor_parallel_size: int) -> str | None:
    """The CPUs of each tensor-parallel rank on vLLM's CPU backend, as
    ``VLLM_CPU_OMP_THREADS_BIND`` takes them ("0,1|2,3"), or None where vLLM's
    own binding works or the user set one. vLLM binds each rank to a NUMA
    node of its own and refuses to start with fewer nodes than ranks, which
    most machines have; then this splits the CPUs this process may use evenly."""
    if tensor_parallel_size == 1 or CPU_BINDING_ENV in os.environ:
        return None
    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    if nodes >= tensor_parallel_size:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} on vLLM's CPU backend needs a CPU per rank, "
            f"and this process may use {len(cpus)}"
        )
    per_rank = len(cpus) // tensor_parallel_size
    ranks = [cpus[i * per_rank : (i + 1) * per_rank] for i in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, rank)) for rank in ranks)
