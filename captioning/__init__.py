"""captioning: image captioning on TensorFlow 2 / Keras 3, from COCO to TFRecords to trained models.

The folders are the data's one-way path; each is a stage, and a module imports only the base modules
(the ones directly in this folder: errors, fileio, vocab, text, images and the TensorFlow helpers, and the
``config`` package) and modules of its own stage or an earlier one::

    data_prep/        prepare: COCO, Karpathy's split, TFDS or the synthetic shapes → a prepared dataset
    data/             records → batches: schema, the prepared dataset, reading, batching, caches, tf.data service
    model/            encoders, decoders (a registry), beam search, the model folder
    train/            the training loop, objectives (a registry), optimizer, distribution, summaries
    experiment/       the composition root: a config typed once, the pieces each stage takes
    inference/        a trained model in use: captions for images, the gallery, the SavedModel
    evaluation/       metrics, grounding, ``evaluate``
    benchmarks/       every stage measured against its ceiling
    cli/              the ``captioning`` command

:data:`STAGES` is that order; ``tests/test_architecture.py`` checks every import against it (and that
no import cycle exists, counting imports inside functions), and docs/architecture.md explains it.
"""

__version__ = "0.1.0"

# the stages, in the data's order (folders of this package; the base modules come before all of them)
# the base packages: folders every stage may import, as the base modules
BASE_PACKAGES = ("config",)
STAGES = ("data", "model", "train", "experiment", "inference", "evaluation", "benchmarks", "cli")
