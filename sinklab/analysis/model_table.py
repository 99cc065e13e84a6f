"""The model table of `sinklab measure` with several models or inputs: one row per model, laid out as Table 1 of Gu et
al. (ICLR 2025): Sink_1 (eps 0.3, T = 64 by default) on each input (natural text, random tokens, one token repeated)
with the published number beside it where `sinklab/reference/paper_tables.yaml` has the model (`pretrained_models`
by hub id, natural inputs of `pretrained_base_vs_chat` too), then per input alpha_1 (the mean attention on token 1,
which is Qwen's first-token attention), the massive activation (the largest |h| of the residual stream over its
median, the largest over layers: `act/massive_ratio`) and, for models with learned sink logits (gpt-oss), the share
of heads whose sink logit takes more than eps of the attention (`sink/slot_sink_logit`).

`rows(results)` flattens the measurements (one per model x input) to records; `wide(records)` is the table; the
markdown and CSV hold the same table.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from sinklab.errors import UserError

PAPER_MISSING = None


def paper_sink1(model: str) -> dict[str, float]:
    """{input: the paper's Sink_1 (%)} of a hub id (or its name after the org: `gpt2-xl`), {} when not in the paper."""
    from sinklab.report.paper import load_paper_tables

    tables = load_paper_tables()
    name = model.strip().rstrip("/").lower()
    hit = lambda ids: any(name in (i.lower(), i.lower().split("/")[-1]) for i in ids or [])  # noqa: E731
    for row in tables.get("pretrained_models", []):
        if hit(row.get("hub")):
            return {k: float(row[k]) for k in ("natural", "random", "repeat") if k in row}
    for row in tables.get("pretrained_base_vs_chat", []):
        for column in ("base", "chat"):
            if hit(row.get(f"hub_{column}")):
                return {"natural": float(row[column])}
    return {}


def row(res: dict, paper: dict[str, float]) -> dict[str, Any]:
    """One measurement (`sinklab.analysis.measurement.measure_target`'s result) as a record."""
    slot = res.get("slot", {}).get("sink_logit")
    massive = res.get("massive") or {}
    return {"model": res["target"], "revision": res.get("revision"), "input": res["input"],
            "sink1": res["sink"]["1"], "paper_sink1": paper.get(res["input"], PAPER_MISSING),
            "alpha1": res["alpha_mean"]["1"], "first_token_attn": res["first_token_attn"]["mean"],
            "massive_ratio": max(massive["ratio"]) if massive.get("ratio") else None,
            "massive_top": max(massive["top"]) if massive.get("top") else None,
            "slot_sink_logit": slot, "seq_len": res["seq_len"], "num_seqs": res["num_seqs"],
            "dtype": res.get("dtype", "float32"), "weights_note": res.get("weights_note"),
            "seconds": res.get("seconds")}


def label(rec: dict) -> str:
    return rec["model"] + (f"@{rec['revision']}" if rec.get("revision") else "")


def wide(records: list[dict]):
    """The table (a DataFrame): one row per model, per input `Sink_1 <input>`, `paper <input>`, then `alpha_1
    <input>`, `massive <input>` and, with sink logits, `sink logit <input>` (share of heads, %); `weights` where a
    model's weights are not its own as trained (a GGUF file's quantization, `TargetMeta.weights_note`)."""
    import pandas as pd

    inputs = list(dict.fromkeys(r["input"] for r in records))
    by_model: dict[str, dict] = {}
    for r in records:
        by_model.setdefault(label(r), {"model": label(r)})[r["input"]] = r
    slots = any(r["slot_sink_logit"] is not None for r in records)
    out = []
    for name, cells in by_model.items():
        line = {"model": name}
        for i in inputs:
            line[f"Sink_1 {i}"] = cells[i]["sink1"] if i in cells else None
            line[f"paper {i}"] = cells[i]["paper_sink1"] if i in cells else None
        for key, title in (("alpha1", "alpha_1"), ("massive_ratio", "massive"),
                           *((("slot_sink_logit", "sink logit"),) if slots else ())):
            for i in inputs:
                line[f"{title} {i}"] = cells[i][key] if i in cells else None
        if any(r.get("weights_note") for r in records):
            line["weights"] = next((r["weights_note"] for r in records if label(r) == name and r.get("weights_note")),
                                   None)
        out.append(line)
    return pd.DataFrame(out)


def markdown(table) -> str:
    """The table in markdown, each Sink_1 cell with the paper's number beside it in parentheses (as `ours (paper)`;
    `-` where not measured or not in the paper)."""
    import pandas as pd

    def cell(col: str, v) -> str:
        if v is None or v != v:  # None or NaN
            return "-"
        if isinstance(v, str):
            return v
        return f"{v:.3f}" if col.startswith("alpha_1") else f"{v:.1f}" if col.startswith("massive") else f"{v:.2f}"
    out = {}
    for col in table.columns:
        if col.startswith("paper "):
            continue
        values = [cell(col, v) for v in table[col]]
        if col.startswith("Sink_1 ") and f"paper {col[7:]}" in table:
            paper = [cell(col, v) for v in table[f"paper {col[7:]}"]]
            values = [f"{a} ({b})" for a, b in zip(values, paper)]
            col += " (paper)"
        out[col] = values
    return pd.DataFrame(out).to_markdown(index=False, disable_numparse=True)


def write(table, csv_path: Optional[str], md_path: Optional[str]) -> dict[str, str]:
    """The table as CSV and/or markdown files (atomic writes); {"csv": path, "markdown": path} of those written."""
    from sinklab.io import atomic_write

    written = {}
    for kind, path, text in (("csv", csv_path, lambda: table.to_csv(index=False)),
                             ("markdown", md_path, lambda: markdown(table) + "\n")):
        if path is None:
            continue
        try:
            atomic_write(Path(path), text())
        except OSError as err:
            raise UserError(f"--{kind} {path}: cannot write it ({err.strerror or err})") from None
        written[kind] = str(path)
    return written


def format_table(res: dict) -> str:
    """`sinklab measure`'s text for the model table."""
    import pandas as pd

    recs = res["rows"]
    first = recs[0]
    lines = [f"Sink_1 (%, eps {res['eps']:g}) of {len(res['models'])} model(s) on {', '.join(res['inputs'])} input "
             f"({first['num_seqs']} sequences x {first['seq_len']} tokens); paper: Gu et al. ICLR 2025, Table 1 "
             "(T = 64)", "", markdown(wide(recs) if recs else pd.DataFrame()), "",
             "alpha_1: mean attention on token 1 (= first-token attention); massive: largest |h| / median |h| of the "
             "residual stream, max over layers" + ("; sink logit: % of heads whose learned sink logit takes > eps"
                                                   if any(r["slot_sink_logit"] is not None for r in recs) else "")]
    lines += [f"{kind}: {path}" for kind, path in res.get("written", {}).items()]
    return "\n".join(lines)
