"""Preprocessing: raw captions and images in, sharded TFRecords out.

``shapes`` makes the synthetic dataset; ``sources`` reads COCO files, Karpathy's split and TFDS;
``images`` validates and re-encodes images; ``writer`` writes shards in parallel; ``prepare`` ties them
together. The record layout itself belongs to :mod:`captioning.schema`, which the reader shares.
"""
