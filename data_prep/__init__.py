"""Preprocessing: raw captions and images in, sharded TFRecords out.

``shapes`` makes the synthetic dataset; ``sources`` reads COCO files, Karpathy's split and TFDS;
``writer`` writes shards in parallel (validating images with :mod:`captioning.images`); ``prepare`` ties them
together. The record layout itself belongs to :mod:`captioning.data.schema`, which the reader shares.
"""
