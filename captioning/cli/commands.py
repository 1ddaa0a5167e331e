"""The commands of the data's path, one ``add_*`` (its flags) and one ``run_*`` (its work) each:
``synth``, ``prepare``, ``train``, ``evaluate``, ``score``, ``caption`` (``export``'s:
:mod:`captioning.cli.export`). Each ``run_*`` imports its stage when it runs, so ``--help`` is instant and a
stage never pays for another's imports (TensorFlow takes seconds to load). Parameters reach the library through
:func:`captioning.cli.parsing.options` and :func:`~captioning.cli.parsing.call`, never copied by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from captioning.cli.parsing import (MAX_IMAGES_PER_SHARD, MAX_SEED, MAX_SHARDS, MAX_SIDE, MAX_SPLIT_IMAGES,
                                    MAX_SYNTH_IMAGES, MAX_WORD_COUNT, MAX_WORKERS, call, config_flags, decoding_flags,
                                    key_int, options, within)
from captioning.config.settings import MAX_DECODE_BATCH, MAX_WORDS
from captioning.data.scenes import SCENES
from captioning.fileio import check_output_file, check_output_folder

log = logging.getLogger("captioning")


def add_synth(sub) -> None:
    p = sub.add_parser(
        "synth", help="write a synthetic dataset ('shapes' or 'hard' scenes) in COCO captions format",
        description="Writes a deterministic synthetic captioning dataset: JPEG images of coloured shapes, "
                    "five captions each, in COCO captions format (images/, annotations/captions_{train,val,test}"
                    ".json), COCO instances files with each shape's box, colour and size "
                    "(annotations/instances_{train,val,test}.json) and Karpathy's dataset_coco.json layout "
                    "(annotations/dataset_shapes.json). "
                    "Splits are 80/10/10. The same seed gives byte-identical files.")
    p.add_argument("--output-dir", required=True, help="folder to write images/ and annotations/ into")
    p.add_argument("--num-images", type=within(3, MAX_SYNTH_IMAGES), default=2000,
                   help=f"number of images in all splits, at least 3 and at most {MAX_SYNTH_IMAGES:,} (default 2000)")
    p.add_argument("--seed", type=within(0, MAX_SEED), default=0,
                   help="random seed; same seed, same bytes (default 0)")
    p.add_argument("--scenes", choices=SCENES, default=SCENES[0],
                   help="shapes: one to three shapes of three kinds and six colours (the default); hard: three to "
                        "six overlapping shapes of six kinds, eight colours, three sizes and fills, clutter, and "
                        "captions with counts, relations and the largest shape")
    p.add_argument("--overwrite", action="store_true", help="write even if --output-dir is not empty")
    p.add_argument("--text-only", action="store_true",
                   help="write only the captions, one a line, to --output-dir/captions.txt (no images; fast: for "
                        "captioning lm train); a rerun with the same flags is a no-op")
    p.set_defaults(handler=run_synth)


def run_synth(args) -> int:
    from data_prep.synth import synthesize, synthesize_text

    check_output_folder(args.output_dir, "`output_dir`", params=("output_dir",))
    if args.text_only:
        log.info("writing the captions of %d synthetic images (%s scenes) to %s", args.num_images, args.scenes,
                 args.output_dir)
        counts = call(synthesize_text, args, progress=not args.quiet)
        print(f"{args.scenes} captions in {args.output_dir}/captions.txt: {counts['captions']:,} captions of "
              f"{counts['images']:,} images" + ("" if counts["written"] else " (already there: nothing to do)"))
        return 0
    log.info("writing %d synthetic images (%s scenes) to %s", args.num_images, args.scenes, args.output_dir)
    counts = call(synthesize, args, progress=not args.quiet)
    print(f"{args.scenes} dataset in {args.output_dir}: " + ", ".join(f"{k} {v} images" for k, v in counts.items()))
    return 0


def add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="turn COCO-format captions and images into sharded TFRecords",
        description="Reads captions and images from one source, validates every image, tokenizes the "
                    "captions, builds the vocabulary from the train split and writes one record per image "
                    "into sharded TFRecords, with vocab.txt and manifest.json (written last).",
        epilog="examples:\n"
               "  captioning prepare --split train=captions_train2014.json:train2014/ \\\n"
               "                     --split val=captions_val2014.json:val2014/ --output-dir data/coco\n"
               "  captioning prepare --karpathy-json dataset_coco.json --images-root coco/ --output-dir data/k\n"
               "  captioning prepare --tfds coco_captions --output-dir data/tfds",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("source (exactly one kind)")
    src.add_argument("--split", action="append", default=[], metavar="NAME=ANNOTATIONS.json:IMAGES_DIR",
                     help="a COCO captions file and its images folder, read with pycocotools; repeat per split")
    src.add_argument("--karpathy-json", metavar="FILE", help="Karpathy's dataset_coco.json (splits inside)")
    src.add_argument("--images-root", metavar="ROOT", help="with --karpathy-json: image path = ROOT/filepath/filename")
    src.add_argument("--tfds", metavar="NAME", help="a prepared TFDS dataset, e.g. coco_captions (never downloads)")
    src.add_argument("--tfds-data-dir", metavar="DIR", help="TFDS data folder (default: TFDS's own default)")
    src.add_argument("--keep-restval", action="store_true",
                     help="keep Karpathy's 'restval' images as their own split instead of adding them to train")
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", required=True, help="folder for the shards, vocab.txt and manifest.json")
    out.add_argument("--shards", action="append", default=[], type=key_int(1, MAX_SHARDS), metavar="NAME=N",
                     help=f"number of shards of a split, at most {MAX_SHARDS:,}; repeat per split "
                          "(default: max(4, ceil(images / --images-per-shard)))")
    out.add_argument("--images-per-shard", type=within(1, MAX_IMAGES_PER_SHARD), default=1000,
                     help=f"images per shard when --shards does not say, at most {MAX_IMAGES_PER_SHARD:,} (default "
                          "1000, ~150 MB for COCO)")
    out.add_argument("--shorter-side", type=within(8, MAX_SIDE), default=None, metavar="PX",
                     help="downscale images whose shorter side is larger to PX pixels (default: keep size)")
    out.add_argument("--jpeg-quality", type=within(1, 100), default=95,
                     help="JPEG quality for images that must be re-encoded, 1 to 100 (default 95)")
    out.add_argument("--seed", type=within(0, MAX_SEED), default=0,
                     help="seed of the image order within shards (default 0)")
    txt = p.add_argument_group("captions and vocabulary")
    txt.add_argument("--min-word-count", type=within(1, MAX_WORD_COUNT), default=4,
                     help="words seen fewer times in train captions become <unk> (default 4, as im2txt)")
    txt.add_argument("--max-caption-length", type=within(1, MAX_WORDS), default=20,
                     help=f"clip captions to this many words, <start>/<end> not counted, at most {MAX_WORDS} (the "
                          "longest caption a model decodes; default 20)")
    txt.add_argument("--keep-punctuation", action="store_true",
                     help="keep punctuation tokens (default: drop them, as Karpathy's split does)")
    txt.add_argument("--vocab", metavar="FILE", help="use this vocab.txt instead of building one from train")
    run = p.add_argument_group("running")
    run.add_argument("--workers", type=within(1, MAX_WORKERS), default=min(os.cpu_count() or 1, MAX_WORKERS),
                     help=f"processes writing shards in parallel, at most {MAX_WORKERS} (default: the cores, here "
                          f"{os.cpu_count()})")
    run.add_argument("--strict", action="store_true", help="fail on the first image that would be skipped")
    run.add_argument("--overwrite", action="store_true", help="replace a prepared dataset in --output-dir")
    run.add_argument("--resume", action="store_true",
                     help="finish an interrupted run: keep its complete shards, write the rest")
    p.set_defaults(handler=run_prepare)


def run_prepare(args) -> int:
    from data_prep.prepare import PrepareOptions, prepare, summarize
    from data_prep.sources import parse_split_arg

    # never one of the files or folders it reads (it writes vocab.txt, manifest.json and shards there)
    sources = [path for arg in args.split for path in parse_split_arg(arg)[1:]]
    check_output_folder(args.output_dir, "`output_dir`", params=("output_dir",), inputs=sources + [
        args.karpathy_json, args.images_root, args.vocab, args.tfds_data_dir])
    dataset = prepare(options(PrepareOptions, args, shards=dict(args.shards)), progress=not args.quiet)
    print(f"prepared dataset in {args.output_dir}")
    print(summarize(dataset))
    return 0


def add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from an experiment config",
        description="Trains the captioning model described by a YAML experiment config (see experiments/). "
                    "Starting again with the same --model-dir resumes from its latest checkpoint and stops at "
                    "train.steps in total; a changed train.objective (e.g. scst after xe), train.optimizer or "
                    "model.encoder_trainable continues from the latest checkpoint's weights with a new "
                    "optimizer. The model folder also receives the resolved config (config.yaml), "
                    "the vocabulary and TensorBoard logs (tensorboard --logdir MODEL_DIR/logs).",
        epilog="examples:\n"
               "  captioning train --config experiments/shapes.yaml --model-dir runs/shapes\n"
               "  captioning train --config experiments/shapes.yaml --model-dir runs/s2 \\\n"
               "      --set train.steps=200 --set distribute.logical_cpus=2 --set distribute.strategy=mirrored\n"
               "  captioning train --config experiments/shapes_scst.yaml --model-dir runs/scst --init-from runs/shapes",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    config_flags(p)
    p.add_argument("--model-dir", required=True, help="folder for checkpoints, logs, config.yaml and vocab.txt")
    p.add_argument("--init-from", metavar="MODEL_DIR",
                   help="start a new --model-dir from the weights of this trained folder's latest checkpoint (same "
                        "vocabulary and architecture; e.g. self-critical training from a cross-entropy model)")
    p.set_defaults(handler=run_train)


def run_train(args) -> int:
    from captioning.config import load_config

    # the config file's errors before TensorFlow loads (main() has read it already: that one, not again)
    cfg = getattr(args, "loaded_config", None) or load_config(args.config, args.overrides)
    from captioning.experiment import for_training  # TensorFlow loads here (the registries' modules)
    from captioning.train import Interrupted, NonFiniteError, train

    # typed once, fitted to the objective and the data: before TensorFlow's runtime starts
    experiment = for_training(cfg)
    from captioning.model.folder import read_folders

    # never the prepared dataset, a preset or the config it reads
    check_output_folder(args.model_dir, "`model_dir`", params=("model_dir",), inputs=(args.config,),
                        read_folders=read_folders(experiment.config, data=True))

    try:
        result = train(experiment, args.model_dir, progress=not args.quiet, init_from=args.init_from)
    except NonFiniteError as e:  # train.nan_policy: stop
        print(f"captioning train: error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:  # SIGINT/SIGTERM before the first step (waiting for a tf.data dispatcher)
        print(f"captioning train: {e}", file=sys.stderr)
        return 0
    if result.interrupted:  # SIGINT/SIGTERM: the step under way finished and was saved
        print(f"interrupted at step {result.step}: saved {result.checkpoint}; run the same command to resume")
        return 0
    skipped = f" ({len(result.skipped_steps)} batches skipped: non-finite loss)" if result.skipped_steps else ""
    print(f"trained to step {result.step} in {args.model_dir}{skipped}")
    return 0


MODEL_DIRS_HELP = ("a folder written by `captioning train`; repeat it for an ensemble (models of one vocabulary, any "
                   "decoders: each step averages their word probabilities)")


def add_model_dirs(p) -> None:
    """``--model-dir``, repeatable: one model or an ensemble (``args.model_dir``: a list of folders); ``--weights``:
    which of the checkpoint's weights (:meth:`captioning.model.folder.ModelDir.use_weights`)."""
    p.add_argument("--model-dir", required=True, action="append", metavar="MODEL_DIR", help=MODEL_DIRS_HELP)
    p.add_argument("--weights", choices=("ema", "raw"), default=None,  # captioning.model.checkpoints.WEIGHTS
                   help="ema: the weight average train.ema_decay kept; raw: the weights as trained (default: ema "
                        "when the checkpoint holds an average, else raw; an ensemble: each model's own default)")


def _decoding_given(args) -> dict:
    """The decoding flags given (None: not given), every value checked on its own with the ``--set decode.KEY``
    overrides (a type, a range, the sizes' upper bounds): one line before a model loads."""
    from captioning.config.sections import DecodeConfig

    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DecodeConfig)}
    DecodeConfig.check_given(getattr(args, "decode_overrides", ()), **flags)
    return flags


def _captioner(args):
    """The trained model of --model-dir (of several, their ensemble), decoding as its (the first's)
    ``decode:`` config says, the decoding flags given overriding it."""
    from captioning import inference

    flags = _decoding_given(args)
    trained = inference.load(args.model_dir, weights=args.weights)
    decode = trained.config.decode.override(**flags).with_overrides(getattr(args, "decode_overrides", ()))
    return inference.Captioner(trained, decode)


def add_evaluate(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="perplexity and COCO caption metrics of a trained model on a split",
        description="Captions every image of a split with beam search and scores the captions against all "
                    "their references with the COCO caption metrics (Bleu_1-4, METEOR, ROUGE_L, CIDEr; "
                    "pycocoevalcap, which needs Java), and computes the perplexity of the references. Keeps the "
                    "result in the model folder as eval/<key>.json and the captions as eval/<key>.predictions.json "
                    "(COCO results format), the key naming the split, checkpoint, decoding, images and dataset; "
                    "the same evaluation again prints the stored result. Also TensorBoard scalars under "
                    "logs/eval_<split>; --output writes the metrics JSON to a file of your choice too.")
    add_model_dirs(p)
    p.add_argument("--split", default="test", help="split of the prepared dataset (default test)")
    p.add_argument("--max-images", type=within(1, MAX_SPLIT_IMAGES), default=None,
                   help=f"only the first N images of the split (N at most {MAX_SPLIT_IMAGES:,})")
    decoding_flags(p)
    p.add_argument("--batch-size", type=within(1, MAX_DECODE_BATCH), default=32,
                   help=f"images decoded together, at most {MAX_DECODE_BATCH:,} (default 32)")
    p.add_argument("--data-dir", help="the prepared dataset, if not where the training config says")
    p.add_argument("--spice", action="store_true",
                   help="also compute SPICE (needs Stanford CoreNLP models that its first run downloads)")
    p.add_argument("--baseline", action="store_true",
                   help="also score the most frequent training caption given for every image")
    p.add_argument("--output", metavar="FILE", help="also write the metrics JSON here")
    p.add_argument("--checkpoint", metavar="PATH", help="evaluate this checkpoint (MODEL_DIR/ckpt-N; default: "
                                                       "the latest complete one)")
    p.add_argument("--instances", metavar="FILE",
                   help="an instances file of the split (captioning synth writes instances_<split>.json; or COCO's "
                        "instances_val2014.json): also report object hallucination (CHAIRi, CHAIRs, object recall), "
                        "and on the synthetic shapes which shapes the captions name, by number of shapes, and for an "
                        "attention model how much attention each colour or kind word put inside the named shape's box")
    p.add_argument("--clip-preset", metavar="NAME_OR_DIR",
                   help="a keras-hub CLIP or SigLIP preset (a folder save_to_preset wrote, or a preset name, which "
                        "keras-hub downloads): also report CLIPScore, RefCLIPScore and text-to-image recall@1/@5")
    p.add_argument("--clip-metric", choices=("clip", "pac"), default="clip",
                   help="pac: the preset holds PAC-S's fine-tuned CLIP; report PAC-S and RefPAC-S (w = 2.0)")
    p.set_defaults(handler=run_evaluate)


def run_evaluate(args) -> int:
    from captioning.evaluation import clip_score, endings, hallucination
    from captioning.evaluation.diversity import describe_diversity
    from captioning.evaluation.evaluate import evaluate
    from captioning.evaluation.metrics import format_table, grounding_table

    _decoding_given(args)  # before the model loads
    result = call(evaluate, args, progress=not args.quiet)
    rows = {"model": result.metrics}
    if result.baseline is not None:
        rows["baseline"] = result.baseline
    which = (f"an ensemble of {len(result.members)} models" if result.members
             else f"checkpoint step {result.checkpoint_step}")
    if "ema" in (result.get("weights") or ()):  # "ema", or an ensemble's list
        which += ", its weight average" if not result.members else ", weight averages"
    method = (result.decode or {}).get("method", "beam")  # what ran: greedy is beam 1, sampling has no beam
    decoding = {"greedy": "greedy", "sample": "sampling"}.get(method, f"beam {result.beam_size}")
    print(f"{args.split}: {result.num_images} images, {which}, {decoding}, "
          f"perplexity {result.perplexity:.3f}")
    print(format_table(rows))
    if result.diversity:
        print(describe_diversity(result.diversity))
    for line in (endings.describe(result), hallucination.describe(result), clip_score.describe(result)):  # "": none
        if line:
            print(line)
    if result.grounding:
        print(grounding_table(result.grounding))
    return 0


def add_score(sub) -> None:
    p = sub.add_parser(
        "score", help="score a COCO results file against COCO caption annotations",
        description="Scores a results file ([{\"image_id\", \"caption\"}]) against COCO caption annotations as "
                    "the COCO caption evaluation does: every image of the results file against all its "
                    "references, with the same metrics, names and numbers as pycocoevalcap (Java needed).")
    p.add_argument("--annotations", required=True, help="COCO captions annotations (e.g. captions_val2014.json)")
    p.add_argument("--results", required=True, help="COCO results format: a list of {image_id, caption}")
    p.add_argument("--json", metavar="OUT", help='also write {"metrics": {...}} to this file')
    p.add_argument("--spice", action="store_true", help="also compute SPICE (needs CoreNLP models)")
    p.set_defaults(handler=run_score)


def run_score(args) -> int:
    from captioning.fileio import atomic_write_json
    from captioning.evaluation.metrics import format_table, score_files

    if args.json is not None:
        # before the scoring, not after it; never over the files it reads
        check_output_file(args.json, "`json`", params=("json",), inputs=(args.annotations, args.results),
                          kind="json", keys=("metrics",))
    scores = score_files(args.annotations, args.results, spice=args.spice)
    print(format_table({"results": scores}))
    if args.json:
        atomic_write_json(args.json, {"metrics": scores})
    return 0


def add_caption(sub) -> None:
    p = sub.add_parser(
        "caption", help="caption your own images",
        description="Captions image files, or the image files of folders (any format Pillow reads). A file "
                    "that cannot be read as an image gets one error line; the others are still captioned, "
                    "and the exit code is then 1.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files or folders of them")
    add_model_dirs(p)
    decoding_flags(p, top_k=True)
    p.add_argument("--json", action="store_true", help="print one JSON object per image instead of text")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML gallery here")
    p.add_argument("--detections", action="append", metavar="FILE",
                   help="a model reading regions: COCO detection results or instances file of the images' boxes "
                        "(repeatable; matched by the instances file's file names, else by the number a file name "
                        "ends with)")
    p.set_defaults(handler=run_caption)


def run_caption(args) -> int:
    from captioning.errors import InputError
    from captioning.inference import caption
    from captioning.model.data_sources import data_source
    from captioning.model.folder import ModelDir

    _decoding_given(args)  # before anything is read
    files = caption.collect_paths(args.paths)
    folders = [ModelDir(path) for path in args.model_dir]
    if args.html is not None:  # before the model loads, not after captioning; never over an image or a model's files
        for folder in folders:
            folder.refuse_output(args.html, "`html`", params=("html",))
        check_output_file(args.html, "`html`", params=("html",), inputs=files + (args.detections or []), kind="html")
    configs = {folder.path: folder.read_config() for folder in folders}  # before the models load: what they read
    sources = {path: data_source(cfg) for path, cfg in configs.items() if cfg is not None}  # what each model reads
    regions = [path for path, source in sources.items() if source.takes_boxes]
    if regions and not args.detections:
        raise InputError(f"the model in {regions[0]} reads regions: give each image's boxes with --detections "
                         "FILE (COCO detection results or instances file)", params=("detections",))
    if args.detections and not regions and all(cfg is not None for cfg in configs.values()):
        raise InputError(f"--detections: the model in {args.model_dir[0]} reads its encoder's grid, not regions (it "
                         "was not trained with data.features: regions)", params=("detections",))
    for path in regions:
        sources[path].check_boxes(path)
    boxes = caption.detections_for(files, args.detections) if regions else None
    captioner = _captioner(args)
    results = caption.caption_files(captioner, files, progress=not args.quiet, boxes=boxes)
    if args.html:
        caption.write_gallery(args.html, results, f"captions by {' + '.join(args.model_dir)}")
    return caption.print_results(results, args.json)
