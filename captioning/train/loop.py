"""The training loop: :class:`Trainer` sets a run up, :meth:`Trainer.run` trains, top to bottom.

Machinery lives elsewhere in the package: the compiled steps (:mod:`~captioning.train.steps`), the
objective (:mod:`~captioning.train.objectives`), the optimizer (:mod:`~captioning.train.optimizer`),
signals, preemption and the profiler (:mod:`~captioning.train.lifecycle`), logging
(:mod:`~captioning.train.summaries`), devices and strategies (:mod:`~captioning.train.distribute`), and
the model folder (:class:`captioning.model.folder.ModelDir`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time

import keras
import tensorflow as tf
from tqdm import tqdm

from captioning.data import disk_cache
from captioning.errors import InputError
from captioning.data.feature_cache import encoder_key
from captioning.fileio import disk_full_error
from captioning.data.pipeline import make_dataset
from captioning.data.service import service_error
from captioning.data.integrity import ShardReader
from captioning.model.folder import ModelDir
from captioning.train import distribute
from captioning.train.accumulate import Accumulation
from captioning.train.ema import WeightAverage
from captioning.train.lifecycle import (Gate, Preempted, StepProfiler, StopOnSignal, close_preemption_handler,
                                        end_while_waiting, preemption_handler, quiet_tf_watcher_threads,
                                        replayed_steps, restore_run, service_watch, wait_for_service)
from captioning.train.objectives import RunContext, objective_class
from captioning.train.objectives import resolve as resolve_objectives
from captioning.train.result import NonFiniteError, TrainResult
from captioning.train.optimizer import epoch_plan, make_optimizer
from captioning.train.steps import (Compiled, EvaluationLoss, evaluation_loss, make_multi_step, make_train_step,
                                   steps_in_call)
from captioning.train.summaries import Progress, Sample, Summaries, Window, greedy_samples

log = logging.getLogger("captioning.train")


class Trainer:
    """Builds the strategy, data, model, optimizer and checkpoints for one run; :meth:`run` trains."""

    def __init__(self, experiment, model_dir: str, strategy: tf.distribute.Strategy | None = None,
                 init_from: str | None = None):
        """``experiment``: a :class:`captioning.experiment.Experiment` made for training
        (``captioning.experiment.for_training``: typed, fitted to its objective and data, its dataset open); this
        stage reads its pieces and types nothing again. ``init_from``: another model folder whose latest
        checkpoint's weights a new folder starts from (e.g. SCST from a cross-entropy model); ignored once this
        folder has a checkpoint of its own."""
        self.experiment = experiment
        cfg, self.dataset, self.extractor = experiment.config, experiment.dataset, experiment.extractor
        self.source = experiment.source  # what the model reads (data.features): asked, never tested by name
        self.cfg, self.model_dir = cfg, model_dir
        self.cache_dir = cfg.data.cache_dir or os.path.join(model_dir, "cache")  # data.cache: disk
        # a clear error for a missing split; the eval split only matters when something evaluates
        for split in (cfg.data.train_split,) + ((cfg.data.eval_split,) if cfg.train.eval_every_steps else ()):
            self.dataset.split(split)
        self.vocab = experiment.tokenizer  # data.tokenizer's (captioning.data.tokenizers); the words one: the vocabulary
        self.shards = ShardReader(cfg.data.skip_corrupt)  # the run's shards, checked against the manifest
        self.strategy = strategy or distribute.make_strategy(cfg.distribute)
        self.chief = distribute.is_chief(self.strategy)
        self.folder = ModelDir(model_dir)
        # Everything that can refuse the run comes before anything is written; what is written afterwards
        # is removed again if the run is refused after all (a checkpoint that does not fit).
        previous = self.folder.check_fits(cfg, self.vocab, later=(resolve_objectives,))  # every key, scst's too
        replicas = self.strategy.num_replicas_in_sync
        if cfg.train.batch_size % replicas:
            raise InputError(f"train.batch_size {cfg.train.batch_size} must be a multiple of the "
                             f"{replicas} replicas")
        held = self.source.held_images(self.dataset, cfg.data.train_split)  # regions: the images the store holds
        self.plan = epoch_plan(self.dataset, cfg, replicas, held)
        self.steps_per_epoch = self.plan.steps_per_epoch
        source = ModelDir(init_from) if init_from else None
        if source is not None:
            source.check_source_for(cfg, self.vocab, self.folder)
        if cfg.data.service:  # a dispatcher with a live worker, or one line now (TF would wait forever)
            wait_for_service(cfg.data.service, cfg.data.service_timeout_s)  # a signal meanwhile: Interrupted

        policy = distribute.mixed_precision_policy() if experiment.mixed_precision else "float32"
        if policy != "float32" and not cfg.train.mixed_precision:
            log.info("the model's preset asks for mixed precision: training in %s", policy)
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(cfg.train.seed)
        with self.strategy.scope():
            self.model = experiment.build_model(len(self.vocab))
            self.model.build_all()
            # a fine-tuned encoder learns at train.encoder_lr_scale times the decoder's rate, a fine-tuned language
            # model (prefix_lm) at train.lm_lr_scale times it
            self.optimizer = make_optimizer(cfg.train, self.steps_per_epoch, policy == "mixed_float16",
                                            self.model.encoder.trainable_variables, cfg.train.encoder_lr_scale,
                                            fused=cfg.train.fused_updates, lm=self.model.lm_variables())
            # Keras 3 optimizers must create their slots inside the scope before the first
            # distributed step, or the first step fails on an unfed 'cond' placeholder.
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
            self.average = WeightAverage(self.model, cfg.train.ema_decay, self.strategy,  # train.ema_decay (0: none)
                                         cfg.train.accumulate_steps)
        keras.mixed_precision.set_global_policy("float32")  # the policy only applies while building
        if not self.model.trainable_variables:  # (a vlm with model.vlm_trainable: none and its vision tower frozen)
            raise InputError("every weight of the model is frozen: nothing would train (model.encoder_trainable is "
                             "false and the decoder's settings train none of its own weights)")
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step,
                                              **self.average.checkpoint_items)
        with self.folder.undo_on_refusal():
            self._start(cfg, previous, source)
        self._compiled = Compiled()
        self.accumulation = self._accumulation()  # train.accumulate_steps > 1, else None

    def _start(self, cfg, previous, source) -> None:
        """Takes the folder (the chief writes it: one training run at a time; the other workers write scratch
        folders), makes the objective, and restores where the run starts."""
        model_dir = self.model_dir
        self._lock = self.folder.lock_for_training() if self.chief else None
        if cfg.data.cache in ("disk", "features"):
            disk_cache.check_folder(self.cache_dir)
        self.objective = objective_class(cfg.train.objective).for_run(
            RunContext(cfg, self.step, self.dataset, self.shards, self.folder, self.chief, tokenizer=self.vocab))
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
        restore_run(self.folder, latest, previous, cfg, source, self.model, self.step, self.optimizer)
        if not latest and source is None and self.extractor:  # a new model reading regions pooled by an encoder
            self.source.start_encoder(self.model, self.extractor, ModelDir)
        self.average.start(latest)  # the checkpoint's average, else from the weights the run starts with
        if latest:
            self._saved_step = self.current_step()  # so an interrupted run does not write it again
        if self.chief and self.current_step() < cfg.train.steps:  # a finished folder's record stays as it is
            self.folder.write(self.experiment.record(), self.vocab, step=self.current_step())

    def current_step(self) -> int:
        return int(self.step.numpy())

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self, progress: bool = True) -> TrainResult:
        """Trains to ``train.steps``, or until SIGINT/SIGTERM (then saves; see :mod:`captioning.train`)."""
        cfg = self.cfg.train
        record = TrainResult(step=self.current_step(), replicas=self.strategy.num_replicas_in_sync)
        if record.step >= cfg.steps:
            log.info("already at step %d of %d: nothing to train", record.step, cfg.steps)
            return record
        log.info("training from step %d to %d: %s on %d replica(s), %d steps per epoch", record.step, cfg.steps,
                 self.plan.describe(), self.strategy.num_replicas_in_sync, self.steps_per_epoch)
        dataset = self.distributed_dataset(self.cfg.data.train_split, training=True)
        train_step = self.train_step_for(dataset)
        multi_step = self.multi_step() if cfg.steps_per_execution > 1 else None  # k steps a call
        batches = iter(dataset)
        summaries = Summaries(self.model_dir, self.chief, self.plan.step_captions, self.objective.parts)
        summaries.config(self.experiment.record())
        profiler = StepProfiler(cfg.profile_steps, summaries.train_dir, enabled=self.chief)
        bar = tqdm(total=cfg.steps, initial=record.step, desc="train", unit="step", disable=None if progress else True,
                   mininterval=1.0)
        progress_of_run = Progress(record, summaries, bar, time.perf_counter())
        # under loss scaling an overflowing gradient is the scaler's business: only the loss counts
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        # a signal, or a lost tf.data service, while the loop waits for a batch that does not come: another
        # thread saves the last step and ends the run (not across workers, whose saves need them all)
        gate, save = Gate(), (None if distribute.is_multi_worker(self.strategy) else self.save)

        def when_stuck(name):
            return save is not None and end_while_waiting(
                gate, save, f"interrupted by {name} at step {self.current_step()} while waiting for input: saved "
                            "{checkpoint}; run the same command to resume", 0)

        with StopOnSignal(when_stuck) as stop, quiet_tf_watcher_threads(), service_watch(self.cfg.data, gate, save):
            preemption = preemption_handler(self.strategy, stop, self.save, self.model_dir)
            try:
                while self.current_step() < cfg.steps and (preemption is not None or stop.signal_name is None):
                    profiler.before(self.current_step() + 1)
                    t0, t1, outs = self._call(gate, batches, train_step, multi_step, preemption)  # 1.
                    t2 = time.perf_counter()
                    step = self.current_step()
                    profiler.after(step)
                    # 2. each step's numbers at its own step; a step with a non-finite loss applied no update
                    progress_of_run.account(outs, step, (t0, t1, t2), scaled, cfg.log_every_steps,
                                            self._non_finite_step, self._learning_rate)
                    self._after_call(progress_of_run, step)  # 3.

                # 4. SIGINT/SIGTERM (one worker): the step under way finished; save it and stop.
                if stop.signal_name and preemption is None and self.current_step() < cfg.steps:
                    self.save()
                    record.interrupted = stop.signal_name
            except Preempted:  # every worker saved this step (PreemptionCheckpointHandler's save_fn)
                record.interrupted = stop.signal_name or "another worker's signal"
            finally:
                gate.close()
                profiler.close()
                close_preemption_handler(preemption)
                bar.close()
                summaries.flush()
        record.step = self.current_step()
        if record.interrupted:
            log.info("interrupted by %s at step %d: saved %s", record.interrupted, record.step,
                     os.path.join(self.model_dir, f"ckpt-{record.step}"))
        if self._saved_step is not None:
            record.checkpoint = os.path.join(self.model_dir, f"ckpt-{self._saved_step}")
        return record

    def _call(self, gate, batches, train_step, multi_step, preemption):
        """1. One iteration = ingestion (waiting for the batch) + the train step; with train.steps_per_execution
        > 1, up to that many steps in one call that reads its own batches and never runs past a checkpoint,
        evaluation or profiled step. Under multi-worker, the handler first checks whether any worker was
        signalled; if so, every worker saves at one common step and Preempted ends the loop. Returns the start,
        the end of ingestion and each step's numbers."""
        t0 = time.perf_counter()
        if multi_step is None:
            batch = self.step_batches(gate, batches)  # train.accumulate_steps > 1: a list
            t1 = time.perf_counter()
            out = train_step(batch) if preemption is None else preemption.run(train_step, batch)
            return t0, t1, [{k: float(v) for k, v in out.items()}]  # waits for the device: step time
        gate.hold()
        steps = tf.constant(steps_in_call(self.cfg.train, self.current_step()), tf.int32)
        out = multi_step(batches, steps) if preemption is None else preemption.run(multi_step, batches, steps)
        out = {k: v.numpy() for k, v in out.items()}
        return t0, t0, [{k: float(v[i]) for k, v in out.items()} for i in range(len(out["loss"]))]

    def _after_call(self, run: Progress, step: int) -> None:
        """3. The checkpoint first: whatever fails after it (summaries, evaluation, samples) never loses the steps
        trained. An evaluation step is always saved first."""
        cfg = self.cfg.train
        evaluate = cfg.eval_every_steps and (step % cfg.eval_every_steps == 0 or step == cfg.steps)
        if step % cfg.checkpoint_every_steps == 0 or step == cfg.steps or evaluate:
            log.info("saved %s", self.save())
        if step % cfg.log_every_steps == 0 or step == cfg.steps:
            run.summaries.window(run.window, step, self._learning_rate(step), len(run.record.skipped_steps))
            run.bar.set_postfix(loss=f"{run.window.mean_loss:.3f}")
            run.window = Window()
        if evaluate:
            samples = self.sample_captions(cfg.sample_captions) if self.chief else []
            run.summaries.evaluation(step, self.evaluate_loss(cfg.eval_batches), samples)

    # ---- data ---------------------------------------------------------------------------------------
    @property
    def preprocessor(self):  # the encoder's image preprocessor: the input resizes and crops with it
        return self.model.image_encoder.preprocessor(self.cfg.data.resize_size)

    def _feature_fn(self):
        if self.cfg.data.cache != "features":
            return None, ""
        encode = tf.function(lambda images: self.model.encoder(images, training=False), autograph=False)
        return encode, encoder_key(self.model.encoder)

    def service_job(self) -> str:
        """The tf.data service job of this run (``data.service``): one name for every worker of the run
        (they split its batches), a new one for each run, so a resumed run never joins a finished job."""
        folder = hashlib.sha256(os.path.abspath(self.model_dir).encode()).hexdigest()[:12]
        return f"captioning-{folder}-from-step-{self.current_step()}"

    def distributed_dataset(self, split: str, training: bool):
        cfg = self.cfg
        feature_fn, feature_key = self._feature_fn()
        job = self.service_job() if training and cfg.data.service else None
        replayed = replayed_steps(cfg, self.current_step()) if training else 0  # a resumed run's batches

        def dataset_fn(input_context):
            batch = input_context.get_per_replica_batch_size(cfg.train.batch_size)
            return make_dataset(cfg.data, split, training=training, batch_size=batch, input_context=input_context,
                                feature_fn=feature_fn, feature_key=feature_key, cache_dir=self.cache_dir,
                                dataset=self.dataset, shards=self.shards, service_job=job, preprocessor=self.preprocessor,
                                source=self.source, tokenizer=self.vocab, skip_batches=replayed
                                * (input_context.num_replicas_in_sync // input_context.num_input_pipelines))

        return self.strategy.distribute_datasets_from_function(dataset_fn)

    # ---- steps --------------------------------------------------------------------------------------
    def _train_step(self):
        """The training step for a distributed batch (:func:`make_train_step`): returns the global mean loss,
        the global gradient norm and the global weight (tokens for ``xe``)."""
        jitter = self.cfg.data.color_jitter and self.cfg.data.cache != "features"
        return make_train_step(self.model, self.optimizer, self.strategy, self.objective, self.step,
                               self.cfg.train.clip_gradient_norm, jitter, self.cfg.train.jit_compile,
                               after_update=self.average.after_update)

    def _accumulation(self) -> Accumulation | None:
        """``train.accumulate_steps`` > 1: each optimizer step takes that many micro-batches
        (:mod:`captioning.train.accumulate`)."""
        t, jitter = self.cfg.train, self.cfg.data.color_jitter and self.cfg.data.cache != "features"
        return Accumulation(self.model, self.optimizer, self.strategy, self.objective, self.step, t.clip_gradient_norm,
                            jitter, t.jit_compile, t.accumulate_steps, self.average.after_update) \
            if t.accumulate_steps > 1 else None

    def train_step_for(self, dataset):
        """The training step compiled for batches of ``dataset`` (a distributed dataset); with
        ``train.accumulate_steps`` > 1 it takes a list of that many micro-batches (:meth:`step_batches`)."""
        if self.accumulation is not None:
            return self.accumulation.step_for(dataset)
        return self._compiled(self._train_step, dataset)

    def step_batches(self, gate: Gate, batches):
        """What one optimizer step takes from the iterator ``batches``, each batch waited for through
        ``gate``: the next batch, or the list of ``train.accumulate_steps`` micro-batches."""
        if self.accumulation is None:
            return gate.next(batches)
        return self.accumulation.read(lambda: gate.next(batches))

    def multi_step(self):
        """``train.steps_per_execution`` training steps in one compiled call (:func:`make_multi_step`)."""
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        train_step = self._train_step() if self.accumulation is None else None  # else each reads its micro-batches
        step_from = self.accumulation.step_from if train_step is None else lambda batches: train_step(next(batches))
        return tf.function(make_multi_step(step_from, self.cfg.train.nan_policy == "stop", scaled), autograph=False)

    def evaluate_loss(self, max_batches: int | None = None) -> EvaluationLoss:
        """Mean cross-entropy per real token and perplexity on the eval split (all captions)."""
        dataset = self.distributed_dataset(self.cfg.data.eval_split, training=False)
        return evaluation_loss(self.model, dataset, self.strategy, max_batches, self._compiled)

    def sample_captions(self, count: int) -> list[Sample]:
        """Greedy captions of the first ``count`` eval images, with their first references, the crops the
        model saw and (attention decoder) each word's weights."""
        if count <= 0:
            return []
        cfg = self.cfg.data
        batches = self.source.eval_batches(cfg.eval_split, count, max_images=count, dataset=self.dataset,
                                           shards=self.shards, preprocessor=self.preprocessor)
        return greedy_samples(self.model, self.vocab, next(iter(batches)), self.objective.sample_notes,
                              references=self.dataset.vocabulary())

    # ---- checkpoints and bad numbers -----------------------------------------------------------------
    def save(self) -> str:
        """Saves ``ckpt-<step>`` unless this step is saved already, after checking that the weights are
        finite (NonFiniteError otherwise). Returns its path in the model folder."""
        step = self.current_step()
        path = os.path.join(self.model_dir, f"ckpt-{step}")
        if self._saved_step == step:
            return path
        floats = [v.value for v in self.model.variables if tf.as_dtype(v.dtype).is_floating]
        if not bool(tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in floats]))):
            raise NonFiniteError.at("the model's weights are no longer finite", step, self.folder.latest_checkpoint())
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

    def _learning_rate(self, step: int) -> float:
        rate = self.optimizer.learning_rate
        return float(rate(step)) if callable(rate) else float(rate)

    def _non_finite_step(self, step: int, loss: float, norm: float, skipped: list[int]) -> None:
        what = f"non-finite loss {loss} (gradient norm {norm})"
        if self.cfg.train.nan_policy == "stop":
            raise NonFiniteError.at(what, step, self.folder.latest_checkpoint())
        skipped.append(step)
        log.warning("step %d: %s: batch skipped, no update applied (%d skipped so far)", step, what, len(skipped))


def train(experiment, model_dir: str, progress: bool = True, init_from: str | None = None,
          then=None) -> TrainResult:
    """Configures devices, then trains ``experiment`` (made for training: see :class:`Trainer`; see
    :mod:`captioning.train`); ``then(trainer)`` after a run that ended."""
    cfg = experiment.config
    distribute.configure_devices(cfg.distribute)
    try:
        trainer = Trainer(experiment, model_dir, init_from=init_from)
        # a damaged shard: one line naming it (InputError), not a DataLossError traceback
        with trainer.shards, trainer.shards.named_errors():
            try:
                result = trainer.run(progress=progress)
                if then is not None:
                    then(trainer)
                return result
            finally:
                trainer.folder.release()  # the folder's lock, for a later run of this process or another
    except distribute.PEER_ERRORS as e:  # multi_worker: another worker is gone; one line naming it
        raise distribute.peer_error(e, cfg.distribute) or e from None
    except tf.errors.OpError as e:  # data.service: the dispatcher restarted without this run's job
        raise (service_error(e, cfg.data.service) if cfg.data.service else None) or e from None
