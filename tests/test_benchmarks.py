"""Each benchmark runs end to end on tiny sizes through the real CLI and writes well-formed JSON.

Speed goals are the benchmarks' business (benchmarks/RESULTS.md), never a test's: these check only
that the numbers exist, are positive and finite, and that what must hold whatever the speed holds.
"""

import json
import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import run_cli

pytestmark = pytest.mark.slow


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def load(path):
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    assert positive(result["machine"]["cores"]) and result["machine"]["tensorflow"]
    return result


def check(done, path):
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    return load(path)


def test_benchmark_input(tmp_path, monkeypatch):
    """In this process: every pipeline the benchmark times is built once (a construction traces the pipeline's
    functions, about half a CPU second), the offload's local variants and the stages' full pipeline being those
    already built. 8 images timed after 8 of warm-up (--measure-images): the figures' shapes and relations, not
    their speed, are checked."""
    from captioning.benchmarks import input as input_benchmark, offload

    built = []

    def recorded(cfg, split, **kwargs):  # the real make_dataset, its arguments noted
        built.append(repr((cfg, split, sorted(kwargs.items()))))
        return make_dataset(cfg, split, **kwargs)

    make_dataset = input_benchmark.make_dataset
    monkeypatch.setattr(input_benchmark, "make_dataset", recorded)
    monkeypatch.setattr(offload, "make_dataset", recorded)
    out = tmp_path / "input.json"
    done = run_cli("-q", "benchmark", "input", "--images", "24", "--cache-images", "8", "--image-size", "96x72",
                   "--measure-images", "8", "--rounds", "1", "--work-dir", str(tmp_path / "work"),
                   "--set", "train.batch_size=8", "--set", "data.image_size=32", "--set", "data.resize_size=36",
                   "--set", "model.encoder=small_cnn", "--service", "1", "--json", str(out))
    result = check(done, out)
    # the pipeline, grouped, service, padded to max, cache memory and features, and the offload's three services
    assert len(built) == 9 and len(set(built)) == len(built), built
    for key in ("naive_img_per_s", "pipeline_img_per_s", "ceiling_img_per_s", "grouped_img_per_s", "service_img_per_s"):
        assert positive(result[key])
    assert result["service_workers"] == 1 and "through the tf.data service" in done.stdout
    assert result["targets"]["service_vs_pipeline"] == [0.85, result["service_vs_pipeline"] >= 0.85]
    assert result["service_vs_pipeline"] == pytest.approx(result["service_img_per_s"] / result["pipeline_img_per_s"])
    # the service in processes of its own, on other cores than the trainer's: what it takes off the trainer
    offload = result["offload"]
    local, served = offload["variants"]["local"], offload["variants"][offload["best_service"]]
    assert set(offload["variants"]) == {"local", "service_none", "service_snappy", "local_grouped", "service_grouped"}
    assert offload["variants"]["service_grouped"]["bytes_per_image"] < offload["variants"]["service_none"]["bytes_per_image"]
    assert offload["grouped_trainer_cpu_ratio"] == pytest.approx(
        offload["variants"]["service_grouped"]["trainer_cpu_ms_per_image"] /
        offload["variants"]["local_grouped"]["trainer_cpu_ms_per_image"])
    assert result["service_trainer_cpu_ratio"] == pytest.approx(served["trainer_cpu_ms_per_image"] /
                                                                local["trainer_cpu_ms_per_image"])
    assert all(positive(v["img_per_s"]) for v in offload["variants"].values())
    assert offload["variants"]["service_none"]["bytes_per_image"] >= 32 * 32 * 3  # the uint8 crop, and captions
    assert "the trainer's CPU per image with the service" in done.stdout
    assert set(result["padding_efficiency"]) >= {"bucketed", "pad_to_max", "grouped"}
    assert all(0 < v <= 1 for v in result["padding_efficiency"].values())
    assert result["padding_efficiency"]["bucketed"] >= result["padding_efficiency"]["pad_to_max"]
    stages = result["stage_cpu_ms_per_image"]
    assert set(stages) == {"parse", "decode_crop", "batching", "total"} and positive(stages["total"])
    assert stages["parse"] + stages["decode_crop"] + stages["batching"] == pytest.approx(stages["total"])
    assert "by stage: parse" in done.stdout
    assert set(result["cache_speedup"]) >= {"memory", "features"}
    assert all(positive(v) for v in result["cache_speedup"].values())
    assert result["dataset"]["images"] == 24 and result["dataset"]["captions_per_image"] == 5
    assert "pipeline_vs_ceiling" in result["targets"]
    assert "pipeline" in done.stdout and "ceiling" in done.stdout


def test_benchmark_train_compares_two_settings_side_by_side(tmp_path, prepared_dir):
    """--compare: the config with and without the extra overrides, alternated (--rounds), both kept with
    the ratio of their captions/s; here grouped (2 images of 5 captions, split padding) against per caption.
    --data points any config at any records; grouped batches of 10 captions hold 2 images of 5 (the compared
    run: one benchmark run fewer than a grouped run of its own). One round (--rounds 1): a round is two trainings of
    their own (3 CPU s each, most of it tracing), and nothing here reads which round's runs were kept. The base run
    (per caption, cross-entropy) carries the checks of what one run measures, which a benchmark run of its own did
    before; a run without --compare, its figures at the top level, is test_benchmark_train_reports_the_scst_...'s."""
    out = tmp_path / "train.json"
    done = run_cli("-q", "benchmark", "train", "--config", "experiments/shapes.yaml", "--data", prepared_dir,
                   "--steps", "3", "--warmup", "1", "--rounds", "1", "--set", "train.batch_size=10",
                   "--set", "model.lstm_units=32", "--compare", "data.captions_per_image=grouped",
                   "--compare", "train.split_padding=true", "--json", str(out))
    result = check(done, out)
    base, compared = result["base"], result["compared"]
    assert base["settings"]["captions_per_image"] == "all" and base["encoder_images_per_caption"] == 1.0
    assert compared["settings"]["captions_per_image"] == "grouped"
    assert compared["encoder_images_per_caption"] == pytest.approx(0.2)
    assert compared["settings"]["overrides"][-2:] == ["data.captions_per_image=grouped", "train.split_padding=true"]
    assert result["captions_per_s_ratio"] == pytest.approx(compared["captions_per_s"] / base["captions_per_s"])
    assert result["rounds"] == 1 and "x the captions/s (best of 1 runs each" in done.stdout
    assert base["settings"]["data"] == compared["settings"]["data"] == prepared_dir
    assert compared["images_per_s"] == pytest.approx(compared["captions_per_s"] / 5)
    assert "encoder images per caption 0.20" in done.stdout
    # what one run measures (the base's; the compared run's keys are the same)
    assert 0 <= base["ingestion_share"] < 1
    for key in ("step_ms", "iteration_ms", "examples_per_s"):
        assert positive(base[key])
    assert base["iteration_ms"] >= base["step_ms"]
    assert base["first_step_s"] * 1000 > 5 * base["step_ms"]  # it traces and optimizes the step
    assert 500 < base["step_graph_nodes"] < 20_000
    assert f"(the first {base['first_step_s']:.1f} s)" in done.stdout
    assert base["settings"]["steps"] == 3
    # every caption its own example: one encoder image per caption, 10 captions a step
    assert base["captions_per_s"] == pytest.approx(10 * 1000 / base["iteration_ms"], rel=1e-6)
    assert base["xla_compilations"] == compared["xla_compilations"] == 0  # train.jit_compile is off: no XLA
    assert not any(name.startswith("captioning-benchmark-train") for name in os.listdir(tmp_path))


def test_benchmark_train_reports_the_scst_rewards_share(tmp_path, prepared_dir):
    """Also the run without --compare (its figures at the top level; the records named with --set data.dir)."""
    out = tmp_path / "train.json"
    done = run_cli("-q", "benchmark", "train", "--config", "experiments/shapes_scst.yaml", "--set",
                   f"data.dir={prepared_dir}", "--steps", "3", "--warmup", "1", "--set", "train.batch_size=10",
                   "--set", "model.lstm_units=32", "--json", str(out))
    result = check(done, out)
    assert 0 <= result["ingestion_share"] < 1 and result["iteration_ms"] >= result["step_ms"]
    assert result["settings"]["steps"] == 3 and result["settings"]["data"] == prepared_dir
    assert f"(the first {result['first_step_s']:.1f} s)" in done.stdout
    assert positive(result["reward_ms"]) and 0 < result["reward_share"] < 1
    # the loop that draws the samples (scst.xla_sampling): once in training (every batch has one shape), once more in
    # the step-in-parts timing's own function
    assert result["xla_compilations"] == 2 and "; 2 XLA compilations" in done.stdout
    assert result["reward_share"] == pytest.approx(result["reward_ms"] / result["step_ms"])
    assert "the CIDEr-D reward alone" in done.stdout
    # the step in parts, each timed alone with the run's model (Show and Tell: drawn with XLA, scored again)
    parts = result["parts_ms"]
    assert sorted(parts) == ["cross_entropy", "encode", "greedy", "reward", "sampling", "sampling_xla",
                             "teacher_forced", "through_loop"]
    assert all(positive(v) for v in parts.values())
    used = parts["encode"] + parts["sampling_xla"] + parts["teacher_forced"] + parts["reward"]
    assert re.search(r"the SCST step in parts \(ms, each alone\): encode [\d.]+ \+ sampling with XLA [\d.]+ \+ "
                     rf"teacher-forced scoring and its backward [\d.]+ \+ reward [\d.]+ = {used:.1f}; not used: ",
                     done.stdout)


def test_the_cacheless_decoders_the_cache_is_measured_against_step_as_the_model_does():
    """benchmark decode's two decoders without a cache (re-reading the caption padded to max_length, or only the
    words so far) give the model's own logits at every step, so beam search makes the same captions with each."""
    from captioning.benchmarks.decode import GrowingPrefix, PrefixRecomputer
    from tests.harness.models import inputs, tiny

    model = tiny("transformer", seed=2)
    images, ids = inputs(seed=3, steps=5)
    features = model.encode(images)
    full = model({"features": features, "input_ids": ids}).numpy()
    for decoder in (PrefixRecomputer(model, 5), GrowingPrefix(model, 5)):
        state = decoder.initial_state(features)
        for t in range(5):
            logits, state = decoder.step(tf.constant(ids[:, t], tf.int32), state)
            np.testing.assert_allclose(logits.numpy(), full[:, t], atol=1e-5, err_msg=f"{type(decoder).__name__} {t}")


def test_prefix_lm_decoding_against_keras_hubs_generate(lm_presets, prepared_dir):
    """benchmark decode's comparison on a prefix_lm model: our greedy search after a prompt and keras-hub's own
    GPT2CausalLM.generate over the very same backbone, each compiled by XLA and not, choose the same tokens (every
    row, batch 1 and 3), and each side's rate is the tokens it made over its best time; the headline ratio is the
    XLA pair's, and keras-hub's own default here (a machine with only CPUs) is without XLA."""
    from captioning.benchmarks.decode_lm import against_keras_hub, summary
    from captioning.experiment import typed
    from tests.harness.distributed import small_config

    experiment = typed(small_config(prepared_dir, "model.decoder=prefix_lm", "model.mapper=mlp",
                                    "model.prefix_length=1", f"model.decoder_preset={lm_presets['gpt2']}"))
    model = experiment.build_model(len(experiment.tokenizer)).build_all()
    result = against_keras_hub(model, prompt_length=5, new_tokens=6, rounds=1, batches=(1, 3))
    assert result["backbone"] == "GPT2Backbone" and (result["prompt_length"], result["new_tokens"]) == (5, 6)
    for batch in (1, 3):
        r = result[f"batch_{batch}"]
        assert r["same_tokens"] is True, batch
        for pair in ("xla", "no_xla"):
            p = r[pair]
            assert positive(p["ours_tokens_per_s"]) and positive(p["keras_hub_tokens_per_s"])
            assert p["ratio"] == pytest.approx(p["ours_tokens_per_s"] / p["keras_hub_tokens_per_s"])
        assert (r["ratio"], r["ours_tokens_per_s"]) == (r["xla"]["ratio"], r["xla"]["ours_tokens_per_s"])
    assert result["keras_hub_default_xla"] is False  # Keras' "auto" on a machine without accelerators
    assert result["target"] == [1.0, all(result[f"batch_{b}"]["ratio"] >= 1.0 for b in (1, 3))]
    assert re.search(r"greedy 5 \+ 6 tokens, batch 3, both compiled by XLA: \d+ tokens/s against keras-hub's generate "
                     r"\d+: [\d.]+x \(target >= 1.0x\); without XLA: \d+ against \d+: [\d.]+x", summary(result))


def test_benchmark_decode(tmp_path, trained_model_dir, trained_attention_dir):
    transformer = ["--set", "model.decoder=transformer", "--set", "model.d_model=16", "--set", "model.heads=2",
                   "--set", "model.ff_size=16", "--set", "model.encoder_layers=1", "--set", "model.decoder_layers=1"]
    options = ["--option", "decode.method=sample,decode.top_k=2", "--option", "decode.block_ngrams=2",
               "--ensemble-with", trained_attention_dir]
    # a trained folder (Show and Tell, with the decoding options) and a model built from the config (the
    # Transformer, with --set): each way of naming the model, each decoder family once
    for extra, decoder in ((["--model-dir", trained_model_dir, *options], "show_and_tell"),
                           (transformer, "transformer")):
        out = tmp_path / "decode.json"
        done = run_cli("-q", "benchmark", "decode", "--batch-size", "4", "--images", "8", "--max-length", "5",
                       "--rounds", "1", "--json", str(out), *extra)
        result = check(done, out)
        assert positive(result["batched_captions_per_s"]) and positive(result["single_captions_per_s"])
        assert result["settings"]["beam_size"] == 3 and result["settings"]["max_length"] == 5
        assert result["settings"]["decoder"] == decoder and positive(result["cache_speedup"])
        assert result["keras_hub_generate"] is None  # no language model decodes
        assert result["cache_speedup"] == pytest.approx(result["cached_captions_per_s"] /
                                                        result["recomputed_captions_per_s"])
        assert result["cache_speedup_prefix"] == pytest.approx(result["cached_captions_per_s"] /
                                                               result["prefix_captions_per_s"])
        assert re.search(r"padded to max_length [\d.]+: [\d.]+x; the words so far only [\d.]+: [\d.]+x", done.stdout)
        assert positive(result["saved_model_captions_per_s"]) and result["saved_model_vs_captioner"] == \
            pytest.approx(result["saved_model_captions_per_s"] / result["captioner_captions_per_s"])
        assert "the exported SavedModel in plain TensorFlow: " in done.stdout
        parts = result["batched_parts_ms"]  # where a batched call's time goes
        assert sorted(parts) == ["decoder_steps", "encoder", "images", "search"] and all(map(positive, parts.values()))
        assert re.search(r"a batched call in parts \(ms, each alone\): images [\d.]+, encoder [\d.]+, search [\d.]+, "
                         r"decoder steps [\d.]+", done.stdout)
        assert positive(result["search_overhead"])  # the median of paired calls' ratios (not of the fastest ones)
        assert result["target"]["search_overhead"][0] in (1.3, 1.15)
        assert re.search(r"the search is [\d.]+x its decoder's steps \(target <= 1\.(30|15)x\), (\d+) steps, its "
                         r"decoder's own (\d+)", done.stdout)
        # the floor runs exactly the steps the search ran (a trained model's search may stop before max_length)
        steps_ran = result["steps_ran"]
        assert steps_ran["search"] == steps_ran["decoder_steps"] and 1 <= steps_ran["search"] <= 5, steps_ran
        if options[0] in extra:  # each decoding setting against plain beam search, side by side
            assert sorted(result["options"]) == ["decode.block_ngrams=2", "decode.method=sample,decode.top_k=2",
                                                 "ensemble of 2"]
            for o in result["options"].values():
                assert o["vs_beam"] == pytest.approx(o["captions_per_s"] / result["batched_captions_per_s"])
            assert "decode.block_ngrams=2: " in done.stdout
    done = run_cli("benchmark", "decode", "--model-dir", trained_model_dir, "--set", "model.decoder=attention")
    assert done.returncode == 2 and "give --model-dir or --config/--set, not both" in done.stderr
    done = run_cli("benchmark", "decode", "--ensemble-with", trained_model_dir)
    assert done.returncode == 2 and "--ensemble-with names the other models of an ensemble" in done.stderr


def test_the_prefix_recomputer_decodes_what_the_model_decodes():
    """The benchmark's decoder without a cache gives the same captions as the model it wraps."""
    import tensorflow as tf

    from captioning.benchmarks.decode import PrefixRecomputer
    from captioning.model.decode import beam_search
    from tests.harness.models import inputs, tiny

    for name in ("show_and_tell", "transformer"):
        model = tiny(name, seed=4)
        images, _ = inputs(seed=5)
        features = model.encode(images)
        cached = beam_search(model, features, beam_size=2, max_length=6)
        recomputed = beam_search(PrefixRecomputer(model, 6), features, beam_size=2, max_length=6)
        np.testing.assert_array_equal(recomputed["ids"].numpy(), cached["ids"].numpy())
        np.testing.assert_allclose(recomputed["log_probs"].numpy(), cached["log_probs"].numpy(), atol=1e-4)
        assert tf.reduce_all(recomputed["lengths"] == cached["lengths"])


def test_benchmark_prepare(tmp_path):
    out = tmp_path / "prepare.json"
    done = run_cli("-q", "benchmark", "prepare", "--images", "12", "--image-size", "64x48", "--shorter-side", "32",
                   "--work-dir", str(tmp_path / "work"), "--json", str(out))
    result = check(done, out)
    for key in ("prepare_img_per_s", "one_worker_img_per_s", "one_core_ceiling_img_per_s"):
        assert positive(result[key])
    assert result["identical_output"] is True  # one worker or many: the same shards
    assert result["settings"]["images"] == 12


def test_benchmark_usage_errors_are_one_line(tmp_path):
    done = run_cli("benchmark", "train", "--config", "experiments/shapes.yaml", "--steps", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("captioning benchmark: error:")
    done = run_cli("benchmark", "input", "--image-size", "640")
    assert done.returncode == 2 and "WIDTHxHEIGHT" in done.stderr


def test_benchmark_quality(tmp_path, prepared_dir):
    """Time to quality: a checkpoint every 5 steps, each evaluated after training; the clock is the
    training run's own (rising with the steps), and a target of 0 is reached at the first checkpoint.
    --compare: a second setting (5 steps instead of 10) trained after the first in the same run, with
    both curves and the ratios. (That each evaluation is kept as `evaluate` keeps it: test_model_dir.)"""
    out = tmp_path / "quality.json"
    done = run_cli("-q", "benchmark", "quality", "--config", "experiments/shapes.yaml", "--data", prepared_dir,
                   "--eval-every", "5", "--target", "0", "--set", "train.steps=10", "--set", "train.batch_size=8",
                   "--set", "model.lstm_units=32", "--set", "model.embedding_size=32",
                   "--compare", "train.steps=5", "--json", str(out))
    result = check(done, out)
    base, compared = result["base"], result["compared"]
    assert [p["step"] for p in base["curve"]] == [5, 10] and [p["step"] for p in compared["curve"]] == [5]
    seconds = [p["seconds"] for p in base["curve"]]
    assert all(positive(s) for s in seconds) and seconds == sorted(seconds)
    assert base["steps_to_target"] == 5 and base["seconds_to_target"] == seconds[0]
    assert base["final"]["step"] == 10 and base["train_seconds"] == seconds[-1]
    assert all(0 <= p["CIDEr"] <= 10 and 0 <= p["Bleu_4"] <= 1 for p in base["curve"] + compared["curve"])
    assert result["train_seconds_ratio"] == pytest.approx(compared["train_seconds"] / base["train_seconds"])
    assert result["seconds_to_target_ratio"] == pytest.approx(compared["seconds_to_target"] / base["seconds_to_target"])
    assert result["compare"] == ["train.steps=5"]
    assert "time to quality: CIDEr >= 0 after" in done.stdout and "time to the target" in done.stdout


def test_benchmark_quality_keeps_one_model_only_without_compare(tmp_path, prepared_dir):
    """--model-dir keeps the trained model (and its evaluations); with --compare there would be two."""
    done = run_cli("-q", "benchmark", "quality", "--config", "experiments/shapes.yaml", "--data", prepared_dir,
                   "--model-dir", str(tmp_path / "model"), "--compare", "train.steps=5")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "--model-dir" in lines[-1] and "--compare" in lines[-1] and not (tmp_path / "model").exists()
