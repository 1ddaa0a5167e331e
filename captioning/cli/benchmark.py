"""``captioning benchmark input|train|decode|serve|litert|prepare``: the flags of each benchmark; the benchmarks
themselves are in :mod:`captioning.benchmarks` (they wire every stage together, ``prepare``
included, which is why they live with the command line)."""

from __future__ import annotations

from captioning.cli.parsing import (MAX_BENCHMARK_IMAGES, MAX_BENCHMARK_STEPS, MAX_CIDER, MAX_ROUNDS, MAX_SIDE,
                                    MAX_WORKERS, batching_flags, call, config_flags, decoding_flags, size, within)
from captioning.config.settings import MAX_DECODE_BATCH, MAX_SECONDS, MAX_STEPS

IMAGES, STEPS, ROUNDS = within(1, MAX_BENCHMARK_IMAGES), within(1, MAX_BENCHMARK_STEPS), within(1, MAX_ROUNDS)
MAX_CLIENTS = 256  # benchmark serve --concurrency: client threads on this machine


def add_benchmark(sub) -> None:
    """The ``benchmark`` command and its benchmarks, each one's flags in a function of its own below (in the
    order ``--help`` lists them)."""
    p = sub.add_parser(
        "benchmark", help="measure the input pipeline, training loop, decoding and prepare against their ceilings",
        description="Benchmarks: each measures the project's own code against a baseline and a ceiling on this "
                    "machine, prints a summary and, with --json, writes the numbers (benchmarks/RESULTS.md has "
                    "this project's results and how to read them). Each takes under 3 minutes with its defaults "
                    "on 2 cores.")
    kinds = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for add in (_add_input, _add_train, _add_quality, _add_decode, _add_serve, _add_litert, _add_prepare):
        add(kinds)


def _common(q, work_dir=True) -> None:
    """The flags every benchmark takes: --json, and --work-dir where it makes photos."""
    q.add_argument("--json", metavar="OUT", help="write the results as JSON to this file")
    if work_dir:
        q.add_argument("--work-dir", default="runs/benchmarks",
                       help="where benchmark photos are made once and reused (default runs/benchmarks)")


def _add_input(kinds) -> None:
    q = kinds.add_parser("input", help="input pipeline vs the naive pipeline and the decode ceiling",
                         description="Images/s of the naive seed-style pipeline, the training input pipeline and "
                                     "bare decode + resize on the same records; padding efficiency; cache speed-ups.")
    q.add_argument("--data", metavar="DIR", dest="data_dir", help="a prepared dataset (default: COCO-like photos made in --work-dir)")
    q.add_argument("--images", type=IMAGES, default=1000, help="photos in the train split (default 1000)")
    q.add_argument("--cache-images", type=IMAGES, default=200, help="photos for the cache epochs (default 200)")
    q.add_argument("--image-size", type=size, default=(640, 480), metavar="WxH", help="photo size (default 640x480)")
    config_flags(q, required=False, help="experiment config whose data and model sections to use (default: the "
                                         "defaults, im2txt's COCO recipe)")
    q.add_argument("--measure-images", type=within(1, MAX_BENCHMARK_STEPS), default=1500,
                   help="images timed per measurement (default 1500)")
    q.add_argument("--rounds", type=ROUNDS, default=2, help="measurements per pipeline, best kept (default 2)")
    q.add_argument("--regions", metavar="NAME",
                   help="also the pipeline reading the dataset's features store NAME (data.features: regions)")
    q.add_argument("--service", type=within(0, MAX_WORKERS), default=0, metavar="N",
                   help="also measure the pipeline through a tf.data service dispatcher and N workers started in "
                        "this process, on the same cores (default 0: not measured)")
    _common(q)
    q.set_defaults(handler=run_benchmark)


def _add_train(kinds) -> None:
    q = kinds.add_parser("train", help="the training loop: ingestion vs train-step time",
                         description="Runs the real training loop and splits each iteration into ingestion time "
                                     "(waiting for the batch) and train step time.")
    config_flags(q, help="experiment config, e.g. experiments/shapes.yaml")
    q.add_argument("--data", metavar="DIR", dest="data_dir", help="train on these prepared records (data.dir)")
    q.add_argument("--photos", action="store_true",
                   help="train on the COCO-like benchmark photos (made once in --work-dir, as benchmark input does)")
    q.add_argument("--steps", type=STEPS, default=300, help="measured steps (default 300)")
    q.add_argument("--warmup", type=within(0, MAX_BENCHMARK_STEPS), default=50, help="steps run first and not measured (default 50)")
    q.add_argument("--compare", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="also measure with this override (repeatable) and report both side by side, e.g. "
                        "data.captions_per_image=grouped")
    q.add_argument("--rounds", type=ROUNDS, default=2,
                   help="with --compare: runs of each, alternated, fastest kept (default 2)")
    _common(q)
    q.set_defaults(handler=run_benchmark)


def _add_quality(kinds) -> None:
    q = kinds.add_parser("quality", help="time to quality: training time until a test CIDEr is reached",
                         description="Trains a config with a checkpoint every --eval-every steps, evaluates each "
                                     "checkpoint afterwards (evaluation time is not on the clock) and reports the "
                                     "training time until test CIDEr first reaches --target, and the final quality.")
    config_flags(q, help="experiment config, e.g. experiments/shapes.yaml")
    q.add_argument("--data", metavar="DIR", dest="data_dir", help="train on these prepared records (data.dir)")
    q.add_argument("--eval-every", type=within(1, MAX_STEPS), default=1000, help="steps between checkpoints (default 1000)")
    q.add_argument("--target", type=within(0, MAX_CIDER, float), default=3.0, help="the CIDEr to reach (default 3.0)")
    q.add_argument("--split", default="test", help="split evaluated (default test)")
    q.add_argument("--model-dir", help="train here and keep it (default: a scratch folder, removed)")
    q.add_argument("--compare", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="then train with this override too (repeatable) and report both and the ratios, e.g. "
                        "model.dropout=0.2")
    _common(q, work_dir=False)
    q.set_defaults(handler=run_benchmark)


def _add_decode(kinds) -> None:
    q = kinds.add_parser("decode", help="batched beam search vs one image at a time",
                         description="Captions/s of batched beam search against one image per call, same code.")
    q.add_argument("--model-dir", help="a trained model (default: a small untrained model)")
    config_flags(q, required=False, help="without --model-dir: an experiment config whose model and data sections "
                                         "make the untrained model (default: the shapes demo's Show and Tell)")
    q.add_argument("--batch-size", type=within(1, MAX_DECODE_BATCH), default=128,
                   help=f"images per batched call, at most {MAX_DECODE_BATCH:,} (default 128)")
    q.add_argument("--images", type=IMAGES, default=256,
                   help="images captioned in the batched measurement (default 256)")
    decoding_flags(q, sets=False)  # its --set configures the untrained model
    q.add_argument("--ensemble-with", action="append", default=[], metavar="MODEL_DIR",
                   help="with --model-dir: also time its ensembles with the first 1, 2, ... of these folders "
                        "(repeatable) against its plain beam search")
    q.add_argument("--option", action="append", default=[], metavar="decode.KEY=VALUE[,...]", dest="decode_options",
                   help="also time these decoding settings against plain beam search (repeatable)")
    q.add_argument("--rounds", type=ROUNDS, default=3, help="timings of the SavedModel, the captioner and the cache's "
                   "decoders, in turn, best kept (default 3)")
    _common(q, work_dir=False)
    q.set_defaults(handler=run_benchmark)


def _add_serve(kinds) -> None:
    q = kinds.add_parser("serve", help="captioning serve under load: concurrent requests vs one at a time",
                         description="Starts `captioning serve`'s server in this process on 127.0.0.1 (a free port) "
                                     "and sends --requests requests one at a time, then --requests from --concurrency "
                                     "clients at once (each phase stops at its count or after --seconds): latency "
                                     "p50/p99, images/s, failed requests and model calls (the batching).")
    q.add_argument("--model-dir", required=True, help="a trained model (e.g. runs/demo/model)")
    q.add_argument("--requests", type=within(1, MAX_BENCHMARK_STEPS), default=300,
                   help="requests a phase (default 300)")
    q.add_argument("--concurrency", type=within(1, MAX_CLIENTS), default=8,
                   help=f"client threads of the concurrent phase, at most {MAX_CLIENTS} (default 8)")
    q.add_argument("--images-per-request", type=within(1, 64), default=1, help="images a request, at most 64 "
                   "(default 1)")
    q.add_argument("--seconds", type=within(1, MAX_SECONDS, float), default=120.0,
                   help="longest a phase runs, in seconds (default 120)")
    batching_flags(q)  # the server's, as `captioning serve` takes them
    _common(q)
    q.set_defaults(handler=run_benchmark)


def _add_litert(kinds) -> None:
    q = kinds.add_parser("litert", help="the .tflite export at each quantization vs the SavedModel, one image a call",
                         description="Per-image latency of `export --format litert`'s file (none, float16, "
                                     "dynamic_int8) in ai-edge-litert's interpreter against the SavedModel, one image "
                                     "per call; file sizes and their ratio; agreement of the best captions.")
    q.add_argument("--model-dir", required=True, help="a trained model (e.g. runs/demo/model)")
    q.add_argument("--images", type=IMAGES, default=200, help="synthetic shapes images captioned (default 200)")
    _common(q)
    q.set_defaults(handler=run_benchmark)


def _add_prepare(kinds) -> None:
    q = kinds.add_parser("prepare", help="prepare with all workers vs one worker vs the one-core ceiling",
                         description="Images/s of `prepare` with one worker per core and with one worker, and the "
                                     "one-core rate of its bare per-image work (decode, resize, re-encode).")
    q.add_argument("--images", type=IMAGES, default=1000, help="photos to prepare (default 1000)")
    q.add_argument("--image-size", type=size, default=(640, 480), metavar="WxH", help="photo size (default 640x480)")
    q.add_argument("--shorter-side", type=within(0, MAX_SIDE), default=346,
                   help="prepare's --shorter-side (default 346; 0: keep size)")
    q.add_argument("--workers", type=within(1, MAX_WORKERS), default=None, help="workers of the parallel run (default: the cores)")
    q.add_argument("--rounds", type=ROUNDS, default=2, help="measurements of each, best kept (default 2)")
    _common(q)
    q.set_defaults(handler=run_benchmark)


def run_benchmark(args) -> int:
    import importlib

    from captioning.benchmarks.common import write_json
    from captioning.fileio import check_output_file, check_output_folder
    from captioning.model.folder import ModelDir

    # before minutes of measuring, never over what it reads: the dataset, the config, the model's files and preset
    data = {args.data_dir: "the prepared dataset"} if getattr(args, "data_dir", None) else {}
    for flag in ("work_dir",) + (("model_dir",) if args.benchmark == "quality" else ()):  # folders it writes
        if getattr(args, flag, None) is not None:
            check_output_folder(getattr(args, flag), f"`{flag}`", params=(flag,),
                                inputs=(getattr(args, "config", None),), read_folders=data)
    if args.json is not None:  # a JSON file of others (no "benchmark" key, as every result here has) is refused
        if getattr(args, "model_dir", None):
            ModelDir(args.model_dir).refuse_output(args.json, "`json`", params=("json",))
        check_output_file(args.json, "`json`", params=("json",), kind="json", keys=("benchmark",),
                          inputs=(getattr(args, "config", None),), read_folders=data)
    bench = importlib.import_module(f"captioning.benchmarks.{args.benchmark}")  # input, train, quality, ...
    values = {"shorter_side": args.shorter_side or None} if args.benchmark == "prepare" else {}  # 0: keep size
    result = call(bench.run, args, progress=not args.quiet, **values)
    print(bench.summary(result))
    write_json(args.json, {"benchmark": args.benchmark, **result})
    return 0
