"""The checkpoints in a model folder: the latest complete one, restoring with a check, the leftovers of an
interrupted save. :class:`~captioning.model.folder.ModelDir` has these methods (:class:`CheckpointFiles`);
nothing else knows the files' names.

**The latest complete checkpoint** is the one the ``checkpoint`` state file names. TF writes a
checkpoint's files first (``ckpt-N_temp/``, then renamed into place) and only then replaces the state file
atomically, so the named checkpoint is complete even while a training run writes the next one. A state
file that cannot be parsed, or that names missing files, is an error, never "no checkpoint" (which would
start again from step 0 over the folder). What a killed save left (``ckpt-N_temp/``, files of a newer
step that the state file does not name, TF's temporary state files) is removed at the next training start.

**The weight average** (``train.ema_decay``, :mod:`captioning.train.ema`) is a checkpoint item of its own,
``ema``: for each trainable weight (and batch-norm moving statistic that training moves), its average under the
key of the variable's position in ``model.variables`` (the model's build order, the same in every process;
Keras' generated layer names are not). ``evaluate``, ``caption`` and ``export`` read the average into the model in
place of the raw weights (:meth:`CheckpointFiles.use_weights`, ``--weights ema|raw``): by default when the
checkpoint holds one, a variable without an average (a frozen encoder's; the statistics in a checkpoint written
before they were averaged) keeping its raw value.

**Reading while training writes**: :meth:`~captioning.model.folder.ModelDir.load` restores the latest
checkpoint; if training deletes it in the meantime (``train.keep_checkpoints``), it takes the new latest
one and tries again. A checkpoint whose variables or shapes do not match the model is one line
(:meth:`CheckpointFiles.restore`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

from captioning.errors import InputError

log = logging.getLogger("captioning.model.folder")

STATE = "checkpoint"  # tf.train.CheckpointManager's state file
CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)(_temp|\..+)")  # ckpt-N.index, ckpt-N.data-*, ckpt-N_temp/
STATE_TEMP = re.compile(re.escape(STATE) + r"\.tmp[0-9a-f]{32}")  # TF's atomic_write_string_to_file's
AVERAGE = "ema"  # the checkpoint item of the weight average (captioning.train.ema): {"averages": {"<index>": var}}
AVERAGED = re.compile(re.escape(AVERAGE) + r"/averages/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE")  # one weight's average
WEIGHTS = ("ema", "raw")  # --weights: the average (train.ema_decay), or the weights as trained


def first_line(error: BaseException | str, limit: int = 300) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "…"


def _hide_unrestored_values(record: logging.LogRecord) -> bool:
    """TF's log lines that the model folder's own one-line errors replace: values a failed restore left
    unrestored, and a state file it could not parse ("...: Checkpoint ignored", retried or reported)."""
    message = record.getMessage()
    return not (message.startswith("Value in checkpoint could not be found in the restored object")
                or "is being deleted with unrestored values" in message
                or message.endswith(": Checkpoint ignored") or message.startswith("ParseError: "))


class CheckpointFiles:
    """The checkpoint side of the model folder at ``path`` (see the module docstring)."""

    path: str

    def latest_checkpoint(self) -> str | None:
        """The path of the latest complete checkpoint, or None when the folder has none."""
        import tensorflow as tf

        path = os.path.join(self.path, STATE)
        if not os.path.exists(path):
            return None
        logging.getLogger("tensorflow").addFilter(_hide_unrestored_values)
        damaged = InputError(f"{path} is damaged (not a checkpoint state file); restore it, or delete it to start "
                             "again from step 0")
        # TF replaces the state file atomically, but reads it by the size the *path* has when the read
        # starts: a read that races a training run's rename can come back cut short. So an unparsable read
        # is tried again, and only one that stays unparsable is damage.
        previous, unreadable = None, 0
        for _ in range(20):
            try:
                state = tf.train.get_checkpoint_state(self.path)  # None, not an error, for an unparsable file
            except (ValueError, UnicodeDecodeError, tf.errors.OpError):
                state = None
            if state is None or not state.model_checkpoint_path:
                unreadable += 1
                if unreadable == 5:
                    raise damaged
                time.sleep(0.05)
                continue
            latest = state.model_checkpoint_path  # made absolute by get_checkpoint_state
            if tf.io.gfile.exists(latest + ".index"):
                return latest
            if latest == previous:  # missing, and not because a training run moved on meanwhile
                break
            previous = latest  # a training run saved a newer one and deleted this one since: read again
        raise InputError(f"{path} names {os.path.basename(latest)}, whose files are missing; restore them, or "
                         "delete that state file to start again from step 0")

    def remove_partial_checkpoints(self, latest: str | None) -> list[str]:
        """Deletes what an interrupted save left: ``ckpt-N_temp/`` folders, ``ckpt-N.*`` files that the state
        file does not name, for N above the latest checkpoint's step, and temporary state files
        (``checkpoint.tmp<hex>``). Returns the removed names."""
        import tensorflow as tf

        latest_step = int(latest.rsplit("-", 1)[1]) if latest else -1
        state = tf.train.get_checkpoint_state(self.path) if latest else None
        named = {os.path.basename(p) for p in state.all_model_checkpoint_paths} if state else set()
        removed = []
        for name in sorted(os.listdir(self.path)):
            if STATE_TEMP.fullmatch(name):
                os.remove(os.path.join(self.path, name))
                removed.append(name)
                continue
            match = CHECKPOINT_FILE.fullmatch(name)
            if not match or f"ckpt-{match.group(1)}" in named:
                continue
            if match.group(2) == "_temp":
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
            elif int(match.group(1)) > latest_step:
                os.remove(os.path.join(self.path, name))
            else:
                continue
            removed.append(name)
        if removed:
            log.info("removed the leftovers of an interrupted save: %s", ", ".join(removed))
        return removed

    @staticmethod
    def restore(path: str, strict: dict, lenient: dict | None = None) -> None:
        """Restores ``strict`` objects (e.g. ``{"model": model, "step": step}``) from checkpoint ``path``,
        asserting that every variable of theirs is in it with its shape, then ``lenient`` ones (e.g. the
        optimizer, whose slots may not match after a change) as far as they fit. InputError when the
        checkpoint does not fit or cannot be read."""
        import tensorflow as tf

        # A failed restore's objects log every value they did not restore when they are collected (which
        # may be before or after the error line); the one-line error says it all.
        logging.getLogger("tensorflow").addFilter(_hide_unrestored_values)
        error = None
        try:
            status = tf.train.Checkpoint(**strict).restore(path)
            status.assert_existing_objects_matched().expect_partial()
            if lenient:
                tf.train.Checkpoint(**lenient).restore(path).expect_partial()
        except (AssertionError, ValueError) as e:
            error = InputError(f"{path} does not fit the model this config builds ({first_line(e)}); it was "
                               "trained with other settings (config.yaml, vocab.txt): use a new `model_dir` or that "
                               "folder's config", params=("model_dir",))
        except tf.errors.OpError as e:
            error = InputError(f"cannot read checkpoint {path}: {first_line(e.message)}")
        if error is not None:
            raise error

    @staticmethod
    def averaged(path: str) -> dict[int, str]:
        """The weight average checkpoint ``path`` holds (``train.ema_decay``): each averaged weight's position in
        ``model.variables`` → its name in the checkpoint; empty when it holds none."""
        import tensorflow as tf

        try:
            names = [name for name, _ in tf.train.list_variables(path)]
        except (ValueError, tf.errors.OpError) as e:
            raise InputError(f"cannot read checkpoint {path}: {first_line(e)}") from None
        return {int(m.group(1)): m.group(0) for m in map(AVERAGED.fullmatch, names) if m}

    def use_weights(self, path: str, model, weights: str | None = None) -> str:
        """Puts the weights ``weights`` names into ``model``, restored from checkpoint ``path``: ``"ema"`` their
        average (``train.ema_decay``) in place of each averaged weight, ``"raw"`` leaves them as restored; None:
        ``"ema"`` when the checkpoint holds an average, else ``"raw"``. Returns the choice. InputError (one line)
        for ``"ema"`` and a checkpoint without an average, or an average that does not fit the model."""
        import tensorflow as tf

        averaged = self.averaged(path)
        weights = weights or ("ema" if averaged else "raw")
        if weights not in WEIGHTS:
            raise InputError(f"`weights` {weights!r} is not one of {', '.join(WEIGHTS)}", params=("weights",))
        if weights == "raw":
            return weights
        if not averaged:
            raise InputError(f"{path} holds no weight average (it was trained with train.ema_decay 0): use "
                             "`weights` raw, or train with train.ema_decay above 0", params=("weights",))
        reader, variables = tf.train.load_checkpoint(path), model.variables
        for index, name in sorted(averaged.items()):
            value = reader.get_tensor(name)
            if index >= len(variables) or tuple(variables[index].shape) != value.shape:
                raise InputError(f"the weight average in {path} does not fit the model its folder's config builds "
                                 f"(weight {index}); use `weights` raw", params=("weights",))
            variables[index].assign(value)
        log.info("using the weight average (train.ema_decay) of %s: %d weights", os.path.basename(path), len(averaged))
        return weights
