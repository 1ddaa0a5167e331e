"""``model.decoder: vlm`` over a tiny random PaliGemma preset written with ``save_to_preset`` (tests/harness/
lm_presets.py's ``write_paligemma``; tests/harness/models.py's ``vlm_preset``: a 16 px ViT in patches of 8, one Gemma
layer, a SentencePiece tokenizer trained in the process): the model's logits are keras-hub's own PaliGemma forward
pass over the same prefix and caption; LoRA trains only its adapters and leaves every other weight bit-identical;
refusals are one line; the issue's training command trains on the records and the folder captions. The decoder
contract (tests/test_decoders.py) runs over it too (stepping, beam search, checkpoints, SavedModel, XLA, 2 replicas)."""

import json
import os

import numpy as np
import pytest

from captioning.errors import InputError
from tests.harness.models import vlm_preset
from tests.helpers import REPO, encode, gradient, run_cli, small_train_config

PROMPT_COLUMNS = 1  # <bos> before the prompt


def vlm(*extra):
    """The settings of a vlm model over the tiny preset."""
    return ("model.encoder=vlm", "model.decoder=vlm", f"model.vlm_preset={vlm_preset()}", *extra)


def test_the_models_logits_are_keras_hubs_paligemma_forward_pass():
    """Image tokens, <bos> and "caption en\\n" read both ways, the caption causally: the project's teacher-forced logits
    of a caption (its pieces at columns id + 4, <end> at the LM's <eos>) equal ``PaliGemmaCausalLM``'s own forward
    pass over [<bos>, prompt, caption, <eos>] with its response mask, position by position."""
    import keras_hub

    from captioning.config import ModelConfig
    from captioning.model import build_model
    from captioning.model.prefix_lm import OFFSET
    from captioning.vocab import END_ID, START_ID

    reference = keras_hub.models.PaliGemmaCausalLM.from_preset(vlm_preset())
    tokenizer = reference.preprocessor.tokenizer
    vocabulary = OFFSET + tokenizer.vocabulary_size()
    model = build_model(vocabulary, ModelConfig(decoder="vlm", encoder="vlm", dropout=0.0,
                                                options={"vlm_preset": vlm_preset()}), 16).build_all()
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    prompt = [int(i) for i in tokenizer("caption en\n")]
    caption = [int(i) for i in tokenizer("a red circle left of a blue square")]
    ids = np.array([[tokenizer.start_token_id, *prompt, *caption, tokenizer.end_token_id]] * 2, np.int32)
    response = np.array([[0] * (1 + len(prompt)) + [1] * (len(caption) + 1)] * 2, np.int32)
    theirs = np.asarray(reference({"images": np.asarray(reference.preprocessor.image_converter(images)),
                                   "token_ids": ids, "padding_mask": np.ones_like(ids), "response_mask": response}))
    # the logits at the prompt's last piece (the first word's) and at each of the caption's pieces
    theirs = theirs[:, len(prompt):len(prompt) + len(caption) + 1]
    ours = model({"image": images, "input_ids": np.array([[START_ID] + [i + OFFSET for i in caption]] * 2)}).numpy()
    assert ours.shape == (2, len(caption) + 1, vocabulary)
    live = [i for i in range(tokenizer.vocabulary_size()) if i not in (0, 1, 2, 3)]  # not <pad>, <eos>, <bos>, <unk>
    np.testing.assert_allclose(ours[..., [i + OFFSET for i in live]], theirs[..., live], atol=1e-5)
    np.testing.assert_allclose(ours[..., END_ID], theirs[..., tokenizer.end_token_id], atol=1e-5)
    assert (ours[..., [0, 1, 3]] < -1e8).all()  # <pad>, <start>, <unk>: never proposed


@pytest.mark.parametrize("extra, says", [
    (("model.vlm_preset=",), "model.vlm_preset is not set"),
    (("model.vlm_preset=/nonexistent/paligemma",), "model.vlm_preset: the folder /nonexistent/paligemma does not"),
    (("model.vlm_trainable=some",), "model.vlm_trainable"),
    (("model.lm_lora_rank=0",), "model.lm_lora_rank"),
])
def test_refusals_are_one_line(extra, says, prepared_dir):
    from captioning.experiment import for_training
    from captioning.model import build_model

    with pytest.raises(InputError) as refused:
        cfg = for_training(small_train_config(prepared_dir, *vlm(*extra)))
        build_model(40, cfg.model, 32)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_preset_of_another_family_is_refused_naming_the_families(lm_presets):
    from captioning.config import ModelConfig
    from captioning.model import build_model

    with pytest.raises(InputError, match=r"holds a GPT2Backbone; model.decoder: vlm reads the image-text models "
                                         r"PaliGemmaBackbone$"):
        build_model(40, ModelConfig(decoder="vlm", encoder="vlm", options={"vlm_preset": lm_presets["gpt2"]}), 32)


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
def test_the_issues_train_command_trains_on_the_records_and_the_folder_captions(prepared_dir, tmp_path):
    """``captioning train --config experiments/scenes_vlm.yaml --set model.vlm_preset=PRESET --model-dir DIR`` (the
    records, sizes and steps set small), then ``caption --json``: the folder keeps the preset's tokenizer and
    captions a photo in its words."""
    folder = tmp_path / "vlm"
    small = [f"data.dir={prepared_dir}", "data.image_size=32", "data.resize_size=36", "data.cache=none",
             "data.bucket_boundaries=[6,10]", "train.steps=2", "train.batch_size=4", "train.checkpoint_every_steps=2",
             "train.eval_every_steps=0"]
    sets = [a for s in small for a in ("--set", s)]
    trained = run_cli("train", "--config", os.path.join(REPO, "experiments", "scenes_vlm.yaml"), "--set",
                      f"model.vlm_preset={vlm_preset()}", "--model-dir", folder, *sets)
    assert trained.returncode == 0, trained.stderr[-3000:]
    photo = tmp_path / "photo.png"
    photo.write_bytes(encode(gradient(size=(40, 30)), "PNG"))
    captioned = run_cli("caption", "--model-dir", folder, photo, "--json", "--max-length", "5")
    assert captioned.returncode == 0, captioned.stderr[-3000:]
    [line] = [json.loads(line) for line in captioned.stdout.splitlines()]
    best = line["captions"][0]
    assert isinstance(best["caption"], str) and best["log_prob"] <= 0
