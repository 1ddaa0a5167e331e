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

import contextlib
import io
import logging
import os
import shutil

from captioning.errors import InputError

log = logging.getLogger("captioning.metrics")

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


def coco_metrics(references: dict, candidates: dict, spice: bool = False) -> dict[str, float]:
    """``references``: image id → list of reference captions; ``candidates``: image id → one caption.

    Scores the images of ``candidates`` (each must have references) and returns ``{metric: value}``.
    """
    check_java()
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
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
    tokenizer = PTBTokenizer()
    gts, res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
    with _us_locale_for_java():
        meteor = Meteor()
    scorers = [(Bleu(4), ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]), (meteor, "METEOR"), (Rouge(), "ROUGE_L"),
               (Cider(), "CIDEr")]
    if spice:
        spice_scorer = _spice()
        if spice_scorer is not None:
            scorers.append((spice_scorer, "SPICE"))
    metrics = {}
    for scorer, method in scorers:
        with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its ratios
            score, _ = scorer.compute_score(gts, res)
        if isinstance(method, list):
            metrics.update({m: float(s) for m, s in zip(method, score)})
        else:
            metrics[method] = float(score)
    del meteor  # stops METEOR's JVM
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


def score_files(annotations_path: str, results_path: str, spice: bool = False) -> dict[str, float]:
    """Scores a COCO results file (``[{"image_id", "caption"}]``) against COCO caption annotations, as the
    COCO caption evaluation does: every image of the results file, against all its references."""
    import json

    from pycocotools.coco import COCO

    for path, what in ((annotations_path, "annotations"), (results_path, "results")):
        if not os.path.isfile(path):
            raise InputError(f"{what} file {path} does not exist")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(annotations_path)
    except json.JSONDecodeError as e:
        raise InputError(f"annotations file {annotations_path} is not valid JSON: {e}") from None
    try:
        with open(results_path, encoding="utf-8") as f:
            results = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"results file {results_path} is not valid JSON: {e}") from None
    if not isinstance(results, list) or not all(isinstance(r, dict) and {"image_id", "caption"} <= set(r)
                                                for r in results):
        raise InputError(f"results file {results_path} must be a list of {{\"image_id\", \"caption\"}} objects")
    unknown = sorted({r["image_id"] for r in results} - set(coco.getImgIds()))
    if unknown:
        raise InputError(f"results file {results_path} has image ids not in {annotations_path}, e.g. {unknown[0]}")
    seen = set()
    for r in results:
        if r["image_id"] in seen:
            raise InputError(f"results file {results_path} has two captions for image {r['image_id']}")
        seen.add(r["image_id"])
    with contextlib.redirect_stdout(io.StringIO()):
        res = coco.loadRes(results)
    ids = res.getImgIds()
    references = {i: [a["caption"] for a in coco.imgToAnns[i]] for i in ids}
    candidates = {i: res.imgToAnns[i][0]["caption"] for i in ids}
    return coco_metrics(references, candidates, spice=spice)


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """A plain-text table: one column per row name (e.g. model, baseline), one line per metric."""
    names = list(rows)
    lines = [f"{'metric':<9}" + "".join(f"{n:>12}" for n in names)]
    for metric in METRICS + (("SPICE",) if any("SPICE" in r for r in rows.values()) else ()):
        lines.append(f"{metric:<9}" + "".join(f"{rows[n].get(metric, float('nan')):>12.4f}" for n in names))
    return "\n".join(lines)
