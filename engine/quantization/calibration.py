"""Built-in calibration text, fixed-length token sequences, and captured linear inputs.

AWQ, GPTQ and SmoothQuant choose their scales from the activations a model actually
sees. The text is the English prose of Python's own reference documentation
(`pydoc_data.topics`, which ships with CPython: nothing is downloaded). Grammar rules,
code examples and headings are dropped; what remains is ~1,100 paragraphs (~60k tokens)
of technical English. The deduplicated paragraphs are split deterministically (every
`HELDOUT_EVERY`-th one held out), so the perplexity text never overlaps the calibration
text. (The text is that of the running Python's version; perplexities are
comparable within one Python version.)

API:
    calibration_text(split) -> str
    calibration_token_ids(tokenizer, num_sequences, seq_len, split="calib") -> int64 [S, L]
    capture_linear_inputs(model, sequences, names) -> {name: [S * L, K]}
    linear_input_absmax(model, sequences, names) -> {name: [K]}   (max |x| per input channel, O(K) memory)
    LayerwiseCalibration(model, sequences): runs decoder layers one at a time over all
        calibration tokens (AWQ/GPTQ quantize layer i on the inputs layers < i produce).
    quantize_layers(model, quantize_layer, on_layer) -> {name: QuantizedLinear}: the
        layer-by-layer loop of AWQ and GPTQ, with a progress callback.

`names` are module names of decoder-layer linears as `model.named_modules()` gives them
(`model.layers.3.self_attn.qkv_proj`, `model.layers.3.mlp.down_proj`, ...). The model is
run prefill-only: each sequence is one request over a private paged KV cache, so the
activations are exactly those of serving these prompts.
"""

from __future__ import annotations

import re
from typing import Callable, Literal

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.ops import get_ops

Split = Literal["calib", "heldout"]
HELDOUT_EVERY = 4  # paragraphs 3, 7, 11, ... (topics sorted by name) are held out
_BLOCK_SIZE = 16
DECODER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The linears of one decoder layer (module names inside it), in the order their inputs are produced."""
_SENTENCE_END = re.compile(r"[.!?]$")


def _prose_paragraphs(doc: str) -> list[str]:
    """Paragraphs of running text (indentation stripped): no grammar rules, interactive
    examples, code (few letters, no final full stop) or headings."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = [line.strip() for line in block.strip("\n").split("\n")]
        if any(line.startswith((">>>", "...", "|")) or "::=" in line for line in lines):
            continue
        if len(lines) > 1 and set(lines[-1]) <= set("*=-~^"):
            continue  # a heading with its underline
        text = " ".join(lines)
        letters = sum(c.isalpha() or c == " " for c in text)
        if len(text) >= 40 and _SENTENCE_END.search(text) and letters >= 0.85 * len(text):
            out.append(text)
    return out


def calibration_text(split: Split = "calib") -> str:
    """The prose of one split, paragraphs separated by blank lines."""
    if split not in ("calib", "heldout"):
        raise ValueError(f"split must be 'calib' or 'heldout', got {split!r}")
    from pydoc_data.topics import topics

    # Topics repeat sections of each other: deduplicate before splitting, or held-out
    # paragraphs would also be calibration paragraphs.
    paragraphs = list(dict.fromkeys(p for name in sorted(topics) for p in _prose_paragraphs(topics[name])))
    held = split == "heldout"
    return "\n\n".join(p for i, p in enumerate(paragraphs) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == held)


def calibration_token_ids(tokenizer, num_sequences: int, seq_len: int, split: Split = "calib") -> torch.Tensor:
    """The split's text as one token stream, cut into `num_sequences` rows of `seq_len` tokens."""
    if num_sequences < 1 or seq_len < 2:
        raise ValueError(f"need num_sequences >= 1 and seq_len >= 2, got {num_sequences}, {seq_len}")
    ids = tokenizer.encode(calibration_text(split), add_special_tokens=False)
    needed = num_sequences * seq_len
    if len(ids) < needed:
        raise ValueError(
            f"the {split!r} text has {len(ids)} tokens, fewer than {num_sequences} x {seq_len} = {needed}"
        )
    return torch.tensor(ids[:needed], dtype=torch.int64).view(num_sequences, seq_len)


class LayerwiseCalibration:
    """All calibration tokens through the decoder, one layer at a time.

    `hidden` holds the residual stream entering the next layer ([S * L, hidden_size]).
    One layer's KV cache is enough: every layer writes its K/V before reading them.
    """

    def __init__(self, model: LlamaForCausalLM, sequences: torch.Tensor) -> None:
        if sequences.dim() != 2:
            raise ValueError(f"sequences must be [num_sequences, seq_len], got {tuple(sequences.shape)}")
        self.model = model
        num_seqs, seq_len = sequences.shape
        device = model.model.embed_tokens.weight.device
        blocks_per_seq = -(-seq_len // _BLOCK_SIZE)
        table = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq)
        pos = torch.arange(seq_len)
        slots = (table.long()[:, pos // _BLOCK_SIZE] * _BLOCK_SIZE + pos % _BLOCK_SIZE).flatten()
        self.positions = pos.repeat(num_seqs).to(device)
        self.meta = AttentionMetadata(
            slot_mapping=slots.to(device),
            block_tables=table.to(device),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, (num_seqs + 1) * seq_len, seq_len, dtype=torch.int32, device=device),
            logits_indices=torch.empty(0, dtype=torch.int64, device=device),
        )
        args = model.args
        dtype = model.model.embed_tokens.weight.dtype
        shape = (num_seqs * blocks_per_seq, _BLOCK_SIZE, args.num_key_value_heads, args.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.ops = get_ops("torch" if device.type == "cpu" else "auto", device)
        with torch.no_grad():
            self.hidden = model.model.embed_tokens(sequences.to(device).flatten())

    def layer(self, index: int) -> DecoderLayer:
        return self.model.model.layers[index]

    @torch.no_grad()
    def attention(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """The attention block's output for normalised input `h` (all calibration tokens)."""
        return layer.self_attn(h, self.positions, self.model.rope, self.kv_cache, self.meta, self.ops)

    @torch.no_grad()
    def layer_forward(self, index: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `index` applied to `x` (default: the current `hidden`)."""
        layer = self.layer(index)
        x = self.hidden if x is None else x
        x = x + self.attention(layer, layer.input_layernorm(x))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def advance(self, index: int) -> None:
        """Move `hidden` through layer `index` (with its weights as they are now)."""
        self.hidden = self.layer_forward(index)

    def capture(self, index: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Inputs [S * L, K] of the named sub-modules of layer `index` (e.g. `mlp.down_proj`)."""
        out: dict[str, torch.Tensor] = {}
        layer = self.layer(index)
        _with_input_hooks({n: layer.get_submodule(n) for n in names}, lambda n, x: out.__setitem__(n, x.detach().clone()),
                          lambda: self.layer_forward(index))
        return out


def quantize_layers(
    model: LlamaForCausalLM, quantize_layer: Callable[[int], dict], on_layer: Callable[[int, int], None] | None = None
) -> dict:
    """{f"model.layers.{i}.{name}": result} of `quantize_layer(i)` ({name inside the layer:
    result}) for every decoder layer in order; `on_layer(i + 1, num_layers)` after each."""
    num_layers = model.args.num_hidden_layers
    results = {}
    for index in range(num_layers):
        results.update({f"model.layers.{index}.{name}": r for name, r in quantize_layer(index).items()})
        if on_layer is not None:
            on_layer(index + 1, num_layers)
    return results


def _with_input_hooks(modules: dict[str, nn.Module], on_input: Callable[[str, torch.Tensor], None], run: Callable[[], object]) -> None:
    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: on_input(name, args[0]))
        for name, module in modules.items()
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()


def _by_layer(model: LlamaForCausalLM, names: list[str]) -> dict[int, list[str]]:
    """{layer index: [full names]}; ValueError for a name that is not a decoder-layer module."""
    modules = dict(model.named_modules())
    grouped: dict[int, list[str]] = {}
    for name in names:
        match = re.fullmatch(r"model\.layers\.(\d+)\..+", name)
        if match is None or name not in modules:
            raise ValueError(f"{name!r} is not a module inside a decoder layer of this model")
        grouped.setdefault(int(match.group(1)), []).append(name)
    return grouped


def _run_layers(model: LlamaForCausalLM, sequences: torch.Tensor, names: list[str], on_input) -> None:
    """Run the calibration tokens through as many layers as the names need, calling
    `on_input(full_name, x)` with each named module's input."""
    grouped = _by_layer(model, names)
    calib = LayerwiseCalibration(model, sequences)
    modules = dict(model.named_modules())
    for index in range(max(grouped, default=-1) + 1):
        hooked = {name: modules[name] for name in grouped.get(index, [])}
        _with_input_hooks(hooked, on_input, lambda: calib.advance(index))


def capture_linear_inputs(model: LlamaForCausalLM, sequences: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: input activations [S * L, K]} of the float model over `sequences` [S, L]."""
    out: dict[str, torch.Tensor] = {}
    _run_layers(model, sequences, names, lambda name, x: out.__setitem__(name, x.detach().clone()))
    return out


def linear_input_absmax(model: LlamaForCausalLM, sequences: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: max |x| over all calibration tokens, per input channel [K]} (SmoothQuant's statistic)."""
    out: dict[str, torch.Tensor] = {}
    _run_layers(model, sequences, names, lambda name, x: out.__setitem__(name, x.detach().abs().amax(dim=0).float()))
    return out
