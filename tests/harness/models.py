"""Tiny decoder models and their inputs: a registered decoder with its ``tiny_settings`` on ``small_cnn`` at
``SIZE`` px (a 2 × 2 grid), a vocabulary of ``V`` words, ``B`` random images and captions of ``T`` words, and
regions of ``R`` features (data.features: regions). A decoder that reads a language-model preset (a
``decoder_preset`` setting: ``prefix_lm``) gets a tiny random GPT-2 preset written once a process into a temporary
folder (tests/harness/lm_presets.py), unless its settings name one."""

import atexit
import dataclasses
import functools
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.model import DECODERS, build_model

V, B, T, SIZE = 40, 3, 7, 32
R = 12  # region features


@functools.lru_cache(maxsize=None)
def lm_preset() -> str:
    """A tiny random GPT-2 preset (backbone and tokenizer), written once a process into a temporary folder: one layer
    (the contract's checks are per decoder; a cache over several layers is tests/test_prefix_lm.py's, each family's
    against keras-hub's own with two), which halves the LM's cost in every contract step, the XLA-compiled one too."""
    from tests.harness.lm_presets import write_gpt2

    folder = tempfile.mkdtemp(prefix="tiny_gpt2_")
    atexit.register(shutil.rmtree, folder, True)
    return write_gpt2(folder, layers=1)


@functools.lru_cache(maxsize=None)
def vlm_preset() -> str:
    """A tiny random PaliGemma preset (tests/harness/lm_presets.py's ``write_paligemma``) whose ViT reads 16 px in
    patches of 8: a 2 × 2 grid, as small_cnn's at 32 px (its images are resized to 16 px inside the encoder)."""
    from tests.harness.lm_presets import write_paligemma

    folder = tempfile.mkdtemp(prefix="tiny_paligemma_")
    atexit.register(shutil.rmtree, folder, True)
    return write_paligemma(folder, patch=8)


PRESET_WRITERS = {"decoder_preset": lm_preset, "vlm_preset": vlm_preset}  # a decoder's preset setting: its tiny one


def tiny_options(name, **changes) -> dict:
    """Decoder ``name``'s ``tiny_settings`` with ``changes``, and the tiny preset for a decoder reading one."""
    cls = DECODERS[name]
    options = {**cls.tiny_settings, **changes}
    for key in {f.name for f in dataclasses.fields(cls.settings_class)} & set(PRESET_WRITERS):
        if not options.get(key):
            options[key] = PRESET_WRITERS[key]()
    return options


def encoder_of(name) -> str:
    """The encoder a tiny model of decoder ``name`` reads with: its own (``own_encoder``), else small_cnn."""
    return DECODERS[name].own_encoder or "small_cnn"


def tiny(name, seed=0, trainable=True, **changes):
    """A tiny model of decoder ``name``: its ``tiny_settings`` with ``changes``, the encoder trainable unless not."""
    cfg = ModelConfig(decoder=name, encoder=encoder_of(name), encoder_trainable=trainable, dropout=0.0,
                      options=tiny_options(name, **changes))
    return build_model(V, cfg, SIZE, seed=seed).build_all()


@functools.lru_cache(maxsize=None)
def shared_tiny(name, **changes):
    """``tiny(name, **changes)``, built once for the tests that only read it (calls, gradients, steps; no weight
    set): one build a decoder (and settings) instead of one a test. The empty-batch check asserts that calls move
    no variable."""
    return tiny(name, **changes)


def inputs(seed=0, batch=B, steps=T):
    """``batch`` random images of ``SIZE`` px and word ids of ``steps`` words, each starting with <start>."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, V, (batch, steps), dtype=np.int64)
    ids[:, 0] = 1  # <start>
    return rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8), ids


def npy(x):
    """A tensor (or anything array-like) as a NumPy array."""
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def tiny_regions(name, seed=0, geometry=False, **changes):
    """A tiny model of decoder ``name`` reading regions of R features (data.features: regions)."""
    from captioning.config import Config, DataConfig
    from captioning.model.data_sources import data_source

    cfg = ModelConfig(decoder=name, encoder=encoder_of(name), dropout=0.0, region_feature_size=R, box_geometry=geometry,
                      options=tiny_options(name, **changes))
    source = data_source(Config(data=DataConfig(features="regions"), model=cfg))
    return build_model(V, cfg, SIZE, seed=seed, source=source).build_all()


def region_batch(counts=(3, 5, 1), extra=0, seed=0, garbage=0):
    """Regions of B images (``counts`` each), padded to the most plus ``extra`` columns holding ``garbage``
    (a seed: random values where the mask is 0; 0: zeros), with boxes and the mask."""
    rng = np.random.default_rng(seed)
    most = max(counts)
    mask = (np.arange(most)[None, :] < np.array(counts)[:, None]).astype(np.float32)
    regions = rng.normal(size=(len(counts), most, R)) * mask[..., None]
    corner = rng.uniform(0, 0.5, (len(counts), most, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(0.1, 0.5, (len(counts), most, 2))], axis=-1) * mask[..., None]
    pad = [[0, 0], [0, extra], [0, 0]]
    regions, boxes, mask = np.pad(regions, pad), np.pad(boxes, pad), np.pad(mask, pad[:2])
    if garbage:
        noise = np.random.default_rng(garbage)
        regions = regions + noise.normal(size=regions.shape) * (1 - mask[..., None])
        boxes = boxes + noise.uniform(size=boxes.shape) * (1 - mask[..., None])
    return {"regions": regions.astype(np.float16), "boxes": boxes.astype(np.float32), "region_mask": mask}


def loss_and_grads(model, batch, **options):
    """The training loss (the decoder's penalty included, if it has one) and its gradients."""
    from captioning.train.objectives import caption_loss_sum

    with tf.GradientTape() as tape:
        loss = caption_loss_sum(model, batch, training=False, penalty=True, **options)
    grads = tape.gradient(loss, model.trainable_variables)
    return npy(loss), [None if g is None else npy(tf.convert_to_tensor(g)) for g in grads]


def same_gradient(actual, desired):
    """Equal up to float32 rounding: 1e-4 relative, and 1e-5 absolute per unit of the gradient's largest
    element (a Transformer's gradients reach ~10, an LSTM's stay under 1, where this is 1e-5). The absolute part
    covers elements that are small sums of large terms added in another order (a gather's gradient against the
    copies'): at 1e-6 one element in 147,456 of a Transformer's was 4.6e-6 over, 2026-11-26. A real difference
    (a caption read with another image, a mask dropped) moves the gradients by their own size."""
    np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(desired).max())))


def rescore(model, images, captions, ended=None):
    """Each caption's summed log-probability (its words, then <end>), by stepping, caption i reading ``images[i]``;
    ``ended`` (a bool per caption, or None: all): whether the caption ended (a caption cut at the search's
    ``max_length`` has no <end> in its sum). All captions step as one batch, one eager step a word (after a caption's
    last word, <end>s that count nothing)."""
    from captioning.vocab import END_ID, START_ID

    captions = [list(words) for words in captions]
    ended = list(ended) if ended is not None else [True] * len(captions)
    steps = max(map(len, captions)) + 1
    tokens = np.full((len(captions), steps), END_ID, np.int32)  # what each step reads
    tokens[:, 0] = START_ID
    for i, words in enumerate(captions):
        tokens[i, 1:len(words) + 1] = words
    state = model.reserve(model.image_state({"image": tf.constant(np.asarray(images))}), steps)
    totals = [0.0] * len(captions)
    for t in range(steps):
        logits, state = model.step(tf.constant(tokens[:, t]), state)
        logp = npy(tf.nn.log_softmax(logits))
        for i, (words, end) in enumerate(zip(captions, ended)):
            if t < len(words) or (t == len(words) and end):  # word t of the caption, or its <end>
                totals[i] += float(logp[i, words[t] if t < len(words) else END_ID])
    return totals
