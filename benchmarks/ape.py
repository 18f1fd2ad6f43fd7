"""APE's training-free recipe (arXiv 2502.05431), the comparison for tuning.

Adaptive Parallel Encoding reads each retrieved context alone, as reuse does,
and then corrects the reading without training:

- **shared prefix:** every context is encoded after the same prefix (here the
  prompt's own prefix, the tokens before the first chunk, in place of the
  stored recipe's lone BOS), so every context has the same attention sink;
- **attention temperature** ``T``: the logits of the tokens computed fresh
  (separators, question, reply) at the contexts' keys are divided by ``T``;
- **scaling factor** ``S``: the attention weights at the contexts' keys are
  multiplied by ``S`` before they are normalised (``log S`` added to those
  logits).

It runs as one Hugging Face forward of ``tune.readings.block_reading`` with
the prefix as each chunk's lead and an attention function that applies ``T``
and ``S`` (``APE_ATTENTION``): a reading of the transformers model, not the
engine, greedy, the whole reading again for each new token. With the lone BOS
as lead and ``T = S = 1`` it is the engines' reuse (r=0). Its time to first
token is reuse's: nothing is recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv

from blend_integrations.prompt import TokenizedPrompt, bos_id_added
from blend_integrations.tune.readings import Reading, batch, block_reading, full_reading

APE_ATTENTION = "blend_ape"


@dataclass(frozen=True)
class Setting:
    temperature: float = 1.0
    scale: float = 1.0
    shared_prefix: bool = True

    @property
    def label(self) -> str:
        lead = "shared prefix" if self.shared_prefix else "BOS"
        return f"APE ({lead}, T={self.temperature:g}, S={self.scale:g})"


class _Adjust:
    """What the attention function multiplies the logits by and adds to them,
    ``[1, 1, L, L]``, for the reading being run (one at a time)."""

    multiply: torch.Tensor | None = None
    add: torch.Tensor | None = None


_ADJUST = _Adjust()


def _ape_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if _ADJUST.multiply is not None:
        scores = scores * _ADJUST.multiply + _ADJUST.add
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(APE_ATTENTION, _ape_attention)


def _prefix(prompt: TokenizedPrompt) -> list[int]:
    first = min(start for start, _ in prompt.chunk_spans)
    return list(prompt.token_ids[:first])


class APEReader:
    """Greedy replies of a Hugging Face causal LM read with APE's recipe."""

    def __init__(self, model, tokenizer) -> None:
        model.set_attn_implementation(APE_ATTENTION)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.bos = bos_id_added(tokenizer)
        eos = model.generation_config.eos_token_id  # where the engines stop: the generation config's EOS too
        self.stop = {t for t in [*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id] if t is not None}

    def _reading(self, prompt: TokenizedPrompt, reply: Sequence[int], setting: Setting | None) -> Reading:
        if setting is None:
            return full_reading(prompt, reply)
        return block_reading(prompt, reply, self.bos, lead=_prefix(prompt) if setting.shared_prefix else None)

    def _adjust(self, context: torch.Tensor, setting: Setting | None) -> None:
        """Set what the attention function applies: ``context`` [queries, keys] marks a fresh row's
        logits at a context's key (the rows that see across chunks)."""
        _ADJUST.multiply = _ADJUST.add = None
        if setting is not None:
            dtype = self.model.dtype
            _ADJUST.multiply = torch.where(context, 1.0 / setting.temperature, 1.0)[None, None].to(dtype)
            _ADJUST.add = torch.where(context, math.log(setting.scale), 0.0)[None, None].to(dtype)

    def generate(self, prompt: TokenizedPrompt, max_tokens: int, setting: Setting | None) -> tuple[list[int], str]:
        """The greedy reply's tokens (with the stop token, as the engines give them) and text; ``setting``
        None: full attention, the model's own prefill.
        The prompt is one forward; each reply token then attends to every row but the leads' copies."""
        from transformers import DynamicCache

        reading = self._reading(prompt, [], setting)
        n = len(reading.ids)
        groups = torch.tensor(reading.groups) if reading.groups else torch.full((n,), -1)
        is_lead = torch.zeros(n, dtype=torch.bool)
        is_lead[sorted(reading.leads)] = True
        chunk = (groups >= 0) & ~is_lead  # the contexts' own tokens
        cache = DynamicCache()
        reply: list[int] = []
        try:
            with torch.no_grad():
                self._adjust((groups[:, None] < 0) & chunk[None, :], setting)
                inputs = batch([reading], self.model.device, self.model.dtype)
                logits = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                while True:
                    reply.append(token := int(logits[0, -1].argmax()))  # the stop token too, as the engines do
                    if token in self.stop or len(reply) == max_tokens:
                        break
                    visible = torch.cat([~is_lead, torch.ones(len(reply), dtype=torch.bool)])
                    mask = torch.zeros(1, 1, 1, len(visible), dtype=self.model.dtype)
                    mask = mask.masked_fill(~visible, torch.finfo(self.model.dtype).min).to(self.model.device)
                    self._adjust(torch.cat([chunk, torch.zeros(len(reply), dtype=torch.bool)])[None, :], setting)
                    logits = self.model(
                        input_ids=torch.tensor([[token]], device=self.model.device),
                        position_ids=torch.tensor([[len(prompt) + len(reply) - 1]], device=self.model.device),
                        attention_mask=mask,
                        past_key_values=cache,
                        use_cache=True,
                    ).logits
        finally:
            _ADJUST.multiply = _ADJUST.add = None
        return reply, self.tokenizer.decode(reply, skip_special_tokens=True)


# the engines' reuse (a check: it should agree as reuse does), then shared prefix with T and S
GRID = [Setting(shared_prefix=False), *(Setting(t, s) for t in (1.0, 0.85, 0.7) for s in (1.0, 0.8))]


def choose(reader: APEReader, prompts: Sequence[TokenizedPrompt], tokens: int) -> tuple[Setting, dict[str, float]]:
    """APE's hyperparameters as its authors set them, on a validation set: the
    setting of ``GRID`` whose first ``tokens`` greedy tokens agree with full
    attention's on most of ``prompts``; (that setting, agreement of each)."""
    reference = [reader.generate(p, tokens, None)[0] for p in prompts]
    agreement = {}
    for setting in GRID:
        same = [reader.generate(p, tokens, setting)[0] == ref for p, ref in zip(prompts, reference)]
        agreement[setting.label] = sum(same) / len(same)
    best = max(GRID, key=lambda s: agreement[s.label])
    return best, agreement
