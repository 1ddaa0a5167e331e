"""``captioning benchmark input``: the training input pipeline against the naive one and the ceiling.

On the same prepared records, in one run, images per second of:

- ``naive`` — the seed-style pipeline: one TFRecord file after another, one record parsed at a time,
  a sequential decode / resize / crop map, captions fanned out and padded to the batch's longest,
  no prefetch (and tf.data's automatic map parallelisation and prefetch injection turned off);
- ``pipeline`` — :func:`captioning.data.pipeline.make_dataset`, exactly as ``train`` calls it;
- ``ceiling`` — :func:`captioning.data.reading.decode_and_resize` of the same JPEG bytes held in
  memory, in a parallel ``tf.data`` map with nothing else: what the cores can decode;
- ``grouped`` — the pipeline with ``data.captions_per_image: grouped`` (batches of whole images with
  all their captions: each image copied into one batch, not into one per caption);
- ``service`` (with ``--service N``) — the same pipeline run by a tf.data service dispatcher and N
  workers started in this process, on the same cores: what the service costs (``data.service``); then
  the service in processes of its own on other cores than this one's: what it takes off the trainer
  (:mod:`captioning.benchmarks.offload`, ``service_trainer_cpu_ratio``);
- ``regions`` (with ``--regions NAME``) — the pipeline with ``data.features: regions`` reading the
  dataset's features store NAME instead of decoding JPEGs (:mod:`captioning.data.region_input`).

Images, not examples, are counted (an image carries ~5 captions). Each is measured ``rounds`` times,
interleaved, and the best kept; CPU time per image is reported too (it barely moves when something
else shares the machine). Then padding efficiency (real tokens / token steps the decoder computes) of
the pipeline's length-grouped batches against batches padded to their longest caption without grouping
(``length_window: 1``) and against grouped batches (``captions_per_image: grouped``), both padded and
as ``train.split_padding`` computes them, and the speed-up of a second epoch over the first with
``cache: memory`` and ``cache: features`` (the frozen encoder of the config, without ImageNet weights).

The data: ``--data DIR`` (a prepared dataset), or COCO-like photos made and prepared once under
``--work-dir`` (:mod:`captioning.benchmarks.photos`; 640×480 by default): a ``train`` split of
``--images`` and a ``val`` split of ``--cache-images`` for the cache epochs. The config defaults to
the project defaults, whose data section is im2txt's COCO recipe (346² resize, random 299² crop and
flip, every caption of every image).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning import config as config_lib
from captioning.config.sections import DataConfig
from captioning.data import schema
from captioning.benchmarks import common, offload
from captioning.benchmarks.photos import cached_photos
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.data.pipeline import make_dataset
from captioning.data.preprocessor import ImagePreprocessor
from captioning.data.reading import decode_and_resize
from captioning.vocab import PAD_ID

log = logging.getLogger("captioning.benchmark")

PHOTOS = {"images": 1000, "cache_images": 200, "size": (640, 480)}  # the default benchmark photos
TARGETS = {"pipeline_vs_ceiling": 0.9, "pipeline_vs_naive": 1.5, "bucketed_padding_efficiency": 0.9,
           "grouped_padding_efficiency": 0.85, "features_cache_speedup": 10.0, "service_vs_pipeline": 0.85}


def local_service(workers: int) -> list:
    """A tf.data service dispatcher and ``workers`` workers in this process, on free localhost ports (the
    dispatcher first): the service's overhead measured on the cores the local pipeline uses."""
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://")[-1]
    return [dispatcher] + [service.WorkerServer(service.WorkerConfig(dispatcher_address=address))
                           for _ in range(workers)]


def photo_records(work_dir: str, images: int, cache_images: int, size: tuple[int, int], seed: int = 0,
                  progress: bool = True) -> str:
    """A prepared dataset of benchmark photos (``train``: ``images``, ``val``: ``cache_images``), made
    once per arguments under ``work_dir`` and reused."""
    from data_prep.prepare import PrepareOptions, prepare

    photos = cached_photos(work_dir, {"train": images, "val": cache_images}, size, seed, progress=progress)
    records = os.path.join(photos["root"], "records")
    if not os.path.exists(PreparedDataset.manifest_path(records)):
        log.info("preparing the benchmark photos into %s (once)", records)
        prepare(PrepareOptions(output_dir=records, split=photos["splits"], overwrite=True, min_word_count=1,
                               workers=common.available_cores()), progress=progress)
    return records


def naive_dataset(files: list[str], cfg: DataConfig, batch_size: int) -> tf.data.Dataset:
    """The seed-style pipeline (see the module docstring), doing the same work per image."""
    size, preprocessor = cfg.image_size, ImagePreprocessor.of(cfg)

    @do_not_convert
    def parse(serialized):
        example = schema.parse_batch(serialized[None])
        return {"encoded": example[schema.IMAGE_ENCODED][0], "captions": example[schema.CAPTION_IDS][0]}

    @do_not_convert
    def decode(example):
        image = tf.image.random_crop(decode_and_resize(example["encoded"], preprocessor), [size, size, 3])
        if cfg.random_flip:
            image = tf.image.random_flip_left_right(image)
        return {"image": image, "captions": example["captions"]}

    @do_not_convert
    def examples(example):
        return tf.data.Dataset.from_tensor_slices(example["captions"]).map(do_not_convert(
            lambda c: {"image": example["image"], "input_ids": c[:-1], "target_ids": c[1:]}))

    ds = tf.data.TFRecordDataset(files).repeat().map(parse).map(decode).flat_map(examples)
    ds = ds.padded_batch(batch_size, padding_values={"image": tf.constant(0, tf.uint8),
                                                     "input_ids": tf.constant(PAD_ID, tf.int64),
                                                     "target_ids": tf.constant(PAD_ID, tf.int64)})
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


def ceiling_dataset(encoded: list[bytes], preprocessor: ImagePreprocessor, batch_size: int) -> tf.data.Dataset:
    """Bare decode + resize (the preprocessor's) of JPEG bytes in memory, in parallel; batched only to count
    cheaply."""
    return (tf.data.Dataset.from_tensor_slices(tf.constant(encoded)).repeat()
            .map(do_not_convert(lambda e: decode_and_resize(e, preprocessor)),
                 num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch_size).prefetch(tf.data.AUTOTUNE))


def _encoded_images(files: list[str]) -> list[bytes]:
    out = []
    for batch in tf.data.TFRecordDataset(files).batch(256).map(do_not_convert(schema.parse_batch)):
        out.extend(batch[schema.IMAGE_ENCODED].numpy().tolist())
    return out


def images_in(batch: dict, captions_per_image: float) -> float:
    """Images in a batch of the pipeline: its images when grouped, else its captions over the captions
    per image (every caption carries its own copy of its image)."""
    if "image_index" in batch:
        return int(tf.shape(batch["image"])[0])
    return int(tf.shape(batch["input_ids"])[0]) / captions_per_image


def stage_cpu_ms(cfg: DataConfig, split: str, batch_size: int, measure_images: int,
                 captions_per_image: float, full: tf.data.Dataset | None = None) -> dict:
    """CPU ms per image of each stage of the training pipeline, from cumulative pipelines timed one after
    another (the difference of two is the stage between them): ``parse`` (read, parse and split the
    records, no image decoded), ``decode_crop`` (decode of the crop window, resize, flip: the per-image
    work), ``batching`` (caption grouping, padding, gathering images into batches: the rest of the full
    pipeline). The partial pipelines are batched too, so each stage's figure carries the same share of
    Python's per-batch cost. CPU time, unlike a rate, compares between machines and barely moves when
    something else shares the machine. ``full``: the training pipeline of ``cfg``, when the caller has built it
    already (its construction traces the pipeline's functions, about half a CPU second: not done twice)."""
    from captioning.data.reading import image_dataset, parsed_images

    def batched(ds):  # Python pulls a batch at a time, as from the full pipeline: its per-pull cost is shared
        return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)

    def per_image_ids(batch):
        return int(tf.shape(batch["image_id"])[0])

    pipelines = {
        "parse": (batched(parsed_images(cfg, split, training=True, shuffle=True, repeat=True)), per_image_ids),
        "decode_crop": (batched(image_dataset(cfg, split, training=True, shuffle=True, repeat=True,
                                              random_crop=cfg.random_crop)), per_image_ids),
        "full": (full if full is not None else make_dataset(cfg, split, training=True, batch_size=batch_size),
                 lambda b: images_in(b, captions_per_image)),
    }
    cumulative = {name: common.throughput(iter(ds), counter, measure_images, warmup=min(300, measure_images))
                  ["cpu_ms_per_unit"] for name, (ds, counter) in pipelines.items()}
    return {"parse": cumulative["parse"], "decode_crop": cumulative["decode_crop"] - cumulative["parse"],
            "batching": cumulative["full"] - cumulative["decode_crop"], "total": cumulative["full"]}


def padding_efficiency(dataset: tf.data.Dataset, batches: int, split: bool = False) -> tuple[float, float | None]:
    """Real tokens / token steps the decoder computes over ``batches`` batches: every padded step, and with
    ``split`` the steps ``train.split_padding`` computes (:func:`captioning.model.base.split_point`) over the same
    batches (else None): ``(padded, split)``."""
    from captioning.model.base import split_point

    real = padded = computed = 0.0
    for batch in dataset.take(batches):
        mask = batch["mask"]
        real += float(tf.reduce_sum(mask))
        padded += float(tf.size(mask))
        if split:
            lengths, steps = tf.cast(tf.reduce_sum(mask, axis=1), tf.int32), int(tf.shape(mask)[1])
            cut = int(split_point(lengths, steps))
            computed += int(tf.size(lengths)) * cut + int(tf.reduce_sum(tf.cast(lengths > cut, tf.int32))) * (steps - cut)
    return real / max(padded, 1.0), (real / max(computed, 1.0) if split else None)


def _epoch_seconds(dataset: tf.data.Dataset) -> tuple[float, int]:
    start, examples = time.perf_counter(), 0
    for batch in dataset:
        examples += int(tf.shape(batch["input_ids"])[0])
    return time.perf_counter() - start, examples


def cache_speedups(cfg: config_lib.Config, split: str, batch_size: int) -> dict:
    """Epoch 1 time / epoch 2 time for ``cache: memory`` and ``cache: features`` on ``split``."""
    from captioning.data.feature_cache import encoder_key
    from captioning.model import build_model

    out = {}
    memory = dataclasses.replace(cfg.data, cache="memory")
    ds = make_dataset(memory, split, training=True, batch_size=batch_size, repeat=False)
    first, n1 = _epoch_seconds(ds)
    second, n2 = _epoch_seconds(ds)
    log.info("cache: memory: epoch 1 %.2f s, epoch 2 %.2f s (%d, %d examples)", first, second, n1, n2)
    out["memory"] = first / second

    vocab = PreparedDataset.load(cfg.data.dir).vocabulary()
    model = build_model(len(vocab), dataclasses.replace(cfg.model, encoder_weights="none"), cfg.data.image_size)
    model.build_all()
    encode = tf.function(lambda images: model.encoder(images, training=False), autograph=False)
    features = dataclasses.replace(cfg.data, cache="features", random_crop=False, random_flip=False,
                                   color_jitter=False)
    with tempfile.TemporaryDirectory(prefix="captioning-benchmark-features-") as scratch:
        start = time.perf_counter()  # epoch 1 includes writing the float16 features to disk
        ds = make_dataset(features, split, training=True, batch_size=batch_size, repeat=False, feature_fn=encode,
                          feature_key=encoder_key(model.encoder), cache_dir=scratch)
        extract = time.perf_counter() - start
        rest, n1 = _epoch_seconds(ds)
        second, n2 = _epoch_seconds(ds)
    log.info("cache: features (%s): epoch 1 %.2f s (encoder %.2f s), epoch 2 %.3f s", cfg.model.encoder,
             extract + rest, extract, second)
    out["features"] = (extract + rest) / second
    return out


def run(config: str | None = None, overrides: tuple[str, ...] = (), data_dir: str | None = None,
        images: int = PHOTOS["images"], cache_images: int = PHOTOS["cache_images"],
        image_size: tuple[int, int] = PHOTOS["size"],
        work_dir: str = "runs/benchmarks", measure_images: int = 1500, rounds: int = 2, service: int = 0,
        regions: str | None = None, progress: bool = True) -> dict:
    """Runs the benchmark (see the module docstring) and returns its JSON-ready result."""
    cfg = config_lib.load_config(config, overrides)
    if measure_images < 1 or rounds < 1 or images < 1 or cache_images < 1 or service < 0:
        raise InputError("`images`, `cache_images`, `measure_images` and `rounds` must be at least 1, `service` "
                         "at least 0", params=("images", "cache_images", "measure_images", "rounds", "service"))
    if data_dir is None:
        data_dir = photo_records(work_dir, images, cache_images, image_size, progress=progress)
    cfg.data.dir = data_dir
    config_lib.validate(cfg)
    dataset = PreparedDataset.load(data_dir)
    split = cfg.data.train_split
    files = dataset.files(split)
    per_image = dataset.split(split).captions_per_image
    batch = cfg.train.batch_size
    encoded = _encoded_images(files)
    log.info("input benchmark on %d images of %s (mean JPEG %.0f KB, %.2f captions each), batch %d",
             len(encoded), data_dir, sum(map(len, encoded)) / len(encoded) / 1000, per_image, batch)

    def count(b):
        return images_in(b, per_image)

    pipelines = _pipelines(cfg.data, split, files, encoded, batch, count, regions)
    servers = None
    if service:  # the same pipeline, run by `service` tf.data service workers in this process
        servers = local_service(service)
        served = dataclasses.replace(cfg.data, service=servers[0].target.split("://")[-1],
                                     service_mode="parallel_epochs")
        pipelines["service"] = (make_dataset(served, split, training=True, batch_size=batch), count)
    best = _best_of_rounds(pipelines, rounds, measure_images)

    stages = stage_cpu_ms(cfg.data, split, batch, measure_images, per_image, full=pipelines["pipeline"][0])
    log.info("CPU ms per image by stage: parse %.2f, decode + crop/flip %.2f, batching %.2f (total %.2f)",
             stages["parse"], stages["decode_crop"], stages["batching"], stages["total"])
    padding = _padding_efficiencies(cfg.data, split, batch, max(20, measure_images // batch), pipelines)
    speedups = cache_speedups(cfg, cfg.data.eval_split if cfg.data.eval_split in dataset.splits else split, batch)

    if service:  # what the service takes off the trainer: servers and trainer on separate cores
        offloaded = offload.measure(cfg.data, split, batch, measure_images, rounds, service, count, work_dir,
                                    built={"local": pipelines["pipeline"][0], "local_grouped": pipelines["grouped"][0]})
    rate = {name: m["per_s"] for name, m in best.items()}
    result = {
        "naive_img_per_s": rate["naive"], "pipeline_img_per_s": rate["pipeline"], "ceiling_img_per_s": rate["ceiling"],
        "grouped_img_per_s": rate["grouped"], "grouped_vs_ceiling": rate["grouped"] / rate["ceiling"],
        **({"service_workers": service, "service_img_per_s": rate["service"],
            "service_vs_pipeline": rate["service"] / rate["pipeline"], "offload": offloaded,
            "service_trainer_cpu_ratio": offloaded["service_trainer_cpu_ratio"]} if service else {}),
        **({"regions_store": regions, "regions_img_per_s": rate["regions"],
            "regions_vs_pipeline": rate["regions"] / rate["pipeline"]} if regions else {}),
        "padding_efficiency": padding,
        "cache_speedup": speedups,
        "pipeline_vs_ceiling": rate["pipeline"] / rate["ceiling"], "pipeline_vs_naive": rate["pipeline"] / rate["naive"],
        "cpu_ms_per_image": {name: m["cpu_ms_per_unit"] for name, m in best.items()},
        "stage_cpu_ms_per_image": stages,
        "dataset": {"dir": data_dir, "images": len(encoded), "captions_per_image": per_image,
                    "mean_jpeg_kb": sum(map(len, encoded)) / len(encoded) / 1000},
        "settings": {"config": config or "(defaults)", "overrides": list(overrides), "batch_size": batch,
                     "measure_images": measure_images, "rounds": rounds, "data": dataclasses.asdict(cfg.data)},
        "machine": common.machine(),
    }
    result["targets"] = _targets(result)
    return result


def _pipelines(cfg: DataConfig, split: str, files: list[str], encoded: list[bytes], batch: int, count,
               regions: str | None) -> dict:
    """The pipelines measured side by side, each with its image counter: ``naive``, ``pipeline``, ``ceiling``,
    ``grouped`` and, with ``regions``, the pipeline reading that features store (``service`` is added by
    :func:`run`, which keeps the servers alive)."""
    pipelines = {
        "naive": (naive_dataset(files, cfg, batch), count),
        "pipeline": (make_dataset(cfg, split, training=True, batch_size=batch), count),
        "ceiling": (ceiling_dataset(encoded, ImagePreprocessor.of(cfg), batch), lambda b: int(tf.shape(b)[0])),
        "grouped": (make_dataset(dataclasses.replace(cfg, captions_per_image="grouped"), split, training=True,
                                 batch_size=batch), count),
    }
    if regions:  # the same pipeline reading a features store's regions instead of decoding JPEGs
        from captioning.model.data_sources import data_source

        read = dataclasses.replace(cfg, features="regions", features_store=regions, cache="none")
        source = data_source(config_lib.Config(data=read))
        pipelines["regions"] = (make_dataset(read, split, training=True, batch_size=batch, source=source), count)
    return pipelines


def _best_of_rounds(pipelines: dict, rounds: int, measure_images: int) -> dict[str, dict]:
    """Each pipeline's fastest of ``rounds`` measurements (:func:`captioning.benchmarks.common.throughput`),
    the pipelines interleaved in every round."""
    best: dict[str, dict] = {}
    for r in range(rounds):
        for name, (ds, count) in pipelines.items():
            m = common.throughput(iter(ds), count, measure_images, warmup=min(300, measure_images))
            log.info("round %d: %-8s %7.1f images/s, %.2f ms CPU per image", r + 1, name, m["per_s"],
                     m["cpu_ms_per_unit"])
            if name not in best or m["per_s"] > best[name]["per_s"]:
                best[name] = m
    return best


def _padding_efficiencies(cfg: DataConfig, split: str, batch: int, batches: int, pipelines: dict) -> dict:
    """:func:`padding_efficiency` over ``batches`` batches of the length-grouped pipeline (``bucketed``), batches
    padded to their longest without grouping (``pad_to_max``), grouped images (``grouped``) and the latter as
    ``train.split_padding`` computes them (``grouped_split``, over the same batches: the pipeline iterated once)."""
    bucketed = padding_efficiency(pipelines["pipeline"][0], batches)[0]
    unsorted = dataclasses.replace(cfg, length_window=1, bucket_boundaries=[])
    pad_to_max = padding_efficiency(make_dataset(unsorted, split, training=True, batch_size=batch), batches)[0]
    grouped, grouped_split = padding_efficiency(pipelines["grouped"][0], batches, split=True)  # the same batches
    log.info("padding efficiency: %.3f length-grouped, %.3f padded to each batch's longest, %.3f grouped "
             "images (%.3f with train.split_padding)", bucketed, pad_to_max, grouped, grouped_split)
    return {"bucketed": bucketed, "pad_to_max": pad_to_max, "grouped": grouped, "grouped_split": grouped_split}


def _targets(result: dict) -> dict:
    """Each of :data:`TARGETS` the result has a figure for: ``[target, whether the figure reaches it]``."""
    padding = result["padding_efficiency"]
    figures = {"pipeline_vs_ceiling": result["pipeline_vs_ceiling"], "pipeline_vs_naive": result["pipeline_vs_naive"],
               "bucketed_padding_efficiency": padding["bucketed"],
               "grouped_padding_efficiency": padding["grouped_split"],
               "features_cache_speedup": result["cache_speedup"]["features"]}
    if "service_vs_pipeline" in result:
        figures["service_vs_pipeline"] = result["service_vs_pipeline"]
    return {name: [TARGETS[name], figure >= TARGETS[name]] for name, figure in figures.items()}


def summary(result: dict) -> str:
    lines = [f"{'':10} {'images/s':>10} {'CPU ms/image':>13}"]
    for name in ("naive", "pipeline", "ceiling", "grouped", "service", "regions"):
        if name + "_img_per_s" not in result:
            continue
        lines.append(f"{name:10} {result[name + '_img_per_s']:>10.1f} {result['cpu_ms_per_image'][name]:>13.2f}")
    lines.append(f"pipeline / ceiling {result['pipeline_vs_ceiling']:.2f} (target >= 0.9), "
                 f"pipeline / naive {result['pipeline_vs_naive']:.2f} (target >= 1.5)")
    p = result["padding_efficiency"]
    lines.append(f"grouped captions / ceiling {result['grouped_vs_ceiling']:.2f}")
    if "service_img_per_s" in result:
        lines.append(f"through the tf.data service ({result['service_workers']} worker(s) on these cores): "
                     f"{result['service_img_per_s']:.1f} images/s, {result['service_vs_pipeline']:.2f} of the local "
                     "pipeline (target >= 0.85)\n" + offload.summary(result["offload"]))
    if "regions_img_per_s" in result:
        lines.append(f"from the features store {result['regions_store']!r} (no JPEG decoded): "
                     f"{result['regions_img_per_s']:.1f} images/s, {result['regions_vs_pipeline']:.1f}x the JPEG pipeline")
    st = result["stage_cpu_ms_per_image"]
    lines.append(f"CPU ms per image by stage: parse {st['parse']:.2f}, decode + crop/flip {st['decode_crop']:.2f}, "
                 f"batching {st['batching']:.2f} (pipeline {st['total']:.2f}; bare decode + resize "
                 f"{result['cpu_ms_per_image']['ceiling']:.2f})")
    lines.append(f"padding efficiency: length-grouped {p['bucketed']:.3f} (target >= 0.9), "
                 f"padded to batch max {p['pad_to_max']:.3f}, grouped images {p['grouped']:.3f} padded, "
                 f"{p['grouped_split']:.3f} computed with train.split_padding (target >= 0.85)")
    c = result["cache_speedup"]
    lines.append(f"epoch 2 / epoch 1 speed-up: cache memory {c['memory']:.1f}x, "
                 f"cache features {c['features']:.1f}x (target >= 10)")
    return "\n".join(lines)
