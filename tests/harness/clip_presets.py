"""Tiny random CLIP and SigLIP presets with their tokenizers, written with ``save_to_preset`` (the files of a real
preset folder: the backbone, the tokenizer and its assets, the preprocessor and the image converter), for
tests/test_clip_score.py. CLIP's byte-level BPE comes from a word list; ``end_token_last=False`` gives
``<|endoftext|>`` the smallest id of all but ``<|startoftext|>``'s neighbour, so that pooling at the largest id
(keras-hub's ``CLIPTextPooler``) finds another token."""

from __future__ import annotations

import os
import string

from tests.harness.lm_presets import WORDS, caption_sentences, sentencepiece_proto

PRINTABLE = string.ascii_lowercase + string.digits + string.punctuation  # every character a caption may hold
SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def clip_tokenizer_parts(words=WORDS, end_token_last: bool = True) -> tuple[dict, list]:
    """CLIP's BPE (pieces ending a word carry ``</w>``): every character alone and ending a word, then each word's
    merges; the two special tokens last (as OpenAI's vocabulary has them) or first."""
    pieces, merges = [], []

    def add(piece):
        if piece not in pieces:
            pieces.append(piece)

    for ch in PRINTABLE:
        add(ch)
        add(ch + "</w>")
    for word in words:
        piece = word[0]
        for i, ch in enumerate(word[1:], 1):
            part = ch + "</w>" if i == len(word) - 1 else ch
            merge = f"{piece} {part}"
            if merge not in merges:
                merges.append(merge)
            piece += part
            add(piece)
    ordered = pieces + list(SPECIAL) if end_token_last else list(SPECIAL) + pieces
    return {piece: i for i, piece in enumerate(ordered)}, merges


def write_clip(folder: str, end_token_last: bool = True, size: int = 32, seed: int = 0) -> str:
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    vocabulary, merges = clip_tokenizer_parts(WORDS + ("photo", "depicts"), end_token_last)
    tokenizer = m.CLIPTokenizer(vocabulary=vocabulary, merges=merges)
    vision = m.CLIPVisionEncoder(patch_size=8, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=24,
                                 image_shape=(size, size, 3))
    text = m.CLIPTextEncoder(vocabulary_size=len(vocabulary), embedding_dim=16, hidden_dim=16, num_layers=1,
                             num_heads=2, intermediate_dim=24, max_sequence_length=24)
    backbone = m.CLIPBackbone(vision, text, projection_dim=8)
    converter = keras_hub.layers.CLIPImageConverter(image_size=(size, size), scale=[1 / (255 * s) for s in STD],
                                                    offset=[-a / s for a, s in zip(MEAN, STD)])
    preprocessor = m.CLIPPreprocessor(tokenizer=tokenizer, image_converter=converter, sequence_length=24)
    os.makedirs(folder, exist_ok=True)
    backbone.save_to_preset(folder)
    preprocessor.save_to_preset(folder)
    return folder


MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)  # CLIP's normalisation, per channel


def write_siglip(folder: str, size: int = 32, seed: int = 0) -> str:
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    tokenizer = m.SigLIPTokenizer(proto=sentencepiece_proto(caption_sentences() + ["a photo depicts"] * 20,
                                                                  eos="</s>", bos="<s>"))
    vision = m.SigLIPVisionEncoder(patch_size=8, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=24,
                                   image_shape=(size, size, 3))
    text = m.SigLIPTextEncoder(vocabulary_size=tokenizer.vocabulary_size(), embedding_dim=16, hidden_dim=16,
                               num_layers=1, num_heads=2, intermediate_dim=24, max_sequence_length=16)
    backbone = m.SigLIPBackbone(vision, text)
    converter = keras_hub.layers.SigLIPImageConverter(image_size=(size, size), scale=1 / 127.5, offset=-1.0)
    preprocessor = m.SigLIPPreprocessor(tokenizer=tokenizer, image_converter=converter, sequence_length=16)
    os.makedirs(folder, exist_ok=True)
    backbone.save_to_preset(folder)
    preprocessor.save_to_preset(folder)
    return folder
