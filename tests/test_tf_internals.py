"""captioning/tf_internals.py's replacement of TensorFlow's backward graph walk: the same ops as TensorFlow's own
walk (loaded from TensorFlow's file as it ships, whatever is installed in its place), on the graph of a
MirroredStrategy training step, for every kind of walk tf.custom_gradient and TensorFlow's other callers ask for."""

import importlib.util

import pytest


def tensorflows_own_walk():
    """``get_backward_walk_ops`` from TensorFlow's op_selector.py, loaded afresh as a module of its own."""
    from tensorflow.python.ops import op_selector

    spec = importlib.util.spec_from_file_location("op_selector_as_shipped", op_selector.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_backward_walk_ops


@pytest.fixture(scope="module")
def step_graph():
    """The graph of a MirroredStrategy step (one device: 2 logical CPUs need a process of their own): a synchronized
    batch norm between two Dense layers under a gradient tape, the gradients all-reduced in replica context."""
    import tensorflow as tf
    import keras

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        dense = keras.layers.Dense(4)
        norm = keras.layers.BatchNormalization(synchronized=True)
        model = keras.Sequential([keras.Input((3,)), dense, norm, keras.layers.Dense(2)])

    def replica(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads), loss

    step = tf.function(lambda x: strategy.run(replica, args=(x,)), autograph=False)
    return step.get_concrete_function(tf.TensorSpec([5, 3], tf.float32)).graph


def test_the_walk_reaches_the_ops_tensorflows_walk_reaches(step_graph):
    from captioning.tf_internals import backward_walk_ops

    theirs = tensorflows_own_walk()
    ops = step_graph.get_operations()
    assert len(ops) > 150
    outputs = [t for op in ops[-40:] for t in op.outputs]
    inputs = [t for op in ops[:60] for t in op.outputs]
    middle = [t for op in ops[len(ops) // 2:len(ops) // 2 + 20] for t in op.outputs]
    cases = [dict(seed_ops=outputs), dict(seed_ops=outputs, stop_at_ts=inputs, inclusive=False),
             dict(seed_ops=outputs, stop_at_ts=middle, only_differentiable=True),
             dict(seed_ops=[t.op for t in outputs], control_inputs=True),
             dict(seed_ops=outputs, within_ops=ops[::2]),
             dict(seed_ops=outputs, within_ops_fn=lambda op: op.type != "ReadVariableOp", inclusive=False),
             dict(seed_ops=outputs[0]), dict(seed_ops=outputs[0].op), dict(seed_ops=[])]
    sizes = []
    for kwargs in cases:
        ours, expected = backward_walk_ops(**kwargs), theirs(**kwargs)
        assert len(ours) == len(set(ours))  # each op once
        assert set(ours) == set(expected), kwargs
        sizes.append(len(ours))
    # the cases differ: stops, filters and control inputs change what the walk reaches
    assert sizes[0] > 100 and sizes[1] < sizes[0] and sizes[4] < sizes[0] and sizes[-1] == 0
    assert len(set(sizes)) >= 5


def test_a_training_step_installs_it_for_tf_custom_gradient(monkeypatch):
    """Building a training step's update puts the walk in the place of TensorFlow's, where tf.custom_gradient
    looks it up (TensorFlow's own put back first: in this process a step may have been built already)."""
    import keras
    import tensorflow as tf
    from tensorflow.python.ops import custom_gradient, op_selector

    from captioning.tf_internals import backward_walk_ops
    from captioning.train.steps import make_update

    monkeypatch.setattr(op_selector, "get_backward_walk_ops", tensorflows_own_walk())
    assert custom_gradient.op_selector.get_backward_walk_ops is not backward_walk_ops
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    make_update(model, keras.optimizers.SGD(), tf.distribute.get_strategy(), tf.Variable(0), 0.0)
    assert custom_gradient.op_selector.get_backward_walk_ops is backward_walk_ops
