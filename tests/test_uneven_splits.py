"""Splits that do not divide by the batch or the replicas: every replica may end up with a partial batch or
with no example at all, and evaluation must still equal one device's (issue: mirrored training crashed in
its evaluation and lost the run)."""

import json
import os
import shutil

import pytest

from tests.harness.scenarios import EVAL_BATCHES, eval_losses
from tests.helpers import copy_model, distributed_result, run_cli, small_train_config


# uneven_dir (train 8 images, val ONE caption, test 3 images) is conftest's: distributed_runs evaluates on it too


@pytest.fixture(scope="module")
def one_device_losses(uneven_dir, trained_model_dir, tmp_path_factory):
    """What the two-replica runs must equal: tests/harness/scenarios.py's eval_losses (the scenario the two-replica
    runs are) on one device, in this process (one device needs no runtime set up before TensorFlow starts)."""
    out = tmp_path_factory.mktemp("one")
    model_dir = out / "model"
    copy_model(trained_model_dir, model_dir)
    eval_losses(uneven_dir, str(out), str(model_dir), "one")
    return json.loads((out / "eval-one.json").read_text())


def assert_same_losses(got, expected):
    assert got["step"] == expected["step"] == 60  # the trained checkpoint, not fresh weights
    for split in ("val", "test"):
        for batch in EVAL_BATCHES:
            key = f"{split}/{batch}"
            loss, tokens = got[key]
            assert tokens == expected[key][1], key  # every caption counted once, none twice
            assert loss == pytest.approx(expected[key][0], abs=1e-5), key
    # the split sizes: 1 caption of 'val' (its tokens), 15 of 'test'
    assert expected["val/2"][1] < 20 < expected["test/2"][1]


@pytest.mark.slow
def test_mirrored_evaluation_equals_one_device_for_uneven_splits(distributed_runs, one_device_losses):
    """trained_model_dir's checkpoint evaluated under 2 replicas (conftest's distributed_runs)."""
    out = distributed_result(distributed_runs, "mirrored", "uneven")
    with open(os.path.join(out, "eval-mirrored.json")) as f:
        got = json.load(f)
    assert got["replicas"] == 2
    assert_same_losses(got, one_device_losses)


@pytest.mark.slow
def test_multi_worker_evaluation_equals_one_device_for_uneven_splits(distributed_runs, one_device_losses):
    """Two workers, one input pipeline each: the 1-caption val split leaves worker 1 with no record at all."""
    out = distributed_result(distributed_runs, "multi_worker", "uneven")
    for index in range(2):
        with open(os.path.join(out, f"eval-multi_worker-{index}.json")) as f:
            got = json.load(f)
        assert got["replicas"] == 2
        assert_same_losses(got, one_device_losses)


@pytest.mark.slow
def test_mirrored_train_cli_evaluates_a_split_smaller_than_the_replicas(distributed_runs):
    """The issue's command, on a validation split of one caption: training, the evaluation at the end and
    its sample captions all run on 2 replicas, exit 0, and the last step is saved (tests/harness/scenarios.py's
    ``uneven_cli``)."""
    from tests.helpers import main_result

    out = distributed_result(distributed_runs, "mirrored", "uneven_cli")
    model_dir, result = os.path.join(out, "m"), main_result(out, "train")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 replica(s)" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("validation loss") == 2
    assert os.path.exists(f"{model_dir}/ckpt-4.index") and os.path.exists(f"{model_dir}/ckpt-2.index")


@pytest.mark.slow
def test_a_failing_evaluation_never_loses_the_steps_trained(uneven_dir, tmp_path):
    """Evaluation at step 2 reads a damaged val shard and stops the run (one line, exit 2): the checkpoint
    of step 2 was written before it, although checkpoint_every_steps is 100."""
    from tests.harness.files import damage

    data = tmp_path / "data"
    shutil.copytree(uneven_dir, data)
    (shard,) = [n for n in os.listdir(data) if n.startswith("val-")]
    damage(str(data / shard), "flipped", record=0)
    config = tmp_path / "c.yaml"
    from captioning.config import save_config

    save_config(small_train_config(str(data), "train.steps=4", "train.eval_every_steps=2",
                                   "train.checkpoint_every_steps=100"), str(config))
    model_dir = tmp_path / "m"
    result = run_cli("train", "--config", str(config), "--model-dir", str(model_dir))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"damaged shard {data / shard}" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    import tensorflow as tf

    assert os.path.basename(tf.train.latest_checkpoint(str(model_dir))) == "ckpt-2"


def test_training_refuses_a_split_with_fewer_images_than_input_pipelines(uneven_dir):
    """A training pipeline with no image of its own would hand its replica empty batches forever."""
    import tensorflow as tf

    from captioning.errors import InputError
    from captioning.data.pipeline import make_dataset

    cfg = small_train_config(uneven_dir).data
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    with pytest.raises(InputError, match=r"the 'val' split has 1 image\(s\), too few for 2 input pipelines"):
        make_dataset(cfg, "val", training=True, batch_size=4, input_context=context)
    # 8 train images in 4 shards over 3 pipelines: every pipeline gets whole files, none is empty
    context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=3)
    batch = next(iter(make_dataset(cfg, "train", training=True, batch_size=4, input_context=context)))
    assert batch["input_ids"].shape[0] == 4
