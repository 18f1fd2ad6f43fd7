"""Shared fixtures: small models built locally (no hub), one engine per model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from blend_integrations import BlendConfig, ChunkStore, load_engine
from tests.fixtures.gpu import vllm_gpu_args
from tests.fixtures.local_models import build_model, sample_text

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Lazily built model directories by name."""
    built: dict[str, str] = {}
    specs = {
        "llama": dict(arch="llama"),
        "llama_seed1": dict(arch="llama", seed=1),
        # one KV head (multi-query attention): on two ranks vLLM copies it to both
        "mistral": dict(arch="mistral", num_kv_heads=1),
        "qwen2": dict(arch="qwen2"),
        "qwen3": dict(arch="qwen3"),
        "gemma2": dict(arch="gemma2"),
        "gemma3_text": dict(arch="gemma3_text"),
        "phi3": dict(arch="phi3"),
        "olmo2": dict(arch="olmo2"),
        "granite": dict(arch="granite"),
        "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    }

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_model(tmp_path_factory.mktemp(name), **specs[name]))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF file, converted once per machine into the
    user cache (``make install`` did it; else this does) and shared by every test."""
    from blend_integrations.models.smollm2 import smollm2_dir, smollm2_gguf

    smollm2_dir()
    return smollm2_gguf()


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Gemma 3 270M's GGUF file (joined from its four packages), converted once
    per machine into the user cache, as ``smollm2_gguf``."""
    from blend_integrations.models.packaged import GEMMA3_270M

    GEMMA3_270M.checkpoint()
    return GEMMA3_270M.gguf()


@pytest.fixture(scope="session")
def qwen05_gguf():
    """Qwen2.5-Coder-0.5B-Instruct's GGUF file (joined from its six packages),
    converted once per machine to bfloat16 into the user cache, as ``smollm2_gguf``."""
    from blend_integrations.models.packaged import QWEN25_CODER_05B

    QWEN25_CODER_05B.checkpoint()
    return QWEN25_CODER_05B.gguf()


@pytest.fixture(scope="session")
def examples_store(tmp_path_factory):
    """One store for the examples, the notebook and the quickstart page, as a user's: the first
    of them to run computes the examples' chunk KV in it, the others read it. Nothing calibrates
    in it, so "auto" is the packaged calibration throughout. ``make test`` gives both of its runs
    the same one ($BLEND_TEST_EXAMPLES_STORE)."""
    shared = os.environ.get("BLEND_TEST_EXAMPLES_STORE")
    return Path(shared) if shared else tmp_path_factory.mktemp("examples") / "store"


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    s = ChunkStore(tmp_path_factory.mktemp("store"))
    yield s
    s.close()


@pytest.fixture(scope="session")
def engines(model_dirs, store):
    """Engines by (model name, dtype), all sharing one store. They run without the live check
    (``quality_check=0``): they serve many tests' requests, and which answer a check picks would
    depend on the tests run before (the live check's own tests: test_live_check.py)."""
    made = {}

    def get(name: str = "llama", dtype: str = "float32", config: BlendConfig | None = None):
        key = (name, dtype, config)
        if key not in made:
            unchecked = (config or BlendConfig()).replace(quality_check=0.0)
            made[key] = load_engine(model_dirs(name), store=store, dtype=dtype, device="cpu", config=unchecked)
        return made[key]

    return get


@pytest.fixture(scope="session")
def engine(engines):
    return engines("llama")


@pytest.fixture
def docs():
    """Fresh documents for each test (new text, so store state never leaks between tests)."""
    import uuid

    seed = uuid.uuid4().int % 10**9
    return [" ".join(sample_text(5, seed=seed + i)) for i in range(4)]


@pytest.fixture(params=["transformers", "vllm"])
def any_engine(request):
    """Each test with it runs on the transformers engine, then on the embedded vLLM engine."""
    return request.getfixturevalue("engine" if request.param == "transformers" else "vllm_engine")


VLLM_REDIS_PASSWORD = "vllm-secret"
# The session vLLM engine's KV cache in tokens: above max_model_len (2048), so vLLM starts, and below
# a few prompts' worth, so concurrent requests are preempted.
KV_CACHE_TOKENS = 3072


@pytest.fixture(scope="session")
def vllm_engine(model_dirs, store, redis_server):
    """One embedded vLLM engine (CPU build here) for the whole session: it takes ~40 s to start.

    Its store is the session store's directory with the session's Redis server as its remote tier,
    reached as a user with a password, so that the password's way into vLLM's processes is used too.
    """
    from blend_integrations.engines.vllm_contract import engine_block_size
    from blend_integrations.models.loading import resolve_device

    redis_server.client().acl_setuser(
        "blend", enabled=True, passwords=[f"+{VLLM_REDIS_PASSWORD}"], keys=["*"], categories=["+@all"]
    )
    remote = f"redis://blend:{VLLM_REDIS_PASSWORD}@127.0.0.1:{redis_server.port}/0"
    # A small KV cache (KV_CACHE_TOKENS) so that concurrent requests get preempted for real, asked for
    # in blocks of the size the engine sets (32 tokens on a CPU: 96 blocks; 16 on a GPU, where
    # kv_cache_gib does not apply). Its worker extension can also inject faults into the blend pass
    # (tests/blend_faults.py).
    on_gpu = resolve_device("auto").type == "cuda"
    engine = load_engine(
        model_dirs("llama"),
        backend="vllm",
        store=ChunkStore(store.path, remote=remote),
        config=BlendConfig(quality_check=0.0),  # as the ``engines``: without the live check
        **vllm_gpu_args(),
        max_model_len=2048,
        kv_cache_gib=1,
        num_gpu_blocks_override=KV_CACHE_TOKENS // engine_block_size(on_gpu),
        disable_log_stats=False,
        # SDPA here, vLLM's kernel in the family and tensor-parallel tests: both ways are
        # tested on any CPU ("auto" picks one per machine; its test makes the worker choose).
        walk_attention="sdpa",
        worker_extension_cls="blend_faults.FaultInjection",
    )
    yield engine
    engine.close()


BLEND_SERVER_KEY = "blend-test-key"


@pytest.fixture(scope="session")
def blend_server(model_dirs, store):
    """A real blend server process (vLLM's OpenAI server with the connector) on loopback,
    behind an API key (``blend_server.api_key``), as a shared server would run."""
    from tests.fixtures.blend_server import BlendServer

    server = BlendServer(
        model_dirs("llama"),
        store=store.path,
        log=store.path.parent / "server.log",
        # no live check: which answer is checked, and so "auto", must not depend on the tests' order
        args=["--max-model-len", "2048", "--kv-cache-gib", "1", "--api-key", BLEND_SERVER_KEY, "--quality-check", "0"],
    )
    server.api_key = BLEND_SERVER_KEY
    with server:
        yield server


# -- Redis: a real server on loopback (tests/fixtures/redis_server.py) --


def _start_redis(workdir):
    from tests.fixtures.redis_server import RedisServer

    try:
        return RedisServer(workdir).start()
    except RuntimeError as e:  # no redis-server: fail, don't skip (CI installs it)
        problem = str(e)
    pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session."""
    server = _start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """URL of database 0 of the session's server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url()


@pytest.fixture
def private_redis_server(tmp_path):
    """A redis-server of this test alone, which it may kill and start again (same port)."""
    server = _start_redis(tmp_path / "redis")
    yield server
    server.stop()
