"""The reader's model card: the README.md a finished training run writes
beside its weights, from the run's summary (``training.train``)."""

from __future__ import annotations


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

Greedy exact match under teacher forcing on {summary.get("held_out", 64)} held-out examples (every answer
token and the end must be the argmax): 1-hop {acc.get("acc_1hop", 0):.2f}, 2-hop {acc.get("acc_2hop", 0):.2f}.
The quality benchmark (`python -m benchmarks quality`, results in
`docs/results/quality.md`) measures generated answers on 300 other held-out
questions, for full prefill and every blend mode.
"""
