"""Small models built on this machine, with no model hub.

A byte-level BPE tokenizer trained on generated English-like text, and a
randomly initialised decoder of the Llama, Mistral, Qwen2 or Qwen3 family,
saved with ``save_pretrained`` so engines load them through exactly the path
a user's checkpoint takes. Everything is deterministic from the seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the a an of to in and is was for on with as by at from that this it its are be has had have not "
    "but or which were their they he she his her we our you your one two three four five six seven "
    "eight nine ten first second new old city river company founded born year years people time world "
    "report museum bridge library garden school market village harbor mountain island valley forest "
    "engineer doctor teacher writer painter farmer sailor merchant scientist mayor captain student "
    "built opened closed moved wrote painted taught studied traded sailed measured designed named "
    "north south east west early late large small quiet busy ancient modern famous local public "
    "question answer document chapter record letter map book story history science music art law "
    "water stone iron glass wood salt silver copper wheat cotton coffee tea paper ink light "
    "because while after before during between under over near across along around through "
    "january february march april may june july august september october november december "
    "red blue green yellow white black golden gray purple orange"
).split()

# Roles as special tokens; with tools, a system turn lists their schemas and
# teaches the Hermes call format (<tool_call>{json}</tool_call>), which
# assistant turns with tool calls are rendered in.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set turns = messages %}"
    "{% if tools %}<|system|>\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% set turns = messages[1:] %}{% endif %}"
    "You may call these tools, given as JSON schemas:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nTo call one, reply with <tool_call>{\"name\": <tool name>, \"arguments\": <JSON object>}</tool_call>.</s>\n"
    "{% endif %}"
    "{% for m in turns %}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

ARCHS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def sample_text(n_sentences: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"])
        if rng.random() < 0.2:
            sentence += f" In {rng.randint(1200, 2025)} it had {rng.randint(2, 900)} rooms."
        out.append(sentence)
    return out


def train_tokenizer(path: str | Path, *, vocab_size: int = 2048, seed: int = 0, texts: list[str] | None = None):
    """Train a byte-level BPE tokenizer on ``texts`` (default: generated text from
    ``seed``) and save it to ``path``, with the chat roles as special tokens and
    CHAT_TEMPLATE. The tokenizer adds BOS in front of text, like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else sample_text(4000, seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=special[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_model(
    path: str | Path,
    *,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    rope_scaling: dict | None = None,
    vocab_size: int = 2048,
    seed: int = 0,
    tokenizer_seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Save a randomly initialised model and its tokenizer to ``path``.
    ``seed`` drives the weights, ``tokenizer_seed`` the tokenizer's training text."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(path, vocab_size=vocab_size, seed=tokenizer_seed)
    config = getattr(transformers, ARCHS[arch])(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    if arch == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Default init (std 0.02) gives near-uniform next-token distributions; a
    # larger std makes greedy decoding decisive, so token-equality tests mean something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def cached_model_dir(*, num_layers: int = 16, hidden_size: int = 512, num_heads: int = 8, num_kv_heads: int = 2) -> Path:
    """A Llama-style model of realistic depth and small width, random weights,
    built once under ``~/.cache/blend_integrations/models``. For benchmarks
    and the demo: speed depends on the architecture, not the weights."""
    root = Path.home() / ".cache" / "blend_integrations" / "models"
    path = root / f"llama-L{num_layers}-H{hidden_size}-h{num_heads}-kv{num_kv_heads}"
    if not (path / "config.json").exists():
        build_model(path, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, max_position_embeddings=8192)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a small local model (no hub).")
    parser.add_argument("path")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_model(
        args.path, arch=args.arch, num_layers=args.layers, hidden_size=args.hidden,
        num_heads=args.heads, num_kv_heads=args.kv_heads, seed=args.seed,
    )
    print(json.dumps({"path": str(path)}))


if __name__ == "__main__":
    main()
