"""Tuning layer: the teacher of a tuning (``distill.py``): the untuned model's
greedy reply to each prompt and its log-probabilities, kept on disk."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from ..prompt import TokenizedPrompt

logger = logging.getLogger(__name__)


class Teacher:
    """The untuned model's greedy reply to each prompt, read with full attention and no adapters, and
    its log-probabilities at each reply token: made once per prompt and kept on disk in ``folder``
    (``reply_tokens`` x the vocabulary x 4 bytes a prompt: 4.9 MB for Qwen's vocabulary at 8, which a
    run of hundreds of prompts could not keep in memory), so a resumed run reads them back. A file is
    named by the base model's fingerprint, the reply's length and the prompt; one that does not read
    back whole and in shape is made again."""

    def __init__(self, model, tokenizer, tokens: int, folder: Path, fingerprint: str) -> None:
        self.model, self.tokens, self.folder, self.fingerprint = model, tokens, folder, fingerprint
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab = model.get_output_embeddings().weight.shape[0]

    def __call__(self, tp: TokenizedPrompt) -> tuple[list[int], torch.Tensor]:
        key = hashlib.sha256(json.dumps([self.fingerprint, self.tokens, list(tp.token_ids)]).encode()).hexdigest()
        path = self.folder / f"{key}.pt"
        if path.is_file():
            kept = self._read(path)
            if kept is not None:
                return kept
            logger.warning("the teacher's reply in %s does not read back whole: made again", path)
        reply, logprobs = self._make(tp)
        self.folder.mkdir(parents=True, exist_ok=True)
        new = path.with_suffix(".new")
        torch.save({"reply": torch.tensor(reply), "logprobs": logprobs}, new)
        new.replace(path)  # whole or absent: a stop mid-write leaves only the .new file
        return reply, logprobs

    def _read(self, path: Path) -> tuple[list[int], torch.Tensor] | None:
        try:
            kept = torch.load(path, weights_only=True)
            reply, logprobs = kept["reply"], kept["logprobs"]
        except Exception:  # any damage (truncated, not torch's, other keys) means: make it again
            return None
        rows = len(reply) if isinstance(reply, torch.Tensor) and reply.dim() == 1 else -1
        if not (
            isinstance(logprobs, torch.Tensor)
            and 1 <= rows <= self.tokens
            and logprobs.dtype == torch.float32
            and logprobs.shape == (rows, self.vocab)
            and not bool(torch.isnan(logprobs).any())
        ):
            return None
        return reply.tolist(), logprobs

    def _make(self, tp: TokenizedPrompt) -> tuple[list[int], torch.Tensor]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(tp.token_ids)], device=device)
        with torch.no_grad(), self.model.disable_adapter():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=self.pad,
            )
        reply = out.sequences[0, ids.shape[1] :].tolist()
        logits = torch.cat(out.logits)[: len(reply)]
        return reply, torch.log_softmax(logits.float(), dim=-1).cpu()
