"""``captioning train``: a custom training loop under any ``tf.distribute`` strategy.

=====================  ==============================================================================
module                 what it holds
=====================  ==============================================================================
``loop``               :class:`Trainer`: the run's set-up, and :meth:`Trainer.run`, the loop, top to bottom
``steps``              the compiled training step (any objective, any strategy) and the evaluation loss
``objectives``         what a replica's loss is: ``xe`` (cross-entropy of the references)
``optimizer``          SGD or Adam and the learning-rate schedule
``lifecycle``          signals, the multi-worker preemption handler, the profiler
``summaries``          log lines and TensorBoard
``distribute``         devices and ``tf.distribute`` strategies; a lost multi-worker peer
=====================  ==============================================================================

Every replica's loss is divided by the weight (real tokens) of the *whole global batch*, so the summed
gradients are those of the global mean for any number of replicas; clipping sees the all-reduced
gradient (:mod:`captioning.train.steps`). The model folder and its rules belong to
:class:`captioning.model.folder.ModelDir`.

Starting again in the same folder resumes from the latest checkpoint and stops at ``train.steps`` in
total. Iteration time = ingestion time (waiting for the next batch) + train step time, the seeds'
definition; both are logged.

Surviving signals, crashes, bad numbers and bad folders (the choices):

* **SIGTERM / SIGINT** (Ctrl-C, a scheduler's stop): the loop finishes the step under way, saves
  ``ckpt-<step>`` and returns; ``captioning train`` prints ``interrupted at step N: saved DIR/ckpt-N; run
  the same command to resume`` and exits 0. A second signal ends the process at once, without saving
  (exit code 128 + the signal's number; the latest complete checkpoint stays the latest). The signals
  are watched by a thread of their own (:class:`~captioning.train.lifecycle.StopOnSignal`), so they are
  acted on even while the loop waits inside TensorFlow for a batch that does not come (a tf.data service
  whose workers are gone): that thread then saves the last step itself and exits 0. Before the first
  step, while ``train`` waits for a tf.data dispatcher, a signal ends it with one line and exit 0
  (:class:`~captioning.train.result.Interrupted`; nothing was written). Under
  MultiWorkerMirroredStrategy every worker must stop after the *same* step, so TF's own
  ``tf.distribute.experimental.PreemptionCheckpointHandler`` agrees on it through the cluster's
  coordination service: its ``TerminationConfig`` polls our signal flag (SIGINT as well as SIGTERM;
  TF alone would only hook SIGTERM), saves through :meth:`Trainer.save` (the chief into the model
  folder, the others into scratch folders) and, instead of TF's default ``sys.exit(42)``, hands control
  back to the loop, so each worker exits 0. The handler keeps its own run counter in a separate,
  never-saved checkpoint object, so our checkpoints keep their layout. (On Google Cloud CPU/TPU VMs the
  handler disables itself and probes the metadata server at start; there signals keep their default
  action and a killed worker resumes from the last periodic checkpoint.)
* **kill -9, power cut of the process, OOM killer**: nothing runs, so a restart resumes from the
  latest complete checkpoint and at most ``train.checkpoint_every_steps`` steps are lost. A save writes
  ``ckpt-N_temp/`` first, renames the data and index files into place (TF's ``MergeV2Checkpoints``),
  and only then rewrites the ``checkpoint`` state file, atomically (``atomic_write_string_to_file``:
  a temporary file renamed over it; object stores such as GCS, which have no rename, write whole
  objects). So a checkpoint cut short is never named in ``checkpoint``; at start the chief deletes such
  leftovers (``ckpt-N_temp/``, unnamed ``ckpt-N.*`` newer than the latest, ``checkpoint.tmp<hex>``),
  which TF documents as safe. A ``checkpoint`` file naming files that are gone is refused
  rather than silently restarting from step 0. (Durability across an OS crash would also need
  fsyncs, which TF does not do.)
* **NaN or Inf**: inside the compiled step, a step whose global loss or global gradient norm is not
  finite applies no update (``tf.cond`` in cross-replica context around ``optimizer.apply``, as Keras'
  LossScaleOptimizer does, so it works under every strategy; batch-norm moving statistics changed by
  that forward pass are put back with ``tf.where``). ``train.nan_policy: stop`` (default) then stops
  with an error naming the step and exit code 1, saving nothing, so the latest checkpoint is the last
  good one; ``skip`` drops the batch, logs a warning, counts it (TensorBoard ``skipped_batches``, and
  ``run()``'s ``skipped_steps``) and trains on. A skipped batch still counts as a step (it was consumed;
  the run still ends at ``train.steps``), but not as an optimizer iteration. Every save also checks
  that the weights are finite (an update of finite gradients can still overflow), so NaN weights are
  never written. Under loss scaling (``mixed_float16``) overflowing gradients are the loss scaler's
  business; only a non-finite loss counts.
* **A folder of another model**: :meth:`~captioning.model.folder.ModelDir.check_fits` refuses another vocabulary, encoder,
  embedding or LSTM size, a small_cnn image size that changes its feature grid, a folder with
  checkpoints but no ``config.yaml`` or ``vocab.txt``, and a ``--model-dir`` that is a file; and the
  restore asserts that every variable of the model was found in the checkpoint with its shape. All of
  these are an :class:`~captioning.errors.InputError` (one line, exit 2) before the first step.
"""

from captioning.train.loop import Trainer, train
from captioning.train.result import Interrupted, NonFiniteError, TrainResult
from captioning.train.lifecycle import StopOnSignal
from captioning.train.objectives import caption_loss_sum, perplexity
from captioning.train.steps import EvaluationLoss, evaluation_loss

__all__ = ["EvaluationLoss", "Interrupted", "NonFiniteError", "StopOnSignal", "TrainResult", "Trainer", "caption_loss_sum",
           "evaluation_loss", "perplexity", "train"]
