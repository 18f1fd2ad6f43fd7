"""The live check (``BlendConfig.quality_check``) on the real engines and a real store: answers
checked against full prefill after they are given, "auto" stepping up where they disagree, every
engine on the store following, and checks that give way to users' requests."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.engines import quality_check
from blend_integrations.engines.quality_check import CheckPreempted
from blend_integrations.models.smollm2 import smollm2_dir
from tests.fixtures.blend_server import checks_ended
from tests.fixtures.local_models import sample_text


def test_at_the_fallback_the_ratio_rises_until_the_answers_hold_and_a_new_engine_starts_there(tmp_path):
    """SmolLM2-135M's real weights under a fingerprint no calibration knows: "auto" runs the
    fallback (0.15), where it loses answers. A check that always agreed would fail this test."""
    from benchmarks.quality import TASKS

    store = ChunkStore(tmp_path / "store", remote="")
    uncalibrated = {"model_fingerprint_override": "smollm2-uncalibrated", "device": "cpu"}
    config = BlendConfig(quality_check=1.0, quality_check_risk=1.0)  # each check at once: the climb is the point
    engine = load_engine(str(smollm2_dir()), store=store, config=config, **uncalibrated)
    task = TASKS["smollm2"]
    examples = task.examples(24, 7_600, None)
    served = []
    for e in examples:
        engine.warm(e.documents)  # each prompt's chunks only as it comes: the ratio rises within about ten
        gen = engine.generate(task.prompt(e, engine.tokenizer, engine.config.separator), max_tokens=4)
        assert engine.quality_checker.wait(120)
        served.append((gen.usage.recompute_ratio, gen.usage.ratio_source, gen.usage.quality_checked))
        if gen.usage.ratio_source == "checked":
            break
    stats = engine.quality_check_stats()
    assert served[0] == (0.15, "fallback", True), served
    assert served[-1][1:] == ("checked", True) and served[-1][0] > 0.15, (served, stats)
    # every check ran and was counted; the misses that moved it are in the state, with its reason
    assert stats["checked"] == len(served) and stats["failed"] == stats["dropped"] == 0
    state = stats["state"]
    assert state["ratio"] > 0.15 and "disagreed with full prefill" in state["why"]
    assert state["rungs"]["0.15"]["checked"] - state["rungs"]["0.15"]["agreed"] == 4
    engine.close()
    # a new engine on the same store starts at the raised ratio
    again = load_engine(str(smollm2_dir()), store=store, config=BlendConfig(quality_check=0.0), **uncalibrated)
    choice = again.calibrations.choice()
    assert (choice.ratio, choice.source) == (state["ratio"], "checked")
    gen = again.generate(task.prompt(examples[0], again.tokenizer, again.config.separator), max_tokens=4)
    assert (gen.usage.recompute_ratio, gen.usage.ratio_source, gen.usage.quality_checked) == (
        state["ratio"],
        "checked",
        False,
    )
    store.close()


def test_on_vllm_a_check_runs_after_the_answer_and_gives_way_to_a_users_request(vllm_engine):
    engine = vllm_engine
    docs = [" ".join(sample_text(5, seed=88_100 + i)) for i in range(3)]
    prompt = engine.tokenize(BlendPrompt("Documents:", docs, "Question: which city is named? Answer:"))
    engine.warm(docs)
    checker = engine.quality_checker
    share = checker.share
    checker.share = 1.0
    try:
        before = dict(checker.counts)
        gen = engine.generate(prompt, max_tokens=4)
        assert gen.usage.quality_checked and gen.usage.ratio_source in ("fallback", "checked")
        assert checker.wait(120)
        assert checker.counts["checked"] == before.get("checked", 0) + 1
        # not checked: sampled, reuse, an explicit ratio, full prefill
        for options in ({"temperature": 0.8, "seed": 1}, {"mode": "reuse"}, {"recompute_ratio": 0.3}, {"mode": "full"}):
            assert not engine.generate(prompt, max_tokens=4, **options).usage.quality_checked, options
        assert checker.counts["picked"] == before.get("picked", 0) + 1
        # a check walks on the workers a slice at a time: a user's request that comes stops it at
        # the next slice, and says so
        user_comes_during_a_check(engine, prompt, started=lambda: engine.checking)
        assert not engine.checking
        # what it computes is full prefill's answer, as vLLM's own prefill and decoding give it
        for seed in range(3):
            docs = [" ".join(sample_text(3 + i, seed=88_150 + 10 * seed + i)) for i in range(3)]
            other = engine.tokenize(BlendPrompt("Documents:", docs, "Question: which city is named? Answer:"))
            assert engine.full_prefill_tokens(other, 8) == engine.generate(other, max_tokens=8, mode="full").token_ids
    finally:
        checker.share = share


def user_comes_during_a_check(engine, prompt, started) -> None:
    """A long check (400 tokens) in a thread; once ``started()`` says it runs, a user's request comes:
    the check gives way (``CheckPreempted``) and the user's answer is full prefill's."""
    raised: list[BaseException] = []

    def long_check() -> None:
        try:
            engine.full_prefill_tokens(prompt, 400)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=long_check)
    thread.start()
    deadline = time.monotonic() + 60
    while not started() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert thread.is_alive(), "the check ended before a user came"
    answer = engine.generate(prompt, max_tokens=4, mode="full")
    thread.join(60)
    assert len(raised) == 1 and isinstance(raised[0], CheckPreempted)
    assert answer.token_ids == engine.generate(prompt, max_tokens=4, mode="full").token_ids
    assert engine.idle()


def test_on_the_transformers_engine_a_check_gives_way_to_a_user_at_the_next_layer(engine):
    """A check holds the engine's lock while it runs; a user's request that comes meanwhile makes it
    stop before its next layer (``CheckPreempted``: it runs again later), so the user waits for one
    layer, not a prefill and its tokens."""
    docs = [" ".join(sample_text(5, seed=88_200 + i)) for i in range(3)]
    prompt = engine.tokenize(BlendPrompt("Documents:", docs, "Question: which city is named? Answer:"))

    def holds_the_engine() -> bool:
        if not engine._lock.acquire(blocking=False):
            return True
        engine._lock.release()
        return False

    user_comes_during_a_check(engine, prompt, started=holds_the_engine)
    # with no user in flight a check runs to its end
    assert len(engine.full_prefill_tokens(prompt, 4)) == 4


def test_a_check_waits_for_a_lull_in_the_users_arrivals(model_dirs, tmp_path):
    """At the default ``quality_check_risk`` (5%) a check starts only where a user is unlikely to come
    before it ends: while users come at a gap shorter than twenty checks' length, the checks picked
    wait (the engine is idle between them all the same); once the users stop, they run. A checker that
    started whenever the engine is idle would fail this test."""
    store = ChunkStore(tmp_path / "store", remote="")
    engine = load_engine(model_dirs("llama"), store=store, device="cpu", config=BlendConfig(quality_check=1.0))
    docs = [" ".join(sample_text(4, seed=88_250 + i)) for i in range(3)]
    engine.warm(docs)
    prompt = engine.tokenize(BlendPrompt("Documents:", docs, "Question: which city? Answer:"))
    checker = engine.quality_checker
    assert checker.risk == 0.05
    assert engine.generate(prompt, max_tokens=3).usage.quality_checked
    assert checker.wait(60) and checker.counts["checked"] == 1  # no check's length known yet: it ran when idle

    def users(n: int) -> None:
        for _ in range(n):
            engine.generate(prompt, max_tokens=3)  # picked, or dropped where the queue is full
            time.sleep(0.02)  # the engine idles between users

    users(15)  # the arrival rate is learnt
    before = dict(checker.counts)
    users(30)
    stats = checker.stats()
    assert stats["mean_gap_s"] < 19 * stats["check_s"], stats  # a check now would meet a user more than 1 time in 20
    assert checker.counts["checked"] == before["checked"], stats  # none started while the users came
    assert checker.counts["dropped"] > before.get("dropped", 0)  # the queue (8) filled meanwhile
    waiting = stats["waiting"]  # the queue's, and the one its thread holds for a lull
    assert waiting >= quality_check.QUEUE
    assert checker.wait(120)  # the users stopped: the quiet spell grows, and the checks run
    assert checker.stats()["waiting"] == 0
    assert checker.counts["checked"] == before["checked"] + waiting and checker.counts["failed"] == 0
    engine.close()
    store.close()


@pytest.mark.parametrize("share", [-0.1, 1.5, "all", True, float("nan")])
def test_a_share_outside_0_to_1_is_refused_by_name(share):
    with pytest.raises(ValueError, match="quality_check must be a number in"):
        BlendConfig(quality_check=share)


def test_an_engine_dropped_without_close_is_freed_and_its_check_thread_ends(model_dirs, tmp_path):
    import gc
    import weakref

    store = ChunkStore(tmp_path / "store", remote="")
    engine = load_engine(model_dirs("llama"), store=store, device="cpu", config=BlendConfig(quality_check=1.0))
    docs = [" ".join(sample_text(4, seed=88_200 + i)) for i in range(3)]
    engine.warm(docs)
    gen = engine.generate(BlendPrompt("Documents:", docs, "Question: which city? Answer:"), max_tokens=3)
    assert gen.usage.quality_checked and engine.quality_checker.wait(60)
    thread = engine.quality_checker._thread
    assert thread is not None and thread.is_alive()
    dropped = weakref.ref(engine)
    del engine, gen
    gc.collect()
    assert dropped() is None
    thread.join(quality_check.WAKE_S + 5)
    assert not thread.is_alive()
    store.close()


def test_both_integrations_pass_the_share_through_and_report_each_check(model_dirs, tmp_path):
    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage

    from blend_integrations.chat import separated
    from blend_integrations.langchain import ChatBlend, chunk_block
    from blend_integrations.llama_index import BlendLLM

    docs = [" ".join(sample_text(4, seed=88_300 + i)) for i in range(3)]
    options = {
        "model": model_dirs("llama"),
        "store_path": str(tmp_path / "store"),
        "config": BlendConfig(quality_check=1.0),
        "model_kwargs": {"device": "cpu"},
        "max_tokens": 3,
    }
    chat = ChatBlend(**options)
    message = [HumanMessage(content=[chunk_block(d) for d in docs] + [{"type": "text", "text": "Which city?"}])]
    first, second = chat.invoke(message), chat.invoke(message)
    assert not first.response_metadata["quality_checked"]  # every chunk missed: nothing blended to check
    assert second.response_metadata["quality_checked"] and second.response_metadata["ratio_source"] == "fallback"
    assert chat.engine.quality_checker.wait(60) and chat.engine.quality_check_stats()["checked"] == 1
    llm = BlendLLM(**options)
    text = "Documents:" + separated(docs) + "Which city?"
    llm.chat([ChatMessage(role="user", content=text)])
    answer = llm.chat([ChatMessage(role="user", content=text)])
    assert answer.additional_kwargs["blend"]["quality_checked"]
    assert llm.engine.quality_checker.wait(60)
    chat.engine.close()
    llm.engine.close()


def settled(server, before: float, timeout: float = 120) -> dict:
    """The server's live checks once they ended one more check than ``before``."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.live_checks()
        if checks_ended(now) > before or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def post(server, key: str, path: str, body: dict) -> tuple[str, dict | None]:
    """A request's answer text and ``kv_transfer_params``."""
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps({"max_tokens": 4, "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.load(r)
    choice = answer["choices"][0]
    return choice.get("text") or choice["message"]["content"], answer.get("kv_transfer_params")


def assert_checked_as_full_prefill_says(server, key: str, path: str, body: dict) -> None:
    """Blended under "auto" (once to store its chunks, then from them), the answer is checked, and
    the check's verdict is the one vLLM's own full prefill of the same request gives."""
    from blend_integrations.http_checks import blended_by_auto

    blend = {"kv_transfer_params": {"blend": {"mode": "blend", "separator": "\n\n"}}}
    post(server, key, path, body | blend)  # its chunks are new: not blended from the store, not checked
    deadline = time.monotonic() + 120
    while server.live_checks()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.2)  # no check of an earlier answer is left to count
    before = server.live_checks()
    text, params = post(server, key, path, body | blend)
    assert blended_by_auto(params), params
    now = settled(server, checks_ended(before))
    assert checks_ended(now) == checks_ended(before) + 1 and now.get("failed", 0) == before.get("failed", 0), now
    full, _ = post(server, key, path, body)
    assert now.get("agreed", 0) - before.get("agreed", 0) == text.startswith(full), (path, text, full, now)


def test_the_server_checks_its_answers_raises_auto_and_says_so_on_metrics(tmp_path):
    """A blend server with ``--quality-check 1`` on SmolLM2-135M's real weights under a fingerprint no
    calibration knows (the fallback, 0.15, where it loses answers): each greedy "auto" answer is
    checked after it was sent (walked on the workers: its verdict is the one vLLM's own full prefill
    gives, for token ids, text and chat messages); "auto" rises for the next requests, ``/metrics``
    counts the checks and gives the ratio and its source, the store holds the state, and a user's
    request arriving during a check stops the check, which runs again later."""
    from benchmarks.live_check import uncalibrated_copy
    from benchmarks.quality import TASKS
    from blend_integrations.calibration import Calibrations
    from blend_integrations.serve import CALIBRATION_PATH
    from blend_integrations.store import model_fingerprint
    from tests.fixtures.blend_server import BlendServer

    model = uncalibrated_copy(smollm2_dir())
    key = "live-check-key"
    # checks start whenever the server is idle (risk 1), so that a user's request can meet one in flight
    args = ["--max-model-len", "2048", "--kv-cache-gib", "1", "--quality-check", "1", "--quality-check-risk", "1"]
    args += ["--api-key", key]
    with BlendServer(model, store=tmp_path / "store", log=tmp_path / "server.log", args=args) as server:
        engine = load_engine(server.url, backend="server", api_key=key)
        task = TASKS["smollm2"]
        examples = task.examples(24, 7_600, None)
        served, ended, agreed = [], 0.0, 0.0
        for e in examples:
            engine.warm(e.documents, progress=False)
            prompt = task.prompt(e, engine.tokenizer, engine.config.separator)
            gen = engine.generate(prompt, max_tokens=4)
            served.append((gen.usage.recompute_ratio, gen.usage.ratio_source))
            if gen.usage.ratio_source == "checked":
                break
            now = settled(server, ended)
            assert checks_ended(now) == ended + 1, now
            assert len(served) > 1 or now["ratio"] == {"fallback": 0.15}  # the series come with the first request
            # the check's verdict is the one vLLM's own full prefill gives (asked once the check ended)
            full = engine.generate(prompt, max_tokens=4, mode="full")
            assert now.get("agreed", 0) - agreed == gen.text.startswith(full.text), (gen.text, full.text, now)
            ended, agreed = checks_ended(now), now.get("agreed", 0)
        now = settled(server, ended)  # the last answer's check too
        assert served[0] == (0.15, "fallback") and served[-1][1] == "checked" and served[-1][0] > 0.15, served
        assert now["disagreed"] == 4 and now.get("failed", 0) == 0 and now["seconds"] > 0, now
        assert now["ratio"] == {"checked": served[-1][0]}
        # the state is the store's: what the connector of any server on it reads with the calibration
        with urllib.request.urlopen(
            urllib.request.Request(server.url + CALIBRATION_PATH, headers={"Authorization": f"Bearer {key}"})
        ) as r:
            dtype = json.loads(r.read())["dtype"]
        store = ChunkStore(tmp_path / "store", remote="")
        choice = Calibrations(store, model_fingerprint(model), dtype, engine="vllm", num_layers=30).choice()
        assert (choice.ratio, choice.source) == (served[-1][0], "checked")
        store.close()
        # a prompt sent as text, or as chat messages: the check prefills the token ids vLLM rendered for it
        docs = [" ".join(sample_text(2, seed=88_300 + i)) for i in range(3)]
        # (the default separator, which SmolLM2's tokenizer splits in two before a word)
        text = "\n\n".join(["Documents:", *docs, "Question: which city is named? Answer:"])
        for path, body in (
            ("/v1/completions", {"prompt": text}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ):
            assert_checked_as_full_prefill_says(server, key, path, body)
        # a user's request that comes while a check runs (a long prompt's) stops it; it runs again later
        docs = [" ".join(sample_text(25, seed=88_400 + i)) for i in range(4)]
        long = engine.tokenize(BlendPrompt("Documents:", docs, "Question: which city is named? Answer:"))
        engine.warm(docs)
        for _ in range(5):
            before = server.live_checks()
            engine.generate(long, max_tokens=4)
            time.sleep(0.3)  # the check's full prefill of some 1,500 tokens has started
            engine.generate("Hello", max_tokens=1)  # a plain prompt: a user all the same
            if settled(server, checks_ended(before)).get("preempted", 0):
                break
        after = server.live_checks()
        assert after.get("preempted", 0) >= 1 and after.get("failed", 0) == 0, after
        assert server.healthy()
