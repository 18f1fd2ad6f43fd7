"""Tensor parallelism: the vLLM engine split over two ranks (vLLM's CPU backend,
one CPU each) blends as one rank does, and shares its chunk store with it; and
every model family on it (``test_family_on_vllm``).

The small random models come from transformers' own configs
(``tests/fixtures/local_models.py``)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import time

import pytest

from blend_integrations import BlendPrompt, ChunkStore, load_engine
from blend_integrations.engines.vllm_contract import check_tensor_parallel
from blend_integrations.engines.vllm_host import CPU_BINDING_ENV, cpu_thread_binding
from blend_integrations.models.hf import SUPPORTED_MODEL_TYPES
from tests.fixtures.exactness import chosen, exact_at_ratio_one

QUESTION = "Question: which city is named in the documents? Answer:"


def tp2_engine(model_dir, store_path, kv_cache_gib: int = 1):
    engine = load_engine(
        model_dir,
        backend="vllm",
        store=ChunkStore(store_path),
        max_model_len=2048,
        kv_cache_gib=kv_cache_gib,
        tensor_parallel_size=2,
        # vLLM's kernel: the session's one-rank engine attends with SDPA, so the
        # comparisons with it cover both ways.
        walk_attention="kernel",
        worker_extension_cls="blend_faults.FaultInjection",  # tests/blend_faults.py
    )
    assert CPU_BINDING_ENV not in os.environ  # the binding went to vLLM's processes only
    return engine


@pytest.fixture(scope="module")
def vllm_tp2(model_dirs, store):
    """The session's llama model (4 heads, 2 KV heads: one per rank) on two
    ranks, over the session store's directory."""
    engine = tp2_engine(model_dirs("llama"), store.path)
    yield engine
    engine.close()


def test_ratio_one_equals_full_prefill_and_one_rank(vllm_tp2, vllm_engine, docs):
    vllm_engine.warm(docs)  # stored by one rank: every KV head in one entry
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    full = vllm_tp2.generate(prompt, max_tokens=12, mode="full", logprobs=2)
    blend = vllm_tp2.generate(prompt, max_tokens=12, recompute_ratio=1.0, logprobs=2)
    one_rank = vllm_engine.generate(prompt, max_tokens=12, recompute_ratio=1.0, logprobs=2)
    assert (blend.usage.chunks_hit, blend.fallback) == (len(docs), None)
    assert blend.usage.cached_tokens == blend.usage.recomputed_tokens > 0
    assert blend.token_ids == full.token_ids == one_rank.token_ids
    assert chosen(blend) == pytest.approx(chosen(full), abs=1e-3)
    assert chosen(blend) == pytest.approx(chosen(one_rank), abs=1e-3)


def test_reordered_chunks_hit_and_are_shared_with_one_rank(vllm_tp2, vllm_engine, engine, docs):
    first = vllm_tp2.generate(BlendPrompt("Read.", docs, QUESTION), max_tokens=2)
    assert (first.usage.chunks_missed, first.fallback) == (len(docs), None)
    order = [docs[2], docs[0], docs[3], docs[1]]
    again = vllm_tp2.generate(BlendPrompt("Read.", order, QUESTION), max_tokens=2)
    chunk_tokens = sum(len(vllm_tp2.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert (again.usage.chunks_hit, again.usage.chunks_missed) == (len(docs), 0)
    assert again.usage.recomputed_tokens == round(0.15 * chunk_tokens)
    # the same keys and entries for one rank, on either engine
    prompt = BlendPrompt("Read.", order[::-1], QUESTION)
    for one_rank in (vllm_engine, engine):
        blend = one_rank.generate(prompt, max_tokens=8, recompute_ratio=1.0)
        assert blend.usage.chunks_hit == len(docs)
        assert blend.token_ids == one_rank.generate(prompt, max_tokens=8, mode="full").token_ids


@pytest.mark.timeout(600)  # ranks that disagreed would wait for each other forever
def test_a_chunk_one_rank_cannot_read_is_computed_on_every_rank(vllm_tp2, docs):
    vllm_tp2.warm(docs)
    lost = vllm_tp2.tokenizer.encode(docs[1], add_special_tokens=False)
    vllm_tp2.llm.collective_rpc("blend_lose_on_rank", args=(1, lost))
    try:
        prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
        blend = vllm_tp2.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    finally:
        vllm_tp2.llm.collective_rpc("blend_lose_on_rank", args=(1, None))
    # the fault fired: rank 1 alone read the chunk and found nothing
    lost_reads = vllm_tp2.llm.collective_rpc("blend_lost_reads")
    assert lost_reads[0] == 0 and lost_reads[1] >= 1, lost_reads
    # The scheduler had planned to load it and reported it so: both ranks computed it standalone instead.
    assert (blend.usage.chunks_hit, blend.fallback) == (len(docs), None)
    assert blend.token_ids == vllm_tp2.generate(prompt, max_tokens=10, mode="full").token_ids


@pytest.mark.timeout(600)  # ranks that disagreed would wait for each other forever
@pytest.mark.parametrize(
    "where, cause",
    [("lease", "OutOfMemoryError: injected fault: no memory"), ("read", "OSError: [Errno 5] injected fault")],
)
def test_a_pass_that_fails_on_one_rank_falls_back_on_every_rank(vllm_tp2, docs, where, cause):
    """Rank 1 alone fails before the walk's collectives: the ranks agree on
    it, so neither waits for the other; vLLM computes the prompt in full and
    the response says why, naming the rank."""
    vllm_tp2.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = vllm_tp2.generate(prompt, max_tokens=10, mode="full")
    vllm_tp2.llm.collective_rpc("blend_break_on_rank", args=(1, where))
    try:
        broken = vllm_tp2.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    finally:
        vllm_tp2.llm.collective_rpc("blend_break_on_rank", args=(1, None))
    assert broken.fallback is not None and broken.usage.cached_tokens == 0
    assert f"the blend pass failed: RanksFailed: tensor-parallel rank 1: {cause}" in broken.fallback
    assert broken.token_ids == full.token_ids
    again = vllm_tp2.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    assert (again.fallback, again.usage.chunks_hit) == (None, len(docs))
    assert again.token_ids == full.token_ids


@pytest.mark.timeout(600)  # ranks that disagreed would wait for each other forever
def test_a_pass_one_rank_has_no_memory_for_falls_back_on_every_rank(vllm_tp2, docs):
    """Rank 1 alone is short of memory for the blend pass (a limit of 1 byte
    on it): the ranks decide together before the walk, so neither enters
    its collectives alone; the request is computed in full with reason
    "blend_memory", naming the rank, and the engine goes on blending."""
    vllm_tp2.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = vllm_tp2.generate(prompt, max_tokens=10, mode="full")
    before = vllm_tp2.stats()
    vllm_tp2.llm.collective_rpc("blend_memory_limit", args=(1, 1))
    try:
        short = vllm_tp2.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    finally:
        vllm_tp2.llm.collective_rpc("blend_memory_limit", args=(None,))
    assert short.fallback.startswith("tensor-parallel rank 1: not enough memory for the blend pass")
    assert short.usage.cached_tokens == 0 and short.token_ids == full.token_ids
    after = vllm_tp2.stats()
    assert after.get("requests_full_blend_memory", 0) - before.get("requests_full_blend_memory", 0) == 1
    workers = [p for rank in vllm_tp2.llm.collective_rpc("blend_pending") for p in rank if p["side"] == "worker"]
    assert len(workers) == 2 and all(p["failed"] == p["invalid_blocks"] == 0 for p in workers)  # both reported
    again = vllm_tp2.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    assert (again.fallback, again.usage.chunks_hit) == (None, len(docs))
    assert again.token_ids == full.token_ids


@pytest.mark.timeout(600)
def test_saving_chunks_that_fails_on_one_rank_stops_both_ranks_together(vllm_tp2, docs):
    """Rank 1 alone cannot compute a missed chunk to save it: both ranks drop
    the save at the same point, the request that missed is answered right,
    and the next one misses the chunks again, computes them, and is right."""
    fresh = [f"{d} Kept in the archive {i}." for i, d in enumerate(docs)]
    prompt = BlendPrompt("Read.", fresh, QUESTION)
    full = vllm_tp2.generate(prompt, max_tokens=6, mode="full")
    vllm_tp2.llm.collective_rpc("blend_break_on_rank", args=(1, "save"))
    try:
        missed = vllm_tp2.generate(prompt, max_tokens=6, recompute_ratio=1.0)  # saved at its second step
    finally:
        vllm_tp2.llm.collective_rpc("blend_break_on_rank", args=(1, None))
    assert (missed.fallback, missed.usage.chunks_missed) == (None, len(fresh))
    assert missed.token_ids == full.token_ids
    again = vllm_tp2.generate(prompt, max_tokens=6, recompute_ratio=1.0)
    assert (again.fallback, again.usage.chunks_missed) == (None, len(fresh))  # nothing was saved
    assert again.token_ids == full.token_ids
    hit = vllm_tp2.generate(prompt, max_tokens=6, recompute_ratio=1.0)
    assert (hit.fallback, hit.usage.chunks_hit) == (None, len(fresh))
    assert hit.token_ids == full.token_ids


@pytest.mark.parametrize("selection", ["deviation", "query", "mixed"])
def test_two_ranks_choose_what_one_rank_chooses(vllm_tp2, vllm_engine, docs, selection):
    """Each rank scores its own heads; the scores summed over both ranks pick
    the tokens one rank picks from all heads, so the replies agree."""
    vllm_engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    two = vllm_tp2.generate(prompt, max_tokens=12, selection=selection, logprobs=2)
    one = vllm_engine.generate(prompt, max_tokens=12, selection=selection, logprobs=2)
    # the same tokens recomputed; the deviation they cover summed in another order (heads split over ranks)
    assert two.fallback is None and two.usage == dataclasses.replace(
        one.usage, ranking_captured=two.usage.ranking_captured
    )
    assert two.usage.ranking_captured == pytest.approx(one.usage.ranking_captured, rel=1e-5)
    assert two.recomputed_positions == one.recomputed_positions and two.reused_spans == one.reused_spans
    assert two.token_ids == one.token_ids
    assert chosen(two) == pytest.approx(chosen(one), abs=1e-3)


def test_two_ranks_attending_with_vllms_kernel_keep_what_sdpa_keeps(vllm_tp2, docs):
    """Each rank's walk attends its own heads in its own paged cache with the
    backend's kernel, and keeps what both keep attending with SDPA."""
    tp = vllm_tp2.tokenize(BlendPrompt("Read.", docs[::-1], QUESTION))
    spans = [list(span) for span in tp.chunk_spans]
    ranks = vllm_tp2.llm.collective_rpc("blend_walk_both_ways", args=(list(tp.token_ids), spans, 0.15, "deviation"))
    assert len(ranks) == 2
    for paged, dense, diff in ranks:
        assert paged and paged == dense == ranks[0][1]
        assert diff < 1e-3


@pytest.mark.parametrize("name", [t for t in SUPPORTED_MODEL_TYPES if t != "llama"])
def test_family_on_vllm(name, model_dirs, tmp_path, docs):
    """Every family but llama (which every other vLLM test runs, on one rank and on two) on the
    embedded vLLM engine split over two ranks, beside the transformers engine. One engine per
    family, on two ranks because that is where families differ most (about 80 s each): Mistral's
    one KV head (fewer than ranks: vLLM copies it to both, and a stored chunk holds it once, read
    and written by the transformers engine); OLMo 2's
    q/k norms span every head, so both ranks' statistics (through vLLM's Transformers backend);
    Gemma's windows shorter than the chunks, rope per layer type and soft-caps; Phi-3's fused
    qkv and gate_up split per rank, and its partial rotary; Granite's four multipliers; Qwen's
    biases and q/k norms per head. Chunks the transformers engine computed are hits on vLLM;
    blend at r=1 is vLLM's full prefill, which is the transformers engine's; reordered chunks
    hit and a blend recomputes its share; a live check's walk gives full prefill's answer; chunks
    the two ranks stored are hits on the transformers engine, with its own exact answer."""
    store = ChunkStore(tmp_path / "store")
    transformers = load_engine(model_dirs(name), store=store, device="cpu")
    transformers.warm(docs)
    # its own KV cache size, though this worker's session engine started with another
    engine = tp2_engine(model_dirs(name), store.path, kv_cache_gib=2)
    try:
        assert engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 2 * 2**30
        prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
        full = exact_at_ratio_one(engine, prompt, len(docs))
        reference = transformers.generate(prompt, max_tokens=10, mode="full", logprobs=1)
        assert reference.token_ids == full.token_ids
        assert chosen(reference) == pytest.approx(chosen(full), abs=1e-3)
        # a live check's full prefill, walked on both ranks with vLLM's logits, gives the same answer
        checked = engine.full_prefill_tokens(engine.tokenize(prompt), 10)
        assert checked[: len(reference.token_ids)] == reference.token_ids
        shuffled = BlendPrompt("Read.", [docs[2], docs[0], docs[3], docs[1]], QUESTION)
        blend = engine.generate(shuffled, max_tokens=4, recompute_ratio=0.15)
        chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
        assert (blend.usage.chunks_hit, blend.usage.chunks_missed, blend.fallback) == (len(docs), 0, None)
        assert blend.usage.recomputed_tokens == round(0.15 * chunk_tokens)
        more = [d + " The end." for d in docs]
        assert engine.warm(more) == len(more)
    finally:
        engine.close()
    back = BlendPrompt("Read.", more, QUESTION)
    again = transformers.generate(back, max_tokens=10, recompute_ratio=1.0)
    assert again.usage.chunks_hit == len(more)
    assert again.token_ids == transformers.generate(back, max_tokens=10, mode="full").token_ids


def test_cpu_binding_and_head_checks(monkeypatch):
    monkeypatch.delenv(CPU_BINDING_ENV, raising=False)
    assert cpu_thread_binding(1) is None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # these machines have one NUMA node: vLLM's own binding would refuse to start
        half = len(cpus) // 2
        assert cpu_thread_binding(2) == "|".join(",".join(map(str, c)) for c in (cpus[:half], cpus[half : 2 * half]))
    with pytest.raises(ValueError, match=f"needs a CPU per rank, and this process may use {len(cpus)}"):
        cpu_thread_binding(len(cpus) + 1)
    monkeypatch.setenv(CPU_BINDING_ENV, "0-1|2-3")  # the user's own binding is kept
    assert cpu_thread_binding(2) is None

    class Config:
        num_attention_heads, num_key_value_heads = 4, 2

    check_tensor_parallel(Config, 4)  # each KV head copied to two ranks
    with pytest.raises(ValueError, match="cannot split the model's 4 attention heads and 2 KV heads"):
        check_tensor_parallel(Config, 3)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            check_tensor_parallel(Config, bad)


def test_engine_and_server_refuse_an_impossible_split(model_dirs, tmp_path, capsys):
    from blend_integrations import serve

    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split the model's 4 attention heads"):
        load_engine(model_dirs("llama"), backend="vllm", store=ChunkStore(tmp_path), tensor_parallel_size=3)
    with pytest.raises(SystemExit):
        serve.main([model_dirs("llama"), "--store", str(tmp_path), "-tp", "3", "--print"])
    assert "tensor_parallel_size=3 cannot split" in capsys.readouterr().err
    # more CPU ranks than CPUs this process may use (these machines have one NUMA node)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        with pytest.raises(SystemExit):
            serve.main([model_dirs("llama"), "--store", str(tmp_path), "-tp", "2", "--print"])
    finally:
        os.sched_setaffinity(0, allowed)
    assert "needs a CPU per rank, and this process may use 1" in capsys.readouterr().err


def test_server_command_splits_the_model_and_binds_cpu_ranks(model_dirs, tmp_path, monkeypatch, capsys):
    from blend_integrations import serve

    monkeypatch.delenv(CPU_BINDING_ENV, raising=False)
    serve.main([model_dirs("llama"), "--store", str(tmp_path), "--tensor-parallel-size", "2", "--print"])
    words = shlex.split(capsys.readouterr().out)
    cmd = words[words.index("-m") - 1 :]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert f"{CPU_BINDING_ENV}={cpu_thread_binding(2)}" in words[: words.index("-m") - 1]


def test_rank_reports_are_merged_by_vllm_as_the_slowest_rank():
    """What each rank measured (loading controller rates) and which blend
    passes failed reach the scheduler through vLLM's own output aggregator."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from blend_integrations.engines.vllm_connector import BlendWorkerMetadata

    reports = [
        BlendWorkerMetadata({"disk": 2e9, "remote": None, "compute": 5e5}, {"a": "rank 0 could not read it"}),
        BlendWorkerMetadata({"disk": 1e9, "remote": 1e8, "compute": 7e5}, {"b": "rank 1 ran out of memory"}),
    ]
    outputs = [
        ModelRunnerOutput(
            req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=r)
        )
        for r in reports
    ]
    merged = (
        KVOutputAggregator(expected_finished_count=2).aggregate(outputs).kv_connector_output.kv_connector_worker_meta
    )
    assert merged.rates == {"disk": 1e9, "remote": None, "compute": 5e5}  # unmeasured on one rank: unknown
    assert merged.failed == {"a": "rank 0 could not read it", "b": "rank 1 ran out of memory"}


def test_a_server_on_two_ranks(model_dirs, store, vllm_engine, docs):
    from tests.fixtures.blend_server import BlendServer

    vllm_engine.warm(docs)  # stored by one rank
    args = ["--max-model-len", "2048", "--kv-cache-gib", "1", "--tensor-parallel-size", "2"]
    log = store.path.parent / "server-tp2.log"
    with BlendServer(model_dirs("llama"), store=store.path, log=log, args=args) as server:
        client = load_engine(server.url, backend="server")
        prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
        served = client.generate(prompt, max_tokens=10, recompute_ratio=1.0)
        assert (served.usage.chunks_hit, served.usage.recomputed_tokens > 0, served.fallback) == (len(docs), True, None)
        assert served.token_ids == vllm_engine.generate(prompt, max_tokens=10, mode="full").token_ids
        # counted once, not once per rank: on /metrics, and in the stream's usage
        stream = client.stream(prompt, max_tokens=2, recompute_ratio=1.0)
        "".join(stream)
        assert stream.generation.usage.cached_tokens == served.usage.cached_tokens
        expected = {
            ("vllm:blend_requests_total", (("outcome", "blend"), ("reason", ""))): 2,
            ("vllm:blend_chunks_hit_total", ()): 2 * len(docs),
            ("vllm:blend_cached_tokens_total", ()): 2 * served.usage.cached_tokens,
            "store hits": 2 * len(docs),  # the reads of rank 0; rank 1 reads the same entries
        }
        deadline = time.monotonic() + 30  # the API server records a step's stats after its outputs
        while True:
            series = server.blend_series()
            counted = {key: series.get(key, 0.0) for key in expected if isinstance(key, tuple)}
            counted["store hits"] = sum(v for (n, _), v in series.items() if n == "vllm:blend_store_hits_total")
            if counted == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert counted == expected
    assert "local_rank=1" in log.read_text()  # vLLM started two CPU ranks
