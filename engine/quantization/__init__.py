"""Weight quantization, in layers (each module imports only from the layers below it):

    affine          the affine (scale + zero point) math, INT4 packing
    linears         the runtime modules that serve quantized linears (Int8Linear, Int4Linear,
                    W8A8Linear, PermutedInputLinear) and their builders
    weights         one quantized linear in layout-free form (QuantizedLinear) -> its runtime module
    checkpoint      the AutoAWQ / AutoGPTQ / Pagoda INT8 checkpoint layouts <-> QuantizedLinear
    rtn             load-time round to nearest: `convert_model(model, method)`, the dispatch of
                    `--quantization` (METHODS below)
    calibration     calibration text, captured activations, layer-by-layer calibration runs
    w8a8            SmoothQuant (calibrated W8A8)
    awq, gptq       AWQ and GPTQ, layer by layer

`pagoda quantize`, which drives them to write a quantized folder, is engine/quantize.py."""

METHODS = ("int8", "int4", "w8a8")
"""`--quantization` values: RTN weight-only INT8 (per-channel) / INT4 (group 128); W8A8
(int8 per-channel weights, int8 per-token dynamic activations, no calibration: `w8a8`)."""

LM_HEAD_QUANTIZATIONS = ("auto", "int8", "none")
"""`--lm-head-quantization` values: the LM head under `--quantization` INT8 weight-only, in
the compute dtype, or chosen per method and device (`rtn.lm_head_int8`)."""
