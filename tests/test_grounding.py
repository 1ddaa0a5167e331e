"""Grounding metrics: naming accuracy and attention localisation, on hand-computed cases and a real
synth run."""

import json
import os

import numpy as np
import pytest

from captioning.errors import InputError
from captioning.evaluation.grounding import attention_localisation, box_coverage, load_instances, naming_accuracy
from captioning.text import tokenize_caption
from data_prep.shapes import COLORS, KINDS
from data_prep.synth import load_split

UNIFORM = [0.25] * 4


def write_instances(tmp_path, images, name="instances.json") -> str:
    """A real instances file: ``images`` = [(id, width, height, [(kind, colour, size, bbox), ...])]."""
    annotations = [{"id": n, "image_id": image_id, "category_id": KINDS.index(kind) + 1, "bbox": list(bbox),
                    "area": bbox[2] * bbox[3], "iscrowd": 0, "attributes": {"color": color, "size": size}}
                   for n, (image_id, _, _, shapes) in enumerate(images)
                   for kind, color, size, bbox in shapes]
    data = {"info": {}, "licenses": [], "annotations": annotations,
            "images": [{"id": i, "file_name": f"{i}.jpg", "width": w, "height": h} for i, w, h, _ in images],
            "categories": [{"id": i, "name": k, "supercategory": "shape"} for i, k in enumerate(KINDS, 1)]}
    path = str(tmp_path / name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


def one_image(tmp_path, *shapes, width=100, height=100):
    """Instances of one image (id 1) with ``shapes``: (kind, colour, size, bbox) each."""
    return load_instances(write_instances(tmp_path, [(1, width, height, list(shapes))]))


def localise(instances, words, weights, grid=(2, 2), resize_size=100, image_size=100, image_id=1):
    return attention_localisation(instances, {image_id: (words.split(), weights)}, grid, resize_size, image_size)


def test_load_instances(tmp_path):
    path = write_instances(tmp_path, [(1, 100, 80, [("circle", "red", "small", (0, 0, 50, 40)),
                                                    ("square", "blue", "large", (50, 40, 50, 40))]),
                                      (2, 60, 60, [])])
    instances = load_instances(path)
    assert instances.kinds == KINDS and instances.colors == ("blue", "red")
    image = instances.images[1]
    assert (image.width, image.height, len(image.shapes)) == (100, 80, 2)
    assert (image.shapes[1].kind, image.shapes[1].color, image.shapes[1].size) == ("square", "blue", "large")
    assert image.shapes[1].bbox == (50.0, 40.0, 50.0, 40.0)
    assert instances.images[2].shapes == ()


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "is not JSON"),
    ('{"images": [], "annotations": []}', "not a shapes instances file: no 'categories'"),
    ('[1, 2]', "not a shapes instances file"),
])
def test_load_instances_refuses_missing_and_garbled_files(tmp_path, content, message):
    path = tmp_path / "instances.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError, match=message) as refused:
        load_instances(str(path))
    assert refused.value.params == ("instances",) and "\n" not in str(refused.value)


def test_load_instances_refuses_annotations_without_colours(tmp_path):
    path = write_instances(tmp_path, [(1, 100, 100, [("circle", "red", "small", (0, 0, 10, 10))])])
    data = json.load(open(path))
    del data["annotations"][0]["attributes"]  # real COCO's instances files have none
    json.dump(data, open(path, "w"))
    with pytest.raises(InputError, match="no 'attributes'") as refused:
        load_instances(path)
    assert refused.value.params == ("instances",)


def test_box_on_exactly_one_cell(tmp_path):
    instances = one_image(tmp_path, ("circle", "red", "small", (50, 0, 50, 50)))
    assert box_coverage((50, 0, 50, 50), 100, 100, (2, 2), 100, 100).tolist() == [0, 1, 0, 0]
    result = localise(instances, "a red circle", [UNIFORM, [0.1, 0.6, 0.2, 0.1], [0.3, 0.3, 0.3, 0.1]])
    red, circle = result.color["1"], result.kind["1"]
    assert (red.words, red.mean_mass, red.mean_area, red.ratio_of_means, red.mean_ratio) == (1, 0.6, 0.25, 2.4, 2.4)
    assert (circle.words, circle.mean_mass, circle.mean_area) == (1, 0.3, 0.25)
    assert result.color["all"] == red and result.color["2"].words == 0 and result.color["2"].mean_mass is None


def test_box_straddling_cells(tmp_path):
    # x 10..70 covers 40/50 of column 0 and 20/50 of column 1; y 0..30 covers 30/50 of row 0
    np.testing.assert_allclose(box_coverage((10, 0, 60, 30), 100, 100, (2, 2), 100, 100), [0.48, 0.24, 0, 0])
    instances = one_image(tmp_path, ("square", "green", "large", (10, 0, 60, 30)))
    result = localise(instances, "green square", [[0.5, 0.5, 0, 0], UNIFORM])
    green, square = result.color["all"], result.kind["all"]
    assert green.mean_mass == pytest.approx(0.36) and green.mean_area == pytest.approx(0.18)
    assert green.ratio_of_means == pytest.approx(2.0) and green.mean_ratio == pytest.approx(2.0)
    assert square.mean_mass == pytest.approx(0.18) and square.ratio_of_means == pytest.approx(1.0)
    # two colour words with ratios 2 and 4: the mean of ratios and the ratio of means differ
    two = one_image(tmp_path, ("square", "green", "large", (10, 0, 60, 30)),
                    ("circle", "red", "small", (50, 50, 50, 50)))
    both = localise(two, "green square red circle", [[0.5, 0.5, 0, 0], UNIFORM, [0, 0, 0, 1], UNIFORM]).color["2"]
    assert both.mean_mass == pytest.approx((0.36 + 1) / 2) and both.mean_area == pytest.approx((0.18 + 0.25) / 2)
    assert both.ratio_of_means == pytest.approx(1.36 / 0.43) and both.mean_ratio == pytest.approx((2 + 4) / 2)


def test_squash_resize_crop_mapping():
    # 300 x 150 squashed to 60 x 60 (x * 0.2, y * 0.4), the central 40 from (10, 10), 20-px cells
    np.testing.assert_allclose(box_coverage((100, 50, 100, 50), 300, 150, (2, 2), 60, 40), [0.25] * 4)
    assert box_coverage((0, 0, 150, 75), 300, 150, (2, 2), 60, 40).tolist() == [1, 0, 0, 0]  # clipped by the crop
    assert box_coverage((0, 0, 40, 20), 300, 150, (2, 2), 60, 40).tolist() == [0] * 4  # wholly cropped away
    # an odd margin: R = 61, S = 40 crops from (61 - 40) // 2 = 10, not 10.5; 122 x 61 scales x by 0.5, y by 1
    np.testing.assert_allclose(box_coverage((20, 10, 40, 30), 122, 61, (2, 2), 61, 40), [1, 0, 0.5, 0])
    # a non-square grid over the crop: 1 row, 4 columns of 10 px
    np.testing.assert_allclose(box_coverage((100, 50, 100, 50), 300, 150, (1, 4), 60, 40), [0, 0.5, 0.5, 0])


def test_box_cropped_away_is_skipped_as_outside(tmp_path):
    instances = one_image(tmp_path, ("circle", "red", "small", (0, 0, 40, 20)), width=300, height=150)
    result = localise(instances, "red circle", [UNIFORM, UNIFORM], resize_size=60, image_size=40)
    assert result.color["1"].words == 0 and result.color["1"].skipped_outside == 1
    assert result.kind["all"].skipped_outside == 1


def test_wrong_colour(tmp_path):
    instances = one_image(tmp_path, ("circle", "red", "small", (0, 0, 50, 50)),
                          ("square", "blue", "large", (50, 50, 50, 50)))
    accuracy = naming_accuracy(instances, {1: "A blue circle and a blue square."}).groups["2"]
    assert (accuracy.images, accuracy.shapes, accuracy.color, accuracy.kind, accuracy.both) == (1, 2, 0.5, 1.0, 0.5)
    words = "a blue circle and a blue square"
    result = localise(instances, words, [UNIFORM, [1, 0, 0, 0], [1, 0, 0, 0], UNIFORM, UNIFORM,
                                         [0, 0, 0, 1], [0, 0.5, 0, 0.5]])
    blue, kind = result.color["2"], result.kind["2"]
    assert (blue.words, blue.skipped_unmatched, blue.mean_mass) == (1, 1, 1.0)  # "blue circle" names nothing
    assert (kind.words, kind.skipped_unmatched, kind.mean_mass) == (1, 1, 0.5)


def test_ambiguous_words_are_skipped_and_multiplicity_counts(tmp_path):
    instances = one_image(tmp_path, ("circle", "red", "small", (0, 0, 50, 50)),
                          ("square", "red", "large", (50, 0, 50, 50)), ("circle", "blue", "small", (0, 50, 50, 50)))
    caption = "a red one beside a circle and a red square"
    accuracy = naming_accuracy(instances, {1: caption}).groups["3"]
    assert (accuracy.color, accuracy.kind, accuracy.both) == (2 / 3, 2 / 3, 1 / 3)  # "red" twice for two red
    weights = [UNIFORM, [0.7, 0.1, 0.1, 0.1]] + [UNIFORM] * 6 + [[0, 0.8, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1]]
    result = localise(instances, caption, weights)
    red, kind = result.color["3"], result.kind["3"]
    assert (red.words, red.skipped_ambiguous, red.mean_mass) == (1, 1, 0.8)  # lone "red" names two shapes
    assert (kind.words, kind.skipped_ambiguous, kind.mean_mass) == (1, 1, 0.6)  # lone "circle" names two
    assert naming_accuracy(instances, {1: "a red circle, a red square and a blue circle"}).groups["all"].both == 1


def test_groups_by_number_of_shapes_and_json(tmp_path):
    instances = load_instances(write_instances(tmp_path, [
        (1, 100, 100, [("circle", "red", "small", (0, 0, 50, 50))]),
        (2, 100, 100, [("circle", "red", "small", (0, 0, 50, 50)), ("square", "blue", "large", (50, 50, 50, 50))])]))
    result = naming_accuracy(instances, {1: "a blue circle", 2: "a red circle and a blue square"})
    assert list(result.groups) == ["1", "2", "3", "all"]
    assert (result.groups["1"].color, result.groups["2"].color, result.groups["3"].color) == (0.0, 1.0, None)
    assert (result.groups["all"].images, result.groups["all"].shapes, result.groups["all"].color) == (2, 3, 2 / 3)
    assert json.loads(json.dumps(result.to_json()))["all"] == {"images": 2, "shapes": 3, "color": 2 / 3,
                                                               "kind": 1.0, "both": 2 / 3}
    located = localise(instances, "a blue circle", [UNIFORM] * 3).to_json()
    assert set(located) == {"color", "kind"} and set(located["kind"]) == {"1", "2", "3", "all"}
    assert json.loads(json.dumps(located))["color"]["1"]["skipped_unmatched"] == 1


def test_bad_inputs_name_their_parameter(tmp_path):
    instances = one_image(tmp_path, ("circle", "red", "small", (0, 0, 50, 50)))
    cases = [
        (lambda: naming_accuracy(instances, {9: "a red circle"}), "captions"),
        (lambda: naming_accuracy(instances, {1: ["a", "red"]}), "captions"),
        (lambda: localise(instances, "red circle", [UNIFORM], image_id=1), "attention"),  # one row, two words
        (lambda: localise(instances, "red circle", [UNIFORM, [0.5, 0.5, 0.5, 0.5]]), "attention"),  # sums to 2
        (lambda: localise(instances, "red circle", [UNIFORM] * 2, image_id=9), "attention"),
        (lambda: localise(instances, "red circle", [UNIFORM] * 2, grid=(2, 0)), "grid"),
        (lambda: localise(instances, "red circle", [UNIFORM] * 2, resize_size=30, image_size=40), "image_size"),
    ]
    for call, param in cases:
        with pytest.raises(InputError) as refused:
            call()
        assert param in refused.value.params and f"`{param}`" in str(refused.value)
    # [words, rows, cols] is accepted as well as [words, cells]
    grid_weights = np.array([[[0.25, 0.25], [0.25, 0.25]], [[1, 0], [0, 0]]])
    assert localise(instances, "red circle", grid_weights).kind["1"].mean_mass == 1.0


# the real synthetic dataset (tests/conftest.py: 40 images, seed 7)


def _reference_run(shapes_dir, split):
    instances = load_instances(os.path.join(shapes_dir, "annotations", f"instances_{split}.json"))
    first = {}
    for ann in load_split(shapes_dir, split)["annotations"]:
        first.setdefault(ann["image_id"], ann["caption"])
    return instances, first


def test_reference_captions_name_every_shape(shapes_dir):
    """Every synth caption lists every shape, so the first reference of each image scores exactly 1; a
    caption with every colour swapped keeps its kinds and loses its colours."""
    swap = dict(zip(COLORS, list(COLORS)[1:] + list(COLORS)[:1]))
    for split in ("train", "val", "test"):
        instances, captions = _reference_run(shapes_dir, split)
        groups = naming_accuracy(instances, captions).groups
        assert groups["all"].images == len(captions) == sum(groups[n].images for n in ("1", "2", "3"))
        for group in groups.values():
            if group.shapes:
                assert (group.color, group.kind, group.both) == (1.0, 1.0, 1.0)
        swapped = {i: " ".join(swap.get(w, w) for w in tokenize_caption(c)) for i, c in captions.items()}
        wrong = naming_accuracy(instances, swapped).groups["all"]
        assert 0 <= wrong.color < 0.5 and wrong.kind == 1.0 and wrong.both <= wrong.color


def test_uniform_attention_is_chance_and_oracle_attention_is_not(shapes_dir):
    grid, resize_size, image_size = (4, 4), 36, 32  # experiments/shapes.yaml's geometry
    instances, captions = _reference_run(shapes_dir, "train")
    uniform, oracle = {}, {}
    for image_id, caption in captions.items():
        image, words = instances.images[image_id], tokenize_caption(caption)
        uniform[image_id] = (words, np.full((len(words), 16), 1 / 16))
        rows = np.full((len(words), 16), 1 / 16)
        for i, word in enumerate(words):  # all weight on the cells of the shape a "colour kind" phrase names
            kind = word if word in KINDS else words[i + 1] if i + 1 < len(words) and words[i + 1] in KINDS else None
            color = words[i - 1] if word in KINDS else word
            named = [s for s in image.shapes if (s.color, s.kind) == (color, kind)]
            if len(named) == 1:
                coverage = box_coverage(named[0].bbox, image.width, image.height, grid, resize_size, image_size)
                rows[i] = coverage / coverage.sum()
        oracle[image_id] = (words, rows)
    chance = attention_localisation(instances, uniform, grid, resize_size, image_size)
    best = attention_localisation(instances, oracle, grid, resize_size, image_size)
    for part in ("color", "kind"):
        for name, group in getattr(chance, part).items():
            if group.words:
                assert group.mean_mass == pytest.approx(group.mean_area, abs=1e-12)
                assert abs(group.ratio_of_means - 1) < 1e-9 and abs(group.mean_ratio - 1) < 1e-9
        vocabulary = COLORS if part == "color" else KINDS
        named = sum(w in vocabulary for c in captions.values() for w in tokenize_caption(c))
        everything = getattr(chance, part)["all"]
        assert everything.words + everything.skipped_ambiguous + everything.skipped_unmatched == named
        assert everything.skipped_unmatched == everything.skipped_outside == 0 and everything.words > 40
        assert getattr(best, part)["all"].ratio_of_means > 2 and getattr(best, part)["all"].mean_ratio > 2
        assert getattr(best, part)["all"].words == everything.words
