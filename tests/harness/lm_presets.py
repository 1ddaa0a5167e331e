"""Tiny random keras-hub causal language models saved as presets with ``save_to_preset`` — the format of a real
preset folder (``config.json``, ``model.weights.h5``, ``tokenizer.json`` and its assets), written in a second
instead of downloaded: GPT-2 with a byte-level BPE ``GPT2Tokenizer`` made from a vocabulary dict and merges, and
Gemma with a ``GemmaTokenizer`` over a SentencePiece model trained in this process on the same words.

The tokenizers know the synthetic scenes' words as whole pieces (a space-led ``Ġred`` for GPT-2) and fall back to
characters for any other word, as a real BPE does on a word it never merged."""

from __future__ import annotations

import io
import os

# the words of the shapes and hard scenes' captions, and a few of COCO's (any other word is spelt in characters)
WORDS = ("a", "an", "the", "of", "and", "on", "in", "to", "is", "with", "at", "there", "are", "picture", "photo",
         "red", "green", "blue", "yellow", "purple", "orange", "white", "black", "gray", "small", "large", "big",
         "circle", "square", "triangle", "circles", "squares", "triangles", "left", "right", "above", "below",
         "one", "two", "three", "four", "five", "six", "shape", "shapes", "largest", "outlined", "filled", "next",
         "man", "dog", "cat", "riding", "wave", "top", "surfboard", "sitting", "table")
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789'"
END = "<|endoftext|>"


def gpt2_tokenizer_parts(words=WORDS) -> tuple[dict, list]:
    """A byte-level BPE vocabulary (piece → id) and merges for ``words``: id 0 is ``<|endoftext|>`` (GPT-2's start,
    end and padding), then every character alone and after a space (``Ġ``), then each word's merges in order, so a
    word of ``words`` after a space is one piece and every merge's parts and result are in the vocabulary."""
    vocabulary = {END: 0}

    def add(piece):
        vocabulary.setdefault(piece, len(vocabulary))

    for ch in LETTERS:
        add(ch)
        add("Ġ" + ch)
    add("Ġ")
    merges = [f"Ġ {ch}" for ch in LETTERS]  # a space and the letter after it are one piece
    for word in words:
        piece = "Ġ" + word[0]
        for ch in word[1:]:
            merge = f"{piece} {ch}"
            if merge not in merges:
                merges.append(merge)
            piece += ch
            add(piece)
    return vocabulary, merges


def sentencepiece_proto(sentences, vocab_size: int = 96, symbols=(), eos: str = "<eos>", bos: str = "<bos>") -> bytes:
    """A SentencePiece model (bytes) trained in this process on ``sentences``: Gemma's special pieces at its ids
    (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3; ``eos`` and ``bos`` name them otherwise: SigLIP's ``</s>``),
    byte fallback so that any text encodes (its 256 byte pieces come on top of ``vocab_size``'s pieces of words);
    ``symbols``: pieces kept whole (Gemma 3's image tokens)."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(list(sentences)), model_writer=out, vocab_size=vocab_size + 260, model_type="BPE",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece=eos, bos_piece=bos,
        unk_piece="<unk>", byte_fallback=True, character_coverage=1.0, minloglevel=2, num_threads=1,
        user_defined_symbols=list(symbols))
    return out.getvalue()


def caption_sentences(words=WORDS, count: int = 400, seed: int = 0) -> list[str]:
    """``count`` made-up sentences of ``words`` (seeded), for training a SentencePiece model."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(count)]


def write_gpt2(folder: str, hidden: int = 16, layers: int = 2, heads: int = 2, max_length: int = 64,
               seed: int = 0) -> str:
    """A tiny random GPT-2 (backbone and tokenizer) saved as a keras-hub preset in ``folder``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    vocabulary, merges = gpt2_tokenizer_parts()
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=tokenizer.vocabulary_size(), num_layers=layers,
                                             num_heads=heads, hidden_dim=hidden, intermediate_dim=2 * hidden,
                                             dropout=0.0, max_sequence_length=max_length)
    os.makedirs(folder, exist_ok=True)
    backbone.save_to_preset(folder)
    tokenizer.save_to_preset(folder)
    return folder


def write_gemma(folder: str, hidden: int = 16, layers: int = 2, heads: int = 2, seed: int = 0) -> str:
    """A tiny random Gemma (backbone and a SentencePiece tokenizer trained here) saved as a keras-hub preset."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto(caption_sentences()))
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=tokenizer.vocabulary_size(), num_layers=layers,
                                              num_query_heads=heads, num_key_value_heads=1, hidden_dim=hidden,
                                              intermediate_dim=2 * hidden, head_dim=hidden // heads, dropout=0.0)
    os.makedirs(folder, exist_ok=True)
    backbone.save_to_preset(folder)
    tokenizer.save_to_preset(folder)
    return folder


def write_paligemma(folder: str, hidden: int = 16, layers: int = 1, heads: int = 2, image_size: int = 16,
                    patch: int = 4, seed: int = 0, gemma2: bool = False, dtype: str | None = None,
                    vit_layers: int = 1, vit_hidden: int | None = None, vit_heads: int | None = None, sentences=None,
                    vocab_size: int = 96) -> str:
    """A tiny random PaliGemma (a SigLIP-style ViT of ``vit_layers`` layers of width ``vit_hidden`` and ``vit_heads``
    heads (default: ``hidden``, ``heads``) of ``image_size`` px in patches of ``patch``, a Gemma of ``layers`` layers
    with one key/value head, a SentencePiece tokenizer of ``vocab_size`` pieces trained here on ``sentences``
    (default: made-up captions of the test words) and its prompt, its image converter: [-1, 1] as the real
    presets') saved with ``PaliGemmaCausalLM.save_to_preset``: the files of a real PaliGemma preset folder.
    ``gemma2``: PaliGemma 2's language model, Gemma 2 (post-norms, soft caps, a sliding window of 4 on every other
    layer, queries scaled by the width). ``dtype``: the backbone's (``bfloat16``: saved so, as the real presets
    are). benchmarks/vlm_finetune.py writes a larger one over the hard scenes' captions."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    sentences = caption_sentences() if sentences is None else list(sentences)
    tokenizer = m.PaliGemmaTokenizer(proto=sentencepiece_proto(sentences + ["caption en"] * 20, vocab_size))
    vit_hidden = vit_hidden or hidden
    backbone = m.PaliGemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=image_size, num_layers=layers,
        num_query_heads=heads, num_key_value_heads=1, hidden_dim=hidden, intermediate_dim=2 * hidden,
        head_dim=hidden // heads, vit_patch_size=patch, vit_num_heads=vit_heads or heads, vit_hidden_dim=vit_hidden,
        vit_num_layers=vit_layers, vit_intermediate_dim=2 * vit_hidden,
        **(dict(use_post_ffw_norm=True, use_post_attention_norm=True, attention_logit_soft_cap=50.0,
                final_logit_soft_cap=30.0, use_sliding_window_attention=True, sliding_window_size=4,
                query_head_dim_normalize=False) if gemma2 else {}), dtype=dtype)
    converter = keras_hub.layers.PaliGemmaImageConverter(image_size=(image_size, image_size), scale=1 / 127.5,
                                                         offset=-1.0)
    preprocessor = m.PaliGemmaCausalLMPreprocessor(tokenizer=tokenizer, image_converter=converter,
                                                   sequence_length=32)
    os.makedirs(folder, exist_ok=True)
    m.PaliGemmaCausalLM(preprocessor=preprocessor, backbone=backbone).save_to_preset(folder)
    return folder


GEMMA3_SYMBOLS = ("<img>", "<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>")


def write_gemma3_vision(folder: str, hidden: int = 16, layers: int = 2, heads: int = 2, image_size: int = 16,
                        patch: int = 4, pool: int = 2, seed: int = 0) -> str:
    """A tiny random Gemma 3 with its vision encoder (a one-layer ViT of ``image_size`` px in patches of ``patch``,
    pooled ``pool`` × ``pool``: 4 image tokens; a Gemma 3 of ``layers`` layers with its sliding window of 4, so the
    window is exercised) and a SentencePiece tokenizer holding Gemma 3's image and turn tokens, saved with
    ``Gemma3CausalLM.save_to_preset``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    tokenizer = m.Gemma3Tokenizer(proto=sentencepiece_proto(caption_sentences() + ["describe this image"] * 20,
                                                            symbols=GEMMA3_SYMBOLS))
    vision = m.Gemma3VisionEncoder(image_size=image_size, patch_size=patch, num_heads=heads, hidden_dim=hidden,
                                   num_layers=1, intermediate_dim=2 * hidden, output_dim=hidden, pool_size=pool)
    backbone = m.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=image_size, num_layers=layers,
        num_query_heads=heads, num_key_value_heads=1, hidden_dim=hidden, intermediate_dim=2 * hidden,
        head_dim=hidden // heads, query_head_dim_normalize=True, use_post_ffw_norm=True,
        use_post_attention_norm=True, use_sliding_window_attention=True, sliding_window_size=4,
        vision_encoder=vision)
    converter = keras_hub.layers.Gemma3ImageConverter(image_size=(image_size, image_size), scale=1 / 127.5,
                                                      offset=-1.0)
    preprocessor = m.Gemma3CausalLMPreprocessor(tokenizer=tokenizer, image_converter=converter, sequence_length=48,
                                                max_images_per_prompt=1,
                                                num_vision_tokens_per_image=vision.num_vision_tokens_per_image)
    os.makedirs(folder, exist_ok=True)
    m.Gemma3CausalLM(preprocessor=preprocessor, backbone=backbone).save_to_preset(folder)
    return folder


def write_blip2(folder: str, hidden: int = 16, layers: int = 2, heads: int = 2, image_size: int = 16, patch: int = 8,
                queries: int = 2, seed: int = 0) -> str:
    """A tiny random BLIP-2 (a one-layer ViT of ``image_size`` px in patches of ``patch`` with its class token, a
    one-layer Q-Former of ``queries`` query tokens, an OPT of ``layers`` layers) with a byte-level BPE tokenizer
    (:func:`gpt2_tokenizer_parts`' pieces and BLIP-2 OPT's ``</s>``, ``<pad>``, ``<image>`` and its newline end
    token), saved with ``BLIP2CausalLM.save_to_preset``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    vocabulary, merges = gpt2_tokenizer_parts()
    for special in ("</s>", "<pad>", "<image>", "\u010a"):
        vocabulary.setdefault(special, len(vocabulary))
    tokenizer = m.BLIP2OPTTokenizer(vocabulary=vocabulary, merges=merges)
    vision = m.BLIP2VisionEncoder(image_size=image_size, patch_size=patch, num_layers=1, num_heads=heads,
                                  hidden_dim=hidden, intermediate_dim=2 * hidden, use_patch_bias=True,
                                  use_class_token=True, use_mha_bias=True, use_mlp_bias=True, dropout_rate=0.0,
                                  layer_norm_epsilon=1e-6, initializer_range=0.02)
    qformer = m.BLIP2QFormer(num_query_tokens=queries, num_layers=1, num_heads=heads, hidden_dim=hidden,
                             intermediate_dim=2 * hidden, vision_dim=hidden, cross_attention_frequency=1, dropout=0.0,
                             layer_norm_epsilon=1e-12)
    opt = m.BLIP2CustomOPT(vocabulary_size=tokenizer.vocabulary_size(), num_layers=layers, num_heads=heads,
                           hidden_dim=hidden, intermediate_dim=2 * hidden, num_query_tokens=queries, dropout=0.0,
                           max_sequence_length=64, qformer_hidden_dim=hidden)
    backbone = m.BLIP2Backbone(vision_encoder=vision, qformer=qformer, language_model=opt)
    converter = keras_hub.layers.BLIP2ImageConverter(image_size=(image_size, image_size))  # EVA-CLIP per channel
    preprocessor = m.BLIP2CausalLMPreprocessor(tokenizer=tokenizer, image_converter=converter, sequence_length=32)
    os.makedirs(folder, exist_ok=True)
    m.BLIP2CausalLM(preprocessor=preprocessor, backbone=backbone).save_to_preset(folder)
    return folder


WRITERS = {"gpt2": write_gpt2, "gemma": write_gemma}
VLM_WRITERS = {"paligemma": write_paligemma, "gemma3": write_gemma3_vision,  # image-text models (model.decoder: vlm)
               "blip2": write_blip2, "paligemma2": lambda folder: write_paligemma(folder, layers=2, gemma2=True)}


def tiny_backbone(family: str, vocabulary: int = 64, hidden: int = 16, layers: int = 2, seed: int = 0):
    """A tiny random keras-hub backbone of ``family`` (``gpt2``, ``gemma``, ``gemma2``, ``gemma3``, ``llama3``,
    ``qwen3``, ``smollm3``; text only, no tokenizer): two grouped-query heads over one key/value head where the
    family has them, Gemma 2's soft caps and sliding window, Gemma 3's query/key norms and SmolLM3's layer
    without rotary positions, so each family's own arithmetic is exercised."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    m = keras_hub.models
    common = dict(vocabulary_size=vocabulary, num_layers=layers, hidden_dim=hidden, intermediate_dim=2 * hidden)
    gqa = dict(num_query_heads=2, num_key_value_heads=1)
    if family == "gpt2":
        return m.GPT2Backbone(**common, num_heads=2, dropout=0.0, max_sequence_length=64)
    if family in ("gemma", "gemma2"):
        two = dict(attention_logit_soft_cap=50.0, final_logit_soft_cap=3.0, use_post_ffw_norm=True,
                   use_post_attention_norm=True, use_sliding_window_attention=True, sliding_window_size=4,
                   query_head_dim_normalize=False) if family == "gemma2" else {}
        return m.GemmaBackbone(**common, **gqa, head_dim=hidden // 2, dropout=0.0, **two)
    if family == "gemma3":
        return m.Gemma3Backbone(**common, **gqa, image_size=None, head_dim=hidden // 2, use_post_ffw_norm=True,
                                use_post_attention_norm=True, use_sliding_window_attention=True,
                                sliding_window_size=4, vision_encoder=None)
    if family == "llama3":
        return m.Llama3Backbone(**common, **gqa)
    if family == "qwen3":
        return m.Qwen3Backbone(**common, **gqa, head_dim=hidden // 2)
    if family == "smollm3":
        return m.SmolLM3Backbone(**common, num_attention_heads=2, num_key_value_heads=1, attention_bias=False,
                                 attention_dropout=0.0,
                                 rope_layer_enabled_list=[True, False][:layers] + [True] * (layers - 2),
                                 layer_types=["full_attention"] * layers, mlp_bias=False, layer_norm_epsilon=1e-6,
                                 max_position_embeddings=64, rope_theta=10000.0, partial_rotary_factor=1.0)
    raise ValueError(f"no tiny backbone of family {family}")


BACKBONE_FAMILIES = ("gpt2", "gemma", "gemma2", "gemma3", "llama3", "qwen3", "smollm3")
