"""Weight quantization: the affine math (`affine`), load-time RTN (`rtn`), SmoothQuant W8A8
(`w8a8`), calibration text and activations (`calibration`), AWQ (`awq`), GPTQ (`gptq`), one
quantized linear in layout-free form (`weights`), the AutoAWQ / AutoGPTQ / Pagoda checkpoint
layouts (`checkpoint`), and `pagoda quantize` (`quantize`)."""

METHODS = ("int8", "int4", "w8a8")
"""`--quantization` values: RTN weight-only INT8 (per-channel) / INT4 (group 128); W8A8
(int8 per-channel weights, int8 per-token dynamic activations, no calibration: `w8a8`)."""
