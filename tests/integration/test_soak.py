"""Soak: several engine processes share one disk store and one Redis database.

4 processes x 40 requests over a 50-document corpus, with tier limits small
enough that chunks are evicted from disk and Redis all the time while others
read them. Half the processes run the loading controller with pipelined
loading, half read whole entries; half have no memory tier, so every hit is
read from disk or Redis. At ratio 1.0 every blended answer must equal full
prefill's, and no store operation may fail.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

from tests.fixtures.local_models import sample_text

PROCESSES, REQUESTS, DOCUMENTS = 4, 40, 50
# a chunk of this corpus is about 160 KB on the test model: the disk tier holds
# about a dozen of the 50, Redis about twice that
DISK_LIMIT, REDIS_LIMIT = 2 * 2**20, 4 * 2**20


def _client(index: int, model_dir: str, store_dir: str, url: str, corpus: list[str], out) -> None:
    try:
        import random

        from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine

        rng = random.Random(index)
        controlled = index % 2 == 1
        config = BlendConfig(loading_controller=controlled, pipelined_loading=controlled)
        store = ChunkStore(
            store_dir,
            size_limit_bytes=DISK_LIMIT,
            memory_limit_bytes=0 if index >= 2 else 2**30,
            remote=url,
            remote_size_limit_bytes=REDIS_LIMIT,
        )
        engine = load_engine(model_dir, store=store, device="cpu", config=config)
        wrong, hits = [], 0
        for r in range(REQUESTS):
            documents = rng.sample(corpus, rng.randint(2, 5))
            prompt = BlendPrompt("Read the notes.", documents, f"Question {r}: what comes next? Answer:")
            blend = engine.generate(prompt, max_tokens=4, recompute_ratio=1.0)
            full = engine.generate(prompt, max_tokens=4, mode="full")
            if blend.token_ids != full.token_ids:
                wrong.append(r)
            hits += blend.usage.chunks_hit
        s = store.stats
        out.put((index, None, wrong, hits, s.memory_hits, s.disk_hits, s.remote_hits, s.corrupt, s.errors))
        store.close()
    except BaseException:
        out.put((index, traceback.format_exc(), [], 0, 0, 0, 0, 0, 0))


def test_four_processes_share_one_disk_store_and_redis(tmp_path, model_dirs, redis_url):
    corpus = [" ".join(sample_text(5, seed=1000 + i)) for i in range(DOCUMENTS)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(target=_client, args=(i, model_dirs("llama"), str(tmp_path / "store"), redis_url, corpus, out))
        for i in range(PROCESSES)
    ]
    for p in workers:
        p.start()
    results = sorted(out.get(timeout=1500) for _ in workers)
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    for index, failure, wrong, hits, memory_hits, disk_hits, remote_hits, corrupt, errors in results:
        assert failure is None, failure
        assert wrong == [], f"process {index}: requests {wrong} differ from full prefill"
        assert (corrupt, errors) == (0, 0), f"process {index}: {corrupt} corrupt entries, {errors} store errors"
        assert hits > 0
    # every tier served hits, and the processes without a memory tier read everything from disk or Redis
    assert sum(r[4] for r in results) > 0 and sum(r[5] for r in results) > 0 and sum(r[6] for r in results) > 0
    assert all(r[4] == 0 and r[5] + r[6] == r[3] for r in results if r[0] >= 2)
