"""Train the reader model: a small Llama-style decoder (tokenizer included) that
answers questions from its documents (training.data).

    python -m training.train OUT_DIR [--steps 800] [--seed 0]

The loss is the answer tokens', plus a smaller language-model loss on the whole
prompt, plus look losses that steer the attention of a few heads towards a
circuit that answers (see ``look_targets``) and a probe loss that keeps the
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
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.fixtures.local_models import train_tokenizer

from .data import Example, corpus_text, make_example, make_examples, prompt, question_subject

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


def forward_capturing(model, x: torch.Tensor, layers: set[int]):
    """Run ``model`` on ``x``: (its output, {layer: the keyword inputs of that
    layer's attention}), for computing attention rows (``attention_rows``)."""
    inputs: dict[int, dict] = {layer: {} for layer in layers}
    hooks = [
        model.model.layers[i].self_attn.register_forward_pre_hook(
            lambda _m, _a, kwargs, seen=seen: seen.update(kwargs), with_kwargs=True
        )
        for i, seen in inputs.items()
    ]
    try:
        return model(input_ids=x), inputs
    finally:
        for hook in hooks:
            hook.remove()


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


@dataclass
class Look:
    """Where some heads of one layer should attend: (query position, source positions) rows."""

    layer: int  # -1: the last
    heads: tuple[int, ...] | None  # None: all
    rows: list[tuple[int, list[int]]]  # the sources of a row are occurrences of one token


# Training steers a few heads towards a circuit that answers from long prompts.
# Every fact names its subject, then the relation, then the value, and the
# subject's last two tokens are always 4 and 5 tokens before the value ("Harbor
# Works is based in Yarrow", "Ada Okafor was born in Brimford"). So: heads of
# the first layer look a fixed distance back (1, 4, 5 tokens), which writes the
# subject into every value token; at the position that answers, heads of the
# second layer look at the question's subject; for 2-hop questions heads of the
# third layer look at the bridge (the first token of the founder's name in the
# company's document: a value like any other, 4-5 tokens after the company's
# name); and the last layer looks at the fact that states the answer. With
# the last layer's look alone the reader copied a value of the right kind (a
# city, a name) but could not tell whose it was: on the benchmark's long prompts
# 1-hop accuracy stayed near 0.2. The losses only shape training; the model is
# a plain Llama.
POSITION_HEADS = {0: 1, 1: 4, 2: 5}  # first layer: head -> how many tokens back it looks
POSITION_ROWS = 128  # positions per example that train them
SUBJECT_LAYER, SUBJECT_HEADS = 1, (0, 1)  # look at the subject's last and second-to-last token
BRIDGE_LAYER, BRIDGE_HEADS = 2, (0, 1)


def look_targets(example: Example, tokenizer, ids: list[int], answer_mask: list[int]) -> dict[str, Look]:
    """The rows of each look loss for one encoded example (see the comment above):
    "position", "subject", "bridge" and, in the last layer, "answer": at the
    position that predicts an answer's first token, the value in the sentence
    that states it; at the next ones, the occurrences that follow the token
    before it (induction: "Ada" -> the "Okafor" after an earlier "Ada")."""
    rows = range(max(POSITION_HEADS.values()), len(ids))
    sampled = rows[:: max(1, len(rows) // POSITION_ROWS)]
    looks = {
        f"position{back}": Look(0, (head,), [(j, [j - back]) for j in sampled]) for head, back in POSITION_HEADS.items()
    }
    subject = [Look(SUBJECT_LAYER, (head,), []) for head in SUBJECT_HEADS]
    bridge, copy = Look(BRIDGE_LAYER, BRIDGE_HEADS, []), Look(-1, None, [])
    asked = [(example.question, example.answer, example.facts)]
    asked += [(f.question, f.answer, f.facts) for f in example.follow_ups]
    starts = [p for p in range(1, len(ids)) if answer_mask[p] and not answer_mask[p - 1]]
    for (question, answer, facts), start in zip(asked, starts, strict=True):
        query = start - 1
        name = tokens_of(tokenizer, question_subject(question))
        at = find(ids, name, before=query)[-1]
        for look, back in zip(subject, (1, 2), strict=True):
            look.rows.append((query, [at + len(name) - back]))
        values = [value_positions(ids, tokenizer, sentence, value, before=query) for sentence, value in facts]
        if len(facts) == 2:
            bridge.rows.append((query, [values[0][0]]))
        n = len(tokens_of(tokenizer, answer))
        copy.rows.append((query, [values[-1][0]]))
        for k in range(1, n):
            p = start + k
            sources = [j for j in range(1, p - 1) if ids[j] == ids[p] and ids[j - 1] == ids[p - 1]]
            if sources:
                copy.rows.append((p - 1, sources))
    return {**looks, "subject_last": subject[0], "subject_before": subject[1], "bridge": bridge, "answer": copy}


def subject_rows(example: Example, tokenizer, ids: list[int], answer_mask: list[int]) -> list[tuple[int, int, int]]:
    """(position, subject's first token, subject's last token) where the last
    layer matches a 1-hop question with its fact: the answering position (the
    question's subject) and the value in the fact sentence (the subject 5 and 4
    tokens before it). ``subject_probe_loss`` makes both name the subject in
    one code, so the last layer's queries and keys can match on it."""
    asked = [(example.question, example.facts)] + [(f.question, f.facts) for f in example.follow_ups]
    starts = [p for p in range(1, len(ids)) if answer_mask[p] and not answer_mask[p - 1]]
    rows = []
    for (question, facts), start in zip(asked, starts, strict=True):
        if len(facts) != 1:  # 2-hop: the last hop's subject is the bridge, which the question does not name
            continue
        name = tokens_of(tokenizer, question_subject(question))
        value = value_positions(ids, tokenizer, *facts[0], before=start - 1)[0]
        rows += [(start - 1, name[0], name[-1]), (value, name[0], name[-1])]
    return rows


def tokens_of(tokenizer, words: str) -> list[int]:
    """The tokens of ``words`` inside a sentence (after a space, as in the documents and questions)."""
    return tokenizer.encode(" " + words, add_special_tokens=False)


def find(ids: list[int], part: list[int], before: int) -> list[int]:
    """Start positions of ``part`` in ``ids[:before]``."""
    return [j for j in range(before - len(part) + 1) if ids[j : j + len(part)] == part]


def value_positions(ids: list[int], tokenizer, sentence: str, value: str, before: int) -> list[int]:
    """Positions of ``value``'s tokens where ``sentence`` states it (in a document before ``before``)."""
    sentence_ids, value_ids = tokens_of(tokenizer, sentence), tokens_of(tokenizer, value)
    starts = find(ids, sentence_ids, before)
    offsets = find(sentence_ids, value_ids, len(sentence_ids))
    if not starts or not offsets:
        raise ValueError(f"the fact {sentence!r} is not in the prompt")
    return [starts[0] + offsets[0] + k for k in range(len(value_ids))]


def attention_rows(attention, hidden_states: torch.Tensor, position_embeddings, queries: list[int]) -> torch.Tensor:
    """A Llama attention layer's softmax weights (heads x len(queries) x keys)
    for a few query positions, computed as its eager path does, so the model
    itself can run a fused attention that never materialises the whole matrix
    (over 3x faster on CPU at 3,000 tokens)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = attention.head_dim
    rows = torch.tensor(queries, device=hidden_states.device)
    q = attention.q_proj(hidden_states[:, rows]).view(1, len(queries), -1, head_dim).transpose(1, 2)
    k = attention.k_proj(hidden_states).view(1, hidden_states.shape[1], -1, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos[:, rows], sin[:, rows])
    k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # grouped-query attention: heads share keys
    scores = (q @ k.transpose(-1, -2))[0] * attention.scaling
    future = torch.arange(k.shape[2], device=rows.device)[None, :] > rows[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1, dtype=torch.float32)


def attention_output(attention, hidden_states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What a Llama attention layer adds to the residual stream at the rows of
    ``weights`` (from ``attention_rows``): rows x hidden size."""
    head_dim = attention.head_dim
    v = attention.v_proj(hidden_states).view(1, hidden_states.shape[1], -1, head_dim).transpose(1, 2)[0]
    v = v.repeat_interleave(weights.shape[0] // v.shape[0], dim=0)  # grouped-query attention
    heads = weights.to(v.dtype) @ v  # heads x rows x head_dim
    return attention.o_proj(heads.transpose(0, 1).reshape(weights.shape[1], -1))


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


def model_card(summary: dict) -> str:
    a, acc = summary["arch"], summary["held_out_teacher_forced"]
    stages = "; ".join(
        f"{lo}-{hi} documents of {tlo}-{thi} tokens from step {start}"
        for (lo, hi), (tlo, thi), start in summary["stages"]
    )
    return f"""# Reader model

A small Llama-style decoder trained in this repository to answer questions from
the documents in its prompt, so that what blending costs in answers can be
measured without downloading a model. It knows nothing but this task.

## Data

Synthetic multi-document question answering from `training.data`
(seed {summary["seed"]}): every example is a fresh world of companies (founder, city)
and people (birthplace, profession), one document of 100-500 tokens of filler
per entity with its facts at random points, distractor documents, and a 1-hop
(answer in one document) or 2-hop (answer needs two) question, half each.
Documents are shown in shuffled order and tokenized alone, as the engines
tokenize chunks. The curriculum: {stages}. Each training prompt carries
{summary["follow_ups"]} follow-up questions as further chat turns (more answers per prompt;
inference asks one). The loss is the answers' tokens plus
{summary["lm_weight"]} times the language-model loss on the whole prompt (the documents are
the plain text), plus look losses (minus the log of the attention a head puts where it
should look, plus the cross-entropy of the token it looks at from what the head adds
alone): {summary["look_weight"]} times the last layer's, whose heads should attend, when predicting
an answer's first token, to the value in the sentence that states it, and for the next tokens
to the occurrences after the token before it; and {summary["circuit_weight"]} times each of these: in the
first layer three heads look 1, 4 and 5 tokens back (facts put their subject's last two
tokens 4 and 5 tokens before the value), in the second layer two heads look from the
answering position at the question's subject, in the third two look at the founder's name
in the company's document for 2-hop questions. Plus {summary["subject_weight"]} times a subject
probe loss: for 1-hop questions, the last layer's input at the answering position and at the
value in the fact sentence must both name the subject (its first and last token), read by one
linear probe and the tied unembedding, so that the last layer can match a fact to the question's
subject (without it, it matched the relation only). These losses only shape training (the probe
is thrown away); the model is a plain Llama. The tokenizer is a byte-level BPE trained on the same
generator's text ({summary["vocab"]} tokens); the chat template is the one of
`tests.fixtures.local_models` (roles as special tokens, Hermes-style tools).

## Size

{summary["params"] / 1e6:.2f} M parameters: {a["num_layers"]} layers, hidden size {a["hidden_size"]}, \
{a["num_heads"]} attention heads ({a["num_kv_heads"]} key/value heads), MLP {a["intermediate_size"]}, tied embeddings,
RoPE (theta {a["rope_theta"]:g}), context 8192; float32 safetensors. Initialisation: Llama's,
except the embeddings (std {summary["embedding_std"]}, so a token's identity dominates
its residual stream) and the last layer's value and output projections, which
start as a copy of what the heads attend to.

## Training

{summary["steps"]} AdamW steps of about {summary["tokens_per_step"]} tokens ({summary["examples"]} examples,
{summary["tokens"] / 1e6:.1f} M tokens), learning rate {summary["lr"]} after a warm-up, cosine down to a tenth over the
last quarter; a stage ends when its 1-hop teacher-forced accuracy reaches {summary["gate"]} (or at its share of the steps);
{summary["minutes"]} minutes on {summary["threads"]} CPU threads. Reproduce with

    python -m training.train OUT_DIR --steps {summary["steps"]} --seed {summary["seed"]} --threads {summary["threads"]}

## Accuracy

Greedy exact match under teacher forcing on 64 held-out examples (every answer
token and the end must be the argmax): 1-hop {acc.get("acc_1hop", 0):.2f}, 2-hop {acc.get("acc_2hop", 0):.2f}.
The quality benchmark (`python -m benchmarks quality`, results in
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
    held_out = make_examples(64, seed=args.seed + 10_000)  # never trained on: other seeds
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
