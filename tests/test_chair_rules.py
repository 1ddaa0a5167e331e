"""CHAIR's two readings of COCO captions: "published" (Rohrbach et al.'s chair.py, bug for bug: what published
CHAIR numbers are) and "corrected" (the paper's definition). tests/data/chair_fixture.json holds 74 captions in the
COCO formats with what chair.py itself gives on them (a port of its CHAIR class run with pattern's singularize;
pattern does not install on this Python, so the numbers are stored, not recomputed); each kind of difference is
checked here by hand, under both readings. No model."""

import json
import os

import pytest

from captioning.errors import InputError
from captioning.evaluation import chair_published, hallucination
from captioning.evaluation.chair_published import WORDS, singularize
from captioning.evaluation.hallucination import (RULES, CocoObjects, chair, coco_sentences, describe, holds,
                                                 load_objects, results)

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "chair_fixture.json")


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """The fixture's instances file written as COCO writes it, loaded; its captions and references."""
    data = json.load(open(FIXTURE, encoding="utf-8"))
    images = {int(i): image for i, image in data["images"].items()}
    names = sorted({name for image in images.values() for name in image["objects"]} | {"bus", "cake"})
    ids = {name: n + 1 for n, name in enumerate(names)}
    instances = {"info": {}, "licenses": [],
                 "images": [{"id": i, "file_name": f"COCO_val2014_{i:012d}.jpg", "width": 640, "height": 480}
                            for i in images],
                 "annotations": [{"id": 100 * i + n, "image_id": i, "category_id": ids[name], "bbox": [1, 2, 3, 4],
                                  "area": 12.0, "iscrowd": 0} for i, image in images.items()
                                 for n, name in enumerate(image["objects"])],
                 "categories": [{"id": i, "name": name, "supercategory": "thing"} for name, i in ids.items()]}
    path = tmp_path_factory.mktemp("chair") / "instances_val2014.json"
    path.write_text(json.dumps(instances), encoding="utf-8")
    objects = load_objects(str(path))
    assert isinstance(objects, CocoObjects)
    return (objects, {i: im["caption"] for i, im in images.items()}, {i: im["references"] for i, im in images.items()},
            data["chair_py"], str(path))


def as_lists(pairs):
    return [list(p) for p in pairs]


def test_published_reading_is_chair_py_on_every_caption_of_the_fixture(fixture):
    objects, captions, refs, chair_py, _ = fixture
    found = coco_sentences(objects, captions, refs, "published")
    for image_id, caption in captions.items():
        expected = chair_py["sentences"][str(image_id)]
        assert (as_lists(found[image_id].mentions), as_lists(found[image_id].hallucinated)) == (
            expected["mentions"], expected["hallucinated"]), caption
    total = chair(objects, captions, refs)  # the default: published
    assert total.rules == "published" and total.captions == 74
    assert (total.chair_s, total.chair_i) == pytest.approx((chair_py["CHAIRs"], chair_py["CHAIRi"]), abs=1e-15)
    assert (total.hallucinated_captions, total.hallucinated_mentions, total.mentions) == (9, 9, 94)
    # the corrected reading differs on 23 of the 74 captions, 18 of them in what CHAIR counts
    corrected = coco_sentences(objects, captions, refs, "corrected")
    differ = [i for i in captions if (corrected[i].mentions, corrected[i].hallucinated) !=
              (found[i].mentions, found[i].hallucinated)]
    assert len(differ) == 23
    other = chair(objects, captions, refs, "corrected")
    assert (other.hallucinated_captions, other.hallucinated_mentions, other.mentions) == (18, 18, 114)


# caption, the image's instances, its references -> (published: mentions, hallucinated; corrected: the same)
CASES = {
    "pattern's final s": ("a bus next to a car", ["car"], [],
                          ([("car", "car")], [], [("bus", "bus"), ("car", "car")], [("bus", "bus")])),
    "its plural is right": ("two buses", ["bus"], [], ([("bus", "bus")], [], [("bus", "bus")], [])),
    "minibus, airbus": ("a minibus and an airbus", [], [],
                        ([], [], [("minibus", "bus"), ("airbus", "airplane")],
                         [("minibus", "bus"), ("airbus", "airplane")])),
    "-ies to -y": ("men in ties beside magpies", ["person"], [],
                   ([("man", "person")], [], [("man", "person"), ("tie", "tie"), ("magpie", "bird")],
                    [("tie", "tie"), ("magpie", "bird")])),
    "-oes to -o": ("two canoes", [], [], ([], [], [("canoe", "boat")], [("canoe", "boat")])),
    "-ie plurals kept": ("collies and doggies", [], [],
                         ([], [], [("collie", "dog"), ("doggie", "dog")], [("collie", "dog"), ("doggie", "dog")])),
    "-ves": ("two thieves", [], [], ([], [], [("thief", "person")], [("thief", "person")])),
    "leading space": ("a motor bike and a cheesecake", [], [],
                      ([], [], [("motor bike", "motorcycle"), ("cheesecake", "cake")],
                       [("motor bike", "motorcycle"), ("cheesecake", "cake")])),
    "iPhone": ("a man with an iPhone", ["person"], [],
               ([("man", "person")], [], [("man", "person"), ("iphone", "cell phone")], [("iphone", "cell phone")])),
    "kine": ("kine in a field", [], [], ([("cow", "cow")], [("cow", "cow")], [], [])),
    "glass": ("a wine glass and two wine glasses", ["wine glass"], [],
              ([("wine glass", "wine glass")] * 2, [], [("wine glass", "wine glass")] * 2, [])),
    "tennis racket": ("a tennis racket", ["tennis racket"], [],
                      ([("racket", "tennis racket")], [], [("tennis racket", "tennis racket")], [])),
    "references read alike": ("two buses", [], ["a red bus on a street"],
                              ([("bus", "bus")], [("bus", "bus")], [("bus", "bus")], [])),
    "not NFKC": ("\uff24\uff2f\uff27 on a street", [], [], ([], [], [("dog", "dog")], [("dog", "dog")])),
    "punctuation parts words": ("a hot, dog", ["dog"], [], ([("dog", "dog")], [], [("dog", "dog")], [])),
    "no mention": ("a view of a street", [], [], ([], [], [], [])),
}


@pytest.mark.parametrize("case", CASES)
def test_each_kind_of_difference(case):
    caption, present, refs, (published, wrong, corrected, corrected_wrong) = CASES[case]
    objects = CocoObjects({7: frozenset(present)})
    for rules, mentions, hallucinated in (("published", published, wrong), ("corrected", corrected, corrected_wrong)):
        [sentence] = coco_sentences(objects, {7: caption}, {7: refs}, rules).values()
        assert (list(sentence.mentions), list(sentence.hallucinated)) == (mentions, hallucinated), rules
        found = chair(objects, {7: caption}, {7: refs}, rules)
        assert found.chair_s == float(bool(hallucinated)) and found.chair_i == (
            len(hallucinated) / len(mentions) if mentions else None), rules
        assert sentence.chair_s == int(bool(hallucinated)) and sentence.chair_i == found.chair_i


def test_singularize_is_patterns_answer_where_it_matters():
    """pattern 3.6's answers, quirks included, for a word that is, or whose singular is, one of the words chair.py
    looks at (WORDS); any other word comes back as it is, since it names nothing whatever pattern makes of it."""
    pattern = {"dogs": "dog", "people": "person", "women": "woman", "children": "child", "mice": "mouse",
               "geese": "goose", "knives": "knife", "ponies": "pony", "benches": "bench", "buses": "bus",
               "bus": "bu", "minibus": "minibu", "tie": "tie", "glass": "glas", "glasses": "glass",
               "tennis": "tenni", "sports": "sport", "scissors": "scissors", "sheep": "sheep", "kine": "cow",
               "oxen": "ox", "dog": "dog", "dogſ": "dog", "ponıes": "pony", "seats": "seat", "toilets": "toilet"}
    assert all(word in WORDS or singular in WORDS for word, singular in pattern.items())
    assert {word: singularize(word) for word in pattern} == pattern
    # pattern's answer in brackets: neither it nor the word is in WORDS
    elsewhere = ["ties",  # ty ("^tie" never matches)
                 "canoes", "magpies", "thieves", "busses",  # cano, magpy, thieve, buss
                 "collies", "doggies", "zombies", "wildebeest", "species",  # as they are
                 "four", "data", "bases", "dogs'", "brothers-in-law", "hot-dogs"]  # fmy, datum, basis, dog's, ...
    assert not any(word in WORDS for word in elsewhere)
    assert [singularize(word) for word in elsewhere] == elsewhere
    table = open(os.path.join(os.path.dirname(chair_published.__file__), "chair_published_words.txt"),
                 encoding="utf-8").read().splitlines()
    pairs = [line.split(" ") for line in table if not line.startswith("#")]
    assert len(pairs) == 932 and all(len(pair) == 2 and pair[0] != pair[1] and (set(pair) & WORDS) for pair in pairs)
    assert len(WORDS) == 412 and {"toilet", "seat", "baby", "adult", "passenger", "glas", "cub", "jet"} <= WORDS


def test_the_lookup_reads_mentions_as_chair_py():
    """What the table decides in a caption, as chair.py's run with pattern gives it; "dogſ" (pattern's rules
    match s case-insensitively, and re takes "ſ" for an s) was no dog before the table."""
    objects = CocoObjects({7: frozenset()})
    said = {caption: [list(m) for m in coco_sentences(objects, {7: caption}, {7: []}, "published")[7].mentions]
            for caption in ("two buses", "a bus", "kine", "collies", "two dogſ", "ponıes", "wine glasses", "a tennis")}
    assert said == {"two buses": [["bus", "bus"]], "a bus": [], "kine": [["cow", "cow"]], "collies": [],
                    "two dogſ": [["dog", "dog"]], "ponıes": [["pony", "horse"]],
                    "wine glasses": [["wine glass", "wine glass"]], "a tennis": []}


def test_a_result_holds_both_readings_and_an_earlier_one_is_not_reused(fixture, tmp_path):
    objects, captions, refs, chair_py, instances = fixture
    result = results(objects, captions, refs, instances)
    assert set(result) == {"chair_i", "chair_s", "object_recall", "hallucination", "chair_i_corrected",
                           "chair_s_corrected", "object_recall_corrected", "hallucination_corrected"}
    assert set(hallucination.SCALARS) == {k for k in result if not k.startswith("hallucination")}
    assert (result["chair_s"], result["chair_i"]) == pytest.approx((chair_py["CHAIRs"], chair_py["CHAIRi"]))
    assert result["chair_s_corrected"] == pytest.approx(18 / 74)
    assert (result["hallucination"]["rules"], result["hallucination_corrected"]["rules"]) == ("published",
                                                                                             "corrected")
    assert holds(result, instances) and not holds(result, str(tmp_path / "other.json"))
    earlier = {**result, "hallucination": {k: v for k, v in result["hallucination"].items() if k != "rules"}}
    for key in ("chair_i_corrected", "chair_s_corrected", "object_recall_corrected", "hallucination_corrected"):
        del earlier[key]
    assert not holds(earlier, instances)  # its chair_i was the corrected reading's, unnamed: evaluated again
    shapes_earlier = {"hallucination": {"objects": "shapes", "instances": instances}}
    assert holds(shapes_earlier, instances)  # the shapes' reading did not change
    lines = describe(result).splitlines()
    assert lines[0].startswith("hallucination (COCO's 80 objects, chair.py's reading, as published): CHAIRi 0.096 "
                               "(9 of 94 object mentions")
    assert any(line.startswith("hallucination (COCO's 80 objects, the corrected reading): CHAIRi 0.158 (18 of 114")
               for line in lines)


def test_the_reading_is_a_registered_choice(fixture, shapes_dir):
    objects, captions, refs, _, _ = fixture
    assert list(RULES) == ["published", "corrected"] and hallucination.DEFAULT_RULES == "published"
    with pytest.raises(InputError, match=r"must be one of published, corrected, got 'publishd' \(did you mean "
                                         r"published\?\)") as refused:
        chair(objects, captions, refs, "publishd")
    assert "\n" not in str(refused.value)
    shapes = load_objects(os.path.join(shapes_dir, "annotations", "instances_test.json"))
    with pytest.raises(InputError, match="the synthetic shapes are read one way"):
        chair(shapes, {}, None, "corrected")
