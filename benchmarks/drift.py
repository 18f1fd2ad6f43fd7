"""How far a chunk's stored KV is from the KV it would have in the prompt: the
premise of blending, measured on a model.

Blending reuses each chunk's KV computed alone and recomputes the tokens whose
KV deviates most. That works when the deviation is small for most tokens and
concentrated in a few. This bench measures both, per layer, on RAG prompts of
the quality bench's kind (generated documents, the model's prompt layout) at several
document lengths:

- drift: the relative L2 distance ``|v_prompt - v_alone| / |v_prompt|`` of the
  values (V has no rotary embedding, so positions do not enter), averaged over
  a chunk's tokens after its first four, and over the first four alone;
- concentration: the share of the squared deviation, at the middle layer, that
  the 15% most deviating chunk tokens carry (0.15 when it is spread evenly; the
  recompute set can repair only what it holds);

for the standalone recipe as stored (``[BOS] + chunk`` when the tokenizer adds a
BOS, else the chunk alone) and, for comparison, where the model has a chat
template whose first token is not the BOS, with that token in front as a fixed
attention sink.

    python -m benchmarks drift [--model reader|smollm2|gemma3-270m|DIR] [--questions 8] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blend_integrations.prompt import bos_id_added
from training.data import make_examples

from . import write_results
from .quality import DEVELOPMENT_SEED, model_and_task, results_name

LENGTHS = ((20, 40), (80, 120), (230, 270), (450, 550))  # words per document, as the quality bench draws them
HEAD = 4  # a chunk's first tokens: where its own attention sink sits when nothing comes before it
TOP_SHARE = 0.15


@torch.no_grad()
def layer_values(model, ids: list[int]) -> list[torch.Tensor]:
    """The values of every layer for ``ids`` computed from position 0: [layer] -> (kv_heads, tokens, head_dim)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [layer.values[0].float() for layer in cache.layers]


def drift(in_prompt: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
    """Per token, the relative distance of ``alone`` from ``in_prompt`` (both (heads, tokens, dim)), mean over heads."""
    return ((in_prompt - alone).norm(dim=-1) / in_prompt.norm(dim=-1).clamp(min=1e-6)).mean(dim=0)


def chunk_drift(
    model, prompt_ids: list[int], spans, prefix: list[int], full: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Per layer, per chunk token (all chunks in a row): the drift of each chunk
    computed as ``prefix + chunk`` from its values in the whole prompt."""
    full = full if full is not None else layer_values(model, prompt_ids)
    per_chunk = []
    for start, end in spans:
        alone = layer_values(model, prefix + prompt_ids[start:end])
        per_chunk.append(
            [drift(full[layer][:, start:end], alone[layer][:, len(prefix) :]) for layer in range(len(full))]
        )
    return [torch.cat([chunk[layer] for chunk in per_chunk]) for layer in range(len(full))]


def recipes(tokenizer) -> dict[str, list[int]]:
    """name -> the tokens put before a chunk when it is computed alone (and dropped after)."""
    bos = bos_id_added(tokenizer)
    stored = [bos] if bos is not None else []
    out = {"as stored (BOS)" if stored else "as stored (no BOS)": stored}
    if not getattr(tokenizer, "chat_template", None):
        return out  # a base model's prompt is plain text: the stored recipe is the only one
    template = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)
    template = template["input_ids"] if hasattr(template, "keys") else template
    if template and template[0] not in stored:
        out[f"+ {tokenizer.convert_ids_to_tokens(template[0])} sink"] = [template[0]]
    return out


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_dir, task, label = model_and_task(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    layers = sorted({1, num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers - 1})
    named = recipes(tokenizer)
    rows, started = [], time.time()
    for lengths in args.lengths:
        examples = make_examples(args.questions, seed=DEVELOPMENT_SEED + 1, n_docs=(6, 6), doc_tokens=lengths)
        per_recipe = {name: [] for name in named}  # name -> per question, per layer drift of all chunk tokens
        tokens = []
        for example in examples:
            tp = task.prompt(example, tokenizer)
            full = layer_values(model, tp.token_ids)
            head = torch.cat([torch.arange(e - s) < HEAD for s, e in tp.chunk_spans])
            tokens.append(statistics.fmean(e - s for s, e in tp.chunk_spans))
            for name, prefix in named.items():
                per_recipe[name].append((head, chunk_drift(model, tp.token_ids, tp.chunk_spans, prefix, full)))
        for name, results in per_recipe.items():
            row = {"doc_words": list(lengths), "chunk_tokens": round(statistics.fmean(tokens)), "recipe": name}
            for layer in layers:
                row[f"body_L{layer}"] = round(statistics.fmean(float(d[layer][~h].mean()) for h, d in results), 4)
            row["head_mid"] = round(statistics.fmean(float(d[num_layers // 2][h].mean()) for h, d in results), 4)
            shares = []
            for _, d in results:
                sq = d[num_layers // 2].pow(2).sort(descending=True).values
                shares.append(float(sq[: max(1, round(TOP_SHARE * len(sq)))].sum() / sq.sum().clamp(min=1e-12)))
            row["top15_share_mid"] = round(statistics.fmean(shares), 4)
            rows.append(row)
            print(row, flush=True)
    config = {
        "model": label,
        "layers": num_layers,
        "layers_shown": layers,
        "questions_per_length": args.questions,
        "documents": 6,
        "system_prompt": task.system,
        "prompt": "the chat template" if getattr(tokenizer, "chat_template", None) else "plain text (no chat template)",
        "seed": DEVELOPMENT_SEED + 1,
        "minutes": round((time.time() - started) / 60, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"config": config, "rows": rows}


def markdown(report: dict) -> str:
    c = report["config"]
    layers = c["layers_shown"]
    lines = [
        f"Model {c['model']} ({c['layers']} layers); {c['questions_per_length']} held-out questions per length, "
        f"{c['documents']} generated documents each, {c.get('prompt', 'the chat template')} with the quality bench's "
        "system prompt; "
        f"{c['date']}.",
        "",
        "Drift: the relative distance of a chunk's values computed alone from its values in the prompt, "
        f"averaged over tokens after a chunk's first {HEAD} (body) and over the first {HEAD} (head, middle layer). "
        f"Top 15%: the share of the squared deviation at the middle layer that the 15% most deviating "
        "tokens carry (0.15 if spread evenly).",
        "",
        "| words per document | tokens per chunk | recipe | "
        + " | ".join(f"body L{layer}" for layer in layers)
        + " | head, middle layer | top 15% share |",
        "|---:|---:|---|" + "---:|" * (len(layers) + 2),
    ]
    for r in report["rows"]:
        cells = [f"{r[f'body_L{layer}']:.3f}" for layer in layers] + [
            f"{r['head_mid']:.3f}",
            f"{r['top15_share_mid']:.3f}",
        ]
        lines.append(
            f"| {r['doc_words'][0]}-{r['doc_words'][1]} | {r['chunk_tokens']} | {r['recipe'].replace('|', chr(92) + '|')} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks drift", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help="reader, smollm2 (the default), gemma3-270m or a checkpoint directory"
    )
    parser.add_argument("--questions", type=int, default=8, help="questions per document length")
    parser.add_argument("--quick", action="store_true", help="2 questions, the two shortest lengths, nothing written")
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    args = parser.parse_args(argv)
    args.lengths = LENGTHS[:2] if args.quick else LENGTHS
    if args.quick:
        args.questions = 2
    report = run(args)
    text = markdown(report)
    print(text)
    if not args.quick and args.out:
        name = results_name(args.model)
        suffix = "" if name == "reader" else "-" + name
        write_results(
            args.out,
            "drift" + suffix,
            "How far stored chunk KV is from in-prompt KV",
            text,
            report,
            command=f"`python -m benchmarks drift --model {args.model}`.",
        )
