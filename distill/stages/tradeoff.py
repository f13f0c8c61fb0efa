"""The run's cost as people quote it: the trade-off line (the share of the teacher's nDCG@10 kept, at what speed
and size, and the served form to use) and the cost table of the report, the card and the log.

The figures are measured by the cost stage (stages/cost.py) and the forms stage (stages/forms.py); this module
only says them, from results.json's `efficiency` block.
"""

from __future__ import annotations

from typing import Any

from distill.metrics import INDEX_PRECISIONS
from distill.stages.cost import same_load

QUALITY_LINE = 0.99  # a served form keeps at least this share of the PyTorch student's nDCG@10, or is not recommended


def recommended(forms: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest form that keeps QUALITY_LINE of the student's nDCG@10 and is faster than PyTorch; None if none."""
    kept = [f for f in forms if f.get("share") is not None and f["share"] >= QUALITY_LINE and f["speedup"] > 1]
    return max(kept, key=lambda f: f["texts_per_second"]) if kept else None


def trade_off_line(results: dict) -> str | None:
    """One sentence a user can quote: the share of the teacher's nDCG@10 kept, and at what cost. None if unknown."""
    efficiency = results.get("efficiency") or {}
    ratios = efficiency.get("ratios")
    teacher = (results.get("teacher") or {}).get("ndcg@10")
    student = (results.get("student_after") or {}).get("ndcg@10")
    if not teacher or student is None or not (ratios or efficiency.get("teacher_note")):
        return None
    kept = f"The student keeps {100 * student / teacher:.1f}% of the teacher's nDCG@10"
    if not ratios:
        return f"{kept}; {efficiency['teacher_note']}."
    if "parameters" not in ratios:  # a served teacher: its speed through its endpoint, from this machine
        return (
            f"{kept} at {ratios['throughput']:.1f}x the throughput of the teacher's endpoint as this machine reaches "
            f"it ({efficiency['teacher_note']}), on {efficiency['device']}."
        )
    model2vec = (
        f" ({ratios['throughput_model2vec']:.1f}x through model2vec)" if "throughput_model2vec" in ratios else ""
    )
    line = (
        f"{kept} at {ratios['throughput']:.1f}x its throughput{model2vec} and {ratios['parameters']:.2f}x its "
        f"parameters, on {efficiency['device']}."
    )
    line += forms_sentence(efficiency)
    rates = [efficiency[side].get("machine_gflops") for side in ("teacher", "student")]
    if not same_load(*rates):
        line += (
            f" The two were timed under different loads (the CPU's matmul at {rates[0]} and {rates[1]} GFLOP/s), "
            "so the speed ratio is off: time both on an idle machine."
        )
    return line


def forms_sentence(efficiency: dict) -> str:
    """The fastest served form that keeps 99% of the student's nDCG@10, and any form below that line ("" if none)."""
    forms = efficiency.get("forms") or []
    best = recommended(forms)
    said = ""
    if best is not None:
        said = (
            f" Served as {best['name']} (`{best['file']}`) it runs at {best['speedup']:.2f}x the PyTorch student's "
            f"throughput and keeps {100 * best['share']:.1f}% of its nDCG@10."
        )
    below = [f for f in forms if f.get("share") is not None and f["share"] < QUALITY_LINE]
    for form in below:
        said += f" {form['name']} keeps {100 * form['share']:.1f}% of its nDCG@10, below 99%: not recommended."
    return said


def cost_table(results: dict) -> str:
    """A Markdown table: teacher, student and each Matryoshka width, with quality and cost side by side."""
    efficiency = results.get("efficiency") or {}
    if not efficiency:
        return ""
    header = "| model | dim | nDCG@10 | texts/s | one query (ms) | parameters | weights (MB) |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    for row, label in (("teacher", "teacher"), ("student", "student"), ("student_model2vec", "student, model2vec")):
        cost = efficiency.get(row)
        if not cost:
            continue
        ndcg = (results.get("teacher" if row == "teacher" else "student_after") or {}).get("ndcg@10")
        lines.append(
            f"| {label} | {cost['dim']} | {_score(ndcg)} | {cost['texts_per_second']:,.1f} | {cost['latency_ms']:.1f} "
            f"| {cost['parameters'] / 1e6:.1f}M | {cost['weights_bytes'] / 1e6:.1f} |"
        )
    for form in efficiency.get("forms") or []:
        lines.append(
            f"| student, {form['name']} (`{form['file']}`) | {efficiency['student']['dim']} | {_score(form['ndcg'])} "
            f"| {form['texts_per_second']:,.1f} | {form['latency_ms']:.1f} | same | {form['file_bytes'] / 1e6:.1f} |"
        )
    student = efficiency["student"]
    widths = (results.get("student_after") or {}).get("matryoshka_ndcg@10") or {}
    for dim, value in sorted(((int(d), v) for d, v in widths.items()), reverse=True):
        if dim != student["dim"]:
            lines.append(f"| student, first {dim} dims | {dim} | {_score(value)} | same | same | same | same |")
    lines += [
        "",
        f"Measured on {efficiency['device']} in {efficiency.get('dtype', 'float32')}: `encode` at batch "
        f"{efficiency['batch_size']} over {efficiency['texts']} passages (the evaluation set's, else training "
        f"texts) after a warm-up; one query: the median of "
        f"{efficiency['latency_repeats']} single-query calls. A truncated width costs the same to encode and "
        "stores fewer bytes per vector.",
    ]
    if efficiency.get("forms"):
        lines.append(
            "An ONNX form runs with ONNX Runtime and the folder's tokenizer (`distill.runtime`), timed alike; its "
            "nDCG@10 is scored on the whole evaluation set, and its size is its `.onnx` file's."
        )
    after = results.get("student_after") or {}
    index = after.get("index_ndcg@10")
    if index and "ndcg@10" in after:
        per_dim = {"float32": 4, **{name: share for name, (_, share) in INDEX_PRECISIONS.items()}}
        rows = {"float32": after["ndcg@10"], **index}
        lines += ["", "| vectors stored as | bytes per text | nDCG@10 |", "|---|---:|---:|"]
        lines += [f"| {name} | {per_dim[name] * student['dim']:g} | {v:.4f} |" for name, v in rows.items()]
        lines += [
            "",
            "int8: both sides quantized with the corpus's per-dimension ranges and searched by their dot product; "
            "binary: searched by Hamming distance; each index's top 40 rescored with the float query "
            "(sentence-transformers' `quantize_embeddings`).",
        ]
    return "\n".join(lines)


def _score(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"
