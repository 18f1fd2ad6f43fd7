"""``blend_integrations.tune``: LoRA self-distillation of a small random model
on generated text, its output in both engines, and its errors."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from blend_integrations import BlendPrompt, ChunkStore, load_engine
from blend_integrations.engines.vllm_host import tcmalloc_library
from blend_integrations.prompt import bos_id_added
from blend_integrations.store import model_fingerprint
from blend_integrations.tune import DocumentsError, TuneError, TuneOptions, tune
from blend_integrations.tune.readings import batch, block_reading, full_reading
from tests.fixtures.commands import run_python
from tests.fixtures.local_models import sample_text

QUESTION = "Question: which city is named in the documents? Answer:"
# small and quick: a few steps at a high rate, so the KL moves on a random model
QUICK = dict(
    steps=8,
    prompts=24,
    held_out=4,
    eval_every=4,
    checkpoint_every=4,
    chunk_tokens=48,
    chunks_per_prompt=3,
    seq_len=512,
    learning_rate=2e-3,
    batch_size=2,
)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune-docs")
    for i in range(6):
        paragraphs = [" ".join(sample_text(6, seed=1000 + 10 * i + j)) for j in range(5)]
        (folder / f"doc{i}.txt").write_text("\n\n".join(paragraphs))
    return folder


@pytest.fixture(scope="module")
def tuned(model_dirs, documents, tmp_path_factory):
    """The session's llama model tuned by the command line."""
    out = tmp_path_factory.mktemp("tuned") / "model"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in QUICK.items()]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = run_python(
        "-m", "blend_integrations.tune", model_dirs("llama"), "--documents", str(documents), "--out", str(out),
        "--no-progress", *args, timeout=900, env=env,
    )  # fmt: skip
    return out, done.stdout


def test_the_block_reading_is_the_engines_reuse(engine, docs):
    """Untuned, the student's block reading gives the logits of the engines'
    reuse (every chunk from the store), and its full reading full prefill's."""
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    tp = engine.tokenize(prompt)
    bos = bos_id_added(engine.tokenizer)
    for mode, reading in (("reuse", block_reading(tp, [], bos)), ("full", full_reading(tp, []))):
        expected = engine.generate(prompt, max_tokens=1, mode=mode, logprobs=5).logprobs[0]
        with torch.no_grad():
            logits = engine.hf_model(**batch([reading], engine.hf_model.device, torch.float32), use_cache=False).logits
        got = torch.log_softmax(logits[0, len(reading.ids) - 1].float(), dim=-1)
        assert max(abs(got[t].item() - lp) for t, lp in expected.items()) < 1e-4, mode


def test_a_steps_gradient_taken_a_reading_at_a_time_is_the_batchs(engine, docs, model_dirs):
    """``backward_batch`` runs one reading of one prompt at a time (one reading's activations in
    memory): its gradient is that of the batch's loss taken at once, the block reading's mean KL over
    every reply row plus the full reading's, weighted, with replies of different lengths."""
    from transformers import AutoModelForCausalLM

    from blend_integrations.tune.distill import backward_batch
    from blend_integrations.tune.readings import kl, reply_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32)
    bos = bos_id_added(engine.tokenizer)
    prompts = [engine.tokenize(BlendPrompt("Read.", docs[i : i + 2], QUESTION)) for i in (0, 2)]
    replies = [[5, 9, 11], [7]]
    with torch.no_grad():  # any log-probabilities serve as the teacher's: the model's own, shifted
        targets = [
            reply_logprobs(model, [full_reading(tp, r)], torch.float32).roll(1, -1) for tp, r in zip(prompts, replies)
        ]
    taught = list(zip(prompts, replies, targets))
    loss = backward_batch(model, taught, bos, torch.float32, full_weight=0.5)
    one_at_a_time = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    target = torch.cat(targets)
    block = kl(
        target, reply_logprobs(model, [block_reading(tp, r, bos) for tp, r in zip(prompts, replies)], torch.float32)
    )
    full = kl(target, reply_logprobs(model, [full_reading(tp, r) for tp, r in zip(prompts, replies)], torch.float32))
    (block + 0.5 * full).backward()
    assert loss == pytest.approx((block + 0.5 * full).item(), rel=1e-5) and loss > 0
    for got, want in zip(one_at_a_time, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_tuning_lowers_the_block_readings_kl_on_held_out_text(tuned, model_dirs):
    out, printed = tuned
    record = json.loads((out / "tuning.json").read_text())
    kls = record["held_out_kl"]
    assert [k["step"] for k in kls] == [0, 4, 8]
    before, after = kls[0]["block"], kls[-1]["block"]
    assert after < before, kls
    assert kls[0]["full"] < 1e-4  # untuned, the full reading is the teacher
    assert f"{before:.4f} -> {after:.4f}" in printed
    assert record["base_fingerprint"] == model_fingerprint(model_dirs("llama"))
    assert not out.with_name(out.name + ".partial").exists()
    assert (out / "adapter" / "adapter_config.json").is_file()  # the adapter alone, beside the merged weights
    # what the run cost: each step's time, and its one process's malloc and peak memory; the command
    # ran on tcmalloc where it is installed (a long run's memory grows on glibc's malloc)
    assert 0 < record["step_seconds_median"] <= record["step_seconds_max"] < record["seconds"]
    [process] = record["processes"]
    assert process["from_step"] == 0 and process["peak_memory_gb"] > 0.1
    assert process["malloc"] == ("tcmalloc" if tcmalloc_library() is not None else "system")


def test_the_squad_recipe_tunes_on_squad_trains_questions(model_dirs, documents, tmp_path):
    llama = model_dirs("llama")
    options = TuneOptions(**{**QUICK, "steps": 1, "prompts": 2, "held_out": 1, "eval_every": 1, "seq_len": 4096})
    options = dataclasses.replace(options, recipe="squad", chunks_per_prompt=2)
    with pytest.raises(TuneError, match="squad recipe asks SQuAD train's own questions .* leave out --documents"):
        tune(llama, [documents], tmp_path / "refused", options=options)
    result = tune(llama, [], tmp_path / "out", options=options, progress=False)
    assert result.steps == 1 and len(result.step_seconds) == 1
    record = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert record["options"]["recipe"] == "squad" and record["train_prompts"] == 2


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_the_tuned_model_runs_on_both_engines_exactly_at_ratio_one(tuned, model_dirs, docs, tmp_path, backend):
    out, _ = tuned
    assert model_fingerprint(out) != model_fingerprint(model_dirs("llama"))  # its own chunks and calibrations
    options = {"max_model_len": 2048, "kv_cache_gib": 1} if backend == "vllm" else {"device": "cpu"}
    with load_engine(str(out), backend=backend, store=ChunkStore(tmp_path), **options) as engine:
        assert engine.warm(docs) == len(docs)
        prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
        full = engine.generate(prompt, max_tokens=8, mode="full")
        blend = engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
        assert (blend.usage.chunks_hit, blend.fallback) == (len(docs), None)
        assert blend.token_ids == full.token_ids


def test_bad_input_is_refused_and_leaves_nothing(model_dirs, documents, tmp_path):
    llama = model_dirs("llama")
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DocumentsError, match="no documents: found no text in"):
        tune(llama, [empty], out, options=TuneOptions(**QUICK))
    with pytest.raises(DocumentsError, match="no documents: pass at least one"):
        tune(llama, [], out, options=TuneOptions(**QUICK))
    short = tmp_path / "short.txt"
    short.write_text("Too short to read.\n\nAnd this.")
    with pytest.raises(DocumentsError, match="documents too short: they make 0 chunk"):
        tune(llama, [short], out, options=TuneOptions(**QUICK))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="is not supported; blend_integrations has adapters"):
        tune(str(gpt2), [documents], out, options=TuneOptions(**QUICK))
    with pytest.raises(ValueError, match="target must be a number >= 0"):
        TuneOptions(target="low")
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        TuneOptions(steps=0)
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine, got 'linear'"):
        TuneOptions(lr_schedule="linear")
    assert not out.exists() and not out.with_name("out.partial").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(TuneError, match="exists: choose a new --out"):
        tune(llama, [documents], existing, options=TuneOptions(**QUICK))
    done = run_python(
        "-m", "blend_integrations.tune", llama, "--documents", str(documents), "--out", str(out), "--target", "low",
        timeout=300, returncode=2,
    )  # fmt: skip
    assert "argument --target: invalid float value: 'low'" in done.stderr


def stop(step, block, full):
    raise KeyboardInterrupt  # with checkpoint_every=1 and eval_every=2: after step 1's checkpoint, at step 2's measurement


def test_an_interrupted_tuning_resumes_and_refuses_another_models_checkpoint(model_dirs, documents, tmp_path):
    out = tmp_path / "out"
    # a cosine schedule: resumed, it goes on from the step the checkpoint reached
    options = TuneOptions(**(QUICK | {"steps": 4, "eval_every": 2, "checkpoint_every": 1, "lr_schedule": "cosine"}))

    with pytest.raises(KeyboardInterrupt):
        tune(model_dirs("llama"), [documents], out, options=options, progress=False, on_eval=stop)
    partial = out.with_name("out.partial")
    assert not out.exists() and (partial / "checkpoint" / "state.pt").is_file()
    for steps in (None, 3):  # a new --steps is no licence to start over on top of the unfinished work
        with pytest.raises(TuneError, match="holds an unfinished tuning: pass --resume"):
            tune(model_dirs("llama"), [documents], out, options=options, progress=False, steps=steps)
    with pytest.raises(TuneError, match="--resume: the checkpoint in .* was made from"):
        tune(model_dirs("llama_seed1"), [documents], out, progress=False, resume=True)
    # the teacher's replies were kept on disk, one file a prompt; damaged ones are made again, never read:
    # bytes that are no torch file, a reply of the wrong shape, and log-probabilities that are NaN
    kept = sorted((partial / "teacher").glob("*.pt"))
    assert len(kept) >= options.held_out + options.batch_size
    for i, path in enumerate(kept):
        good = torch.load(path, weights_only=True)
        if i % 3 == 0:
            path.write_bytes(b"not a torch file")
        elif i % 3 == 1:
            torch.save({"reply": good["reply"], "logprobs": good["logprobs"][:, :-1]}, path)
        else:
            torch.save({"reply": good["reply"], "logprobs": torch.full_like(good["logprobs"], float("nan"))}, path)
    # resumed with the checkpoint's options alone: on from step 1, stopped again at step 2's measurement
    with pytest.raises(KeyboardInterrupt):
        tune(model_dirs("llama"), [documents], out, progress=False, resume=True, on_eval=stop)
    # a checkpoint of 0.1.0 kept one peak for the whole run: read as one process whose malloc is unknown
    state = torch.load(partial / "checkpoint" / "state.pt", weights_only=True)
    del state["progress"]["processes"]
    state["progress"]["peak_memory_gb"] = 1.5
    torch.save(state, partial / "checkpoint" / "state.pt")
    # resumed with its checkpoint's options, but told to stop sooner than its 4 steps
    result = tune(model_dirs("llama"), [documents], out, progress=False, resume=True, steps=3)
    assert result.steps == 3 and (out / "tuning.json").is_file() and not partial.exists()
    record = json.loads((out / "tuning.json").read_text())
    assert [k["step"] for k in record["held_out_kl"]] == [0, 2, 3] and record["options"]["steps"] == 3
    # each process that made the checkpointed steps, with its own malloc and peak (the resume stopped
    # at step 2's measurement checkpointed nothing, so it is not among them)
    first, resumed = record["processes"]
    assert first == {"from_step": 0, "malloc": None, "peak_memory_gb": 1.5}
    assert resumed["from_step"] == 1 and resumed["malloc"] in ("tcmalloc", "jemalloc", "system")
    # each step took the rate a run of 3 steps never stopped takes at that step: the schedule went on from
    # the checkpoint's step (a restarted one would give step 2 the first step's rate) and decays over the new total
    whole = tune(
        model_dirs("llama"),
        [documents],
        tmp_path / "whole",
        options=dataclasses.replace(options, steps=3),
        progress=False,
    )
    rates = whole.learning_rates
    assert len(rates) == 3 and rates[0] == options.learning_rate > rates[1] > rates[2] > 0, rates
    assert result.learning_rates == rates
    # the same held-out KL as the run never stopped: no damaged reply of the teacher's was read
    flat = [[value for row in run.held_out_kl for value in row] for run in (result, whole)]
    assert flat[0] == pytest.approx(flat[1], rel=1e-4)


def test_a_run_starts_where_only_the_teachers_replies_were_kept(model_dirs, documents, tmp_path):
    """A run stopped before its first checkpoint leaves the teacher's replies alone: not a tuning to resume
    (a new run starts and reads them back), and a run with another model never reads them."""
    out = tmp_path / "out"
    options = TuneOptions(**(QUICK | {"steps": 2, "eval_every": 1, "checkpoint_every": 2}))
    with pytest.raises(KeyboardInterrupt):  # at step 1's measurement, before the checkpoint at step 2
        tune(model_dirs("llama"), [documents], out, options=options, progress=False, on_eval=stop)
    partial = out.with_name("out.partial")
    assert os.listdir(partial) == ["teacher"]
    made = {p.name: p.stat().st_mtime_ns for p in (partial / "teacher").glob("*.pt")}
    other = tune(model_dirs("llama_seed1"), [documents], out, options=options, progress=False)
    assert other.steps == 2 and not partial.exists()
    assert other.held_out_kl[0][2] < 1e-4  # untuned, its full reading is its own teacher's, not the other model's
    with pytest.raises(KeyboardInterrupt):
        tune(model_dirs("llama"), [documents], tmp_path / "again", options=options, progress=False, on_eval=stop)
    again = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "again.partial" / "teacher").glob("*.pt")}
    assert set(again) == set(made)  # the same model's replies, named alike; another model's were others


def test_resume_refuses_other_options_than_the_checkpoints_and_says_which_it_keeps(model_dirs, documents, tmp_path):
    out = tmp_path / "out"
    options = TuneOptions(**(QUICK | {"steps": 2, "eval_every": 2, "checkpoint_every": 1, "learning_rate": 5e-5}))
    with pytest.raises(KeyboardInterrupt):
        tune(model_dirs("llama"), [documents], out, options=options, progress=False, on_eval=stop)
    meta = out.with_name("out.partial") / "checkpoint" / "meta.json"
    saved = meta.read_text()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = ["-m", "blend_integrations.tune", model_dirs("llama"), "--documents", str(documents), "--out", str(out),
               "--resume", "--no-progress"]  # fmt: skip
    # given and not the checkpoint's: refused, each with both values; one equal to it (--seed 0) and --steps may be given
    done = run_python(*command, "--learning-rate", "1e-4", "--rank", "8", "--seed", "0", "--steps", "3",
                      timeout=300, env=env, returncode=2)  # fmt: skip
    assert (
        "error: --resume: --rank 8 differs from the checkpoint's 16; --learning-rate 0.0001 differs from the "
        "checkpoint's 5e-05: resume with the checkpoint's options or start a new run"
    ) in done.stderr
    assert "resuming" not in done.stdout and meta.read_text() == saved and not out.exists()
    with pytest.raises(TuneError, match=r"--resume: --learning-rate 0\.0001 differs from the checkpoint's 5e-05: "):
        tune(
            model_dirs("llama"), [documents], out, options=dataclasses.replace(options, learning_rate=1e-4), resume=True
        )
    # left out, an option is the checkpoint's, and the command says which it kept
    done = run_python(*command, "--seed", "0", timeout=600, env=env)
    kept = done.stdout.splitlines()[0]
    assert kept.startswith("resuming with the checkpoint's --steps 2, --rank 16, --alpha 32, --learning-rate 5e-05,")
    assert "--seed" not in kept
    assert json.loads((out / "tuning.json").read_text())["options"] == dataclasses.asdict(options)


def test_the_adapter_alone_merges_once_into_the_same_checkpoint(tuned, model_dirs, tmp_path):
    """What a package ships: the adapter (a few MB) and its record, merged
    into the base model once on the user's machine, into the very checkpoint
    the tuning wrote (the same fingerprint, so the same chunks and calibrations)."""
    from blend_integrations.models.adapters import merged_checkpoint, pack_adapter

    out, _ = tuned
    adapter = out / "adapter"
    assert json.loads((adapter / "tuning.json").read_text())["steps"] == QUICK["steps"]
    assert sum(p.stat().st_size for p in adapter.iterdir()) < 0.2 * (out / "model.safetensors").stat().st_size
    merged = merged_checkpoint(model_dirs("llama"), adapter, cache=tmp_path)
    assert model_fingerprint(merged) == model_fingerprint(out)
    assert (merged / "tuning.json").is_file() and (merged / "chat_template.jinja").is_file()
    assert merged_checkpoint(model_dirs("llama"), adapter, cache=tmp_path) == merged  # made once
    assert [p.name for p in tmp_path.iterdir()] == [merged.name]  # nothing half-merged left
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
        merged_checkpoint(model_dirs("llama"), tmp_path / merged.name, cache=tmp_path / "other")
    # packed as a package ships it: bfloat16 weights (half the bytes), the record naming the base, not a path
    packed = pack_adapter(adapter, tmp_path / "packed", base_model="tiny llama")
    assert (packed / "adapter_model.safetensors").stat().st_size < 0.6 * (
        adapter / "adapter_model.safetensors"
    ).stat().st_size
    assert json.loads((packed / "tuning.json").read_text())["base_model"] == "tiny llama"
    with pytest.raises(FileExistsError, match="exists: pack the adapter into a new folder"):
        pack_adapter(adapter, packed)
    assert model_fingerprint(merged_checkpoint(model_dirs("llama"), packed, cache=tmp_path)) != model_fingerprint(out)
