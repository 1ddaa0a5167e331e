"""``captioning train``: a custom training loop under any ``tf.distribute`` strategy.

Each step, every replica computes the masked cross-entropy of its share of the global batch. The loss is
divided by the number of real (unmasked) tokens in the *whole global batch*, counted with an all-reduce,
so summing the replicas' gradients gives exactly the gradient of the global mean, for any number of
replicas and any split of long and short captions between them.

Gradient clipping by global norm must see the summed gradient. Keras 3 optimizers clip before they
all-reduce (per replica, which is wrong under data parallelism), so the loop all-reduces the gradients
itself, clips the global gradient, and hands each replica ``g / replicas`` to ``optimizer.apply``, whose
own sum restores ``g``. (That costs a second all-reduce of the gradients; exact for 2^k replicas, within
an ulp otherwise.)

The model folder::

    config.yaml     the resolved config (every key)
    vocab.txt       the dataset's vocabulary: later commands need only --model-dir
    ckpt-<step>.*   checkpoints (tf.train.CheckpointManager), the last train.keep_checkpoints kept
    logs/train      TensorBoard: loss, perplexity, learning rate, gradient norm, examples/s,
                    ingestion vs step time, sample captions; with train.profile_steps a TF
                    profiler trace of those steps (plugins/profile, TensorBoard's Profile tab)
    logs/eval       validation loss and perplexity

With ``data.color_jitter`` the step applies im2txt's colour distortions to the batch on the device
(:mod:`captioning.augment`) before the forward pass.

Starting again in the same folder resumes from the latest checkpoint and stops at ``train.steps`` in
total. Iteration time = ingestion time (waiting for the next batch) + train step time, the seeds'
definition; both are logged.

Surviving signals, crashes, bad numbers and bad folders (the choices):

* **SIGTERM / SIGINT** (Ctrl-C, a scheduler's stop): the loop finishes the step under way, saves
  ``ckpt-<step>`` and returns; ``captioning train`` prints ``interrupted at step N: saved DIR/ckpt-N; run
  the same command to resume`` and exits 0. The first signal resets both signals to the operating
  system's default action, so a second one kills the process at once (as ``kill -9`` would: the
  latest complete checkpoint stays the latest). Python runs signal handlers between steps, so a
  signal that arrives during a long step, save or evaluation is acted on when it ends. Under
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
* **A folder of another model**: :meth:`ModelDir.check_fits` refuses another vocabulary, encoder,
  embedding or LSTM size, a small_cnn image size that changes its feature grid, a folder with
  checkpoints but no ``config.yaml`` or ``vocab.txt``, and a ``--model-dir`` that is a file; and the
  restore asserts that every variable of the model was found in the checkpoint with its shape. All of
  these are an :class:`~captioning.errors.InputError` (one line, exit 2) before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import threading
import time

import keras
import tensorflow as tf
from tqdm import tqdm

from captioning import config as config_lib
from captioning import disk_cache, distribute, schema
from captioning.augment import color_jitter
from captioning.model.decode import beam_search, ids_to_text
from captioning.errors import InputError
from captioning.fileio import disk_full_error
from captioning.input_pipeline import eval_images, make_dataset
from captioning.integrity import data_errors
from captioning.model import all_layers, build_model
from captioning.model_dir import ModelDir
from captioning.vocab import Vocabulary

log = logging.getLogger("captioning.train")

class NonFiniteError(Exception):
    """The loss, the gradient norm or the weights stopped being finite (``train.nan_policy: stop``).
    Nothing was saved; the command line prints the message and exits 1."""

    exit_code = 1


class _Preempted(Exception):
    """Raised by the PreemptionCheckpointHandler's exit_fn once the checkpoint is saved on every worker."""


class StopOnSignal:
    """While active (a context manager), the first SIGINT or SIGTERM sets :attr:`signal_name` and makes
    both signals' next delivery take the operating system's default action (the process dies at once).
    Signal handlers can only be installed from the main thread; elsewhere it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        for other in self.SIGNALS:
            signal.signal(other, signal.SIG_DFL)
        log.warning("%s: finishing the current step, then saving a checkpoint and exiting "
                    "(a second SIGINT/SIGTERM exits at once, without saving)", self.signal_name)

    def release(self) -> None:
        """Gives the signals back to their previous handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self.release()


class LearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then constant, step (staircase), exponential or cosine decay.

    ``step``: multiply by ``factor`` every ``decay_steps`` (im2txt: 0.5 every 8 epochs);
    ``exponential``: the same, continuously; ``cosine``: from the base rate to 0 at ``total_steps``.
    """

    def __init__(self, base: float, kind: str, decay_steps: int, factor: float, total_steps: int,
                 warmup_steps: int = 0):
        self.base, self.kind, self.decay_steps, self.factor = base, kind, max(1, decay_steps), factor
        self.total_steps, self.warmup_steps = max(1, total_steps), warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        progress = tf.maximum(step - self.warmup_steps, 0.0)
        if self.kind == "step":
            rate = self.base * self.factor ** tf.floor(progress / self.decay_steps)
        elif self.kind == "exponential":
            rate = self.base * self.factor ** (progress / self.decay_steps)
        elif self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            rate = self.base * 0.5 * (1.0 + tf.cos(math.pi * tf.minimum(progress / span, 1.0)))
        else:
            rate = tf.constant(self.base, tf.float32)
        if self.warmup_steps:
            rate = rate * tf.minimum(1.0, (step + 1.0) / self.warmup_steps)
        return rate

    def get_config(self):
        return {"base": self.base, "kind": self.kind, "decay_steps": self.decay_steps, "factor": self.factor,
                "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


def make_optimizer(t: config_lib.TrainConfig, steps_per_epoch: int, mixed_float16: bool):
    schedule = LearningRate(t.learning_rate, t.lr_schedule, round(t.lr_decay_epochs * steps_per_epoch),
                            t.lr_decay_factor, t.steps, t.warmup_steps)
    if t.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=schedule)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=schedule)
    return keras.optimizers.LossScaleOptimizer(optimizer) if mixed_float16 else optimizer


def examples_per_epoch(manifest: dict, cfg: config_lib.Config) -> int:
    split = manifest["splits"][cfg.data.train_split]
    return split["captions"] if cfg.data.captions_per_image == "all" else split["images"]


def _forward_state(model) -> list:
    """The variables a training forward pass assigns: the moving statistics of batch-norm layers that
    train (a frozen encoder's run in inference mode and stay put)."""
    found = {}
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            for v in (layer.moving_mean, layer.moving_variance):
                found[id(v)] = v
    return list(found.values())


def caption_loss_sum(model, batch: dict, training: bool = False):
    """Cross-entropy summed over the real (unmasked) target words of ``batch``; training divides it by
    the global batch's word count, evaluation by the split's (perplexity = exp(mean))."""
    inputs = {k: batch[k] for k in ("image", "features", "input_ids") if k in batch}
    logits = model(inputs, training=training)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["target_ids"], logits=logits)
    return tf.reduce_sum(ce * batch["mask"])


def _hide_handler_deprecation(record: logging.LogRecord) -> bool:
    """PreemptionCheckpointHandler calls its own deprecated ``total_run_calls`` when it saves, which logs
    advice meant for its callers ("Track steps using a tf.Variable...", which we do)."""
    return "total_run_calls" not in record.getMessage()


@contextlib.contextmanager
def _quiet_tf_watcher_threads():
    """While training: a peer error in one of TF's own failure-handling threads (the
    PreemptionCheckpointHandler polls the coordination service) is logged at debug level instead of
    printing a thread traceback. When a worker is lost, that thread fails like the training step does,
    and the step's error is the one reported (one line, :func:`captioning.distribute.peer_error`)."""
    previous = threading.excepthook

    def hook(args):
        frames, tb = [], args.exc_traceback
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        ours = any(f"{os.sep}failure_handling{os.sep}" in name for name in frames)
        if isinstance(args.exc_value, distribute.PEER_ERRORS) and ours:
            name = getattr(args.thread, "name", "?")
            log.debug("TF's %s thread stopped: %s", name, str(args.exc_value).splitlines()[0])
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def _raise_preempted() -> None:
    raise _Preempted()


def _new_window() -> dict:
    """Sums over the steps between two log lines; loss, tokens and norm over the finite steps only."""
    return {"loss": 0.0, "tokens": 0.0, "norm": 0.0, "finite": 0, "ingest": 0.0, "step": 0.0, "n": 0}


class StepProfiler:
    """``train.profile_steps: [start, stop]``: a TensorFlow profiler trace of those steps (ingestion and
    train step, with step markers) into ``logdir``, where TensorBoard's Profile tab finds it
    (``logdir/plugins/profile/<run>/*.xplane.pb``; the tab comes with ``pip install
    tensorboard-plugin-profile``). It shows per op where a step's time goes and, in its input-pipeline
    analyser, whether the device waited for data. Only the chief traces."""

    def __init__(self, steps: list[int], logdir: str, enabled: bool = True):
        self.start, self.stop = (steps if steps and enabled else (0, -1))
        self.logdir, self.active, self._trace = logdir, False, None

    def before(self, step: int) -> None:
        if step == self.start and not self.active:
            tf.profiler.experimental.start(self.logdir)
            self.active = True
            log.info("profiling steps %d to %d into %s", self.start, self.stop, self.logdir)
        if self.active:
            self._trace = tf.profiler.experimental.Trace("train", step_num=step, _r=1)
            self._trace.__enter__()

    def after(self, step: int) -> None:
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if self.active:
            tf.profiler.experimental.stop()
            self.active = False
            log.info("profiler trace written under %s (TensorBoard: Profile tab)", self.logdir)


class Trainer:
    """Builds the strategy, data, model, optimizer and checkpoints for one run; :meth:`run` trains."""

    def __init__(self, cfg: config_lib.Config, model_dir: str, strategy: tf.distribute.Strategy | None = None):
        config_lib.validate(cfg)
        self.cfg, self.model_dir = cfg, model_dir
        self.cache_dir = cfg.data.cache_dir or os.path.join(model_dir, "cache")  # data.cache: disk
        self.manifest = schema.read_manifest(cfg.data.dir)
        # a clear error for a missing split; the eval split only matters when something evaluates
        for split in (cfg.data.train_split,) + ((cfg.data.eval_split,) if cfg.train.eval_every_steps else ()):
            schema.split_files(cfg.data.dir, self.manifest, split)
        self.vocab = Vocabulary.load(os.path.join(cfg.data.dir, schema.VOCAB))
        self.strategy = strategy or distribute.make_strategy(cfg.distribute)
        self.chief = distribute.is_chief(self.strategy)
        self.folder = ModelDir(model_dir)
        # checks only: config.yaml and vocab.txt are written once the checkpoint is known to fit
        previous = self.folder.check_fits(cfg, self.vocab)
        if cfg.data.cache == "disk":
            disk_cache.check_folder(self.cache_dir)
        replicas = self.strategy.num_replicas_in_sync
        if cfg.train.batch_size % replicas:
            raise InputError(f"train.batch_size {cfg.train.batch_size} must be a multiple of the "
                             f"{replicas} replicas")
        self.steps_per_epoch = max(1, examples_per_epoch(self.manifest, cfg) // cfg.train.batch_size)

        policy = distribute.mixed_precision_policy() if cfg.train.mixed_precision else "float32"
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(cfg.train.seed)
        with self.strategy.scope():
            self.model = build_model(len(self.vocab), cfg.model, cfg.data.image_size, seed=cfg.train.seed)
            self.model.build_all()
            self.optimizer = make_optimizer(cfg.train, self.steps_per_epoch, policy == "mixed_float16")
            # Keras 3 optimizers must create their slots inside the scope before the first
            # distributed step, or the first step fails on an unfed 'cond' placeholder.
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        keras.mixed_precision.set_global_policy("float32")  # the policy only applies while building

        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        # The chief writes the folder: one training run at a time (the other workers write scratch folders).
        self._lock = self.folder.lock_for_training() if self.chief else None
        latest = self.folder.latest_checkpoint()
        if self.chief:
            self.folder.remove_partial_checkpoints(latest)
            write_dir = model_dir
        else:  # a scratch folder; what a killed run left there is of no use
            write_dir = os.path.join(model_dir, f".tmp-{distribute.worker_id(self.strategy)}")
            shutil.rmtree(write_dir, ignore_errors=True)
        self.manager = tf.train.CheckpointManager(self.checkpoint, write_dir, max_to_keep=cfg.train.keep_checkpoints,
                                                  checkpoint_name="ckpt", step_counter=self.step)
        self._saved_step = None
        if latest and previous is not None and previous.model.encoder_trainable != cfg.model.encoder_trainable:
            # Keras optimizers track their variables by position, so when the set of trained variables
            # changes (fine-tuning the encoder after training with it frozen) the saved optimizer state
            # no longer lines up: restore the model and the step, and start the optimizer afresh.
            self.folder.restore(latest, {"model": self.model, "step": self.step})
            log.info("resumed the model from %s at step %d with a new optimizer (model.encoder_trainable "
                     "changed)", latest, int(self.step.numpy()))
        elif latest:
            self.folder.restore(latest, {"model": self.model, "step": self.step}, {"optimizer": self.optimizer})
            log.info("resumed from %s at step %d", latest, int(self.step.numpy()))
        if latest:
            self._saved_step = int(self.step.numpy())  # so an interrupted run does not write it again
        start = int(self.step.numpy())
        if self.chief and start < cfg.train.steps:  # a finished folder's record stays as it is
            self.folder.write(cfg, self.vocab, step=start)
        self._skipped_steps: list[int] = []
        self._steps: dict = {}

    # ---- data ---------------------------------------------------------------------------------------
    def _feature_fn(self):
        if self.cfg.data.cache != "features":
            return None
        return tf.function(lambda images: self.model.encoder(images, training=False))

    def distributed_dataset(self, split: str, training: bool):
        cfg = self.cfg

        def dataset_fn(input_context):
            batch = input_context.get_per_replica_batch_size(cfg.train.batch_size)
            return make_dataset(cfg.data, split, training=training, batch_size=batch, input_context=input_context,
                                feature_fn=self._feature_fn(), cache_dir=self.cache_dir)

        return self.strategy.distribute_datasets_from_function(dataset_fn)

    # ---- steps --------------------------------------------------------------------------------------
    def _compiled(self, make, dataset):
        """``make()``'s step as a tf.function traced once for the dataset's element_spec: batches of
        every bucket length share one graph instead of one trace per caption length."""
        key = (make.__name__, repr(dataset.element_spec))
        if key not in self._steps:
            self._steps[key] = tf.function(make(), input_signature=[dataset.element_spec])
        return self._steps[key]

    def train_step_for(self, dataset):
        """The compiled training step for batches of ``dataset`` (a distributed dataset): returns the
        global mean loss per token, the global gradient norm and the global token count."""
        return self._compiled(self._make_train_step, dataset)

    def _make_train_step(self):
        model, optimizer, strategy = self.model, self.optimizer, self.strategy
        clip = self.cfg.train.clip_gradient_norm
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        forward_state = _forward_state(model)

        jitter = self.cfg.data.color_jitter and self.cfg.data.cache != "features"

        def replica_step(batch):
            if jitter:  # im2txt's colour distortions, on the device (captioning.augment)
                batch = {**batch, "image": color_jitter(batch["image"])}
            ctx = tf.distribute.get_replica_context()
            tokens = tf.reduce_sum(batch["mask"])
            global_tokens = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tokens)
            variables = model.trainable_variables
            before = [tf.identity(v.value) for v in forward_state]  # the forward pass moves these
            with tf.GradientTape() as tape:
                loss_sum = caption_loss_sum(self.model, batch, training=True)
                loss = loss_sum / tf.maximum(global_tokens, 1.0)
                if scaled:
                    loss = optimizer.scale_loss(loss)
            # Dense gradients (the embedding's arrive as IndexedSlices): they are all-reduced and scaled.
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
            # the global gradient and loss, on every replica
            *grads, global_loss_sum = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads + [loss_sum])
            if scaled:
                grads = [g / optimizer.dynamic_scale for g in grads]
            norm = tf.linalg.global_norm(grads)
            # The same verdict on every replica and worker: it is computed from all-reduced values.
            # Under loss scaling, overflowing gradients are the LossScaleOptimizer's to skip.
            finite = tf.math.is_finite(global_loss_sum)
            if not scaled:
                finite = tf.logical_and(finite, tf.math.is_finite(norm))
            for v, old in zip(forward_state, before):  # a skipped step leaves batch norm as it was
                v.assign(tf.where(finite, v.value, old))
            if clip > 0:
                grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)
            share = 1.0 / ctx.num_replicas_in_sync  # optimizer.apply sums over replicas again
            if scaled:
                share = share * optimizer.dynamic_scale
            grads = [g * share for g in grads]
            if scaled:  # it applies only finite gradients itself (and lowers its scale otherwise)
                optimizer.apply(grads, variables)
                grads = []
            return global_loss_sum, global_tokens, norm, finite, grads

        def apply(grads):
            optimizer.apply(grads, model.trainable_variables)

        def train_step(batch):
            total, count, norm, finite, grads = strategy.run(replica_step, args=(batch,))
            if not scaled:
                # A cond in cross-replica context around strategy.run: optimizer.apply merge_calls, which a
                # cond inside the replica function cannot hold (Keras' LossScaleOptimizer does the same).
                tf.cond(strategy.experimental_local_results(finite)[0],
                        lambda: strategy.run(apply, args=(grads,)), lambda: None)
            self.step.assign_add(1)
            # The replicas all-reduced the loss and the token count already: any replica's copy is global.
            total, count, norm = (strategy.experimental_local_results(x)[0] for x in (total, count, norm))
            return total / tf.maximum(count, 1.0), norm, count

        return train_step

    def _step_was_finite(self, loss: float, norm: float) -> bool:
        """The host's copy of the compiled step's verdict, from the values it returns."""
        return math.isfinite(loss) and (math.isfinite(norm) or
                                        isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer))

    def _make_eval_step(self):
        strategy = self.strategy

        def eval_step(batch):
            def replica(b):
                return caption_loss_sum(self.model, b, training=False), tf.reduce_sum(b["mask"])

            loss_sum, tokens = strategy.run(replica, args=(batch,))
            return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss_sum, axis=None),
                    strategy.reduce(tf.distribute.ReduceOp.SUM, tokens, axis=None))

        return eval_step

    def evaluate_loss(self, max_batches: int | None = None) -> dict:
        """Mean cross-entropy per real token and perplexity on the eval split (all captions)."""
        total, count = 0.0, 0.0
        dataset = self.distributed_dataset(self.cfg.data.eval_split, training=False)
        eval_step = self._compiled(self._make_eval_step, dataset)
        for i, batch in enumerate(dataset):
            if max_batches and i >= max_batches:
                break
            loss_sum, tokens = eval_step(batch)
            total, count = total + float(loss_sum), count + float(tokens)
        loss = total / max(count, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count)}

    def sample_captions(self, count: int) -> list[tuple[int, str, str]]:
        """(image id, generated caption, first reference) for the first ``count`` eval images."""
        if count <= 0:
            return []
        cfg = self.cfg.data
        batch = next(iter(eval_images(cfg, cfg.eval_split, count, max_images=count)))
        best = beam_search(self.model, self.model.encode(batch["image"]), beam_size=1)  # greedy
        captions = ids_to_text(self.vocab, best["ids"], best["lengths"])
        out = []
        for i, (caption,) in enumerate(captions):
            reference = " ".join(self.vocab.decode(batch["captions"][i][0].numpy()))
            out.append((int(batch["image_id"][i]), caption, reference))
        return out

    # ---- the loop -----------------------------------------------------------------------------------
    def save(self) -> str:
        """Saves ``ckpt-<step>`` unless this step is saved already, after checking that the weights are
        finite (NonFiniteError otherwise). Returns its path in the model folder."""
        step = int(self.step.numpy())
        path = os.path.join(self.model_dir, f"ckpt-{step}")
        if self._saved_step == step:
            return path
        if not self._weights_finite():
            raise NonFiniteError(self._non_finite_message("the model's weights are no longer finite", step))
        try:
            written = self.manager.save(checkpoint_number=step)
        except (OSError, tf.errors.OpError) as e:
            # TF replaces the state file only after a checkpoint's files are complete: the latest one
            # stays the latest, and the next start removes this one's leftovers.
            latest = self.folder.latest_checkpoint() if self.chief else None
            then = f"run the same command to resume from {os.path.basename(latest)}" if latest else \
                "run the same command again"
            size = sum(os.path.getsize(p) for p in tf.io.gfile.glob(latest + ".*")) if latest else 0
            need = f" (a checkpoint takes about {size / 2**20:.1f} MB)" if size else ""
            raise disk_full_error(e, self.manager.directory, f"checkpoint ckpt-{step}{need}", then) or e
        if not self.chief:  # other workers write to a scratch folder, only for the collective ops
            shutil.rmtree(os.path.dirname(written), ignore_errors=True)
        self._saved_step = step
        return path

    def _weights_finite(self) -> bool:
        floats = [v.value for v in self.model.variables if tf.as_dtype(v.dtype).is_floating]
        return bool(tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in floats])))

    def _non_finite_message(self, what: str, step: int) -> str:
        latest = self.folder.latest_checkpoint()
        kept = (f"the latest checkpoint, {os.path.basename(latest)}, is the last good one" if latest
                else "there is no checkpoint yet")
        return (f"{what} at step {step}: stopped without saving; {kept}. Lower train.learning_rate, set "
                "train.clip_gradient_norm, or set train.nan_policy=skip to skip such batches")

    def _preemption_handler(self, stop: StopOnSignal):
        """TF's PreemptionCheckpointHandler when this is one worker of a multi-worker cluster, else None."""
        resolver = getattr(self.strategy, "cluster_resolver", None)
        if (not isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None
                or not resolver.cluster_spec().jobs):
            return None
        config = tf.distribute.experimental.TerminationConfig(
            termination_watcher_fn=lambda: stop.signal_name is not None,  # polled every second
            exit_fn=_raise_preempted, grace_period=0, save_fn=self.save)
        # The handler adds its run counter to the checkpoint it is given and restores it from that manager's
        # folder: it gets an empty checkpoint object of its own, in a folder that never holds any, so every
        # worker's counter starts at 0 and our checkpoints keep their layout.
        bookkeeping = tf.train.CheckpointManager(tf.train.Checkpoint(), os.path.join(self.model_dir, ".preemption"),
                                                 max_to_keep=1)
        handler = tf.distribute.experimental.PreemptionCheckpointHandler(resolver, bookkeeping,
                                                                         termination_config=config)
        logging.getLogger("tensorflow").addFilter(_hide_handler_deprecation)
        platform = getattr(getattr(handler, "_platform_device", None), "name", "")
        if platform in ("GCE_CPU", "GCE_TPU"):  # TF's handler does nothing there
            log.warning("PreemptionCheckpointHandler is disabled on %s: SIGTERM/SIGINT keep their default "
                        "action; a restart resumes from the last periodic checkpoint", platform)
            stop.release()
            return None
        return handler

    def run(self, progress: bool = True) -> dict:
        """Trains to ``train.steps``, or until SIGINT/SIGTERM (then saves; see the module docstring).

        Returns ``{"step", "trained_steps", "losses", "ingestion_s", "step_s", "skipped_steps",
        "interrupted", "checkpoint"}``: ``ingestion_s`` and ``step_s`` are each iteration's time waiting
        for the batch and running the step, in seconds; ``skipped_steps`` the steps whose batch was
        skipped for a non-finite loss (``train.nan_policy: skip``; their ``losses`` are NaN or Inf);
        ``interrupted`` the signal's name (or ``"another worker's signal"``) when one ended the run early,
        else None; ``checkpoint`` the path of the folder's latest checkpoint when the run ended (None if
        there is none)."""
        cfg = self.cfg.train
        start = int(self.step.numpy())
        result = {"step": start, "trained_steps": 0, "losses": [], "ingestion_s": [], "step_s": [],
                  "skipped_steps": [], "interrupted": None, "checkpoint": None}
        if start >= cfg.steps:
            log.info("already at step %d of %d: nothing to train", start, cfg.steps)
            return result
        log.info("training from step %d to %d: global batch %d on %d replica(s), %d steps per epoch",
                 start, cfg.steps, cfg.batch_size, self.strategy.num_replicas_in_sync, self.steps_per_epoch)
        logs = os.path.join(self.model_dir, "logs")
        writer = tf.summary.create_file_writer(os.path.join(logs, "train")) if self.chief else tf.summary.create_noop_writer()
        eval_writer = tf.summary.create_file_writer(os.path.join(logs, "eval")) if self.chief else tf.summary.create_noop_writer()
        dataset = self.distributed_dataset(self.cfg.data.train_split, training=True)
        train_step = self.train_step_for(dataset)
        iterator = iter(dataset)
        window = _new_window()
        history, ingestion_s, step_s = [], [], []
        self._skipped_steps = skipped = []
        interrupted = None
        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=None if progress else True,
                   mininterval=1.0)
        profiler = StepProfiler(cfg.profile_steps, os.path.join(logs, "train"), enabled=self.chief)
        with StopOnSignal() as stop, _quiet_tf_watcher_threads():
            preemption = self._preemption_handler(stop)
            try:
                while int(self.step.numpy()) < cfg.steps and (preemption is not None or stop.signal_name is None):
                    profiler.before(int(self.step.numpy()) + 1)
                    t0 = time.perf_counter()
                    batch = next(iterator)
                    t1 = time.perf_counter()
                    if preemption is None:
                        loss, norm, tokens = train_step(batch)
                    else:  # checks first whether a worker was signalled; if so all save at one step and stop
                        loss, norm, tokens = preemption.run(train_step, batch)
                    loss = float(loss)  # waits for the step: step time includes the device work
                    t2 = time.perf_counter()
                    step = int(self.step.numpy())
                    profiler.after(step)
                    norm = float(norm)
                    history.append(loss)
                    ingestion_s.append(t1 - t0)
                    step_s.append(t2 - t1)
                    if self._step_was_finite(loss, norm):
                        window["loss"] += loss * float(tokens)
                        window["tokens"] += float(tokens)
                        window["norm"] += norm
                        window["finite"] += 1
                    else:
                        what = f"non-finite loss {loss} (gradient norm {norm})"
                        if cfg.nan_policy == "stop":
                            raise NonFiniteError(self._non_finite_message(what, step))
                        skipped.append(step)
                        log.warning("step %d: %s: batch skipped, no update applied (%d skipped so far)", step,
                                    what, len(skipped))
                    window["ingest"] += t1 - t0
                    window["step"] += t2 - t1
                    window["n"] += 1
                    bar.update(1)
                    evaluate = cfg.eval_every_steps and (step % cfg.eval_every_steps == 0 or step == cfg.steps)
                    # The checkpoint first: whatever fails after it (summaries, evaluation, sample captions)
                    # never loses the steps trained. An evaluation step is always saved first.
                    if step % cfg.checkpoint_every_steps == 0 or step == cfg.steps or evaluate:
                        log.info("saved %s", self.save())
                    if step % cfg.log_every_steps == 0 or step == cfg.steps:
                        self._log_window(writer, window, step)
                        bar.set_postfix(loss=f"{window['loss'] / max(window['tokens'], 1):.3f}")
                        window = _new_window()
                    if evaluate:
                        self._evaluate(eval_writer, writer, step)
                if stop.signal_name and preemption is None and int(self.step.numpy()) < cfg.steps:
                    self.save()
                    interrupted = stop.signal_name
            except _Preempted:  # every worker saved this step (PreemptionCheckpointHandler's save_fn)
                interrupted = stop.signal_name or "another worker's signal"
            finally:
                profiler.close()
                if preemption is not None:
                    # TF relies on __del__ to stop the handler's watcher threads when no preemption came;
                    # stop them now, so they do not outlive the run.
                    preemption.__del__()
                bar.close()
                writer.flush()
                eval_writer.flush()
        step = int(self.step.numpy())
        if interrupted:
            log.info("interrupted by %s at step %d: saved %s", interrupted, step,
                     os.path.join(self.model_dir, f"ckpt-{step}"))
        saved = None if self._saved_step is None else os.path.join(self.model_dir, f"ckpt-{self._saved_step}")
        result.update(step=step, trained_steps=len(history), losses=history, ingestion_s=ingestion_s, step_s=step_s,
                      skipped_steps=skipped, interrupted=interrupted, checkpoint=saved)
        return result

    def _log_window(self, writer, window, step: int) -> None:
        n = max(window["n"], 1)
        iteration = (window["ingest"] + window["step"]) / n
        examples_per_s = self.cfg.train.batch_size * n / max(window["ingest"] + window["step"], 1e-9)
        lr = float(self.optimizer.learning_rate) if not callable(self.optimizer.learning_rate) else \
            float(self.optimizer.learning_rate(self.step))
        with writer.as_default(step=step):
            if window["finite"]:
                loss = window["loss"] / max(window["tokens"], 1.0)
                tf.summary.scalar("loss", loss)
                tf.summary.scalar("perplexity", math.exp(min(loss, 50.0)))
                tf.summary.scalar("gradient_norm", window["norm"] / window["finite"])
            tf.summary.scalar("learning_rate", lr)
            tf.summary.scalar("skipped_batches", len(self._skipped_steps))  # in this run, so far
            tf.summary.scalar("examples_per_second", examples_per_s)
            tf.summary.scalar("time/ingestion_ms", 1000 * window["ingest"] / n)
            tf.summary.scalar("time/train_step_ms", 1000 * window["step"] / n)
            tf.summary.scalar("time/ingestion_share", window["ingest"] / n / max(iteration, 1e-9))
        if not window["finite"]:
            log.info("step %d: all %d steps since the last log line skipped (non-finite loss)", step, window["n"])
            return
        log.info("step %d: loss %.4f, %.0f examples/s, ingestion %.1f ms + step %.1f ms", step, loss,
                 examples_per_s, 1000 * window["ingest"] / n, 1000 * window["step"] / n)

    def _evaluate(self, eval_writer, writer, step: int) -> None:
        metrics = self.evaluate_loss(self.cfg.train.eval_batches)
        with eval_writer.as_default(step=step):
            tf.summary.scalar("loss", metrics["loss"])
            tf.summary.scalar("perplexity", metrics["perplexity"])
        samples = self.sample_captions(self.cfg.train.sample_captions) if self.chief else []
        if samples:
            text = "\n\n".join(f"image {i}: **{caption}** (reference: {ref})" for i, caption, ref in samples)
            with writer.as_default(step=step):
                tf.summary.text("sample_captions", text)
        log.info("step %d: validation loss %.4f, perplexity %.2f%s", step, metrics["loss"], metrics["perplexity"],
                 f"; e.g. \"{samples[0][1]}\"" if samples else "")


def train(cfg: config_lib.Config, model_dir: str, progress: bool = True) -> dict:
    """Configures devices, then trains (see the module docstring). Returns a summary of the run."""
    distribute.configure_devices(cfg.distribute)
    try:
        with data_errors():  # a damaged shard: one line naming it (InputError), not a DataLossError traceback
            return Trainer(cfg, model_dir).run(progress=progress)
    except distribute.PEER_ERRORS as e:  # multi_worker: another worker is gone; one line naming it
        raise distribute.peer_error(e, cfg.distribute) or e from None
