"""The ``captioning`` command line: one subcommand per stage of the data's path.

Parsers are built with argparse only; each handler imports its stage when it runs, so ``--help`` is
instant and a stage never pays for another's imports (TensorFlow takes seconds to load).

Exit codes: 0 success; 1 finished with errors on some inputs (``train``: a non-finite loss under
``train.nan_policy: stop``); 2 usage or input error (one line on stderr, no traceback); 130 interrupted.
``train`` catches SIGINT and SIGTERM itself: it finishes the step, saves a checkpoint and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from captioning import __version__
from captioning.errors import InputError, PeerLostError
from captioning.fileio import check_output_file

log = logging.getLogger("captioning")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``captioning evaluate: error: argument --batch-size: must be
    an integer of at least 1, got 0 (see captioning evaluate --help)`` and exit code 2; the line names
    the command as every other error line does (``captioning benchmark: error: …`` for its subcommands)."""

    def error(self, message: str):
        command = " ".join(self.prog.split()[:2])  # "captioning benchmark", as every other error line says
        self.exit(2, f"{command}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _at_least(low, kind=int):
    """An argparse type: an integer (or, with ``kind=float``, a finite number) of at least ``low``."""
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be {what} of at least {low:g}, got {text}")
        return value

    parse.__name__ = f"{what} >= {low:g}"
    return parse


POSITIVE, NATURAL = _at_least(1), _at_least(0)


def _key_int(text: str) -> tuple[str, int]:
    name, eq, value = text.partition("=")
    try:
        number = int(value)
    except ValueError:
        number = None
    if not eq or not name or number is None:
        raise argparse.ArgumentTypeError(f"{text!r} must look like NAME=INTEGER, e.g. train=256")
    return name, number


def _add_synth(sub) -> None:
    p = sub.add_parser(
        "synth", help="write the synthetic 'shapes' dataset in COCO captions format",
        description="Writes a deterministic synthetic captioning dataset: JPEG images of coloured shapes, "
                    "five captions each, in COCO captions format (images/, annotations/captions_{train,val,test}"
                    ".json) plus Karpathy's dataset_coco.json layout (annotations/dataset_shapes.json). "
                    "Splits are 80/10/10. The same seed gives byte-identical files.")
    p.add_argument("--output-dir", required=True, help="folder to write images/ and annotations/ into")
    p.add_argument("--num-images", type=_at_least(3), default=2000,
                   help="number of images in all splits, at least 3 (default 2000)")
    p.add_argument("--seed", type=NATURAL, default=0, help="random seed; same seed, same bytes (default 0)")
    p.add_argument("--overwrite", action="store_true", help="write even if --output-dir is not empty")
    p.set_defaults(handler=_run_synth)


def _run_synth(args) -> int:
    from data_prep.shapes import synthesize

    log.info("writing %d synthetic images to %s", args.num_images, args.output_dir)
    counts = synthesize(args.output_dir, args.num_images, args.seed, args.overwrite, progress=not args.quiet)
    print(f"shapes dataset in {args.output_dir}: " + ", ".join(f"{k} {v} images" for k, v in counts.items()))
    return 0


def _add_prepare(sub) -> None:
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
    out.add_argument("--shards", action="append", default=[], type=_key_int, metavar="NAME=N",
                     help="number of shards of a split; repeat per split "
                          "(default: max(4, ceil(images / --images-per-shard)))")
    out.add_argument("--images-per-shard", type=POSITIVE, default=1000,
                     help="images per shard when --shards does not say (default 1000, ~150 MB for COCO)")
    out.add_argument("--shorter-side", type=_at_least(8), default=None, metavar="PX",
                     help="downscale images whose shorter side is larger to PX pixels (default: keep size)")
    out.add_argument("--jpeg-quality", type=POSITIVE, default=95,
                     help="JPEG quality for images that must be re-encoded (default 95)")
    out.add_argument("--seed", type=NATURAL, default=0, help="seed of the image order within shards (default 0)")
    txt = p.add_argument_group("captions and vocabulary")
    txt.add_argument("--min-word-count", type=POSITIVE, default=4,
                     help="words seen fewer times in train captions become <unk> (default 4, as im2txt)")
    txt.add_argument("--max-caption-length", type=POSITIVE, default=20,
                     help="clip captions to this many words, <start>/<end> not counted (default 20)")
    txt.add_argument("--keep-punctuation", action="store_true",
                     help="keep punctuation tokens (default: drop them, as Karpathy's split does)")
    txt.add_argument("--vocab", metavar="FILE", help="use this vocab.txt instead of building one from train")
    run = p.add_argument_group("running")
    run.add_argument("--workers", type=POSITIVE, default=os.cpu_count() or 1,
                     help=f"processes writing shards in parallel (default: the cores, here {os.cpu_count()})")
    run.add_argument("--strict", action="store_true", help="fail on the first image that would be skipped")
    run.add_argument("--overwrite", action="store_true", help="replace a prepared dataset in --output-dir")
    run.add_argument("--resume", action="store_true",
                     help="finish an interrupted run: keep its complete shards, write the rest")
    p.set_defaults(handler=_run_prepare)


def _run_prepare(args) -> int:
    from data_prep.prepare import PrepareOptions, prepare, summarize

    shards = {}
    for name, count in args.shards:
        shards[name] = count
    opts = PrepareOptions(
        output_dir=args.output_dir, split=args.split, karpathy_json=args.karpathy_json,
        images_root=args.images_root, tfds=args.tfds, tfds_data_dir=args.tfds_data_dir,
        keep_restval=args.keep_restval, shards=shards, images_per_shard=args.images_per_shard,
        min_word_count=args.min_word_count, max_caption_length=args.max_caption_length,
        keep_punctuation=args.keep_punctuation, vocab=args.vocab, shorter_side=args.shorter_side,
        jpeg_quality=args.jpeg_quality, seed=args.seed, workers=args.workers, strict=args.strict,
        overwrite=args.overwrite, resume=args.resume)
    dataset = prepare(opts, progress=not args.quiet)
    print(f"prepared dataset in {args.output_dir}")
    print(summarize(dataset))
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from an experiment config",
        description="Trains the Show-and-Tell model described by a YAML experiment config (see experiments/). "
                    "Starting again with the same --model-dir resumes from its latest checkpoint and stops at "
                    "train.steps in total. The model folder also receives the resolved config (config.yaml), "
                    "the vocabulary and TensorBoard logs (tensorboard --logdir MODEL_DIR/logs).",
        epilog="examples:\n"
               "  captioning train --config experiments/shapes.yaml --model-dir runs/shapes\n"
               "  captioning train --config experiments/shapes.yaml --model-dir runs/s2 \\\n"
               "      --set train.steps=200 --set distribute.logical_cpus=2 --set distribute.strategy=mirrored",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment YAML (may inherit from another with base:)")
    p.add_argument("--model-dir", required=True, help="folder for checkpoints, logs, config.yaml and vocab.txt")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key, parsed by its type (repeatable), e.g. train.steps=500")
    p.set_defaults(handler=_run_train)


def _run_train(args) -> int:
    from captioning.config import load_config

    cfg = load_config(args.config, args.overrides)  # config errors come before TensorFlow loads
    from captioning.train import NonFiniteError, train

    try:
        result = train(cfg, args.model_dir, progress=not args.quiet)
    except NonFiniteError as e:  # train.nan_policy: stop
        print(f"captioning train: error: {e}", file=sys.stderr)
        return e.exit_code
    if result.interrupted:  # SIGINT/SIGTERM: the step under way finished and was saved
        print(f"interrupted at step {result.step}: saved {result.checkpoint}; run the same command to resume")
        return 0
    skipped = f" ({len(result.skipped_steps)} batches skipped: non-finite loss)" if result.skipped_steps else ""
    print(f"trained to step {result.step} in {args.model_dir}{skipped}")
    return 0


def _decoding_flags(p) -> None:
    p.add_argument("--beam-size", type=POSITIVE, default=3,
                   help="beam width; 1 is greedy decoding (default 3, as the paper)")
    p.add_argument("--max-length", type=POSITIVE, default=20, help="longest caption in words (default 20)")
    p.add_argument("--length-normalization", type=_at_least(0.0, float), default=0.0, metavar="ALPHA",
                   help="rank complete captions by log_prob / length^ALPHA (default 0: by log_prob)")


def _captioner(args):
    """The trained model of --model-dir with the decoding flags of ``_decoding_flags`` and --top-k."""
    from captioning import inference

    return inference.Captioner(inference.load(args.model_dir), beam_size=args.beam_size, max_length=args.max_length,
                               length_normalization=args.length_normalization, top_k=args.top_k)


def _add_evaluate(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="perplexity and COCO caption metrics of a trained model on a split",
        description="Captions every image of a split with beam search and scores the captions against all "
                    "their references with the COCO caption metrics (Bleu_1-4, METEOR, ROUGE_L, CIDEr; "
                    "pycocoevalcap, which needs Java), and computes the perplexity of the references. Writes "
                    "metrics.json and predictions.json (COCO results format) into the model folder, and "
                    "TensorBoard scalars under logs/eval_<split>.")
    p.add_argument("--model-dir", required=True, help="a folder written by `captioning train`")
    p.add_argument("--split", default="test", help="split of the prepared dataset (default test)")
    p.add_argument("--max-images", type=POSITIVE, default=None, help="only the first N images of the split")
    _decoding_flags(p)
    p.add_argument("--batch-size", type=POSITIVE, default=32, help="images decoded together (default 32)")
    p.add_argument("--data-dir", help="the prepared dataset, if not where the training config says")
    p.add_argument("--spice", action="store_true",
                   help="also compute SPICE (needs Stanford CoreNLP models that its first run downloads)")
    p.add_argument("--baseline", action="store_true",
                   help="also score the most frequent training caption given for every image")
    p.add_argument("--output", metavar="FILE", help="also write the metrics JSON here")
    p.set_defaults(handler=_run_evaluate)


def _run_evaluate(args) -> int:
    from captioning.evaluate import evaluate
    from captioning.metrics import format_table

    result = evaluate(args.model_dir, split=args.split, beam_size=args.beam_size, max_images=args.max_images,
                      max_length=args.max_length, length_normalization=args.length_normalization,
                      batch_size=args.batch_size, data_dir=args.data_dir, spice=args.spice,
                      baseline=args.baseline, output=args.output, progress=not args.quiet)
    rows = {"model": result["metrics"]}
    if "baseline" in result:
        rows["baseline"] = result["baseline"]
    print(f"{args.split}: {result['num_images']} images, checkpoint step {result['checkpoint_step']}, "
          f"beam {result['beam_size']}, perplexity {result['perplexity']:.3f}")
    print(format_table(rows))
    return 0


def _add_score(sub) -> None:
    p = sub.add_parser(
        "score", help="score a COCO results file against COCO caption annotations",
        description="Scores a results file ([{\"image_id\", \"caption\"}]) against COCO caption annotations as "
                    "the COCO caption evaluation does: every image of the results file against all its "
                    "references, with the same metrics, names and numbers as pycocoevalcap (Java needed).")
    p.add_argument("--annotations", required=True, help="COCO captions annotations (e.g. captions_val2014.json)")
    p.add_argument("--results", required=True, help="COCO results format: a list of {image_id, caption}")
    p.add_argument("--json", metavar="OUT", help='also write {"metrics": {...}} to this file')
    p.add_argument("--spice", action="store_true", help="also compute SPICE (needs CoreNLP models)")
    p.set_defaults(handler=_run_score)


def _run_score(args) -> int:
    from captioning.fileio import atomic_write_json
    from captioning.metrics import format_table, score_files

    if args.json:
        check_output_file(args.json, "--json")  # before the scoring, not after it
    scores = score_files(args.annotations, args.results, spice=args.spice)
    print(format_table({"results": scores}))
    if args.json:
        atomic_write_json(args.json, {"metrics": scores})
    return 0


def _add_caption(sub) -> None:
    p = sub.add_parser(
        "caption", help="caption your own images",
        description="Captions image files, or the image files of folders (any format Pillow reads). A file "
                    "that cannot be read as an image gets one error line; the others are still captioned, "
                    "and the exit code is then 1.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files or folders of them")
    p.add_argument("--model-dir", required=True, help="a folder written by `captioning train`")
    _decoding_flags(p)
    p.add_argument("--top-k", type=POSITIVE, default=1, help="captions per image, best first (at most --beam-size)")
    p.add_argument("--json", action="store_true", help="print one JSON object per image instead of text")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML gallery here")
    p.set_defaults(handler=_run_caption)


def _run_caption(args) -> int:
    from captioning import caption

    files = caption.collect_paths(args.paths)
    if args.html:
        check_output_file(args.html, "--html")  # before the model loads, not after captioning
    captioner = _captioner(args)
    results = caption.caption_files(captioner, files, progress=not args.quiet)
    if args.html:
        caption.write_gallery(args.html, results, f"captions by {args.model_dir}")
    return caption.print_results(results, args.json)


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="export a SavedModel that captions JPEG/PNG bytes",
        description="Writes a SavedModel whose serving signature takes a batch of encoded images (JPEG, PNG) "
                    "and returns the top captions and their log-probabilities, beam search inside. It loads "
                    "with tf.saved_model.load, without this project.")
    p.add_argument("--model-dir", required=True, help="a folder written by `captioning train`")
    p.add_argument("--output", required=True, help="the SavedModel folder to write")
    _decoding_flags(p)
    p.add_argument("--top-k", type=POSITIVE, default=1, help="captions per image (at most --beam-size)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output if it holds an earlier export (never a folder of other files)")
    p.set_defaults(handler=_run_export)


def _run_export(args) -> int:
    from captioning.export import check_output, export

    check_output(args.output, args.model_dir, args.overwrite)  # before the model loads
    print(f"exported to {export(_captioner(args), args.output, args.model_dir, overwrite=args.overwrite)}")
    return 0


def _size(text: str) -> tuple[int, int]:
    width, x, height = text.lower().partition("x")
    if not x or not width.isdigit() or not height.isdigit() or int(width) < 8 or int(height) < 8:
        raise argparse.ArgumentTypeError(f"{text!r} must look like WIDTHxHEIGHT, e.g. 640x480 (at least 8x8)")
    return int(width), int(height)


def _add_benchmark(sub) -> None:
    p = sub.add_parser(
        "benchmark", help="measure the input pipeline, training loop, decoding and prepare against their ceilings",
        description="Benchmarks: each measures the project's own code against a baseline and a ceiling on this "
                    "machine, prints a summary and, with --json, writes the numbers (benchmarks/RESULTS.md has "
                    "this project's results and how to read them). Each takes under 3 minutes with its defaults "
                    "on 2 cores.")
    kinds = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    def common(q, work_dir=True):
        q.add_argument("--json", metavar="OUT", help="write the results as JSON to this file")
        if work_dir:
            q.add_argument("--work-dir", default="runs/benchmarks",
                           help="where benchmark photos are made once and reused (default runs/benchmarks)")

    q = kinds.add_parser("input", help="input pipeline vs the naive pipeline and the decode ceiling",
                         description="Images/s of the naive seed-style pipeline, the training input pipeline and "
                                     "bare decode + resize on the same records; padding efficiency; cache speed-ups.")
    q.add_argument("--data", metavar="DIR", help="a prepared dataset (default: COCO-like photos made in --work-dir)")
    q.add_argument("--images", type=POSITIVE, default=1000, help="photos in the train split (default 1000)")
    q.add_argument("--cache-images", type=POSITIVE, default=200, help="photos for the cache epochs (default 200)")
    q.add_argument("--image-size", type=_size, default=(640, 480), metavar="WxH", help="photo size (default 640x480)")
    q.add_argument("--config", help="experiment config whose data and model sections to use (default: the defaults, "
                                    "im2txt's COCO recipe)")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key (repeatable)")
    q.add_argument("--measure-images", type=POSITIVE, default=1500,
                   help="images timed per measurement (default 1500)")
    q.add_argument("--rounds", type=POSITIVE, default=2, help="measurements per pipeline, best kept (default 2)")
    common(q)
    q.set_defaults(handler=_run_benchmark)

    q = kinds.add_parser("train", help="the training loop: ingestion vs train-step time",
                         description="Runs the real training loop and splits each iteration into ingestion time "
                                     "(waiting for the batch) and train step time.")
    q.add_argument("--config", required=True, help="experiment config, e.g. experiments/shapes.yaml")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key (repeatable)")
    q.add_argument("--steps", type=POSITIVE, default=300, help="measured steps (default 300)")
    q.add_argument("--warmup", type=NATURAL, default=50, help="steps run first and not measured (default 50)")
    common(q, work_dir=False)
    q.set_defaults(handler=_run_benchmark)

    q = kinds.add_parser("decode", help="batched beam search vs one image at a time",
                         description="Captions/s of batched beam search against one image per call, same code.")
    q.add_argument("--model-dir", help="a trained model (default: a small untrained model)")
    q.add_argument("--batch-size", type=POSITIVE, default=128, help="images per batched call (default 128)")
    q.add_argument("--images", type=POSITIVE, default=256,
                   help="images captioned in the batched measurement (default 256)")
    q.add_argument("--beam-size", type=POSITIVE, default=3, help="beam width (default 3)")
    q.add_argument("--max-length", type=POSITIVE, default=20, help="longest caption in words (default 20)")
    common(q, work_dir=False)
    q.set_defaults(handler=_run_benchmark)

    q = kinds.add_parser("prepare", help="prepare with all workers vs one worker vs the one-core ceiling",
                         description="Images/s of `prepare` with one worker per core and with one worker, and the "
                                     "one-core rate of its bare per-image work (decode, resize, re-encode).")
    q.add_argument("--images", type=POSITIVE, default=1000, help="photos to prepare (default 1000)")
    q.add_argument("--image-size", type=_size, default=(640, 480), metavar="WxH", help="photo size (default 640x480)")
    q.add_argument("--shorter-side", type=NATURAL, default=346,
                   help="prepare's --shorter-side (default 346; 0: keep size)")
    q.add_argument("--workers", type=POSITIVE, default=None, help="workers of the parallel run (default: the cores)")
    q.add_argument("--rounds", type=POSITIVE, default=2, help="measurements of each, best kept (default 2)")
    common(q)
    q.set_defaults(handler=_run_benchmark)


def _run_benchmark(args) -> int:
    from captioning.benchmarks.common import write_json

    if args.benchmark == "input":
        from captioning.benchmarks import input as bench

        result = bench.run(args.config, tuple(args.overrides), args.data, args.images, args.cache_images,
                           args.image_size, args.work_dir, args.measure_images, args.rounds, progress=not args.quiet)
    elif args.benchmark == "train":
        from captioning.benchmarks import train as bench

        result = bench.run(args.config, tuple(args.overrides), args.steps, args.warmup, progress=not args.quiet)
    elif args.benchmark == "decode":
        from captioning.benchmarks import decode as bench

        result = bench.run(args.model_dir, args.batch_size, args.images, args.beam_size, args.max_length,
                           progress=not args.quiet)
    else:
        from captioning.benchmarks import prepare as bench

        result = bench.run(args.images, args.image_size, args.shorter_side or None, workers=args.workers,
                           work_dir=args.work_dir, rounds=args.rounds, progress=not args.quiet)
    print(bench.summary(result))
    write_json(args.json, result)
    return 0


# (prepare loads it only for a TFDS source, data_prep.sources.TfdsSource; its workers never do.)
_USES_TENSORFLOW = {"train", "evaluate", "caption", "export", "benchmark"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="captioning", description="Show-and-Tell image captioning on TensorFlow 2: prepare data, "
                                       "train, evaluate, caption.")
    parser.add_argument("--version", action="version", version=f"captioning {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, TensorFlow's included")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_synth(sub)
    _add_prepare(sub)
    _add_train(sub)
    _add_evaluate(sub)
    _add_score(sub)
    _add_caption(sub)
    _add_export(sub)
    _add_benchmark(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is first imported
        os.environ.setdefault("CAPTIONING_QUIET_TF", "1")  # for worker processes too
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    if not args.verbose:  # TensorFlow's own Python logger narrates internals (checkpoint sharding, ...)
        logging.getLogger("tensorflow").setLevel(logging.WARNING)
        logging.getLogger("absl").setLevel(logging.WARNING)
    from tqdm.contrib.logging import logging_redirect_tqdm

    if not args.verbose and args.command in _USES_TENSORFLOW:
        from captioning.tf_import import import_tensorflow_quietly

        import_tensorflow_quietly()
    try:
        with logging_redirect_tqdm():  # log lines print above progress bars, not through them
            return args.handler(args)
    except InputError as e:
        print(f"captioning {args.command}: error: {e}", file=sys.stderr)
        if isinstance(e, PeerLostError):
            # TF's coordination agent, shut down in an error state, logs that state from C++ at exit,
            # after this line: the line above says it all, so stderr ends here (exit itself stays normal).
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        return e.exit_code
    except Exception as e:  # a full disk wherever it strikes (a log, a summary): one line, not a traceback
        from captioning.fileio import disk_full_error

        error = disk_full_error(e, getattr(e, "filename", None) or "the disk", "an output")
        if error is None:
            raise
        print(f"captioning {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"captioning {args.command}: interrupted", file=sys.stderr)
        return 130
