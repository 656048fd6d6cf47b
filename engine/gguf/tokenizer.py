"""Tokenizer fixes on top of transformers' GGUF conversion, so that the folder's tokenizer
splits text as the model's own tokenizer (and llama.cpp) does.

- SentencePiece-BPE vocabularies (`tokenizer.ggml.model` "llama" with scores and no merges,
  e.g. Gemma 3): transformers renders them as a Unigram model, which splits words the BPE
  merges keep whole (Gemma 3: "France" as "Fr|an|ce" instead of "▁France"). They are rebuilt
  as BPE whose merges are ranked by the merged piece's score, as SentencePiece merges and as
  transformers' own converter does from a SentencePiece model file.
- BOS: prepended when the file says `tokenizer.ggml.add_bos_token` (Gemma 3 without its BOS
  generates nonsense); transformers' conversion leaves it out.
"""

from __future__ import annotations

from engine.gguf.reader import GGUFFile

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values


def field(reader: GGUFFile, key: str):
    """A metadata value of the file (None when absent)."""
    value = reader.fields.get(key)
    return None if value is None else value.contents()


def fix_tokenizer(tokenizer, reader: GGUFFile, bos_id: int | None) -> None:
    """Apply the fixes above to the transformers tokenizer converted from the file, in place."""
    is_spm_bpe = (field(reader, "tokenizer.ggml.model") == "llama" and "tokenizer.ggml.merges" not in reader.fields
                  and "tokenizer.ggml.scores" in reader.fields)
    if is_spm_bpe and type(tokenizer.backend_tokenizer.model).__name__ == "Unigram":
        tokenizer._tokenizer = _spm_bpe(reader, tokenizer.backend_tokenizer)
    if field(reader, "tokenizer.ggml.add_bos_token") and bos_id is not None:
        _add_bos(tokenizer, bos_id)


def _spm_bpe(reader: GGUFFile, converted):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    scores = list(field(reader, "tokenizer.ggml.scores"))
    types = list(field(reader, "tokenizer.ggml.token_type"))
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for i in sorted((i for i, kind in enumerate(types) if kind == _NORMAL), key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[int(unk)],
                               fuse_unk=True, byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bpe.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == _CONTROL])
    bpe.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(types) if kind == _USER_DEFINED])
    bpe.post_processor = converted.post_processor
    return bpe


def _add_bos(tokenizer, bos_id: int) -> None:
    from tokenizers.processors import TemplateProcessing

    if tokenizer.encode("a")[:1] == [bos_id]:
        return
    bos = tokenizer.convert_ids_to_tokens(bos_id)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
