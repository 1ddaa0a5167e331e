"""COCO's 80 object categories as CHAIR reads them in a caption (Rohrbach et al. 2018, "Object Hallucination in
Image Captioning"; their ``utils/chair.py`` and ``data/synonyms.txt`` in github.com/LisaAnne/Hallucination).

**The table** (:data:`SYNONYMS`, the reference's ``data/synonyms.txt`` as it is, one line per category):
the first word of a line is the category's name in COCO's instances files (its *node*), the others are
words that name it ("kitten" is a cat, "puppy" a dog, "people" a person, "table" a dining table).

**A caption's objects** (:func:`corrected_mentions`, the *corrected* reading; chair.py's own, quirks
included, is :mod:`captioning.evaluation.chair_published`, and docs/using.md lists where the two differ):

1. the words of :func:`captioning.text.tokenize_caption` (the tokenizer of ``nltk.word_tokenize``, which
   chair.py calls, without punkt's sentence splitter), punctuation kept, as chair.py keeps it: "a hot, dog"
   is no hot dog; each word in its singular form (:func:`singular`);
2. left to right, two words that form one of :data:`DOUBLE_WORDS` become one word: "hot dog", "teddy
   bear", "fire hydrant" (so "hot dog" is not a dog), "baby bird" → bird, "adult cow" → cow (so "baby"
   and "adult" before an animal word are not a person), "passenger train" → train, "bow tie" → tie,
   "toilet seat" → toilet, "home plate" and "train track" (no object: "train tracks" name no train);
3. a caption holding both "toilet" and "seat" loses its "seat"s ("the seat of the toilet" is no chair);
4. every word left that the table has is a mention of its node, repeats included: "a dog chasing a
   dog" mentions dog twice (:func:`read_objects`, steps 2-4, shared with chair.py's reading).

Where this differs from chair.py, on purpose: chair.py uses pattern's ``singularize``, whose rules turn
"bus" into "bu", "ties" into "ty", "canoes" into "cano" and leave "collies"; here :func:`singular` is a
rule-based singulariser with a list of irregular plurals covering every word of the table
(tests/test_hallucination.py checks each table word's plural); chair.py's own artefacts of pattern
("knive", "phon", "wine glas" → wine glass) stay in the table and are simply not needed. Two entries of
the table have a stray space (" motor bike", " cheesecake") and so never match in chair.py; here each
entry is stripped, so they do. "iPhone" is lowercased (captions are). "stove top oven" is three words and
chair.py joins only pairs: it is read as "stove" and "oven", two mentions of oven, as in chair.py.
"""

from __future__ import annotations

from captioning.text import tokenize_caption

# github.com/LisaAnne/Hallucination, data/synonyms.txt (BSD 2-Clause), as it is: data, not code.
SYNONYMS = """\
person, girl, boy, man, woman, kid, child, chef, baker, people, adult, rider, children, baby, worker, passenger, sister, biker, policeman, cop, officer, lady, cowboy, bride, groom, male, female, guy, traveler, mother, father, gentleman, pitcher, player, skier, snowboarder, skater, skateboarder, person, woman, guy, foreigner, child, gentleman, caller, offender, coworker, trespasser, patient, politician, soldier, grandchild, serviceman, walker, drinker, doctor, bicyclist, thief, buyer, teenager, student, camper, driver, solider, hunter, shopper, villager
bicycle, bike, bicycle, bike, unicycle, minibike, trike
car, automobile, van, minivan, sedan, suv, hatchback, cab, jeep, coupe, taxicab, limo, taxi
motorcycle, scooter,  motor bike, motor cycle, motorbike, scooter, moped
airplane, jetliner, plane, air plane, monoplane, aircraft, jet, jetliner, airbus, biplane, seaplane
bus, minibus, trolley
train, locomotive, tramway, caboose
truck, pickup, lorry, hauler, firetruck
boat, ship, liner, sailboat, motorboat, dinghy, powerboat, speedboat, canoe, skiff, yacht, kayak, catamaran, pontoon, houseboat, vessel, rowboat, trawler, ferryboat, watercraft, tugboat, schooner, barge, ferry, sailboard, paddleboat, lifeboat, freighter, steamboat, riverboat, battleship, steamship
traffic light, street light, traffic signal, stop light, streetlight, stoplight
fire hydrant, hydrant
stop sign
parking meter
bench, pew
bird, ostrich, owl, seagull, goose, duck, parakeet, falcon, robin, pelican, waterfowl, heron, hummingbird, mallard, finch, pigeon, sparrow, seabird, osprey, blackbird, fowl, shorebird, woodpecker, egret, chickadee, quail, bluebird, kingfisher, buzzard, willet, gull, swan, bluejay, flamingo, cormorant, parrot, loon, gosling, waterbird, pheasant, rooster, sandpiper, crow, raven, turkey, oriole, cowbird, warbler, magpie, peacock, cockatiel, lorikeet, puffin, vulture, condor, macaw, peafowl, cockatoo, songbird
cat, kitten, feline, tabby
dog, puppy, beagle, pup, chihuahua, schnauzer, dachshund, rottweiler, canine, pitbull, collie, pug, terrier, poodle, labrador, doggie, doberman, mutt, doggy, spaniel, bulldog, sheepdog, weimaraner, corgi, cocker, greyhound, retriever, brindle, hound, whippet, husky
horse, colt, pony, racehorse, stallion, equine, mare, foal, palomino, mustang, clydesdale, bronc, bronco
sheep, lamb, ram, lamb, goat, ewe
cow, cattle, oxen, ox, calf, cattle, holstein, heifer, buffalo, bull, zebu, bison 
elephant
bear, panda
zebra
giraffe
backpack, knapsack
umbrella
handbag, wallet, purse, briefcase
tie, bow, bow tie
suitcase, suit case, luggage
frisbee
skis, ski
snowboard
sports ball, ball
kite
baseball bat
baseball glove
skateboard
surfboard, longboard, skimboard, shortboard, wakeboard
tennis racket, racket
bottle
wine glass
cup
fork
knife, pocketknife, knive
spoon
bowl, container
banana
apple
sandwich, burger, sub, cheeseburger, hamburger
orange
broccoli
carrot
hot dog
pizza
donut, doughnut, bagel
cake,  cheesecake, cupcake, shortcake, coffeecake, pancake
chair, seat, stool
couch, sofa, recliner, futon, loveseat, settee, chesterfield 
potted plant, houseplant
bed
dining table, table, desk
toilet, urinal, commode, toilet, lavatory, potty
tv, monitor, televison, television
laptop, computer, notebook, netbook, lenovo, macbook, laptop computer
mouse
remote
keyboard
cell phone, mobile phone, phone, cellphone, telephone, phon, smartphone, iPhone
microwave
oven, stovetop, stove, stove top oven
toaster
sink
refrigerator, fridge, fridge, freezer
book
clock
vase
scissors
teddy bear, teddybear
hair drier, hairdryer
toothbrush
"""


def _table() -> dict[str, str]:
    """word → node (the first word of its line), each entry stripped and lowercased."""
    inverse = {}
    for line in SYNONYMS.splitlines():
        entries = [entry.strip().lower() for entry in line.split(",")]
        for entry in entries:
            inverse.setdefault(entry, entries[0])
    return inverse


NODE_OF = _table()  # "kitten" -> "cat", "hot dog" -> "hot dog", "table" -> "dining table", ...
CATEGORIES = tuple(dict.fromkeys(NODE_OF.values()))  # the 80 nodes, COCO's category names, in table order

# chair.py's coco_double_words: two words read as one (each stands for itself)
_DOUBLES = ("motor bike", "motor cycle", "air plane", "traffic light", "street light", "traffic signal", "stop light",
            "fire hydrant", "stop sign", "parking meter", "suit case", "sports ball", "baseball bat",
            "baseball glove", "tennis racket", "wine glass", "hot dog", "cell phone", "mobile phone", "teddy bear",
            "hair drier", "potted plant", "bow tie", "laptop computer", "stove top oven", "home plate", "train track")
ANIMAL_WORDS = ("bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "animal", "cub")
VEHICLE_WORDS = ("jet", "train")
DOUBLE_WORDS = ({pair: pair for pair in _DOUBLES}
                | {f"{age} {animal}": animal for animal in ANIMAL_WORDS for age in ("baby", "adult")}
                | {f"passenger {vehicle}": vehicle for vehicle in VEHICLE_WORDS}
                | {"bow tie": "tie", "toilet seat": "toilet"})

# plural -> singular where the rules of singular() do not give it (every word of the table is covered: tested)
IRREGULAR = {
    "people": "person", "men": "man", "women": "woman", "children": "child", "gentlemen": "gentleman",
    "policemen": "policeman", "servicemen": "serviceman", "grandchildren": "grandchild", "mice": "mouse",
    "geese": "goose", "oxen": "ox", "knives": "knife", "pocketknives": "pocketknife", "calves": "calf",
    "thieves": "thief", "buses": "bus", "busses": "bus", "minibuses": "minibus", "airbuses": "airbus",
    "taxis": "taxi", "skis": "ski", "corgis": "corgi", "broccolis": "broccoli", "zebus": "zebu",
    "buffaloes": "buffalo", "flamingoes": "flamingo", "teeth": "tooth", "feet": "foot", "wolves": "wolf",
    "leaves": "leaf", "shelves": "shelf", "loaves": "loaf", "halves": "half", "wives": "wife", "lives": "life",
    "collies": "collie", "magpies": "magpie", "doggies": "doggie", "cookies": "cookie", "movies": "movie",
}
UNCHANGED = frozenset({"scissors", "series", "species", "news", "pants", "jeans", "shorts"})


def singular(word: str) -> str:
    """The singular of a lowercase word: :data:`IRREGULAR`, else the words in :data:`UNCHANGED` and those
    ending in "ss", "us" or "is" as they are ("glass", "bus", "tennis"), else "-ies" → "-y" (words of 5
    letters or more: "ponies", but "ties" → "tie"), "-ches", "-shes", "-sses", "-xes", "-zzes" → without
    "es", any other "-s" → without it. Words that are not nouns go through the same rules ("has" → "ha"),
    which is harmless: only the table's words count.

    >>> [singular(w) for w in ("dogs", "people", "ponies", "ties", "benches", "glasses", "bus", "knives", "sheep")]
    ['dog', 'person', 'pony', 'tie', 'bench', 'glass', 'bus', 'knife', 'sheep']
    >>> singular("wine"), singular("sandwiches"), singular("oranges"), singular("skis")
    ('wine', 'sandwich', 'orange', 'ski')
    """
    if word in IRREGULAR:
        return IRREGULAR[word]
    if word in UNCHANGED or not word.endswith("s") or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies") and len(word) >= 5:
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "sses", "xes", "zzes")):
        return word[:-2]
    return word[:-1]


def object_mentions(words: list[str]) -> list[tuple[str, str]]:
    """The COCO objects a tokenised caption names, in order, as (the word or two words, its node) (module
    docstring).

    >>> object_mentions("a kitten and two hot dogs beside a toilet seat".split())
    [('kitten', 'cat'), ('hot dog', 'hot dog'), ('toilet', 'toilet')]
    >>> object_mentions("a baby bird on a man s bow tie near a teddy bear".split())
    [('bird', 'bird'), ('man', 'person'), ('tie', 'tie'), ('teddy bear', 'teddy bear')]
    """
    return read_objects([singular(w) for w in words], NODE_OF, DOUBLE_WORDS)


def corrected_mentions(caption: str) -> list[tuple[str, str]]:
    """The COCO objects ``caption`` names by the corrected reading (module docstring): its words, punctuation
    kept between them, through :func:`object_mentions`.

    >>> corrected_mentions("Two buses, a bus and a tie near canoes")
    [('bus', 'bus'), ('bus', 'bus'), ('tie', 'tie'), ('canoe', 'boat')]
    >>> corrected_mentions("a hot, dog")  # a comma between: a dog, not a hot dog
    [('dog', 'dog')]
    """
    return object_mentions(reading_tokens(caption))


def reading_tokens(caption: str) -> list[str]:
    """The tokens CHAIR reads in ``caption``: :func:`captioning.text.tokenize_caption` with punctuation kept, save
    marks at its very end, which part no two words. Most of COCO's captions ("A dog on a bed.") have no other
    mark and take the tokenizer's fast path (about 100 times nltk's speed).

    >>> reading_tokens("A hot, dog."), reading_tokens("A hot dog.")
    (['a', 'hot', ',', 'dog', '.'], ['a', 'hot', 'dog'])
    """
    if all(ch.isalnum() or ch.isspace() for ch in caption.rstrip(" .!?\n")):
        return tokenize_caption(caption)
    return tokenize_caption(caption, keep_punctuation=True)


def read_objects(words: list[str], node_of: dict[str, str], doubles: dict[str, str]) -> list[tuple[str, str]]:
    """Steps 2-4 of the module docstring on singular ``words``: pairs in ``doubles`` joined left to right,
    "seat" dropped beside "toilet", then (word, node) for each word ``node_of`` has."""
    joined, i = [], 0
    while i < len(words):
        pair = " ".join(words[i:i + 2])
        if i + 1 < len(words) and pair in doubles:
            joined.append(doubles[pair])
            i += 2
        else:
            joined.append(words[i])
            i += 1
    if "toilet" in joined and "seat" in joined:
        joined = [w for w in joined if w != "seat"]
    return [(w, node_of[w]) for w in joined if w in node_of]
