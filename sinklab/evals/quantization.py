"""The evaluation `quant`: validation perplexity in fp32 and under simulated quantization (`sinklab.quant.fake`, which
says what is quantized and how), the command `sinklab quant` = `sinklab eval quant` (`sinklab.cli.quant`)."""
from __future__ import annotations

from sinklab.evals.registry import ANY, EVALUATIONS, NON_NEGATIVE, PERPLEXITY, Evaluation
from sinklab.quant.fake import FP32, SCHEMES

_SCHEMES = "|".join((FP32.name, *SCHEMES))


@EVALUATIONS.register("quant")
class Quantization(Evaluation):
    """In a sweep's quant.csv: for fp32 and each scheme <scheme>_loss, _ppl, _bpb (bits per byte), _gap (ppl - the
    fp32 ppl), _rel_gap (gap / the fp32 ppl); then val_targets, calib_batches and weights (per-tensor |
    per-channel)."""

    command = "sinklab.cli.quant"
    summary = "perplexity with simulated W8A8 / W4A4 / W8A16 quantization (= sinklab quant)"
    bounds = ((rf"^({_SCHEMES})_ppl$", PERPLEXITY),
              (rf"^(({_SCHEMES})_(loss|bpb)|val_targets|calib_batches)$", NON_NEGATIVE),
              (rf"^({_SCHEMES})_(gap|rel_gap)$", ANY))

    @staticmethod
    def row(result: dict) -> dict:
        row = {f"{scheme}_{k}": r.get(k) for scheme, r in result["schemes"].items()
               for k in ("loss", "ppl", "bpb", "gap", "rel_gap")}
        return {**row, **{k: result[k] for k in ("val_targets", "calib_batches", "weights")}}
