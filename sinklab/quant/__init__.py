"""Simulated post-training quantization: fake-quantized linear layers (`sinklab.quant.fake`) and the
`sinklab quant` command (`sinklab.quant.cli`)."""
from sinklab.quant.fake import (FP32, SCHEMES, Scheme, asymmetric_grid, calibrate, evaluate, fake_quantized,
                                mean_nll, quantizable_layers, quantize_asymmetric, quantize_symmetric)

__all__ = ["FP32", "SCHEMES", "Scheme", "asymmetric_grid", "calibrate", "evaluate", "fake_quantized", "mean_nll",
           "quantizable_layers", "quantize_asymmetric", "quantize_symmetric"]
