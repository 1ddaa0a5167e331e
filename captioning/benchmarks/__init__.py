"""``captioning benchmark``: is the accelerator ever waiting for data? Numbers, measured side by side.

One module per benchmark, each reusing the code it measures (never a copy of it):

- :mod:`~captioning.benchmarks.input` — the training input pipeline against the seed-style naive
  pipeline and the bare decode + resize ceiling; padding efficiency; cache speed-ups.
- :mod:`~captioning.benchmarks.train` — the real training loop, split into ingestion and step time.
- :mod:`~captioning.benchmarks.decode` — batched beam search against one image at a time.
- :mod:`~captioning.benchmarks.prepare` — ``prepare`` with all workers, one worker, and the one-core
  ceiling of its per-image work.

:mod:`~captioning.benchmarks.photos` makes COCO-like photos for them. Results and how they were reached:
``benchmarks/RESULTS.md``.
"""
