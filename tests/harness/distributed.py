"""What a process of 2 replicas needs, for tests/distributed_worker.py and the scenarios it runs
(:mod:`tests.harness.scenarios`): the small config that trains in seconds on the shapes fixture, two logical CPUs
configured before the runtime starts, and the process's one MultiWorkerMirroredStrategy (TF_CONFIG).

The strategy lives here, not in the script: the script runs as ``__main__``, so a scenario that imported it by its
module name would get a second copy of it, and with it a second strategy in the process, whose first variable's
broadcast then met another shape from the other worker."""

from captioning.config import load_config


def small_config(data_dir, *extra):
    """The LSTM decoders' sizes come as defaults (a base's values): a Transformer in ``extra`` reads none of them."""
    return load_config(None, [
        f"data.dir={data_dir}", "data.image_size=32", "data.resize_size=36", "data.bucket_boundaries=[6,10]",
        "data.random_flip=false", "data.deterministic=true", "data.shuffle_buffer=64",
        "model.encoder=small_cnn", "model.encoder_trainable=true", "model.dropout=0.0", "train.batch_size=8",
        "train.optimizer=sgd", "train.learning_rate=0.5", "train.lr_schedule=constant", "train.eval_every_steps=0",
        "train.log_every_steps=1", "train.checkpoint_every_steps=100", *extra],
        defaults=["model.embedding_size=16", "model.lstm_units=16"])


def two_cpus():
    """Two logical CPU devices, configured once, before the runtime starts."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or ()) != 2:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def two_replicas():
    """The MirroredStrategy over the two logical CPUs of :func:`two_cpus` (called first, before the runtime starts),
    its all-reduce on one device."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


_MULTI_WORKER = []


def multi_worker_strategy():
    """This process's MultiWorkerMirroredStrategy (TF_CONFIG), made once: the scenarios of the worker's ``many``
    share the cluster, as the collectives are configured once per process."""
    import tensorflow as tf

    if not _MULTI_WORKER:
        _MULTI_WORKER.append(tf.distribute.MultiWorkerMirroredStrategy())
    return _MULTI_WORKER[0]
