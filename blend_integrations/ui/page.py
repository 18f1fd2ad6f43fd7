"""The demo page, built with Gradio (docs/ui.md says why): pick and order
documents, ask, and watch blending and full prefill answer side by side,
with what blending recomputed highlighted in the prompt."""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home: set before Gradio is imported

import gradio as gr
import pandas as pd

from .session import RECOMPUTED, REUSED, AskError, DemoSession, highlighted, summary, verdict

COLORS = {RECOMPUTED: "#f97316", REUSED: "#dbeafe"}
EXPLAINED = (
    "Each document's KV comes from the chunk store, computed when the document was read alone. "
    f"Blending recomputes the tokens whose KV deviates most (**{RECOMPUTED}**, orange) and uses the rest "
    f"as stored (**{REUSED}**, blue); unmarked tokens were computed fresh (each document's first tokens, "
    "and documents the store did not hold yet: ask again and they are hits)."
)


def _table(stats: dict[str, object]) -> str:
    # a fallback's reason is free text: a "|" or a line break in it would end its cell
    cells = {name: str(value).replace("|", "\\|").replace("\n", " ") for name, value in stats.items()}
    rows = "\n".join(f"| {name} | {value} |" for name, value in cells.items())
    return f"| | |\n|---|---:|\n{rows}"


def _ttft_plot(history: list[dict]) -> gr.ScatterPlot:
    """The session's TTFTs by question. Questions are categories "1", "2", ...
    in asking order: on a numeric axis Vega-Lite ticks one question as
    "1.000000" and several at fractions of a question."""
    data = pd.DataFrame(history, columns=["question", "answer", "ttft_ms"]).astype({"question": str})
    numbers = sorted({h["question"] for h in history})
    return gr.ScatterPlot(value=data, sort=[str(n) for n in numbers])


def _reordered(order: list[str], picked: list[str]) -> list[str]:
    """The chosen documents in their order: those still picked keep their places, new picks go last."""
    return [name for name in order if name in picked] + [name for name in picked if name not in order]


def serve(page: gr.Blocks, session: DemoSession, host: str, port: int, **launch) -> None:
    """Serve ``page`` with ``GET /health`` beside it (200 once the model is
    loaded, 503 while it loads or if it failed: the status says which), and
    return at once; ``page.block_thread()`` waits."""
    from fastapi.responses import JSONResponse

    app, _, _ = page.queue().launch(server_name=host, server_port=port, prevent_thread_lock=True, **launch)

    def health() -> JSONResponse:
        ready = session.engine is not None
        return JSONResponse({"ready": ready, "status": session.status()}, status_code=200 if ready else 503)

    app.add_api_route("/health", health, methods=["GET"])
    app.router.routes.insert(0, app.router.routes.pop())  # before Gradio's own routes


def build_page(session: DemoSession, documents: dict[str, str]) -> gr.Blocks:
    names = list(documents)
    with gr.Blocks(title="CacheBlend: blend against full prefill") as page:
        gr.Markdown("# CacheBlend, side by side\nReused chunk KV with a few tokens recomputed, against full prefill.")
        status = gr.Markdown(session.status(), elem_id="status")
        known = gr.State(dict(documents))
        with gr.Row():
            with gr.Column(scale=1):
                picked = gr.CheckboxGroup(names, label="Documents", elem_id="documents")
                order = gr.Dropdown(
                    names, value=[], multiselect=True, label="Order in the prompt", elem_id="order", interactive=True
                )
                with gr.Row():
                    reverse = gr.Button("Reverse order", size="sm")
                    rotate = gr.Button("Move last to first", size="sm")
                pasted = gr.Textbox(lines=3, label="Paste a document", elem_id="pasted")
                add = gr.Button("Add pasted document", size="sm")
            with gr.Column(scale=2):
                question = gr.Textbox(label="Question", elem_id="question")
                with gr.Row():
                    ratio_mode = gr.Radio(
                        ["fixed", "auto"],
                        value="fixed",
                        label="Recompute ratio",
                        info='"auto": the calibrated policy (full prefill where blending cannot hold quality)',
                        scale=1,
                        elem_id="ratio-mode",
                    )
                    ratio = gr.Slider(
                        0.0, 1.0, value=0.15, step=0.05, label="fixed ratio", scale=2, elem_id="fixed-ratio"
                    )
                ask = gr.Button("Ask", variant="primary", elem_id="ask")
                message = gr.Markdown("", elem_id="message")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("### With blending")
                        blend_text = gr.Textbox(label="answer", lines=3, elem_id="blend-answer")
                        blend_stats = gr.Markdown(elem_id="blend-stats")
                    with gr.Column():
                        gr.Markdown("### Full prefill")
                        full_text = gr.Textbox(label="answer", lines=3, elem_id="full-answer")
                        full_stats = gr.Markdown(elem_id="full-stats")
        gr.Markdown(f"### What blending recomputed\n{EXPLAINED}")
        marks = gr.HighlightedText(color_map=COLORS, show_legend=True, label="the prompt's documents", elem_id="marks")
        plot = gr.ScatterPlot(
            x="question",
            y="ttft_ms",
            color="answer",
            title="Time to first token per question",
            x_title="question",
            y_title="TTFT (ms)",
            elem_id="ttft-plot",
        )

        picked.change(lambda p, o: gr.update(value=_reordered(o, p)), [picked, order], order)
        # the ticks follow what the user puts in or takes out of the order box: Ask reads the ticks
        order.input(lambda o: gr.update(value=o), order, picked)
        reverse.click(lambda o: o[::-1], order, order)
        rotate.click(lambda o: o[-1:] + o[:-1], order, order)

        def add_pasted(text: str, known: dict[str, str], p: list[str], o: list[str]):
            text = text.strip()
            if not text:
                return known, gr.update(), gr.update(), "", "Paste a document's text first."
            name = f"pasted {sum(n.startswith('pasted ') for n in known) + 1}"
            known = {**known, name: text}
            names = list(known)
            added = f"Added **{name}**."
            return (
                known,
                gr.update(choices=names, value=p + [name]),
                gr.update(choices=names, value=o + [name]),
                "",
                added,
            )

        add.click(add_pasted, [pasted, known, picked, order], [known, picked, order, pasted, message])

        def answer(p: list[str], o: list[str], known: dict[str, str], question: str, mode: str, value: float):
            # the ticks themselves, not only the order box: a click right after a tick may come before
            # the tick's update of the order box has returned
            chosen = [known[n] for n in _reordered(o, p) if n in known]
            blank = {blend_stats: "", full_stats: "", marks: None}
            try:
                answered = None
                for answered in session.ask(chosen, question, "auto" if mode == "auto" else float(value)):
                    yield {blend_text: answered.blend, full_text: answered.full, message: "", **blank}
            except AskError as exc:
                yield {message: f"**Cannot ask:** {exc}", **blank}
                return
            except Exception as exc:  # the page stays up; the question failed
                yield {message: f"**The engine failed on this question:** {type(exc).__name__}: {exc}", **blank}
                return
            assert answered is not None and session.engine is not None
            blend, full = answered.generations["blend"], answered.generations["full"]
            yield {
                blend_stats: _table(summary(blend)),
                full_stats: _table(summary(full)),
                marks: highlighted(session.engine, blend, answered.prompt),
                plot: _ttft_plot(session.history),
                message: verdict(blend, full),
            }

        # one question at a time on the one engine: a second tab's waits in Gradio's queue
        ask.click(
            answer,
            [picked, order, known, question, ratio_mode, ratio],
            [blend_text, full_text, blend_stats, full_stats, marks, plot, message],
            concurrency_limit=1,
            concurrency_id="engine",
        )
        timer = gr.Timer(1.0)
        timer.tick(lambda: (session.status(), gr.Timer(active=not session.wait(0))), None, [status, timer])
    return page
