"""Train the reader model: a small Llama-style decoder (tokenizer included) that
answers questions from its documents (blend_integrations.quality.data).

    python -m blend_integrations.quality.train OUT_DIR [--steps 800] [--seed 0]

Deterministic for a seed, step count and thread count. The loss is the answer tokens' plus
a smaller language-model loss on the rest of the prompt; each training prompt
asks several questions about its documents, as further chat turns. Prompts are built
exactly as the engines build them at inference (the chat template, each
document tokenized alone), and the curriculum grows from a few short documents
to the benchmark's 6-10 documents of 100-500 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from ..local_models import train_tokenizer
from .data import Example, corpus_text, make_example, make_examples, prompt
ARCH = {"num_layers": 4, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 768}


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
    answers = [example.answer] + [a for _, a in example.follow_ups]
    questions = [q for q, _ in example.follow_ups] + [None]
    for answer, next_question in zip(answers, questions, strict=True):
        # a leading space: the answer's tokens are then the very tokens it has in the documents
        reply = tokenizer.encode(" " + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + reply, mask + [1] * len(reply)
        if next_question is not None:
            turn = tokenizer.encode(f"\n<|user|>\nQuestion: {next_question}</s>\n<|assistant|>\n",
                                    add_special_tokens=False)
            ids, mask = ids + turn, mask + [0] * len(turn)
    return ids, mask


def stage(progress: float) -> dict:
    """The curriculum: many small steps on tiny documents first (retrieval has to
    be learned on short contexts; on long ones the model stays at the prior),
    then longer and more documents, up to the benchmark's 6-10 of 100-500 tokens."""
    if progress < 0.3:
        return {"n_docs": (1, 3), "doc_tokens": (10, 30)}
    if progress < 0.5:
        return {"n_docs": (2, 5), "doc_tokens": (30, 120)}
    if progress < 0.75:
        return {"n_docs": (4, 8), "doc_tokens": (60, 300)}
    return {"n_docs": (6, 10), "doc_tokens": (100, 500)}


def build_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=ARCH["hidden_size"], intermediate_size=ARCH["intermediate_size"],
        num_hidden_layers=ARCH["num_layers"], num_attention_heads=ARCH["num_heads"],
        num_key_value_heads=ARCH["num_kv_heads"], head_dim=ARCH["hidden_size"] // ARCH["num_heads"],
        max_position_embeddings=8192, rope_theta=10000.0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def loss_of(model, ids: list[int], answer_mask: list[int], lm_weight: float) -> torch.Tensor:
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float()
    targets = x[0, 1:]
    per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    mask = torch.tensor(answer_mask[1:], dtype=torch.float32)
    answer_loss = (per_token * mask).sum() / mask.sum()
    return answer_loss + lm_weight * per_token.mean()


@torch.no_grad()
def teacher_forced_accuracy(model, examples: list[Example], tokenizer) -> dict:
    """Share of examples whose every answer token (and the end) is the argmax:
    greedy decoding's exact match, in one forward pass each."""
    model.eval()
    hits = {1: [], 2: []}
    for ex in examples:
        ids, mask = encode(ex, tokenizer)
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        predicted = logits.argmax(-1)
        at = torch.tensor(mask[1:]).bool()
        hits[ex.hops].append(bool((predicted[at] == torch.tensor(ids[1:])[at]).all()))
    model.train()
    return {f"acc_{h}hop": sum(v) / len(v) for h, v in hits.items() if v}


def model_card(summary: dict) -> str:
    a, acc = summary["arch"], summary["held_out_teacher_forced"]
    return f"""# Reader model

A small Llama-style decoder trained in this repository to answer questions from
the documents in its prompt, so that what blending costs in answers can be
measured without downloading a model. It knows nothing but this task.

## Data

Synthetic multi-document question answering from `blend_integrations.quality.data`
(seed {summary["seed"]}): every example is a fresh world of companies (founder, city)
and people (birthplace, profession), one document of 100-500 tokens of filler
per entity with its facts at random points, distractor documents, and a 1-hop
(answer in one document) or 2-hop (answer needs two) question, half each.
Documents are shown in shuffled order and tokenized alone, as the engines
tokenize chunks. The curriculum grows from 1-3 documents of 10-30 tokens to
6-10 documents of 100-500 tokens. Each training prompt carries
{summary["follow_ups"]} follow-up questions as further chat turns (more answers per prompt;
inference asks one). The loss is the answers' tokens plus
{summary["lm_weight"]} times the language-model loss on the whole prompt (the documents are
the plain text). The tokenizer is a byte-level BPE trained on the same
generator's text ({summary["vocab"]} tokens); the chat template is the one of
`blend_integrations.local_models` (roles as special tokens, Hermes-style tools).

## Size

{summary["params"] / 1e6:.2f} M parameters: {a["num_layers"]} layers, hidden size {a["hidden_size"]}, \
{a["num_heads"]} attention heads ({a["num_kv_heads"]} key/value heads), MLP {a["intermediate_size"]}, tied embeddings,
RoPE (theta 10000), context 8192; float32 safetensors.

## Training

{summary["steps"]} AdamW steps of about {summary["tokens_per_step"]} tokens ({summary["examples"]} examples,
{summary["tokens"] / 1e6:.1f} M tokens), peak learning rate {summary["lr"]}, warm-up then cosine;
{summary["minutes"]} minutes on {summary["threads"]} CPU threads. Reproduce with

    python -m blend_integrations.quality.train OUT_DIR --steps {summary["steps"]} --seed {summary["seed"]} --threads {summary["threads"]}

## Accuracy

Greedy exact match under teacher forcing on 64 held-out examples (every answer
token and the end must be the argmax): 1-hop {acc.get("acc_1hop", 0):.2f}, 2-hop {acc.get("acc_2hop", 0):.2f}.
The quality benchmark (`python -m blend_integrations.bench quality`, results in
`docs/results/quality.md`) measures generated answers on 300 other held-out
questions, for full prefill and every blend mode.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the reader model on the synthetic QA task.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps; the schedule follows them")
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lm-weight", type=float, default=0.2)
    parser.add_argument("--follow-ups", type=int, default=6, help="extra questions per training prompt")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_reader_tokenizer(args.out, args.vocab, args.seed)
    model = build_model(tokenizer, args.seed)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    held_out = make_examples(64, seed=args.seed + 10_000)  # never trained on: other seeds
    rng = random.Random(args.seed + 1)
    started, step, seen_tokens, examples_seen = time.time(), 0, 0, 0
    log = []
    model.train()
    while step < args.steps:
        progress = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        step_tokens, losses = 0, []
        while step_tokens < args.tokens_per_step:
            ex = make_example(rng, hops=2 if rng.random() < 0.5 else 1, follow_ups=args.follow_ups, **stage(progress))
            ids, mask = encode(ex, tokenizer)
            loss = loss_of(model, ids, mask, args.lm_weight)
            (loss * len(ids) / args.tokens_per_step).backward()
            step_tokens += len(ids)
            losses.append(loss.item())
            examples_seen += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        seen_tokens += step_tokens
        if step % 25 == 0:
            entry = {"step": step, "minutes": round((time.time() - started) / 60, 1), "lr": round(lr, 6),
                     "loss": round(sum(losses) / len(losses), 4), "stage": stage(progress)["n_docs"],
                     "tokens": seen_tokens}
            if step % 50 == 0:
                if step % 100 == 0:
                    entry.update(teacher_forced_accuracy(model, held_out[:32], tokenizer))
                in_stage = make_examples(32, seed=args.seed + 20_000 + step, **stage(progress))
                entry.update({f"stage_{k}": v for k, v in teacher_forced_accuracy(model, in_stage, tokenizer).items()})
                model.save_pretrained(str(args.out), safe_serialization=True)  # a checkpoint to look at
            log.append(entry)
            print(json.dumps(entry), flush=True)

    minutes = (time.time() - started) / 60
    final = teacher_forced_accuracy(model, held_out, tokenizer)
    model.save_pretrained(str(args.out), safe_serialization=True)
    summary = {"params": params, "steps": step, "examples": examples_seen, "tokens": seen_tokens,
               "minutes": round(minutes, 1), "threads": args.threads, "seed": args.seed, "arch": ARCH,
               "vocab": len(tokenizer), "lr": args.lr, "lm_weight": args.lm_weight,
               "tokens_per_step": args.tokens_per_step, "follow_ups": args.follow_ups,
               "held_out_teacher_forced": final}
    (args.out / "training.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    (args.out / "README.md").write_text(model_card(summary))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
