"""The decoder contract: what every registered decoder must do, run over every entry of
``captioning.model.DECODERS`` (and any decoder registered with ``--decoder FILE:NAME``), so a new
decoder is tested by these with no new test code.

Each test builds the decoder with its ``tiny_settings`` on ``small_cnn`` at 32 px (a 2 × 2 grid) and
random images or random regions: stepping word by word equals the teacher-forced pass (over the grid and over
regions); padding regions with anything changes nothing; with ``model.box_geometry`` the regions' boxes change
the logits, without it they change nothing; an empty replica batch gives empty logits and zero gradients;
split padding changes nothing; grouped captions equal a copy of the image per caption; beam search returns
its captions best first with the model's own log-probabilities (and an attending decoder's weights per word);
mixed precision keeps the logits and variables in float32; a checkpoint round-trips and one of other shapes is
refused; the SavedModel captions as the captioner does; two mirrored replicas compute what one device
computes. Each check is a function of tests/harness/decoder_contract.py (``run_decoder_test`` runs them over one
decoder); this module runs each over every registered decoder, one test a check."""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from captioning.model import DECODERS
from tests.harness import decoder_contract as contract
from tests.harness.scenarios import contract_result
from tests.helpers import REPO, register_decoder_file

NAMES = sorted(DECODERS)


@pytest.mark.parametrize("name", NAMES)
def test_a_decoder_declares_what_the_rest_of_the_code_asks(name):
    contract.check_declarations(name)


@pytest.mark.parametrize("name", NAMES)
def test_stepping_word_by_word_equals_the_teacher_forced_pass(name):
    contract.check_stepping(name)


@pytest.mark.parametrize("name", NAMES)
def test_padding_regions_with_anything_changes_nothing(name):
    contract.check_region_padding(name)


@pytest.mark.parametrize("name", NAMES)
def test_box_geometry_makes_the_boxes_count_and_without_it_they_do_not(name):
    contract.check_box_geometry(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_model_reading_regions_steps_as_it_teacher_forces(name):
    contract.check_region_stepping(name)


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_replica_batch_gives_empty_logits_zero_loss_and_zero_gradients(name):
    contract.check_empty_batch(name)


@pytest.mark.parametrize("name", NAMES)
def test_split_padding_gives_the_same_logits_loss_and_gradients(name):
    contract.check_split_padding(name)


@pytest.mark.parametrize("name", NAMES)
def test_grouped_captions_equal_one_copy_of_the_image_per_caption(name):
    contract.check_grouped_captions(name)


@pytest.mark.parametrize("name", NAMES)
def test_beam_search_returns_its_best_captions_first_with_the_models_log_probabilities(name):
    contract.check_beam_search(name)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_keeps_logits_and_variables_in_float32(name):
    contract.check_mixed_precision(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_round_trips_and_one_of_other_shapes_is_refused(name, tmp_path):
    contract.check_checkpoint(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_an_xla_compiled_training_step_equals_the_plain_one(name, mirrored_contracts):
    """train.jit_compile: the replica's forward and backward pass compiled by XLA (fixed shapes from
    data.bucket_boundaries) gives the same loss, gradient norm and update as without (a trainable encoder
    with batch norm, clipping active). Both steps, from the same weights and batch, are conftest's
    mirrored_contracts' (the plain one is the one-device step the mirrored replicas are held to)."""
    r = contract_result(mirrored_contracts, "decoders", name)
    assert float(r["one_norm"]) > 0.05 and float(r["xla_norm"]) == pytest.approx(float(r["one_norm"]), rel=1e-4)
    assert float(r["xla_loss"]) == pytest.approx(float(r["one_loss"]), rel=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 20 and sorted(names) == sorted(k[len("xla/"):] for k in r.files if k.startswith("xla/"))
    for key in names:
        np.testing.assert_allclose(r["xla/" + key], r["one/" + key], atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_saved_model_captions_as_the_captioner_does(name, tmp_path, shapes_dir):
    contract.check_saved_model(name, tmp_path, os.path.join(shapes_dir, "images"))


# Every selected decoder's one-device, mirrored and XLA-compiled steps are conftest's mirrored_contracts': one process
# (TensorFlow starts once with two devices) for them, beside the one of tests/test_encoders_end_to_end.py's pairs. show_and_tell's
# train 3 steps with the weight average (tests/test_ema.py's): their loss and norm are the first step's, their
# weights those after the third.


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_mirrored_replicas_compute_what_one_device_computes(name, mirrored_contracts):
    r = contract_result(mirrored_contracts, "decoders", name)
    assert int(r["one_replicas"]) == 1 and int(r["two_replicas"]) == 2
    assert r["tokens_first_half"] != r["tokens_second_half"]  # an uneven split of the words
    assert float(r["one_norm"]) > 0.05  # so clipping at 0.05 was active (on the global gradient)
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 20  # the encoder's and the decoder's weights, batch-norm statistics alike
    for key in names:
        np.testing.assert_allclose(r["two/" + key], r["one/" + key], atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_a_new_decoder_is_tested_by_the_contract_with_no_new_test_code(tmp_path, request):
    """A decoder from a file outside the project (tests/data/toy_decoder.py), registered as one entry:
    every contract test pytest collects for a registered decoder runs on it and passes; the same decoder with
    a subtle bug fails them."""
    toy = str(tmp_path / "toy_decoder.py")  # a file outside the project, as a user would write one
    shutil.copy(os.path.join(REPO, "tests", "data", "toy_decoder.py"), toy)
    # the same decoder with its subtle bug switched on (BROKEN=1), registered beside it as "broken": one pytest
    # process runs the toy's contract and the broken one's stepping test
    source = open(toy).read()
    assert source.count('os.environ.get("BROKEN")') == 1
    broken_file = str(tmp_path / "broken_decoder.py")
    with open(broken_file, "w") as f:
        f.write(source.replace('os.environ.get("BROKEN")', "True"))
    here = [sys.executable, "-m", "pytest", os.path.join(REPO, "tests", "test_decoders.py"), "-p", "no:cacheprovider",
            "-m", "not slow"]
    args = [*here, "-v", "--decoder", f"{toy}:toy", "--decoder", f"{broken_file}:broken", "-k",
            "toy and not mirrored or broken and stepping_word_by_word"]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("BROKEN", None)
    # the contract as pytest collects it for a decoder of the project (this module collected again by pytest's
    # own collector, in this process: its quick tests of show_and_tell), its name put in the toy's place
    module = pytest.Module.from_parent(request.session, path=pathlib.Path(__file__))
    listed = [item.name for item in module.collect() if isinstance(item, pytest.Function)
              and item.get_closest_marker("slow") is None and "[show_and_tell" in item.name and "mirrored" not in item.name]
    contract = {re.sub(r"\[show_and_tell(?=[-\]])", "[toy", name) for name in listed}
    # 11 since the split-padding and shared-model checks became one test a decoder each (b56da82, 5131e66)
    assert len(contract) >= 11 and all("[toy" in test for test in contract), sorted(contract)
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    # exit 1: the broken decoder's stepping test fails (the contract catches the bug), and it alone
    assert done.returncode == 1, done.stdout[-3000:]
    passed = {m.group(1) for m in re.finditer(r"^tests/test_decoders\.py::(\S+) PASSED", done.stdout, re.M)}
    assert passed == contract, (sorted(contract - passed), sorted(passed - contract))
    # the bug is in stepping: the contract test that compares it with the teacher-forced pass catches it
    failed = set(re.findall(r"^FAILED (tests/test_decoders\.py::\S+)", done.stdout, re.M))
    assert failed == {"tests/test_decoders.py::test_stepping_word_by_word_equals_the_teacher_forced_pass[broken]"}, \
        done.stdout[-3000:]


def test_run_decoder_test_runs_this_modules_checks_and_stops_at_a_broken_decoder(tmp_path, monkeypatch):
    """What a decoder's own test file calls (tests/harness/decoder_contract.py's ``run_decoder_test``): every quick
    check this module runs a test for (read from its source), in one call, which stops at the first check a decoder
    fails: the toy decoder (tests/data/toy_decoder.py, registered from a file outside the project) with its subtle
    bug fails at stepping, after its declarations."""
    tree = ast.parse(pathlib.Path(__file__).read_text(encoding="utf-8"))
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == "contract"}
    assert called - {"run_decoder_test"} == {check.__name__ for check in contract.DECODER_CHECKS} | {"check_saved_model"}
    toy = str(tmp_path / "toy_decoder.py")
    shutil.copy(os.path.join(REPO, "tests", "data", "toy_decoder.py"), toy)
    monkeypatch.setenv("BROKEN", "1")
    try:
        register_decoder_file(toy, "broken")
        with pytest.raises(AssertionError) as failed:
            contract.run_decoder_test("broken", tmp_path)
        names = [entry.name for entry in failed.traceback]
        assert "run_decoder_test" in names and "check_stepping" in names
    finally:
        DECODERS.pop("broken", None)
