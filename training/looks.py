"""The reader's look losses' targets (training only): where training steers
a few heads to attend (``look_targets``), where the last layer must read the
question's subject (``subject_rows``), and what those heads attend to and add,
computed for a few rows (``attention_rows``, ``attention_output``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .data import Example, question_subject


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
