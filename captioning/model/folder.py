"""The model folder: what ``train`` writes and ``evaluate``, ``caption`` and ``export`` read.

Nobody else knows its file names or its rules; everything goes through :class:`ModelDir`::

    config.yaml       the resolved config of the latest training run: every key, paths absolute
    history.yaml      each training run that changed config.yaml: the step it started at, its config
    vocab.txt         the vocabulary (line i is id i), or tokenizer/, a language model's (captioning.data.tokenizers)
    checkpoint        TF's state file: names the latest complete checkpoint, written last, atomically
    ckpt-<step>.*     checkpoints (model, optimizer, step; with train.ema_decay the weights' average, ema)
    logs/             TensorBoard: train; eval, the validation during training; eval_<split>, evaluate
    eval/             evaluate's results, one file per (split, checkpoint, decoding, images)
    cache/            data.cache: disk's and features' files, unless data.cache_dir says elsewhere
    cider_document_frequencies.npz   train.objective: scst — the training references' n-gram document
                      frequencies for the CIDEr-D reward, computed at the first SCST start
                      (captioning.train.document_frequencies owns the format)
    training.lock     locked by the training run writing here (one at a time: :meth:`ModelDir.lock_for_training`)

The checkpoints' rules — the latest complete checkpoint, restoring with a check, removing what an
interrupted save left, reading while training writes — are :mod:`captioning.model.checkpoints`, whose
methods :class:`ModelDir` has.

**Damaged files** are one line naming the file: a ``config.yaml`` that is not YAML, is not a config, or
lacks keys (cut short: this project writes every key); a ``vocab.txt`` that is not UTF-8 or not a
vocabulary; a damaged ``checkpoint`` state file; a checkpoint whose variables or shapes do not match
what ``config.yaml`` and ``vocab.txt`` describe.

**A saved config's sections**: the model stage types the shared sections and the decoder's settings
(``captioning.model.resolve``); an objective's section (``scst:``) stays as written
(:class:`captioning.config.ComponentSection`): ``evaluate``, ``caption`` and ``export`` read no objective's
settings. Training types it too (``later`` of :meth:`ModelDir.check_fits`), so a key missing there stops
``train`` as damage like any other.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
from dataclasses import dataclass

from captioning import config as config_lib
from captioning.errors import InputError
from captioning.fileio import atomic_write_text, make_dirs, refuse_inputs
from captioning.data.tokenizers import as_tokenizer, choose, load_tokenizer, preset as preset_tokenizer
from captioning.model.checkpoints import CHECKPOINT_FILE, STATE_TEMP, STATE, CheckpointFiles
from captioning.vocab import Vocabulary

log = logging.getLogger("captioning.model.folder")

CONFIG = "config.yaml"
HISTORY = "history.yaml"
VOCAB = "vocab.txt"
LOCK = "training.lock"  # held by the training run writing into the folder
DOCUMENT_FREQUENCIES = "cider_document_frequencies.npz"  # scst's reward (captioning.train.document_frequencies)
# what a run creates in the folder besides checkpoints (all of it removed again when the run is refused)
TOKENIZER = preset_tokenizer.FOLDER  # a language model's tokenizer (data.tokenizer: preset), instead of vocab.txt
OWN_NAMES = frozenset({CONFIG, HISTORY, VOCAB, TOKENIZER, LOCK, DOCUMENT_FREQUENCIES, "logs", "cache", "eval"})


def read_folders(cfg: config_lib.Config, whose: str = "", data: bool = False) -> dict[str, str]:
    """The folders a model of ``cfg`` is built from, ``{folder: what it is}``, where no output may lie (refuse_inputs):
    a preset folder a path setting of the encoder or decoder names (``model.encoder_preset``, ``model.decoder_preset``,
    absolute in config.yaml), with ``data`` the prepared dataset. ``whose``: words after the setting's name."""
    from captioning.model import decoder_class, encoder_class

    folders, model = {}, cfg.model
    for cls, settings in ((encoder_class(model.encoder), model.encoder_settings),
                          (decoder_class(model.decoder), model.decoder_settings)):
        for key in getattr(cls, "path_keys", ()):
            value = getattr(settings, key) if model.typed else model.options.get(key)
            if value and os.path.isdir(value):
                folders[value] = f"model.{key}{' ' + whose if whose else ','}"
    folders.update({cfg.data.dir: "the prepared dataset"} if data and cfg.data.dir else {})
    return folders


def _architecture_diff(old: config_lib.Config, cfg: config_lib.Config) -> list[str]:
    """:func:`captioning.model.architecture_diff` of ``old`` and ``cfg``, asking ``cfg``'s data source."""
    from captioning.model import architecture_diff
    from captioning.model.data_sources import data_source

    return architecture_diff(old, cfg, data_source(cfg))


@dataclass
class TrainedModel:
    """A model restored from a model folder, with what it was trained with."""

    model: object  # a captioning.model.CaptionModel
    config: config_lib.Config
    vocab: Vocabulary  # its tokenizer (captioning.data.tokenizers: the words one is a Vocabulary)
    step: int
    checkpoint: str
    model_dir: str
    weights: str = "raw"  # "ema": the checkpoint's weight average (train.ema_decay) in place of its raw weights

    @property
    def members(self) -> list["TrainedModel"]:
        """The trained models it is made of: itself (an ensemble, :mod:`captioning.model.ensemble`, has
        several)."""
        return [self]

    @property
    def preprocessor(self):
        """Its encoder's image preprocessor at its data's sizes (:mod:`captioning.data.preprocessor`): the crop it
        captions, as it was trained and evaluated on."""
        return self.model.image_encoder.preprocessor(self.config.data.resize_size)


class ModelDir(CheckpointFiles):
    """One model folder (see the module docstring). Reading methods raise :class:`InputError` naming the
    file when something is damaged."""

    def __init__(self, path: str):
        self.path = path

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def vocab_file(self) -> str:
        return self.file(VOCAB)

    @property
    def config_file(self) -> str:
        return self.file(CONFIG)

    @property
    def document_frequencies_file(self) -> str:
        return self.file(DOCUMENT_FREQUENCIES)

    def owns(self, path: str) -> bool:
        """Whether ``path`` is (or lies inside) one of this folder's own files: its config, vocabulary,
        history, checkpoints and their state file, logs, evaluation results, caches, lock. Only ``train``
        (and ``evaluate``, for its results) writes those; any other output there is refused."""
        folder, real = os.path.realpath(self.path), os.path.realpath(path)
        if not real.startswith(folder.rstrip(os.sep) + os.sep):
            return False
        first = os.path.relpath(real, folder).split(os.sep)[0]
        return (first in OWN_NAMES or first == STATE or first == ".preemption" or first.startswith(".tmp-")
                or bool(CHECKPOINT_FILE.fullmatch(first)) or bool(STATE_TEMP.fullmatch(first)))

    def owns_checkpoint(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` (a path prefix, ``…/ckpt-N``) lies in this folder."""
        return os.path.realpath(os.path.dirname(checkpoint) or ".") == os.path.realpath(self.path)

    def check_foreign_checkpoint(self, checkpoint: str, cfg: config_lib.Config, vocab: Vocabulary) -> None:
        """A checkpoint of another model folder is read only when that folder's config.yaml and vocab.txt say
        it is this model: the same vocabulary and architecture (else its weights, decoded with this
        vocabulary, would give garbled captions under this folder's name). InputError naming
        ``checkpoint`` otherwise; a log line when it fits."""
        other = ModelDir(os.path.dirname(checkpoint) or ".")
        def refuse(why):
            return InputError(f"`checkpoint` {checkpoint} is not of the model folder {self.path} and {why}",
                              params=("checkpoint",))

        try:
            old, old_vocab = other.read_config(), other.read_vocab()
        except InputError as e:
            raise refuse(f"its folder's files cannot be read ({e})") from None
        if old is None or old_vocab is None:
            raise refuse(f"its folder {other.path} has no config.yaml and vocab.txt to tell what it was trained with")
        if old_vocab != vocab:
            raise refuse(f"was trained with another vocabulary ({len(old_vocab)} words against {len(vocab)})")
        diff = _architecture_diff(old, cfg)
        if diff:
            raise refuse(f"holds a model with other {', '.join(diff)}")
        log.info("checkpoint %s is of another model folder, %s, with the same vocabulary and architecture", checkpoint,
                 other.path)

    def refuse_output(self, path: str, what: str, params: tuple[str, ...] = (), data: bool = False,
                      data_dir: str | None = None) -> None:
        """An InputError naming ``what`` when ``path`` is one of this folder's own files (:meth:`owns`) or
        lies in a folder its model is built from (:meth:`read_folders`: a keras-hub preset; with ``data``,
        the command reads the prepared dataset too: ``data_dir``, or config.yaml's ``data.dir``). A new name
        inside the model folder is no input of any command (``caption --html MODEL/gallery.html``)."""
        if self.owns(path):
            raise InputError(f"{what} {path} is a file of the model folder {self.path}, which only `captioning train` "
                             "writes; give a file name outside it, or a new name", params=params)
        refuse_inputs(path, what, params, read_folders=self.read_folders(data, data_dir))

    def read_folders(self, data: bool = False, data_dir: str | None = None) -> dict[str, str]:
        """:func:`read_folders` of config.yaml (empty for a folder without a readable one: the command's own
        load says why)."""
        try:
            cfg = self.read_config() if os.path.isdir(self.path) else None
        except InputError:
            cfg = None
        folders = read_folders(cfg, f"of {self.path},") if cfg is not None else {}
        if data and (data_dir or cfg is not None):
            folders[data_dir or cfg.data.dir] = "the prepared dataset"
        return folders

    def checkpoint(self, step: int) -> str:
        """The path (prefix) of the checkpoint of ``step``, as training names it."""
        return self.file(f"ckpt-{step}")

    # ---- reading ------------------------------------------------------------------------------------
    def read_config(self, later: tuple = ()) -> config_lib.Config | None:
        """The folder's config.yaml (None when there is none); damaged or cut short: InputError. ``later``:
        a later stage's functions that type the sections it owns (``captioning.train.objectives.resolve``),
        each called with ``complete=True``, so that a key missing there is damage too."""
        path = self.file(CONFIG)
        if not os.path.exists(path):
            return None
        from captioning.model import resolve

        try:
            cfg = resolve(config_lib.load_config(path, complete=True), complete=True)
            for typed in later:
                cfg = typed(cfg, complete=True)
            return cfg
        except InputError as e:
            raise InputError(f"{path} is damaged: {e}; restore it, or use a new model folder") from None

    def read_vocab(self) -> Vocabulary | None:  # its tokenizer (tokenizer/, or vocab.txt), None, or InputError
        return load_tokenizer(self.path)

    @staticmethod
    def tokenizer_file(cfg: config_lib.Config | None) -> str:
        """The tokenizer's file a folder of ``cfg`` keeps: ``vocab.txt``, or ``tokenizer`` (a folder)."""
        from captioning.model import decoder_class
        model = cfg.model if cfg is not None and cfg.model.typed else None
        preset = model and decoder_class(model.decoder).tokenizer_preset(model.decoder_settings)
        return TOKENIZER if model and choose(cfg.data.tokenizer, preset, model.decoder) == "preset" else VOCAB

    def require_trained(self) -> tuple[config_lib.Config, Vocabulary]:
        """config.yaml and vocab.txt (or tokenizer/) of a folder that ``train`` wrote (InputError otherwise)."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise InputError(f"{self.path} is a file, not a model folder")
        cfg, vocab = self.read_config(), self.read_vocab()
        for name, value in ((CONFIG, cfg), (self.tokenizer_file(cfg), vocab)):
            if value is None:
                raise InputError(f"{self.path} is not a model folder: {name} is missing (train a model there first)")
        return cfg, vocab

    # ---- training's checks and writes ------------------------------------------------------------------
    def check_fits(self, cfg: config_lib.Config, vocab: Vocabulary, later: tuple = ()) -> config_lib.Config | None:
        """Refuses (InputError) a folder made for another vocabulary or model shape, one with checkpoints but
        without the config or vocabulary they were trained with, and a path that is a file. Returns the
        folder's config, if any (``later``: as :meth:`read_config`). Writes nothing (:meth:`lock_for_training`
        creates the folder)."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise InputError(f"model folder {self.path} is a file, not a folder")
        if os.path.exists(self.file(STATE)):
            kept = next((n for n in (VOCAB, TOKENIZER) if os.path.exists(self.file(n))), self.tokenizer_file(cfg))
            for name in (CONFIG, kept):
                if not os.path.exists(self.file(name)):
                    raise InputError(f"{self.path} holds checkpoints but no {name}, so what they were trained with "
                                     f"is unknown; put its {name} back or use a new --model-dir")
        old_vocab = self.read_vocab()
        if old_vocab is not None and old_vocab != vocab and not isinstance(vocab, type(old_vocab)):  # preset's
            raise InputError(f"{self.path} was trained with another tokenizer ({old_vocab.identity}); use a new --model-dir")
        if old_vocab is not None and old_vocab != vocab:
            raise InputError(f"{self.file(VOCAB)} ({len(old_vocab)} words) is not the vocabulary of {cfg.data.dir} "
                             f"({len(vocab)} words): {self.path} was trained with another vocabulary, or that file "
                             "is damaged; use a new --model-dir")
        old = self.read_config(later)
        if old is not None:
            diff = _architecture_diff(old, cfg)
            if diff:
                raise InputError(f"{self.path} holds a model with other {', '.join(diff)}; "
                                 "use a new `model_dir` or the same model settings", params=("model_dir",))
        return old

    def check_source_for(self, cfg: config_lib.Config, vocab: Vocabulary, target: "ModelDir") -> None:
        """Refuses (InputError naming ``init_from``) this folder as the starting weights of a model of
        ``cfg`` and ``vocab`` in ``target``: it must be another folder, hold a complete checkpoint, and
        have the same vocabulary and architecture."""
        def refuse(why):
            return InputError(f"`init_from` {self.path} {why}", params=("init_from",))

        if os.path.realpath(self.path) == os.path.realpath(target.path):
            raise refuse("is the model folder itself; it resumes on its own")
        if not os.path.isdir(self.path) or not self.latest_checkpoint():
            raise refuse("holds no trained model (no checkpoint)")
        old, old_vocab = self.read_config(), self.read_vocab()
        if old is None or old_vocab is None:
            raise refuse("lacks its config.yaml or vocab.txt")
        if old_vocab != vocab:
            raise refuse(f"was trained with another vocabulary than {cfg.data.dir}")
        diff = _architecture_diff(old, cfg)
        if diff:
            raise refuse(f"holds a model with other {', '.join(diff)}")

    def write(self, record: dict, vocab: Vocabulary, step: int) -> None:
        """Records the config a training run starting at ``step`` uses — ``record``, the experiment's own
        (``captioning.experiment.Experiment.record``: every key, paths absolute) — and the vocabulary, each
        atomically. When config.yaml held another config, history.yaml keeps it: every run that changed the
        config, with the step it started at. The configs are compared as written (an objective's section is
        typed in the record and as written in the folder's)."""
        import yaml

        try:
            old = self.read_config()
            if old is None or config_lib.to_dict(old) != record:
                history = []
                if os.path.exists(self.file(HISTORY)):
                    with open(self.file(HISTORY), encoding="utf-8") as f:
                        history = yaml.safe_load(f) or []
                if not history and old is not None:  # a folder from before history.yaml: keep what it had
                    history.append({"started_at_step": None, "config": config_lib.to_dict(old)})
                history.append({"started_at_step": step, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                                "config": record})
                atomic_write_text(self.file(HISTORY), yaml.safe_dump(history, sort_keys=False))
            as_tokenizer(vocab).save_to(self.path)
            config_lib.save_record(record, self.file(CONFIG))
        except OSError as e:
            from captioning.fileio import disk_full_error

            raise disk_full_error(e, self.path, "the model folder's config") or InputError(
                f"cannot write to the model folder {self.path}: {e.strerror or e}") from None

    def lock_for_training(self) -> int | None:
        """Takes the folder for one training run: an exclusive POSIX lock on ``training.lock``, held as long
        as the returned descriptor stays open (the run's lifetime; the kernel drops it when the process
        dies, however it dies). A second ``train`` in the same folder is an InputError naming the first's
        process id, instead of two runs overwriting each other's checkpoints. (POSIX locks belong to the
        process, so several Trainers of one process do not exclude each other.) None where there are no
        POSIX locks (Windows)."""
        make_dirs(self.path, "model folder")
        try:
            import fcntl
        except ImportError:
            return None
        fd = os.open(self.file(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise InputError(f"another `captioning train` (process {holder}) is training in {self.path}: wait for it "
                             "to end or stop it; two runs would overwrite each other's checkpoints") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.lock_fd = fd
        return fd

    def release(self) -> None:
        """Gives up :meth:`lock_for_training`'s lock (a process that goes on after its run)."""
        if getattr(self, "lock_fd", None) is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    @contextlib.contextmanager
    def undo_on_refusal(self):
        """A training run's start: if an :class:`InputError` refuses the run inside the block (a checkpoint
        that does not fit, another run training there), what the block created here is removed again —
        the folder itself when it did not exist, else the files of this folder's own names that were not
        there — and the lock released, so a refused run leaves the disk as it found it."""
        existed = os.path.isdir(self.path)
        before = set(os.listdir(self.path)) if existed else set()
        try:
            yield
        except InputError:
            self.release()
            created = (set(os.listdir(self.path)) if os.path.isdir(self.path) else set()) - before
            for name in created & OWN_NAMES:
                path = self.file(name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            if not existed and os.path.isdir(self.path) and not os.listdir(self.path):
                os.rmdir(self.path)
            raise

    # ---- restoring ---------------------------------------------------------------------------------------
    def load(self, checkpoint: str | None = None, attempts: int = 5, weights: str | None = None) -> TrainedModel:
        """The trained model at ``checkpoint`` (default: the latest complete one), rebuilt from config.yaml
        and vocab.txt, holding the ``weights`` it names (:meth:`use_weights`: ``"ema"``, the weight average;
        ``"raw"``; None: the average when the checkpoint has one). The encoder is built without its pretrained
        weights (the checkpoint has the trained ones), so loading never downloads. While a training run writes
        into the folder, a latest checkpoint deleted before it could be read is replaced by the new latest (up to
        ``attempts`` times)."""

        import tensorflow as tf

        from captioning.model import build_model
        from captioning.model.data_sources import data_source

        cfg, vocab = self.require_trained()
        if checkpoint and not self.owns_checkpoint(checkpoint):
            self.check_foreign_checkpoint(checkpoint, cfg, vocab)
        model = build_model(len(vocab), cfg.model, cfg.data.image_size, restoring=True,
                            source=data_source(cfg)).build_all()
        step = tf.Variable(0, dtype=tf.int64)
        for attempt in range(attempts):
            path = checkpoint or self.latest_checkpoint()
            if not path:
                raise InputError(f"{self.path} holds no checkpoint yet (ckpt-<step>): train first")
            try:
                self.restore(path, {"model": model, "step": step})
                weights = self.use_weights(path, model, weights)
                break
            except InputError:
                if checkpoint or attempt == attempts - 1 or self.latest_checkpoint() == path:
                    raise
                log.info("%s was replaced by a newer checkpoint while it was read; reading the newer one", path)
        log.info("restored %s (step %d)", path, int(step.numpy()))
        return TrainedModel(model, cfg, vocab, int(step.numpy()), path, self.path, weights)
