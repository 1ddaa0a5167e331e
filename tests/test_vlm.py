"""``model.decoder: vlm`` over tiny random presets written with ``save_to_preset`` (tests/harness/lm_presets.py's
``write_paligemma`` — tests/harness/models.py's ``vlm_preset``: a 16 px ViT in patches of 8, one Gemma layer — and
``write_gemma3_vision``; SentencePiece tokenizers trained in the process): the model's logits are each family's own
keras-hub forward pass over the same prefix and caption; LoRA trains only its adapters and leaves every other weight bit-identical;
refusals are one line; the issue's training command trains on the records and the folder captions. The decoder
contract (tests/test_decoders.py) runs over it too (stepping, beam search, checkpoints, SavedModel, XLA, 2 replicas)."""

import html
import json
import os

import numpy as np
import pytest

from captioning.errors import InputError
from tests.harness.models import vlm_preset
from tests.helpers import REPO, encode, gradient, run_cli, small_train_config



def vlm(*extra):
    """The settings of a vlm model over the tiny preset."""
    return ("model.encoder=vlm", "model.decoder=vlm", f"model.vlm_preset={vlm_preset()}", *extra)


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """A tiny random preset of each family (tests/harness/lm_presets.py's ``VLM_WRITERS``): PaliGemma's is
    tests/harness/models.py's ``vlm_preset`` (the decoder contract's), the others written here."""
    from tests.harness.lm_presets import VLM_WRITERS

    root = tmp_path_factory.mktemp("vlm_presets")
    return {name: vlm_preset() if name == "paligemma" else write(str(root / name))
            for name, write in VLM_WRITERS.items()}


def paligemma_reference(reference, pixels, prefix, caption, end):
    """PaliGemma's own forward pass (its preprocessor's packing: the prefix, then the response, its mask)."""
    ids = np.array([prefix + caption + [end]] * len(pixels), np.int32)
    response = np.array([[0] * len(prefix) + [1] * (len(caption) + 1)] * len(pixels), np.int32)
    return np.asarray(reference({"images": pixels, "token_ids": ids, "padding_mask": np.ones_like(ids),
                                 "response_mask": response}))


def gemma3_reference(reference, pixels, prefix, caption, end):
    """Gemma 3's own backbone over the prefix (its <img> run spliced with the image) and the caption, then its tied
    embedding reversed."""
    placeholder = reference.preprocessor.tokenizer.image_placeholder_id
    ids = np.array([prefix + caption + [end]] * len(pixels), np.int32)
    where = np.flatnonzero(ids[0] == placeholder)
    hidden = reference.backbone({"images": pixels[:, None], "token_ids": ids, "padding_mask": np.ones_like(ids),
                                 "vision_mask": ids == placeholder,
                                 "vision_indices": np.tile(where[None], (len(pixels), 1)).astype(np.int32)})
    return np.asarray(reference.backbone.token_embedding(hidden, reverse=True))


def blip2_reference(reference, pixels, prefix, caption, end):
    """BLIP-2's own backbone (its query tokens, then the text, OPT's positions from 2) and OPT's tied embedding
    reversed over the text's positions."""
    ids = np.array([prefix + caption + [end]] * len(pixels), np.int32)
    hidden = reference.backbone({"images": pixels, "token_ids": ids, "padding_mask": np.ones_like(ids)})
    queries = reference.backbone.num_query_tokens
    return np.asarray(reference.backbone.language_model.token_embedding(hidden[:, queries:], reverse=True))


REFERENCES = {"paligemma": paligemma_reference, "gemma3": gemma3_reference, "blip2": blip2_reference,
              "paligemma2": paligemma_reference}
FAMILIES = ("blip2", "gemma3", "paligemma")  # trained through the command (PaliGemma 2 is PaliGemma's class)


@pytest.mark.parametrize("family", sorted(REFERENCES))
def test_the_models_logits_are_keras_hubs_own_forward_pass(family, presets):
    """PaliGemma: image tokens, <bos> and "caption en\\n" read both ways, the caption causally; Gemma 3: <bos>, its
    prompt with the image tokens spliced in at <img> (both ways among themselves), the rest causally, its sliding
    window of 4 crossed; BLIP-2: the Q-Former's query tokens, </s> and "a photo of", causal, OPT's learned positions;
    PaliGemma 2: PaliGemma over Gemma 2 (soft caps, post-norms, a sliding window of 4 crossed). The project's teacher-forced logits of a caption (its pieces at columns id + 4, <end> at the
    LM's <eos>) equal the family's own keras-hub forward pass over the same sequence, position by position."""
    import keras_hub

    from captioning.config import ModelConfig
    from captioning.model import build_model
    from captioning.model.prefix_lm import OFFSET
    from captioning.vocab import END_ID, START_ID

    preset = presets[family]
    reference = keras_hub.models.CausalLM.from_preset(preset) if family != "blip2" else (
        keras_hub.models.BLIP2CausalLM.from_preset(preset))  # (CausalLM.from_preset finds BLIP2Seq2SeqLM first)
    tokenizer = reference.preprocessor.tokenizer
    vocabulary = OFFSET + tokenizer.vocabulary_size()
    model = build_model(vocabulary, ModelConfig(decoder="vlm", encoder="vlm", dropout=0.0,
                                                options={"vlm_preset": preset}), 16).build_all()
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    pixels = np.asarray(reference.preprocessor.image_converter(images))
    caption = [int(i) for i in tokenizer("a red circle left of a blue square")]
    prefix = model.prefix_ids
    assert prefix[0] == tokenizer.start_token_id and len(prefix) > 2
    theirs = REFERENCES[family](reference, pixels, prefix, caption, tokenizer.end_token_id)
    # the logits at the prefix's last piece (the first word's) and at each of the caption's pieces
    at = len(prefix) - 1  # (PaliGemma's output leaves out its image positions, which come before its text)
    theirs = theirs[:, at:at + len(caption) + 1]
    ours = model({"image": images, "input_ids": np.array([[START_ID] + [i + OFFSET for i in caption]] * 2)}).numpy()
    assert ours.shape == (2, len(caption) + 1, vocabulary)
    special = set(int(i) - OFFSET for i in model.special.numpy().nonzero()[0] + OFFSET)
    live = [i for i in range(tokenizer.vocabulary_size()) if i not in special]
    assert len(live) > 50 and {tokenizer.start_token_id, tokenizer.end_token_id, tokenizer.pad_token_id} <= special
    np.testing.assert_allclose(ours[..., [i + OFFSET for i in live]], theirs[..., live], atol=1e-5)
    np.testing.assert_allclose(ours[..., END_ID], theirs[..., tokenizer.end_token_id], atol=1e-5)
    assert (ours[..., [0, 1, 3]] < -1e8).all()  # <pad>, <start>, <unk>: never proposed
    assert (ours[..., [i + OFFSET for i in special if i + OFFSET < vocabulary]] < -1e8).all()


@pytest.mark.parametrize("extra, says", [
    (("model.vlm_trainable=none", "model.encoder_trainable=false"), "every weight of the model is frozen"),
    (("model.vlm_preset=",), "model.vlm_preset is not set"),
    (("model.vlm_preset=/nonexistent/paligemma",), "model.vlm_preset: the folder /nonexistent/paligemma does not"),
    (("model.vlm_trainable=some",), "model.vlm_trainable"),
    (("model.lm_lora_rank=0",), "model.lm_lora_rank"),
])
def test_refusals_are_one_line(extra, says, prepared_dir, tmp_path):
    """Bad settings, and a model of which nothing would train, are refused in one line before anything is
    written."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    folder = tmp_path / "m"
    with pytest.raises(InputError) as refused:
        cfg = for_training(small_train_config(prepared_dir, *vlm(*extra)))
        Trainer(cfg, str(folder))
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not folder.exists()  # a refused run writes nothing


def test_a_preset_of_another_family_or_a_text_only_gemma3_is_refused_naming_the_families(lm_presets, tmp_path):
    from captioning.config import ModelConfig
    from captioning.model import build_model
    from tests.harness.lm_presets import tiny_backbone

    families = r"model.decoder: vlm reads the image-text models BLIP2Backbone, Gemma3Backbone, PaliGemmaBackbone$"
    with pytest.raises(InputError, match=r"holds a GPT2Backbone; " + families):
        build_model(40, ModelConfig(decoder="vlm", encoder="vlm", options={"vlm_preset": lm_presets["gpt2"]}), 32)
    tiny_backbone("gemma3").save_to_preset(str(tmp_path / "text_only"))
    with pytest.raises(InputError, match=r"holds a Gemma3Backbone without a vision encoder; " + families):
        build_model(40, ModelConfig(decoder="vlm", encoder="vlm", options={"vlm_preset": str(tmp_path / "text_only")}),
                    32)


@pytest.mark.slow  # a Trainer.run
def test_lora_trains_only_the_adapters_and_every_other_weight_stays_bit_identical(prepared_dir, tmp_path):
    """vlm_trainable: lora (the default), rank 2: the trainable variables are the LM's adapters (a and b of the query
    and value projections of its one layer: 4), none of the vision tower's; 3 steps move the adapters and leave every
    other weight, the ViT's LoRA-wrapped projections included, bit-identical."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, *vlm("model.lm_lora_rank=2", "model.encoder_trainable=false",
                                                "train.steps=3", "train.optimizer=adam",
                                                "train.learning_rate=0.01"))
    trainer = Trainer(for_training(cfg), str(tmp_path / "m"))
    trained = [v.path for v in trainer.model.trainable_variables]
    assert sorted(trained) == sorted(f"decoder_block_0/attention/{p}/lora_kernel_{k}" for p in ("query", "value")
                                     for k in "ab"), trained
    before = {v.path + f"#{i}": v.numpy().copy() for i, v in enumerate(trainer.model.weights)}
    trainer.run(progress=False)
    after = {v.path + f"#{i}": v.numpy() for i, v in enumerate(trainer.model.weights)}
    moved = sorted(k.split("#")[0] for k in before if not np.array_equal(before[k], after[k]))
    assert moved and set(moved) <= set(trained), moved
    assert "decoder_block_0/attention/query/lora_kernel_b" in moved  # b starts at zero: the update reached it


@pytest.mark.slow  # a training run and a caption through the command line
@pytest.mark.parametrize("family", FAMILIES)
def test_the_issues_train_command_trains_on_the_records_and_the_folder_captions(family, presets, prepared_dir,
                                                                                 tmp_path):
    """``captioning train --config experiments/scenes_vlm.yaml --set model.vlm_preset=PRESET --model-dir DIR`` (the
    records, sizes and steps set small) over each family, then ``caption --json``: the folder keeps the preset's
    tokenizer and captions a photo in its words."""
    preset = presets[family]
    folder = tmp_path / "vlm"
    small = [f"data.dir={prepared_dir}", "data.image_size=32", "data.resize_size=36", "data.cache=none",
             "data.bucket_boundaries=[6,10]", "train.steps=2", "train.batch_size=4", "train.checkpoint_every_steps=2",
             "train.eval_every_steps=0"]
    sets = [a for s in small for a in ("--set", s)]
    trained = run_cli("train", "--config", os.path.join(REPO, "experiments", "scenes_vlm.yaml"), "--set",
                      f"model.vlm_preset={preset}", "--model-dir", folder, *sets)
    assert trained.returncode == 0, trained.stderr[-3000:]
    import yaml

    saved = yaml.safe_load((folder / "config.yaml").read_text())["model"]  # LoRA, the vision tower frozen
    assert (saved["vlm_trainable"], saved["encoder_trainable"], saved["lm_lora_rank"]) == ("lora", False, 4), saved
    photo = tmp_path / "photo.png"
    photo.write_bytes(encode(gradient(size=(40, 30)), "PNG"))
    gallery = tmp_path / "gallery.html"
    captioned = run_cli("caption", "--model-dir", folder, photo, "--json", "--max-length", "5", "--html", gallery)
    assert captioned.returncode == 0, captioned.stderr[-3000:]
    [line] = [json.loads(line) for line in captioned.stdout.splitlines()]
    best = line["captions"][0]
    assert isinstance(best["caption"], str) and best["log_prob"] <= 0
    page = gallery.read_text()  # the HTML gallery: the photo inlined and its caption (escaped as the page does)
    assert "data:image/" in page and html.escape(best["caption"]) in page


@pytest.fixture(scope="module")
def lora_folder(prepared_dir, tmp_path_factory):
    """A PaliGemma model of rank-2 LoRA adapters trained 4 steps (Adam at 0.01: the adapters move) on the shapes
    fixture, in a module folder (only read by the tests)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    folder = str(tmp_path_factory.mktemp("vlm_lora") / "model")
    cfg = small_train_config(prepared_dir, *vlm("model.lm_lora_rank=2", "model.encoder_trainable=false",
                                                "train.steps=4", "train.optimizer=adam", "train.learning_rate=0.01",
                                                "train.checkpoint_every_steps=4"))
    Trainer(for_training(cfg), folder).run(progress=False)
    return folder


GREEDY = ("--beam-size", "1", "--max-length", "5")  # the exports' and caption's decoding: the cheapest to trace


def saved_variables(folder) -> list[str]:
    """The variables a SavedModel holds (by index: the export keeps the serving functions' variables)."""
    import tensorflow as tf

    return [name for name, _ in tf.train.list_variables(os.path.join(folder, "variables", "variables"))]


@pytest.mark.slow  # two exports and a caption
def test_export_merge_lora_holds_no_adapter_and_captions_as_the_adapted_model(lora_folder, tmp_path):
    """``export --merge-lora``: the SavedModel holds no LoRA adapter (an export without the flag does) and captions as
    ``caption`` does with the adapters (the same best captions, log-probabilities within float rounding); a rerun is
    a no-op; --merge-lora for a LiteRT file, and for a model without adapters, are refused in one line."""
    import tensorflow as tf

    photos = []
    for i, size in enumerate([(40, 30), (64, 64)]):
        photos.append(tmp_path / f"p{i}.png")
        photos[-1].write_bytes(encode(gradient(size=size).rotate(50 * i), "PNG"))
    merged, plain = tmp_path / "merged", tmp_path / "plain"
    done = run_cli("export", "--model-dir", lora_folder, "--merge-lora", "--output", merged, *GREEDY)
    assert done.returncode == 0 and "(the LoRA adapters merged into their weights)" in done.stdout, done.stderr[-2000:]
    assert run_cli("export", "--model-dir", lora_folder, "--output", plain, *GREEDY).returncode == 0
    from captioning import inference
    from captioning.model.lora import adapted_layers

    adapted = len(adapted_layers(inference.load(lora_folder).model.lora_backbone()))
    assert adapted == 4  # the query and value projections of the ViT's layer and of the LM's
    assert len(saved_variables(plain)) - len(saved_variables(merged)) == 2 * adapted  # no a, no b
    assert json.loads((merged / "captioning_export.json").read_text())["lora"] == "merged"
    again = run_cli("export", "--model-dir", lora_folder, "--merge-lora", "--output", merged, *GREEDY)
    assert again.returncode == 0 and again.stdout.startswith("already exported"), again.stdout
    captioned = run_cli("caption", "--model-dir", lora_folder, *photos, "--json", *GREEDY)
    assert captioned.returncode == 0, captioned.stderr[-2000:]
    best = [json.loads(line)["captions"][0] for line in captioned.stdout.splitlines()]
    out = tf.saved_model.load(str(merged)).signatures["serving_default"](
        images=tf.constant([p.read_bytes() for p in photos]))
    assert [c.decode() for c in out["captions"].numpy()[:, 0]] == [b["caption"] for b in best]
    np.testing.assert_allclose(out["log_probs"].numpy()[:, 0], [b["log_prob"] for b in best], atol=1e-4)
    refused = run_cli("export", "--model-dir", lora_folder, "--merge-lora", "--format", "litert", "--output",
                      tmp_path / "m.tflite")
    assert refused.returncode == 2 and "--merge-lora applies to a SavedModel" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # an export, and keras-hub's model loaded beside ours
def test_the_lora_file_loads_into_the_keras_hub_preset_and_gives_the_trained_models_logits(lora_folder, tmp_path):
    """``export --format lora``: keras-hub's own ``.lora.h5`` file, which ``load_lora_weights`` puts into a fresh
    ``PaliGemmaCausalLM`` of the preset: its forward pass then gives the trained model's logits (its vision tower
    stayed the preset's: frozen); a rerun is a no-op, another model's adapters need --overwrite, a name without
    .lora.h5 is refused in one line."""
    import keras_hub

    from captioning import inference
    from captioning.model.prefix_lm import OFFSET
    from captioning.vocab import START_ID

    path = tmp_path / "adapters.lora.h5"
    done = run_cli("export", "--model-dir", lora_folder, "--format", "lora", "--output", path)
    assert done.returncode == 0 and done.stdout.startswith(f"exported the LoRA adapters to {path}"), done.stderr
    again = run_cli("export", "--model-dir", lora_folder, "--format", "lora", "--output", path)
    assert again.returncode == 0 and again.stdout.startswith("already exported"), again.stdout
    reference = keras_hub.models.PaliGemmaCausalLM.from_preset(vlm_preset())
    reference.backbone.load_lora_weights(str(path))
    trained = inference.load(lora_folder, weights="raw")
    tokenizer = reference.preprocessor.tokenizer
    size = trained.model.image_size  # 32 px crops, resized to the preset's 16 inside the encoder
    images = np.random.default_rng(2).integers(0, 256, (2, size, size, 3), dtype=np.uint8)
    pixels = np.asarray(trained.model.image_encoder.preprocess(images.astype(np.float32)))  # what the ViT reads
    assert pixels.shape == (2, 16, 16, 3)
    caption = [int(i) for i in tokenizer("two red squares")]
    prefix = trained.model.prefix_ids
    theirs = paligemma_reference(reference, pixels, prefix, caption,
                                 tokenizer.end_token_id)[:, len(prefix) - 1:len(prefix) + len(caption)]
    ours = trained.model({"image": images,
                          "input_ids": np.array([[START_ID] + [i + OFFSET for i in caption]] * 2)}).numpy()
    live = [i for i in range(tokenizer.vocabulary_size()) if i > 3]
    assert np.abs(theirs).max() > 1e-3
    np.testing.assert_allclose(ours[..., [i + OFFSET for i in live]], theirs[..., live], atol=1e-4)
    other = tmp_path / "other.lora.h5"  # the untrained adapters of the preset: other values
    fresh = keras_hub.models.PaliGemmaBackbone.from_preset(vlm_preset())
    fresh.enable_lora(2)
    fresh.save_lora_weights(str(other))
    for output, says in ((tmp_path / "adapters.h5", "a LoRA file's name ends in .lora.h5"),
                         (other, "holds other LoRA adapters; pass --overwrite")):
        refused = run_cli("export", "--model-dir", lora_folder, "--format", "lora", "--output", output)
        # one line saying why, the last (the second refusal comes after the model loaded: its log lines first)
        assert refused.returncode == 2 and says in refused.stderr.strip().splitlines()[-1], refused.stderr
        assert "Traceback" not in refused.stderr
    replaced = run_cli("export", "--model-dir", lora_folder, "--format", "lora", "--output", other, "--overwrite")
    assert replaced.returncode == 0 and open(other, "rb").read() == open(path, "rb").read()


@pytest.mark.slow  # an evaluation with METEOR's JVM
def test_evaluate_with_instances_scores_a_vlm_model(lora_folder, shapes_dir):
    """The issue's ``evaluate --model-dir DIR --split test --instances ...``: COCO metrics, CHAIR and diversity of
    the captions of a vlm model, stored in its folder."""
    done = run_cli("evaluate", "--model-dir", lora_folder, "--split", "test", "--beam-size", "2", "--max-length", "6",
                   "--instances", os.path.join(shapes_dir, "annotations", "instances_test.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("test: 4 images") and "CIDEr" in done.stdout and "CHAIR" in done.stdout, done.stdout


@pytest.mark.slow  # three Trainer runs
def test_a_resumed_run_restores_the_adapters_and_the_optimizer_and_equals_an_uninterrupted_run(prepared_dir, tmp_path):
    """LoRA training stopped at step 2, started again in the folder: before its first step the model's every weight
    (the adapters, drawn at random when LoRA is enabled, among them) and the optimizer's every variable (Adam's
    moments of the adapters, its step) are those the first run ended with; it trains on to step 4 on the batches
    an uninterrupted run sees (``data.deterministic: true`` replays the stream), and ends with that run's weights,
    bit for bit."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    def trainer(steps, folder="m"):
        cfg = small_train_config(prepared_dir, *vlm("model.lm_lora_rank=2", "model.encoder_trainable=false",
                                                    f"train.steps={steps}", "train.optimizer=adam",
                                                    "train.learning_rate=0.01", "train.checkpoint_every_steps=2",
                                                    "data.deterministic=true"))
        return Trainer(for_training(cfg), str(tmp_path / folder))

    first = trainer(2)
    assert first.run(progress=False).step == 2
    weights = {v.path + f"#{i}": v.numpy() for i, v in enumerate(first.model.weights)}
    moments = {v.path + f"#{i}": v.numpy() for i, v in enumerate(first.optimizer.variables)}
    assert any("lora_kernel_b" in k and np.abs(v).max() > 0 for k, v in moments.items())  # Adam's moments moved
    second = trainer(4)  # restored as it starts
    assert int(second.step.numpy()) == 2
    for key, value in weights.items():
        np.testing.assert_array_equal(second.model.weights[int(key.split("#")[1])].numpy(), value, err_msg=key)
    for key, value in moments.items():
        np.testing.assert_array_equal(second.optimizer.variables[int(key.split("#")[1])].numpy(), value,
                                      err_msg=key)
    resumed = second.run(progress=False)
    whole = trainer(4, "uninterrupted")
    uninterrupted = whole.run(progress=False)
    assert resumed.step == uninterrupted.step == 4
    assert resumed.losses == uninterrupted.losses[2:], (resumed.losses, uninterrupted.losses)  # the same batches
    for mine, theirs in zip(second.model.weights, whole.model.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=mine.path)


@pytest.mark.slow  # SCST steps, and an accumulated run with the weight average
def test_scst_rewards_words_and_accumulation_with_the_average_trains_the_adapters(prepared_dir, tmp_path):
    """SCST on a vlm model: the reward (CIDEr-D of the samples' detokenized words) is finite and the adapters move,
    the rest of the model bit-identical; then ``train.accumulate_steps: 2`` with ``train.ema_decay: 0.5``: the
    average follows the adapters only (the frozen weights have none) and a folder loads with either."""
    import math

    from captioning import inference
    from captioning.experiment import for_training
    from captioning.train import Trainer

    scst = ("train.objective=scst", "data.captions_per_image=grouped", "scst.samples=3", "train.batch_size=10",
            "scst.max_length=8")
    cfg = small_train_config(prepared_dir, *vlm("model.lm_lora_rank=2", "model.encoder_trainable=false",
                                                "train.optimizer=adam", "train.learning_rate=0.01", *scst))
    trainer = Trainer(for_training(cfg), str(tmp_path / "scst"))
    assert trainer.objective.words is not None  # the reward reads words, not SentencePiece pieces
    before = {v.path + f"#{i}": v.numpy().copy() for i, v in enumerate(trainer.model.weights)}
    dataset = trainer.distributed_dataset(cfg.data.train_split, training=True)
    step, batches = trainer.train_step_for(dataset), iter(dataset)
    outs = [{k: float(v) for k, v in step(next(batches)).items()} for _ in range(3)]
    assert all(math.isfinite(o["loss"]) and math.isfinite(o["reward"]) and o["reward"] >= 0 for o in outs), outs
    trained = {v.path for v in trainer.model.trainable_variables}
    moved = {k.split("#")[0] for k, v in before.items()
             if not np.array_equal(v, trainer.model.weights[int(k.split("#")[1])].numpy())}
    assert moved and moved <= trained, moved

    cfg = small_train_config(prepared_dir, *vlm("model.lm_lora_rank=2", "model.encoder_trainable=false",
                                                "train.optimizer=adam", "train.learning_rate=0.01",
                                                "train.accumulate_steps=2", "train.ema_decay=0.5", "train.steps=2",
                                                "train.checkpoint_every_steps=2"))
    folder = str(tmp_path / "ema")
    trainer = Trainer(for_training(cfg), folder)
    averaged = [v.path for v, _ in trainer.average.pairs]
    assert averaged and set(averaged) == {v.path for v in trainer.model.trainable_variables}
    assert trainer.run(progress=False).step == 2
    raw, ema = inference.load(folder, weights="raw"), inference.load(folder, weights="ema")
    adapters = {v.path: v.numpy() for v in raw.model.weights if "lora_kernel_b" in v.path}
    averages = {v.path: v.numpy() for v in ema.model.weights if "lora_kernel_b" in v.path}
    assert adapters.keys() == averages.keys() and any(not np.array_equal(adapters[k], averages[k]) for k in adapters)


@pytest.mark.slow  # a training run
def test_a_folder_whose_preset_moved_says_so_in_one_line(prepared_dir, tmp_path):
    """The model folder records the preset it started from (config.yaml's model.vlm_preset, absolute): evaluate and
    caption on a folder whose preset is no longer there say so in one line, exit 2."""
    import shutil

    from captioning.experiment import for_training
    from captioning.train import Trainer

    preset = str(tmp_path / "preset")
    shutil.copytree(vlm_preset(), preset)
    cfg = small_train_config(prepared_dir, "model.encoder=vlm", "model.decoder=vlm", f"model.vlm_preset={preset}",
                             "train.steps=1", "train.checkpoint_every_steps=1")
    folder = str(tmp_path / "m")
    Trainer(for_training(cfg), folder).run(progress=False)
    assert f"vlm_preset: {preset}" in open(os.path.join(folder, "config.yaml")).read()
    shutil.move(preset, str(tmp_path / "elsewhere"))
    photo = tmp_path / "p.png"
    photo.write_bytes(encode(gradient(size=(20, 20)), "PNG"))
    for args in (("evaluate", "--model-dir", folder, "--split", "test"), ("caption", "--model-dir", folder, photo)):
        done = run_cli(*args)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"model.vlm_preset: the folder {preset} does not exist (moved or deleted?)" in done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow  # a server
def test_serve_answers_as_caption_does(lora_folder, tmp_path):
    """``captioning serve --model-dir DIR``'s server (on 127.0.0.1, a free port) answers a posted photo with the record
    ``caption --json`` prints for it, the best caption first, no attention (a language model's layers give none)."""
    from captioning import inference
    from captioning.benchmarks.serve import post
    from captioning.inference.serve import start

    photo = tmp_path / "photo.png"
    photo.write_bytes(encode(gradient(size=(48, 36)), "PNG"))
    captioned = run_cli("caption", "--model-dir", lora_folder, photo, "--json")
    assert captioned.returncode == 0, captioned.stderr[-2000:]
    [expected] = [json.loads(line) for line in captioned.stdout.splitlines()]
    running = start(inference.Captioner(inference.load(lora_folder)), port=0)
    try:
        assert running.url.startswith("http://127.0.0.1:")
        status, body = post(running.url + "caption", [("image", "photo.png", photo.read_bytes())])
    finally:
        running.stop()
    [record] = json.loads(body)
    assert status == 200 and record["captions"] == expected["captions"] and record["image"] == "photo.png"
    assert "attention" not in record["captions"][0]


@pytest.mark.slow  # conftest's distributed_runs (2 logical CPUs, a process of its own)
def test_two_mirrored_replicas_train_the_adapters_as_one_device(distributed_runs):
    """LoRA under MirroredStrategy: one step on 2 replicas (clipping at 0.05 active, the halves' token counts unequal)
    gives the loss and every weight one device gives — the adapters moved (their b starts at zero), the frozen
    weights (the ViT's, the LM's kernels) as they were."""
    from tests.helpers import distributed_result

    r = np.load(os.path.join(distributed_result(distributed_runs, "mirrored", "vlm_lora"), "mirrored.npz"))
    assert int(r["one_replicas"]) == 1 and int(r["two_replicas"]) == 2
    assert r["tokens_first_half"] != r["tokens_second_half"] and float(r["one_norm"]) > 0.05
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    moved = sorted(np.abs(r["one/" + n]).max() > 0 for n in names if n.endswith("lora_kernel_b"))
    assert moved == [False, False, True, True]  # the ViT's two stay at zero (frozen), the LM's two moved
    for key in names:
        np.testing.assert_allclose(r["two/" + key], r["one/" + key], atol=1e-5, err_msg=key)


def own_log_prob(model, crop, ids, length, max_length):
    """A caption's log-probability by the model's own teacher-forced pass over its pieces (and <end> when it ended
    before ``max_length``)."""
    from captioning.vocab import END_ID, START_ID

    pieces = [int(i) for i in ids[:length]]
    logits = model({"image": crop[None], "input_ids": np.array([[START_ID] + pieces])}).numpy()[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))  # log-softmax
    return sum(logp[t, p] for t, p in enumerate(pieces)) + (logp[len(pieces), END_ID] if length < max_length else 0.0)


@pytest.mark.slow  # a Captioner traced per decoding
def test_decoding_options_over_a_vlm_model(lora_folder, tmp_path):
    """The decoding toolbox over a vlm model's pieces: greedy and beam search (best first, each caption's
    log-probability the model's own), diverse beams (the groups start apart), seeded sampling (the same seed, the
    same captions) and n-gram blocking over the words the pieces spell (no word twice in a row)."""
    import tensorflow as tf

    from captioning import inference
    from captioning.config import DecodeConfig

    trained = inference.load(lora_folder)
    photos = [encode(gradient(size=size).rotate(30 * i), "PNG") for i, size in enumerate([(40, 30), (64, 64)])]

    def decoded(**options):
        out = inference.Captioner(trained, DecodeConfig(**options)).decode(tf.constant(photos))
        return {k: out[k].numpy() for k in ("ids", "lengths", "log_probs", "scores", "images")}

    for options in (dict(method="greedy", max_length=6), dict(beam_size=3, top_k=3, max_length=6)):
        out = decoded(**options)
        for i in range(2):
            for k in range(out["ids"].shape[1]):
                want = own_log_prob(trained.model, out["images"][i], out["ids"][i, k], out["lengths"][i, k], 6)
                assert out["log_probs"][i, k] == pytest.approx(want, abs=1e-4)
            assert list(out["scores"][i]) == sorted(out["scores"][i], reverse=True)
    diverse = decoded(beam_size=4, beam_groups=2, diversity=100.0, top_k=2, max_length=6)
    assert all(diverse["ids"][:, 0, 0] != diverse["ids"][:, 1, 0])
    sampled = [decoded(method="sample", top_k=2, seed=7, max_length=6)["ids"] for _ in range(2)]
    np.testing.assert_array_equal(sampled[0], sampled[1])
    words = trained.vocab
    blocked = decoded(method="greedy", max_length=12, block_ngrams=1)
    for ids, length in zip(blocked["ids"][:, 0], blocked["lengths"][:, 0]):
        said = words.decode([int(i) for i in ids[:length]])
        complete = said[:-1] if length == 12 else said  # a last word cut at max_length is left out
        assert all(a != b for a, b in zip(complete, complete[1:])), said


@pytest.mark.slow  # two Trainers and a step
def test_a_preset_saved_in_bfloat16_trains_in_mixed_precision_unless_told(prepared_dir, tmp_path):
    """model.vlm_precision: auto (the default) computes in mixed precision for a preset saved in bfloat16 (as the real
    ones are): bfloat16 compute, float32 variables, a finite step; vlm_precision: float32 keeps float32, and a
    float32 preset trains in float32."""
    import math

    from captioning.experiment import for_training
    from captioning.model.vlm import preset_dtype
    from captioning.train import Trainer
    from tests.harness.lm_presets import write_paligemma

    low = write_paligemma(str(tmp_path / "bf16"), dtype="bfloat16")
    assert preset_dtype(low) == "bfloat16" and preset_dtype(vlm_preset()) == "float32"
    for preset, extra, compute in ((low, (), "bfloat16"), (low, ("model.vlm_precision=float32",), "float32"),
                                   (vlm_preset(), (), "float32")):
        cfg = small_train_config(prepared_dir, "model.encoder=vlm", "model.decoder=vlm", f"model.vlm_preset={preset}",
                                 "train.steps=1", *extra)
        trainer = Trainer(for_training(cfg), str(tmp_path / f"m-{compute}-{len(extra)}-{preset == low}"))
        assert trainer.model.backbone.compute_dtype == compute, (preset, extra)
        assert {v.dtype for v in trainer.model.trainable_variables} == {"float32"}
        if compute == "bfloat16":
            dataset = trainer.distributed_dataset(cfg.data.train_split, training=True)
            out = trainer.train_step_for(dataset)(next(iter(dataset)))
            assert math.isfinite(float(out["loss"]))
