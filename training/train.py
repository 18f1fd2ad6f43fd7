"""Train the reader model: a small Llama-style decoder (tokenizer included) that
answers questions from its documents (training.data).

    python -m training.train OUT_DIR [--steps 800] [--seed 0]

The loss is the answer tokens', plus a smaller language-model loss on the whole
prompt, plus look losses that steer the attention of a few heads towards a
circuit that answers (``training.looks``) and a probe loss that keeps the
question's subject readable where the last layer matches it with a fact
(``subject_probe_loss``); each training prompt asks several
questions about its documents, as further chat turns. Prompts are built exactly as the engines
build them at inference (the chat template, each document tokenized alone),
and the curriculum grows from a few short documents to the benchmark's 6-10
documents of 100-500 tokens.

Every 100 steps the run saves OUT_DIR/checkpoint.pt, and the same command
continues from it (``--stop-after N`` trains in slices). With ``--threads 1`` a
run is bit-for-bit deterministic for a seed and step count, stopped and
continued or not; with more threads PyTorch's float reductions can differ from
run to run, and so can the step at which the model learns to copy the answer
(an abrupt change).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from tests.fixtures.local_models import train_tokenizer

from .card import model_card
from .data import Example, corpus_text, make_example, make_examples, prompt
from .looks import Look, attention_output, attention_rows, forward_capturing, look_targets, subject_rows

EMBEDDING_STD = 0.1
ARCH = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 768,
    "rope_theta": 1e6,
}
# rope_theta: a head can only match content (a name in the question with the same
# name in a document) on the dimensions that RoPE turns slowly over the distance
# between them. At theta 10000 with 32-dimensional heads, one pair of dimensions
# turns less than a radian over 4,000 tokens; at 1e6 (Llama 3 uses 5e5) six do.
# With 10000 the reader answered from prompts of a few hundred tokens but not
# from the benchmark's 600-5,000.


def train_reader_tokenizer(path: Path, vocab_size: int, seed: int):
    """The local models' tokenizer recipe (BPE, chat roles, chat template) on the task's text."""
    texts = corpus_text(1500, seed) + [f"{e.question} {e.answer}" for e in make_examples(1000, seed + 1, n_docs=(2, 3))]
    return train_tokenizer(path, vocab_size=vocab_size, texts=texts)


def encode(example: Example, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the token is part of an answer) for teacher forcing.
    Follow-up questions continue the conversation as further turns, as the chat
    template writes them: more answers to learn from for the same documents."""
    ids = prompt(example, tokenizer).token_ids
    mask = [0] * len(ids)
    answers = [example.answer] + [f.answer for f in example.follow_ups]
    questions = [f.question for f in example.follow_ups] + [None]
    for answer, next_question in zip(answers, questions, strict=True):
        # a leading space: the answer's tokens are then the very tokens it has in the documents
        reply = tokenizer.encode(" " + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + reply, mask + [1] * len(reply)
        if next_question is not None:
            turn = tokenizer.encode(
                f"\n<|user|>\nQuestion: {next_question}</s>\n<|assistant|>\n", add_special_tokens=False
            )
            ids, mask = ids + turn, mask + [0] * len(turn)
    return ids, mask


# The curriculum. Copying the answer has to be learned on short contexts (on long
# ones the model stays at the prior and answers the most frequent name). A stage
# ends when its 1-hop teacher-forced accuracy reaches GATE, or at its share of
# the steps at the latest.
STAGES = (
    {"n_docs": (1, 3), "doc_tokens": (10, 30), "until": 0.35},
    {"n_docs": (6, 10), "doc_tokens": (30, 150), "until": 0.55},
    {"n_docs": (6, 10), "doc_tokens": (100, 500), "until": 1.0},  # the benchmark's distribution
)
GATE = 0.9


def learning_rate(peak: float, step: int, steps: int) -> float:
    """Warm-up, constant while the curriculum runs, cosine down to a tenth over the last quarter."""
    decay = max(0.0, (step / steps - 0.75) / 0.25)
    return peak * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decay)))


def build_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=ARCH["hidden_size"],
        intermediate_size=ARCH["intermediate_size"],
        num_hidden_layers=ARCH["num_layers"],
        num_attention_heads=ARCH["num_heads"],
        num_key_value_heads=ARCH["num_kv_heads"],
        head_dim=ARCH["hidden_size"] // ARCH["num_heads"],
        max_position_embeddings=8192,
        rope_theta=ARCH["rope_theta"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger than Llama's 0.02: at 0.02 a token's residual stream at the last
        # layer is mostly the layers' output (cosine 0.14 with its embedding), at
        # 0.1 mostly the token (0.8), so what a head attends to can be copied.
        model.model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
    copy_init(model.model.layers[-1].self_attn, config)
    return model


@torch.no_grad()
def copy_init(attention, config) -> None:
    """Start the layer's value and output projections as a copy: whatever its
    heads attend to is added to the residual stream unchanged (on the subspace
    the key/value heads carry), so with tied embeddings an attended token raises
    its own logit from the first step. From a random start, a model this small
    learned to attend to the answer long before it learned to copy it."""
    hidden, head_dim = config.hidden_size, config.head_dim
    kv_heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))  # orthonormal columns
    values = basis[:, : kv_heads * head_dim].T  # v = values @ x
    attention.v_proj.weight.copy_(values)
    out = torch.cat(
        [
            values[(h // group) * head_dim : (h // group + 1) * head_dim].T / group
            for h in range(config.num_attention_heads)
        ],
        dim=1,
    )
    attention.o_proj.weight.copy_(out)


def loss_of(
    model,
    ids: list[int],
    answer_mask: list[int],
    lm_weight: float,
    looks: dict[str, Look] | None = None,
    weights: dict[str, float] | None = None,
    probe: torch.nn.Linear | None = None,
    subjects: list[tuple[int, int, int]] | None = None,
    subject_weight: float = 0.0,
) -> torch.Tensor:
    """Answer tokens' loss, plus ``lm_weight`` times the language-model loss,
    plus, for each kind of ``looks`` (see ``look_targets``), its weight times
    minus the log of the attention its heads put on its sources, and times the
    cross-entropy of the token they look at from their output alone, plus
    ``subject_weight`` times ``subject_probe_loss`` at ``subjects``."""
    x = torch.tensor([ids], device=model.device)
    looks = {name: look for name, look in (looks or {}).items() if look.rows and (weights or {}).get(name, 0) > 0}
    probing = probe is not None and subject_weight > 0 and bool(subjects)
    last = len(model.model.layers) - 1  # looks name it -1; one capture serves them and the probe
    layers = {look.layer % (last + 1) for look in looks.values()} | ({last} if probing else set())
    out, inputs = forward_capturing(model, x, layers)
    logits = out.logits[0, :-1].float()
    per_token = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
    mask = torch.tensor(answer_mask[1:], dtype=torch.float32, device=model.device)
    loss = (per_token * mask).sum() / mask.sum() + lm_weight * per_token.mean()
    if probing:
        loss = loss + subject_weight * subject_probe_loss(model, probe, inputs[last], subjects)
    for name, look in looks.items():
        seen = inputs[look.layer % (last + 1)]
        attention = attention_rows(
            model.model.layers[look.layer].self_attn,
            seen["hidden_states"],
            seen["position_embeddings"],
            [query for query, _ in look.rows],
        )
        heads = attention if look.heads is None else attention[list(look.heads)]
        terms = [
            -torch.log(heads[:, i, sources].sum(-1).clamp(min=1e-9)).mean() for i, (_, sources) in enumerate(look.rows)
        ]
        loss = loss + weights[name] * torch.stack(terms).mean()
        # What the heads add must name the token they look at, on its own: a
        # look is only useful to the next layers if its output carries what it
        # read (with the looks alone, the last layer found every fact of the
        # asked relation but could not tell whose it was).
        if look.heads is not None:
            others = [h for h in range(attention.shape[0]) if h not in look.heads]
            attention = attention.index_fill(0, torch.tensor(others, device=attention.device), 0.0)
        copied = attention_output(model.model.layers[look.layer].self_attn, seen["hidden_states"], attention)
        copy_logits = model.lm_head(model.model.norm(copied)).float()
        looked_at = x[0, [sources[0] for _, sources in look.rows]]
        loss = loss + weights[name] * torch.nn.functional.cross_entropy(copy_logits, looked_at)
    return loss


def subject_probe_loss(
    model, probe: torch.nn.Linear, last_inputs: dict, rows: list[tuple[int, int, int]]
) -> torch.Tensor:
    """Cross-entropy of the subject's first and last token, read by ``probe``
    (one code for queries and keys) and the tied unembedding from the last
    layer's normalized input at ``rows`` (``subject_rows``). Copies that
    attention heads make are small next to what the MLPs write (norm 2-3
    against 200-300 at a fact's value): without this the subject was not
    linearly readable where the last layer needs it, and it matched a fact's
    relation but not whose fact it was."""
    hidden = last_inputs["hidden_states"][0, [p for p, _, _ in rows]]
    first, last = probe(hidden).chunk(2, dim=-1)
    logits = model.lm_head(torch.cat([first, last])).float()
    targets = torch.tensor([f for _, f, _ in rows] + [t for _, _, t in rows], device=hidden.device)
    return torch.nn.functional.cross_entropy(logits, targets)


@torch.no_grad()
def teacher_forced_accuracy(model, examples: list[Example], tokenizer) -> dict:
    """Share of examples whose every answer token (and the end) is the argmax:
    greedy decoding's exact match, in one forward pass each."""
    model.eval()
    hits = {1: [], 2: []}
    for ex in examples:
        ids, mask = encode(ex, tokenizer)
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, :-1].cpu()
        predicted = logits.argmax(-1)
        at = torch.tensor(mask[1:]).bool()
        hits[ex.hops].append(bool((predicted[at] == torch.tensor(ids[1:])[at]).all()))
    model.train()
    return {f"acc_{h}hop": sum(v) / len(v) for h, v in hits.items() if v}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the reader model on the synthetic QA task.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps; the schedule follows them")
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lm-weight", type=float, default=0.2)
    parser.add_argument("--look-weight", type=float, default=1.0, help="weight of the last layer's look loss (0: off)")
    parser.add_argument(
        "--circuit-weight", type=float, default=1.0, help="weight of each look loss of the first three layers (0: off)"
    )
    parser.add_argument(
        "--subject-weight",
        type=float,
        default=1.0,
        help="weight of the subject probe loss at the last layer's input (0: off)",
    )
    parser.add_argument("--follow-ups", type=int, default=12, help="extra questions per training prompt")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--held-out", type=int, default=64, help="held-out questions the model card's accuracy is measured on"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--stop-after", type=int, help="save a checkpoint after this step and stop (train in slices)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "checkpoint.pt"
    resume = torch.load(checkpoint, weights_only=False) if checkpoint.exists() else None
    settings = {
        k: getattr(args, k)
        for k in (
            "steps",
            "tokens_per_step",
            "lr",
            "lm_weight",
            "look_weight",
            "circuit_weight",
            "subject_weight",
            "follow_ups",
            "vocab",
            "seed",
            "held_out",
        )
    }
    if resume and resume["settings"] != settings:
        raise SystemExit(
            f"{checkpoint} was written with other settings ({resume['settings']}); "
            "use another output directory or delete the checkpoint"
        )
    tokenizer = train_reader_tokenizer(args.out, args.vocab, args.seed)
    model = build_model(tokenizer, args.seed).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    # training only, not part of the model (see subject_probe_loss)
    probe = torch.nn.Linear(ARCH["hidden_size"], 2 * ARCH["hidden_size"], bias=False).to(args.device)
    optimizer = torch.optim.AdamW(
        [*model.parameters(), *probe.parameters()], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    if args.held_out < 1:
        parser.error(f"--held-out must be at least 1, got {args.held_out}")
    held_out = make_examples(args.held_out, seed=args.seed + 10_000)  # never trained on: other seeds
    rng = random.Random(args.seed + 1)
    state = {"step": 0, "stage": 0, "stage_starts": [0], "tokens": 0, "examples": 0, "minutes": 0.0, "log": []}
    if resume:  # carry on exactly where the last run stopped
        model.load_state_dict(resume["model"])
        probe.load_state_dict(resume["probe"])
        optimizer.load_state_dict(resume["optimizer"])
        rng.setstate(resume["rng"])
        torch.set_rng_state(resume["torch_rng"])
        state = resume["state"]
        print(f"resuming at step {state['step']}", flush=True)
    model.train()
    while state["step"] < args.steps:
        step_started = time.perf_counter()  # minutes add up step times: gaps between resumed runs don't count
        step = state["step"]
        lr = learning_rate(args.lr, step, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        shape = {k: STAGES[state["stage"]][k] for k in ("n_docs", "doc_tokens")}
        optimizer.zero_grad()
        step_tokens, losses = 0, []
        while step_tokens < args.tokens_per_step:
            ex = make_example(rng, hops=2 if rng.random() < 0.5 else 1, follow_ups=args.follow_ups, **shape)
            ids, mask = encode(ex, tokenizer)
            looks = look_targets(ex, tokenizer, ids, mask)
            weights = {name: args.look_weight if name == "answer" else args.circuit_weight for name in looks}
            loss = loss_of(
                model,
                ids,
                mask,
                args.lm_weight,
                looks,
                weights,
                probe,
                subject_rows(ex, tokenizer, ids, mask),
                args.subject_weight,
            )
            (loss * len(ids) / args.tokens_per_step).backward()
            step_tokens += len(ids)
            losses.append(loss.item())
            state["examples"] += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step = state["step"] = step + 1
        state["tokens"] += step_tokens
        if step % 25 == 0:
            entry = {
                "step": step,
                "minutes": round(state["minutes"], 1),
                "lr": round(lr, 6),
                "loss": round(sum(losses) / len(losses), 4),
                "stage": state["stage"],
                "tokens": state["tokens"],
            }
            if step % 100 == 0:
                in_stage = make_examples(64, seed=args.seed + 20_000 + step, **shape)
                entry.update({f"stage_{k}": v for k, v in teacher_forced_accuracy(model, in_stage, tokenizer).items()})
                if step % 500 == 0:
                    entry.update(teacher_forced_accuracy(model, held_out, tokenizer))
                last = state["stage"] == len(STAGES) - 1
                if not last and (
                    entry.get("stage_acc_1hop", 0) >= GATE or step >= STAGES[state["stage"]]["until"] * args.steps
                ):
                    state["stage"] += 1
                    state["stage_starts"].append(step)
                    entry["next_stage"] = state["stage"]
            state["log"].append(entry)
            print(json.dumps(entry), flush=True)
        state["minutes"] += (time.perf_counter() - step_started) / 60
        if step % 100 == 0 or step == args.stop_after:
            model.save_pretrained(str(args.out), safe_serialization=True)  # weights to look at
            torch.save(
                {
                    "settings": settings,
                    "model": model.state_dict(),
                    "probe": probe.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "rng": rng.getstate(),
                    "torch_rng": torch.get_rng_state(),
                    "state": state,
                },
                checkpoint.with_suffix(".tmp"),
            )
            checkpoint.with_suffix(".tmp").replace(checkpoint)  # a run killed mid-save keeps the last one
        if step == args.stop_after:
            print(f"stopped after step {step}; run the same command again to go on", flush=True)
            return

    final = teacher_forced_accuracy(model, held_out, tokenizer)
    model.save_pretrained(str(args.out), safe_serialization=True)
    checkpoint.unlink(missing_ok=True)
    summary = {
        "params": params,
        "steps": state["step"],
        "examples": state["examples"],
        "tokens": state["tokens"],
        "minutes": round(state["minutes"], 1),
        "threads": args.threads,
        "device": args.device,
        "seed": args.seed,
        "arch": ARCH,
        "vocab": len(tokenizer),
        "lr": args.lr,
        "lm_weight": args.lm_weight,
        "look_weight": args.look_weight,
        "circuit_weight": args.circuit_weight,
        "subject_weight": args.subject_weight,
        "tokens_per_step": args.tokens_per_step,
        "follow_ups": args.follow_ups,
        "held_out": args.held_out,
        "held_out_teacher_forced": final,
        "gate": GATE,
        "embedding_std": EMBEDDING_STD,
        "stages": [
            [STAGES[i]["n_docs"], STAGES[i]["doc_tokens"], start] for i, start in enumerate(state["stage_starts"])
        ],
    }
    log = state["log"]
    (args.out / "training.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    (args.out / "README.md").write_text(model_card(summary))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
