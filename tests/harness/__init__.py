"""The test harness: what the test modules share, so that no test module imports another (tests/test_architecture.py
checks). Fixtures built once per session are in tests/conftest.py; plain helpers (images, ports, the command line
in-process or in a process, small configs) in tests/helpers.py; the rest here, by subject:

- :mod:`tests.harness.models` — tiny decoder models on ``small_cnn`` at 32 px and their random inputs, regions and
  gradients (``tiny``, ``shared_tiny``, ``inputs``, ``tiny_regions``, ``region_batch``, ``loss_and_grads``, ``npy``).
- :mod:`tests.harness.decoder_contract` — the decoder contract, one ``check_...`` function a promise, and
  ``run_decoder_test(name, folder, **settings)`` that runs every quick one over one registered decoder.
- :mod:`tests.harness.encoder_contract` — the encoder contract: ``check_encoder_declarations``, ``check_pair`` (an
  encoder under a decoder) and ``run_encoder_test(entry, presets)`` over one registered encoder and every decoder.
- :mod:`tests.harness.presets` — tiny keras-hub presets written offline, and the encoder contract's entries.
- :mod:`tests.harness.training` — ``captioning train`` in the background (``Cli``), its config, checkpoints and
  TensorBoard scalars; the two workers of a localhost cluster (``run_two_workers``).
- :mod:`tests.harness.averages` — the weight average (``train.ema_decay``) as a Trainer or a checkpoint holds it, and
  one step of it recomputed in numpy (``averages``, ``checkpoint_averages``, ``next_average``, ``assert_same``).
- :mod:`tests.harness.distributed` — what a process of 2 replicas needs: the small config (``small_config``), two
  logical CPUs (``two_cpus``) and the process's one ``multi_worker_strategy``.
- :mod:`tests.harness.scenarios` — the 2-replica scenarios of conftest's ``distributed_runs`` that belong to one
  test file each (``accumulate``, ``eval_losses``, ``nan_skip``, ``uneven_cli``, ``resume``, ``fused``), which
  tests/distributed_worker.py runs, and what those test files share with them; the decoder and encoder contracts'
  2-replica steps of conftest's ``mirrored_contracts`` (``MIRRORED_PAIRS``, ``contract_result``).
- :mod:`tests.harness.data_service` — tf.data service dispatchers and workers as processes (``Proc``, ``Cluster``).
- :mod:`tests.harness.files` — shards damaged in place (``damage``), the script that loads an export without the
  project (``LOADER``), docs/litert.md's snippet (``doc_snippet``).
- :mod:`tests.harness.source` — the project's modules and what each imports, read from the source, and the imports of
  test modules that tests/test_architecture.py forbids.

A registered component's own test is then a few lines, e.g. a new decoder's::

    from tests.harness.decoder_contract import run_decoder_test

    def test_my_decoder_keeps_the_contract(tmp_path):
        run_decoder_test("my_decoder", tmp_path)

(every registered decoder already runs the contract in tests/test_decoders.py, one test a promise, and every
encoder in tests/test_encoders.py; a component's own file adds its own promises, or the contract under other
settings, as tests/test_transformer.py does for its normalisations and positions).

tests/conftest.py registers this package for pytest's assertion rewriting: an ``assert`` here reports its values as
one in a test module does.
"""
