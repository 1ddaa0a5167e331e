"""The COCO caption metrics, computed exactly as the COCO caption evaluation code does.

``pycocoevalcap``'s ``COCOEvalCap.evaluate()`` always constructs SPICE, whose first use downloads
Stanford CoreNLP models, so it cannot run offline. :func:`coco_metrics` makes the same calls in the
same order instead: PTB-tokenize the references, then the candidates (Java), then ``Bleu(4)``,
``Meteor()`` (Java), ``Rouge()`` (ROUGE-L) and ``Cider()`` (CIDEr-D). The numbers are identical to
pycocoevalcap's, to the last digit (tested). SPICE runs only when asked for, and when its models are
missing it is skipped with one clear line rather than a download attempt failing deep inside Java.

METEOR's JVM is started with ``-Duser.language=en -Duser.country=US``: under a locale with a decimal
comma it would print scores that Python cannot parse.

Metric names are the COCO server's: ``Bleu_1`` … ``Bleu_4``, ``METEOR``, ``ROUGE_L``, ``CIDEr`` (and
``SPICE``).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import shutil

from captioning.errors import InputError

log = logging.getLogger("captioning.evaluation.metrics")

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
JAVA_MISSING = ("pycocoevalcap needs Java for PTB tokenization and METEOR, and `java` is not on PATH: "
                "install a Java runtime (e.g. apt-get install default-jre-headless)")


def check_java() -> None:
    if shutil.which("java") is None:
        raise InputError(JAVA_MISSING)


@contextlib.contextmanager
def _us_locale_for_java():
    old = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = ((old or "") + " -Duser.language=en -Duser.country=US").strip()
    try:
        yield
    finally:
        if old is None:
            del os.environ["JAVA_TOOL_OPTIONS"]
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = old


_METEOR = None  # this process's METEOR scorer, kept between scorings (its JVM takes ~4 s to start)


def start_meteor():
    """This process's METEOR scorer, started if it is not running: its JVM spends about 4 s loading the
    paraphrase tables, so it is started once per process and kept (``evaluate`` starts it before it
    captions, so the loading overlaps the decoding; later evaluations in the same process reuse it).
    :func:`stop_meteor` ends it; so does the end of the process."""
    global _METEOR
    process = getattr(_METEOR, "meteor_p", None)
    if process is None or process.poll() is not None:
        check_java()
        from pycocoevalcap.meteor.meteor import Meteor

        with _us_locale_for_java():
            _METEOR = Meteor()
    return _METEOR


def stop_meteor() -> None:
    """Ends this process's METEOR scorer (its JVM), if it runs."""
    global _METEOR
    process = getattr(_METEOR, "meteor_p", None)
    _METEOR = None
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


atexit.register(stop_meteor)


def coco_metrics(references: dict, candidates: dict, spice: bool = False) -> dict[str, float]:
    """``references``: image id → list of reference captions; ``candidates``: image id → one caption.

    Scores the images of ``candidates`` (each must have references) and returns ``{metric: value}``.
    METEOR runs in this process's scorer (:func:`start_meteor`).
    """
    check_java()
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    missing = [i for i in candidates if not references.get(i)]
    if missing:
        raise InputError(f"{len(missing)} candidate image(s) have no reference captions, e.g. image id {missing[0]}")
    if not candidates:
        raise InputError("there are no captions to score")
    ids = list(candidates)
    gts = {i: [{"caption": c} for c in references[i]] for i in ids}
    res = {i: [{"caption": candidates[i]}] for i in ids}
    meteor = start_meteor()  # (started before tokenising: its JVM loads while the tokenizer runs)
    tokenizer = PTBTokenizer()
    gts, res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
    scorers = [(Bleu(4), ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]), (meteor, "METEOR"), (Rouge(), "ROUGE_L"),
               (Cider(), "CIDEr")]
    if spice:
        spice_scorer = _spice()
        if spice_scorer is not None:
            scorers.append((spice_scorer, "SPICE"))
    metrics = {}
    try:
        for scorer, method in scorers:
            with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its ratios
                score, _ = scorer.compute_score(gts, res)
            if isinstance(method, list):
                metrics.update({m: float(s) for m, s in zip(method, score)})
            else:
                metrics[method] = float(score)
    except BaseException:  # a scorer interrupted mid-exchange cannot be trusted with the next one
        stop_meteor()
        raise
    return metrics


def _spice():
    """A Spice scorer when its CoreNLP models are already on disk, else None (with a warning)."""
    from pycocoevalcap.spice import spice as spice_module

    lib = os.path.join(os.path.dirname(spice_module.__file__), "lib")
    if not any(name.startswith("stanford-corenlp") and name.endswith("models.jar") for name in
               (os.listdir(lib) if os.path.isdir(lib) else [])):
        log.warning("SPICE skipped: it needs the Stanford CoreNLP models in %s, which its first run "
                    "downloads; fetch them on a machine with internet access", lib)
        return None
    return spice_module.Spice()


def _read_json(path: str, what: str):
    if os.path.isdir(path):
        raise InputError(f"{what} {path} is a folder, not a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _check_annotations(data, path: str) -> None:
    what = f"annotations file {path}"
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("annotations"), list):
        raise InputError(f"{what} is not COCO caption annotations: it needs 'images' and 'annotations' lists")
    for image in data["images"]:
        if not isinstance(image, dict) or "id" not in image:
            raise InputError(f"{what}: every image needs an 'id', got {str(image)[:80]}")
    for ann in data["annotations"]:
        if not isinstance(ann, dict) or "image_id" not in ann or not isinstance(ann.get("caption"), str):
            raise InputError(f"{what}: every annotation needs an 'image_id' and a 'caption' string "
                             f"(is this an instances file?), got {str(ann)[:80]}")


def _check_results(results, path: str) -> None:
    what = f"results file {path}"
    if not isinstance(results, list) or not all(isinstance(r, dict) and {"image_id", "caption"} <= set(r)
                                                for r in results):
        raise InputError(f"{what} must be a list of {{\"image_id\", \"caption\"}} objects")
    if not results:
        raise InputError(f"{what} holds no captions (an empty list)")
    seen = set()
    for r in results:
        if not isinstance(r["caption"], str):
            raise InputError(f"{what}: the caption of image {r['image_id']!r} is not a string: {str(r['caption'])[:60]}")
        if isinstance(r["image_id"], bool) or not isinstance(r["image_id"], int):
            raise InputError(f"{what}: image ids must be integers, got {r['image_id']!r}")
        if r["image_id"] in seen:
            raise InputError(f"{what} has two captions for image {r['image_id']}")
        seen.add(r["image_id"])


def score_files(annotations_path: str, results_path: str, spice: bool = False) -> dict[str, float]:
    """Scores a COCO results file (``[{"image_id", "caption"}]``) against COCO caption annotations, as the
    COCO caption evaluation does: every image of the results file, against all its references. Both
    files are read and checked in full before any scoring (one-line InputErrors: missing, not UTF-8,
    not JSON, the wrong layout, the two files swapped, no captions, a caption that is not a string)."""
    from pycocotools.coco import COCO

    annotations = _read_json(annotations_path, "annotations file")
    results = _read_json(results_path, "results file")
    if isinstance(annotations, list) and isinstance(results, dict) and "annotations" in results:
        raise InputError(f"the annotations and results files look swapped: {annotations_path} is a results list "
                         f"and {results_path} holds annotations; pass them the other way round")
    _check_annotations(annotations, annotations_path)
    _check_results(results, results_path)
    coco = COCO()
    coco.dataset = annotations
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco.createIndex()
    unknown = sorted({r["image_id"] for r in results} - set(coco.getImgIds()))
    if unknown:
        raise InputError(f"results file {results_path} has image ids not in {annotations_path}, e.g. {unknown[0]}")
    references = {r["image_id"]: [a["caption"] for a in coco.imgToAnns[r["image_id"]]] for r in results}
    candidates = {r["image_id"]: r["caption"] for r in results}
    return coco_metrics(references, candidates, spice=spice)


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """A plain-text table: one column per row name (e.g. model, baseline), one line per metric."""
    names = list(rows)
    lines = [f"{'metric':<9}" + "".join(f"{n:>12}" for n in names)]
    for metric in METRICS + (("SPICE",) if any("SPICE" in r for r in rows.values()) else ()):
        lines.append(f"{metric:<9}" + "".join(f"{rows[n].get(metric, float('nan')):>12.4f}" for n in names))
    return "\n".join(lines)


def grounding_table(found: dict) -> str:
    """Naming accuracy, relations named correctly and attention localisation per number of shapes, as text."""
    def cell(value, form="{:.3f}"):
        return "-" if value is None else form.format(value)

    lines = ["shapes  images  colour  kind   both   relations right of judged (mentions/image)" +
             ("   attention in box / box area: colour, kind words" if "attention" in found else "")]
    for group, naming in found["naming"].items():
        line = (f"{group:>6}  {naming['images']:>6}  {cell(naming['color'])}  {cell(naming['kind'])}  "
                f"{cell(naming['both'])}")
        relation = found.get("relations", {}).get(group)
        line += "   " + (f"{cell(relation['accuracy']):>5} of {relation['judged']:<4} "
                         f"({cell(relation['mentions_per_image'], '{:.2f}')})"
                         if relation and relation["images"] else "-").ljust(41)
        if "attention" in found:
            parts = []
            for kind in ("color", "kind"):
                g = found["attention"][kind].get(group)
                parts.append("-" if not g or g["words"] == 0 else
                             f"{g['mean_mass']:.2f} / {g['mean_area']:.2f} = {g['ratio_of_means']:.1f}x")
            line += "   " + ", ".join(parts)
        lines.append(line.rstrip())
    return "\n".join(lines)
