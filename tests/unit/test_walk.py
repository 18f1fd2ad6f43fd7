"""The walk on its own (fusion/walk.py): a small random model's own modules,
no engine, no store."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from blend_integrations.calibration import Guard, RankShares
from blend_integrations.config import SELECTIONS
from blend_integrations.cost import Shape, passes, token_layers
from blend_integrations.fusion import KVCache, ReusedSpan, ScratchCache, forward
from blend_integrations.fusion.attention import QUERY_GROUP, DenseAttention, query_groups, visible_keys
from blend_integrations.fusion.selection import QUERY_TAIL
from blend_integrations.models import HFDecoder
from blend_integrations.store import CodedKV
from blend_integrations.store.codec import encode_kv

CHUNK = slice(5, 25)  # the reused tokens of a 40-token prompt
SCHEDULE = [(1, 0.15)]  # blend: check at layer 1, recompute 15%


@pytest.fixture(scope="module")
def hf_model(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hf_model):
    return HFDecoder(hf_model)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(0))


def walk(model, ids, **options):
    with torch.inference_mode():
        return forward(model, KVCache.allocate(model, len(ids)), ids, **options)


def recorded(model, ids) -> torch.Tensor:
    """K before RoPE and V of every token of ``ids``, computed together."""
    record = torch.empty(model.num_layers, 2, model.num_kv_heads, len(ids), model.head_dim)
    walk(model, ids, record=record, logits=False)
    return record


def test_full_walk_equals_the_models_own_forward(hf_model, model, ids):
    logits, stats = walk(model, ids)
    with torch.inference_mode():
        own = hf_model(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(logits, own, atol=1e-4, rtol=1e-4)
    assert (stats.cached_tokens, stats.recomputed_tokens) == (0, 0)
    assert stats.token_layers == len(ids) * model.num_layers


@pytest.mark.parametrize(
    "schedule, selection", [(None, None), *((SCHEDULE, s) for s in SELECTIONS)], ids=["reuse", *SELECTIONS]
)
def test_reused_kv_computed_in_place_gives_full_prefills_logits(model, ids, schedule, selection):
    """KV that is exactly what full prefill computes leaves nothing to fix:
    reuse and blend, whichever tokens blend picks (the query's choice reads
    the reused KV its first pass left in the cache), give full prefill's logits."""
    full, _ = walk(model, ids)
    kv = recorded(model, ids)[:, :, :, CHUNK].clone()
    options = dict(selection=selection, query_start=QUERY) if selection else {}
    logits, stats = walk(model, ids, reused=[ReusedSpan(CHUNK.start, kv)], schedule=schedule, **options)
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    n = CHUNK.stop - CHUNK.start
    assert stats.cached_tokens == n
    assert stats.recomputed_tokens == (round(0.15 * n) if schedule else 0)


def test_standalone_kv_drifts_and_ratio_one_restores_full(model, ids):
    """A chunk computed alone (from position 0) and moved: reuse drifts from
    full prefill, blend at ratio 1 recomputes every token and equals it."""
    full, _ = walk(model, ids)
    alone = recorded(model, ids[CHUNK])  # the standalone recipe, without a BOS
    span = [ReusedSpan(CHUNK.start, alone)]
    reuse, _ = walk(model, ids, reused=span)
    every, stats = walk(model, ids, reused=span, schedule=[(1, 1.0)])
    assert (reuse - full).abs().max() > 1e-3  # the chunk missed its context: not full prefill
    torch.testing.assert_close(every, full, atol=1e-4, rtol=1e-4)
    assert stats.recomputed_tokens == stats.cached_tokens == CHUNK.stop - CHUNK.start


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_a_coded_span_reads_as_its_decoded_values(model, ids, codec):
    """A coded store's entry (``CodedKV``) is decoded by the walk one layer at
    a time where it computes: the walk reads what decoding it whole gives,
    after the span's sink tokens, exactly."""
    sink = 2
    stored = recorded(model, ids[CHUNK.start - sink : CHUNK.stop])  # the chunk with a 2-token sink ahead
    coded = CodedKV(encode_kv(stored, codec), codec, tuple(stored.shape), stored.dtype)
    decoded = coded.decode()
    span = ReusedSpan(CHUNK.start, coded, skip=sink)
    assert span.end == CHUNK.stop
    heads = ReusedSpan(CHUNK.start, coded, heads=slice(1, 2), skip=sink)
    assert torch.equal(heads.layer(1, torch.device("cpu")), decoded[1][:, 1:2, sink:])
    from_codes, _ = walk(model, ids, reused=[span], schedule=SCHEDULE)
    from_values, _ = walk(model, ids, reused=[ReusedSpan(CHUNK.start, decoded[:, :, :, sink:])], schedule=SCHEDULE)
    assert torch.equal(from_codes, from_values)


def test_reuse_computes_only_the_fresh_tokens(model, ids):
    kv = recorded(model, ids)[:, :, :, CHUNK].clone()
    _, reuse = walk(model, ids, reused=[ReusedSpan(CHUNK.start, kv)])
    _, blend = walk(model, ids, reused=[ReusedSpan(CHUNK.start, kv)], schedule=SCHEDULE)
    fresh = len(ids) - (CHUNK.stop - CHUNK.start)
    assert reuse.token_layers == fresh * model.num_layers
    # blend: every token up to the check layer, then the fresh and the recomputed ones
    assert blend.token_layers == len(ids) * 1 + (fresh + blend.recomputed_tokens) * (model.num_layers - 1)


class RowsFinished(HFDecoder):
    """The model, noting how many rows each layer's attention output and MLP ran on."""

    def __init__(self, hf_model) -> None:
        super().__init__(hf_model)
        self.rows: dict[int, int] = {}

    def finish(self, layer, hidden, attn):
        self.rows[layer] = hidden.shape[0]
        return super().finish(layer, hidden, attn)


def test_the_last_layer_runs_attention_and_mlp_only_for_the_logits(hf_model, ids):
    """Past its KV the last layer only gives the logits: it attends and runs
    its MLP for the last token alone, and not at all without logits; its KV
    is written for every token all the same."""
    model, last = RowsFinished(hf_model), hf_model.config.num_hidden_layers - 1
    caches = [KVCache.allocate(model, len(ids)) for _ in range(2)]
    with torch.inference_mode():
        forward(model, caches[0], ids)
        assert model.rows[last] == 1 and model.rows[last - 1] == len(ids)
        model.rows.clear()
        forward(model, caches[1], ids, logits=False)
        assert last not in model.rows and model.rows[last - 1] == len(ids)
    for layer in range(model.num_layers):
        torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], atol=0, rtol=0)
        torch.testing.assert_close(caches[1].v[layer], caches[0].v[layer], atol=0, rtol=0)


class QueriesCounted(HFDecoder):
    """The model, noting how many rows each layer's query projection ran on;
    ``fused``: it makes q with k and v whether asked for or not (as vLLM's
    fused projection does)."""

    def __init__(self, hf_model, fused: bool = False) -> None:
        super().__init__(hf_model)
        self.fused = fused
        self.q_rows: dict[int, int] = {}

    def qkv(self, layer, hidden, queries=True):
        q, k, v = super().qkv(layer, hidden, queries or self.fused)
        if q is not None:
            self.q_rows[layer] = self.q_rows.get(layer, 0) + q.shape[1]
        return q, k, v


def test_a_check_layer_makes_queries_only_for_the_tokens_it_keeps(hf_model, ids):
    """K and V of every token, queries of the kept ones only; an adapter that
    makes every query anyway gives the same logits and tokens."""
    span = [ReusedSpan(CHUNK.start, recorded(QueriesCounted(hf_model), ids[CHUNK]))]
    results = {}
    for fused in (False, True):
        model = QueriesCounted(hf_model, fused)
        results[fused] = walk(model, ids, reused=span, schedule=SCHEDULE)
        kept = len(ids) - (CHUNK.stop - CHUNK.start) + results[fused][1].recomputed_tokens
        assert model.q_rows[0] == len(ids)
        assert kept < len(ids) and model.q_rows[1] == (len(ids) if fused else kept)
        assert model.q_rows[2] == kept
    (split, split_stats), (fused, fused_stats) = results[False], results[True]
    torch.testing.assert_close(split, fused, atol=1e-5, rtol=1e-5)
    assert split_stats.kept == fused_stats.kept


def test_the_cache_must_hold_the_new_tokens(model, ids):
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        forward(model, KVCache.allocate(model, len(ids) - 1), ids)


QUERY = 30  # the new tokens from here on (but the last) are the query


@pytest.mark.parametrize("selection", SELECTIONS)
def test_ratio_one_equals_full_prefill_for_every_selection(model, ids, selection):
    full, _ = walk(model, ids)
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    every, stats = walk(model, ids, reused=span, schedule=[(1, 1.0)], selection=selection, query_start=QUERY)
    torch.testing.assert_close(every, full, atol=1e-4, rtol=1e-4)
    assert stats.recomputed_tokens == stats.cached_tokens == len(stats.kept) == CHUNK.stop - CHUNK.start


def test_query_selection_ranks_by_the_query_and_pays_for_a_reuse_pass(model, ids):
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    _, deviation = walk(model, ids, reused=span, schedule=SCHEDULE, query_start=QUERY)
    _, query = walk(model, ids, reused=span, schedule=SCHEDULE, selection="query", query_start=QUERY)
    _, mixed = walk(model, ids, reused=span, schedule=SCHEDULE, selection="mixed", query_start=QUERY)
    _, reuse = walk(model, ids, reused=span)
    n = round(0.15 * (CHUNK.stop - CHUNK.start))
    assert len(deviation.kept) == len(query.kept) == len(mixed.kept) == n
    assert all(CHUNK.start <= i < CHUNK.stop for i in query.kept + mixed.kept)
    assert query.kept != deviation.kept
    # the query's attention is summed over every layer in a reuse pass first, which leaves
    # the final KV of the tokens before the chunk (they read nothing blending changes)
    assert query.token_layers == deviation.token_layers + reuse.token_layers - CHUNK.start * model.num_layers
    assert mixed.token_layers == query.token_layers
    # the loading controller's cost model counts what the walk computes (0.15 of 20 reused is 3 tokens)
    shape = Shape.of(len(ids), [(CHUNK.start, CHUNK.stop)])
    cost = lambda query_pass: token_layers(shape, model.num_layers, SCHEDULE, query_pass)  # noqa: E731
    assert (cost(False), cost(True)) == (deviation.token_layers, query.token_layers)
    # and its passes: the query's reuse pass, then the blend walk
    assert (passes(SCHEDULE), passes(SCHEDULE, True)) == (deviation.passes, query.passes) == (1, 2)
    assert reuse.passes == passes(None) == 1
    # mixed: half by the query's attention, the rest by deviation
    assert set(mixed.kept) <= set(query.kept) | set(deviation.kept)


def test_a_query_aware_walk_computes_logits_once(model, ids, monkeypatch):
    """Its reuse pass only scores: the LM head runs in the blend walk alone
    (on Gemma 3 270M's 262,144-token vocabulary, a large share of a pass)."""
    heads = []
    monkeypatch.setattr(model, "logits", lambda hidden: heads.append(hidden.shape) or torch.zeros(1, 8))
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    walk(model, ids, reused=span, schedule=SCHEDULE, selection="query", query_start=QUERY)
    assert heads == [(1, model.config.hidden_size)]


@pytest.mark.parametrize("query_start", [None, 39])
def test_without_query_tokens_query_selection_ranks_by_deviation(model, ids, query_start):
    """No query (none given, or only the token whose logits are returned, which
    vLLM's blend pass never has): the choice falls back to deviation, at no extra cost."""
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    _, deviation = walk(model, ids, reused=span, schedule=SCHEDULE)
    _, query = walk(model, ids, reused=span, schedule=SCHEDULE, selection="query", query_start=query_start)
    assert (query.kept, query.token_layers, query.passes) == (deviation.kept, deviation.token_layers, 1)


def test_a_question_before_the_documents_still_has_a_query(model, ids):
    """The query is what follows the last chunk: with the question first, the
    template's tail."""
    first = slice(20, 36)  # the chunk: the question (tokens 0-19) stands before it
    span = [ReusedSpan(first.start, recorded(model, ids[first]))]
    full, _ = walk(model, ids)
    _, deviation = walk(model, ids, reused=span, schedule=SCHEDULE)
    _, query = walk(model, ids, reused=span, schedule=SCHEDULE, selection="query", query_start=first.stop)
    every, _ = walk(model, ids, reused=span, schedule=[(1, 1.0)], selection="query", query_start=first.stop)
    assert query.kept != deviation.kept
    torch.testing.assert_close(every, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3_text"])
def test_query_attention_is_what_the_models_own_attention_pays(model_dirs, arch):
    """The query's attention to each token, summed over heads and layers
    (what query selection ranks by), equals the attention weights of the
    model's own eager attention: sliding windows (Gemma 3, 32-token windows
    in this 40-token prompt), soft-capped scores and a query scalar (Gemma 2)."""
    own = AutoModelForCausalLM.from_pretrained(model_dirs(arch), dtype=torch.float32, attn_implementation="eager")
    decoder = HFDecoder(own.eval())
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(1))
    relevance = torch.zeros(len(ids))
    walk(decoder, ids, query_start=QUERY, relevance=relevance)
    with torch.inference_mode():
        weights = own(ids[None], output_attentions=True).attentions  # per layer [1, heads, T, T]
    # the query: tokens QUERY.. but the last (whose logits the walk returns)
    expected = sum(w[0, :, QUERY:-1].sum(dim=(0, 1)) for w in weights)
    torch.testing.assert_close(relevance, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("question_end", [None, 36])
def test_query_tail_keeps_what_the_last_query_tokens_read(model_dirs, question_end):
    """The "query-tail" selection ranks the reused tokens by the attention of the query's
    last QUERY_TAIL tokens (before the one whose logits are returned; with
    ``question_end``, the question's own last ones before a template's tail), each
    head's weight on a key times the norm of that key's value, summed over
    layers; "query" by the whole query's attention. The reused KV here is the
    prompt's own, so the reuse pass is full prefill and the model's eager
    attention gives the scores."""
    own = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32, attn_implementation="eager")
    decoder = HFDecoder(own.eval())
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(2))
    record = recorded(decoder, ids)
    span = [ReusedSpan(CHUNK.start, record[:, :, :, CHUNK])]
    with torch.inference_mode():
        weights = own(ids[None], output_attentions=True).attentions  # per layer [1, heads, T, T]
    group = weights[0].shape[1] // decoder.num_kv_heads  # query heads per KV head
    end = question_end if question_end is not None else len(ids) - 1
    tail = slice(end - QUERY_TAIL, end)
    by_tail = sum(
        (w[0, :, tail].sum(dim=1) * record[layer, 1].norm(dim=-1).repeat_interleave(group, dim=0)).sum(dim=0)
        for layer, w in enumerate(weights)
    )
    by_query = sum(w[0, :, QUERY:-1].sum(dim=(0, 1)) for w in weights)
    count = round(0.25 * (CHUNK.stop - CHUNK.start))
    kept = {}
    for selection in ("query", "query-tail"):
        _, stats = walk(
            decoder,
            ids,
            reused=span,
            schedule=[(0, 0.25)],
            selection=selection,
            query_start=QUERY,
            question_end=question_end,
        )
        kept[selection] = sorted(stats.kept)
    assert kept["query-tail"] == sorted((CHUNK.start + by_tail[CHUNK].topk(count).indices).tolist())
    assert kept["query"] == sorted((CHUNK.start + by_query[CHUNK].topk(count).indices).tolist())
    assert kept["query"] != kept["query-tail"]


def test_a_selection_by_the_query_reports_the_share_of_its_attention(model, ids):
    """What the guard reads at the first check layer is how much of the
    ranking's score the top tokens hold: for a selection by the query, the
    share of the query's attention (from the reuse pass) that the top ratio
    of the reused tokens hold; at check layer 0 no token deviates."""
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    relevance = torch.zeros(len(ids))
    walk(model, ids, reused=span, selection="query-tail", query_start=len(ids) - 1 - QUERY_TAIL, relevance=relevance)
    _, tail = walk(model, ids, reused=span, schedule=[(0, 0.25)], selection="query-tail", query_start=QUERY)
    expected = RankShares.of(relevance[CHUNK])
    assert tail.share.cumulative == pytest.approx(expected.cumulative)
    assert tail.captured == pytest.approx(expected(0.25)) and 0.25 < tail.captured < 1.0
    _, deviation = walk(model, ids, reused=span, schedule=[(1, 0.25)])
    assert deviation.captured != pytest.approx(tail.captured)


def test_at_check_layer_0_without_query_tokens_the_guard_reads_no_ranking_and_raises_the_ratio(model, ids):
    """A selection by the query with no query tokens ranks by deviation, which is zero at layer 0
    (a token's layer-0 K and V do not depend on its context): that tells nothing, so the guard reads
    the shares of an even ranking and raises the ratio, where a share of 1.0 never would."""
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    guard = Guard(0.15, 0.5, (0.15, 0.3, 0.5, 0.7))
    schedule_for = lambda r: [(0, r)]  # noqa: E731
    _, blind = walk(
        model, ids, reused=span, schedule=[(0, 0.15)], selection="query", guard=guard, schedule_for=schedule_for
    )
    assert blind.share.cumulative == pytest.approx(RankShares.even(CHUNK.stop - CHUNK.start).cumulative)
    assert blind.guarded and blind.ratio == 0.5 and blind.captured == pytest.approx(0.5)
    # with the query's tokens, its attention ranks them, and the guard reads that
    _, seeing = walk(
        model, ids, reused=span, schedule=[(0, 0.15)], selection="query", query_start=QUERY, guard=guard,
        schedule_for=schedule_for,
    )  # fmt: skip
    assert seeing.share.cumulative != pytest.approx(blind.share.cumulative)


def test_a_scratch_cache_is_reused_unless_held(model):
    caches = ScratchCache(model)
    with caches.lease(40) as first:
        ptr = first.k[0].data_ptr()
        assert first.capacity == 40 and first.length == 0
        with caches.lease(40) as meanwhile:  # the first is still held: a cache of its own
            assert meanwhile.k[0].data_ptr() != ptr
    with caches.lease(30) as smaller:  # the same rows again
        assert (smaller.k[0].data_ptr(), smaller.capacity) == (ptr, 30)
    with caches.lease(ScratchCache.STEP + 1) as larger:
        assert larger.k[0].data_ptr() != ptr and larger.capacity == ScratchCache.STEP + 1


def test_queries_far_apart_attend_in_separate_groups():
    """Reuse's active set on a CPU: a system prompt's 15 tokens and a question
    3,000 positions later attend in separate calls, so the early queries do
    not read the keys up to the question; a blend's scattered queries (a few
    positions apart) still fill whole groups. Either way each query attends
    exactly the keys up to its own position."""
    cpu = torch.device("cpu")
    reuse = torch.cat([torch.arange(15), torch.arange(3088, 3126)])
    assert query_groups(reuse, cpu, 4) == [(0, 15), (15, 15 + QUERY_GROUP), (15 + QUERY_GROUP, 53)]
    scattered = torch.arange(15, 3000, 6)
    assert {hi - lo for lo, hi in query_groups(scattered, cpu, 4)[:-1]} == {QUERY_GROUP}
    assert query_groups(reuse, torch.device("meta"), 4) == [(0, 53)]  # a GPU: one block, within its budget

    gen = torch.Generator().manual_seed(0)
    T, D = 3126, 16
    q = torch.randn(4, len(reuse), D, generator=gen)  # 4 query heads over 2 KV heads
    K, V = torch.randn(2, T, D, generator=gen), torch.randn(2, T, D, generator=gen)
    attention = DenseAttention(reuse, 0, T, windows=[None], scaling=D**-0.5, dtype=torch.float32)
    got = attention(0, q, K, V)
    scores = torch.einsum("hqd,hkd->hqk", q, K.repeat_interleave(2, dim=0)) * D**-0.5
    weights = scores.masked_fill(~visible_keys(reuse, T, None), float("-inf")).softmax(-1)
    torch.testing.assert_close(got, weights @ V.repeat_interleave(2, dim=0), atol=1e-5, rtol=1e-5)


def test_a_given_ranking_chooses_the_recomputed_tokens(model, ids):
    """``ranking`` (the oracle benchmark's token set) replaces the selection:
    the kept tokens are its top ``ratio`` of the reused ones, whatever the
    deviation says, and the walk otherwise costs what a deviation blend costs."""
    span = [ReusedSpan(CHUNK.start, recorded(model, ids[CHUNK]))]
    _, deviation = walk(model, ids, reused=span, schedule=[(1, 0.25)])
    ranking = torch.zeros(len(ids))
    ranking[CHUNK] = torch.arange(
        CHUNK.stop - CHUNK.start, 0, -1, dtype=torch.float32
    )  # the chunk's first tokens first
    _, given = walk(model, ids, reused=span, schedule=[(1, 0.25)], ranking=ranking)
    assert given.kept == tuple(range(CHUNK.start, CHUNK.start + 5))  # a quarter of 20
    assert given.kept != deviation.kept and given.token_layers == deviation.token_layers
