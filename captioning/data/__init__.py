"""The data stage: from a prepared dataset's records to the batches a model trains on.

=====================  ==============================================================================
module                 what it holds
=====================  ==============================================================================
``schema``             the record layout: feature keys, shard names (the writer, ``data_prep``, shares it)
``prepared``           :class:`~captioning.data.prepared.PreparedDataset`: the folder ``prepare`` writes
``integrity``          shards checked against the manifest; damaged records named or skipped
``reading``            records → decoded images, central crops, references; one user image's decode
``batching``           images with captions → padded batches, by length or grouped per image
``augment``            im2txt's colour distortions, on the device
``disk_cache``         ``data.cache: disk``: decoded images in files named by what they hold
``feature_cache``      ``data.cache: features``: the frozen encoder's outputs, float16 on disk
``pipeline``           :func:`~captioning.data.pipeline.make_dataset`: the training and evaluation input
``service``            TensorFlow's tf.data service: its servers, and the trainer's side
=====================  ==============================================================================

Importing this package imports nothing: ``schema`` and ``prepared`` are read by ``data_prep``'s worker
processes, which never load TensorFlow.
"""
