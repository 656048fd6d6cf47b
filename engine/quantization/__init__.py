"""Weight quantization: the affine math (`affine`) and load-time RTN conversion (`rtn`)."""

METHODS = ("int8", "int4")
"""`--quantization` values: RTN weight-only INT8 (per-channel) / INT4 (group 128)."""
