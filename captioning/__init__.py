"""captioning: Show-and-Tell image captioning on TensorFlow 2 / Keras 3.

The data's one-way path through the package::

    data_prep/ (prepare) → captioning.schema (records) → input pipeline → model → train
                         → decode / evaluate → captioning.cli (the ``captioning`` command)
"""

__version__ = "0.1.0"
