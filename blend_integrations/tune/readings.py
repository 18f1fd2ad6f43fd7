"""Tuning layer: a blend prompt read the two ways a tuned model must know.

- **Full:** every token attends to every earlier one (the model's own prefill).
- **Block:** what the chunk store holds, as the engines reuse it. Each chunk
  is read alone, ``[BOS] + chunk`` (``Blender.compute_chunk``'s recipe), and
  its KV sits at the chunk's positions in the prompt; the prompt's other
  tokens (prefix, separators, question) and the reply attend to everything.

Both are one forward of a Hugging Face causal LM with an explicit attention
mask and position ids, so gradients reach every weight. The block reading
puts a copy of BOS before each chunk, at the position just before the chunk:
its chunk's tokens attend to it and to their own chunk only, and nothing
else sees it. Attention within the chunk then depends on the same relative
positions as the stored recipe's, and every other token attends to the
chunk's KV at its prompt positions, as after the engines' re-rotation. An
untuned model's block reading is the engines' reuse (r=0); the tests compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..prompt import TokenizedPrompt


@dataclass(frozen=True)
class Reading:
    """One sequence to run: ids, positions, who may attend to whom
    (``allowed[q, k]``), and the rows whose logits predict the reply."""

    ids: list[int]
    positions: list[int]
    allowed: torch.Tensor  # [L, L] bool
    predicts: list[int]  # rows whose next-token logits are compared, in reply order
    groups: tuple[int, ...] = ()  # block reading, per row: the chunk a token (or its lead's copy) is of, else -1
    leads: frozenset[int] = frozenset()  # block reading: the rows of the copies read before each chunk


def full_reading(prompt: TokenizedPrompt, reply: Sequence[int]) -> Reading:
    ids = list(prompt.token_ids) + list(reply)
    n = len(ids)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    start = len(prompt) - 1  # the last prompt token predicts the reply's first
    return Reading(ids, list(range(n)), allowed, list(range(start, start + len(reply))))


def block_reading(
    prompt: TokenizedPrompt, reply: Sequence[int], bos_id: int | None, *, lead: Sequence[int] | None = None
) -> Reading:
    """The prompt with every chunk read alone (see the module's docstring).
    ``lead``: the tokens each chunk is read after, in place of ``[bos_id]``
    (APE's shared prefix is the prompt's own prefix)."""
    lead = list(lead) if lead is not None else ([] if bos_id is None else [bos_id])
    ids: list[int] = []
    positions: list[int] = []
    group: list[int] = []  # per row: -1 for a token that attends to everything, c for chunk c and its lead
    lead_rows: set[int] = set()
    starts = {start: c for c, (start, _) in enumerate(prompt.chunk_spans)}
    ends = {end for _, end in prompt.chunk_spans}
    current = -1
    for p, token in enumerate(prompt.token_ids):
        if p in ends:
            current = -1
        if p in starts:
            current = starts[p]
            if p < len(lead):
                raise ValueError("a chunk at the prompt's first token has no position for its BOS")
            for i, copied in enumerate(lead):
                lead_rows.add(len(ids))
                ids.append(copied)
                positions.append(p - len(lead) + i)
                group.append(current)
        ids.append(token)
        positions.append(p)
        group.append(current)
    for i, token in enumerate(reply):
        ids.append(token)
        positions.append(len(prompt) + i)
        group.append(-1)
    n = len(ids)
    groups = torch.tensor(group)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    same_chunk = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)
    is_lead = torch.zeros(n, dtype=torch.bool)
    is_lead[list(lead_rows)] = True
    fresh = groups < 0
    # a fresh token sees every earlier row but the lead copies; a chunk token its chunk and its lead; a
    # lead's token its own lead's earlier tokens (as BOS at position 0 of the stored recipe sees itself)
    allowed = causal & ((fresh[:, None] & ~is_lead[None, :]) | (same_chunk & (~is_lead[:, None] | is_lead[None, :])))
    first = n - len(reply) - 1
    return Reading(ids, positions, allowed, list(range(first, first + len(reply))), tuple(group), frozenset(lead_rows))


def batch(readings: Sequence[Reading], device: torch.device, dtype: torch.dtype) -> dict:
    """Model inputs for ``readings`` padded to one length: ``input_ids``,
    ``position_ids`` and a 4D additive ``attention_mask`` (Hugging Face takes
    a 4D mask as it is); padding rows attend to themselves only."""
    n = max(len(r.ids) for r in readings)
    ids = torch.zeros(len(readings), n, dtype=torch.long)
    positions = torch.zeros(len(readings), n, dtype=torch.long)
    allowed = torch.eye(n, dtype=torch.bool).repeat(len(readings), 1, 1)
    for i, r in enumerate(readings):
        m = len(r.ids)
        ids[i, :m] = torch.tensor(r.ids)
        positions[i, :m] = torch.tensor(r.positions)
        allowed[i, :m, :m] = r.allowed
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return {
        "input_ids": ids.to(device),
        "position_ids": positions.to(device),
        "attention_mask": mask[:, None].to(device),
    }


def reply_logprobs(model, readings: Sequence[Reading], dtype: torch.dtype) -> torch.Tensor:
    """``[sum of reply lengths, vocab]`` float32 log-probabilities of the rows
    that predict each reading's reply, in order."""
    device = next(model.parameters()).device
    # logits only at the rows compared: a prompt's other rows would hold (and keep for the backward
    # pass) a vocabulary-wide row each
    keep = sorted({row for r in readings for row in r.predicts})
    column = {row: j for j, row in enumerate(keep)}
    inputs = batch(readings, device, dtype)
    logits = model(**inputs, use_cache=False, logits_to_keep=torch.tensor(keep, device=device)).logits
    rows = [logits[i, [column[row] for row in r.predicts]] for i, r in enumerate(readings)]
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student), both log-probabilities."""
    return (teacher.exp() * (teacher - student)).sum(-1).mean()
