"""The live check (``BlendConfig.quality_check``) on the real engines and a real store: answers
checked against full prefill after they are given, "auto" stepping up where they disagree, every
engine on the store following, and checks that give way to users' requests."""

from __future__ import annotations

import threading
import time

import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.engines.quality_check import CheckPreempted
from blend_integrations.models.smollm2 import smollm2_dir
from tests.fixtures.local_models import sample_text


def test_at_the_fallback_the_ratio_rises_until_the_answers_hold_and_a_new_engine_starts_there(tmp_path):
    """SmolLM2-135M's real weights under a fingerprint no calibration knows: "auto" runs the
    fallback (0.15), where it loses answers. A check that always agreed would fail this test."""
    from benchmarks.quality import TASKS

    store = ChunkStore(tmp_path / "store", remote="")
    uncalibrated = {"model_fingerprint_override": "smollm2-uncalibrated", "device": "cpu"}
    config = BlendConfig(quality_check=1.0)
    engine = load_engine(str(smollm2_dir()), store=store, config=config, **uncalibrated)
    task = TASKS["smollm2"]
    examples = task.examples(24, 7_600, None)
    engine.warm(sorted({d for e in examples for d in e.documents}))
    served = []
    for e in examples:
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
        # a check in flight is aborted the moment a user's request comes, and says so
        raised: list[BaseException] = []

        def long_check() -> None:
            try:
                engine.full_prefill_tokens(prompt, 400)
            except BaseException as e:
                raised.append(e)

        thread = threading.Thread(target=long_check)
        thread.start()
        deadline = time.monotonic() + 60
        while not engine._checks and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine._checks, "the check never started"
        answer = engine.generate(prompt, max_tokens=4, mode="full")
        thread.join(60)
        assert len(raised) == 1 and isinstance(raised[0], CheckPreempted)
        assert answer.token_ids == engine.generate(prompt, max_tokens=4, mode="full").token_ids
        assert not engine._checks and engine.idle()
    finally:
        checker.share = share


@pytest.mark.parametrize("share", [-0.1, 1.5, "all", True, float("nan")])
def test_a_share_outside_0_to_1_is_refused_by_name(share):
    with pytest.raises(ValueError, match="quality_check must be a number in"):
        BlendConfig(quality_check=share)


def test_an_engine_dropped_without_close_is_freed_and_its_check_thread_ends(model_dirs, tmp_path):
    import gc
    import weakref

    from blend_integrations.engines import quality_check

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
