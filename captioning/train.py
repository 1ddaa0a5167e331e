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
                    ingestion vs step time, sample captions
    logs/eval       validation loss and perplexity

Starting again in the same folder resumes from the latest checkpoint and stops at ``train.steps`` in
total. Iteration time = ingestion time (waiting for the next batch) + train step time, the seeds'
definition; both are logged.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time

import keras
import tensorflow as tf
from tqdm import tqdm

from captioning import config as config_lib
from captioning import distribute, schema
from captioning.decode import beam_search, ids_to_text
from captioning.errors import InputError
from captioning.input_pipeline import eval_images, make_dataset
from captioning.model import ShowAndTell, caption_loss_sum
from captioning.vocab import Vocabulary

log = logging.getLogger("captioning.train")

CONFIG_FILE = "config.yaml"  # the model folder's layout; inference reads it from here
VOCAB_FILE = "vocab.txt"
# Keys that change the variables' shapes. Others (encoder_trainable, dropout, ...) may change between
# runs in one folder: that is how fine-tuning continues from the frozen-encoder checkpoint.
ARCHITECTURE_KEYS = ("encoder", "embedding_size", "lstm_units")


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


def prepare_model_dir(model_dir: str, cfg: config_lib.Config, vocab: Vocabulary,
                      chief: bool) -> config_lib.Config | None:
    """Writes config.yaml and vocab.txt; refuses a folder made for another vocabulary or model shape.
    Returns the folder's previous config, if any."""
    os.makedirs(model_dir, exist_ok=True)
    vocab_path = os.path.join(model_dir, VOCAB_FILE)
    config_path = os.path.join(model_dir, CONFIG_FILE)
    if os.path.exists(vocab_path) and Vocabulary.load(vocab_path) != vocab:
        raise InputError(f"{model_dir} was trained with another vocabulary than {cfg.data.dir}'s; "
                         "use a new --model-dir")
    old = None
    if os.path.exists(config_path):
        old = config_lib.load_config(config_path)
        diff = [k for k in ARCHITECTURE_KEYS if getattr(old.model, k) != getattr(cfg.model, k)]
        if diff:
            raise InputError(f"{model_dir} holds a model with other model.{', model.'.join(diff)}; "
                             "use a new --model-dir or the same model settings")
    if chief:
        vocab.save(vocab_path)
        config_lib.save_config(cfg, config_path)
    return old


class Trainer:
    """Builds the strategy, data, model, optimizer and checkpoints for one run; :meth:`run` trains."""

    def __init__(self, cfg: config_lib.Config, model_dir: str, strategy: tf.distribute.Strategy | None = None):
        config_lib.validate(cfg)
        self.cfg, self.model_dir = cfg, model_dir
        self.manifest = schema.read_manifest(cfg.data.dir)
        for split in (cfg.data.train_split, cfg.data.eval_split):
            schema.split_files(cfg.data.dir, self.manifest, split)  # clear error for a missing split
        self.vocab = Vocabulary.load(os.path.join(cfg.data.dir, schema.VOCAB))
        self.strategy = strategy or distribute.make_strategy(cfg.distribute)
        self.chief = distribute.is_chief(self.strategy)
        previous = prepare_model_dir(model_dir, cfg, self.vocab, self.chief)
        replicas = self.strategy.num_replicas_in_sync
        if cfg.train.batch_size % replicas:
            raise InputError(f"train.batch_size {cfg.train.batch_size} must be a multiple of the "
                             f"{replicas} replicas")
        self.steps_per_epoch = max(1, examples_per_epoch(self.manifest, cfg) // cfg.train.batch_size)

        policy = distribute.mixed_precision_policy() if cfg.train.mixed_precision else "float32"
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(cfg.train.seed)
        with self.strategy.scope():
            self.model = ShowAndTell(len(self.vocab), cfg.model, cfg.data.image_size, seed=cfg.train.seed)
            self.model.build_all()
            self.optimizer = make_optimizer(cfg.train, self.steps_per_epoch, policy == "mixed_float16")
            # Keras 3 optimizers must create their slots inside the scope before the first
            # distributed step, or the first step fails on an unfed 'cond' placeholder.
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        keras.mixed_precision.set_global_policy("float32")  # the policy only applies while building

        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        write_dir = model_dir if self.chief else os.path.join(model_dir, f".tmp-{distribute.worker_id(self.strategy)}")
        self.manager = tf.train.CheckpointManager(self.checkpoint, write_dir, max_to_keep=cfg.train.keep_checkpoints,
                                                  checkpoint_name="ckpt", step_counter=self.step)
        latest = tf.train.latest_checkpoint(model_dir)
        if latest and previous is not None and previous.model.encoder_trainable != cfg.model.encoder_trainable:
            # Keras optimizers track their variables by position, so when the set of trained variables
            # changes (fine-tuning the encoder after training with it frozen) the saved optimizer state
            # no longer lines up: restore the model and the step, and start the optimizer afresh.
            tf.train.Checkpoint(model=self.model, step=self.step).restore(latest).expect_partial()
            log.info("resumed the model from %s at step %d with a new optimizer (model.encoder_trainable "
                     "changed)", latest, int(self.step.numpy()))
        elif latest:
            self.checkpoint.restore(latest).expect_partial()
            log.info("resumed from %s at step %d", latest, int(self.step.numpy()))
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
            cache_path = os.path.join(cfg.data.cache_dir or os.path.join(self.model_dir, "cache"),
                                      f"{split}-{input_context.input_pipeline_id}")
            return make_dataset(cfg.data, split, training=training, batch_size=batch, input_context=input_context,
                                feature_fn=self._feature_fn(), cache_path=cache_path)

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

        def replica_step(batch):
            ctx = tf.distribute.get_replica_context()
            tokens = tf.reduce_sum(batch["mask"])
            global_tokens = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tokens)
            variables = model.trainable_variables
            with tf.GradientTape() as tape:
                loss_sum = caption_loss_sum(self.model, batch, training=True)
                loss = loss_sum / tf.maximum(global_tokens, 1.0)
                if scaled:
                    loss = optimizer.scale_loss(loss)
            # Dense gradients (the embedding's arrive as IndexedSlices): they are all-reduced and scaled.
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
            grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)  # the global gradient, on every replica
            if scaled:
                grads = [g / optimizer.dynamic_scale for g in grads]
            norm = tf.linalg.global_norm(grads)
            if clip > 0:
                grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)
            share = 1.0 / ctx.num_replicas_in_sync  # optimizer.apply sums over replicas again
            if scaled:
                share = share * optimizer.dynamic_scale
            optimizer.apply([g * share for g in grads], variables)
            return loss_sum, tokens, norm

        def train_step(batch):
            loss_sum, tokens, norm = strategy.run(replica_step, args=(batch,))
            self.step.assign_add(1)
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, loss_sum, axis=None)
            count = strategy.reduce(tf.distribute.ReduceOp.SUM, tokens, axis=None)
            return total / tf.maximum(count, 1.0), strategy.experimental_local_results(norm)[0], count

        return train_step

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
        path = self.manager.save(checkpoint_number=int(self.step.numpy()))
        if not self.chief:  # other workers write to a scratch folder, only for the collective ops
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return path

    def run(self, progress: bool = True) -> dict:
        """Trains to ``train.steps``. Returns ``{"step", "trained_steps", "losses", "ingestion_s", "step_s"}``:
        the last two are each iteration's time waiting for the batch and running the step, in seconds."""
        cfg = self.cfg.train
        start = int(self.step.numpy())
        if start >= cfg.steps:
            log.info("already at step %d of %d: nothing to train", start, cfg.steps)
            return {"step": start, "trained_steps": 0, "losses": [], "ingestion_s": [], "step_s": []}
        log.info("training from step %d to %d: global batch %d on %d replica(s), %d steps per epoch",
                 start, cfg.steps, cfg.batch_size, self.strategy.num_replicas_in_sync, self.steps_per_epoch)
        logs = os.path.join(self.model_dir, "logs")
        writer = tf.summary.create_file_writer(os.path.join(logs, "train")) if self.chief else tf.summary.create_noop_writer()
        eval_writer = tf.summary.create_file_writer(os.path.join(logs, "eval")) if self.chief else tf.summary.create_noop_writer()
        dataset = self.distributed_dataset(self.cfg.data.train_split, training=True)
        train_step = self.train_step_for(dataset)
        iterator = iter(dataset)
        window = {"loss": 0.0, "tokens": 0.0, "ingest": 0.0, "step": 0.0, "n": 0, "norm": 0.0}
        history, ingestion_s, step_s = [], [], []
        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=None if progress else True,
                   mininterval=1.0)
        result = {"step": start, "trained_steps": 0}
        try:
            while int(self.step.numpy()) < cfg.steps:
                t0 = time.perf_counter()
                batch = next(iterator)
                t1 = time.perf_counter()
                loss, norm, tokens = train_step(batch)
                loss = float(loss)  # waits for the step: step time includes the device work
                t2 = time.perf_counter()
                step = int(self.step.numpy())
                history.append(loss)
                ingestion_s.append(t1 - t0)
                step_s.append(t2 - t1)
                window["loss"] += loss * float(tokens)
                window["tokens"] += float(tokens)
                window["ingest"] += t1 - t0
                window["step"] += t2 - t1
                window["norm"] += float(norm)
                window["n"] += 1
                bar.update(1)
                if step % cfg.log_every_steps == 0 or step == cfg.steps:
                    self._log_window(writer, window, step)
                    bar.set_postfix(loss=f"{window['loss'] / max(window['tokens'], 1):.3f}")
                    window = dict.fromkeys(window, 0.0)
                    window["n"] = 0
                if cfg.eval_every_steps and (step % cfg.eval_every_steps == 0 or step == cfg.steps):
                    self._evaluate(eval_writer, writer, step)
                if step % cfg.checkpoint_every_steps == 0 or step == cfg.steps:
                    log.info("saved %s", self.save())
        finally:
            bar.close()
            writer.flush()
            eval_writer.flush()
        result.update(step=int(self.step.numpy()), trained_steps=len(history), losses=history,
                      ingestion_s=ingestion_s, step_s=step_s)
        return result

    def _log_window(self, writer, window, step: int) -> None:
        n = max(window["n"], 1)
        loss = window["loss"] / max(window["tokens"], 1.0)
        iteration = (window["ingest"] + window["step"]) / n
        examples_per_s = self.cfg.train.batch_size * n / max(window["ingest"] + window["step"], 1e-9)
        lr = float(self.optimizer.learning_rate) if not callable(self.optimizer.learning_rate) else \
            float(self.optimizer.learning_rate(self.step))
        with writer.as_default(step=step):
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("perplexity", math.exp(min(loss, 50.0)))
            tf.summary.scalar("learning_rate", lr)
            tf.summary.scalar("gradient_norm", window["norm"] / n)
            tf.summary.scalar("examples_per_second", examples_per_s)
            tf.summary.scalar("time/ingestion_ms", 1000 * window["ingest"] / n)
            tf.summary.scalar("time/train_step_ms", 1000 * window["step"] / n)
            tf.summary.scalar("time/ingestion_share", window["ingest"] / n / max(iteration, 1e-9))
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
    return Trainer(cfg, model_dir).run(progress=progress)
