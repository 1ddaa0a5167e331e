"""Object hallucination (CHAIR, object recall) and bad endings: on files written in the COCO formats against an
independent count, on hand-made cases (a synonym, a plural, two-word objects, an image without instances, an
empty caption), on every plural the synonym table needs, and on the synthetic shapes. No model: evaluate's
result and TensorBoard are checked in tests/test_attention_use.py."""

import json
import os

import pytest

from captioning.errors import InputError
from captioning.evaluation.coco_objects import NODE_OF, SYNONYMS, object_mentions, singular
from captioning.evaluation.endings import bad_endings
from captioning.evaluation.grounding import check_covers, load_instances
from captioning.evaluation.hallucination import CocoObjects, chair, load_objects
from captioning.text import tokenize_caption
from data_prep.synth import load_split

# a few real COCO category ids (instances_val2014.json's)
COCO_IDS = {"person": 1, "car": 3, "bird": 16, "cat": 17, "dog": 18, "frisbee": 34, "hot dog": 58, "chair": 62,
            "dining table": 67, "toilet": 70, "teddy bear": 88}
# image id -> (its instances' categories, its reference captions, the generated caption)
IMAGES = {
    1: (["dog", "frisbee", "person"], ["A man throwing a frisbee to his dog.", "A dog catches a frisbee in the park"],
        "a man and two dogs playing with a frisbee on a table"),  # the table is not there
    2: (["cat"], ["A kitten sleeping on a chair.", "a small cat on a wooden chair"],
        "a kitten sitting on a toilet seat"),  # a toilet seat is a toilet, not the chair the references name
    3: ([], ["A plate of hot dogs on a table.", "two hot dogs with mustard"],  # no instances: the references say
        "two hot dogs on a table next to a dog"),  # hot dogs are no dog: the dog is hallucinated
    4: (["bird"], ["a bird sitting on a branch", "A baby bird in a nest."], "a baby bird sitting in a nest"),
    5: (["car", "person", "car"], ["cars parked on a street", "people walking past parked cars"], ""),
    6: (["teddy bear", "chair"], ["a teddy bear sitting on a chair"], "A teddy bear on a chair."),
}
# the test's own reading of the fixture's object words (two words first), written apart from the module's table
LEXICON = {"man": "person", "people": "person", "dog": "dog", "dogs": "dog", "frisbee": "frisbee",
           "table": "dining table", "kitten": "cat", "cat": "cat", "chair": "chair", "toilet": "toilet",
           "bird": "bird", "cars": "car", "hot dogs": "hot dog", "baby bird": "bird", "toilet seat": "toilet",
           "teddy bear": "teddy bear"}


def write_coco(tmp_path):
    """captions_test.json and instances_test.json as COCO writes them, and the results file's captions."""
    images = [{"id": i, "file_name": f"COCO_val2014_{i:012d}.jpg", "width": 640, "height": 480} for i in IMAGES]
    captions = [{"id": 10 * i + n, "image_id": i, "caption": text}
                for i, (_, refs, _) in IMAGES.items() for n, text in enumerate(refs)]
    annotations = [{"id": 100 * i + n, "image_id": i, "category_id": COCO_IDS[name], "bbox": [1, 2, 30, 40],
                    "area": 1200.0, "iscrowd": 0, "segmentation": [[1, 2, 31, 2, 31, 42]]}
                   for i, (names, _, _) in IMAGES.items() for n, name in enumerate(names)]
    categories = [{"id": i, "name": name, "supercategory": "thing"} for name, i in COCO_IDS.items()]
    for name, data in (("captions_test.json", {"info": {}, "licenses": [], "images": images, "annotations": captions}),
                       ("instances_test.json", {"info": {}, "licenses": [], "images": images,
                                                "annotations": annotations, "categories": categories})):
        (tmp_path / name).write_text(json.dumps(data), encoding="utf-8")
    return str(tmp_path / "instances_test.json"), str(tmp_path / "captions_test.json")


def independent_count(instances_path, captions_path, generated):
    """CHAIRi, CHAIRs, recall counted from the files with the test's LEXICON."""
    def objects(text):
        words = text.lower().replace(".", " ").split()
        found, i = [], 0
        while i < len(words):
            if " ".join(words[i:i + 2]) in LEXICON:
                found.append(LEXICON[" ".join(words[i:i + 2])])
                i += 2
            else:
                found += [LEXICON[words[i]]] if words[i] in LEXICON else []
                i += 1
        return found

    instances, refs = json.load(open(instances_path)), json.load(open(captions_path))
    names = {c["id"]: c["name"] for c in instances["categories"]}
    present = {im["id"]: set() for im in instances["images"]}
    for ann in instances["annotations"]:
        present[ann["image_id"]].add(names[ann["category_id"]])
    for ann in refs["annotations"]:
        present[ann["image_id"]].update(objects(ann["caption"]))
    mentions = wrong = bad_captions = named = 0
    for image_id, caption in generated.items():
        said = objects(caption)
        mentions += len(said)
        wrong += sum(o not in present[image_id] for o in said)
        bad_captions += any(o not in present[image_id] for o in said)
        named += len(set(said) & present[image_id])
    return wrong / mentions, bad_captions / len(generated), named / sum(len(present[i]) for i in generated)


def references(captions_path):
    refs = {}
    for ann in json.load(open(captions_path))["annotations"]:
        refs.setdefault(ann["image_id"], []).append(ann["caption"])
    return refs


def test_chair_on_coco_files_equals_an_independent_count(tmp_path):
    instances, captions = write_coco(tmp_path)
    objects = load_objects(instances)
    assert isinstance(objects, CocoObjects) and objects.images[3] == frozenset()
    generated = {i: caption for i, (_, _, caption) in IMAGES.items()}
    found = chair(objects, generated, references(captions))
    assert (found.chair_i, found.chair_s, found.object_recall) == pytest.approx(
        independent_count(instances, captions, generated), abs=1e-12)
    # by hand: 12 mentions, 3 hallucinated (table, toilet, dog) in 3 of 6 captions; 9 of 12 objects named
    assert (found.mentions, found.hallucinated_mentions, found.hallucinated_captions) == (12, 3, 3)
    assert (found.objects_present, found.objects_named, found.chair_i, found.chair_s, found.object_recall) == \
        (12, 9, 0.25, 0.5, 0.75)
    assert dict(found.hallucinated) == {"dining table": 1, "toilet": 1, "dog": 1}
    result = found.to_result("/x/instances_test.json")
    assert result["chair_i"] == 0.25 and result["hallucination"]["objects"] == "coco"
    assert "not measured" in result["hallucination"]["note"]  # the shapes' grounding is left out
    check_covers(objects, list(IMAGES), "test", instances)  # every image listed
    with pytest.raises(InputError, match="lists 6 of the 7 images"):  # the number listed, not the 1 missing
        check_covers(objects, [*IMAGES, 99], "test", instances)
    with pytest.raises(InputError, match="lists 2 of the 10 images .* image 7"):
        check_covers(objects, [1, 2, *range(7, 15)], "test", instances)


def test_hand_made_cases(tmp_path):
    instances, captions = write_coco(tmp_path)
    objects, refs = load_objects(instances), references(captions)

    def one(image_id, caption):
        found = chair(objects, {image_id: caption}, refs)
        return found.mentions, dict(found.hallucinated), found.objects_named

    assert one(2, "a kitten") == (1, {}, 1)  # a synonym: a kitten is the cat
    assert one(1, "two dogs and three men") == (2, {}, 2)  # plurals: dog, person
    assert one(6, "two hot dogs") == (1, {"hot dog": 1}, 0)  # a hot dog is no dog ...
    assert one(1, "two hot dogs") == (1, {"hot dog": 1}, 0)  # ... even beside a dog
    assert one(4, "a baby bird") == (1, {}, 1)  # a bird, not a person (a baby)
    assert one(4, "a baby") == (1, {"person": 1}, 0)
    assert one(6, "a toilet seat") == (1, {"toilet": 1}, 0)  # a toilet, not the chair that is there
    assert one(6, "a seat") == (1, {}, 1)  # a seat alone is a chair
    assert one(3, "a hot dog on a table") == (2, {}, 2)  # no instances: its objects are its references'
    assert one(5, "") == (0, {}, 0)  # an empty caption names nothing and hallucinates nothing
    empty = chair(objects, {5: ""}, refs)
    assert (empty.chair_i, empty.chair_s, empty.object_recall) == (None, 0.0, 0.0)
    assert object_mentions(tokenize_caption("A dog's frisbee, a Teddy-bear and cell phones")) == [
        ("dog", "dog"), ("frisbee", "frisbee"), ("cell phone", "cell phone")]  # "teddy-bear" is one token


def plural(entry: str) -> str:
    """The test's English plural of a table entry (its last word)."""
    irregular = {"person": "people", "man": "men", "woman": "women", "child": "children", "gentleman": "gentlemen",
                 "policeman": "policemen", "serviceman": "servicemen", "grandchild": "grandchildren",
                 "mouse": "mice", "goose": "geese", "ox": "oxen", "knife": "knives", "pocketknife": "pocketknives",
                 "calf": "calves", "thief": "thieves", "buffalo": "buffaloes", "flamingo": "flamingoes"}
    unchanged = {"sheep", "cattle", "bison", "aircraft", "watercraft", "scissors", "people", "children", "oxen",
                 "skis", "fowl", "waterfowl", "peafowl", "luggage"}
    *first, last = entry.split()
    if last in irregular:
        last = irregular[last]
    elif last not in unchanged:
        if last.endswith(("s", "x", "ch", "sh")):
            last += "es"
        elif last.endswith("y") and last[-2] not in "aeiou":
            last = last[:-1] + "ies"
        else:
            last += "s"
    return " ".join(first + [last])


def test_every_table_word_and_its_plural_name_its_category():
    entries = {entry.strip().lower() for line in SYNONYMS.splitlines() for entry in line.split(",")}
    assert len(entries) > 380 and len(set(NODE_OF.values())) == 80
    for entry in sorted(entries - {"stove top oven"}):
        for text in (f"a {entry}", f"two {plural(entry)}"):
            assert [node for _, node in object_mentions(text.split())] == [NODE_OF[entry]], text
    # chair.py joins two words, never three: a "stove top oven" is a stove and an oven
    assert object_mentions("a stove top oven".split()) == [("stove", "oven"), ("oven", "oven")]
    assert [singular(w) for w in ("bus", "tennis", "glass", "dress", "this")] == ["bus", "tennis", "glass", "dress",
                                                                                 "this"]


def test_instances_files_are_told_apart_by_their_content(tmp_path, shapes_dir):
    shapes_file = os.path.join(shapes_dir, "annotations", "instances_test.json")
    assert load_objects(shapes_file) == load_instances(shapes_file)
    instances, _ = write_coco(tmp_path)
    data = json.load(open(instances))
    data["categories"].append({"id": 500, "name": "spaceship"})
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InputError) as refused:
        load_objects(str(tmp_path / "bad.json"))
    message = str(refused.value)
    assert "\n" not in message and refused.value.params == ("instances",)
    assert "not a shapes instances file" in message and "nor a COCO instances file: category 'spaceship'" in message
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="nor a COCO instances file"):
        load_objects(str(tmp_path / "list.json"))


def test_chair_on_the_synthetic_shapes(shapes_dir):
    """The synth captions name every shape by colour and kind: no hallucination, full recall; swapping every
    colour hallucinates and recalls less; a kind without a colour is right when the kind is there."""
    instances = load_objects(os.path.join(shapes_dir, "annotations", "instances_test.json"))
    first = {}
    for ann in load_split(shapes_dir, "test")["annotations"]:
        first.setdefault(ann["image_id"], ann["caption"])
    right = chair(instances, first)
    assert right.objects == "shapes" and right.mentions >= len(first)
    assert (right.chair_i, right.chair_s, right.object_recall) == (0.0, 0.0, 1.0)
    image_id, image = next((i, im) for i, im in instances.images.items() if len(im.shapes) == 1)
    [shape] = image.shapes
    other = next(c for c in ("red", "green", "blue", "yellow") if c != shape.color)
    found = chair(instances, {image_id: f"a {other} {shape.kind} and a {shape.kind} and a hexagon"})
    assert (found.mentions, dict(found.hallucinated), found.objects_named) == (
        3, {f"{other} {shape.kind}": 1, "hexagon": 1}, 0)
    assert (found.chair_i, found.chair_s, found.object_recall) == (2 / 3, 1.0, 0.0)



def test_a_caption_that_is_not_text_is_one_line_in_every_measure(shapes_dir, tmp_path):
    """CHAIR (the shapes' and COCO's, each reading), naming and relations check each caption alike."""
    from captioning.evaluation.grounding import naming_accuracy
    from captioning.evaluation.relations import relation_accuracy

    shapes = load_objects(os.path.join(shapes_dir, "annotations", "instances_test.json"))
    coco = load_objects(write_coco(tmp_path)[0])
    calls = [lambda: chair(shapes, {next(iter(shapes.images)): 5}), lambda: naming_accuracy(
        shapes, {next(iter(shapes.images)): 5}), lambda: relation_accuracy(shapes, {next(iter(shapes.images)): 5})]
    calls += [lambda r=r: chair(coco, {next(iter(coco.images)): 5}, rules=r) for r in ("published", "corrected")]
    for call in calls:
        with pytest.raises(InputError, match=r"^`captions` has 5 for image \S+, not a caption$"):
            call()


def test_bad_ending_rate():
    found = bad_endings(["a man riding a horse", "a dog playing with a", "A cat on the.", "two cats and", "",
                         "a red circle with"])
    assert found["bad_ending_rate"] == 4 / 6
    assert found["bad_endings"] == {"a": 1, "and": 1, "the": 1, "with": 1}
    assert bad_endings([]) == {"bad_ending_rate": None, "bad_endings": {}}
