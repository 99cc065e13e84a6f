"""Simulated post-training quantization: fake-quantized linear layers (`sinklab.quant.fake`); the `sinklab quant`
command is `sinklab.cli.quant`."""
from sinklab.quant.fake import (FP32, SCHEMES, Scheme, asymmetric_grid, calibrate, evaluate, fake_quantized,
                                quantizable_layers, quantize_asymmetric, quantize_symmetric)

__all__ = ["FP32", "SCHEMES", "Scheme", "asymmetric_grid", "calibrate", "evaluate", "fake_quantized",
           "quantizable_layers", "quantize_asymmetric", "quantize_symmetric"]
