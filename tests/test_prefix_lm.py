"""model.decoder: prefix_lm (captioning/model/prefix_lm.py) and its language-model families
(captioning/model/language_models.py), over tiny random presets (tests/harness/lm_presets.py) and the tiny
small_cnn encoder. The decoder contract (tests/test_decoders.py) runs over it too, with a tiny GPT-2 preset."""

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model import build_model, check_caption_length
from captioning.model.language_models import FAMILIES, adapter
from captioning.model.prefix_lm import DEAD, PrefixLM, PrefixLMSettings
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from tests.harness.lm_presets import BACKBONE_FAMILIES, tiny_backbone, write_gpt2
from tests.harness.models import SIZE, inputs, npy

CAUSAL = {"gpt2": "GPT2CausalLM", "gemma": "GemmaCausalLM", "gemma2": "GemmaCausalLM", "gemma3": "Gemma3CausalLM",
          "llama3": "Llama3CausalLM", "qwen3": "Qwen3CausalLM", "smollm3": "SmolLM3CausalLM"}


@pytest.fixture(scope="module")
def gemma_preset(lm_presets):
    """The session's tiny Gemma preset (tests/conftest.py's ``lm_presets``: write_gemma's defaults)."""
    return lm_presets["gemma"]


@pytest.fixture(scope="module")
def gpt2_preset(lm_presets):
    """The session's tiny GPT-2 preset (``lm_presets``: write_gpt2's defaults, as tests/harness/models.lm_preset)."""
    return lm_presets["gpt2"]


def build(preset, vocab_size=None, seed=0, encoder_trainable=False, **options):
    """A prefix_lm over small_cnn at SIZE px reading ``preset``, its vocabulary the preset tokenizer's (4 + pieces)."""
    from captioning.model.prefix_lm import _tokenizer

    vocab_size = vocab_size or 4 + int(_tokenizer(preset).vocabulary_size())
    cfg = ModelConfig(decoder="prefix_lm", encoder="small_cnn", dropout=0.0, encoder_trainable=encoder_trainable,
                      options={**PrefixLM.tiny_settings, "lm_trainable": False, "decoder_preset": preset, **options})
    return build_model(vocab_size, cfg, SIZE, seed=seed).build_all()


@pytest.mark.parametrize("family", BACKBONE_FAMILIES)
def test_each_familys_adapter_computes_what_keras_hubs_causal_lm_does(family):
    """Our cached steps over embedded ids give keras-hub's own CausalLM.call_with_cache logits and the backbone's
    full pass (to 1e-5); a prefix of vectors before them is read as positions, stepping equal to one pass."""
    import keras_hub

    backbone = tiny_backbone(family)
    lm = adapter(backbone)
    assert type(lm) is FAMILIES[type(backbone).__name__] and lm.width == 16
    rows, steps = 2, 7
    ids = np.random.default_rng(0).integers(1, 64, (rows, steps)).astype("int32")
    causal = getattr(keras_hub.models, CAUSAL[family])(backbone=backbone, preprocessor=None)
    cache = lm.empty_cache(rows, steps, "float32")
    if family == "gemma3":  # its own cache: a (key, value) tuple a layer
        cache = tuple((cache[:, i, 0], cache[:, i, 1]) for i in range(lm.layers))
    theirs = npy(causal.call_with_cache(ids, cache, tf.constant(0))[0])
    full = npy(lm.logits(backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})))
    cache, ours = lm.empty_cache(rows, steps, "float32"), []
    for t in range(steps):
        hidden, cache = lm.run(lm.embed(ids[:, t:t + 1]), cache, tf.constant(t))
        ours.append(npy(lm.logits(hidden)))
    ours = np.concatenate(ours, axis=1)
    assert ours.shape == (rows, steps, 64) and np.abs(theirs).max() > 1e-2
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(full, theirs, atol=1e-5, rtol=0)
    # a prefix of 3 vectors, then the pieces: one pass equals the prefix then piece by piece
    prefix = tf.constant(np.random.default_rng(1).normal(size=(rows, 3, 16)), tf.float32)
    once = npy(lm.logits(lm.run(tf.concat([prefix, lm.embed(ids)], 1), lm.empty_cache(rows, 3 + steps, "float32"),
                                tf.constant(0))[0]))[:, 3:]
    _, cache = lm.run(prefix, lm.empty_cache(rows, 3 + steps, "float32"), tf.constant(0))
    stepped = []
    for t in range(steps):
        hidden, cache = lm.run(lm.embed(ids[:, t:t + 1]), cache, tf.constant(3 + t))
        stepped.append(npy(lm.logits(hidden)))
    np.testing.assert_allclose(np.concatenate(stepped, axis=1), once, atol=1e-5, rtol=0)
    assert np.abs(once - theirs).max() > 1e-3  # the prefix is read


def test_a_backbone_that_cannot_take_a_prefix_is_refused_in_one_line(tmp_path):
    import keras_hub

    bert = keras_hub.models.BertBackbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
                                         intermediate_dim=16, max_sequence_length=16)
    with pytest.raises(InputError) as e:
        adapter(bert)
    message = str(e.value)
    assert "\n" not in message and "BertBackbone" in message
    assert all(name in message for name in ("GPT2Backbone", "GemmaBackbone", "Gemma3Backbone", "Llama3Backbone",
                                            "Qwen3Backbone", "SmolLM3Backbone"))
    bert.save_to_preset(str(tmp_path / "bert"))  # a preset folder of it: refused as the model is built
    with pytest.raises(InputError, match="holds a BertBackbone, which cannot take a visual prefix"):
        build(str(tmp_path / "bert"), vocab_size=20)


def test_the_first_word_is_read_after_the_prefix_and_prompt_and_ids_are_the_lms_plus_four(gemma_preset):
    """With a prompt, <start>'s logits are the LM's at the prompt's last piece after the prefix: LM token i is
    column i + 4, <end> the LM's end token, <pad>, <start>, <unk> and the LM's special tokens dead; stepping equals
    the full pass (Gemma: SentencePiece, rotary positions)."""
    from captioning.model.prefix_lm import _captions_tokenizer, _tokenizer

    model = build(gemma_preset, mapper="mlp", prompt="a picture of")
    tokenizer = _tokenizer(gemma_preset)
    prompt = [int(i) for i in npy(tokenizer("a picture of"))]
    assert len(prompt) >= 3 and model.prefix_positions == 2 + len(prompt)
    images, _ = inputs(seed=1)
    features = model.encode(images)
    logits, _ = model.step(tf.fill([3], START_ID), model.reserve(model.initial_state(features), 1))
    lm, rows = model.lm, len(images)
    x = tf.concat([model.mapper(features), tf.tile(lm.embed(tf.constant([prompt])), [rows, 1, 1])], axis=1)
    hidden, _ = lm.run(x, lm.empty_cache(rows, x.shape[1], "float32"), tf.constant(0))
    expected = npy(lm.logits(hidden))[:, -1]  # the last prompt piece's output
    logits = npy(logits)
    assert logits.shape == (rows, model.vocab_size) == (rows, 4 + tokenizer.vocabulary_size())
    special = {i - 4 for i in _captions_tokenizer(gemma_preset).special_ids()}  # the tokenizer's rule
    assert {0, 1, 2, 3} <= special  # <pad>, <eos>, <bos>, <unk>
    words = [i for i in range(tokenizer.vocabulary_size()) if i not in special]
    np.testing.assert_allclose(logits[:, [i + 4 for i in words]], expected[:, words], atol=1e-5)
    np.testing.assert_allclose(logits[:, END_ID], expected[:, tokenizer.end_token_id], atol=1e-5)
    dead = [PAD_ID, START_ID, UNK_ID] + [i + 4 for i in special]
    assert (logits[:, dead] == DEAD).all()
    ids = np.random.default_rng(2).integers(4, model.vocab_size, (rows, 6))
    ids[:, 0] = START_ID
    full = npy(model({"image": images, "input_ids": ids}))
    state, stepped = model.reserve(model.initial_state(features), 6), []
    for t in range(6):
        out, state = model.step(tf.constant(ids[:, t], tf.int32), state)
        stepped.append(npy(out))
    np.testing.assert_allclose(np.stack(stepped, axis=1), full, atol=1e-5, rtol=0)
    np.testing.assert_allclose(full[:, 0], logits, atol=1e-5)


def _train_step(model, seed=0):
    """One Adam update of the model's trainable variables on random captions."""
    import keras

    from captioning.train.objectives import caption_loss_sum

    images, ids = inputs(seed=seed)
    ids = ids % model.vocab_size
    ids[:, 0] = START_ID
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
             "mask": np.ones(ids.shape, np.float32)}
    with tf.GradientTape() as tape:
        loss = caption_loss_sum(model, batch, training=True)
    keras.optimizers.Adam(0.01).apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                                    model.trainable_variables))


def _size(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def test_only_the_mapper_trains_with_a_frozen_lm_and_lora_trains_only_its_adapters(gpt2_preset):
    """Frozen (the default): the mapper's variables are the decoder's only trainable ones (the LM's are its
    variables, untrained). LoRA rank 2: the mapper and the adapters of the query and value projections train
    (counted), nothing else; after a step every other LM weight is bit for bit the preset's. (A frozen LM bit for
    bit after training through ``captioning.train``: tests/test_tokenizers.py's end-to-end test of a decoder over a
    preset's tokenizer.)"""
    preset = gpt2_preset
    frozen = build(preset, vocab_size=40)
    encoder = {id(v) for v in frozen.encoder.weights}
    mine = {id(v) for v in frozen.trainable_variables} - encoder
    assert mine == {id(v) for v in frozen.mapper.trainable_variables} and frozen.lm_variables() == []
    assert {id(v) for v in frozen.decoder_variables()} == {id(v) for v in frozen.weights} - encoder
    assert {id(v) for v in frozen.backbone.weights} <= {id(v) for v in frozen.decoder_variables()}

    lora = build(preset, vocab_size=40, lm_lora_rank=2)
    trainable = [v for v in lora.trainable_variables if id(v) not in {id(w) for w in lora.encoder.weights}]
    adapters = [v for v in trainable if "lora" in v.path]
    # write_gpt2's sizes; Keras' EinsumDense LoRA of a [hidden, heads, head] kernel: A [hidden, heads, rank] and
    # B [rank, head], for the query and the value projection of each layer
    hidden, layers, heads, rank = 16, 2, 2, 2
    assert _size(adapters) == layers * 2 * (hidden * heads * rank + rank * hidden // heads) == 320
    assert {id(v) for v in trainable} == {id(v) for v in adapters} | {id(v) for v in lora.mapper.trainable_variables}
    assert {id(v) for v in lora.lm_variables()} == {id(v) for v in adapters}
    base = {v.path: npy(v).copy() for v in lora.backbone.weights if "lora" not in v.path}
    b_before = {v.path: npy(v).copy() for v in adapters if "lora_kernel_b" in v.path}
    _train_step(lora)
    for v in lora.backbone.weights:
        if "lora" not in v.path:
            np.testing.assert_array_equal(npy(v), base[v.path], err_msg=v.path)
    assert all(not np.array_equal(npy(v), b_before[v.path]) for v in adapters if "lora_kernel_b" in v.path)


def test_settings_are_checked_in_one_line_and_gpt2_bounds_the_caption_length(gpt2_preset, tmp_path, monkeypatch):
    from captioning.model import typed_model

    def typed(**options):
        return typed_model(ModelConfig(decoder="prefix_lm", encoder="small_cnn", options=options))

    for options in ({}, {"decoder_preset": str(tmp_path / "nowhere")}):  # typed, then refused when the preset is read
        settings = typed(**options).decoder_settings
        for read in (PrefixLM.tokenizer_preset, lambda s: build(s.decoder_preset, vocab_size=40)):
            with pytest.raises(InputError, match=r"needs model.decoder_preset|decoder_preset: .*nowhere does not exist"):
                read(settings)
    with pytest.raises(InputError, match="choose one"):
        typed(decoder_preset=gpt2_preset, lm_trainable=True, lm_lora_rank=4)
    gpt2 = typed(decoder_preset=gpt2_preset, prefix_length=10)
    # write_gpt2's 64 positions: 10 prefix vectors, the first word read at position 9 → 64 − 10 + 1 words
    assert PrefixLM.max_caption_length(gpt2.decoder_settings) == 55
    check_caption_length(gpt2, "decode.max_length", 55)
    with pytest.raises(InputError, match="decode.max_length is 56, but model.decoder prefix_lm decodes captions of "
                                         "at most 55 words"):
        check_caption_length(gpt2, "decode.max_length", 56)
    assert PrefixLM.max_caption_length(PrefixLMSettings()) is None
    import os  # a preset folder named relative to the working directory is recorded absolute (a path key)

    monkeypatch.chdir(os.path.dirname(gpt2_preset))
    assert typed(decoder_preset=os.path.basename(gpt2_preset)).decoder_settings.decoder_preset == gpt2_preset


def test_gpt2_max_length_is_the_positions_the_model_reads():
    """The bound is real: the longest caption decodes (its last step reads GPT-2's last position)."""
    preset = write_gpt2(__import__("tempfile").mkdtemp(), max_length=8)
    model = build(preset, vocab_size=40, prefix_length=3)
    longest = PrefixLM.max_caption_length(model.settings)
    assert longest == 8 - 3 + 1
    images, _ = inputs(seed=3)
    state = model.reserve(model.initial_state(model.encode(images)), longest)
    token = tf.fill([3], START_ID)
    for _ in range(longest):
        logits, state = model.step(token, state)
        token = tf.cast(tf.argmax(logits, axis=1), tf.int32)
    assert int(state["t"][0]) == 8 and np.isfinite(npy(logits)).all()
    # a training caption longer than the positions reads the last one past them (no error mid-run), stepping as
    # the full pass
    _, ids = inputs(seed=4, steps=longest + 3)
    full = npy(model({"image": images, "input_ids": ids}))
    state, stepped = model.reserve(model.initial_state(model.encode(images)), longest + 3), []
    for t in range(longest + 3):
        out, state = model.step(tf.constant(ids[:, t], tf.int32), state)
        stepped.append(npy(out))
    np.testing.assert_allclose(np.stack(stepped, axis=1), full, atol=1e-5, rtol=0)


def test_a_fine_tuned_lm_learns_at_train_lm_lr_scale_and_the_encoder_at_its_own(gpt2_preset):
    """model.lm_trainable: the LM's SGD update is train.lm_lr_scale times the one at the mapper's rate, the encoder's
    train.encoder_lr_scale times it, the mapper's the rate's; both scales apply in one optimizer."""
    from captioning.config.sections import TrainConfig
    from captioning.train.objectives import caption_loss_sum
    from captioning.train.optimizer import make_optimizer

    model = build(gpt2_preset, vocab_size=40, lm_trainable=True, encoder_trainable=True)
    images, ids = inputs(seed=4)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
             "mask": np.ones(ids.shape, np.float32)}
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = caption_loss_sum(model, batch, training=False)
    gradients = tape.gradient(loss, variables)
    before = [npy(v).copy() for v in variables]
    train = TrainConfig(optimizer="sgd", momentum=0.0, learning_rate=1.0, lr_schedule="constant", lm_lr_scale=0.25,
                        encoder_lr_scale=0.5)
    optimizer = make_optimizer(train, 10, False, model.encoder.trainable_variables, train.encoder_lr_scale,
                               lm=model.lm_variables())
    optimizer.build(variables)
    optimizer.apply(gradients, variables)
    lm, encoder = ({id(v) for v in group} for group in (model.lm_variables(), model.encoder.trainable_variables))
    assert lm and lm <= {id(v) for v in model.backbone.weights}
    seen = set()
    for v, b, g in zip(variables, before, gradients):
        if g is None or np.abs(npy(tf.convert_to_tensor(g))).max() < 1e-6:
            continue
        scale = 0.25 if id(v) in lm else 0.5 if id(v) in encoder else 1.0
        np.testing.assert_allclose(b - npy(v), scale * npy(tf.convert_to_tensor(g)), rtol=1e-4, atol=1e-7,
                                   err_msg=v.path)
        seen.add(scale)
    assert seen == {0.25, 0.5, 1.0}


def test_the_scenes_experiment_needs_its_preset_on_the_command_line(gpt2_preset, tmp_path):
    """experiments/scenes_prefix_lm.yaml names no language model: without --set model.decoder_preset the run is
    refused in one line naming the key, nothing written; with it the config types (the mapper's recipe)."""
    import os

    from captioning import experiment
    from tests.helpers import REPO, run_cli

    path = os.path.join(REPO, "experiments", "scenes_prefix_lm.yaml")
    done = run_cli("train", "--config", path, "--model-dir", tmp_path / "plm")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "captioning train: error: model.decoder: prefix_lm needs model.decoder_preset: a keras-hub causal-LM preset "
        "folder (captioning lm train writes one) or preset name, e.g. --set model.decoder_preset=runs/lm"]
    assert not os.path.exists(tmp_path / "plm")
    settings = experiment.load(path, [f"model.decoder_preset={gpt2_preset}"]).config.model.decoder_settings
    assert (settings.mapper, settings.prefix_length, settings.mapper_layers, settings.lm_trainable) == (
        "transformer", 10, 2, False)


def test_lm_lr_scale_without_a_trained_lm_is_named_as_doing_nothing(gpt2_preset):
    from captioning.config import Config
    from captioning.config.loader import ineffective
    from captioning.config.sections import TrainConfig

    said = ("train.lm_lr_scale 0.1 does nothing: no language model is trained (model.decoder: prefix_lm with "
            "model.lm_trainable or model.lm_lora_rank)")
    assert said in ineffective(Config(train=TrainConfig(lm_lr_scale=0.1)))
    for options, lines in (({}, [said]), ({"lm_trainable": True}, []), ({"lm_lora_rank": 4}, [])):
        model = ModelConfig(decoder="prefix_lm", options={"decoder_preset": gpt2_preset, **options})
        assert [line for line in ineffective(Config(model=model, train=TrainConfig(lm_lr_scale=0.1)))
                if "lm_lr_scale" in line] == lines
