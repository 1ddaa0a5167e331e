"""Run by tests/test_train.py in fresh processes (logical devices must be set before TF starts).

    python tests/distributed_worker.py mirrored DATA_DIR OUT_DIR
        one training step from the same weights and the same global batch on one device and on a
        MirroredStrategy over 2 logical CPUs; writes both losses and weights to OUT_DIR/mirrored.npz
    python tests/distributed_worker.py multi_worker DATA_DIR OUT_DIR   (with TF_CONFIG set)
        trains a few steps under MultiWorkerMirroredStrategy; writes OUT_DIR/weights-<task>.npz
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from captioning.config import load_config  # noqa: E402


def small_config(data_dir, *extra):
    return load_config(None, [
        f"data.dir={data_dir}", "data.image_size=32", "data.resize_size=36", "data.bucket_boundaries=[6,10]",
        "data.random_flip=false", "data.deterministic=true", "data.shuffle_buffer=64",
        "model.encoder=small_cnn", "model.encoder_trainable=true", "model.embedding_size=16",
        "model.lstm_units=16", "model.dropout=0.0", "train.batch_size=8", "train.optimizer=sgd",
        "train.learning_rate=0.5", "train.lr_schedule=constant", "train.eval_every_steps=0",
        "train.log_every_steps=1", "train.checkpoint_every_steps=100", *extra])


def weights(model):
    return {f"{i:03d}_{v.name}": v.numpy() for i, v in enumerate(model.variables)}


def mirrored(data_dir, out_dir):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from captioning.input_pipeline import make_dataset
    from captioning.train import Trainer

    # clipping at 0.05 is always active here, so clipping per replica instead of after the all-reduce
    # would change the update
    # The encoder trains too: its batch norm sees the global batch's statistics (model.sync_batch_norm).
    cfg = small_config(data_dir, "train.clip_gradient_norm=0.05")
    one = Trainer(cfg, os.path.join(out_dir, "one"), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    two = Trainer(cfg, os.path.join(out_dir, "two"), strategy=tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    for a, b in zip(one.model.variables, two.model.variables):
        b.assign(a.numpy())
    # one fixed global batch of 8 captions; its two halves hold different numbers of real tokens
    batch = next(iter(make_dataset(cfg.data, "train", training=False, batch_size=8)))
    mask = batch["mask"].numpy()
    results = {"tokens_first_half": mask[:4].sum(), "tokens_second_half": mask[4:].sum()}
    for name, trainer in (("one", one), ("two", two)):
        dataset = trainer.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors(batch).unbatch().batch(8))
        loss, norm, tokens = trainer.train_step_for(dataset)(next(iter(dataset)))
        results[f"{name}_loss"], results[f"{name}_norm"] = float(loss), float(norm)
        results[f"{name}_replicas"] = trainer.strategy.num_replicas_in_sync
        for key, value in weights(trainer.model).items():
            results[f"{name}/{key}"] = value
    np.savez(os.path.join(out_dir, "mirrored.npz"), **results)


def multi_worker(data_dir, out_dir):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    from captioning.train import Trainer

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cfg = small_config(data_dir, "train.steps=4", "distribute.strategy=multi_worker")
    trainer = Trainer(cfg, os.path.join(out_dir, "model"), strategy=strategy)
    result = trainer.run(progress=False)
    np.savez(os.path.join(out_dir, f"weights-{task}.npz"), losses=np.array(result["losses"]),
             replicas=strategy.num_replicas_in_sync, **weights(trainer.model))


if __name__ == "__main__":
    {"mirrored": mirrored, "multi_worker": multi_worker}[sys.argv[1]](sys.argv[2], sys.argv[3])
