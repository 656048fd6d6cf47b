"""A model from its config alone (`--load-format dummy`, as vLLM's): random weights, made on the device.

For benchmarks of a model's shape without its checkpoint (Llama-3-8B built straight on an
H200 in seconds, no download, no disk) and for tests. The folder needs only config.json
and a tokenizer; `write_dummy_model_folder` writes both, the tokenizer a word-level one
("w0".."w{vocab-1}", one token per word), so token-id prompts decode to something.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

INIT_STD = 0.02
"""Standard deviation of every matrix (transformers' default `initializer_range`)."""


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Matrices ~ N(0, INIT_STD^2), norm weights 1, biases 0; drawn on the model's device."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed)
        seed += 1
        if param.dim() >= 2:
            param.normal_(0.0, INIT_STD, generator=gen)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()


def write_dummy_model_folder(path: Path, hf_config) -> Path:
    """config.json of `hf_config` (a transformers config) plus a word-level tokenizer of its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(hf_config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w2"
    ).save_pretrained(path)
    return path
