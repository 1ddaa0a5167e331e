"""An evaluation is of one dataset, one checkpoint and one decoding: a stored result is reused only for
the same ones, a checkpoint of another model folder is read only when it is this model, and the instances
file is checked before any decoding (issue 19's items 6, 7 and 13)."""

import json
import os
import shutil

import pytest

from tests.helpers import coco_split_args, copy_model, run_main


@pytest.fixture(scope="module")
def other_data(trained_model_dir, tmp_path_factory):
    """Another shapes dataset (other images, 6 test images) prepared with the trained model's vocabulary."""
    from data_prep.prepare import PrepareOptions, prepare
    from data_prep.synth import synthesize

    root = str(tmp_path_factory.mktemp("other_shapes"))
    synthesize(root, num_images=60, seed=99, progress=False)
    out = str(tmp_path_factory.mktemp("other_records"))
    prepare(PrepareOptions(output_dir=out, split=coco_split_args(root), workers=1,
                           vocab=os.path.join(trained_model_dir, "vocab.txt")), progress=False)
    return out


@pytest.mark.slow
def test_a_stored_result_is_reused_only_for_the_same_dataset(trained_model_dir, other_data, tmp_path, caplog):
    from captioning.data.prepared import PreparedDataset
    from captioning.evaluation.evaluate import evaluate

    model = tmp_path / "model"
    copy_model(trained_model_dir, model)
    mine = evaluate(str(model), split="test", beam_size=1, max_images=3, progress=False)
    theirs = evaluate(str(model), split="test", beam_size=1, max_images=3, progress=False, data_dir=other_data)
    assert mine.dataset != theirs.dataset == PreparedDataset.load(other_data).identity
    assert theirs.data_dir == os.path.abspath(other_data)
    mine_ids = {p["image_id"] for p in json.load(open(next(model.glob(f"eval/*{mine.dataset[:8]}.predictions.json"))))}
    theirs_ids = {p["image_id"] for p in json.load(open(next(model.glob(
        f"eval/*{theirs.dataset[:8]}.predictions.json"))))}
    assert len(list(model.glob("eval/test-step60-*.json"))) == 4  # two results, two caption files
    with open(next(model.glob(f"eval/*{theirs.dataset[:8]}.json"))) as f:
        assert json.load(f) == json.loads(json.dumps(theirs))
    assert mine_ids and theirs_ids and theirs_ids != mine_ids or theirs.metrics != mine.metrics
    with caplog.at_level("INFO", logger="captioning.evaluation.evaluate"):  # each again: its own stored result
        assert evaluate(str(model), split="test", beam_size=1, max_images=3, progress=False,
                        data_dir=other_data) == theirs
    assert "evaluated already" in caplog.text
    # a stored document that is not of this dataset is not taken, whatever its file name says
    path = next(model.glob(f"eval/*{theirs.dataset[:8]}.json"))
    doctored = dict(theirs, dataset="someone-else", metrics={k: -1.0 for k in theirs.metrics})
    path.write_text(json.dumps(doctored))
    again = evaluate(str(model), split="test", beam_size=1, max_images=3, progress=False, data_dir=other_data)
    assert again.metrics == theirs.metrics and again.dataset == theirs.dataset


@pytest.mark.slow
def test_a_checkpoint_of_another_model_folder_is_read_only_when_it_is_this_model(trained_model_dir,
                                                                                 trained_attention_dir, tmp_path):
    from captioning.evaluation.evaluate import evaluate

    model = tmp_path / "model"
    copy_model(trained_model_dir, model)
    other = os.path.join(trained_attention_dir, "ckpt-40")
    code, _, err = run_main("evaluate", "--model-dir", model, "--checkpoint", other, "--max-images", "2")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"captioning evaluate: error: --checkpoint {other} is not of the model folder {model} and holds a model "
        "with other model.decoder")
    bare = tmp_path / "bare"  # checkpoint files without the folder's config.yaml and vocab.txt
    bare.mkdir()
    for name in os.listdir(trained_model_dir):
        if name.startswith("ckpt-60"):
            shutil.copy(os.path.join(trained_model_dir, name), bare / name)
    code, _, err = run_main("evaluate", "--model-dir", model, "--checkpoint", bare / "ckpt-60", "--max-images", "2")
    assert code == 2 and "has no config.yaml and vocab.txt to tell what it was trained with" in err
    assert not list(model.glob("eval/*-first2-*"))  # nothing decoded, nothing stored
    twin = tmp_path / "twin"  # another folder of the same model: accepted, and its result kept apart
    copy_model(trained_model_dir, twin)
    foreign = evaluate(str(model), split="test", beam_size=1, max_images=2, progress=False,
                       checkpoint=str(twin / "ckpt-60"))
    own = evaluate(str(model), split="test", beam_size=1, max_images=2, progress=False)
    assert foreign.checkpoint == os.path.realpath(twin / "ckpt-60") != own.checkpoint
    assert foreign.metrics == own.metrics  # the same weights
    names = sorted(p.name for p in model.glob("eval/test-step60-beam1-len20-norm0-first2-*.json")
                   if not p.name.endswith("predictions.json"))
    assert len(names) == 2 and sum("-from" in n for n in names) == 1


def test_the_wrong_instances_file_is_found_before_any_decoding(trained_attention_dir, shapes_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(trained_attention_dir, model)
    before = sorted(os.listdir(model / "eval")) if (model / "eval").exists() else []
    wrong = os.path.join(shapes_dir, "annotations", "instances_val.json")
    code, _, err = run_main("evaluate", "--model-dir", model, "--split", "test", "--instances", wrong)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"captioning evaluate: error: --instances {wrong} lists none of the 4 images of split test (e.g. image "
        f"{sorted(json.load(open(os.path.join(shapes_dir, 'annotations', 'captions_test.json')))['images'], key=lambda i: i['id'])[0]['id']}"
        "): give that split's instances file (captioning synth writes annotations/instances_test.json)")
    assert (sorted(os.listdir(model / "eval")) if (model / "eval").exists() else []) == before  # nothing decoded


@pytest.mark.slow
def test_a_result_records_the_decoding_that_ran_and_every_caption(trained_model_dir, tmp_path):
    """Greedy decoding is keyed and recorded as a beam of 1 whatever --beam-size says, sampling as no beam
    (issue 30, item 16); the predictions file holds each image's captions beside the best, so the diversity
    among them is recomputed from it (item 20)."""
    from captioning.evaluation.diversity import distinct, mbleu_4, words
    from captioning.evaluation.evaluate import evaluate

    model = tmp_path / "model"
    copy_model(trained_model_dir, model)

    def results():
        return sorted(p.name for p in model.glob("eval/*.json") if not p.name.endswith(".predictions.json"))

    greedy = evaluate(str(model), split="test", beam_size=7, max_images=2, progress=False,
                      decode_overrides=("decode.method=greedy",))
    assert greedy.beam_size == 1 and greedy.decode["beam_size"] == 1 and greedy.decode["method"] == "greedy"
    assert len(results()) == 1 and results()[0].startswith("test-step60-beam1-len20-norm0-greedy-"), results()
    # another --beam-size with greedy decoding is the same evaluation: the stored result, said to be greedy
    code, out, _ = run_main("evaluate", "--model-dir", model, "--max-images", "2", "--beam-size", "5",
                            "--set", "decode.method=greedy")
    assert code == 0 and "2 images, checkpoint step 60, greedy, perplexity" in out
    assert len(results()) == 1

    sampled = evaluate(str(model), split="test", beam_size=7, max_images=2, progress=False,
                       decode_overrides=("decode.method=sample", "decode.top_k=3"))
    assert sampled.beam_size is None and sampled.decode["beam_size"] is None
    name = next(n for n in results() if n.startswith("test-step60-sample-len20-norm0-sample-"))
    predictions = json.load(open(model / "eval" / name.replace(".json", ".predictions.json")))
    assert len(predictions) == 2 and all(p["caption"] == p["captions"][0] and len(p["captions"]) == 3
                                         for p in predictions)
    every = {p["image_id"]: p["captions"] for p in predictions}
    assert sampled.diversity["captions_per_image"] == 3
    assert mbleu_4(every) == pytest.approx(sampled.diversity["mbleu_4"], rel=1e-9, abs=1e-12)  # summed in another order
    local = [distinct([words(c) for c in texts], 2) for texts in every.values()]
    if None not in local:  # (a model trained 60 steps may say one word)
        assert sum(local) / 2 == pytest.approx(sampled.diversity["local_distinct_2"])
